"""Reconciliation of an estimate with allocator readings (memory ledger).

Compares like with like: the estimate's tensor peak against ``allocated`` (``max_memory_allocated``),
``reserved`` against ``allocated`` at the same moment, and the budget left under ``capacity``. Each
signal fires when its difference passes ``alert_fraction`` (10 %, as in the seed). Differences keep
their sign: an allocator reading below the estimate stays negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InputError

ALERT_FRACTION = 0.10
SIGNALS = ("inspect_estimate_difference", "inspect_allocator_retained_space", "capacity_pressure")


@dataclass(frozen=True)
class Reconciliation:
    estimate_difference_bytes: int  # allocated − estimate (signed)
    allocator_gap_bytes: int  # reserved − allocated
    budget_margin_bytes: int  # capacity − reserved
    signals: tuple[str, ...]
    alert_fraction: float = ALERT_FRACTION

    def to_json(self) -> dict[str, object]:
        return {
            "estimate_difference_bytes": self.estimate_difference_bytes,
            "allocator_gap_bytes": self.allocator_gap_bytes,
            "budget_margin_bytes": self.budget_margin_bytes,
            "signals": list(self.signals),
            "alert_fraction": self.alert_fraction,
        }


def reconcile(
    estimate_bytes: float,
    allocated_bytes: float,
    reserved_bytes: float,
    capacity_bytes: float,
    alert_fraction: float = ALERT_FRACTION,
) -> Reconciliation:
    """Seed 004's ``reconcile_memory_record`` in bytes, with the same validation."""
    values = {
        "estimate": estimate_bytes,
        "allocated": allocated_bytes,
        "reserved": reserved_bytes,
        "capacity": capacity_bytes,
    }
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InputError(name, f"must be a finite, non-negative number of bytes, got {value!r}")
    if capacity_bytes <= 0:
        raise InputError("capacity", "must be positive")
    if not allocated_bytes <= reserved_bytes <= capacity_bytes:
        raise InputError("reserved", "readings must satisfy allocated <= reserved <= capacity")
    difference = allocated_bytes - estimate_bytes
    gap = reserved_bytes - allocated_bytes
    margin = capacity_bytes - reserved_bytes
    signals = []
    if difference > estimate_bytes * alert_fraction:
        signals.append(SIGNALS[0])
    if gap > capacity_bytes * alert_fraction:
        signals.append(SIGNALS[1])
    if margin < capacity_bytes * alert_fraction:
        signals.append(SIGNALS[2])
    return Reconciliation(round(difference), round(gap), round(margin), tuple(signals), alert_fraction)

"""The phase ledger (memory ledger): memory objects × phases, the peak phase and its dominant object.

Rules (memory ledger): sizes are non-negative integers; the load phase holds parameters only
(plus the device overheads); a phase total is the sum of the objects live at that phase's peak; the
peak is the largest phase total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import MemcalcError
from .setup import TrainingSetup
from .vocab import OBJECTS, OVERHEAD_OBJECTS, PHASES, TENSOR_OBJECTS, UNIFIED_OBJECTS

SCHEMA = 1


class LedgerError(MemcalcError):
    """A ledger broke one of memory ledger's rules (a bug in an estimator, never user input)."""


@dataclass(frozen=True)
class PhaseLedger:
    """The bytes of each memory object live at one phase's peak."""

    phase: str
    objects: dict[str, int]

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise LedgerError(f"unknown phase {self.phase!r}")
        unknown = set(self.objects) - set(OBJECTS)
        if unknown:
            raise LedgerError(f"unknown memory objects {sorted(unknown)}")
        for name in OBJECTS:
            value = self.objects.setdefault(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LedgerError(f"{self.phase}.{name} must be a non-negative integer, got {value!r}")
        ordered = {name: self.objects[name] for name in OBJECTS}  # one order everywhere: JSON diffs between runs
        self.objects.clear()
        self.objects.update(ordered)
        if self.phase == "load":  # the model, and the gradient buckets a wrapper makes as it wraps it (DDP's)
            extra = [n for n in TENSOR_OBJECTS if n not in ("parameters", "gradients") and self.objects[n]]
            if extra:
                raise LedgerError(f"load holds only parameters and gradient buckets, not {extra}")

    @property
    def total_bytes(self) -> int:
        return sum(self.objects.values())

    @property
    def tensor_bytes(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` would show for this phase."""
        return sum(self.objects[n] for n in TENSOR_OBJECTS)

    @property
    def dominant_object(self) -> str:
        return max(OBJECTS, key=lambda n: self.objects[n])


def with_overheads(tensor_objects: dict[str, int], phase: str, setup: TrainingSetup) -> PhaseLedger:
    """Add the CUDA context and the allocator reserve (a fraction of the phase's tensor bytes)."""
    objects = dict(tensor_objects)
    tensor_total = sum(v for k, v in objects.items() if k in TENSOR_OBJECTS)  # the allocator's blocks only
    objects["cuda_context"] = setup.cuda_context_bytes
    objects["allocator_reserve"] = round(tensor_total * setup.allocator_reserve)
    return PhaseLedger(phase, objects)


@dataclass(frozen=True)
class Estimate:
    """The result of one estimate: a ledger per phase, with what it assumed."""

    setup: TrainingSetup
    method: str
    phases: dict[str, PhaseLedger]
    assumptions: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if tuple(self.phases) != PHASES:
            raise LedgerError(f"phases must be {PHASES}, got {tuple(self.phases)}")

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=lambda p: self.phases[p].total_bytes)

    @property
    def peak(self) -> PhaseLedger:
        return self.phases[self.peak_phase]

    @property
    def peak_bytes(self) -> int:
        return self.peak.total_bytes

    @property
    def peak_tensor_bytes(self) -> int:
        """The peak of tensor objects alone (``torch.cuda.max_memory_allocated``)."""
        return max(p.tensor_bytes for p in self.phases.values())

    @property
    def dominant_object(self) -> str:
        return self.peak.dominant_object

    @property
    def overhead_bytes(self) -> int:
        return sum(self.peak.objects[n] for n in OVERHEAD_OBJECTS)

    def object_bytes(self, name: str) -> dict[str, int]:
        """One object's bytes across the phases."""
        return {p: self.phases[p].objects[name] for p in PHASES}


def shown_objects(estimate: Estimate) -> tuple[str, ...]:
    """The ledger rows a table lists: every object, the paged optimizer state only when the setup has one."""
    return tuple(o for o in OBJECTS if o not in UNIFIED_OBJECTS or any(estimate.object_bytes(o).values()))


#: The name of the parameters sub-row that holds autocast's 16-bit weight copies (live from forward to backward).
COPIES_ROW = "autocast copies"


def parameter_rows(estimate: Estimate) -> list[tuple[str, dict[str, int]]]:
    """The parameters object of a fine-tuning estimate split into what the window's and the report's sub-rows list:
    each stored part (``details["parameter_split"]``: trainable adapters, frozen or quantized base) in every phase,
    and the rest of the phase's parameters object, autocast's 16-bit copies. Empty for full fine-tuning."""
    split: dict[str, int] = estimate.details.get("parameter_split") or {}
    if not split:
        return []
    rows = [(name, dict.fromkeys(PHASES, n)) for name, n in split.items()]
    stored = sum(split.values())
    rest = {p: max(0, estimate.phases[p].objects["parameters"] - stored) for p in PHASES}
    if any(rest.values()):
        rows.append((COPIES_ROW, rest))
    return rows

"""The summary table the per-rank benchmarks print: per kind of case, how many, how many within each limit, and the
worst difference."""

from __future__ import annotations

import time


def print_summary(worst: dict[str, list[float]], start: float, *, title: str = "layout", width: int = 14,
                  limits: tuple[float, ...] = (1, 2, 3), unit: str = "cases", noun: str = "traced ranks") -> None:
    """Print the table for ``worst`` (kind → each case's largest |difference| in %), then the count and the time since
    ``start`` (``time.perf_counter()``)."""
    print()
    print(f"{title:<{width}}{unit:>7}" + "".join(f"{f'≤ {lim:g} %':>9}" for lim in limits) + f"{'worst':>9}")
    for kind, errs in worst.items():
        print(f"{kind:<{width}}{len(errs):>7}" + "".join(f"{sum(e <= lim for e in errs):>9}" for lim in limits)
              + f"{max(errs):>8.2f}%")
    print(f"\n{sum(len(v) for v in worst.values())} {noun} in {time.perf_counter() - start:.0f} s")

"""Which cases README's test command runs, and which only the full run (``MEMCALC_FULL_TESTS=1``).

On the 2-core machines CI runs on, the whole suite had grown to about 40 minutes against the brief's "well under 15".
Most of it is agreement matrices: one capability (a ledger against PyTorch's own traced or real rank) checked at
several precisions, degrees or schedules. The default run keeps every capability and at least one case of each
matrix, chosen so each axis value a matrix names is still run somewhere; the further cases carry the ``full_matrix``
mark and run with ``MEMCALC_FULL_TESTS=1`` (tests/conftest.py deselects them otherwise and says how many). Run the
full suite before landing a change to tracing, fitting or the parallel ledger; docs/testing.md lists what each tier
takes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest

#: The environment variable that runs every case.
FULL_ENV = "MEMCALC_FULL_TESTS"
#: A further case of a matrix whose capability the default run already checks.
FULL = pytest.mark.full_matrix


def full_only(case: Any, single: bool = False) -> Any:
    """``case`` (a tuple of a parametrize list, a ``pytest.param``, or with ``single`` the value of a one-name
    parametrize) run only in the full suite."""
    if isinstance(case, type(pytest.param(0))):
        return pytest.param(*case.values, marks=[*case.marks, FULL], id=case.id)
    return pytest.param(*((case,) if single else case), marks=FULL)


def sample(cases: Sequence[Any], keep: Iterable[int], single: bool = False) -> list[Any]:
    """``cases`` with all but the positions ``keep`` run only in the full suite (their ids unchanged)."""
    kept = set(keep)
    if not kept or not kept <= set(range(len(cases))):
        raise ValueError(f"keep names cases {sorted(kept)} of {len(cases)}")
    return [case if i in kept else full_only(case, single) for i, case in enumerate(cases)]


def bare_functions(items: Iterable[Any]) -> list[str]:
    """The test functions among the collected ``items`` of which every case is marked ``full_matrix``."""
    cases: dict[str, list[bool]] = {}
    for item in items:
        name = f"{item.nodeid.split('::')[0]}::{getattr(item, 'originalname', item.name)}"
        cases.setdefault(name, []).append(item.get_closest_marker("full_matrix") is not None)
    return sorted(name for name, marked in cases.items() if all(marked))

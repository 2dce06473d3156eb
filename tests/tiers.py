"""Which tests README's test command runs, and which only the full run (``MEMCALC_FULL_TESTS=1``).

On the 2-core machines CI runs on, the whole suite takes about 40 minutes against the brief's "well under 15". Almost
all of it is a few hundred integration tests that trace a model on fake tensors or run real CPU steps, a few seconds
to two minutes each. The default run keeps every test that takes a few seconds, the acceptance tests of each
capability (the issue's real DDP and FSDP2 ranks, the done-when layout, the traced per-rank matrices, the soak, the
hostile inputs) and at least one case of each agreement matrix. Two marks leave the rest to the full run:

- ``full_matrix`` (:data:`FULL`, through :func:`sample`): a further case of a matrix whose capability a kept case of
  the same function checks. A function whose every case carries it is a usage error (:func:`bare_functions`).
- ``full_suite`` (:data:`WHOLE`): a whole test function of a combination or a path that a default test of the same
  capability already exercises (docs/testing.md lists them by capability).

tests/conftest.py deselects both unless ``MEMCALC_FULL_TESTS=1``, or unless the test was named on the command line.
Run the full suite before landing a change to tracing, fitting, the parallel ledgers or rank measurement."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

#: The environment variable that runs every test.
FULL_ENV = "MEMCALC_FULL_TESTS"
#: A further case of a matrix whose capability the default run already checks.
FULL = pytest.mark.full_matrix
#: A whole test function left to the full run.
WHOLE = pytest.mark.full_suite

K = TypeVar("K")
V = TypeVar("V")


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


def _function(item: Any) -> str:
    return f"{item.nodeid.split('::')[0]}::{getattr(item, 'originalname', item.name)}"


def bare_functions(items: Iterable[Any]) -> list[str]:
    """The test functions among the collected ``items`` of which every case is marked ``full_matrix`` and which are
    not marked ``full_suite`` as a whole (a sample that kept nothing, by mistake)."""
    cases: dict[str, list[bool]] = {}
    whole: set[str] = set()
    for item in items:
        name = _function(item)
        cases.setdefault(name, []).append(item.get_closest_marker(FULL.name) is not None)
        if item.get_closest_marker(WHOLE.name) is not None:
            whole.add(name)
    return sorted(name for name, marked in cases.items() if all(marked) and name not in whole)


def named_on_the_command_line(args: Iterable[str], root: Path, base: Path | None = None) -> list[str]:
    """The node ids (relative to ``root``, as pytest writes them) of the tests named with ``::`` in ``args`` (paths
    relative to ``base``, the folder pytest was started in): a test asked for by name runs whatever its tier."""
    named = []
    for arg in args:
        if "::" not in arg:
            continue
        path, rest = arg.split("::", 1)
        try:
            rel = Path(base or Path.cwd(), path).resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            continue
        named.append(f"{rel}::{rest}")
    return named


def left_to_full(items: Iterable[Any], named: Sequence[str] = ()) -> list[Any]:
    """The ``items`` the default suite leaves to the full one: marked ``full_matrix`` or ``full_suite``, and not
    named on the command line (:func:`named_on_the_command_line`)."""
    def asked(nodeid: str) -> bool:
        return any(nodeid == n or nodeid.startswith((f"{n}[", f"{n}::")) for n in named)

    return [item for item in items
            if (item.get_closest_marker(FULL.name) is not None or item.get_closest_marker(WHOLE.name) is not None)
            and not asked(item.nodeid)]


class OnDemand(dict[K, V]):
    """A module fixture's results made the first time a test asks for each (``make(key)``), then kept: a default run
    that keeps one case of a matrix pays for that case alone."""

    def __init__(self, make: Callable[[K], V]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: K) -> V:
        value = self[key] = self._make(key)
        return value

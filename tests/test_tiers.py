"""The default suite's sample of the matrices (tests/tiers.py): the marked cases are the ones named, ids unchanged,
and no test function can lose every case."""

from __future__ import annotations

import pytest
from tiers import FULL, bare_functions, full_only, sample


def _marked(case: object) -> bool:
    return any(m.name == FULL.name for m in getattr(case, "marks", ()))


def test_sample_marks_all_but_the_kept_positions() -> None:
    cases = [("a", 1), ("b", 2), pytest.param("c", 3, id="third"), ("d", 4)]
    out = sample(cases, (0, 2))
    assert [_marked(c) for c in out] == [False, True, False, True]
    assert out[0] == ("a", 1) and out[2] is cases[2] and out[1].values == ("b", 2)
    assert full_only(cases[2]).id == "third" and _marked(full_only(cases[2]))
    single = sample([(1, 2), (3, 4)], (0,), single=True)  # one name whose values are tuples: kept whole
    assert single[1].values == ((3, 4),)
    for bad in ((), (4,), (-1,)):
        with pytest.raises(ValueError, match="keep names"):
            sample(cases, bad)


class _Item:
    def __init__(self, nodeid: str, marked: bool) -> None:
        self.nodeid, self.name = nodeid, nodeid.split("::")[1]
        self.originalname = self.name.split("[")[0]
        self._marked = marked

    def get_closest_marker(self, name: str) -> object:
        return object() if self._marked and name == FULL.name else None


def test_a_function_whose_every_case_is_marked_is_found() -> None:
    items = [_Item("tests/t.py::f[a]", True), _Item("tests/t.py::f[b]", False), _Item("tests/t.py::g[a]", True),
             _Item("tests/t.py::g[b]", True), _Item("tests/u.py::g[a]", False), _Item("tests/t.py::h", False)]
    assert bare_functions(items) == ["tests/t.py::g"]

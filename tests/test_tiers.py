"""The default suite (tests/tiers.py): the marked cases are the ones named, ids unchanged; no test function loses
every case by mistake; a whole function left to the full suite is left whole; a test named on the command line runs
whatever its tier; a module fixture's cases are made only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiers import FULL, WHOLE, OnDemand, bare_functions, full_only, left_to_full, named_on_the_command_line, sample


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
    def __init__(self, nodeid: str, marked: bool, whole: bool = False) -> None:
        self.nodeid, self.name = nodeid, nodeid.split("::")[1]
        self.originalname = self.name.split("[")[0]
        self._marks = {FULL.name} if marked else set()
        if whole:
            self._marks.add(WHOLE.name)

    def get_closest_marker(self, name: str) -> object:
        return object() if name in self._marks else None


def test_a_function_whose_every_case_is_marked_is_found() -> None:
    items = [_Item("tests/t.py::f[a]", True), _Item("tests/t.py::f[b]", False), _Item("tests/t.py::g[a]", True),
             _Item("tests/t.py::g[b]", True), _Item("tests/u.py::g[a]", False), _Item("tests/t.py::h", False)]
    assert bare_functions(items) == ["tests/t.py::g"]


def test_a_whole_function_left_to_the_full_suite_is_not_a_mistake() -> None:
    items = [_Item("tests/t.py::g[a]", True, whole=True), _Item("tests/t.py::g[b]", True, whole=True),
             _Item("tests/t.py::k[a]", True), _Item("tests/t.py::w", False, whole=True)]
    assert bare_functions(items) == ["tests/t.py::k"]


def test_the_default_suite_leaves_both_marks_out_unless_a_test_is_named(tmp_path: Path) -> None:
    items = [_Item("tests/t.py::f[a]", False), _Item("tests/t.py::f[b]", True), _Item("tests/t.py::w", False, True),
             _Item("tests/t.py::wide[a]", False, True), _Item("tests/t.py::wide[b]", True, True),
             _Item("tests/t.py::C::m", False, True)]
    assert [i.nodeid for i in left_to_full(items)] == [
        "tests/t.py::f[b]", "tests/t.py::w", "tests/t.py::wide[a]", "tests/t.py::wide[b]", "tests/t.py::C::m"]
    (tmp_path / "tests").mkdir()
    named = named_on_the_command_line([str(tmp_path / "tests" / "t.py::wide"), "tests/t.py", "-k", "x",
                                       "/elsewhere/t.py::w", str(tmp_path / "tests" / "t.py::C")], tmp_path)
    assert named == ["tests/t.py::wide", "tests/t.py::C"]  # a path outside the root names nothing of it
    assert [i.nodeid for i in left_to_full(items, named)] == ["tests/t.py::f[b]", "tests/t.py::w"]
    # relative to the folder pytest started in
    assert named_on_the_command_line(["t.py::w", "../tests/t.py::f"], tmp_path, tmp_path / "tests") == [
        "tests/t.py::w", "tests/t.py::f"]
    # a name is a whole id or an id's prefix up to a case or a method, never a longer function's name
    assert [i.nodeid for i in left_to_full(items, ["tests/t.py::wid"])] == [i.nodeid for i in left_to_full(items)]


def test_a_fixtures_cases_are_made_when_first_asked_and_kept() -> None:
    made: list[str] = []

    def make(key: str) -> str:
        made.append(key)
        return key * 2

    cases = OnDemand(make)
    assert cases["a"] == "aa" and cases["a"] == "aa" and cases["b"] == "bb"
    assert made == ["a", "b"] and dict(cases) == {"a": "aa", "b": "bb"}

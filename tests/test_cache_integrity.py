"""Caches that cannot lie (issue 61, "hostile files"): a poisoned fit, refusal or transformers answer in the cache
never changes a verdict. Each is detected (a checksum over content, kind, key and versions; values range-checked and
consistent), set aside as ``<name>.bad`` with one ``memcalc: note:`` line, rebuilt, and the next run is silent.

The corpus is generated here from real calibrations of tiny configs (nothing binary is shipped): a fitted OPT
(``estimate`` of a family without a block model, one calibration for the module) and a Gemma 2 whose quick estimate
reads its cached counts and its SDPA answer (Gemma 2 has no SDPA: a cached "True" made it fail every run). The cases
in this process replace the traces of a recalibration by the pristine fit (the detection, the set-aside, the notice
and the rewrite are real; a calibration costs seconds); the real CLI in a subprocess recalibrates for real.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import childmem
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc_gui import cli
from memcalc_gui.core import cachefile
from memcalc_gui.core import files as files_module
from memcalc_gui.core.fitted import FitModel, signature
from memcalc_gui.trace import fit as fitmod
from memcalc_gui.trace import meta, ranks

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=1024, max_position_embeddings=2048)
OPT = dict(COMMON, model_type="opt", hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_attention_heads=4,
           num_hidden_layers=4)
GEMMA2 = dict(COMMON, model_type="gemma2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_hidden_layers=4)
STEP = ["--capacity", "1GiB", "--batch", "2", "--seq", "128", "--json"]
NOTE = "memcalc: note:"
#: A bound on one in-process run (a stubbed recalibration) and one real CLI run (a real one), on 2 busy cores.
RUN_S, CLI_S = 30.0, 120.0


def fresh_process() -> None:
    """Forget what this process read and reported, as a new ``memcalc`` process starts."""
    fitmod._READ.clear()
    meta._STRUCTURES.clear()
    ranks._NARROWER.clear()
    cachefile.forget()


def run(argv: list[str]) -> tuple[int, str, list[str], float]:
    """``memcalc`` in this process: exit code, stdout, the ``memcalc:`` lines on stderr, seconds."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    lines = [line for line in err.getvalue().splitlines() if line.startswith("memcalc:")]
    return rc, out.getvalue(), lines, time.perf_counter() - t0


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One real calibration of the tiny OPT and the Gemma 2 counts and SDPA answer, in a cache of their own, with
    the answers the CLI gives from it (a second run is silent and the same)."""
    root = tmp_path_factory.mktemp("pristine")
    cache = root / "cache"
    opt, gemma = root / "opt.json", root / "gemma2.json"
    opt.write_text(json.dumps(OPT))
    gemma.write_text(json.dumps(GEMMA2))
    fitted = ["estimate", "--config", str(opt), "--precision", "bf16", *STEP]
    quick = ["estimate", "--config", str(gemma), "--method", "quick", *STEP]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMCALC_CACHE_DIR", str(cache))
        fresh_process()
        answers = {}
        for name, argv in (("fitted", fitted), ("quick", quick)):
            rc, out, lines, _ = run(argv)
            assert rc == 0 and not lines, lines
            answers[name] = out
            fresh_process()
            assert run(argv)[:3] == (0, out, [])
        fresh_process()
    fits = sorted(cache.glob("*.json"))
    assert len(fits) == 1, fits  # bf16: no what-if of this tiny model is worth a calibration of its own
    gemma_params = json.loads(answers["quick"])["params"]
    kinds: dict[str, str] = {}
    for path in (cache / "structures").glob("*.json"):  # Gemma 2's counts and its SDPA answer (False)
        data = json.loads(path.read_text())
        if data["payload"] in ({"sdpa": False}, dict(data["payload"], num_params=gemma_params)):
            kinds[data["kind"]] = path.name
    assert set(kinds) == {"structure", "sdpa"}, kinds
    payload = json.loads(fits[0].read_text())["payload"]
    return SimpleNamespace(root=root, cache=cache, fitted=fitted, quick=quick, answers=answers, fit=fits[0].name,
                           model=FitModel.from_json(payload), structure=kinds["structure"], sdpa=kinds["sdpa"])


@pytest.fixture()
def case(pristine: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A copy of the pristine cache for one case, this process made fresh, the working folder an empty one of its
    own, and a recalibration's traces replaced by the pristine fit (``traced`` counts them)."""
    cache = tmp_path / "cache"
    shutil.copytree(pristine.cache, cache)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(cache))
    monkeypatch.chdir(work)
    fresh_process()
    traced: list[int] = []

    def pristine_traces(cfg: dict, setup: Any, *_a: Any, **_k: Any) -> FitModel:
        assert signature(setup) == pristine.model.signature, "a calibration the pristine cache does not hold"
        traced.append(1)
        return pristine.model

    monkeypatch.setattr(fitmod, "_fit", pristine_traces)
    yield SimpleNamespace(cache=cache, work=work, fit=cache / pristine.fit, traced=traced, tmp=tmp_path,
                          structure=cache / "structures" / pristine.structure,
                          sdpa=cache / "structures" / pristine.sdpa)
    fresh_process()


def envelope(path: Path) -> dict[str, Any]:
    return json.loads(path.read_bytes())


def forge(path: Path, data: dict[str, Any], **changes: Any) -> None:
    """Write ``data`` (an envelope) changed by ``changes``, its checksum recomputed as :func:`cachefile.seal` does
    but allowing NaN and infinity: what someone who recomputes the checksum writes."""
    env = {k: v for k, v in {**data, **changes}.items() if k != "sha256"}
    body = json.dumps(env, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    env["sha256"] = hashlib.sha256(body).hexdigest()
    path.write_bytes(json.dumps(env, sort_keys=True, separators=(",", ":"), allow_nan=True).encode())


def stale(path: Path, data: dict[str, Any], **changes: Any) -> None:
    """Write ``data`` changed by ``changes`` with its checksum left as it was."""
    path.write_text(json.dumps({**data, **changes}, allow_nan=True))


def scaled(payload: dict[str, Any], factor: float, anchor: bool = False) -> dict[str, Any]:
    """The fit with every moment's coefficients multiplied by ``factor`` (and its check trace's bytes, ``anchor``)."""
    out = json.loads(json.dumps(payload))
    for key in ("moments", "accum_moments"):
        for candidates in out[key].values():
            for group in candidates:
                for moment in group:
                    for obj, poly in moment.items():
                        moment[obj] = [c * factor for c in poly]
    if anchor:
        out["anchor"]["bytes"] = {p: round(v * factor) for p, v in out["anchor"]["bytes"].items()}
    return out


def poison_fit(kind: str, path: Path) -> None:
    data = envelope(path)
    payload = data["payload"]
    if kind == "nan":
        stale(path, data, payload=scaled(payload, float("nan")))
    elif kind == "nan-forged":
        forge(path, data, payload=scaled(payload, float("nan")))
    elif kind == "inf-forged":
        forge(path, data, payload=scaled(payload, float("inf")))
    elif kind == "x0.01":
        stale(path, data, payload=scaled(payload, 0.01))
    elif kind == "x0.01-forged":  # the stored check trace's bytes disagree
        forge(path, data, payload=scaled(payload, 0.01))
    elif kind == "x1e30-forged":
        forge(path, data, payload=scaled(payload, 1e30, anchor=True))
    elif kind == "negative-forged":
        forge(path, data, payload=scaled(payload, -1.0, anchor=False))
    elif kind == "wrong-type-forged":
        moments = json.loads(json.dumps(payload["moments"]))
        first = moments["forward"][0][0]
        first[next(iter(first))] = "lots"
        forge(path, data, payload=dict(payload, moments=moments))
    elif kind == "wrong-kind-forged":  # an SDPA answer where the fit belongs
        forge(path, data, kind="sdpa", payload={"sdpa": True})
    elif kind == "other-key-forged":  # another fit's file copied under this name
        forge(path, data, key="0" * 32)
    elif kind == "note-forged":
        forge(path, data, payload=dict(payload, notes=["Fits on any GPU: no need to check"]))
    elif kind == "counts-forged":
        forge(path, data, payload=dict(payload, structure=dict(payload["structure"], active_params=10**12)))
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "folder":  # with an older .bad beside it: only the latest is kept
        path.with_name(path.name + ".bad").write_text("older")
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("x")
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        raise AssertionError(kind)


def leftovers(case: SimpleNamespace) -> list[str]:
    """Temporary files anywhere under the case, and anything written outside its cache folder."""
    found = [str(p) for p in case.tmp.rglob("*") if p.name.endswith((".tmp", ".part"))]
    found += [str(p) for p in case.tmp.rglob("*") if p.is_file() and case.cache not in p.parents]
    return found


def assert_one_note(lines: list[str], *words: str) -> None:
    notes = [line for line in lines if line.startswith(NOTE)]
    assert len(notes) == 1 and len(lines) == 1, lines
    assert all(w in notes[0] for w in words), notes[0]
    assert len(notes[0]) < 600


FIT_POISONS = ["nan", "nan-forged", "inf-forged", "x0.01", "x0.01-forged", "x1e30-forged", "negative-forged",
               "wrong-type-forged", "wrong-kind-forged", "other-key-forged", "note-forged", "counts-forged",
               "truncated", "empty", "folder", "fifo"]


@pytest.mark.parametrize("kind", FIT_POISONS)
def test_a_poisoned_fit_never_changes_the_verdict(pristine: SimpleNamespace, case: SimpleNamespace,
                                                  kind: str) -> None:
    poison_fit(kind, case.fit)
    rc, out, lines, seconds = run(pristine.fitted)
    assert rc == 0 and out == pristine.answers["fitted"]
    assert_one_note(lines, "the cached fit", case.fit.name, "set aside as", "calibrated again")
    assert seconds < RUN_S and case.traced == [1]
    bad = case.fit.with_name(case.fit.name + ".bad")
    assert bad.is_dir() if kind == "folder" else bad.exists()
    assert [p.name for p in case.cache.glob("*.bad")] == [bad.name]
    rebuilt = envelope(case.fit)
    assert rebuilt["kind"] == "fit" and rebuilt["payload"]["moments"] == pristine.model.to_json()["moments"]
    assert not leftovers(case)
    fresh_process()  # the next run: silent, from the rebuilt file
    assert run(pristine.fitted)[:3] == (0, pristine.answers["fitted"], []) and case.traced == [1]


def test_a_fit_damaged_after_it_was_read_is_not_served_from_memory(pristine: SimpleNamespace,
                                                                   case: SimpleNamespace) -> None:
    """The window reads a fit, the file is damaged behind it: the next estimate in the same process reads it anew,
    sets it aside and recalibrates, and says so once."""
    assert run(pristine.fitted)[:3] == (0, pristine.answers["fitted"], [])
    assert fitmod._READ
    poison_fit("x0.01-forged", case.fit)
    rc, out, lines, _ = run(pristine.fitted)
    assert rc == 0 and out == pristine.answers["fitted"] and case.traced == [1]
    assert_one_note(lines, "the cached fit", "more than 0.5% apart")
    assert run(pristine.fitted)[:3] == (0, pristine.answers["fitted"], [])


@pytest.mark.parametrize("kind", ["stale-checksum", "legacy"])
def test_a_poisoned_refusal_does_not_refuse_the_model(pristine: SimpleNamespace, case: SimpleNamespace,
                                                      kind: str) -> None:
    """A ``.refused`` record with a bogus reason (the fit gone) is not obeyed: one written by memcalc before the
    envelope is stale (rebuilt silently), one whose checksum does not match is damaged (one note)."""
    data = envelope(case.fit)
    case.fit.unlink()
    refused = case.fit.with_suffix(".refused")
    if kind == "legacy":
        refused.write_text(json.dumps({"schema": 6, "refused": "bogus: refused forever"}))
    else:
        stale(refused, data, kind="refusal", payload={"refused": "bogus: refused forever"})
    rc, out, lines, _ = run(pristine.fitted)
    assert rc == 0 and out == pristine.answers["fitted"] and case.traced == [1]
    if kind == "legacy":
        assert lines == []
    else:
        assert_one_note(lines, "the cached refusal", "checksum")
    assert case.fit.is_file() and not leftovers(case)
    fresh_process()
    assert run(pristine.fitted)[:3] == (0, pristine.answers["fitted"], []) and case.traced == [1]


ANSWER_POISONS = {
    # the counts file
    "counts-bare-sdpa": ("structure", lambda p, d: p.write_text('{"sdpa": true}'), "not a memcalc cache file"),
    "counts-sdpa-payload-forged": ("structure", lambda p, d: forge(p, d, payload={"sdpa": True}),
                                   "does not hold a config's counts"),
    "counts-sdpa-kind-forged": ("structure", lambda p, d: forge(p, d, kind="sdpa", payload={"sdpa": True}),
                                "'sdpa' answer where a 'structure' one belongs"),
    "counts-inconsistent-forged": ("structure", lambda p, d: forge(
        p, d, payload=dict(d["payload"], active_params=d["payload"]["num_params"] + 1)), "exceeds num_params"),
    "counts-negative-forged": ("structure", lambda p, d: forge(p, d, payload=dict(d["payload"], root_unit=-5)),
                               "not a whole number"),
    "counts-truncated": ("structure", lambda p, d: p.write_bytes(p.read_bytes()[:40]), "not valid JSON"),
    # Gemma 2's SDPA answer (it has none: "True" made every run fail)
    "sdpa-true-stale-checksum": ("sdpa", lambda p, d: stale(p, d, payload={"sdpa": True}), "checksum"),
    "sdpa-string-forged": ("sdpa", lambda p, d: forge(p, d, payload={"sdpa": "yes"}), "SDPA answer"),
    "sdpa-legacy-true": ("sdpa", lambda p, d: p.write_text('{"sdpa": true}'), None),  # stale: silent
}


@pytest.mark.parametrize("name", sorted(ANSWER_POISONS))
def test_a_poisoned_answer_of_transformers_never_changes_the_verdict(pristine: SimpleNamespace,
                                                                     case: SimpleNamespace, name: str) -> None:
    which, poison, words = ANSWER_POISONS[name]
    path = case.structure if which == "structure" else case.sdpa
    poison(path, envelope(path))
    rc, out, lines, seconds = run(pristine.quick)
    assert rc == 0 and out == pristine.answers["quick"] and seconds < RUN_S
    if words is None:
        assert lines == [] and not path.with_name(path.name + ".bad").exists()
    else:
        assert_one_note(lines, "the cached answer of transformers", words, "set aside as", "asked again")
        assert path.with_name(path.name + ".bad").is_file()
    assert envelope(path)["kind"] == which and not leftovers(case)
    fresh_process()
    assert run(pristine.quick)[:3] == (0, pristine.answers["quick"], [])


def test_a_poisoned_narrower_config_is_asked_again(case: SimpleNamespace) -> None:
    """A tensor-parallel rank's narrower config kept on disk must keep the asked config's other keys and split
    only its widths by the degree: one that does not is damaged."""
    key = json.dumps([GEMMA2, 2, False], sort_keys=True)
    want = ranks._narrower_config_memo(GEMMA2, 2, False)
    assert want["num_attention_heads"] == 2
    path = meta.answer_path("narrower:" + key)
    data = envelope(path)
    for change in ({"num_attention_heads": 4}, {"vocab_size": 10}, {"hidden_size": 32}):
        forge(path, data, payload={"config": {**want, **change}})
        fresh_process()
        assert ranks._narrower_config_memo(GEMMA2, 2, False) == want
        notes = cachefile.take_notices()
        assert len(notes) == 1 and "set aside" in notes[0], notes
        assert envelope(path)["payload"] == {"config": want}


def test_a_full_disk_leaves_no_temporary_file(pristine: SimpleNamespace, case: SimpleNamespace,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while the rebuilt fit is written: the answer stands, one note says the cache cannot be written, no
    temporary file is left; once there is room the next run keeps its calibration and is silent."""
    case.fit.unlink()

    def full(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(files_module, "_write_chunk", full)
        rc, out, lines, _ = run(pristine.fitted)
    assert rc == 0 and out == pristine.answers["fitted"]
    assert_one_note(lines, "cannot be written", "the disk is full", "not kept")
    assert not case.fit.exists() and not leftovers(case)
    fresh_process()
    assert run(pristine.fitted)[:3] == (0, pristine.answers["fitted"], [])
    assert case.fit.is_file() and case.traced == [1, 1]


def read_only(mp: pytest.MonkeyPatch, folder: Path) -> None:
    """``folder`` as a read-only folder is to a user that is not root: nothing created, renamed or removed in it."""
    inside = str(folder)

    def guard(real: Any, *paths_at: int, flags_at: int | None = None) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            creating = flags_at is None or (len(args) > flags_at and args[flags_at] & os.O_CREAT)
            if creating and any(str(os.fspath(args[i])).startswith(inside) for i in paths_at if i < len(args)):
                raise PermissionError(errno.EACCES, "Permission denied", str(args[paths_at[0]]))
            return real(*args, **kwargs)
        return wrapped

    mp.setattr(os, "open", guard(os.open, 0, flags_at=1))
    for name in ("rename", "replace"):
        mp.setattr(os, name, guard(getattr(os, name), 0, 1))
    for name in ("unlink", "mkdir", "rmdir"):
        mp.setattr(os, name, guard(getattr(os, name), 0))


def test_a_read_only_cache_is_said_once_and_never_reparsed(pristine: SimpleNamespace, case: SimpleNamespace,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged fit in a cache that cannot be written: the answer stands, one note says the file is damaged and
    cannot be set aside, one that the folder cannot be written; a second estimate in the same process (the window)
    says neither again and does not parse the damaged file again."""
    poison_fit("nan", case.fit)
    unsealed: list[int] = []
    real_unseal = cachefile._unseal

    def counting(raw: bytes, kind: str, *args: Any) -> Any:
        unsealed.append(kind == "fit")
        return real_unseal(raw, kind, *args)

    monkeypatch.setattr(cachefile, "_unseal", counting)
    with monkeypatch.context() as mp:
        read_only(mp, case.cache)
        rc, out, lines, _ = run(pristine.fitted)
        assert rc == 0 and out == pristine.answers["fitted"]
        assert len(lines) == 2 and all(line.startswith(NOTE) for line in lines), lines
        assert "cannot be set aside (permission denied)" in lines[0]
        assert "cannot be written (permission denied)" in lines[1]
        parsed = sum(unsealed)
        rc, out, lines, _ = run(pristine.fitted)
        assert rc == 0 and out == pristine.answers["fitted"] and lines == []
        assert sum(unsealed) == parsed == 1  # the damaged fit is remembered by its stamp, not parsed again
    assert not leftovers(case) and not case.fit.with_name(case.fit.name + ".bad").exists()


def test_orphaned_temporary_files_are_swept(case: SimpleNamespace) -> None:
    """A process killed while writing leaves its temporary file: the next write in that folder removes the ones
    over an hour old (never a fresh one, which another process may be writing)."""
    old = [case.cache / ".memcalc-abc123.part", case.cache / "x.123.456.tmp"]
    young = case.cache / ".memcalc-young.part"
    for p in (*old, young):
        p.write_text("partial")
    past = time.time() - 2 * cachefile.ORPHAN_AGE_S
    for p in old:
        os.utime(p, (past, past))
    assert cachefile.write_sealed(case.cache / "new.json", kind="fit", key="new", versions={}, payload={})
    assert not any(p.exists() for p in old) and young.exists()


# ---- the real CLI ----------------------------------------------------------------------------------------------
def memcalc(argv: list[str], cache: Path, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """The real CLI in a process of its own: what it did, its seconds, and its own peak resident size in bytes
    (tests/childmem.py; 0 where the system does not say), measured outside ``cwd`` and the cache."""
    with tempfile.TemporaryDirectory() as measured:
        peak = Path(measured) / "peak"
        env = dict(os.environ, PYTHONPATH=str(ROOT), MEMCALC_CACHE_DIR=str(cache), **{childmem.PEAK_ENV: str(peak)})
        t0 = time.perf_counter()
        proc = subprocess.run(childmem.command("memcalc_gui.cli", *argv), capture_output=True, text=True,
                              timeout=CLI_S, env=env, cwd=cwd, stdin=subprocess.DEVNULL)
        return proc, time.perf_counter() - t0, childmem.read_peak(peak) or 0


CLI_CASES = {
    "fit-fifo": ("fitted", "fit", "the cached fit"),  # a real recalibration: the FIFO is never opened
    "counts-bare-sdpa": ("quick", "structure", "the cached answer of transformers"),
    "sdpa-true-stale-checksum": ("quick", "sdpa", "the cached answer of transformers"),
}


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_the_cli_says_it_once_and_answers_the_same(pristine: SimpleNamespace, case: SimpleNamespace,
                                                   name: str) -> None:
    """A real ``memcalc`` process: exit 0, the pristine answer, one note on stderr and nothing else, in bounded
    time and memory, nothing written outside the cache; the next process is silent."""
    command, which, words = CLI_CASES[name]
    path = {"fit": case.fit, "structure": case.structure, "sdpa": case.sdpa}[which]
    if which == "fit":
        poison_fit("fifo", path)
    else:
        ANSWER_POISONS[name][1](path, envelope(path))
    argv = getattr(pristine, command)
    proc, seconds, peak = memcalc(argv, case.cache, case.work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == pristine.answers[command]
    assert proc.stderr.splitlines() == [line for line in proc.stderr.splitlines() if line.startswith(NOTE)]
    assert_one_note(proc.stderr.splitlines(), words, "set aside as")
    assert seconds < CLI_S
    assert peak < 4 << 30  # under 4 GiB: a real recalibration imports torch and transformers and traces
    assert envelope(path)["kind"] == {"fit": "fit", "structure": "structure", "sdpa": "sdpa"}[which]
    assert not leftovers(case) and not any(case.work.iterdir())
    proc, _, _ = memcalc(argv, case.cache, case.work)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, pristine.answers[command], "")


def test_the_window_says_a_damaged_fit_once_and_shows_the_same_result(pristine: SimpleNamespace,
                                                                      case: SimpleNamespace, qtbot: Any) -> None:
    """The window on the same config and setup as the CLI: the damaged fit is set aside, recalibrated in its worker,
    said once in the status bar, and the peak it shows is the CLI's answer from the pristine cache."""
    from memcalc_gui.ui.form import default_state
    from memcalc_gui.ui.main_window import MainWindow

    poison_fit("x0.01-forged", case.fit)
    state = default_state().replace(model_kind="config", config_path=str(pristine.root / "opt.json"),
                                    precision="bf16", optimizer="adamw", batch="2", seq="128", grad_accum="1",
                                    gpu="", capacity="1GiB")
    window = MainWindow(initial_state=state, persist=False)
    qtbot.addWidget(window)
    said: list[str] = []
    window.statusBar().messageChanged.connect(said.append)
    window.show()
    qtbot.waitUntil(lambda: window.result is not None and window.result.setup.extras.get("fitted"), timeout=60_000)
    expected = json.loads(pristine.answers["fitted"])
    assert window.result.estimate.peak_bytes == expected["peak_bytes"] and case.traced == [1]
    notes = [m for m in said if "set aside as" in m]
    assert len(notes) == 1 and case.fit.name in notes[0] and "\n" not in notes[0], said
    window.refresh()
    assert len([m for m in said if "set aside as" in m]) == 1
    assert case.fit.with_name(case.fit.name + ".bad").exists() and not leftovers(case)

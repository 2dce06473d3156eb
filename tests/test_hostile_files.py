"""Hostile files memcalc reads and hostile places it writes to (issue 61): snapshots and profiler timelines that
would exhaust memory or the CPU, malformed ones in PyTorch's and memcalc's own shape, special files, and output
paths that are devices, FIFOs, links to them or names too long. Each ends within 10 s and 1 GB of extra memory with
one line naming the field and exit 2 (or a correct answer), and nothing is written outside the chosen output.

The corpus is generated (bench/hostile_corpus.py); the CLI runs in one child process per command, which times each
file and reads its own peak resident size over each, less what it held before (tests/childmem.py: Linux's ``VmHWM``,
reset between files).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import hostile_corpus
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core import files
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.timeline import read_timeline, read_timeline_file

ROOT = Path(__file__).resolve().parents[1]
#: The issue's bounds for every reproducer.
SECONDS, EXTRA_BYTES = 10.0, 2**30


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("hostile-snapshots")
    paths = {name: str(p) for name, p in hostile_corpus.write_all(folder).items()}
    paths["profiler-5.6M-changes"] = str(hostile_corpus.big_profiler_json(folder / "big-profiler.json"))
    paths.update(hostile_corpus.special_paths(folder))
    return paths


_CHILD = """
import contextlib, io, json, sys, time
import childmem
from memcalc_gui.cli import main
files, argv = json.loads(sys.argv[1]), json.loads(sys.argv[2])
results = {}
for name, path in files.items():
    out, err = io.StringIO(), io.StringIO()
    before = childmem.rss() or 0
    childmem.reset_peak()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([a.replace("{file}", path) for a in argv])
        except SystemExit as exc:
            rc = exc.code
    results[name] = [rc, err.getvalue(), time.perf_counter() - t0, (childmem.peak() or before) - before]
print(json.dumps(results))
"""


def _run_all(paths: dict[str, str], argv: list[str], tmp: Path) -> dict[str, list]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "tests"))),
               MEMCALC_CACHE_DIR=str(tmp / "cache"))
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(paths), json.dumps(argv)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(results: dict[str, list], flag: str) -> None:
    for name, (rc, err, seconds, extra) in results.items():
        lines = err.strip().splitlines()
        assert seconds < SECONDS, (name, seconds)
        assert extra < EXTRA_BYTES, (name, extra)
        if name.startswith("ok-"):
            assert rc == 0, (name, err)
            continue
        assert rc == 2, (name, rc, err[-500:])
        assert len(lines) == 1 and lines[0].startswith(f"memcalc: error: {flag}: "), (name, err[-500:])
        assert "internal error" not in err and len(lines[0]) <= 420, name


def test_every_hostile_snapshot_through_reconcile(corpus, tmp_path):
    """``memcalc reconcile --snapshot FILE``: the issue's reproducers (a few hundred bytes of shared nested lists,
    one list of 10,000 frames under 200,000 events, a profiler timeline that expands past 5 M changes, a FIFO,
    /dev/zero and a link to it), memo-index bombs, and every malformed field in PyTorch's and memcalc's shape."""
    marker = Path("/tmp/memcalc-pwned")
    marker.unlink(missing_ok=True)
    results = _run_all(corpus, ["reconcile", "--preset", "gpt2", "--snapshot", "{file}"], tmp_path)
    _check(results, "--snapshot")
    assert set(results) == set(corpus)
    assert not marker.exists()
    assert {p.name for p in tmp_path.iterdir()} <= {"cache"}  # nothing written beside memcalc's cache


def test_hostile_snapshots_through_report(corpus, tmp_path):
    """``memcalc report --snapshot FILE --out r.png``: the same corpus, refused before any rendering; the one that
    reads writes its report, and nothing else appears."""
    out = tmp_path / "r.png"
    results = _run_all(corpus, ["report", "--preset", "gpt2", "--snapshot", "{file}", "--out", str(out)], tmp_path)
    _check(results, "--snapshot")
    assert out.is_file()
    assert {p.name for p in tmp_path.iterdir()} <= {"cache", "r.png"}


def test_the_shared_frames_snapshot_reads_once_per_list():
    """200,000 events sharing one list of 10,000 frames read as 200,000 look-ups, not 2·10⁹ frame visits."""
    data = hostile_corpus.pickles()["ok-shared-frames"]
    t0 = time.perf_counter()
    tl = read_timeline(data)
    assert time.perf_counter() - t0 < SECONDS
    assert len(tl.events) == 200_000 and {e.phase for e in tl.events} == {"forward"}
    assert tl.events[0].module == "/src/model_0.py:0"


def test_memo_bombs_are_refused_before_unpickling():
    """CPython's unpickler sizes its memo by the largest index: index 10⁹ in 9 bytes took 48 s and 15 GB."""
    corpus = hostile_corpus.pickles()
    for name in ("memo-long-binput", "memo-put-text", "memo-put-digits"):
        t0 = time.perf_counter()
        with pytest.raises(InputError, match="memo index"):
            read_timeline(corpus[name])
        assert time.perf_counter() - t0 < 0.5, name


# ---- outputs ---------------------------------------------------------------------------------------------------
@pytest.fixture
def targets(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    link_fifo = tmp_path / "link-to-fifo.png"
    link_fifo.symlink_to(fifo)
    link_dir = tmp_path / "link-to-dir.png"
    (tmp_path / "adir").mkdir()
    link_dir.symlink_to(tmp_path / "adir")
    (tmp_path / "dir.png").mkdir()
    return {"fifo": fifo, "link-to-fifo": link_fifo, "link-to-folder": link_dir, "folder": tmp_path / "dir.png",
            "missing-folder": tmp_path / "nope" / "r.png",
            "name-256-bytes": tmp_path / ("r" * 252 + ".png"), "name-300-bytes": tmp_path / ("é" * 148 + ".png")}


def _state(path: Path) -> object:
    """What is at ``path`` (its mode, a link's target), or why nothing can be."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.errno
    return st.st_mode, os.readlink(path) if path.is_symlink() else None


def test_output_paths_refused_before_anything_is_written(targets, tmp_path):
    """A device, FIFO or folder (or a link to one), a missing folder or a name the file system cannot hold: one
    line naming the flag, exit 2, at once, and the FIFO, link and folder are left as they were."""
    before = {p: _state(p) for p in targets.values()}
    for name, path in targets.items():
        for argv in (["report", "--preset", "gpt2", "--out", str(path)],
                     ["estimate", "--config", "{tiny}", "--batch", "1", "--seq", "16", "--method", "trace",
                      "--snapshot-out", str(path).removesuffix(".png") + ".pickle"]):
            if "{tiny}" in argv:
                if name not in ("fifo", "link-to-fifo", "folder"):
                    continue  # one set of kinds is enough for the trace (it costs a torch import)
                cfg = tmp_path / "tiny.json"
                cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                           "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}))
                argv = [a.replace("{tiny}", str(cfg)) for a in argv]
                pickled = Path(argv[-1])
                if name in ("fifo", "link-to-fifo") and not pickled.exists():
                    os.mkfifo(pickled) if name == "fifo" else pickled.symlink_to(targets["fifo"])
                elif name == "folder" and not pickled.exists():
                    pickled.mkdir()
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "memcalc_gui.cli", *argv], capture_output=True, text=True,
                                  timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2, (name, argv[0], proc.stderr[-800:])
            assert len(lines) == 1 and "internal error" not in lines[0], (name, proc.stderr[-800:])
            assert ("--out: " if argv[0] == "report" else "--snapshot-out: ") in lines[0], (name, lines)
            assert time.perf_counter() - t0 < 30, name
    assert {p: _state(p) for p in targets.values()} == before
    assert (tmp_path / "fifo.png").is_fifo() and not any(p.name.startswith(".memcalc-") for p in tmp_path.iterdir())


def test_a_link_to_a_device_is_never_replaced(tmp_path):
    """As root, replacing a link's target ``/dev/null`` would destroy it: the check refuses the write first."""
    link = tmp_path / "null.pdf"
    link.symlink_to("/dev/null")
    with pytest.raises(files.OutputError, match="a device") as info:
        files.atomic_write(link, b"data", field="out")
    assert info.value.field == "out"
    assert Path("/dev/null").is_char_device() and link.is_symlink()


def test_snapshot_out_is_written_whole(tmp_path, monkeypatch):
    """``--snapshot-out`` goes through the atomic writer: a full disk keeps the previous file and leaves no part."""
    from memcalc_gui.core.timeline import Timeline, TimelineEvent

    target = tmp_path / "predicted.pickle"
    target.write_bytes(b"the previous snapshot")
    tl = Timeline((TimelineEvent(512, "activations", "forward", 0, "m", "mm", 4096),), "trace")

    def full(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_write_chunk", full)
    with pytest.raises(files.OutputError, match="disk is full") as info:
        tl.write_snapshot(target)
    assert info.value.field == "snapshot_out"
    assert target.read_bytes() == b"the previous snapshot" and [p.name for p in tmp_path.iterdir()] == [target.name]
    monkeypatch.undo()
    tl.write_snapshot(target)
    assert read_timeline_file(target).events == tl.events


def test_measure_snapshot_path_is_checked_before_the_step(tmp_path, capsys):
    fifo = tmp_path / "s.pickle"
    os.mkfifo(fifo)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        cli_main(["measure", "--preset", "gpt2", "--device", "cpu", "--snapshot", str(fifo)])
    assert info.value.code == 2 and time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memcalc: error: --snapshot: cannot write") and "pipe" in err[0]

"""Hostile memory snapshots and profiler timelines, generated (never shipped as binaries): the issue's reproducers
and their relatives, each small unless its point is size. Used by tests/test_hostile_files.py (the CLI) and
tests/test_ui_hostile.py (the window); ``python -m bench.hostile_corpus`` prints each file's answer, time and memory."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any


def _nested(depth: int) -> list[Any]:
    """A list whose text doubles with each level (every level holds the one below twice, shared by the pickle)."""
    x: list[Any] = []
    for _ in range(depth):
        x = [x, x]
    return x


def _snap(entry: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"device_traces": [[entry]], "segments": [], **extra}


def _own(frames: Any, spans: Any = None, source: Any = "trace") -> dict[str, Any]:
    """memcalc's own shape (``Timeline.to_snapshot``) with the given frames and spans."""
    return _snap({"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "frames": frames},
                 memcalc={"source": source, "rounding": 1,
                          "spans": [["forward", 0, 0, 1]] if spans is None else spans})


INNER = {"filename": "model.layers.0", "line": 0, "name": "mm"}


def _outer(line: Any) -> dict[str, Any]:
    return {"filename": "memcalc forward", "line": line, "name": "activations"}


def pickles() -> dict[str, bytes]:
    """Name → pickle bytes. Each is refused with one line, except where the name says ``ok``."""
    loop: dict[str, Any] = {}
    loop["self"] = loop
    frames_10k = [{"filename": f"/src/model_{i}.py", "line": i, "name": "forward"} for i in range(10_000)]
    shared_blocks = [{"size": 512, "state": "active_allocated"} for _ in range(10_000)]
    out: dict[str, bytes] = {
        # the issue's: a shared nested list as a frame's filename (its text is 2^40 elements long)
        "nested-filename": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1, "frames": [
            {"filename": _nested(40), "line": 1, "name": "x"}]}), protocol=4),
        "nested-name-60": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1, "frames": [
            {"filename": "a.py", "line": 1, "name": _nested(60)}]}), protocol=4),
        # the issue's: 200,000 events sharing one list of 10,000 frames (an answer, read once)
        "ok-shared-frames": pickle.dumps({"device_traces": [[{"action": "alloc", "addr": i * 512, "size": 512,
                                                              "frames": frames_10k} for i in range(200_000)]],
                                          "segments": []}, protocol=4),
        # CPython's unpickler makes its memo table as large as the largest index asked for
        "memo-long-binput": b"\x80\x04N" + b"r" + struct.pack("<I", 10**9) + b".",
        "memo-put-text": b"Np1000000000\n.",
        "memo-put-digits": b"Np" + b"9" * 5000 + b"\n.",
        "negative-length": b"\x80\x02T" + struct.pack("<i", -5) + b"abc.",
        "not-an-opcode": b"\x80\x04\xff\xfe.",
        "names-os-system": b"cos\nsystem\n(S'touch /tmp/memcalc-pwned'\ntR.",
        "truncated": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 2, "frames": []}))[:-9],
        # memcalc's own shape, malformed field by field
        "own-frame-int": pickle.dumps(_own([5])),
        "own-frames-dict": pickle.dumps(_own({"filename": "x"})),
        "own-line-abc": pickle.dumps(_own([INNER, _outer("abc")])),
        "own-line-inf": pickle.dumps(_own([INNER, _outer(float("inf"))])),
        "own-line-5000-digits": pickle.dumps(_own([INNER, _outer("9" * 5000)])),
        "own-line-huge-int": pickle.dumps(_own([INNER, _outer(10**400)])),
        "own-line-negative": pickle.dumps(_own([INNER, _outer(-1)])),
        "own-span-out-of-range": pickle.dumps(_own([INNER, _outer(0)], spans=[["forward", 0, 0, 99]])),
        "own-span-negative": pickle.dumps(_own([INNER, _outer(0)], spans=[["forward", 0, -3, 1]])),
        "own-span-not-a-phase": pickle.dumps(_own([INNER, _outer(0)], spans=[[["x"], 0, 0, 1]])),
        "own-span-short": pickle.dumps(_own([INNER, _outer(0)], spans=[["forward", 0]])),
        "own-spans-not-a-list": pickle.dumps(_own([INNER, _outer(0)], spans={"forward": 1})),
        "own-recursive-source": pickle.dumps(_own([INNER, _outer(0)], source=loop, spans=loop)),
        "own-filename-list": pickle.dumps(_own([{"filename": _nested(30), "line": 0, "name": "x"}, _outer(0)])),
        "own-text-too-long": pickle.dumps(_own([INNER, {"filename": "memcalc forward", "line": 0,
                                                          "name": "x" * 100_000}])),
        "own-marker-list": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1, "frames": []},
                                              memcalc=[1, 2])),
        # PyTorch's shape, malformed
        "addr-negative": pickle.dumps(_snap({"action": "alloc", "addr": -1, "size": 512, "frames": []})),
        "addr-bool": pickle.dumps(_snap({"action": "alloc", "addr": True, "size": 512, "frames": []})),
        "size-past-1-eib": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 2**61, "frames": []})),
        "size-float": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1.5, "frames": []})),
        "action-list": pickle.dumps(_snap({"action": ["alloc"], "addr": 1, "size": 1, "frames": []})),
        "frames-string": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1, "frames": "abc"})),
        "frame-line-string": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1, "frames": [
            {"filename": "a.py", "line": "7", "name": "forward"}]})),
        "entry-not-a-record": pickle.dumps({"device_traces": [["nope"]]}),
        "segments-not-a-list": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1}, segments="x")),
        "ok-segment-blocks-shared": pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1}]],
                                               "segments": [{"device": 0, "total_size": 1, "blocks": shared_blocks}
                                                            for _ in range(1_000)]}, protocol=4),
        "block-size-string": pickle.dumps(_snap({"action": "alloc", "addr": 1, "size": 1}, segments=[
            {"device": 0, "total_size": 1, "blocks": [{"size": "1", "state": "active_allocated"}]}])),
        "many-devices": pickle.dumps({"device_traces": [[] for _ in range(5_000)], "segments": []}),
        "no-trace": pickle.dumps({"device_traces": []}),
        "just-an-int": pickle.dumps(42),
        "deep-list": b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b".",
    }
    return out


def profiler_jsons() -> dict[str, bytes]:
    """Name → JSON bytes of profiler memory timelines, each refused with one line."""
    return {
        "profiler-deep-row": b"[[1], [" + b"[" * 100_000 + b"]" * 100_000 + b"]]",
        "profiler-long-number": b"[[1], [[0, " + b"9" * 10_000 + b", 0, 0, 0, 0, 0, 0, 0]]]",
        "profiler-float": b"[[1], [[0, 1.5, 0, 0, 0, 0, 0, 0, 0]]]",
        "profiler-bool": b"[[1], [[0, true, 0, 0, 0, 0, 0, 0, 0]]]",
        "profiler-past-1-eib": b"[[1], [[0, " + str(2**61).encode() + b", 0, 0, 0, 0, 0, 0, 0]]]",
        "profiler-times-text": b'[["a"], [[0, 1, 0, 0, 0, 0, 0, 0, 0]]]',
        "profiler-counts-differ": b"[[1, 2], [[0, 1, 0, 0, 0, 0, 0, 0, 0]]]",
        "profiler-object": b'{"times": [], "sizes": []}',
        "profiler-trailing": b"[[1], [[0, 1, 0, 0, 0, 0, 0, 0, 0]]] x",
        "profiler-latin1": b'[["\xe9"], []]',
    }


def big_profiler_json(path: Path, rows: int = 700_000) -> Path:
    """The issue's profiler timeline that expands without end, scaled to just past the change limit: every category
    changes at every sample (8 changes a row: 700,000 rows are 5.6 M changes, ~48 MB)."""
    with path.open("w") as f:
        f.write("[[" + ",".join(map(str, range(rows))) + "],[")
        f.write(",".join(f"[0,{i},{i + 1},{i + 2},{i + 3},{i + 4},{i + 5},{i + 6},{i + 7}]" for i in range(rows)))
        f.write("]]")
    return path


def special_paths(folder: Path) -> dict[str, str]:
    """Paths that are not regular files (or not there), and a regular file too large to be a snapshot (sparse: it
    takes no disk)."""
    fifo = folder / "fifo.pickle"
    os.mkfifo(fifo)
    link = folder / "zero.pickle"
    link.symlink_to("/dev/zero")
    big = folder / "big.pickle"
    with big.open("wb") as f:
        f.truncate(2**30 + 1)
    (folder / "dir.pickle").mkdir()
    return {"fifo": str(fifo), "dev-zero": "/dev/zero", "link-to-dev-zero": str(link),
            "folder": str(folder / "dir.pickle"), "missing": str(folder / "missing.pickle"),
            "larger-than-1-gib": str(big)}


def write_all(folder: Path) -> dict[str, Path]:
    """Every generated file of this corpus in ``folder``: name → path."""
    out = {}
    for name, data in pickles().items():
        out[name] = folder / f"{name}.pickle"
        out[name].write_bytes(data)
    for name, data in profiler_jsons().items():
        out[name] = folder / f"{name}.json"
        out[name].write_bytes(data)
    return out




def main() -> None:
    """Run every file of the corpus through ``memcalc reconcile`` in this process, printing its exit status, its
    time, the rise of this process's peak resident size, and the line it printed."""
    import argparse
    import contextlib
    import io
    import resource
    import sys
    import tempfile
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from memcalc_gui.cli import main as cli_main

    parser = argparse.ArgumentParser(description="the hostile snapshot corpus through memcalc reconcile")
    parser.add_argument("--width", type=int, default=90, help="characters of each message shown")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="memcalc-hostile-"))
    paths = {name: str(p) for name, p in write_all(folder).items()}
    paths["profiler-5.6M-changes"] = str(big_profiler_json(folder / "big-profiler.json"))
    paths.update(special_paths(folder))
    print(f"{'file':<26}{'exit':>5}{'seconds':>9}{'extra MiB':>11}  answer")
    for name, path in paths.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out, err = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli_main(["reconcile", "--preset", "gpt2", "--snapshot", path])
            except SystemExit as exc:
                rc = int(exc.code or 0)
        seconds = time.perf_counter() - t0
        extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        said = (err.getvalue().strip() or out.getvalue().strip().splitlines()[0]).removeprefix("memcalc: error: ")
        print(f"{name:<26}{rc:>5}{seconds:>9.2f}{extra:>11.0f}  {said[:args.width]}")


if __name__ == "__main__":
    main()

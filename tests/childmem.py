"""The peak resident memory of a command, as the command itself used it, for tests that bound it (issue 61: "within
10 s and 1 GB of extra memory").

``ru_maxrss`` of a child (``os.wait4``, ``RUSAGE_CHILDREN``, or ``RUSAGE_SELF`` inside it) counts its parent's peak
too: Linux keeps a process's largest resident size across ``exec``, so a command started by a pytest worker that has
imported torch reports about 1.2 GB before it has done anything. ``VmHWM`` in ``/proc/self/status`` is the peak of the
process's memory since its ``exec`` (and since the last ``clear_refs`` reset), which is the command's own.

:func:`command` runs a module as ``python -m`` does and writes its ``VmHWM`` at exit to the file named by
``MEMCALC_TEST_PEAK_FILE``; :func:`peak` and :func:`reset_peak` measure inside a process of the test's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PEAK_ENV = "MEMCALC_TEST_PEAK_FILE"

_WRAPPER = """
import atexit, os, runpy, sys
sys.path.insert(0, {tests!r})
import childmem
atexit.register(childmem.write_peak)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def peak() -> int | None:
    """This process's peak resident size in bytes since its exec or the last :func:`reset_peak` (``None`` where the
    system does not say: not Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss() -> int | None:
    """This process's resident size now, in bytes (``None``: not Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Start :func:`peak` again from the resident size now (Linux's ``clear_refs``); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def write_peak() -> None:
    """At exit of a :func:`command`: its peak into the file :data:`PEAK_ENV` names."""
    path, value = os.environ.get(PEAK_ENV), peak()
    if path and value is not None:
        Path(path).write_text(str(value), encoding="ascii")


def command(module: str, *args: str) -> list[str]:
    """``python -m module args…`` that writes its own peak resident size at exit (:data:`PEAK_ENV`)."""
    return [sys.executable, "-c", _WRAPPER.format(tests=str(Path(__file__).resolve().parent)), module, *args]


def read_peak(path: Path) -> int | None:
    """The peak a :func:`command` wrote to ``path``; ``None`` if it wrote none (killed, or not Linux)."""
    try:
        return int(path.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None

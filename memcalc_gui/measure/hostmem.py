"""How much memory this machine can still give a measurement, read with the standard library only (no psutil).

A measurement builds a real model and runs a real step: planned beyond this, it would make the machine swap or, with
no swap, wake the kernel's OOM killer, which ends whichever process it picks (maybe another user's). The engine
(:mod:`.engine`) refuses such a setup before it builds anything; this module says what "available" is.

* Linux: ``MemAvailable`` of ``/proc/meminfo`` (the kernel's estimate of what can be allocated without swapping:
  free pages and the cache it can reclaim), capped by the room the memory cgroup leaves this process: cgroup v2
  ``memory.max`` less ``memory.current``, v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``, each less the
  inactive file cache the kernel reclaims first, for this process's cgroup and every one above it (the smallest).
* Windows: ``GlobalMemoryStatusEx``'s ``ullAvailPhys`` (ctypes).
* macOS: the free, inactive and speculative pages ``vm_stat`` counts.
* Elsewhere: ``os.sysconf('SC_AVPHYS_PAGES')`` (free pages only) where it exists.

``None`` when none of these answers: the engine then refuses nothing on memory grounds.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

#: A cgroup limit at or above this is "no limit" (cgroup v1 writes 2^63 − 4096 for none).
NO_LIMIT = 2**62
PROC_SELF = Path("/proc/self")
MEMINFO = Path("/proc/meminfo")


def available_bytes() -> int | None:
    """Bytes this process may still allocate on this machine without swapping, or ``None`` when unknown (see the
    module's docstring for each system). Tests replace this function."""
    if sys.platform.startswith("linux"):
        found = [v for v in (meminfo_available(), cgroup_room()) if v is not None]
        return max(0, min(found)) if found else _sysconf_available()
    if sys.platform == "win32":
        return _windows_available()
    if sys.platform == "darwin":
        return _macos_available()
    return _sysconf_available()


def meminfo_available(path: Path = MEMINFO) -> int | None:
    """``MemAvailable`` (``MemFree`` on kernels before 3.14, which lack it) in bytes; ``None`` when unreadable."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    info = {}
    for line in text.splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            info[m.group(1)] = int(m.group(2)) * 1024
    return info.get("MemAvailable", info.get("MemFree"))


def cgroup_room(proc: Path = PROC_SELF) -> int | None:
    """The least room any memory cgroup above this process leaves (limit − usage + inactive file cache), ``None``
    when no limit is set or none can be read. ``proc``: the ``/proc/<pid>`` whose ``cgroup`` and ``mountinfo`` are
    read (tests point it at files of their own)."""
    try:
        groups = (proc / "cgroup").read_text(encoding="utf-8", errors="replace").splitlines()
        mounts = (proc / "mountinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    rooms = []
    for version, mount, root, path in _memory_cgroups(groups, mounts):
        # the process's own cgroup below the mount point (a cgroup namespace mounts its own root there)
        rel = os.path.relpath(path, root) if (path + "/").startswith(root.rstrip("/") + "/") else "."
        here = Path(os.path.normpath(mount / rel))
        while True:
            room = _room(here, version)
            if room is not None:
                rooms.append(room)
            if here == mount or here == here.parent:
                break
            here = here.parent
    return min(rooms) if rooms else None


def _memory_cgroups(groups: list[str], mounts: list[str]) -> list[tuple[int, Path, str, str]]:
    """(version, mount point, the mount's root within the hierarchy, this process's cgroup path) for the memory
    controller: v1's ``memory`` hierarchy and the v2 unified one."""
    paths: dict[int, str] = {}
    for line in groups:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    found = []
    for line in mounts:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and "memory" in options else 0
        if version in paths:
            mount = Path(fields[4].replace("\\040", " "))
            found.append((version, mount, fields[3], paths[version]))
    return found


def _room(folder: Path, version: int) -> int | None:
    """What one cgroup's limit leaves, ``None`` without a limit (or its files)."""
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    try:
        limit_text = (folder / names[0]).read_text(encoding="ascii").strip()
        if limit_text == "max":
            return None
        limit = int(limit_text)
        usage = int((folder / names[1]).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None
    if limit >= NO_LIMIT:
        return None
    inactive = 0
    with contextlib.suppress(OSError, ValueError):
        for line in (folder / "memory.stat").read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(" ")
            if key == names[2]:
                inactive = int(value)
                break
    return max(0, limit - max(0, usage - inactive))


def _sysconf_available() -> int | None:
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def _windows_available() -> int | None:
    import ctypes

    class MemoryStatusEx(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

    status = MemoryStatusEx()
    status.dwLength = ctypes.sizeof(MemoryStatusEx)
    try:
        ok = ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None
    return int(status.ullAvailPhys) if ok else None


def vm_stat_available(text: str) -> int | None:
    """The free, inactive and speculative pages of macOS's ``vm_stat`` output, in bytes."""
    size = re.search(r"page size of (\d+) bytes", text)
    pages = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"^Pages (\w+):\s+(\d+)\.?$", text, re.M)}
    if size is None or "free" not in pages:
        return None
    return int(size.group(1)) * sum(pages.get(k, 0) for k in ("free", "inactive", "speculative"))


def _macos_available() -> int | None:
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return _sysconf_available()
    return vm_stat_available(out) or _sysconf_available()

"""Every file memcalc reads for a user or writes for one: bounded, regular, whole. Standard library only.

Reading (:func:`read_regular`): a path a user names is opened only when it is a regular file — a FIFO, a device
such as ``/dev/zero``, a socket or a folder is refused before a read could block or grow without end, also behind a
symbolic link — and at most a cap per kind of file is read: the size is checked before reading and again while
reading (a file that grows while it is read is refused). ``O_NONBLOCK`` keeps even a FIFO swapped in between the
check and the open from blocking.

Writing (:func:`check_output`, :func:`atomic_write`): a file is written under a short temporary name in the target's
folder, ``fsync``-ed, then renamed over the target, so a full disk or an interrupted write leaves the previous file
as it was and no partial one. A symbolic link is followed only to a regular file (or to nothing yet: the file is
created there); a link to a device, a FIFO, a socket or a folder is refused rather than replaced, and so is such a
path itself. A name the file system cannot hold, a missing folder, a full disk or a read-only folder is one line.

The cache (:func:`cache_dir`): the one folder memcalc writes on its own account (fits, the structures transformers
reported, configs fetched from the Hub).

Every failure is an :class:`~memcalc_gui.core.errors.InputError` naming the field (``--snapshot``, ``--out``, …).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Final

from .errors import InputError

#: Short enough for any file system: the target's own name may sit at the length limit.
_TMP_PREFIX: Final = ".memcalc-"
_TMP_SUFFIX: Final = ".part"


class OutputError(InputError):
    """A file could not be written to ``path``; nothing was left behind (the previous file, if any, is unchanged)."""

    def __init__(self, field: str, path: str | os.PathLike[str], why: str) -> None:
        super().__init__(field, f"cannot write {os.fspath(path)}: {why}; nothing was written")
        self.path = Path(os.fspath(path))
        self.why = why


def cache_dir() -> Path:
    """Where fits are kept: ``MEMCALC_CACHE_DIR``, else the platform's user cache folder (``…/memcalc/fits``).
    Structures and Hub configs live in sub-folders of it."""
    override = os.environ.get("MEMCALC_CACHE_DIR")
    if override:
        return Path(override)
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / "memcalc" / "Cache"
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches" / "memcalc"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memcalc"
    return base / "fits"


def _name(path: Path) -> str:
    return str(path) if len(str(path)) <= 120 else f"…{str(path)[-119:]}"


def _os_reason(exc: OSError) -> str:
    """A short reason for an ``OSError``, in the words people search for."""
    reasons = {errno.ENOSPC: "the disk is full (no space left on device)", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied", errno.EROFS: "the file system is read-only",
               errno.ENOENT: "no such file or folder", errno.ENOTDIR: "a part of the path is not a folder",
               errno.ENAMETOOLONG: "the name is longer than the file system allows", errno.ELOOP:
               "too many symbolic links", errno.EISDIR: "it is a folder", errno.EDQUOT: "the disk quota is exceeded"}
    return reasons.get(exc.errno or 0) or exc.strerror or type(exc).__name__


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a folder", "a pipe (FIFO)", "a device", …)."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _stat(path: Path, field: str, follow: bool = True) -> os.stat_result | None:
    """``stat`` (or ``lstat``) of ``path``; ``None`` when nothing is there; one line for any other failure."""
    try:
        return os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return None
        raise InputError(field, f"cannot use {_name(path)}: {_os_reason(exc)}") from None
    except ValueError:  # an embedded NUL byte
        raise InputError(field, "the path contains a NUL byte") from None


def read_regular(path: str | os.PathLike[str], *, field: str, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; :class:`InputError` on ``field``
    otherwise (missing, unreadable, not a regular file, larger than ``limit``, grew past it while read)."""
    p = Path(os.fspath(path)).expanduser()
    st = _stat(p, field)
    if st is None:
        raise InputError(field, f"cannot read {_name(p)}: no such file")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(field, f"{_name(p)} is {file_kind(st.st_mode)}; a {what} is a regular file (a pipe, device, "
                                "socket or folder is never read)")
    if st.st_size > limit:
        raise InputError(field, f"{_name(p)} is {st.st_size:,} bytes; a {what} is at most {limit:,}")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        raise InputError(field, f"cannot read {_name(p)}: {_os_reason(exc)}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
            raise InputError(field, f"{_name(p)} is not a regular file")
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise InputError(field, f"cannot read {_name(p)}: {_os_reason(exc)}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise InputError(field, f"{_name(p)} grew past {limit:,} bytes while being read")
    return b"".join(chunks)


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def check_output(path: str | os.PathLike[str], *, field: str) -> Path:
    """The absolute path a file for ``path`` will be written to (a symbolic link's target), or
    :class:`OutputError` on ``field`` when it cannot be: a folder, a device, FIFO or socket (or a link to one),
    a missing folder, a name longer than the file system allows. Nothing is written."""
    raw = os.fspath(path)
    if "\0" in str(raw):
        raise InputError(field, "the path contains a NUL byte")
    if not str(raw).strip():
        raise InputError(field, "give a file name")
    target = Path(raw).expanduser().absolute()
    link = _stat(target, field, follow=False)
    if link is not None and stat.S_ISLNK(link.st_mode):
        try:
            target = Path(os.path.realpath(target))
        except (OSError, ValueError) as exc:
            raise OutputError(field, target, f"the link cannot be followed ({type(exc).__name__})") from None
    st = _stat(target, field)
    if st is not None and not stat.S_ISREG(st.st_mode):
        via = " (through a symbolic link)" if link is not None and stat.S_ISLNK(link.st_mode) else ""
        raise OutputError(field, target, f"it is {file_kind(st.st_mode)}{via}; memcalc writes only regular files")
    folder = _stat(target.parent, field)
    if folder is None or not stat.S_ISDIR(folder.st_mode):
        raise OutputError(field, target, f"the folder {_name(target.parent)} does not exist")
    limit = _name_max(target.parent)
    size = len(os.fsencode(target.name))
    if size > limit:
        raise OutputError(field, target, f"the file name is {size} bytes; this file system allows {limit}")
    return target


def _new_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write_chunk(fd: int, data: memoryview) -> int:
    """One ``os.write`` (tests replace it to simulate a full disk)."""
    return os.write(fd, data)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, field: str) -> Path:
    """Write ``data`` for ``path`` all or nothing (see the module docstring); returns the file written (a link's
    target). :class:`OutputError` on ``field`` when it cannot be written; the previous file is then unchanged and
    no temporary file is left."""
    target = check_output(path, field=field)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=target.parent)
    except OSError as exc:
        raise OutputError(field, target, _os_reason(exc)) from None
    tmp = Path(tmp_name)
    done = False
    try:
        try:
            view = memoryview(data)
            while view:
                n = _write_chunk(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, "the write made no progress")
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            mode = stat.S_IMODE(target.stat().st_mode)
        except OSError:
            mode = _new_file_mode()
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        done = True
    except OSError as exc:
        raise OutputError(field, target, _os_reason(exc)) from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return target

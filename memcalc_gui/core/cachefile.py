"""Cache files that cannot lie: one sealed envelope for every file memcalc keeps in its cache. Standard library only.

Every file memcalc writes on its own account (fits, refusals, the answers transformers gave) is one JSON object::

    {"format": CACHE_FORMAT, "kind": "fit", "key": "<the name's hash>", "versions": {...},
     "sha256": "<hex>", "payload": {...}}

``sha256`` is over the canonical JSON (sorted keys, no spaces, ASCII, no NaN or infinity) of the other five fields,
so a file edited by hand, cut short, or moved under another file's name no longer matches. The file itself is
written canonically, so those bytes are the file's own less its ``,"sha256":"…"`` field: a read hashes the bytes it
read (a tenth of a millisecond for a 60 KB fit) rather than encoding the parsed JSON again (6 ms). The checksum is for
integrity, not security: anyone who can write the cache can recompute it. That is why every reader also checks the
payload's values (finite, non-negative, within :data:`~memcalc_gui.core.units.MAX_SIZE_BYTES`, consistent with
one another), which catches nonsense whether or not the checksum was recomputed.

On read (:func:`read_sealed`) a file is

* **missing**: ``None``;
* **stale** (another envelope format, other versions, or a file of the format before the envelope that a
  ``legacy`` test recognises): ``None``, silently; the caller computes it again and overwrites it;
* **damaged** (not a regular file, unreadable, not JSON, not an envelope, a checksum that does not match, another
  kind or key, a payload its ``check`` refuses): moved aside to ``<name>.bad`` (only the latest one is kept), one
  notice recorded (:func:`take_notices`), ``None``. A damaged file that cannot be moved aside (a read-only cache)
  is remembered by its size and times, so it is reported and parsed once per process, not on every read.

Writes (:func:`write_sealed`) go through :func:`~memcalc_gui.core.files.atomic_write` (a temporary file in the
cache folder, fsync-ed, renamed over the target; removed on any failure). A cache that cannot be written is one
notice per folder and process ("… cannot be written: …; calibrations are not kept") and nothing left behind.

Notices are lines for the user, each recorded once: the CLI prints them to stderr as ``memcalc: note: …`` when a
command ends, the window can show them in its status bar (:func:`take_notices` from its GUI thread).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from .errors import InputError
from .files import atomic_write, file_kind, read_regular

#: The envelope's format: a file of another format is stale (computed again, silently).
CACHE_FORMAT: Final = 1
#: The largest cache file read (a pipeline fit with its stages is a few hundred KB).
MAX_CACHE_FILE_BYTES: Final = 32 << 20
#: The suffix a damaged file is moved aside to (``<name>.bad``; a later damaged file of the same name replaces it).
BAD_SUFFIX: Final = ".bad"
#: Temporary files older than this in a cache folder are orphans of a killed process: removed on the next write.
ORPHAN_AGE_S: Final = 3600.0
#: The longest path a notice names in full (its tail beyond).
_NOTICE_PATH_CHARS: Final = 200
_REASON_CHARS: Final = 160

_LOCK = threading.Lock()
_PENDING: list[str] = []
_ONCE: set[object] = set()
#: Damaged files that could not be moved aside, by their stamp: read again only once they change.
_DAMAGED: dict[Path, tuple[int, int, int, int]] = {}
_SWEPT: set[Path] = set()


class Damaged(ValueError):
    """A cache file that is not what it says (the reason is one line)."""


def take_notices() -> list[str]:
    """The notices recorded since the last call, oldest first (and forgets them): the CLI prints each as
    ``memcalc: note: …``; the window shows them in its status bar."""
    with _LOCK:
        out = list(_PENDING)
        _PENDING.clear()
    return out


def notice(text: str, once: object = None) -> None:
    """Record one line for the user; ``once``: a key under which it is recorded at most once per process."""
    line = " ".join(text.split())
    with _LOCK:
        if once is not None:
            if once in _ONCE:
                return
            _ONCE.add(once)
        if line not in _PENDING:
            _PENDING.append(line)


def _shown(path: Path) -> str:
    text = str(path)
    return text if len(text) <= _NOTICE_PATH_CHARS else f"…{text[-(_NOTICE_PATH_CHARS - 1):]}"


def _short(reason: str) -> str:
    line = " ".join(str(reason).split())
    return line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS - 1] + "…"


def _os_why(exc: BaseException) -> str:
    if isinstance(exc, InputError):  # core.files.OutputError says why in a few words
        return _short(getattr(exc, "why", None) or exc.reason)
    if isinstance(exc, OSError):
        reasons = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
                   errno.EPERM: "permission denied", errno.EROFS: "the file system is read-only",
                   errno.EDQUOT: "the disk quota is exceeded", errno.ENOTDIR: "a part of the path is not a folder",
                   errno.EISDIR: "it is a folder"}
        return reasons.get(exc.errno or 0) or _short(exc.strerror or type(exc).__name__)
    return _short(str(exc))


def canonical(data: Any) -> bytes:
    """The bytes the checksum is over: sorted keys, no spaces, ASCII; ``ValueError`` for NaN or infinity (and for
    anything JSON cannot hold)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _digest(kind: str, key: str, versions: dict[str, Any], payload: Any, fmt: Any = CACHE_FORMAT) -> str:
    return hashlib.sha256(canonical({"format": fmt, "kind": kind, "key": key, "versions": versions,
                                     "payload": payload})).hexdigest()


def seal(kind: str, key: str, versions: dict[str, Any], payload: Any) -> bytes:
    """The file's bytes: ``payload`` in the envelope (see the module docstring); ``ValueError`` for a payload JSON
    cannot hold exactly (NaN, infinity)."""
    return canonical({"format": CACHE_FORMAT, "kind": kind, "key": key, "versions": versions,
                      "sha256": _digest(kind, key, versions, payload), "payload": payload})


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


_SHA_FIELD: Final = b',"sha256":"'


def _sound(raw: bytes, stored: Any) -> bool:
    """Whether ``raw`` (a canonical envelope, :func:`seal`) hashes, less its ``sha256`` field, to ``stored``: the
    checksum over the canonical JSON of the other fields, without encoding them again. The envelope's field is the
    last one of its name (sorted keys put only ``versions`` after it, and a quote inside a JSON string is escaped,
    so the bytes cannot appear there)."""
    if not isinstance(stored, str) or len(stored) != 64:
        return False
    at = raw.rfind(_SHA_FIELD)
    end = at + len(_SHA_FIELD) + 64
    if at < 0 or raw[end:end + 1] != b'"' or raw[at + len(_SHA_FIELD):end] != stored.encode("ascii", "replace"):
        return False
    return hashlib.sha256(raw[:at] + raw[end + 1:]).hexdigest() == stored


def _unseal(raw: bytes, kind: str, key: str, versions: dict[str, Any], check: Callable[[Any], None] | None,
            legacy: Callable[[Any], bool] | None) -> Any:
    """The payload of a file's bytes; ``None`` for a stale file; :class:`Damaged` for a damaged one."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise Damaged("it nests too deeply to be JSON memcalc wrote") from None
    except ValueError:
        raise Damaged("empty" if not raw.strip() else "not valid JSON (cut short or overwritten)") from None
    if not isinstance(data, dict):
        raise Damaged("not a JSON object")
    if "format" not in data:
        if legacy is not None and legacy(data):
            return None  # written before the envelope: computed again, silently
        raise Damaged("not a memcalc cache file (no format)")
    fmt = data["format"]
    if type(fmt) is not int:
        raise Damaged("its format is not a number")
    if fmt != CACHE_FORMAT:
        return None
    if set(data) != {"format", "kind", "key", "versions", "sha256", "payload"}:
        raise Damaged("its envelope has other fields than memcalc writes")
    found_kind, found_key, found_versions = data["kind"], data["key"], data["versions"]
    if not isinstance(found_kind, str) or not isinstance(found_key, str) or not isinstance(found_versions, dict):
        raise Damaged("its envelope's kind, key or versions have the wrong type")
    if not _sound(raw, data["sha256"]):
        raise Damaged("its checksum does not match its content")
    if found_kind != kind:
        raise Damaged(f"it holds a {_short(found_kind)[:40]!r} answer where a {kind!r} one belongs")
    if found_key != key:
        raise Damaged("it is another file's content (its key is not its name's)")
    if found_versions != versions:
        return None  # another memcalc, torch or transformers: computed again, silently
    if check is not None:
        try:
            check(data["payload"])
        except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
            raise Damaged(str(exc) or type(exc).__name__) from None
    return data["payload"]


def read_sealed(path: Path, *, kind: str, key: str, versions: dict[str, Any], what: str,
                check: Callable[[Any], None] | None = None, legacy: Callable[[Any], bool] | None = None,
                redo: str = "memcalc computes it again") -> Any:
    """The payload of the ``kind`` file at ``path`` written for ``key`` under ``versions``; ``None`` when it is
    missing, stale or damaged (see the module docstring). ``check`` raises ``ValueError`` (or another error of a
    malformed value) for a payload that cannot be true; ``legacy`` recognises the file this kind had before the
    envelope (stale, not damaged); ``what`` names the file in a notice ("the cached fit"), ``redo`` says what
    follows ("calibrated again")."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None  # missing (or a cache folder that is not one: the write says so)
    stamp = _stamp(st)
    with _LOCK:
        if _DAMAGED.get(path) == stamp:
            return None
    try:
        if not stat.S_ISREG(st.st_mode):
            raise Damaged(f"it is {file_kind(st.st_mode)}")
        try:
            raw = read_regular(path, field="cache", limit=MAX_CACHE_FILE_BYTES, what="cache file")
        except InputError as exc:
            if not path.exists():
                return None  # removed between the two looks
            raise Damaged(exc.reason) from None
        return _unseal(raw, kind, key, versions, check, legacy)
    except Damaged as exc:
        set_aside(path, str(exc), what, redo, stamp)
        return None


def set_aside(path: Path, reason: str, what: str = "the cache file", redo: str = "memcalc computes it again",
              stamp: tuple[int, int, int, int] | None = None) -> bool:
    """Move the damaged ``path`` (a file, or a folder or FIFO where a file belongs) to ``<name>.bad``, replacing an
    older one, and record one notice; ``False`` (and the notice says so, once) when it cannot be moved."""
    bad = path.with_name(path.name + BAD_SUFFIX)
    try:
        _clear(bad)
        os.rename(path, bad)
    except FileNotFoundError:  # another process moved it first: it said so
        return True
    except OSError as exc:
        if stamp is not None:
            with _LOCK:
                _DAMAGED[path] = stamp
        notice(f"{what} {_shown(path)} is damaged ({_short(reason)}) and cannot be set aside ({_os_why(exc)}): "
               "it is ignored", once=("damaged", path, stamp))
        return False
    with _LOCK:
        _DAMAGED.pop(path, None)
    notice(f"{what} {_shown(path)} was damaged ({_short(reason)}): set aside as {bad.name}; {redo}")
    return True


def _clear(path: Path) -> None:
    """Remove what is at ``path`` (a file, link, FIFO, or a folder with what it holds); nothing when nothing is."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def write_sealed(path: Path, *, kind: str, key: str, versions: dict[str, Any], payload: Any,
                 what: str = "the cache file") -> bool:
    """Keep ``payload`` at ``path`` in its envelope, whole or not at all; ``False`` when it could not be written
    (one notice per folder and process; no temporary file left). Something other than a regular file at ``path``
    (a folder, a FIFO) is moved aside first, as a damaged file is. A payload JSON cannot hold exactly (NaN) is
    not written: ``ValueError``, a bug of the caller."""
    data = seal(kind, key, versions, payload)
    return write_bytes(path, data, what=what)


def write_bytes(path: Path, data: bytes, *, what: str = "the cache file") -> bool:
    """``data`` at ``path`` whole or not at all (:func:`~memcalc_gui.core.files.atomic_write`); ``False`` and one
    notice per folder and process when the folder cannot be written; a non-regular file at ``path`` is moved
    aside first."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _sweep(folder)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                set_aside(path, f"it is {file_kind(st.st_mode)}", what, "memcalc writes the file there again")
        atomic_write(path, data, field="cache")
    except (OSError, InputError) as exc:
        notice(f"the cache folder {_shown(folder)} cannot be written ({_os_why(exc)}): calibrations and the answers "
               "transformers gave are not kept, so they are computed again on each run", once=("unwritable", folder))
        return False
    return True


def _sweep(folder: Path) -> None:
    """Remove the temporary files a killed process left in ``folder`` (``atomic_write``'s ``.memcalc-*.part``, and
    ``*.tmp`` of memcalc before it) once they are :data:`ORPHAN_AGE_S` old; once per folder and process."""
    with _LOCK:
        if folder in _SWEPT:
            return
        _SWEPT.add(folder)
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            name = entry.name
            orphan = (name.startswith(".memcalc-") and name.endswith(".part")) or \
                (name.endswith(".tmp") and name.count(".") >= 3)  # <stem>.<pid>.<thread>.tmp
            if orphan:
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False) and now - entry.stat(follow_symlinks=False).st_mtime \
                            > ORPHAN_AGE_S:
                        os.unlink(entry.path)


def forget() -> None:
    """Forget the notices, the damaged files remembered and the folders swept (tests: a fresh process)."""
    with _LOCK:
        _PENDING.clear()
        _ONCE.clear()
        _DAMAGED.clear()
        _SWEPT.clear()

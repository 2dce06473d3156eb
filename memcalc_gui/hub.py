"""A model named by its Hugging Face Hub id (``meta-llama/Llama-3.1-8B``): its ``config.json`` from a local
directory, the local Hugging Face cache, memcalc's own cache of the Hub, or the Hub.

Order: a directory (or a ``config.json`` path) the id names on this machine; the local Hugging Face cache, read only
(``huggingface_hub.try_to_load_from_cache``: ``HF_HOME``/``HF_HUB_CACHE`` honoured); memcalc's own cache of configs
it fetched (``<cache>/hub``, see :func:`memcalc_gui.core.files.cache_dir`); the published config memcalc bundles as
a preset (``_name_or_path`` equal to the id, default revision only); only then the Hub.

The Hub is asked by memcalc's own request (:func:`fetch_config_bytes`), never by ``hf_hub_download``: that one
names the files it writes after the server's ``ETag`` and ``X-Repo-Commit`` headers (a mirror sending
``"../../site-packages/x.pth"`` wrote outside the cache) and retries a stalled download without end. memcalc's
request is one ``GET {HF_ENDPOINT}/{repo}/resolve/{revision}/config.json`` with huggingface_hub's headers (the token
from ``HF_TOKEN`` or ``hf auth login``; built with its telemetry off, which would otherwise ask the server for an
agent registry and write it to ``HF_HOME``), for a repo id and a revision validated first (huggingface_hub's
``validate_repo_id``; a 40-hex commit or a git ref name). It is bounded: :data:`DEADLINE_S` for everything,
:data:`MAX_CONFIG_BYTES` checked against ``Content-Length`` and while reading, at most :data:`MAX_REDIRECTS`
redirects (the token goes only to the endpoint's own origin), no retry, every status one line. The content is
decoded and parsed with the limits of any user config before anything is written, and it is written only into
memcalc's cache, atomically, under a name hashed from (endpoint, repo id, revision): no name ever comes from a
server. ``HF_HUB_OFFLINE`` as the user set it keeps the network out (memcalc sets it for its own model building, so
the user's value is the one seen when the program started). Every failure is one line naming its cause: offline,
unreachable, too slow, too large, gated, not found, no config.json, rate-limited, server error, not JSON.

huggingface_hub is imported inside functions only; every file read goes through ``core.configfile`` like any
config the user opens.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import importlib
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urljoin, urlsplit

from . import USER_HF_OFFLINE, __version__, install_hint
from .core.configfile import MAX_CONFIG_BYTES, decode_text, parse_config_text, read_config
from .core.errors import ConfigError, InputError, one_line
from .core.files import atomic_write, cache_dir
from .core.model import preset_config, preset_for_hub_id

#: ``org/name`` as the Hub spells repository ids (huggingface_hub.utils.validate_repo_id): letters, digits and
#: ``-_.``; at most 96 characters for the name.
REPO_ID = re.compile(r"^(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}$")
#: A commit hash, or a git ref name made of letters, digits and ``._-/`` that starts with a letter, digit or ``_``
#: (so never ``/``, ``-`` or ``.``); :func:`check_revision` adds git's other rules.
REVISION = re.compile(r"[0-9a-f]{40}|[A-Za-z0-9_][A-Za-z0-9._/-]*")
MAX_REVISION_CHARS: Final = 200
FIELD = "model_id"
REVISION_FIELD = "revision"

#: The whole fetch — name lookup, connection, TLS, redirects, headers and body — ends within this many seconds:
#: a config.json is a few KiB, which the Hub sends in well under a second, and a server trickling bytes or holding
#: the connection open is cut here, so every misbehaving server ends the CLI (about 1 s to start) within 10 s.
DEADLINE_S: Final = 8.0
#: Each connect and each read waits at most this long (and never past the deadline).
OPERATION_TIMEOUT_S: Final = 5.0
#: The Hub answers ``resolve`` with one redirect (to its file cache or CDN), a renamed repository with one more.
MAX_REDIRECTS: Final = 3
_CHUNK: Final = 64 * 1024
_REDIRECTS: Final = (301, 302, 303, 307, 308)
HUB_ORIGIN: Final = "Hub"
CACHE_ORIGIN: Final = "Hub, cached by memcalc"


@dataclass(frozen=True)
class HubConfig:
    """A resolved config and where it came from (for the model's source line)."""

    repo_id: str
    config: dict[str, Any]
    path: str
    origin: str  # "local directory", "local cache", CACHE_ORIGIN, the bundled preset, or HUB_ORIGIN

    @property
    def source(self) -> str:
        return f"{self.repo_id} ({self.origin})"


def _bundled(repo_id: str, preset: str) -> HubConfig:
    return HubConfig(repo_id, preset_config(preset), f"preset {preset}", f"memcalc's bundled copy, preset {preset}")


def _fail(message: str) -> InputError:
    return InputError(FIELD, message)


def _read(path: str | Path) -> dict[str, Any]:
    """A config file on this machine through the bounded reader; its errors name ``--model``, the flag given."""
    try:
        return read_config(path)
    except ConfigError as exc:
        raise ConfigError(FIELD, exc.reason) from None


#: huggingface_hub's settings are module globals: one thread at a time changes them (the window's fetch runs on a
#: worker thread while its typing looks up caches on the GUI thread).
_CONSTANTS_LOCK = threading.Lock()


def _hub_headers() -> dict[str, str]:
    """huggingface_hub's request headers (user agent; ``authorization`` from ``HF_TOKEN`` or ``hf auth login``),
    built with its telemetry off and its offline switch on: with telemetry on, ``build_hf_headers`` itself asks
    ``{HF_ENDPOINT}/api/agent-harnesses`` for the user agent and writes the answer to ``HF_HOME/.agent_harnesses.json``
    (a second request to the server, and a file outside memcalc's cache). Nothing else of huggingface_hub reads
    ``HF_HUB_OFFLINE`` here: memcalc checks the user's own value (:data:`USER_HF_OFFLINE`) before any request."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    with _CONSTANTS_LOCK:
        saved = constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY
        constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY = True, True
        try:
            headers = dict(build_hf_headers(library_name="memcalc", library_version=__version__))
        finally:
            constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_TELEMETRY = saved
    headers["Accept-Encoding"] = "identity"  # never a compressed body to inflate
    return headers


def check_revision(revision: str | None) -> str:
    """``revision`` (``None`` is ``main``) when it is a commit hash or a git ref name, else :class:`InputError` on
    ``revision``: it becomes part of a URL and a cache key, so ``..``, a leading ``/`` or ``-``, control characters
    and anything longer than :data:`MAX_REVISION_CHARS` are refused before either is built."""
    if revision is None:
        return "main"
    bad = (len(revision) > MAX_REVISION_CHARS or not REVISION.fullmatch(revision) or ".." in revision
           or "//" in revision or "/." in revision or revision.endswith(("/", ".", ".lock")))
    if bad:
        raise InputError(REVISION_FIELD, f"{revision[:60]!r} is not a branch, tag or commit hash (letters, digits "
                                         f"and ._-/ without '..', at most {MAX_REVISION_CHARS} characters)")
    return revision


def _check_repo_id(text: str) -> None:
    """The Hub's own rules for a repository id (huggingface_hub's validator when it is installed)."""
    message = f"{text[:80]!r} is neither a folder here nor a Hub id (org/name, e.g. meta-llama/Llama-3.1-8B)"
    if not REPO_ID.match(text) or ".." in text or "--" in text:
        raise _fail(message)
    try:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        return
    try:
        validate_repo_id(text)
    except HFValidationError:
        raise _fail(message) from None


def cache_file(endpoint: str, repo_id: str, revision: str) -> Path:
    """Where memcalc keeps the ``config.json`` it fetched for (endpoint, repo id, revision): a name hashed from the
    three, so no part of it comes from a user's text or a server's headers."""
    key = hashlib.sha256(f"{endpoint}\n{repo_id}\n{revision}".encode()).hexdigest()
    return cache_dir() / "hub" / f"{key}.json"


def _from_own_cache(file: Path, repo_id: str) -> HubConfig | None:
    """The config memcalc stored for this id, or ``None`` (also when it cannot be read: it is fetched again)."""
    try:
        if not file.is_file():
            return None
        return HubConfig(repo_id, read_config(file), str(file), CACHE_ORIGIN)
    except (OSError, InputError):
        return None


def _store(file: Path, data: bytes) -> str | None:
    """Keep a validated config in memcalc's cache; a cache that cannot be written is not an error (``None``)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        return str(atomic_write(file, data, field=FIELD))
    except (OSError, InputError):
        return None


# ---- the request ----------------------------------------------------------------------------------------------
class _Sockets:
    """The sockets of one fetch, so the caller can cut them at the deadline (a blocked read then returns at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.expired = False

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.append(sock)
            if self.expired:
                self._cut(sock)

    def set_timeout(self, seconds: float) -> None:
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.settimeout(seconds)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._open:
                self._cut(sock)

    @staticmethod
    def _cut(sock: socket.socket) -> None:
        # the plain socket's shutdown, also for a TLS socket: SSLSocket.shutdown would drop its TLS state under a
        # thread that is reading
        with contextlib.suppress(OSError, ValueError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _watched(sockets: _Sockets) -> Callable[..., socket.socket]:
    def create_connection(address: Any, timeout: Any = None, source_address: Any = None) -> socket.socket:
        sock = socket.create_connection(address, timeout, source_address)
        sockets.add(sock)
        return sock

    return create_connection


class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, sockets: _Sockets, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _watched(sockets)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, sockets: _Sockets, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sockets = sockets
        self._create_connection = _watched(sockets)

    def connect(self) -> None:
        """As http.client's, with the TLS socket watched before its handshake (a server may stall that too)."""
        http.client.HTTPConnection.connect(self)
        host = self._tunnel_host or self.host  # type: ignore[attr-defined]
        self.sock = self._context.wrap_socket(self.sock, server_hostname=host,  # type: ignore[attr-defined]
                                              do_handshake_on_connect=False)
        self._sockets.add(self.sock)
        self.sock.do_handshake()


def _tls_context() -> ssl.SSLContext:
    """The system's certificates (``SSL_CERT_FILE`` honoured), and certifi's where it is installed (a Python from
    python.org on macOS has no system store of its own)."""
    context = ssl.create_default_context()
    with contextlib.suppress(ImportError, OSError, ssl.SSLError):
        context.load_verify_locations(importlib.import_module("certifi").where())
    context.set_alpn_protocols(["http/1.1"])
    return context


def _opener(sockets: _Sockets) -> urllib.request.OpenerDirector:
    """http and https only (no ``file:``, ``ftp:`` or ``data:``), the user's proxy settings, and no redirect
    handler: a redirect comes back as an :class:`urllib.error.HTTPError` that :func:`fetch_config_bytes` follows
    itself, so it decides how often and where the token goes."""
    context = _tls_context()

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(functools.partial(_HTTPConnection, sockets=sockets), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(functools.partial(_HTTPSConnection, sockets=sockets), req, context=context)

    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.UnknownHandler(), HTTP(), HTTPS(context=context),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port


def hub_url(endpoint: str, repo_id: str, revision: str) -> str:
    """The address of ``config.json`` as huggingface_hub's ``hf_hub_url`` builds it (the revision quoted whole, so
    ``refs/pr/1`` is one path segment), from ``endpoint`` itself: ``hf_hub_url`` keeps its own template when the
    endpoint differs from the one it was imported with."""
    return f"{endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/config.json"


def _status_error(code: int, headers: Any, repo_id: str, revision: str) -> InputError:
    """One line for an HTTP status, with the Hub's ``X-Error-Code`` where it sent one."""
    error_code = str(headers.get("X-Error-Code", "") if headers is not None else "")
    if error_code == "GatedRepo":
        return _fail(f"{repo_id} is gated: accept its license on the Hub, then log in (hf auth login) or set HF_TOKEN")
    if error_code == "RepoNotFound":
        return _fail(f"no model {repo_id} on the Hub (or it is private: log in or set HF_TOKEN)")
    if error_code == "RevisionNotFound":
        return InputError(REVISION_FIELD, f"{repo_id} has no revision {revision!r} on the Hub")
    if error_code == "EntryNotFound":
        return _fail(f"{repo_id} has no config.json on the Hub")
    if code in (401, 403):
        return _fail(f"the Hub refused {repo_id} (HTTP {code}): it is private or gated; log in (hf auth login) or "
                     "set HF_TOKEN")
    if code == 404:
        return _fail(f"the Hub has no config.json for {repo_id} at revision {revision!r} (HTTP 404)")
    if code == 429:
        wait = str(headers.get("Retry-After", "") if headers is not None else "").strip()
        later = f"in {int(wait)} s" if wait.isdigit() and int(wait) <= 86_400 else "later"
        return _fail(f"the Hub is rate-limiting: try again {later}")
    if 500 <= code <= 599:
        return _fail(f"the Hub failed with HTTP {code} (a server error): try again later")
    return _fail(f"the Hub answered HTTP {code} for {repo_id}'s config.json")


def _content_length(headers: Any) -> int | None:
    values = (headers.get_all("Content-Length") if headers is not None else None) or []
    if not values:
        return None
    if len(set(values)) != 1 or not str(values[0]).strip().isdigit():
        raise _fail("the Hub sent a malformed Content-Length")
    return int(str(values[0]).strip())


def _too_large(repo_id: str, size: int | None) -> InputError:
    """``size`` from Content-Length, or ``None`` when the body ran past the cap while it was read."""
    said = f"is {size:,} bytes" if size is not None else f"runs past {MAX_CONFIG_BYTES:,} bytes"
    return _fail(f"{repo_id}'s config.json from the Hub {said}; a config.json is at most {MAX_CONFIG_BYTES:,} bytes "
                 "(nothing was stored)")


def _download(url: str, headers: dict[str, str], repo_id: str, revision: str, sockets: _Sockets,
              deadline: float) -> bytes:
    """The body of ``url`` (following at most :data:`MAX_REDIRECTS` redirects), at most :data:`MAX_CONFIG_BYTES`."""
    opener = _opener(sockets)
    home = _origin(url)
    for _hop in range(MAX_REDIRECTS + 1):
        if _origin(url)[0] not in ("http", "https"):
            raise _fail(f"the Hub redirected {repo_id}'s config.json to a non-HTTP address")
        sent = {k: v for k, v in headers.items() if _origin(url) == home or k.lower() != "authorization"}
        request = urllib.request.Request(url, headers=sent, method="GET")
        timeout = max(0.05, min(OPERATION_TIMEOUT_S, deadline - time.monotonic()))
        try:
            response = opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            with contextlib.closing(exc):
                location = exc.headers.get("Location") if exc.headers is not None else None
                if exc.code in _REDIRECTS and location:
                    url = urljoin(url, location.strip())
                    continue
                raise _status_error(exc.code, exc.headers, repo_id, revision) from None
        with contextlib.closing(response):
            if response.status != 200:
                raise _status_error(response.status, response.headers, repo_id, revision)
            length = _content_length(response.headers)
            if length is not None and length > MAX_CONFIG_BYTES:
                raise _too_large(repo_id, length)
            chunks: list[bytes] = []
            total = 0
            while total <= MAX_CONFIG_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    sockets.expire()
                    break
                sockets.set_timeout(min(OPERATION_TIMEOUT_S, left))  # a trickle is cut at the deadline
                chunk = response.read1(min(_CHUNK, MAX_CONFIG_BYTES + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            if total > MAX_CONFIG_BYTES:
                raise _too_large(repo_id, None)
            if sockets.expired:
                raise TimeoutError("deadline")
            if length is not None and total != length:
                raise _fail(f"the Hub's answer for {repo_id} ended after {total:,} of {length:,} bytes")
            return b"".join(chunks)
    raise _fail(f"the Hub redirected {repo_id}'s config.json more than {MAX_REDIRECTS} times")


def fetch_config_bytes(endpoint: str, repo_id: str, revision: str, headers: dict[str, str]) -> bytes:
    """The bytes of ``config.json`` at ``revision`` of ``repo_id`` from ``endpoint``, within :data:`DEADLINE_S`.

    The request runs on a daemon thread the caller waits for until the deadline; then its sockets are cut (a read
    blocked on them returns at once) and the caller gives one line, so even a stalled name lookup cannot hold it.
    No retry: a retry would only split the same deadline, a 429 or a 5xx is not helped by asking again at once, and
    the user can run the command again. Nothing is written here."""
    if _origin(endpoint)[0] not in ("http", "https"):
        raise _fail(f"HF_ENDPOINT {endpoint[:80]!r} is not an http(s) address")
    url = hub_url(endpoint, repo_id, revision)
    deadline = time.monotonic() + DEADLINE_S
    sockets = _Sockets()
    outcome: list[bytes | BaseException] = []

    def work() -> None:
        try:
            outcome.append(_download(url, headers, repo_id, revision, sockets, deadline))
        except BaseException as exc:  # handed to the caller
            outcome.append(exc)

    worker = threading.Thread(target=work, name="memcalc-hub-request", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        sockets.expire()
        worker.join(0.5)
    result = outcome[0] if outcome else None
    if isinstance(result, bytes):
        return result
    if result is None or sockets.expired or time.monotonic() >= deadline:
        raise _fail(f"the Hub did not send {repo_id}'s config.json within {DEADLINE_S:g} s (a slow or stalled "
                    "server): try again later")
    if isinstance(result, InputError):
        raise result
    cause = result.reason if isinstance(result, urllib.error.URLError) and isinstance(result.reason,
                                                                                       BaseException) else result
    what = f"{type(cause).__name__}: {one_line(str(cause), 120)}"
    if isinstance(cause, TimeoutError):
        raise _fail(f"the Hub did not answer for {OPERATION_TIMEOUT_S:g} s ({repo_id}'s config.json): a slow or "
                    "stalled server or network; try again later")
    if isinstance(cause, http.client.HTTPException) and not isinstance(cause, ConnectionError):
        raise _fail(f"the Hub sent a malformed answer for {repo_id}'s config.json ({what})")
    raise _fail(f"{repo_id} is not in the local Hugging Face cache and the Hub cannot be reached ({what})")


def _parse(data: bytes, repo_id: str) -> dict[str, Any]:
    """The config in ``data`` with the limits of any config file, or one line on ``--model``."""
    name = f"{repo_id}'s config.json from the Hub"
    try:
        return parse_config_text(decode_text(data, name), name)
    except ConfigError as exc:
        raise ConfigError(FIELD, exc.reason) from None


# ---- the lookup -----------------------------------------------------------------------------------------------
def _local(text: str) -> Path | None:
    """The folder or ``.json`` file ``text`` names on this machine, or ``None`` (also for a name no file system can
    hold: ``Path.is_dir`` raises for a component past 255 bytes, or a NUL)."""
    try:
        local = Path(text).expanduser()
        return local if local.is_dir() or (local.is_file() and local.suffix == ".json") else None
    except (OSError, ValueError, RuntimeError):  # RuntimeError: ~user that does not exist
        return None


def resolve_config(model_id: str, revision: str | None = None, *, allow_network: bool = True) -> HubConfig:
    """The ``config.json`` of ``model_id``: a local directory or file, else the local Hugging Face cache, else
    memcalc's cache, else the bundled preset, else the Hub.

    ``allow_network=False`` looks on this machine only (the window's startup and typing: an id is not fetched until
    the user asks). Raises :class:`InputError` on field ``model_id`` (or ``revision``) with one line naming the cause.
    """
    text = model_id.strip()
    if not text:
        raise _fail("give a Hub id such as meta-llama/Llama-3.1-8B")
    local = _local(text)
    if local is not None:
        file = local / "config.json" if local.is_dir() else local
        if not file.is_file():
            raise _fail(f"{local} has no config.json")
        return HubConfig(text, _read(file), str(file), "local directory")
    _check_repo_id(text)
    rev = check_revision(revision)
    preset = preset_for_hub_id(text) if rev == "main" else None
    try:
        import huggingface_hub as hub
        from huggingface_hub import constants
    except ImportError:
        if preset is not None:
            return _bundled(text, preset)
        raise _fail(f"Hub ids need huggingface_hub: {install_hint('hf')}") from None

    cached = hub.try_to_load_from_cache(text, "config.json", revision=revision)  # reads only
    if isinstance(cached, str):
        return HubConfig(text, _read(cached), cached, "local cache")
    endpoint = str(constants.ENDPOINT).rstrip("/")
    file = cache_file(endpoint, text, rev)
    own = _from_own_cache(file, text)
    if own is not None:
        return own
    if preset is not None:  # the published config, bundled with memcalc: no network needed
        return _bundled(text, preset)
    if not allow_network:
        raise _fail(f"{text} is not in the local Hugging Face cache: fetch it from the Hub")
    if USER_HF_OFFLINE:
        raise _fail(f"{text} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    headers = _hub_headers()
    data = fetch_config_bytes(endpoint, text, rev, headers)
    config = _parse(data, text)
    stored = _store(file, data)
    return HubConfig(text, config, stored or hub_url(endpoint, text, rev), HUB_ORIGIN)

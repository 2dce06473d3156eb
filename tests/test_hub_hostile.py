"""Issue 61, the Hub half: a Hub mirror that misbehaves on purpose cannot write outside memcalc's cache, hang the CLI
or the window, or print more than one line.

The mirror is a local server on 127.0.0.1 (``HF_ENDPOINT``) with one route per misbehaviour: ``ETag`` and
``X-Repo-Commit`` headers naming files outside the cache (huggingface_hub 2.5 named its blobs after them), a body
trickling a byte every few seconds, a 10 GiB ``Content-Length``, 100 MB bodies without one, 429, 500, redirect loops,
redirects to another port (the token must not follow) and to ``file:``, broken JSON. Each case runs the real CLI in a
process whose HOME, HF_HOME, XDG_CACHE_HOME, TMPDIR and MEMCALC_CACHE_DIR lie in one temporary tree, and asserts: exit
0 with the right answer or exit 2 with one line naming the cause, within 10 s and 1 GiB, and no file or folder new
anywhere in the tree except in memcalc's cache folder (the traversal targets included).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import childmem
import pytest
from PySide6.QtCore import Qt

from memcalc_gui.core.configfile import MAX_CONFIG_BYTES
from memcalc_gui.core.model import spec_from_config

pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512}
TINY_BYTES = json.dumps(TINY).encode()
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_memcalcTestToken0123456789"
#: A trickling route sends one byte this often (past memcalc's per-read timeout would test that, not the deadline).
TRICKLE_S = 2.0
#: From HF_HOME/hub/models--org--x/blobs, where huggingface_hub writes a blob named after the ETag, to the tree's root.
UP = "../../../../"
#: Every misbehaving case ends within this (the issue's bound: a CLI start included).
BOUND_S = 10.0


class Server(ThreadingHTTPServer):
    """A Hub mirror; ``site`` stands for the user's site-packages, ``other`` for another host's address."""

    daemon_threads = True

    def __init__(self, site: Path) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.site = site
        self.other = ""
        self.stop = threading.Event()
        self.seen: list[tuple[str, str | None]] = []
        self.heads: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    """GET as the Hub answers it, misbehaving per repository; HEAD with the same headers (huggingface_hub's
    ``get_hf_file_metadata`` asks it first, so the corpus reproduces the issue against the old client too)."""

    protocol_version = "HTTP/1.0"
    server: Server
    head = False

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.server.heads.append(self.path)
        self.head = True
        self.respond()

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        self.respond()

    def respond(self) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")
        route = ROUTES.get("/".join(parts[:2])) if parts[2:3] == ["resolve"] and parts[-1] == "config.json" else None
        with contextlib.suppress(OSError):  # the client went away (it cut a stalled or oversized answer)
            (route or _not_found)(self)

    # helpers for the routes
    def answer(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        if "Content_Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not self.head:
            self.wfile.write(body)

    def trickle(self) -> None:
        """One byte every :data:`TRICKLE_S` until the client leaves or the test ends."""
        if self.head:
            return
        self.wfile.write(b"{")
        self.wfile.flush()
        while not self.server.stop.wait(TRICKLE_S):
            self.wfile.write(b" ")
            self.wfile.flush()

    def flood(self, chunked: bool) -> None:
        """100 MB of JSON whitespace with no Content-Length (chunked or ended by closing the connection)."""
        block = b" " * 2**20
        for i in range(100 * (not self.head)):
            if self.server.stop.is_set():
                return
            data = b"{" + block[1:] if i == 0 else block
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if not self.head:
            self.wfile.write(b"0\r\n\r\n" if chunked else b"")


def _not_found(h: Handler) -> None:
    h.answer(404, X_Error_Code="EntryNotFound")


def _good(h: Handler, **headers: str) -> None:
    h.answer(200, TINY_BYTES, **{"ETag": f'"{abs(hash(TINY_BYTES)):x}"', "X_Repo_Commit": COMMIT, **headers})


def _trickle(h: Handler) -> None:
    h.send_response(200)
    h.send_header("Content-Length", "1000")
    h.end_headers()
    h.trickle()


def _trickle_headers(h: Handler) -> None:
    h.wfile.write(b"HTTP/1.0 200 OK\r\n")
    h.wfile.flush()
    while not h.server.stop.wait(0.3):
        h.wfile.write(b"X")
        h.wfile.flush()


def _huge(h: Handler) -> None:
    h.send_response(200)
    h.send_header("Content-Length", str(10 * 2**30))
    h.end_headers()
    h.trickle()


def _flood(chunked: bool) -> Callable[[Handler], None]:
    def route(h: Handler) -> None:
        if chunked:
            h.protocol_version = "HTTP/1.1"
            h.close_connection = True
        h.send_response(200)
        h.send_header("Transfer-Encoding" if chunked else "Connection", "chunked" if chunked else "close")
        h.end_headers()
        h.flood(chunked)

    return route


def _redirect(target: Callable[[Handler], str]) -> Callable[[Handler], None]:
    def route(h: Handler) -> None:
        h.answer(302, Location=target(h))

    return route


def _body(data: bytes) -> Callable[[Handler], None]:
    return lambda h: h.answer(200, data)


ROUTES: dict[str, Callable[[Handler], None]] = {
    "org/tiny": _good,
    "org/etag-up": lambda h: _good(h, ETag=f'"{UP}site/memcalc_evil.pth"'),
    "org/etag-abs": lambda h: _good(h, ETag=f'"{h.server.site}/memcalc_abs.pth"'),
    "org/commit-up": lambda h: _good(h, X_Repo_Commit=f"{UP}site/commit"),
    "org/trickle": _trickle,
    "org/trickle-headers": _trickle_headers,
    "org/huge": _huge,
    "org/flood-close": _flood(chunked=False),
    "org/flood-chunked": _flood(chunked=True),
    "org/ratelimit": lambda h: h.answer(429, Retry_After="30"),
    "org/error": lambda h: h.answer(500, b"<html>oops</html>\n" * 50),
    "org/norev": lambda h: h.answer(404, X_Error_Code="RevisionNotFound", X_Error_Message="Invalid rev id"),
    "org/loop": _redirect(lambda h: h.path),
    "org/away": _redirect(lambda h: f"{h.server.other}/org/tiny/resolve/main/config.json"),
    "org/file": _redirect(lambda h: "file:///etc/passwd"),
    "org/loc-up": _redirect(lambda h: f"{UP}{UP}site/memcalc_loc.pth"),
    "org/short": lambda h: h.answer(200, b'{"a": 1}', Content_Length="1000"),
    "org/headers": lambda h: h.answer(200, TINY_BYTES, **{f"X_Filler_{i}": "x" * 100 for i in range(200)}),
    "org/notjson": _body(b"{not json"),
    "org/array": _body(b"[1, 2, 3]"),
    "org/deep": _body(b'{"a":' * 5000 + b"1" + b"}" * 5000),
}


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """The temporary tree every file of a case lives in: HOME, HF_HOME, caches, TMPDIR, the fake site-packages."""
    for name in ("home", "hf", "xdg", "tmp", "site", "memcalc"):
        (tmp_path / name).mkdir()
    return tmp_path


def _serve(site: Path) -> Iterator[Server]:
    server = Server(site)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()  # trickling handlers end at their next tick
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture()
def hub(tree: Path) -> Iterator[Server]:
    yield from _serve(tree / "site")


@pytest.fixture()
def other(tree: Path) -> Iterator[Server]:
    yield from _serve(tree / "site")


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _outside(root: Path, before: set[Path]) -> list[str]:
    """What appeared under ``root`` outside memcalc's cache folder since ``before``."""
    cache = root / "memcalc"
    return sorted(str(p.relative_to(root)) for p in _files(root) - before if not p.is_relative_to(cache))


def run_cli(args: list[str], endpoint: str, tree: Path) -> tuple[int, str, str, float, int]:
    """The real CLI in its own process, online (the suite's HF_HUB_OFFLINE=1 overridden), every folder in ``tree``:
    exit status, stdout, stderr, seconds, and the command's own peak resident memory in bytes (tests/childmem.py:
    a child's ``ru_maxrss`` would count this pytest worker's too)."""
    drop = ("HF_", "TRANSFORMERS_OFFLINE", "MEMCALC_CACHE_DIR", "XDG_CACHE_HOME", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_TOKEN=TOKEN, HOME=str(tree / "home"),
               HF_HOME=str(tree / "hf"), XDG_CACHE_HOME=str(tree / "xdg"), TMPDIR=str(tree / "tmp"),
               MEMCALC_CACHE_DIR=str(tree / "memcalc"), PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.TemporaryDirectory() as measured:  # outside ``tree``: nothing of the test's appears there
        env[childmem.PEAK_ENV] = str(Path(measured) / "peak")
        t0 = time.perf_counter()
        proc = subprocess.Popen(childmem.command("memcalc_gui.cli", *args), stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, env=env)
        try:
            proc.wait(timeout=60)  # a hang fails the bound below instead of the suite
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        peak = childmem.read_peak(Path(measured) / "peak") or 0  # the command's own (VmHWM; 0 where unknown)
        return proc.returncode, out.read().decode(), err.read().decode(), seconds, peak


def check(tree: Path, server: Server, repo: str, *extra: str) -> tuple[int, str, str]:
    """One CLI run against ``server``, with the guarantees every case shares; returns (status, stdout, line)."""
    before = _files(tree)
    rc, out, err, seconds, peak = run_cli(["estimate", "--model", repo, "--json", *extra], server.url, tree)
    lines = err.strip().splitlines()
    assert rc in (0, 2), err
    assert seconds < BOUND_S, (repo, seconds, err)
    assert peak < 2**30, (repo, peak)
    assert _outside(tree, before) == [], (repo, err)
    assert not list((tree / "site").iterdir())  # the traversal targets
    assert server.heads == []  # memcalc's one GET, never huggingface_hub's HEAD-then-download
    if rc == 0:
        assert err == "" and json.loads(out)["params"] == spec_from_config(TINY).num_params
        return rc, out, ""
    assert out == "" and len(lines) == 1 and lines[0].startswith("memcalc: error: --"), err
    assert "Traceback" not in err and TOKEN not in err
    return rc, out, lines[0]


def _stored(tree: Path) -> list[Path]:
    return sorted((tree / "memcalc" / "hub").glob("*")) if (tree / "memcalc" / "hub").is_dir() else []


@pytest.mark.parametrize("repo", ["org/etag-up", "org/etag-abs", "org/commit-up"])
def test_header_names_never_become_file_names(tree: Path, hub: Server, repo: str) -> None:
    """The reproducer: an ETag or commit naming site-packages (relative or absolute) gets the right answer, and the
    one file written is memcalc's, named by a hash; nothing lands in the Hugging Face cache or the target."""
    check(tree, hub, repo)
    stored = _stored(tree)
    assert len(stored) == 1 and len(stored[0].stem) == 64 and stored[0].read_bytes() == TINY_BYTES
    assert not list((tree / "hf").rglob("*"))


@pytest.mark.parametrize(("repo", "words"), [
    ("org/huge", "10,737,418,240 bytes; a config.json is at most 4,194,304"),
    ("org/flood-close", f"runs past {MAX_CONFIG_BYTES:,} bytes"),
    ("org/flood-chunked", f"runs past {MAX_CONFIG_BYTES:,} bytes"),
    ("org/ratelimit", "the Hub is rate-limiting: try again in 30 s"),
    ("org/error", "the Hub failed with HTTP 500"),
    ("org/loop", "redirected org/loop's config.json more than 3 times"),
    ("org/file", "to a non-HTTP address"),
    ("org/loc-up", "org/loc-up has no config.json on the Hub"),
    ("org/notjson", "org/notjson's config.json from the Hub is not valid JSON"),
    ("org/array", "must hold a JSON object"),
    ("org/deep", "nests deeper than 32 levels"),
])
def test_a_misbehaving_hub_is_one_line_at_once(tree: Path, hub: Server, repo: str, words: str) -> None:
    """Each misbehaviour is refused with one line naming it, nothing is stored, and the Hub is asked once (no
    retry; a redirect loop is cut after 3)."""
    _, _, line = check(tree, hub, repo)
    assert words in line and line.startswith("memcalc: error: --model: "), line
    assert _stored(tree) == []
    asked = [path for path, _ in hub.seen]
    assert len(asked) == (4 if repo == "org/loop" else 2 if repo == "org/loc-up" else 1), asked


def test_a_trickling_body_is_cut_at_the_deadline(tree: Path, hub: Server) -> None:
    """One byte every 2 s used to hang the CLI for good; the fetch's deadline ends it with one line."""
    t0 = time.perf_counter()
    _, _, line = check(tree, hub, "org/trickle")
    assert "did not send org/trickle's config.json within 8 s" in line
    assert time.perf_counter() - t0 > 7  # it was the deadline, not a per-read timeout
    assert _stored(tree) == []


def test_the_token_goes_to_the_endpoint_only(tree: Path, hub: Server, other: Server) -> None:
    """A redirect to another origin (the Hub's CDN, or a hostile mirror's friend) is followed without the token."""
    hub.other = other.url
    check(tree, hub, "org/away")
    assert hub.seen == [("/org/away/resolve/main/config.json", f"Bearer {TOKEN}")]
    assert other.seen == [("/org/tiny/resolve/main/config.json", None)]
    assert len(_stored(tree)) == 1


@pytest.mark.parametrize("revision", ["../../x", "/abs/path", "main\nx"])
def test_bad_revisions_are_refused_before_any_request(tree: Path, hub: Server, revision: str) -> None:
    """The issue's three through the CLI: one line naming --revision, and the server is never asked."""
    _, _, line = check(tree, hub, "org/tiny", f"--revision={revision}")
    assert line.startswith("memcalc: error: --revision: ") and "is not a branch, tag or commit hash" in line
    assert hub.seen == []


@pytest.mark.parametrize("revision", ["a..b", "r" * 300, "-rf", "main/", "x.lock", "", "a//b", "a/.b", "main.",
                                      "a b", "a\tb", "a%2F..", "a@{1}", "\u202emain"])
def test_the_revision_pattern(revision: str) -> None:
    from memcalc_gui.core.errors import InputError
    from memcalc_gui.hub import check_revision

    with pytest.raises(InputError) as info:
        check_revision(revision)
    assert info.value.field == "revision" and "\n" not in str(info.value)
    for good in (COMMIT, "main", "refs/pr/1", "v1.0-rc_2", "release/2024.06", "r" * 200):
        assert check_revision(good) == good


@pytest.mark.parametrize(("revision", "quoted"), [(COMMIT, COMMIT), ("refs/pr/1", "refs%2Fpr%2F1"),
                                                  ("v1.0-rc_2", "v1.0-rc_2")])
def test_good_revisions_are_asked_for_quoted(tree: Path, hub: Server, revision: str, quoted: str) -> None:
    check(tree, hub, "org/tiny", "--revision", revision)
    assert [path for path, _ in hub.seen] == [f"/org/tiny/resolve/{quoted}/config.json"]


def test_a_missing_revision_names_the_flag(tree: Path, hub: Server) -> None:
    _, _, line = check(tree, hub, "org/norev", "--revision", "v9")
    assert line == "memcalc: error: --revision: org/norev has no revision 'v9' on the Hub"


# ---- in-process: the same request with a short deadline, and memcalc's cache ---------------------------------
@pytest.fixture()
def online(tree: Path, hub: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    """This process pointed at ``hub``, online, with memcalc's cache in ``tree``."""
    from huggingface_hub import constants

    import memcalc_gui.hub as hubmod

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(hubmod, "USER_HF_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tree / "hf" / "hub"))
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(tree / "memcalc"))
    return hub


@pytest.mark.parametrize(("repo", "words"), [
    ("org/trickle-headers", "did not send org/trickle-headers's config.json within 1.5 s"),
    ("org/short", "ended after 8 of 1,000 bytes"),
    ("org/headers", "the Hub sent a malformed answer for org/headers's config.json (HTTPException: got more than 100"),
])
def test_stalled_headers_and_short_bodies(tree: Path, online: Server, monkeypatch: pytest.MonkeyPatch, repo: str,
                                          words: str) -> None:
    """Headers sent a byte at a time are cut by the same deadline (here shortened to 1.5 s); a body shorter than
    its Content-Length, or 200 headers, are refused; nothing is stored."""
    import memcalc_gui.hub as hubmod
    from memcalc_gui.core.errors import InputError

    monkeypatch.setattr(hubmod, "DEADLINE_S", 1.5)
    t0 = time.perf_counter()
    with pytest.raises(InputError) as info:
        hubmod.resolve_config(repo)
    assert time.perf_counter() - t0 < 3 and info.value.field == "model_id" and words in info.value.reason
    assert _stored(tree) == []


def test_memcalc_cache_answers_while_typing_and_offline(tree: Path, online: Server,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetched config is read back from memcalc's cache by the window's look-up as the user types (no network),
    and with HF_HUB_OFFLINE set; a damaged cache file is fetched again rather than trusted."""
    import memcalc_gui.hub as hubmod

    found = hubmod.resolve_config("org/tiny")
    assert found.origin == "Hub" and found.config == TINY and len(online.seen) == 1
    file = hubmod.cache_file(online.url, "org/tiny", "main")
    assert found.path == str(file) and file.read_bytes() == TINY_BYTES
    again = hubmod.resolve_config("org/tiny", allow_network=False)
    assert again.origin == "Hub, cached by memcalc" and again.config == TINY
    monkeypatch.setattr(hubmod, "USER_HF_OFFLINE", True)
    assert hubmod.resolve_config("org/tiny").config == TINY and len(online.seen) == 1
    monkeypatch.setattr(hubmod, "USER_HF_OFFLINE", False)
    file.write_bytes(b"[broken")
    assert hubmod.resolve_config("org/tiny").origin == "Hub" and file.read_bytes() == TINY_BYTES
    # another endpoint or revision is another file: a mirror's answer never stands in for the Hub's
    assert hubmod.cache_file("https://huggingface.co", "org/tiny", "main") != file
    assert hubmod.cache_file(online.url, "org/tiny", COMMIT) != file


def test_the_window_fetch_ends_on_its_own(qtbot: Any, tree: Path, online: Server) -> None:
    """Fetch against the trickling server used to stay "Fetching…": it now ends at the deadline with one line in
    the field, the last good result kept and the button enabled again."""
    pytest.importorskip("pytestqt")
    from memcalc_gui.ui.form import FormState
    from memcalc_gui.ui.main_window import MainWindow

    w = MainWindow(persist=False)
    qtbot.addWidget(w)
    good = w.result
    w.apply_state(FormState().replace(model_kind="hub", hub_id="org/trickle"))
    t0 = time.perf_counter()
    qtbot.mouseClick(w.inputs.fetch_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "did not send" in w.inputs.errors().get("hub_id", ""), timeout=15000)
    assert time.perf_counter() - t0 < BOUND_S
    message = w.inputs.errors()["hub_id"]
    assert "\n" not in message and "within 8 s" in message and w.result is good
    qtbot.waitUntil(w.inputs.fetch_button.isEnabled, timeout=5000)
    assert _stored(tree) == [] and not list((tree / "site").iterdir())
    w.close()


@pytest.mark.parametrize("repo_id", ["org/x.git", "-org/x", "org/.x", "org/x-", "a/b/c", "org/x\ny", "org/" + "x" * 97,
                                     "a" * 300 + "/x", "org/x\0y", "~nosuchuser-memcalc/x"])
def test_repo_ids_follow_the_hubs_rules(repo_id: str) -> None:
    """huggingface_hub's validator on top of memcalc's pattern: refused before any cache or network is consulted."""
    from memcalc_gui.core.errors import InputError
    from memcalc_gui.hub import resolve_config

    with pytest.raises(InputError) as info:
        resolve_config(repo_id, allow_network=False)
    assert info.value.field == "model_id" and "neither a folder here nor a Hub id" in info.value.reason

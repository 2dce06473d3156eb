"""``--model org/name``: config.json from a local folder, the local Hugging Face cache, memcalc's cache or the Hub.

The Hub is a local HTTP server that answers the Hub's file routes (``/{repo}/resolve/{revision}/config.json``,
HEAD and GET, with the headers huggingface_hub reads and the ``X-Error-Code`` it maps to errors), pointed to with
``HF_ENDPOINT`` — the real client runs, in a real process, with an empty ``HF_HOME``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from PySide6.QtCore import Qt

from memcalc_gui.core.model import spec_from_config

pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
#: repo id → (status, X-Error-Code, body)
REPOS: dict[str, tuple[int, str, bytes]] = {
    "org/tiny": (200, "", json.dumps(TINY).encode()),
    "org/gated": (401, "GatedRepo", b""),
    "org/missing": (404, "RepoNotFound", b""),
    "org/noconfig": (404, "EntryNotFound", b""),
    "org/broken": (200, "", b"{not json"),
}


class HubHandler(BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def _answer(self, body: bool) -> None:
        HubHandler.requests.append(f"{self.command} {self.path}")
        parts = self.path.split("?")[0].strip("/").split("/")
        repo = "/".join(parts[:2])
        status, code, data = REPOS.get(repo, (404, "RepoNotFound", b""))
        if parts[2:3] != ["resolve"] or parts[-1] != "config.json":
            status, code, data = 404, "EntryNotFound", b""
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
        if status == 200:
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{abs(hash(data)):x}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def hub_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    HubHandler.requests = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run(args: list[str], endpoint: str, hf_home: Path, offline: bool = False) -> tuple[int, str, str, float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1",
               MEMCALC_CACHE_DIR=str(hf_home.parent / "memcalc-cache"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memcalc_gui.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


def test_hub_download_then_the_cache_without_network(hub_server: str, tmp_path: Path) -> None:
    args = ["estimate", "--model", "org/tiny", "--batch", "2", "--seq", "64", "--json"]
    rc, out, err, _ = run(args, hub_server, tmp_path / "hf")
    assert rc == 0, err
    data = json.loads(out)
    assert data["setup"]["model"]["name"] == "org/tiny" and "(Hub)" in data["setup"]["model"]["source"]
    assert data["params"] == spec_from_config(TINY).num_params
    assert any(r.startswith("GET /org/tiny/resolve/main/config.json") for r in HubHandler.requests)
    # kept in memcalc's own cache (the Hugging Face cache is only read), where the next run finds it with the
    # network off
    assert len(list((tmp_path / "memcalc-cache" / "hub").glob("*.json"))) == 1
    assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file()]
    seen = len(HubHandler.requests)
    rc, out, err, _ = run(args, hub_server, tmp_path / "hf", offline=True)
    assert rc == 0, err
    again = json.loads(out)
    assert "(Hub, cached by memcalc)" in again["setup"]["model"]["source"]
    assert again["peak_bytes"] == data["peak_bytes"]
    assert len(HubHandler.requests) == seen  # no request at all
    rc, out, err, _ = run(args, hub_server, tmp_path / "hf")  # a cache hit never asks the Hub
    assert rc == 0 and json.loads(out)["peak_bytes"] == data["peak_bytes"]
    assert len(HubHandler.requests) == seen


def test_the_local_hugging_face_cache_answers_first_without_network(tmp_path: Path) -> None:
    """A config the Hugging Face tools downloaded (HF_HOME's hub cache) is read, never written, and wins."""
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text(json.dumps(TINY))
    args = ["estimate", "--model", "org/tiny", "--batch", "2", "--seq", "64", "--json"]
    rc, out, err, _ = run(args, "http://127.0.0.1:9", tmp_path / "hf")
    assert rc == 0, err
    data = json.loads(out)
    assert "(local cache)" in data["setup"]["model"]["source"]
    assert data["params"] == spec_from_config(TINY).num_params


@pytest.mark.parametrize(("repo", "words"), [
    ("org/gated", "is gated: accept its license"),
    ("org/missing", "no model org/missing on the Hub"),
    ("org/noconfig", "has no config.json on the Hub"),
    ("org/broken", "config.json"),
])
def test_hub_failures_are_one_line_naming_the_cause(hub_server: str, tmp_path: Path, repo: str,
                                                    words: str) -> None:
    rc, out, err, seconds = run(["estimate", "--model", repo], hub_server, tmp_path / "hf")
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memcalc: error: --"), err
    assert words in lines[0] and "Traceback" not in err
    assert seconds < 15


def test_offline_and_unreachable_hub_say_so_at_once(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc, _, err, seconds = run(["estimate", "--model", "org/tiny"], closed, tmp_path / "hf")
    assert rc == 2 and "the Hub cannot be reached" in err and len(err.strip().splitlines()) == 1
    assert seconds < 15  # no retry with backoff
    rc, _, err, _ = run(["estimate", "--model", "org/tiny"], closed, tmp_path / "hf", offline=True)
    assert rc == 2 and "HF_HUB_OFFLINE is set" in err


def test_a_local_model_folder_and_bad_ids(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    rc, out, err, _ = run(["estimate", "--model", str(folder), "--json"], "http://127.0.0.1:9", tmp_path / "hf")
    assert rc == 0, err
    assert "(local directory)" in json.loads(out)["setup"]["model"]["source"]
    for bad in ("../etc/passwd", "a/b/c", "org/na me", ""):
        rc, _, err, _ = run(["estimate", "--model", bad], "http://127.0.0.1:9", tmp_path / "hf")
        assert rc == 2 and "--model" in err and len(err.strip().splitlines()) == 1, (bad, err)


def test_the_window_fetches_a_hub_id_then_reads_it_from_the_cache(qtbot, hub_server: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Source "Hugging Face Hub id": typing never goes to the network (the field says to fetch); Fetch downloads
    the config on a worker thread and the estimate follows; a gated id is marked in the field and the last good
    result stays."""
    pytest.importorskip("pytestqt")
    from huggingface_hub import constants

    import memcalc_gui.hub as hub
    from memcalc_gui.ui.form import FormState
    from memcalc_gui.ui.main_window import MainWindow

    monkeypatch.setattr(constants, "ENDPOINT", hub_server)
    template = hub_server + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "USER_HF_OFFLINE", False)
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(tmp_path / "memcalc-cache"))
    w = MainWindow(persist=False)
    qtbot.addWidget(w)
    good = w.result
    w.apply_state(FormState().replace(model_kind="hub", hub_id="org/tiny"))
    assert not w.refresh()
    assert "fetch it from the Hub" in w.inputs.errors()["hub_id"] and w.result is good
    assert HubHandler.requests == []  # nothing was asked of the network while typing
    qtbot.mouseClick(w.inputs.fetch_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: w.result is not good and w.result.setup.model is not None
                    and w.result.setup.model.name == "org/tiny", timeout=15000)
    assert w.result.setup.num_params == spec_from_config(TINY).num_params
    assert "org/tiny" in w.statusBar().currentMessage()
    fetched = w.result
    w.apply_state(w.inputs.state().replace(hub_id="org/gated"))
    qtbot.mouseClick(w.inputs.fetch_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "gated" in w.inputs.errors().get("hub_id", ""), timeout=15000)
    assert w.result is fetched
    qtbot.waitUntil(w.inputs.fetch_button.isEnabled, timeout=5000)
    w.close()


@pytest.mark.full_suite
def test_the_issue_command_answers_from_the_bundled_config_without_network(hub_server: str, tmp_path: Path) -> None:
    """`--model Qwen/Qwen3-30B-A3B … --gpus 8 --strategy zero3`: not in the cache, so the published config memcalc
    bundles answers (the Hub is never asked), and the fitted method gives a per-GPU ledger of the MoE. (Checkpointed
    already, so the one calibration answers: without it, a setup that does not fit calibrates the checkpointing
    what-if too, which doubles the test's 20 s and is checked in test_unknown_family.)"""
    args = ["estimate", "--model", "Qwen/Qwen3-30B-A3B", "--batch", "2", "--seq", "4096", "--gpus", "8",
            "--strategy", "zero3", "--gpu", "h100-80gb", "--checkpointing", "full", "--json"]
    rc, out, err, _ = run(args, hub_server, tmp_path / "hf")
    assert rc == 0, err
    data = json.loads(out)
    assert HubHandler.requests == []
    assert data["method"] == "fitted" and data["per_gpu"] and data["strategy"] == "zero3" and data["gpus"] == 8
    assert data["params"] == 30_532_122_624 and data["active_params"] == 3_353_032_704
    step = data["phases"]["optimizer_step"]["objects"]
    # ZeRO-3 over 8: Adam's two fp32 moments (8 bytes per parameter) split 8 ways; 2 + 4 bytes of 16-bit weights and
    # fp32 master weights per parameter split too
    assert step["optimizer_state"] == pytest.approx(data["params"], rel=0.001)
    assert step["parameters"] == pytest.approx(6 * data["params"] / 8, rel=0.001)
    assert any("largest unit gathered" in a for a in data["assumptions"])
    assert data["suggestions"] and data["fits"] is False

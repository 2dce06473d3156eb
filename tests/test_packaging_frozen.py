"""The frozen (PyInstaller) app, when one has been built: skipped otherwise.

Build first with ``python packaging/build.py [--flavour lite|full]`` (writes ``dist/memcalc-<flavour>/``), or
point ``MEMCALC_FROZEN_APP`` at an unpacked folder. ``packaging/ci_check.sh`` builds and checks the lite app on
its own; these tests re-check whatever is in ``dist/`` from a normal pytest run.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from memcalc_gui import __version__

ROOT = Path(__file__).resolve().parent.parent
EXE = ".exe" if sys.platform == "win32" else ""
ERROR_MARKERS = ("Traceback", "Error", "error:", "Failed", "FAILED", "QThread")


def _apps() -> list[Path]:
    env = os.environ.get("MEMCALC_FROZEN_APP")
    candidates = [Path(env)] if env else [ROOT / "dist" / "memcalc-lite", ROOT / "dist" / "memcalc-full"]
    return [p for p in candidates if (p / f"memcalc-gui{EXE}").is_file() and (p / f"memcalc{EXE}").is_file()]


APPS = _apps()
pytestmark = pytest.mark.skipif(not APPS, reason="no frozen app built (python packaging/build.py)")


@pytest.fixture(params=APPS, ids=[p.name for p in APPS] or ["none"])
def app(request: pytest.FixtureRequest) -> Path:
    return Path(request.param)


def _is_lite(app: Path) -> bool:
    return not (app / "_internal" / "torch").exists()


def run(app: Path, exe: str, args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", MEMCALC_SETTINGS_DIR=str(tmp_path / "settings"),
               MEMCALC_LOG_DIR=str(tmp_path / "logs"), HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    return subprocess.run([str(app / f"{exe}{EXE}"), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=env)


def assert_clean(proc: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    bad = [line for line in out.splitlines() if any(m in line for m in ERROR_MARKERS)]
    assert not bad, out
    logs = tmp_path / "logs"
    assert not (logs.is_dir() and any(logs.iterdir())), "uncaught errors were logged"


def test_version(app: Path, tmp_path: Path) -> None:
    proc = run(app, "memcalc-gui", ["--version"], tmp_path)
    assert proc.stdout.strip() == f"memcalc-gui {__version__}"
    proc = run(app, "memcalc", ["--version"], tmp_path)
    assert proc.stdout.strip() == f"memcalc {__version__}"


def test_bundled_resources(app: Path) -> None:
    res = app / "_internal" / "resources"
    for rel in ("gpus.json", "models/qwen2.5-1.5b.json", "icons/memcalc.png", "icons/memcalc.svg",
                "fonts/DejaVuSans.ttf"):
        assert (res / rel).is_file(), rel


def test_smoke_test(app: Path, tmp_path: Path) -> None:
    proc = run(app, "memcalc-gui", ["--smoke-test"], tmp_path)
    assert_clean(proc, tmp_path)
    assert "memcalc-gui smoke ok" in proc.stdout


def test_screenshot(app: Path, tmp_path: Path) -> None:
    out = tmp_path / "shot.png"
    proc = run(app, "memcalc-gui", ["--preset", "llama-3.1-8b", "--gpu", "a100-80gb", "--screenshot", str(out)],
               tmp_path)
    assert_clean(proc, tmp_path)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 500 and len(data) > 20_000


def test_cli_estimate(app: Path, tmp_path: Path) -> None:
    proc = run(app, "memcalc", ["estimate", "--preset", "gpt2", "--gpu", "a100-80gb", "--json"], tmp_path)
    assert_clean(proc, tmp_path)
    assert json.loads(proc.stdout)["schema"] == 1


def test_bad_flag_is_one_line_and_status_2(app: Path, tmp_path: Path) -> None:
    proc = run(app, "memcalc-gui", ["--preset", "no-such-model", "--smoke-test"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_report_export(app: Path, tmp_path: Path) -> None:
    if run(app, "memcalc", ["report", "--help"], tmp_path).returncode != 0:
        pytest.skip("this build has no `memcalc report`")
    out = tmp_path / "x.pdf"
    proc = run(app, "memcalc", ["report", "--preset", "gpt2", "--out", str(out)], tmp_path)
    assert_clean(proc, tmp_path)
    assert out.read_bytes()[:5] == b"%PDF-"


def test_lite_has_no_torch(app: Path, tmp_path: Path) -> None:
    if not _is_lite(app):
        pytest.skip("full build")
    internal = app / "_internal"
    assert not (internal / "transformers").exists()
    assert not list(internal.glob("libtorch*"))
    proc = run(app, "memcalc", ["measure", "--preset", "gpt2", "--device", "cpu"], tmp_path)
    assert proc.returncode != 0 and "PyTorch" in proc.stdout + proc.stderr


def test_full_traces_and_measures(app: Path, tmp_path: Path) -> None:
    if _is_lite(app):
        pytest.skip("lite build")
    assert (app / "_internal" / "torch" / "bin" / f"torch_shm_manager{EXE}").is_file() or sys.platform == "win32"
    proc = run(app, "memcalc", ["estimate", "--preset", "gpt2", "--method", "trace", "--seq", "128", "--json"],
               tmp_path, timeout=300)
    assert_clean(proc, tmp_path)
    assert json.loads(proc.stdout)["schema"] == 1
    proc = run(app, "memcalc", ["measure", "--preset", "gpt2", "--device", "cpu", "--seq", "64", "--iterations", "2",
                                "--json"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    # a multi-GPU setup's ranks are spawned processes of the frozen executable itself (freeze_support)
    proc = run(app, "memcalc", ["measure", "--preset", "qwen2.5-0.5b", "--gpus", "2", "--tp", "2", "--seq", "64",
                                "--iterations", "2", "--json"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(json.loads(proc.stdout)["ranks"]) == 2

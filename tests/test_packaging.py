"""Resources are found the same way from an installed wheel as from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(proc.stderr[-2000:])
    return next(out.glob("memcalc_gui-*.whl"))


def test_wheel_contains_resources(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "memcalc_gui/resources/gpus.json" in names
    assert "memcalc_gui/resources/models/qwen2.5-1.5b.json" in names


def test_installed_wheel_finds_presets(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    code = ("import memcalc_gui, sys; from memcalc_gui.core.resources import resources_dir; "
            "from memcalc_gui.cli import main; d = resources_dir(); "
            "assert str(d).startswith(sys.argv[1]), d; print(d); "
            "sys.exit(main(['estimate', '--preset', 'qwen2.5-1.5b', '--gpu', 'a100-80gb', '--json']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    proc = subprocess.run([sys.executable, "-S", "-c", code.replace("sys.argv[1]", repr(str(target)))],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(target) in proc.stdout and '"schema": 1' in proc.stdout

"""``memcalc-gui`` / ``python -m memcalc_gui`` as scripts and CI use them (subprocesses, offscreen)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from memcalc_gui import __version__
from memcalc_gui.app import SCREENSHOT_SIZE, SMOKE_OK, build_parser
from memcalc_gui.core.resources import resources_dir
from memcalc_gui.ui.settings import SETTINGS_ENV

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT))
    env[SETTINGS_ENV] = str(tmp_path / "settings")
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_smoke_test_flag(tmp_path):
    proc = run(["-m", "memcalc_gui", "--smoke-test"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert SMOKE_OK in proc.stdout
    assert "Fits" in proc.stdout
    assert not (tmp_path / "settings" / "memcalc.ini").exists()  # scripted runs leave no settings


def test_screenshot_flag_writes_a_png(tmp_path):
    from PySide6.QtGui import QImage

    out = tmp_path / "shots" / "window.png"
    proc = run(["-m", "memcalc_gui", "--preset", "qwen2.5-7b", "--batch", "4", "--seq", "2048",
                "--precision", "mixed", "--gpu", "a100-80gb", "--screenshot", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Does not fit" in proc.stdout
    image = QImage(str(out))
    assert not image.isNull()
    assert (image.width(), image.height()) == SCREENSHOT_SIZE
    # Not a blank image: many distinct colours (bars, text).
    colours = {image.pixel(x, y) for x in range(0, image.width(), 17) for y in range(0, image.height(), 13)}
    assert len(colours) > 20


def test_torch_is_not_imported_at_startup(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        t0 = time.perf_counter()
        from memcalc_gui.app import create_application
        from memcalc_gui.ui.main_window import MainWindow
        app = create_application([])
        w = MainWindow(persist=False)
        w.show()
        app.processEvents()
        assert w.result is not None
        print("startup_s", round(time.perf_counter() - t0, 3))
        print("torch_loaded", "torch" in sys.modules, "transformers_loaded", "transformers" in sys.modules)
        w.close()
    """)
    proc = run(["-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "torch_loaded False transformers_loaded False" in proc.stdout
    # start-up time is a benchmark figure (README, docs/packaging.md), not a timed assertion


def test_version_and_bad_flags(tmp_path):
    proc = run(["-m", "memcalc_gui", "--version"], tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"memcalc-gui {__version__}"
    proc = run(["-m", "memcalc_gui", "--smoke-tset"], tmp_path)
    assert proc.returncode == 2 and "unrecognized" in proc.stderr
    proc = run(["-m", "memcalc_gui", "--preset", "no-such-model", "--smoke-test"], tmp_path)
    assert proc.returncode == 2
    assert "preset" in proc.stderr
    proc = run(["-m", "memcalc_gui", "--config", str(tmp_path / "missing.json"), "--smoke-test"], tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


def test_parser_accepts_the_documented_flags():
    argv = ["--preset", "gpt2", "--screenshot", "x.png", "-platform", "offscreen"]
    args, rest = build_parser().parse_known_args(argv)
    assert args.preset == "gpt2" and args.screenshot == "x.png"
    assert rest == ["-platform", "offscreen"]
    args, _ = build_parser().parse_known_args(["--config", "c.json", "--smoke-test"])
    assert args.config == "c.json" and args.smoke_test
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preset", "a", "--config", "b"])


def test_bundled_font_icon_and_licence(qapp):
    from PySide6.QtGui import QFontDatabase, QImage

    from memcalc_gui.app import create_application

    res = resources_dir()
    for name in ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "LICENSE-DejaVu.txt"):
        assert (res / "fonts" / name).is_file(), name
    assert "Bitstream" in (res / "fonts" / "LICENSE-DejaVu.txt").read_text(encoding="utf-8")
    app = create_application([])
    assert app is qapp
    assert "DejaVu Sans" in QFontDatabase.families()
    assert app.applicationName() == "memcalc" and app.organizationName() == "memcalc"
    png = QImage(str(res / "icons" / "memcalc.png"))
    assert (png.width(), png.height()) == (256, 256)
    assert (res / "icons" / "memcalc.svg").read_text(encoding="utf-8").lstrip().startswith("<?xml")
    assert not app.windowIcon().isNull()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fontconfig")
def test_bundled_font_becomes_the_default_without_system_fonts(tmp_path):
    conf = tmp_path / "fonts.conf"
    (tmp_path / "empty").mkdir()
    conf.write_text(f'<?xml version="1.0"?><fontconfig><dir>{tmp_path / "empty"}</dir>'
                    f'<cachedir>{tmp_path / "cache"}</cachedir></fontconfig>', encoding="utf-8")
    code = "from memcalc_gui.app import create_application; print('font', create_application([]).font().family())"
    env_run = dict(os.environ, FONTCONFIG_FILE=str(conf))
    env_run.pop("MEMCALC_BUNDLED_FONT", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=dict(env_run, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert "font DejaVu Sans" in proc.stdout


def test_icon_png_is_rendered_from_the_svg(qapp, tmp_path):
    from PySide6.QtGui import QImage

    from memcalc_gui.view.assets import icon_path, render_svg_png

    out = tmp_path / "icon.png"
    assert render_svg_png(icon_path("svg"), out, 256)
    got, want = QImage(str(out)), QImage(str(icon_path("png")))
    assert got.size() == want.size()
    # Qt releases round anti-aliased edges differently by one level; the shapes and colours must match
    worst = max(
        max(abs(a - b) for a, b in zip(got.pixelColor(x, y).getRgb(), want.pixelColor(x, y).getRgb(), strict=True))
        for y in range(want.height()) for x in range(want.width())
    )
    assert worst <= 2

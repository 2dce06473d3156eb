"""Build memcalc as a one-folder desktop app with PyInstaller, then check and archive it.

    python packaging/build.py                       # lite: no torch/transformers, ~225 MB, starts in < 1 s
    python packaging/build.py --flavour full        # full: torch + transformers, measurement and the trace work
    python packaging/build.py --dist /tmp/out       # put dist/memcalc-<flavour>/ and the archive elsewhere

Produces ``DIST/memcalc-<flavour>/`` with the executables ``memcalc-gui`` (the window) and ``memcalc`` (the
command line) side by side, presets/GPU table/icons/fonts under ``_internal/resources``, and next to it
``memcalc-<flavour>-<version>-<os>-<arch>.tar.gz`` (``.zip`` on Windows). On macOS PyInstaller also writes
``memcalc-<flavour>.app``. Run it with the Python of the environment that has memcalc's dependencies and
PyInstaller (``pip install pyinstaller``); see docs/packaging.md.

After building it checks: the resources are there; lite has no torch, full has torch (and
torch/bin/torch_shm_manager) and transformers; ``memcalc-gui --version`` runs frozen; lite stays under the size
budget. Exit status 0 only if all hold.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPEC = HERE / "memcalc.spec"
LITE_MAX_MB = 250

#: Debian/Ubuntu packages whose libraries Qt's xcb platform plugin needs. PyInstaller bundles only what it finds
#: on the build host: a host without them yields an app that cannot open a window on a user's desktop.
XCB_APT = ("libxcb-cursor0", "libxcb-icccm4", "libxcb-image0", "libxcb-keysyms1", "libxcb-randr0",
           "libxcb-render-util0", "libxcb-shape0", "libxcb-shm0", "libxcb-sync1", "libxcb-xfixes0", "libxcb-xkb1",
           "libxcb-glx0", "libx11-xcb1", "libxkbcommon-x11-0")


def version() -> str:
    sys.path.insert(0, str(ROOT))
    from memcalc_gui import __version__

    return __version__


def platform_tag() -> str:
    system = {"linux": "linux", "win32": "windows", "darwin": "macos"}.get(sys.platform, sys.platform)
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "arm64", "aarch64": "aarch64"}.get(machine, machine)
    return f"{system}-{machine}"


def folder_mb(path: Path) -> float:
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total / 1e6


def preflight(flavour: str, allow_missing_libs: bool) -> list[str]:
    """Problems that would give a broken app (empty list: none)."""
    problems: list[str] = []
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        problems.append(f"PyInstaller is not installed: {sys.executable} -m pip install 'pyinstaller>=6.22,<7'")
    for mod in ("PySide6", "pyqtgraph", "numpy"):
        try:
            __import__(mod)
        except ImportError:
            problems.append(f"{mod} is not importable from {sys.executable}: pip install -e . first")
    if flavour == "full":
        import importlib.util

        for mod in ("torch", "transformers"):
            if importlib.util.find_spec(mod) is None:
                problems.append(f"the full flavour bundles {mod}, which {sys.executable} cannot import: "
                                "pip install -e '.[measure,hf]' (a CPU torch: --index-url "
                                "https://download.pytorch.org/whl/cpu)")
    if not problems:
        problems += binding_problems()
    if sys.platform.startswith("linux"):
        if shutil.which("objdump") is None or shutil.which("ldd") is None:
            problems.append("objdump/ldd missing: install binutils (apt-get install binutils), or PyInstaller "
                            "cannot find the shared libraries to bundle")
        missing = missing_xcb_libs()
        if missing and not allow_missing_libs:
            problems.append("Qt's xcb plugin needs libraries this host lacks, so they would not be bundled and the "
                            f"window could not open on X11: {', '.join(missing)}.\n    apt-get install "
                            f"{' '.join(XCB_APT)}   (or pass --allow-missing-libs for an offscreen-only build)")
    return problems


def binding_problems() -> list[str]:
    """The bundled Python and Qt binding must not drop references to None (PySide6 6.12.0 on Python 3.11 does:
    the window aborts after a minute of typing). Checked by running the reproducer with this interpreter."""
    code = "from memcalc_gui.ui.soak import none_refcount_drift; print(none_refcount_drift())"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return ["the Qt binding check did not finish in 120 s"]
    last = proc.stdout.strip().splitlines()[-1:] or ["?"]
    if proc.returncode != 0 or (last[0] != "None" and not last[0].lstrip("-").isdigit()):
        return [f"the Qt binding check failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"]
    if last[0] != "None" and int(last[0]) < -1000:
        import PySide6

        return [f"PySide6 {PySide6.__version__} on Python {sys.version.split()[0]} drops references to None "
                f"({last[0]} over 2000 repaints): the packaged window would abort. Install "
                "'PySide6-Essentials>=6.6,<6.12' (6.11.3 is checked) or build with Python >= 3.12."]
    return []


def missing_xcb_libs() -> list[str]:
    try:
        import PySide6
    except ImportError:
        return []
    qt = Path(PySide6.__file__).parent / "Qt"
    missing: set[str] = set()
    libs = [qt / "plugins" / "platforms" / "libqxcb.so", *sorted((qt / "lib").glob("libQt6XcbQpa.so*"))[:1],
            *sorted((qt / "plugins" / "xcbglintegrations").glob("*.so"))]
    for lib in libs:
        if not lib.is_file() or shutil.which("ldd") is None:
            continue
        out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
        missing.update(line.split()[0] for line in out.splitlines() if "not found" in line)
    return sorted(missing)


def run_pyinstaller(flavour: str, dist: Path, work: Path, console: bool, clean: bool, pyz: bool) -> None:
    cmd = [sys.executable, "-m", "PyInstaller", str(SPEC), "--noconfirm", "--log-level", "WARN",
           "--distpath", str(dist), "--workpath", str(work)]
    if clean:
        cmd.append("--clean")
    cmd += ["--", "--flavour", flavour]
    if console:
        cmd.append("--console")
    if pyz:
        cmd.append("--archive")
    print("build: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def check_bundle(app: Path, flavour: str) -> list[str]:
    internal = app / "_internal"
    exe = ".exe" if sys.platform == "win32" else ""
    problems = [f"missing {name}" for name in (f"memcalc-gui{exe}", f"memcalc{exe}") if not (app / name).is_file()]
    res = internal / "resources"
    for rel in ("gpus.json", "models/gpt2.json", "icons/memcalc.png", "icons/memcalc.svg", "fonts/DejaVuSans.ttf"):
        if not (res / rel).is_file():
            problems.append(f"resource not bundled: resources/{rel}")
    has_torch = (internal / "torch").exists() or any(internal.glob("libtorch*"))
    if flavour == "lite" and has_torch:
        problems.append("the lite build contains torch (excludes in packaging/memcalc.spec do not hold)")
    if flavour == "lite" and (internal / "transformers").exists():
        problems.append("the lite build contains transformers")
    if flavour == "full":
        if not has_torch:
            problems.append("the full build has no torch")
        shm = internal / "torch" / "bin" / ("torch_shm_manager" + exe)
        if sys.platform != "win32" and not shm.is_file():
            problems.append(f"the full build lacks {shm.relative_to(app)} (torch's DataLoader shared memory)")
        if not (internal / "transformers").exists():
            problems.append("the full build has no transformers")
    if not any((internal / "PySide6").rglob("*QtOpenGL*")):
        problems.append("PySide6.QtOpenGL(Widgets) not bundled (pyqtgraph imports them)")
    return problems


def smoke_version(app: Path) -> tuple[bool, str]:
    exe = app / ("memcalc-gui.exe" if sys.platform == "win32" else "memcalc-gui")
    env = dict(os.environ, QT_QPA_PLATFORM=os.environ.get("QT_QPA_PLATFORM", "offscreen"))
    try:
        proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def add_linux_extras(app: Path) -> None:
    """The desktop-entry installer travels inside the folder, so an unpacked archive can register itself."""
    linux = HERE / "linux"
    for name in ("install-desktop.sh", "memcalc.desktop.in"):
        src = linux / name
        if src.is_file():
            shutil.copy2(src, app / name)
    readme = app / "README.txt"
    readme.write_text(
        f"memcalc {version()} ({app.name})\n\n"
        "  ./memcalc-gui              the window (--smoke-test, --screenshot PATH, --version, --preset NAME ...)\n"
        "  ./memcalc --help           the command line\n"
        "  ./install-desktop.sh       add memcalc to the desktop's application menu (~/.local/share/applications)\n"
        "  ./install-desktop.sh --uninstall\n\n"
        "Keep this folder where it is after installing the menu entry (the entry points here).\n"
        "Errors are logged to ~/.local/share/memcalc/memcalc/logs/memcalc-gui.log.\n",
        encoding="utf-8",
    )


def archive(app: Path, dist: Path, flavour: str, compresslevel: int) -> Path:
    stem = f"memcalc-{flavour}-{version()}-{platform_tag()}"
    top = f"memcalc-{flavour}-{version()}"
    if sys.platform == "win32":
        out = dist / f"{stem}.zip"
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as zf:
            for p in sorted(app.rglob("*")):
                zf.write(p, Path(top) / p.relative_to(app))
        return out
    out = dist / f"{stem}.tar.gz"
    with tarfile.open(out, "w:gz", compresslevel=compresslevel) as tf:
        tf.add(app, arcname=top)  # keeps the executables' mode bits and symlinks
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="packaging/build.py")
    p.add_argument("--flavour", choices=("lite", "full"), default="lite",
                   help="lite: without torch/transformers (default); full: with them")
    p.add_argument("--dist", type=Path, default=ROOT / "dist", help="output folder (default ./dist)")
    p.add_argument("--work", type=Path, help="PyInstaller's work folder (default ./build/pyinstaller-FLAVOUR)")
    p.add_argument("--clean", action="store_true", help="empty PyInstaller's cache and work folder first")
    p.add_argument("--no-archive", action="store_true", help="skip the .tar.gz / .zip")
    p.add_argument("--compresslevel", type=int, default=6, choices=range(1, 10), metavar="1-9",
                   help="gzip/zip level of the archive (default 6)")
    p.add_argument("--console", action="store_true",
                   help="Windows/macOS: build memcalc-gui with a console, so --smoke-test prints (debug/CI)")
    p.add_argument("--pyz", action="store_true",
                   help="modules in a PYZ inside each executable (PyInstaller's default) instead of shared .pyc files")
    p.add_argument("--allow-missing-libs", action="store_true",
                   help="Linux: build even if Qt's xcb libraries are missing on this host (offscreen-only app)")
    args = p.parse_args(argv)

    problems = preflight(args.flavour, args.allow_missing_libs)
    if problems:
        for line in problems:
            print(f"build: error: {line}", file=sys.stderr)
        return 1
    dist: Path = args.dist.expanduser().resolve()
    work: Path = (args.work or ROOT / "build" / f"pyinstaller-{args.flavour}").expanduser().resolve()
    app = dist / f"memcalc-{args.flavour}"

    t0 = time.perf_counter()
    try:
        run_pyinstaller(args.flavour, dist, work, args.console, args.clean, args.pyz)
    except subprocess.CalledProcessError as exc:
        print(f"build: error: PyInstaller failed (exit {exc.returncode})", file=sys.stderr)
        return 1
    build_s = time.perf_counter() - t0
    if sys.platform.startswith("linux"):
        add_linux_extras(app)

    problems = check_bundle(app, args.flavour)
    ok, line = smoke_version(app)
    if not ok:
        problems.append(f"the frozen memcalc-gui --version failed: {line[-2000:]}")
    size = folder_mb(app)
    if args.flavour == "lite" and size > LITE_MAX_MB:
        problems.append(f"the lite folder is {size:.0f} MB, over the {LITE_MAX_MB} MB budget")

    archive_path = None
    if not args.no_archive and not problems:
        t1 = time.perf_counter()
        archive_path = archive(app, dist, args.flavour, args.compresslevel)
        archive_s = time.perf_counter() - t1

    print(f"build: {app}  ({size:.0f} MB, PyInstaller {build_s:.0f} s)  {line if ok else ''}")
    if archive_path is not None:
        print(f"build: {archive_path}  ({archive_path.stat().st_size / 1e6:.0f} MB, {archive_s:.0f} s)")
    for line in problems:
        print(f"build: error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

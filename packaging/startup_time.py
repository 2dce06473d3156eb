"""Time a built app from spawn to a shown window, cold and warm (the figures in docs/packaging.md).

    python packaging/startup_time.py dist/memcalc-lite            # warm only
    sudo python packaging/startup_time.py dist/memcalc-lite --cold  # + cold: drops the page cache first (root)
    xvfb-run -a python packaging/startup_time.py dist/memcalc-lite --cold   # + "window mapped" on a real X server

Two measurements:
  smoke   wall time of ``memcalc-gui --smoke-test`` offscreen: spawn, window shown, one estimate, close, exit
          (an upper bound of start-to-shown);
  mapped  with an X display and ``xwininfo``: spawn ``memcalc-gui`` normally and poll every 5 ms until its main
          window is mapped on the X server, then terminate it (start-to-shown, as a user sees it).
Cold = after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (needs root); without permission the first run is
reported as "first run" instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TITLE = "memcalc — GPU memory"


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def env_for(tmp: str, platform: str | None) -> dict[str, str]:
    env = dict(os.environ, MEMCALC_SETTINGS_DIR=tmp, MEMCALC_LOG_DIR=os.path.join(tmp, "logs"))
    if platform:
        env["QT_QPA_PLATFORM"] = platform
    return env


def time_smoke(exe: Path, tmp: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([str(exe), "--smoke-test"], capture_output=True, text=True, env=env_for(tmp, "offscreen"))
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"--smoke-test failed:\n{proc.stdout}{proc.stderr}")
    return dt


def window_mapped() -> bool:
    out = subprocess.run(["xwininfo", "-root", "-tree"], capture_output=True, text=True).stdout
    return any(TITLE in line and "x" in line for line in out.splitlines())


def time_mapped(exe: Path, tmp: str, timeout: float = 30.0) -> float:
    if window_mapped():
        raise SystemExit("a memcalc window is already open on this display; close it first")
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(exe)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env_for(tmp, "xcb"))
    try:
        while time.perf_counter() - t0 < timeout:
            if window_mapped():
                return time.perf_counter() - t0
            if proc.poll() is not None:
                raise SystemExit(f"memcalc-gui exited with {proc.returncode} before showing a window")
            time.sleep(0.005)
        raise SystemExit(f"no window after {timeout} s")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("app", type=Path, help="the built folder, e.g. dist/memcalc-lite")
    p.add_argument("--cold", action="store_true", help="also a cold start (drops the page cache; needs root)")
    p.add_argument("--runs", type=int, default=5, help="warm runs (median reported; default 5)")
    args = p.parse_args()
    exe = args.app / ("memcalc-gui.exe" if sys.platform == "win32" else "memcalc-gui")
    if not exe.is_file():
        raise SystemExit(f"{exe} not found: build it with packaging/build.py")
    x11 = bool(os.environ.get("DISPLAY")) and shutil.which("xwininfo") is not None
    kinds = [("smoke", time_smoke)] + ([("mapped", time_mapped)] if x11 else [])
    with tempfile.TemporaryDirectory() as tmp:
        for kind, fn in kinds:
            if args.cold:
                label = "cold" if drop_caches() else "first run (no permission to drop caches)"
                print(f"{args.app.name} {kind:6s} {label}: {fn(exe, tmp):.2f} s", flush=True)
            fn(exe, tmp)  # warm-up
            runs = [fn(exe, tmp) for _ in range(args.runs)]
            print(f"{args.app.name} {kind:6s} warm: median {statistics.median(runs):.2f} s "
                  f"(min {min(runs):.2f}, max {max(runs):.2f}, {len(runs)} runs)", flush=True)
        if not x11:
            print("(no X display or xwininfo: 'mapped' skipped; run under xvfb-run -a for it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

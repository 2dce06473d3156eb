"""``memcalc-gui``: the desktop window, plus flags for scripts and CI.

    memcalc-gui                          open the window (last setup, or the default)
    memcalc-gui --preset llama-3.1-8b    start from a preset (or --config PATH, --params 1.5B)
    memcalc-gui --screenshot out.png     render the window to a PNG and exit
    memcalc-gui --smoke-test             start, estimate, close; print "memcalc-gui smoke ok"
    memcalc-gui --soak 3600              use the window by script for an hour; print a summary

torch is never imported here: the window opens in well under a second.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__

SMOKE_OK = "memcalc-gui smoke ok"
SCREENSHOT_SIZE = (1360, 880)

# ---------------------------------------------------------------------------------------------- uncaught errors
#: Set to a folder to write the error log there instead of the user's log directory (tests, CI, portable use).
LOG_ENV = "MEMCALC_LOG_DIR"
LOG_NAME = "memcalc-gui.log"


class _Crashes:
    """Uncaught errors seen while :func:`main` runs (any thread)."""

    scripted = True  # --smoke-test / --screenshot (or not decided yet): no dialog, the exit status says it
    errors: list[str] = []  # noqa: RUF012
    bridge: Any = None  # QObject in the GUI thread that shows the dialog (signals cross threads)
    box: Any = None  # the dialog on screen, reused while it is open


def log_dir() -> Path:
    """``QStandardPaths.AppLocalDataLocation/logs`` (``MEMCALC_LOG_DIR`` overrides).

    Linux ``~/.local/share/memcalc/memcalc/logs``, macOS ``~/Library/Application Support/memcalc/memcalc/logs``,
    Windows ``%LOCALAPPDATA%\\memcalc\\memcalc\\logs``.
    """
    override = os.environ.get(LOG_ENV)
    if override:
        return Path(override).expanduser()
    try:
        from PySide6.QtCore import QCoreApplication, QStandardPaths

        if not QCoreApplication.organizationName():
            QCoreApplication.setOrganizationName("memcalc")
        if QCoreApplication.instance() is None or not QCoreApplication.applicationName():
            QCoreApplication.setApplicationName("memcalc")
        location = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppLocalDataLocation)
        if location:
            return Path(location) / "logs"
    except Exception:  # the fallback below is the same place, computed by hand
        pass
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "memcalc" / "memcalc" / "logs"


def _write_log(text: str) -> Path | None:
    try:
        folder = log_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOG_NAME
        if path.is_file() and path.stat().st_size > 1_000_000:
            path.replace(path.with_name(LOG_NAME + ".1"))
        build = "frozen" if getattr(sys, "frozen", False) else "python"
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        with path.open("a", encoding="utf-8") as fh:
            fh.write(f"=== {stamp} memcalc-gui {__version__} ({build}, {sys.platform}) pid {os.getpid()}\n{text}\n")
        return path
    except OSError:
        return None


def _report_uncaught(exc_type: Any, exc: Any, tb: Any, thread: str | None = None, fatal: bool = False) -> None:
    """Log an uncaught error, print it, and show it in a dialog (never a silent exit)."""
    if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    where = f" in thread {thread!r}" if thread else ""
    text = f"uncaught error{where}:\n" + "".join(traceback.format_exception(exc_type, exc, tb))
    _Crashes.errors.append(text)
    path = _write_log(text)
    note = f"details written to {path}" if path else f"could not write the log in {log_dir()}"
    if sys.stderr is not None:  # None in a windowed (no console) frozen app on Windows/macOS
        try:
            sys.stderr.write(f"memcalc-gui: {text}memcalc-gui: {note}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    if _Crashes.scripted:
        return
    summary = f"{exc_type.__name__}: {exc}" if exc_type is not None else "unknown error"
    if fatal:
        _crash_dialog(summary, text, note, fatal=True)
    elif _Crashes.bridge is not None:
        _Crashes.bridge.raised.emit(summary, text, note)  # queued to the GUI thread when raised elsewhere


def _excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
    _report_uncaught(exc_type, exc, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else None
    _report_uncaught(args.exc_type, args.exc_value, args.exc_traceback, thread=name or "?")


def _crash_dialog(summary: str, details: str, note: str, fatal: bool = False) -> None:
    """The error dialog (GUI thread only): non-modal while the window runs, modal before a fatal exit."""
    try:
        from PySide6.QtWidgets import QApplication, QMessageBox

        app = QApplication.instance()
        if app is None and fatal:
            app = QApplication([sys.argv[0] if sys.argv else "memcalc-gui"])
        if app is None or QApplication.platformName() in ("offscreen", "minimal"):
            return
        box = _Crashes.box
        if box is not None and box.isVisible():  # one dialog at a time: count the rest
            box.setInformativeText(f"{len(_Crashes.errors)} errors so far; {note}.")
            return
        box = QMessageBox(QMessageBox.Icon.Critical, "memcalc — unexpected error",
                          f"memcalc hit an unexpected error:\n{summary}" + (
                              "\n\nmemcalc has to close." if fatal else
                              "\n\nThe window keeps running, but results may be stale; restarting is safest."))
        box.setInformativeText(f"{note}.")
        box.setDetailedText(details)
        if fatal:
            box.exec()
        else:
            _Crashes.box = box
            box.open()
    except Exception:  # the error is already logged and printed; never fail while reporting
        pass


def _install_crash_bridge(app: Any) -> None:
    """A GUI-thread object whose signal shows the dialog, so errors from worker threads reach it safely."""
    from PySide6.QtCore import QObject, Signal, Slot

    class CrashBridge(QObject):
        raised = Signal(str, str, str)

        @Slot(str, str, str)
        def show_dialog(self, summary: str, details: str, note: str) -> None:
            _crash_dialog(summary, details, note)

    bridge = CrashBridge(app)
    bridge.raised.connect(bridge.show_dialog)  # a bound slot of a GUI-thread object: queued from other threads
    _Crashes.bridge = bridge


def build_parser() -> argparse.ArgumentParser:
    from .core.setup import OPTIMIZERS, PRECISIONS

    p = argparse.ArgumentParser(
        prog="memcalc-gui",
        description="How much GPU memory one training step needs, phase by phase — and whether it fits.",
    )
    p.add_argument("--version", action="version", version=f"memcalc-gui {__version__}")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", metavar="NAME", help="start from a built-in model preset")
    model.add_argument("--config", metavar="PATH", help="start from a Hugging Face config.json")
    model.add_argument("--model", metavar="ORG/NAME",
                       help="start from a Hugging Face Hub id (from the local cache; the window's Fetch downloads it)")
    model.add_argument("--params", metavar="N", help="start from a bare parameter count (1.5B, 350M): method quick")
    p.add_argument("--batch", metavar="B", help="micro-batch")
    p.add_argument("--seq", metavar="L", help="sequence length")
    p.add_argument("--grad-accum", metavar="K", help="gradient accumulation steps")
    p.add_argument("--precision", choices=PRECISIONS)
    p.add_argument("--optimizer", metavar="NAME", help=", ".join(OPTIMIZERS))
    p.add_argument("--optimizer-impl", metavar="IMPL", help="foreach, single-tensor or fused")
    p.add_argument("--attention", choices=("sdpa", "eager"))
    p.add_argument("--checkpointing", choices=("none", "full"))
    p.add_argument("--gpu", metavar="NAME", help="GPU preset id or name (a100-80gb, 'RTX 4090')")
    p.add_argument("--capacity", metavar="SIZE", help="device capacity (80GiB, 24GB); overrides --gpu's")
    p.add_argument("--screenshot", metavar="PATH", help="render the window to a PNG and exit")
    p.add_argument("--smoke-test", action="store_true", help="start, estimate, close; print a line; exit 0")
    p.add_argument("--soak", metavar="SECONDS", type=_seconds,
                   help="self-test: use the window by script for SECONDS (edits, dialogs, traces, measurements, "
                        "hostile files), print a summary and exit 0 if it survived")
    p.add_argument("--soak-seed", metavar="N", type=int, default=1, help=argparse.SUPPRESS)
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= 7 * 24 * 3600:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and a week, got {text!r}")
    return value


def _state_from_args(args: argparse.Namespace):  # -> FormState | None
    """The starting form for the given flags (``None``: none given, restore the last setup)."""
    from .core.errors import InputError
    from .core.setup import find_gpu
    from .ui.form import FormState, ModelCache, build_setup, capacity_text, default_state

    flags = ("preset", "config", "params", "batch", "seq", "grad_accum", "precision", "optimizer", "optimizer_impl",
             "attention", "checkpointing", "gpu", "capacity")
    if all(getattr(args, f) is None for f in flags) and not (args.screenshot or args.smoke_test or args.soak):
        return None
    state: FormState = default_state()
    if args.preset is not None:
        state = state.replace(model_kind="preset", preset=args.preset.strip().lower())
    elif args.config is not None:
        state = state.replace(model_kind="config", config_path=str(Path(args.config).expanduser().resolve()))
    elif args.model is not None:
        state = state.replace(model_kind="hub", hub_id=args.model.strip())
    elif args.params is not None:
        state = state.replace(model_kind="params", params=args.params)
    for name in ("batch", "seq", "grad_accum", "precision", "optimizer", "optimizer_impl", "attention",
                 "checkpointing"):
        value = getattr(args, name)
        if value is not None:
            state = state.replace(**{name: value})
    if args.gpu is not None:
        try:
            gpu = find_gpu(args.gpu)
        except InputError as exc:
            raise SystemExit(f"memcalc-gui: error: {exc}") from None
        state = state.replace(gpu=gpu.id, capacity=capacity_text(gpu))
    if args.capacity is not None:
        state = state.replace(gpu="", capacity=args.capacity)
    try:
        build_setup(state, ModelCache())
    except Exception as exc:  # FormErrors or InputError: say which flag is wrong
        errors = getattr(exc, "errors", None) or {"input": str(exc)}
        text = "; ".join(f"{k}: {v}" for k, v in errors.items())
        raise SystemExit(f"memcalc-gui: error: {text}") from None
    return state


def create_application(argv: Sequence[str] | None = None):  # -> QApplication
    """The ``QApplication`` with names, the bundled fonts and the icon (reuses an existing instance)."""
    from PySide6.QtWidgets import QApplication

    from .ui.settings import APPLICATION, ORGANIZATION
    from .view.assets import app_icon, register_fonts

    app = QApplication.instance()
    if app is None:
        app = QApplication([sys.argv[0] if sys.argv else "memcalc-gui", *(argv or [])])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationVersion(__version__)
    app.setDesktopFileName("memcalc")
    register_fonts(app)
    app.setWindowIcon(app_icon())
    return app


def screenshot(window, path: str | Path, size: tuple[int, int] = SCREENSHOT_SIZE) -> bool:
    """Render ``window`` at ``size`` to a PNG."""
    from PySide6.QtWidgets import QApplication

    window.resize(*size)
    window.show()
    for _ in range(3):
        QApplication.processEvents()
    window.refresh()
    QApplication.processEvents()
    out = Path(path).expanduser()
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    return window.grab().save(str(out), "PNG")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the window or a scripted mode; uncaught errors (any thread) are logged to :func:`log_dir`, printed,
    and shown in a dialog — and make ``--smoke-test`` / ``--screenshot`` exit 1."""
    previous = sys.excepthook, threading.excepthook
    sys.excepthook, threading.excepthook = _excepthook, _thread_excepthook
    _Crashes.scripted, _Crashes.errors, _Crashes.bridge, _Crashes.box = True, [], None, None
    try:
        status = _main(argv)
    except Exception:
        _report_uncaught(*sys.exc_info(), fatal=True)
        return 1
    finally:
        sys.excepthook, threading.excepthook = previous
    if _Crashes.errors and _Crashes.scripted:
        print(f"memcalc-gui: FAILED: {len(_Crashes.errors)} uncaught error(s), see {log_dir() / LOG_NAME}",
              file=sys.stderr)
        return 1
    return status


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, qt_args = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    unknown = [a for a in qt_args if a.startswith("--")]
    if unknown:  # Qt's own options have one dash (-platform, -style); a typo of ours should not pass silently
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _Crashes.scripted = bool(args.screenshot or args.smoke_test or args.soak)
    try:
        initial = _state_from_args(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    app = create_application(qt_args)
    _install_crash_bridge(app)

    from .ui.main_window import MainWindow

    scripted = bool(args.screenshot or args.smoke_test or args.soak)
    window = MainWindow(initial_state=initial, persist=not scripted)
    if args.screenshot:
        ok = screenshot(window, args.screenshot)
        print(window.headline())
        window.close()
        if not ok:
            print(f"memcalc-gui: error: could not write {args.screenshot}", file=sys.stderr)
            return 1
        print(f"wrote {args.screenshot}")
        return 0
    if args.smoke_test:
        window.show()
        app.processEvents()
        ok = window.refresh() and window.result is not None
        headline = window.headline()
        window.close()
        app.processEvents()
        if not ok:
            print("memcalc-gui smoke FAILED: " + "; ".join(f"{k}: {v}" for k, v in window.inputs.errors().items()),
                  file=sys.stderr)
            return 1
        print(headline)
        print(SMOKE_OK)
        return 0
    window.show()
    _close_on_signals(window)
    outcome: dict[str, Any] = {}
    if args.soak:
        from .ui.soak import SOAK_OK, Soak

        soak = Soak(window, args.soak, seed=args.soak_seed)
        soak.done.connect(lambda line, ok: outcome.update(line=line, ok=ok))
        soak.start()
    status = app.exec()
    if args.soak:
        print(f"memcalc-gui soak: {outcome.get('line', 'interrupted before the end')}", flush=True)
        if outcome.get("ok") and not _Crashes.errors:
            print(SOAK_OK, flush=True)
        else:
            status = 1
    from .ui.workers import running_orphans

    if running_orphans():  # a job that could not stop within a second: leave now rather than wait or abort
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)
    return status


def _close_on_signals(window: Any) -> None:
    """Ctrl+C (SIGINT) and SIGTERM close the window as its close button does (settings saved, workers stopped).

    Python runs signal handlers only between bytecodes, so a timer wakes the interpreter while Qt waits.
    """
    import signal

    from PySide6.QtCore import QTimer

    def close(*_: Any) -> None:
        window.close()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, OSError):  # not the main thread, or a platform without it
            signal.signal(sig, close)
    timer = QTimer(window)
    timer.setInterval(200)
    timer.timeout.connect(lambda: None)
    timer.start()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""``memcalc-gui``: the desktop window, plus flags for scripts and CI.

    memcalc-gui                          open the window (last setup, or the default)
    memcalc-gui --preset llama-3.1-8b    start from a preset (or --config PATH, --params 1.5B)
    memcalc-gui --screenshot out.png     render the window to a PNG and exit
    memcalc-gui --smoke-test             start, estimate, close; print "memcalc-gui smoke ok"

torch is never imported here: the window opens in well under a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__

SMOKE_OK = "memcalc-gui smoke ok"
SCREENSHOT_SIZE = (1360, 880)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memcalc-gui",
        description="How much GPU memory one training step needs, phase by phase — and whether it fits.",
    )
    p.add_argument("--version", action="version", version=f"memcalc-gui {__version__}")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", metavar="NAME", help="start from a built-in model preset")
    model.add_argument("--config", metavar="PATH", help="start from a Hugging Face config.json")
    model.add_argument("--params", metavar="N", help="start from a bare parameter count (1.5B, 350M): method quick")
    p.add_argument("--batch", metavar="B", help="micro-batch")
    p.add_argument("--seq", metavar="L", help="sequence length")
    p.add_argument("--grad-accum", metavar="K", help="gradient accumulation steps")
    p.add_argument("--precision", choices=("fp32", "mixed", "bf16"))
    p.add_argument("--optimizer", metavar="NAME", help="adamw, adam, adamw-8bit, sgd, sgd-momentum, adafactor, lion")
    p.add_argument("--optimizer-impl", metavar="IMPL", help="foreach, single-tensor or fused")
    p.add_argument("--attention", choices=("sdpa", "eager"))
    p.add_argument("--checkpointing", choices=("none", "full"))
    p.add_argument("--gpu", metavar="NAME", help="GPU preset id or name (a100-80gb, 'RTX 4090')")
    p.add_argument("--capacity", metavar="SIZE", help="device capacity (80GiB, 24GB); overrides --gpu's")
    p.add_argument("--screenshot", metavar="PATH", help="render the window to a PNG and exit")
    p.add_argument("--smoke-test", action="store_true", help="start, estimate, close; print a line; exit 0")
    return p


def _state_from_args(args: argparse.Namespace):  # -> FormState | None
    """The starting form for the given flags (``None``: none given, restore the last setup)."""
    from .core.errors import InputError
    from .core.setup import find_gpu
    from .ui.form import FormState, ModelCache, build_setup, capacity_text, default_state

    flags = ("preset", "config", "params", "batch", "seq", "grad_accum", "precision", "optimizer", "optimizer_impl",
             "attention", "checkpointing", "gpu", "capacity")
    if all(getattr(args, f) is None for f in flags) and not (args.screenshot or args.smoke_test):
        return None
    state: FormState = default_state()
    if args.preset is not None:
        state = state.replace(model_kind="preset", preset=args.preset.strip().lower())
    elif args.config is not None:
        state = state.replace(model_kind="config", config_path=str(Path(args.config).expanduser().resolve()))
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

    from .ui.assets import app_icon, register_fonts
    from .ui.settings import APPLICATION, ORGANIZATION

    app = QApplication.instance()
    if app is None:
        app = QApplication([sys.argv[0] if sys.argv else "memcalc-gui", *(argv or [])])
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationVersion(__version__)
    app.setDesktopFileName("memcalc-gui")
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
    parser = build_parser()
    args, qt_args = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    unknown = [a for a in qt_args if a.startswith("--")]
    if unknown:  # Qt's own options have one dash (-platform, -style); a typo of ours should not pass silently
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        initial = _state_from_args(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    app = create_application(qt_args)

    from .ui.main_window import MainWindow

    scripted = bool(args.screenshot or args.smoke_test)
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
    return app.exec()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

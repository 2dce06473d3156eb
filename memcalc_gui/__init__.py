"""memcalc: how much GPU memory one training step needs, phase by phase."""

import builtins as _builtins
import os as _os

__version__ = "0.1.0"

#: The interpreter's ``__import__`` as memcalc_gui found it: the window's entry point imports this package before
#: PySide6, which wraps ``__import__`` for its ``__feature__`` switch (``memcalc_gui.measure.plain_imports``).
INTERPRETER_IMPORT = _builtins.__import__

#: Whether the user keeps the Hugging Face Hub offline, read before memcalc sets ``HF_HUB_OFFLINE`` for its own
#: model building (``memcalc_gui.hub`` fetches a config only when the user's own setting allows it).
USER_HF_OFFLINE: bool = (_os.environ.get("HF_HUB_OFFLINE") or _os.environ.get("TRANSFORMERS_OFFLINE") or "").strip() \
    .upper() in ("1", "ON", "YES", "TRUE")


def install_hint(extra: str = "measure") -> str:
    """How to get an optional extra (``measure``: PyTorch and transformers; ``lora``: peft and bitsandbytes) for
    this kind of install."""
    import sys

    if getattr(sys, "frozen", False):
        return "this is the lite build; use the memcalc-full build to measure and trace"
    return f"pip install 'memcalc-gui[{extra}]'"

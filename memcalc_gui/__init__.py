"""memcalc: how much GPU memory one training step needs, phase by phase."""

__version__ = "0.1.0"


def install_hint(extra: str = "measure") -> str:
    """How to get an optional extra (``measure``: PyTorch and transformers; ``lora``: peft and bitsandbytes) for
    this kind of install."""
    import sys

    if getattr(sys, "frozen", False):
        return "this is the lite build; use the memcalc-full build to measure and trace"
    return f"pip install 'memcalc-gui[{extra}]'"

"""memcalc: how much GPU memory one training step needs, phase by phase."""

__version__ = "0.1.0"


def install_hint() -> str:
    """How to get PyTorch and transformers for measuring and tracing, for this kind of install."""
    import sys

    if getattr(sys, "frozen", False):
        return "this is the lite build; use the memcalc-full build to measure and trace"
    return "pip install 'memcalc-gui[measure]'"

"""memcalc: how much GPU memory one training step needs, phase by phase."""

__version__ = "0.1.0"

"""``python -m memcalc_gui``: the desktop window (same flags as ``memcalc-gui``)."""

from memcalc_gui.app import main

if __name__ == "__main__":  # a measurement's rank processes (spawn) import this module again: not a second window
    raise SystemExit(main())

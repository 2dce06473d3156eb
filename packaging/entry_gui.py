"""PyInstaller entry point of the ``memcalc-gui`` executable (the window)."""

import multiprocessing

from memcalc_gui.app import main

if __name__ == "__main__":
    # a multi-GPU measurement starts its ranks with spawn, which re-runs this executable: freeze_support makes such a
    # child run its rank and exit instead of opening a second window
    multiprocessing.freeze_support()
    raise SystemExit(main())

"""PyInstaller entry point of the ``memcalc`` executable (the command line)."""

import multiprocessing

from memcalc_gui.cli import entry

if __name__ == "__main__":
    multiprocessing.freeze_support()  # the ranks of a multi-GPU measurement (spawn) re-run this executable
    entry()

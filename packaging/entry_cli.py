"""PyInstaller entry point of the ``memcalc`` executable (the command line)."""

from memcalc_gui.cli import entry

entry()

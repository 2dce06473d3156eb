"""PyInstaller entry point of the ``memcalc-gui`` executable (the window)."""

from memcalc_gui.app import main

raise SystemExit(main())

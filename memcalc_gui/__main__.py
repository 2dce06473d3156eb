"""``python -m memcalc_gui``: the desktop window (same flags as ``memcalc-gui``)."""

from memcalc_gui.app import main

raise SystemExit(main())

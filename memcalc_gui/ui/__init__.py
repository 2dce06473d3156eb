"""memcalc_gui.ui: the desktop window (PySide6 + pyqtgraph). Nothing here computes memory; every number
comes from ``memcalc_gui.core``."""

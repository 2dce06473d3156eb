"""The view layer the window and the report share: the chart, the plan text, the theme, fonts and icons.

``ui/`` (the window) and ``report/`` (PDF/PNG export) both import it; ``report/`` never imports ``ui/``.
"""

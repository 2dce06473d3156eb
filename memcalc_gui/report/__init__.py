"""The budget report: the estimate, verdict, suggestions and sources as a PDF or one PNG image.

``export_report(result, "report.pdf")`` is the whole API; the window (File → Export report…) and
``memcalc report`` call it.
"""

from __future__ import annotations

from .export import (
    PAGES,
    ReportError,
    ReportFile,
    ReportWriteError,
    default_page,
    export_report,
    report_format,
    write_report,
)

__all__ = [
    "PAGES",
    "ReportError",
    "ReportFile",
    "ReportWriteError",
    "default_page",
    "export_report",
    "report_format",
    "write_report",
]

"""Reports to share: a CSV in msprobe's column names plus dumpstore's, and one self-contained HTML page.

`analyze` runs the comparison, the divergence verdict and the overflow scan once; `write_csv` and
`render_html` / `write_html` render them.  Modules: `data` (what is rendered), `csvfile` (the CSV's columns
and rows), `csvcols` (its cells by column), `csvwrite` (writing it),
`figures` (the charts and training curves), `rows` (every compared row for the page's table), `culprit` (the
culprit in words), `sections` (the page's markup), `page` (the page, from the files in `assets/`), `text`
(the verdict line and number formatting).
"""

from __future__ import annotations

# the names below that are not in __all__ were module-level names of the former report.py: still importable here
from .csvfile import (  # noqa: F401
    CSV_COLUMNS,
    DUMPSTORE_COLUMNS,
    MSPROBE_COLUMNS,
    RESULT_OF_STATUS,
    csv_rows,
)
from .csvwrite import write_csv
from .data import ReportData, analyze
from .figures import BACKWARD, MAX_HEAT_COLUMNS, MAX_POINTS  # noqa: F401
from .page import _json_for_script, plotly_js, render_html, write_html, write_report_html  # noqa: F401
from .sections import MAX_TABLE_ROWS  # noqa: F401
from .text import summary_line

__all__ = [
    "CSV_COLUMNS",
    "ReportData",
    "analyze",
    "csv_rows",
    "plotly_js",
    "render_html",
    "summary_line",
    "write_csv",
    "write_html",
]

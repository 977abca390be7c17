"""The HTML report: one self-contained page (verdict, charts, top rows, stacks, checklist, health, runs).

plotly.js is embedded (a partial build shipped in assets/, see assets/PLOTLY.md), so the file works offline.  The page's
markup, script and style are asset files beside this module (assets/page.html, guard.js, main.js,
report.css), read with importlib.resources.  Every string that comes from a dump (names, paths, stack lines)
is untrusted: it is HTML-escaped in markup and in plotly labels, and JSON inside <script> has `<`, `>` and
`&` as \\u escapes.  A Content-Security-Policy lets only the page's own scripts run (by SHA-256 hash) and
forbids any network access, so even a missed escape cannot run a script.  Script errors and CSP violations
are written into `#js-errors` (empty when all is well).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from dumpstore.errors import DumpstoreError

from ..checklist import Checklist
from ..compare import Comparison
from ..divergence import Verdict
from ..health import HealthReport
from ..overflow import OverflowReport
from . import sections
from .data import ReportData
from .figures import MAX_POINTS, focus, heat_figure, line_figure, per_op, prepared
from .sections import MAX_TABLE_ROWS
from .text import esc, write_text

__all__ = ["plotly_js", "render_html", "write_html", "write_report_html"]

_SLOT = re.compile(r"\{\{(\w+)\}\}")


@functools.cache
def asset(name: str) -> str:
    """The text of one of the page's asset files (assets/<name>)."""
    return importlib.resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def plotly_js() -> str:
    """The partial plotly.js build shipped with the report (assets/plotly-report.min.js; see assets/PLOTLY.md)."""
    try:
        text = asset("plotly-report.min.js")
    except OSError as exc:
        raise DumpstoreError(f"the HTML report's plotly.js (dumpstore/analysis/report/assets/plotly-report.min.js) "
                             f"cannot be read ({exc}); reinstall dumpstore, or write only --csv") from None
    # never end the <script> element early (the file has no such text today; the hash covers the result)
    return re.sub(r"</(script)", r"<\\/\1", text, flags=re.IGNORECASE)


def write_html(cmp: Comparison, verdict: Verdict, overflow_report: OverflowReport | None, store,
               path: str | Path, **options: Any) -> int:
    """Write render_html(...) to `path`; returns the file size in bytes (options: see render_html)."""
    return write_text(render_html(cmp, verdict, overflow_report, store, **options), path)


def write_report_html(data: ReportData, store, path: str | Path, **options: Any) -> int:
    """The HTML page of `analyze(...)`, with the checklist and health sections."""
    return write_text(render_html(data.cmp, data.verdict, data.overflow, store, checklist_report=data.checklist,
                                  health_report=data.health, **options), path)


def render_html(cmp: Comparison, verdict: Verdict, overflow_report: OverflowReport | None = None, store=None,
                *, max_table_rows: int = MAX_TABLE_ROWS, max_points: int = MAX_POINTS,
                generated_at: str | None = None, checklist_report: Checklist | None = None,
                health_report: HealthReport | None = None) -> str:
    """One self-contained HTML page: verdict, charts, top mismatches, culprit's stack, run metadata."""
    rows = prepared(cmp.rows)
    ops = per_op(rows)
    focus_rank, focus_step = focus(verdict, ops)
    figs = {"line": line_figure(ops, verdict, focus_rank, max_points)}
    steps = sorted(ops["step"].unique().to_list())
    ranks = sorted(ops["rank"].unique().to_list())
    if len(steps) > 1:
        figs["steps"] = heat_figure(ops.filter(pl.col("rank") == focus_rank), "step", verdict,
                                    f"rel_l2 by step and {{cols}} (rank {focus_rank}, max over output leaves)")
    if len(ranks) > 1:
        figs["ranks"] = heat_figure(ops.filter(pl.col("step") == focus_step), "rank", verdict,
                                    f"rel_l2 by rank and {{cols}} (step {focus_step}, max over output leaves)")
    body = [
        sections.verdict_section(cmp, verdict, overflow_report),
        sections.checklist_section(checklist_report),
        sections.chart_section(figs, focus_rank, len(steps), len(ranks), verdict),
        sections.health_section(health_report),
        sections.table_section(rows, max_table_rows),
        sections.stack_section(cmp, verdict, store),
        sections.meta_section(cmp, verdict, store, bool(len(ranks) > 1)),
    ]
    data = {"figures": {k: v for k, v in figs.items() if v is not None}}
    title = f"dumpstore report: {cmp.target} vs {cmp.ref}"
    when = generated_at or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return _page(title, when, "\n".join(body), data)


def _json_for_script(obj: Any) -> str:
    """JSON safe inside <script>: no NaN/Infinity, and '<', '>', '&' (so '</', '<!--') as \\u escapes."""
    text = json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _sha(script: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode() + "'"


def _page(title: str, when: str, body: str, data: dict) -> str:
    """assets/page.html with its {{slots}} filled in one pass (filled text is never scanned for slots)."""
    from dumpstore import __version__

    plotly, guard, main = plotly_js(), asset("guard.js"), asset("main.js")
    csp = (f"default-src 'none'; script-src {_sha(guard)} {_sha(plotly)} {_sha(main)}; "
           "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; connect-src 'none'; "
           "base-uri 'none'; form-action 'none'")
    slots = {"csp": csp, "title": esc(title), "css": asset("report.css"), "guard_js": guard, "when": esc(when),
             "version": esc(__version__), "body": body, "data": _json_for_script(data), "plotly": plotly,
             "main_js": main}
    return _SLOT.sub(lambda m: slots[m.group(1)], asset("page.html"))

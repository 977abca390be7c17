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
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from dumpstore.errors import DumpstoreError

from .._checklist import Checklist
from .._health import HealthReport
from .._overflow import OverflowReport
from ..compare import Comparison
from ..verdict import Finding, Verdict
from . import sections
from .data import ReportData, fetch
from .figures import (
    MAX_POINTS,
    focus,
    grad_figure,
    heat_figure,
    line_figure,
    loss_figure,
    per_op,
    prepared,
    update_figure,
)
from .rows import table_data
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
        raise DumpstoreError(
            f"the HTML report's plotly.js (dumpstore/analysis/report/assets/plotly-report.min.js) "
            f"cannot be read ({exc}); reinstall dumpstore, or write only --csv"
        ) from None
    # never end the <script> element early (the file has no such text today; the hash covers the result)
    return re.sub(r"</(script)", r"<\\/\1", text, flags=re.IGNORECASE)


def write_html(
    cmp: Comparison, verdict: Verdict, overflow_report: OverflowReport | None, store, path: str | Path, **options: Any
) -> int:
    """Write render_html(...) to `path`; returns the file size in bytes (options: see render_html)."""
    return write_text(render_html(cmp, verdict, overflow_report, store, **options), path)


def write_report_html(data: ReportData, store, path: str | Path, **options: Any) -> int:
    """The HTML page of `analyze(...)`, with the checklist and health sections (options: see render_html)."""
    return write_text(
        render_html(
            data.cmp,
            data.verdict,
            data.overflow,
            store,
            checklist_report=data.checklist,
            health_report=data.health,
            **options,
        ),
        path,
    )


def render_html(
    cmp: Comparison,
    verdict: Verdict,
    overflow_report: OverflowReport | None = None,
    store=None,
    *,
    max_table_rows: int = MAX_TABLE_ROWS,
    max_points: int = MAX_POINTS,
    generated_at: str | None = None,
    checklist_report: Checklist | None = None,
    health_report: HealthReport | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    only_differing: bool = False,
    explained: dict | None = None,
    notes: list[str] | None = None,
) -> str:
    """One self-contained HTML page: verdict, charts, curves, every compared row, culprit's stack, run metadata.

    `max_table_rows`: rows per page of the table (all rows are in the page); `max_points`: points per chart trace;
    `progress("html", done, 4)` as the table, the charts, the sections and the page are built.
    """
    tell = progress or (lambda stage, done, total: None)
    from ..rank import significance

    rows = prepared(cmp.rows if "significance" in cmp.rows.columns else significance(cmp.rows))
    tell("html", 0, 4)
    table = table_data(rows.filter(pl.col("status") != "pass") if only_differing else rows, verdict.culprit)
    table["only_differing"] = only_differing
    tell("html", 1, 4)
    figs, alt, pickers, focus_rank = _figures(rows, verdict, table, max_points)
    tell("html", 2, 4)
    findings = health_report.findings if health_report is not None else []
    if health_report is not None:
        figs["loss"] = loss_figure(rows, health_report.loss, findings)
    figs["grads"] = grad_figure(rows, focus_rank, findings=findings)
    figs["updates"] = _update_figure(cmp, store, focus_rank)
    n_steps, n_ranks = len(set(table["cols"]["step"])), len(set(table["cols"]["rank"]))
    parts = [
        (
            "verdict",
            "Verdict",
            sections.verdict_section(
                cmp,
                verdict,
                overflow_report,
                rows,
                explained if explained is not None else _explained(store, verdict),
                notes if notes is not None else _mode_notes(store, cmp),
                _kernel(store, cmp),
            ),
        ),
        ("checklist", "Checklist", sections.checklist_section(checklist_report)),
        ("charts", "Error charts", sections.chart_section(figs, 0, n_steps, n_ranks, verdict, pickers)),
        ("curves", "Training curves", sections.curves_section(figs)),
        ("health", "Health", sections.health_section(health_report)),
        ("mismatches", "All rows", sections.table_section(table, max_table_rows)),
        ("stack", "Call stack", sections.stack_section(cmp, verdict, store)),
        ("meta", "Runs", sections.meta_section(cmp, verdict, store, n_ranks > 1)),
    ]
    tell("html", 3, 4)
    body = [sections.toc([(i, label) for i, label, html in parts if html])] + [html for _, _, html in parts]
    data = {"figures": {k: v for k, v in figs.items() if v is not None}, "alt": alt, "table": table}
    title = f"dumpstore report: {cmp.target} vs {cmp.ref}"
    when = generated_at or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    page = _page(title, when, "\n".join(body), data)
    tell("html", 4, 4)
    return page


def _kernel(store, cmp: Comparison) -> tuple[bool, Finding | None]:
    """(whether the target was replayed, its kernel finding with the reference's error beside it)."""
    if store is None:
        return False, None
    from ..replay.findings import kernel_finding, replayed

    if not replayed(store, cmp.target):
        return False, None
    return True, kernel_finding(store, cmp.target, ref=cmp.ref)


UPDATES_SQL = (
    "SELECT step, rank, param, coalesce(ratio_sketch, ratio_est) AS ratio FROM weight_change "
    "WHERE run = $run AND prev_step = step - 1"
)


def _update_figure(cmp: Comparison, store, rank: int) -> dict | None:
    """Update ratios of both runs (from the store's weight_change view), or None without a store."""
    if store is None:
        return None
    sides = [fetch(store, run, UPDATES_SQL, {"run": run}) for run in (cmp.target, cmp.ref)]
    return update_figure(sides[0], sides[1], rank)


MAX_PICKS = 16  # ranks or steps offered by a chart's picker (each is drawn ahead, into the page)


def _figures(rows: pl.DataFrame, verdict: Verdict, table: dict, max_points: int) -> tuple[dict, dict, dict, int]:
    """The error charts at the focus rank/step, the same charts at the other ranks/steps, their pickers, the rank."""
    op_index = {op: i for i, op in enumerate(table["dicts"]["op"])}
    ops = per_op(rows)
    focus_rank, focus_step = focus(verdict, ops)
    steps = sorted(ops["step"].unique().to_list())
    ranks = sorted(ops["rank"].unique().to_list())

    def line(r: int) -> dict:
        return line_figure(ops, verdict, r, max_points, op_index)

    def by_step(r: int) -> dict | None:
        return heat_figure(
            ops.filter(pl.col("rank") == r),
            "step",
            verdict,
            f"rel_l2 by step and {{cols}} (rank {r}, max over output leaves)",
        )

    def by_rank(s: int) -> dict | None:
        return heat_figure(
            ops.filter(pl.col("step") == s),
            "rank",
            verdict,
            f"rel_l2 by rank and {{cols}} (step {s}, max over output leaves)",
        )

    figs: dict[str, Any] = {"line": line(focus_rank)}
    plan: list[tuple[str, str, list[Any], int, Callable[[int], dict | None]]] = [
        ("line", "rank", ranks, focus_rank, line)
    ]
    if len(steps) > 1:
        figs["steps"] = by_step(focus_rank)
        plan.append(("steps", "rank", ranks, focus_rank, by_step))
    if len(ranks) > 1:
        figs["ranks"] = by_rank(focus_step)
        plan.append(("ranks", "step", steps, focus_step, by_rank))
    alt: dict[str, dict[str, Any]] = {}
    pickers: dict[str, tuple[str, list, Any]] = {}
    for key, axis, values, current, make in plan:
        if figs.get(key) is None or not 1 < len(values) <= MAX_PICKS:
            continue
        alt[key] = {str(v): make(v) for v in values if v != current}
        pickers[key] = (axis, values, current)
    return figs, alt, pickers, focus_rank


def _json_for_script(obj: Any) -> str:
    """JSON safe inside <script>: no NaN/Infinity, and '<', '>', '&' (so '</', '<!--') as \\u escapes."""
    try:
        text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:  # NaN or Infinity somewhere: copy with them as null (the walk is slow on big pages)
        text = json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


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
    csp = (
        f"default-src 'none'; script-src {_sha(guard)} {_sha(plotly)} {_sha(main)}; "
        "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; connect-src 'none'; "
        "base-uri 'none'; form-action 'none'"
    )
    slots = {
        "csp": csp,
        "title": esc(title),
        "css": asset("report.css"),
        "guard_js": guard,
        "when": esc(when),
        "version": esc(__version__),
        "body": body,
        "data": _json_for_script(data),
        "plotly": plotly,
        "main_js": main,
    }
    return _SLOT.sub(lambda m: slots[m.group(1)], asset("page.html"))


def _explained(store, verdict) -> dict:
    """The findings in the user's terms (analysis/explain.py), as `dumpstore divergence` shows them."""
    if store is None:
        return {}
    from ..explain import explain_findings

    return explain_findings(store, verdict)


def _mode_notes(store, cmp: Comparison) -> list[str]:
    """Runs dumped in different modes, said in the verdict's header as `dumpstore divergence` says it."""
    if store is None:
        return []
    from ..explain import mode_notes, run_modes

    return mode_notes(run_modes(store, cmp.target, cmp.ref), cmp.target, cmp.ref, False)

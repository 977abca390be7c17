"""Reports to share: a CSV in msprobe's column names plus dumpstore's, and one self-contained HTML page.

`analyze` runs the comparison, the divergence verdict and the overflow scan once; `write_csv` and
`render_html` / `write_html` render them.

CSV: one row per aligned leaf (tensors and non-tensor arguments, unmatched leaves included), in the store's
order.  msprobe 26.x column names where the meaning is the same (§5.7 of MSPROBE_FORMAT.md), then dumpstore's
own columns; the dump mode's own msprobe columns and cells come from msprobe_csv.py (statistics: the four
`…RelativeErr` as msprobe's text, `0.9186%`, `inf`, `Nan`; md5: `NPU MD5`, `BENCH MD5`, msprobe's `Result`).
Other numbers are written as numbers (`inf`, `-inf`, `nan`; empty when unknown), never as `%` strings;
shapes as msprobe writes them (`[4, 8, 32]`, `[]` for non-tensors, `N/A` for null leaves).  With the store at
hand the dtype is the dumped one (`torch.float32`, `<class 'int'>`), the summary columns are the dumper's
statistics (what msprobe shows) and `NPU_Stack_Info` holds the call stack on the first row of each op.
The six tensor-mode cells are msprobe's (`compare_runs(..., exact=True)`; text cells such as 'unsupported' left
empty), else dumpstore's estimates (Cosine, MaxAbsErr from sketches or statistics; the rest empty).
`Result` maps dumpstore's status: pass -> pass, diverged/error -> error, unmatched/unknown -> warning;
`Err_message` is a JSON list naming the metric and threshold.

HTML: plotly.js is embedded (read from the installed `plotly` package), so the file works offline.  Every
string that comes from a dump (names, paths, stack lines) is untrusted: it is HTML-escaped in markup and in
plotly labels, and JSON inside <script> has `<`, `>` and `&` as \\u escapes.  A Content-Security-Policy lets
only the page's own scripts run (by SHA-256 hash) and forbids any network access, so even a missed escape
cannot run a script.  Script errors and CSP violations are written into `#js-errors` (empty when all is well).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import html
import importlib.util
import io
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from dumpstore.errors import DumpstoreError

from . import msprobe_csv
from .checklist import Checklist, checklist
from .compare import Comparison, compare_runs
from .divergence import Finding, Verdict, divergence
from .health import HealthReport, health
from .order import OUTPUT_IO
from .overflow import OverflowReport, overflow
from .tolerance import Tolerances

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

BACKWARD = ("backward", "parameters_grad")
MAX_TABLE_ROWS = 500      # rows of the top-mismatch table
MAX_POINTS = 2000         # points per chart trace before downsampling (max per bucket)
MAX_HEAT_COLUMNS = 300    # ops per heat map row before grouping ops into layers
N_A = "N/A"

# ------------------------------------------------------------------------------------------------ analysis


@dataclass
class ReportData:
    """What both reports are rendered from."""

    cmp: Comparison
    verdict: Verdict
    overflow: OverflowReport | None
    checklist: Checklist | None = None
    health: HealthReport | None = None


def analyze(store, target: str, ref: str, *, steps: list[int] | None = None, ranks: list[int] | None = None,
            tolerances: Tolerances | None = None, exact: bool = False, mapping: Any = None) -> ReportData:
    """Compare `target` with `ref`, find the first divergence and culprit, and scan `target` for overflow.

    Arguments as for `compare_runs` (`mapping`: an `analysis.mapping.Mapping`, None for names as dumped).
    """
    cmp = compare_runs(store, target, ref, steps=steps, ranks=ranks, tolerances=tolerances, exact=exact,
                       mapping=mapping)
    verdict = divergence(cmp)
    ovf = overflow(store, target, ref=ref, steps=steps, ranks=ranks, cmp=cmp)
    return ReportData(cmp, verdict, ovf, checklist(store, target, ref, tolerances=tolerances, cmp=cmp),
                      health(store, target))


def summary_line(verdict: Verdict) -> str:
    """One line with the verdict and its threshold, for a terminal."""
    f, c = verdict.first_divergence, verdict.culprit
    if f is None:
        return f"PASS | {verdict.target} vs {verdict.ref} | no divergence ({_counts(verdict.counts)})"
    line = f"DIVERGED | step {f.step} rank {f.rank} {f.op} | {_finding_metric(f)}"
    if c is not None:
        line += f" | culprit {c.kind}: {c.op}"
    return line


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "nothing compared"


def _finding_metric(f: Finding) -> str:
    if f.value is None:
        return f.detail or f.kind
    op = ">" if f.threshold is not None and f.value > f.threshold else "<="
    text = f"{f.metric or 'rel_l2'}={_fmt(f.value)} {op} tol={_fmt(f.threshold)}"
    return text + (f" ({f.dtype})" if f.dtype else "")


# ------------------------------------------------------------------------------------------------ CSV

MSPROBE_COLUMNS: tuple[str, ...] = (
    "NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
    "NPU Requires_grad", "Bench Requires_grad",
    "Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio",
    "Max diff", "Min diff", "Mean diff", "L2norm diff",
    "NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm",
    "Requires_grad Consistent", "Result", "Err_message", "NPU_Stack_Info", "Data_name",
)
DUMPSTORE_COLUMNS: tuple[str, ...] = (
    "step", "rank", "seq", "op", "io", "match", "rel_l2", "err_source", "err_bound", "tol", "tol_dtype",
    "severity", "status", "detail",
)
CSV_COLUMNS: tuple[str, ...] = MSPROBE_COLUMNS + DUMPSTORE_COLUMNS

# msprobe cell -> (exact-mode column from analysis/exact.py, dumpstore's own column used otherwise)
_METRIC_SOURCES = {
    "Cosine": ("msprobe_cosine", "cosine"),
    "EucDist": ("msprobe_euc_dist", "euc_dist"),
    "MaxAbsErr": ("msprobe_max_abs_err", "max_abs_err"),
    "MaxRelativeErr": ("msprobe_max_rel_err", "max_rel_err"),
    "One Thousandth Err Ratio": ("msprobe_one_thousandth", "one_thousandth"),
    "Five Thousandths Err Ratio": ("msprobe_five_thousandth", "five_thousandth"),
}
RESULT_OF_STATUS = {"pass": "pass", "diverged": "error", "error": "error", "unmatched": "warning",
                    "unknown": "warning"}
_STATS = (("max", "max"), ("min", "min"), ("mean", "mean"), ("norm", "l2norm"))

_SIDE_INPUTS = ("name", "kind", "dtype", "dtype_raw", "value_type", "value", "scalar_value", "shape", "checksum",
                "requires_grad", "data_name", "record", "seq", "io", "stack_id", "max", "min", "mean", "norm",
                "dump_max", "dump_min", "dump_mean", "dump_norm")
_CSV_INPUTS = frozenset(_SIDE_INPUTS + tuple(c for pair in _METRIC_SOURCES.values() for c in pair) + (
    "step", "rank", "source", "match", "err", "err_source", "err_bound", "tol", "tol_dtype", "severity", "status",
    "detail", "nonfinite_mismatch", "max_diff", "min_diff", "mean_diff", "norm_diff", "msprobe_message"))

RAW_SQL = ("SELECT step, rank, source, leaf, dtype_raw, dump_max, dump_min, dump_mean, dump_norm "
           "FROM tensors WHERE run = $run")
STACKS_SQL = "SELECT step, rank, stack_id, frames FROM stacks WHERE run = $run"
STACK_SQL = "SELECT frames FROM stacks WHERE run = $run AND step = $step AND rank = $rank AND stack_id = $sid"


def write_csv(cmp: Comparison, path: str | Path, *, store=None) -> int:
    """Write the comparison as CSV (see the module docstring); returns the number of data rows."""
    rows = csv_rows(cmp, store=store)
    cols = msprobe_csv.columns(CSV_COLUMNS, msprobe_csv.dump_mode(cmp, store))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for row in rows:
        w.writerow([_csv_cell(row[c]) for c in cols])
    _write(buf.getvalue(), path)
    return len(rows)


def csv_rows(cmp: Comparison, *, store=None) -> list[dict[str, Any]]:
    """The CSV rows as dicts keyed by CSV_COLUMNS (numbers as float/int, None when unknown)."""
    rows = _with_raw(cmp, store)
    rows = rows.select([c for c in rows.columns if c.removeprefix("ref_") in _CSV_INPUTS])
    stacks = _all_stacks(store, cmp.target) if store is not None else {}
    out, seen_ops, mode = [], set(), msprobe_csv.dump_mode(cmp, store)
    for r in rows.iter_rows(named=True):
        d = _csv_row(r)
        msprobe_csv.fill(d, r, mode)  # msprobe's cells of this dump mode (statistics, md5)
        op_key = (r["step"], r["rank"], r["source"], r["record"])
        frames = stacks.get((r["step"], r["rank"], r["stack_id"])) if r["record"] else None
        if frames is not None and op_key not in seen_ops:
            d["NPU_Stack_Info"] = str(list(frames))
        seen_ops.add(op_key)
        out.append(d)
    return out


def _with_raw(cmp: Comparison, store) -> pl.DataFrame:
    """cmp.rows plus the dumped dtype and the dumper's statistics of both sides (when the store is given)."""
    rows = cmp.rows
    if store is None:
        return rows
    keys = ["step", "rank", "source", "leaf"]
    rows = rows.with_row_index("_row")
    for run, prefix in ((cmp.target, ""), (cmp.ref, "ref_")):
        raw = _fetch(store, run, RAW_SQL, {"run": run})
        if raw is None:
            continue
        raw = raw.rename({c: f"{prefix}{c}" for c in raw.columns if c not in keys or c == "leaf"})
        on = ["step", "rank", "source", f"{prefix}leaf"]
        raw = raw.with_columns([pl.col(c).cast(rows.schema[c]) for c in on if c in rows.columns])
        rows = rows.join(raw, on=on, how="left")
    return rows.sort("_row").drop("_row")


def _fetch(store, run: str, sql: str, params: dict) -> pl.DataFrame | None:
    """Rows of `sql` over the store's views, or None where the store lacks a column (the caller falls back)."""
    import duckdb

    from dumpstore.query import connect, fetch_arrow

    con = connect(store, runs=[run])
    try:
        return pl.from_arrow(fetch_arrow(con, sql, params))  # type: ignore[return-value]
    except duckdb.BinderException:
        return None
    finally:
        con.close()


def _all_stacks(store, run: str) -> dict[tuple, list[str]]:
    df = _fetch(store, run, STACKS_SQL, {"run": run})
    if df is None:
        return {}
    return {(s, r, i): f for s, r, i, f in df.iter_rows()}


def _csv_row(r: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    t_here, r_here = r.get("name") is not None, r.get("ref_name") is not None
    d["NPU Name"] = r["name"] if t_here else N_A
    d["Bench Name"] = r["ref_name"] if r_here else N_A
    for side, pre, here in (("NPU", "", t_here), ("Bench", "ref_", r_here)):
        d[f"{side} Dtype"] = _msprobe_dtype(r, pre) if here else N_A
        d[f"{side} Tensor Shape"] = _msprobe_shape(r, pre) if here else N_A
        rg = r.get(f"{pre}requires_grad")
        d[f"{side} Requires_grad"] = rg if (here and r.get(f"{pre}kind") == "tensor" and rg is not None) else N_A
        for stat, label in _STATS:
            d[f"{side} {label}"] = _stat_value(r, pre, stat)
    for col, (exact_col, own_col) in _METRIC_SOURCES.items():
        d[col] = _metric_value(r, exact_col, own_col)
    for stat, label in (("max", "Max"), ("min", "Min"), ("mean", "Mean"), ("norm", "L2norm")):
        d[f"{label} diff"] = _stat_diff(d[f"NPU {'l2norm' if stat == 'norm' else stat}"],
                                        d[f"Bench {'l2norm' if stat == 'norm' else stat}"], r.get(f"{stat}_diff"))
    d["Requires_grad Consistent"] = (t_here and r_here and d["NPU Requires_grad"] == d["Bench Requires_grad"])
    d["Result"] = RESULT_OF_STATUS.get(r["status"] or "", N_A)
    d["Err_message"] = json.dumps(_messages(r, d))
    d["NPU_Stack_Info"] = N_A
    d["Data_name"] = str([_data_name(r.get("data_name"), t_here), _data_name(r.get("ref_data_name"), r_here)])
    d.update(step=r["step"], rank=r["rank"], seq=r.get("seq") if r.get("seq") is not None else r.get("ref_seq"),
             op=r.get("record") or r.get("ref_record"), io=r.get("io") or r.get("ref_io"), match=r.get("match"),
             rel_l2=r.get("err"), err_source=r.get("err_source"), err_bound=r.get("err_bound"), tol=r.get("tol"),
             tol_dtype=r.get("tol_dtype"), severity=r.get("severity"), status=r.get("status"),
             detail=r.get("detail"))
    return d


def _msprobe_dtype(r: dict, pre: str) -> str:
    kind = r.get(f"{pre}kind")
    if kind == "null":
        return N_A
    if kind == "tensor":
        raw = r.get(f"{pre}dtype_raw")
        return raw or (f"torch.{r[f'{pre}dtype']}" if r.get(f"{pre}dtype") else N_A)
    vt = r.get(f"{pre}value_type")
    if not vt:
        return r.get(f"{pre}dtype") or N_A
    return vt if "." in vt else f"<class '{vt}'>"


def _msprobe_shape(r: dict, pre: str) -> str:
    kind = r.get(f"{pre}kind")
    if kind == "null":
        return N_A
    shape = r.get(f"{pre}shape")
    if kind == "tensor" and shape is not None:
        return "[" + ", ".join(str(int(x)) for x in shape) + "]"
    if r.get(f"{pre}value_type") == "torch.Size" and r.get(f"{pre}value"):
        return str(r[f"{pre}value"])
    return "[]" if kind == "scalar" else N_A


def _stat_value(r: dict, pre: str, stat: str) -> float | None:
    """The dumper's statistics when it wrote any (what msprobe shows), else the store's; an argument's value."""
    kind = r.get(f"{pre}kind")
    if kind == "scalar":
        return r.get(f"{pre}scalar_value")
    if kind != "tensor":
        return None
    if any(r.get(f"{pre}dump_{s}") is not None for s, _ in _STATS):
        return r.get(f"{pre}dump_{stat}")
    return r.get(f"{pre}{stat}")


def _stat_diff(a: float | None, b: float | None, own: float | None) -> float | None:
    if a is None or b is None:
        return own
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return a - b


def _metric_value(r: dict, exact_col: str, own_col: str) -> float | None:
    if exact_col in r and r[exact_col] is not None:
        return _number(r[exact_col])
    return _number(r.get(own_col))


def _number(v: Any) -> float | None:
    """msprobe cells and our numbers as a float: text cells ('unsupported', 'N/A', ...) give None, 'Nan' NaN."""
    if v is None:
        return None
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(str(v).strip().rstrip("%"))
    except ValueError:
        return None


def _messages(r: dict, d: dict) -> list[str]:
    status, out = r.get("status"), []
    if status == "diverged":
        if r.get("nonfinite_mismatch"):
            out.append(f"error: {r.get('detail') or 'non-finite values differ'}")
        else:
            out.append(f"error: rel_l2 {_fmt(r.get('err'))} > tol {_fmt(r.get('tol'))} ({r.get('tol_dtype')}), "
                       f"from {r.get('err_source')}" + (f"; {r['detail']}" if r.get("detail") else ""))
    elif status == "error":
        out.append(f"error: {r.get('detail') or 'leaf could not be read'}")
    elif status == "unmatched":
        out.append("warning: No bench data matched." if r.get("name") is not None
                   else "warning: only in the reference (bench); no target data matched.")
    elif status == "unknown":
        out.append("warning: not comparable from what was dumped (no norm, sketch or checksum on both sides)")
    if r.get("msprobe_message"):
        out.append(f"info: msprobe: {r['msprobe_message']}")
    if d["NPU Requires_grad"] != d["Bench Requires_grad"] and status != "unmatched":
        out.append(f"warning: requires_grad {d['NPU Requires_grad']} vs {d['Bench Requires_grad']}")
    return out


def _data_name(name: str | None, here: bool) -> str:
    return name if (here and name) else "-1"


_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(v: Any) -> Any:
    """Numbers as numbers; text that a spreadsheet would run as a formula gets a leading quote."""
    if v is None:
        return ""
    if isinstance(v, (bool, int, float)):
        return v
    s = str(v)
    if s[:1] in _FORMULA and _number(s) is None:
        return "'" + s
    return s


# ------------------------------------------------------------------------------------------------ HTML


def plotly_js() -> str:
    """plotly.min.js from the installed `plotly` package (no network)."""
    spec = importlib.util.find_spec("plotly")
    for base in (spec.submodule_search_locations or []) if spec else []:
        p = Path(base) / "package_data" / "plotly.min.js"
        if p.exists():
            # never end the <script> element early (the file has no such text today; the hash covers the result)
            return re.sub(r"</(script)", r"<\\/\1", p.read_text(encoding="utf-8"), flags=re.IGNORECASE)
    raise DumpstoreError("the HTML report embeds plotly.js from the Python package `plotly`, which is not "
                         "installed; install it (pip install plotly) or write only --csv")


def write_html(cmp: Comparison, verdict: Verdict, overflow_report: OverflowReport | None, store,
               path: str | Path, **options: Any) -> int:
    """Write render_html(...) to `path`; returns the file size in bytes (options: see render_html)."""
    return _write(render_html(cmp, verdict, overflow_report, store, **options), path)


def write_report_html(data: ReportData, store, path: str | Path, **options: Any) -> int:
    """The HTML page of `analyze(...)`, with the checklist and health sections."""
    return _write(render_html(data.cmp, data.verdict, data.overflow, store, checklist_report=data.checklist,
                              health_report=data.health, **options), path)


def _write(text: str, path: str | Path) -> int:
    """Write a report file (making its folder), or a one-line error naming it."""
    data = text.encode("utf-8")
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    except OSError as exc:
        raise DumpstoreError(f"{p}: cannot write the report ({exc.strerror or exc}); pick another path") from None
    return len(data)


def render_html(cmp: Comparison, verdict: Verdict, overflow_report: OverflowReport | None = None, store=None,
                *, max_table_rows: int = MAX_TABLE_ROWS, max_points: int = MAX_POINTS,
                generated_at: str | None = None, checklist_report: Checklist | None = None,
                health_report: HealthReport | None = None) -> str:
    """One self-contained HTML page: verdict, charts, top mismatches, culprit's stack, run metadata."""
    rows = _prepared(cmp.rows)
    per_op = _per_op(rows)
    focus_rank, focus_step = _focus(verdict, per_op)
    figs = {"line": _line_figure(per_op, verdict, focus_rank, max_points)}
    steps = sorted(per_op["step"].unique().to_list())
    ranks = sorted(per_op["rank"].unique().to_list())
    if len(steps) > 1:
        figs["steps"] = _heat_figure(per_op.filter(pl.col("rank") == focus_rank), "step", verdict,
                                     f"rel_l2 by step and {{cols}} (rank {focus_rank}, max over output leaves)")
    if len(ranks) > 1:
        figs["ranks"] = _heat_figure(per_op.filter(pl.col("step") == focus_step), "rank", verdict,
                                     f"rel_l2 by rank and {{cols}} (step {focus_step}, max over output leaves)")
    sections = [
        _verdict_section(cmp, verdict, overflow_report),
        _checklist_section(checklist_report),
        _chart_section(figs, focus_rank, len(steps), len(ranks), verdict),
        _health_section(health_report),
        _table_section(rows, max_table_rows),
        _stack_section(cmp, verdict, store),
        _meta_section(cmp, verdict, store, bool(len(ranks) > 1)),
    ]
    data = {"figures": {k: v for k, v in figs.items() if v is not None}}
    title = f"dumpstore report: {cmp.target} vs {cmp.ref}"
    when = generated_at or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return _page(title, when, "\n".join(sections), data)


# -- data for the page --------------------------------------------------------------------------------------


def _prepared(rows: pl.DataFrame) -> pl.DataFrame:
    return rows.with_columns(
        pl.coalesce("record", "ref_record").alias("_op"), pl.coalesce("direction", "ref_direction").alias("_dir"),
        pl.coalesce("io", "ref_io").alias("_io"), pl.coalesce("seq", "ref_seq").alias("_seq"),
        pl.coalesce("name", "ref_name").alias("_name"), pl.coalesce("module", "ref_module").alias("_module"),
    )


def _per_op(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per op (record) and step and rank: the output leaf with the highest severity."""
    outs = rows.filter(pl.col("_io").is_in(OUTPUT_IO))
    by_sev = pl.col("severity").fill_nan(None).fill_null(-1.0)

    def worst(c: str) -> pl.Expr:
        return pl.col(c).sort_by(by_sev, descending=True).first()

    return (outs.group_by(["step", "rank", "source", "_op"], maintain_order=True).agg(
        pl.col("_seq").min().alias("seq"), pl.col("_dir").first().alias("direction"),
        pl.col("_module").first().alias("module"), worst("err").alias("err"), worst("tol").alias("tol"),
        worst("tol_dtype").alias("tol_dtype"), worst("_name").alias("leaf_name"),
        worst("err_source").alias("err_source"), pl.col("severity").max().alias("severity"),
        (pl.col("status") == "diverged").any().alias("diverged"),
        (pl.col("status") == "unmatched").all().alias("unmatched"),
    ).rename({"_op": "op"}).sort(["step", "rank", "source", "seq"], nulls_last=True))


def _focus(verdict: Verdict, per_op: pl.DataFrame) -> tuple[int, int]:
    for f in (verdict.culprit, verdict.first_divergence):
        if f is not None:
            return f.rank, f.step
    ranks = per_op["rank"].to_list()
    steps = per_op["step"].to_list()
    return (min(ranks) if ranks else 0), (min(steps) if steps else 0)


def _bounds(errs: list[float | None], tols: list[float | None]) -> tuple[float, float]:
    """Where 0 and inf are drawn on a log axis: below the smallest, above the largest finite value."""
    vals = [v for v in errs + tols if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (min(vals), max(vals)) if vals else (1e-6, 1.0)
    return lo / 100.0, max(hi, 1.0) * 100.0


def _clamp(v: float | None, floor: float, ceil: float) -> float | None:
    if v is None or math.isnan(v):
        return None
    if v == math.inf or v > ceil:
        return ceil
    return max(v, floor)


def _e(v: Any) -> str:
    """HTML-escape anything for markup (None -> an em dash)."""
    return "—" if v is None else html.escape(str(v), quote=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.2e}" if (v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4)) else f"{v:.4g}"
    return str(v)


def _downsample(idx: list[int], keep: set[int], ys: list[float | None], max_points: int) -> list[int]:
    """Indices to draw: all if few, else the max of each bucket (peaks survive) plus the marked points."""
    if len(idx) <= max_points:
        return idx
    size = math.ceil(len(idx) / max_points)
    out = {i for i in idx if i in keep}
    for s in range(0, len(idx), size):
        bucket = [i for i in idx[s:s + size] if ys[i] is not None]
        if bucket:
            out.add(max(bucket, key=lambda i: ys[i]))  # type: ignore[arg-type,return-value]
    return sorted(out)


def _line_figure(per_op: pl.DataFrame, verdict: Verdict, rank: int, max_points: int) -> dict[str, Any]:
    """rel_l2 per op along execution order (steps in order, dump order within a step), log scale."""
    ops = per_op.filter(pl.col("rank") == rank).to_dicts()
    errs = [o["err"] for o in ops]
    floor, ceil = _bounds(errs, [o["tol"] for o in ops])
    ys = [ceil if o["unmatched"] else _clamp(e, floor, ceil) for e, o in zip(errs, ops)]
    marks = _marks(verdict, rank)
    keep = {i for i, o in enumerate(ops) if (o["step"], o["op"]) in marks}
    traces, sampled = [], False
    group = ["only in one run (at the top)" if o["unmatched"] else "inf (at the top)" if o["err"] == math.inf
             else "backward" if o["direction"] in BACKWARD else "forward" for o in ops]
    for label, marker in _LINE_GROUPS.items():
        idx = [i for i, g in enumerate(group) if g == label and ys[i] is not None]
        if not idx and label not in ("forward", "backward"):
            continue
        shown = _downsample(idx, keep, ys, max_points)
        sampled = sampled or len(shown) < len(idx)
        traces.append(_scatter(label, [ops[i] for i in shown], [ys[i] for i in shown], shown, marker))
    tol_idx = list(range(len(ops)))
    if len(tol_idx) > 2 * max_points:
        tol_idx = tol_idx[::math.ceil(len(tol_idx) / (2 * max_points))]
    traces.insert(0, {"type": "scatter", "mode": "lines", "name": "tolerance", "x": tol_idx,
                      "y": [ops[i]["tol"] if ops[i]["tol"] else None for i in tol_idx],
                      "line": {"color": "#888", "dash": "dot", "width": 1, "shape": "hvh"},
                      "hoverinfo": "skip", "connectgaps": True})
    annotations = []
    for (step, op), (label, symbol, color) in marks.items():
        hit = [i for i, o in enumerate(ops) if o["step"] == step and o["op"] == op]
        if not hit or ys[hit[0]] is None:
            continue
        i = hit[0]
        traces.append(_scatter(label, [ops[i]], [ys[i]], [i], {"color": color, "size": 16, "symbol": symbol,
                                                             "line": {"color": "#000", "width": 1}}))
        annotations.append({"x": i, "y": math.log10(ys[i]), "text": _e(f"{label}: {op}"), "showarrow": True,
                            "arrowhead": 2, "ax": 40,
                            "ay": (40 if ys[i] >= ceil / 10 else -40) * (1 + 0.6 * len(annotations)),
                            "font": {"color": color}, "bgcolor": "rgba(255,255,255,0.85)"})
    shapes = _step_lines(ops, annotations)
    title = f"Relative L2 error along execution order (rank {rank}; 0 drawn at the bottom)"
    if sampled:
        title += f" — downsampled to the max of each bucket (≤ {max_points} points per trace)"
    layout = {"title": {"text": _e(title), "font": {"size": 14}}, "height": 420,
              "margin": {"l": 70, "r": 20, "t": 50, "b": 50},
              "xaxis": {"title": {"text": "op in execution order"}, "zeroline": False},
              "yaxis": {"title": {"text": "relative L2 error"}, "type": "log", "exponentformat": "e",
                        "range": [math.log10(floor) - 0.2, math.log10(ceil) + 0.2]},
              "legend": {"orientation": "h", "y": -0.18}, "annotations": annotations, "shapes": shapes,
              "hovermode": "closest"}
    return {"data": traces, "layout": layout}


_LINE_GROUPS = {
    "forward": {"color": "#1f77b4", "size": 5},
    "backward": {"color": "#ff7f0e", "size": 5},
    "inf (at the top)": {"color": "#d62728", "size": 7, "symbol": "triangle-up"},
    "only in one run (at the top)": {"color": "#8c564b", "size": 8, "symbol": "x"},
}


def _marks(verdict: Verdict, rank: int) -> dict[tuple[int, str], tuple[str, str, str]]:
    marks: dict[tuple[int, str], tuple[str, str, str]] = {}
    f, c = verdict.first_divergence, verdict.culprit
    if f is not None and f.rank == rank:
        marks[(f.step, f.op)] = ("first divergence", "diamond", "#9467bd")
    if c is not None and c.rank == rank:
        marks[(c.step, c.op)] = ("culprit", "star", "#d62728")  # wins over the first divergence when the same op
    return marks


def _scatter(name: str, ops: list[dict], ys: list, xs: list[int], marker: dict, mode: str = "markers") -> dict:
    text = [_e(f"{o['op']} (step {o['step']})") + "<br>" + _e(o["leaf_name"] or "") + "<br>rel_l2 "
            + _fmt(o["err"]) + " (" + _e(o["err_source"]) + "), tol " + _fmt(o["tol"]) + " " + _e(o["tol_dtype"])
            for o in ops]
    return {"type": "scatter", "mode": mode, "name": name, "x": xs, "y": ys, "text": text,
            "hovertemplate": "%{text}<extra>" + _e(name) + "</extra>", "marker": marker}


def _step_lines(ops: list[dict], annotations: list[dict]) -> list[dict]:
    shapes, last = [], None
    for i, o in enumerate(ops):
        if o["step"] != last:
            if last is not None:
                shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": i - 0.5, "x1": i - 0.5,
                               "y0": 0, "y1": 1, "line": {"color": "#bbb", "width": 1}})
            annotations.append({"x": i, "y": 1.0, "xref": "x", "yref": "paper", "text": f"step {o['step']}",
                                "showarrow": False, "xanchor": "left", "yanchor": "bottom",
                                "font": {"size": 10, "color": "#666"}})
            last = o["step"]
    return shapes


_MODULE_PATH = re.compile(r"^(?:Module|Cell)\.(.+?)\.[A-Za-z_]\w*\.(?:forward|backward)\.\d+$")


def _layer(module: str | None, op: str, direction: str | None) -> str:
    """A layer label from the parent module: Module.layers.1.fc1.Linear.forward.0 -> 'layers.1 (fwd)'."""
    m = _MODULE_PATH.match(module or "")
    parts = m.group(1).split(".") if m else ([module] if module else [op.split(".")[0]])
    name = parts[0]
    for i, p in enumerate(parts):
        if p.isdigit():
            name = ".".join(parts[: i + 1])
            break
    return f"{name} ({'bwd' if direction in BACKWARD else 'fwd'})"


def _heat_figure(ops: pl.DataFrame, axis: str, verdict: Verdict, title: str) -> dict[str, Any] | None:
    """A heat map of log10(rel_l2): rows = steps or ranks, columns = ops (or layers when there are many)."""
    recs = ops.filter(pl.col("err").is_not_null()).to_dicts()
    if not recs:
        return None
    n_ops = len({r["op"] for r in recs})
    by_layer = n_ops > MAX_HEAT_COLUMNS
    col_of = (lambda r: _layer(r["module"], r["op"], r["direction"])) if by_layer else (lambda r: r["op"])
    cols: dict[str, int] = {}
    for r in sorted(recs, key=lambda r: (r["seq"] if r["seq"] is not None else 0)):
        cols.setdefault(col_of(r), len(cols))
    rows = sorted({r[axis] for r in recs})
    row_i = {v: i for i, v in enumerate(rows)}
    floor, ceil = _bounds([r["err"] for r in recs], [r["tol"] for r in recs])
    z: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    raw: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    for r in recs:
        i, j = row_i[r[axis]], cols[col_of(r)]
        if raw[i][j] is None or (r["err"] is not None and r["err"] > raw[i][j]):  # type: ignore[operator]
            raw[i][j] = r["err"]
            z[i][j] = math.log10(_clamp(r["err"], floor, ceil))  # type: ignore[arg-type]
    labels = [_e(c) for c in cols]
    text = [[f"{axis} {rows[i]}<br>{labels[j]}<br>rel_l2 {_fmt(raw[i][j])}" for j in range(len(cols))]
            for i in range(len(rows))]
    data: list[dict[str, Any]] = [{
        "type": "heatmap", "z": z, "x": labels, "y": [f"{axis} {v}" for v in rows], "text": text,
        "hovertemplate": "%{text}<extra></extra>", "colorscale": "Viridis", "hoverongaps": False,
        "colorbar": {"title": {"text": "log10<br>rel_l2"}, "thickness": 14}}]
    c = verdict.culprit or verdict.first_divergence
    if c is not None and c.op in cols and (c.step if axis == "step" else c.rank) in row_i:
        data.append({"type": "scatter", "mode": "markers", "name": "culprit", "showlegend": False,
                     "x": [_e(c.op)], "y": [f"{axis} {c.step if axis == 'step' else c.rank}"],
                     "marker": {"symbol": "star", "size": 14, "color": "#d62728", "line": {"color": "#fff",
                                                                                           "width": 1}},
                     "hovertemplate": _e(f"culprit: {c.op}") + "<extra></extra>"})
    layout = {"title": {"text": _e(title.format(cols="layer" if by_layer else "op")), "font": {"size": 14}},
              "height": 230 + max(130, 34 * len(rows)), "margin": {"l": 70, "r": 20, "t": 50, "b": 160},
              "xaxis": {"type": "category", "tickangle": -60, "tickfont": {"size": 9}, "automargin": True},
              "yaxis": {"type": "category", "autorange": "reversed"}}
    return {"data": data, "layout": layout}


# -- sections -------------------------------------------------------------------------------------------------


def _finding_html(label: str, f: Finding | None, none_text: str) -> str:
    if f is None:
        return f'<div class="finding none"><h3>{_e(label)}</h3><p>{_e(none_text)}</p></div>'
    metric, threshold = (f.metric, _fmt(f.threshold)) if f.metric is not None else (
        "record alignment (exact name, backward renumbering)", "the record exists in both runs")
    cells = [("op", f.op), ("step / rank", f"step {f.step}, rank {f.rank}"), ("kind", f.kind),
             ("leaf", f.name), ("metric", metric), ("value", _fmt(f.value) if f.value is not None else None),
             ("threshold", threshold),
             ("dtype", f.dtype), ("from", f.source),
              ("severity (value / threshold)", _fmt(f.severity) if f.severity is not None else None),
             ("detail", f.detail)]
    cells += [(f"evidence: {k}", _fmt(v) if isinstance(v, float) else v) for k, v in (f.evidence or {}).items()]
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in cells if v is not None)
    head = f'{_e(label)}: <code class="op">{_e(f.op)}</code>'
    return (f'<div class="finding"><h3>{head}</h3><p class="metric">{_e(_finding_metric(f))}</p>'
            f'<table class="kv">{rows}</table></div>')


def _overflow_html(ovf: OverflowReport | None) -> str:
    label = "First overflow"
    rule = ("metric: NaN / +Inf / -Inf / ±finfo.max element counts of output tensors; threshold: any such value "
            "that the reference does not also have at the aligned tensor (producer = op with clean inputs)")
    if ovf is None:
        return f'<div class="finding none"><h3>{label}</h3><p>not scanned</p></div>'
    f = ovf.first_overflow
    if f is None:
        more = f" ({len(ovf.producers)} masking-like producers ignored)" if ovf.producers else ""
        return (f'<div class="finding none"><h3>{label}</h3><p>none: no NaN/Inf/saturated value beyond the '
                f'reference{_e(more)}</p><p class="rule">{_e(rule)}</p></div>')
    cells = [("op", f.get("op")), ("step / rank", f"step {f.get('step')}, rank {f.get('rank')}"),
             ("kind", f.get("kind")), ("leaf", f.get("name"))]
    cells += [(k, f.get(k)) for k in ("nan_count", "posinf_count", "neginf_count", "sat_count")
              if f.get(k) is not None]
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in cells)
    extra = f"<p>{len(ovf.producers)} producer op(s) in all.</p>" if len(ovf.producers) > 1 else ""
    return (f'<div class="finding bad"><h3>{label}: <code class="op">{_e(f.get("op"))}</code></h3>'
            f'<p class="rule">{_e(rule)}</p><table class="kv">{rows}</table>{extra}</div>')


def _unmatched_html(verdict: Verdict, limit: int = 30) -> str:
    un = verdict.unmatched
    rule = "metric: record alignment (exact name, backward renumbering); threshold: a record present in one run only"
    if not un:
        return (f'<div class="finding none"><h3>Unmatched ops</h3><p>none: every record has a partner</p>'
                f'<p class="rule">{_e(rule)}</p></div>')
    items = "".join(f"<tr><td>{_e(u['step'])}</td><td>{_e(u['rank'])}</td><td>{_e(u['side'])}</td>"
                    f"<td><code>{_e(u['op'])}</code></td></tr>" for u in un[:limit])
    more = f"<p>… and {len(un) - limit} more.</p>" if len(un) > limit else ""
    return (f'<div class="finding bad"><h3>Unmatched ops: {len(un)}</h3><p class="rule">{_e(rule)}</p>'
            f'<table class="grid"><tr><th>step</th><th>rank</th><th>only in</th><th>op</th></tr>{items}</table>'
            f'{more}</div>')


def _verdict_section(cmp: Comparison, verdict: Verdict, ovf: OverflowReport | None) -> str:
    f = verdict.first_divergence
    status = "diverged" if f is not None else "pass"
    head = _e(summary_line(verdict))
    steps = "".join(
        f"<tr><td>{_e(s['step'])}</td><td>{_e(s['compared'])}</td><td>{_e(s['diverged'])}</td>"
        f"<td>{_e(s['unmatched'])}</td><td>{_e(_fmt(s['max_err']))}</td><td><code>{_e(s['first_divergence'])}"
        f"</code></td></tr>" for s in verdict.steps)
    tol = cmp.tolerances
    tol_text = (f"all dtypes {tol.all_dtypes:g}" if tol.all_dtypes is not None
                else ", ".join(f"{k} {v:.2e}" for k, v in tol.rel_l2.items()))
    return f"""
<section id="verdict" class="{status}">
<h2>Verdict</h2>
<p class="headline" id="verdict-line">{head}</p>
<p class="rule">Primary metric: relative L2 error ‖target − ref‖ / ‖ref‖ per leaf, judged against a tolerance per
dtype ({_e(tol_text)}; a pair is judged at the less precise of its dtypes and the run's compute precision
{_e(verdict.precision.get('floor'))}). Leaf counts: {_e(_counts(verdict.counts))}.</p>{_coverage_html(cmp)}
<div class="findings">
{_finding_html("First divergence", f, "none: every compared output is within tolerance")}
{_finding_html("Culprit", verdict.culprit, "none found" if f is not None else "none")}
{_overflow_html(ovf)}
{_unmatched_html(verdict)}
</div>
<h3>By step</h3>
<table class="grid" id="steps-table"><tr><th>step</th><th>compared</th><th>diverged</th><th>unmatched</th>
<th>max rel_l2</th><th>first divergence</th></tr>{steps}</table>
</section>"""


def _coverage_html(cmp: Comparison) -> str:
    cov = getattr(cmp, "coverage", None) or {}
    notes = []
    for side, label in (("target", "target"), ("ref", "reference")):
        for what in ("steps", "ranks"):
            extra = sorted(set(cov.get(f"{side}_{what}", [])) - set(cov.get(f"common_{what}", [])))
            if extra:
                notes.append(f"{what} only in the {label}, not compared: {', '.join(map(str, extra))}")
    if not notes:
        return ""
    return '<p class="warn">' + "; ".join(_e(n) for n in notes) + "</p>"


def _chart_section(figs: dict, rank: int, n_steps: int, n_ranks: int, verdict: Verdict) -> str:
    parts = ['<section id="charts"><h2>Error along the run</h2>', '<div class="chart" id="chart-line"></div>']
    if figs.get("steps") is not None:
        parts.append('<h3>Error by step</h3><div class="chart" id="chart-steps"></div>')
    elif n_steps > 1:
        parts.append("<p>No step has a comparable output.</p>")
    if n_ranks > 1:
        parts.append('<h3>Error by rank</h3>')
        if figs.get("ranks") is not None:
            parts.append('<div class="chart" id="chart-ranks"></div>')
        rows = "".join(
            f"<tr><td>{_e(r['rank'])}</td><td>{_e(r['diverged'])}</td><td>{_e(_fmt(r['max_err']))}</td>"
            f"<td><code>{_e(r['first_divergence'])}</code></td><td>{_e(r['first_step'])}</td>"
            f"<td>{'yes' if r['disagrees_with_peers'] else 'no'}</td></tr>" for r in verdict.ranks)
        parts.append('<table class="grid" id="ranks-table"><tr><th>rank</th><th>diverged leaves</th>'
                     '<th>max rel_l2</th><th>first divergence</th><th>at step</th><th>disagrees with peers</th>'
                     f'</tr>{rows}</table>')
    parts.append("</section>")
    return "\n".join(parts)


_STATUS_ORDER = {"error": 0, "diverged": 1, "unmatched": 2, "unknown": 3, "pass": 4}
_TABLE_COLS = (("step", "n"), ("rank", "n"), ("leaf", "s"), ("io", "s"), ("dtype", "s"), ("shape", "s"),
               ("rel_l2", "n"), ("tol", "n"), ("severity", "n"), ("from", "s"), ("cosine", "n"),
               ("max_abs_err", "n"), ("status", "s"), ("detail", "s"))


def _table_section(rows: pl.DataFrame, limit: int) -> str:
    order = pl.col("status").replace_strict(_STATUS_ORDER, default=5, return_dtype=pl.Int32)
    sev = pl.col("severity").fill_nan(None)
    top = (rows.filter(pl.col("status").is_not_null() & (pl.col("kind").is_null() | (pl.col("kind") != "null")))
           .with_columns(order.alias("_order"), sev.alias("_sev"))
           .sort(["_order", "_sev", "step", "rank", "_seq"], descending=[False, True, False, False, False],
                 nulls_last=True).head(limit))
    n_bad = int(rows.filter(pl.col("status").is_in(["diverged", "error", "unmatched"])).height)
    body = []
    for r in top.iter_rows(named=True):
        shape = r["shape"] if r["shape"] is not None else r.get("ref_shape")
        vals = (r["step"], r["rank"], r["_name"], r["_io"], r.get("dtype") or r.get("ref_dtype"),
                None if shape is None else "[" + ", ".join(str(x) for x in shape) + "]",
                r["err"], r["tol"], r["severity"], r["err_source"], r["cosine"], r["max_abs_err"], r["status"],
                r["detail"])
        cells = []
        for (_, kind), v in zip(_TABLE_COLS, vals):
            if kind == "n":
                key = "" if v is None else (str(v) if not isinstance(v, float) or math.isfinite(v)
                                            else ("1e999" if v > 0 else "-1e999"))
                cells.append(f'<td class="num" data-v="{_e(key)}">{_e(_fmt(v))}</td>')
            else:
                cells.append(f"<td>{_e(v) if v is not None else ''}</td>")
        body.append(f'<tr class="st-{_e(r["status"])}">{"".join(cells)}</tr>')
    head = "".join(f'<th data-k="{k}" title="click to sort">{_e(c)}</th>' for c, k in _TABLE_COLS)
    statuses = "".join(f'<option value="{s}">{s}</option>' for s in _STATUS_ORDER)
    return f"""
<section id="mismatches">
<h2>Top rows by severity</h2>
<p>{n_bad} leaves diverged, failed or are unmatched; showing the first {top.height} of {rows.height} rows,
mismatches first, then by severity (rel_l2 / tol). Click a header to sort; type to filter.</p>
<div class="controls"><input id="filter" type="search" placeholder="filter (any text)" size="40">
<select id="status-filter"><option value="">any status</option>{statuses}</select>
<span id="shown-count"></span></div>
<div class="scroll"><table class="grid sortable" id="top-table"><thead><tr>{head}</tr></thead>
<tbody>{"".join(body)}</tbody></table></div>
</section>"""


def _stack_of(cmp: Comparison, store, f: Finding) -> tuple[str, list[str]] | None:
    """The call stack of a finding's op, from the target run (or the reference, for an op only there)."""
    r = cmp.rows.filter((pl.col("step") == f.step) & (pl.col("rank") == f.rank)
                        & ((pl.col("record") == f.op) | (pl.col("ref_record") == f.op)))
    if f.name:
        named = r.filter((pl.col("name") == f.name) | (pl.col("ref_name") == f.name))
        r = named if named.height else r
    for run, col, rec in ((cmp.target, "stack_id", "record"), (cmp.ref, "ref_stack_id", "ref_record")):
        hit = r.filter((pl.col(rec) == f.op) & pl.col(col).is_not_null())
        if hit.height:
            df = _fetch(store, run, STACK_SQL, {"run": run, "step": f.step, "rank": f.rank,
                                                "sid": int(hit[col][0])})
            if df is not None and df.height:
                frames = df.row(0, named=True)["frames"]
                return run, list(frames or [])
    return None


def _frames_html(frames: list[str]) -> str:
    out = []
    for fr in frames:
        loc, _, code = str(fr).partition(", \n")
        out.append(f'<li><span class="loc">{_e(loc)}</span>' + (f"<br><code>{_e(code.strip())}</code>" if code else "")
                   + "</li>")
    return "<ol class=\"stack\">" + "".join(out) + "</ol>"


def _checklist_section(cl: Checklist | None) -> str:
    if cl is None:
        return ""
    rows = "".join(f'<tr class="st-{_e(c.status)}"><th>{_e(c.title)}</th><td>{_e(c.status)}</td>'
                   f"<td>{_e(c.evidence)}</td></tr>" for c in cl.checks)
    return ('<section id="checklist"><h2>Checklist</h2><p>Are the two runs fed the same thing?</p>'
            f"<table><thead><tr><th>check</th><th>status</th><th>evidence</th></tr></thead><tbody>{rows}"
            "</tbody></table></section>")


def _health_section(hr: HealthReport | None, limit: int = 50) -> str:
    if hr is None:
        return ""
    counts = ", ".join(f"{_e(k)} ×{_e(v)}" for k, v in hr.counts.items() if v) or "no findings"
    loss = "".join(f"<tr><td>{_e(x.get('step'))}</td><td>{_e(x.get('rank'))}</td><td>{_e(_fmt(x.get('value')))}"
                   "</td></tr>" for x in hr.loss)
    found = "".join(f"<tr><td>{_e(f.watchpoint)}</td><td>{_e(f.step)}</td><td>{_e(f.rank)}</td>"
                    f"<td><code>{_e(f.op)}</code></td><td>{_e(f.name or '')}</td><td>{_e(_fmt(f.value))}</td>"
                    f"<td>{_e(_fmt(f.threshold))}</td><td>{_e(f.detail or '')}</td></tr>"
                    for f in hr.findings[:limit])
    extra = len(hr.findings) - limit
    more = f"<p>… and {extra} more (dumpstore health --run …).</p>" if extra > 0 else ""
    parts = [f'<section id="health"><h2>Health of {_e(hr.run)}</h2><p>Single-run watchpoints: {counts}.</p>']
    if loss:
        parts.append("<h3>Loss per step</h3><table><thead><tr><th>step</th><th>rank</th><th>loss</th></tr></thead>"
                     f"<tbody>{loss}</tbody></table>")
    if found:
        parts.append("<table><thead><tr><th>watchpoint</th><th>step</th><th>rank</th><th>op</th><th>tensor</th>"
                     f"<th>value</th><th>threshold</th><th>detail</th></tr></thead><tbody>{found}</tbody></table>{more}")
    parts.append("</section>")
    return "".join(parts)


def _stack_section(cmp: Comparison, verdict: Verdict, store) -> str:
    parts = ['<section id="stack"><h2>Call stack</h2>']
    shown = set()
    for label, f in (("Culprit", verdict.culprit), ("First divergence", verdict.first_divergence)):
        if f is None or (f.step, f.rank, f.op) in shown:
            continue
        shown.add((f.step, f.rank, f.op))
        got = _stack_of(cmp, store, f) if store is not None else None
        if got is None:
            parts.append(f"<h3>{_e(label)}: <code>{_e(f.op)}</code></h3><p>no stack recorded (stack.json "
                         f"missing, or not in the store)</p>")
            continue
        run, frames = got
        parts.append(f"<h3>{_e(label)}: <code>{_e(f.op)}</code> <small>(run {_e(run)}, step {_e(f.step)}, rank "
                     f"{_e(f.rank)}; innermost frame first)</small></h3>{_frames_html(frames)}")
    if not shown:
        parts.append("<p>No divergence, so no stack to show.</p>")
    parts.append("</section>")
    return "\n".join(parts)


_META_FIELDS = ("source_path", "framework", "task", "level", "dump_mode", "generation", "steps", "ranks",
                "n_files", "n_records", "n_rows", "n_tensors", "n_tensor_files", "n_errors", "sample_k",
                "sketch_m", "created_at", "dumpstore_version")


def _dtype_counts(rows: pl.DataFrame, col: str, kind_col: str) -> str:
    t = rows.filter(pl.col(kind_col) == "tensor").group_by(col).len().sort("len", descending=True)
    return ", ".join(f"{d} ×{n}" for d, n in t.iter_rows() if d is not None) or "—"


def _meta_section(cmp: Comparison, verdict: Verdict, store, multi_rank: bool) -> str:
    info: dict[str, dict[str, Any]] = {}
    for run in (cmp.target, cmp.ref):
        try:
            info[run] = store.run_info(run) if store is not None else {}
        except DumpstoreError:
            info[run] = {}
    t, r = info[cmp.target], info[cmp.ref]
    rows = [("run", cmp.target, cmp.ref)]
    rows += [(k, t.get(k), r.get(k)) for k in _META_FIELDS if k in t or k in r]
    rows.append(("tensor dtypes compared", _dtype_counts(cmp.rows, "dtype", "kind"),
                 _dtype_counts(cmp.rows, "ref_dtype", "ref_kind")))
    rows.append(("compute precision", verdict.precision.get("target"), verdict.precision.get("ref")))
    exact = "msprobe_cosine" in cmp.rows.columns
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_list(a))}</td><td>{_e(_list(b))}</td></tr>" for k, a, b in rows)
    extra = (f"<p>Compared rows: {cmp.rows.height}; aligned records: {cmp.records.height}; exact tensor "
             f"metrics: {'yes' if exact else 'no (statistics / sketches)'}; amplification threshold "
             f"{cmp.tolerances.amplification:g}.</p>")
    return (f'<section id="meta"><h2>Runs</h2><table class="grid meta"><tr><th></th><th>target</th>'
            f'<th>reference</th></tr>{body}</table>{extra}</section>')


def _list(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    return None if v == "" else v


# -- the page ------------------------------------------------------------------------------------------------


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


_GUARD_JS = """
window.__reportErrors = [];
window.__reportError = function (msg) {
  window.__reportErrors.push(String(msg));
  var el = document.getElementById('js-errors');
  if (el) { el.textContent = window.__reportErrors.join('\\n'); el.hidden = false; }
};
window.addEventListener('error', function (e) { window.__reportError('Uncaught ' + (e.message || e)); });
window.addEventListener('unhandledrejection', function (e) {
  window.__reportError('Unhandled rejection ' + (e.reason && e.reason.message || e.reason)); });
document.addEventListener('securitypolicyviolation', function (e) {
  window.__reportError('CSP blocked ' + e.violatedDirective + ' ' + (e.blockedURI || '')); });
(function () { var ce = console.error; console.error = function () {
  window.__reportError('console.error ' + Array.prototype.join.call(arguments, ' '));
  return ce.apply(console, arguments); }; })();
window.alert = function (m) { window.__reportError('alert() called: ' + m); };
"""

_MAIN_JS = """
(function () {
  var t0 = performance.now();
  var data = JSON.parse(document.getElementById('report-data').textContent);
  var config = {displaylogo: false, responsive: true};
  var ids = {line: 'chart-line', steps: 'chart-steps', ranks: 'chart-ranks'};
  var jobs = [];
  Object.keys(data.figures).forEach(function (k) {
    var el = document.getElementById(ids[k]);
    var fig = data.figures[k];
    if (el && fig && window.Plotly) { jobs.push(Plotly.newPlot(el, fig.data, fig.layout, config)); }
  });
  if (!window.Plotly) { window.__reportError('plotly.js did not load'); }
  Promise.all(jobs).then(function () {
    document.body.setAttribute('data-charts', String(jobs.length));
    document.getElementById('render-ms').textContent = (performance.now()).toFixed(0);
    var paint = performance.getEntriesByName('first-contentful-paint')[0];
    document.body.setAttribute('data-first-paint-ms', paint ? paint.startTime.toFixed(0) : '');
  }, function (err) { window.__reportError('chart failed: ' + err); });

  var table = document.getElementById('top-table');
  if (!table) { return; }
  var tbody = table.tBodies[0];
  var rows = Array.prototype.slice.call(tbody.rows);
  var filter = document.getElementById('filter');
  var status = document.getElementById('status-filter');
  var count = document.getElementById('shown-count');
  function apply() {
    var q = filter.value.toLowerCase(), s = status.value, n = 0;
    rows.forEach(function (tr) {
      var ok = (!q || tr.textContent.toLowerCase().indexOf(q) >= 0) && (!s || tr.className === 'st-' + s);
      tr.style.display = ok ? '' : 'none';
      if (ok) { n++; }
    });
    count.textContent = n + ' of ' + rows.length + ' rows';
  }
  filter.addEventListener('input', apply);
  status.addEventListener('change', apply);
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
    th.addEventListener('click', function () {
      var asc = th.getAttribute('data-sort') !== 'asc';
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute('data-sort'); });
      th.setAttribute('data-sort', asc ? 'asc' : 'desc');
      var numeric = th.getAttribute('data-k') === 'n';
      rows.sort(function (a, b) {
        var x = a.cells[col], y = b.cells[col], r;
        if (numeric) {
          var xv = x.getAttribute('data-v'), yv = y.getAttribute('data-v');
          if (xv === '' && yv === '') { return 0; }
          if (xv === '') { return 1; }
          if (yv === '') { return -1; }
          r = parseFloat(xv) - parseFloat(yv);
        } else {
          r = x.textContent.localeCompare(y.textContent);
        }
        return asc ? r : -r;
      });
      rows.forEach(function (tr) { tbody.appendChild(tr); });
    });
  });
  apply();
})();
"""

_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0 auto;
       max-width: 1360px; padding: 16px 24px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; border-bottom: 1px solid #ddd; padding-bottom: 4px;
margin-top: 28px; } h3 { font-size: 15px; margin: 12px 0 6px; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; word-break: break-all; }
.sub { color: #666; margin: 0; }
#verdict .headline { font: 600 15px ui-monospace, Menlo, Consolas, monospace; padding: 10px 12px;
  border-radius: 6px; word-break: break-all; }
#verdict.diverged .headline { background: #fdecea; border: 1px solid #f5c2c0; }
#verdict.pass .headline { background: #e9f7ef; border: 1px solid #b7e1c6; }
.findings { display: grid; grid-template-columns: repeat(auto-fit, minmax(600px, 1fr)); gap: 12px; }
.finding { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; background: #fafafa; }
.finding.bad { border-color: #f5c2c0; } .finding.none { color: #555; }
.finding h3 { margin-top: 4px; } .metric { font-family: ui-monospace, Menlo, Consolas, monospace; }
.rule { color: #666; font-size: 12.5px; } .warn { color: #8a5a00; }
table.kv th { text-align: left; font-weight: 600; padding: 2px 12px 2px 0; vertical-align: top; white-space: nowrap; }
table.kv td { word-break: break-all; }
table.grid { border-collapse: collapse; font-size: 12.5px; }
table.grid th, table.grid td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
table.grid th { background: #f3f3f3; }
table.sortable th { cursor: pointer; user-select: none; white-space: nowrap; }
table.sortable th[data-sort=asc]::after { content: " ▲"; } table.sortable th[data-sort=desc]::after { content: " ▼"; }
td.num { text-align: right; font-family: ui-monospace, Menlo, Consolas, monospace; white-space: nowrap; }
tr.st-diverged td, tr.st-error td { background: #fff4f3; } tr.st-unmatched td { background: #fffbe6; }
.scroll { max-height: 640px; overflow: auto; border: 1px solid #eee; }
.controls { margin: 6px 0; } .controls input, .controls select { font-size: 13px; padding: 3px 6px; }
.chart { width: 100%; min-height: 260px; }
ol.stack { font-size: 12.5px; } ol.stack li { margin-bottom: 4px; } ol.stack .loc { color: #555; }
#js-errors { background: #fdecea; color: #a00; padding: 8px; white-space: pre-wrap; }
footer { color: #888; font-size: 12px; margin-top: 30px; }
"""


def _page(title: str, when: str, body: str, data: dict) -> str:
    plotly = plotly_js()
    csp = (f"default-src 'none'; script-src {_sha(_GUARD_JS)} {_sha(plotly)} {_sha(_MAIN_JS)}; "
           "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; connect-src 'none'; "
           "base-uri 'none'; form-action 'none'")
    from dumpstore import __version__

    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title>
<style>{_CSS}</style>
<script>{_GUARD_JS}</script>
</head>
<body>
<h1>{_e(title)}</h1>
<p class="sub">generated {_e(when)} by dumpstore {_e(__version__)} · self-contained, works offline</p>
<pre id="js-errors" hidden></pre>
{body}
<footer>Charts drawn <span id="render-ms"></span> ms after the page started loading. plotly.js (MIT) is embedded.
</footer>
<script type="application/json" id="report-data">{_json_for_script(data)}</script>
<script>{plotly}</script>
<script>{_MAIN_JS}</script>
</body>
</html>
"""

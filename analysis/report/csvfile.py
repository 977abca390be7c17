"""The CSV report: one row per aligned leaf, msprobe's columns with msprobe's values, then dumpstore's own columns.

One row per aligned leaf (tensors and non-tensor arguments, unmatched leaves included), in the store's order.
msprobe 26.x column names (§5.7 of MSPROBE_FORMAT.md) hold what `msprobe compare` writes for the same pair
(msprobe_csv.py): dtypes and shapes as dumped, the summary cells as msprobe holds them (`None`, `True`/`False`,
`Nan`, ` inf`), the statistics diffs and relative errors (statistics mode), `NPU MD5` / `BENCH MD5` (md5 mode),
the six tensor metrics (tensor mode; `unsupported` where msprobe cannot compare; `report --csv` on two tensor
dumps reads the files as `--exact` does), `Result` / `Err_message` by msprobe's own per-op rules,
`NPU_Stack_Info` on the first row of each op, `Data_name`.  The columns msprobe does not write in the dump's mode
(e.g. `Cosine` in statistics mode) hold dumpstore's estimates, as numbers.
dumpstore's judgement is in its own columns: `rel_l2` (relative L2 error), `err_source`, `err_bound`, `tol`,
`tol_dtype`, `severity` (rel_l2 / tol), `dumpstore_status` (pass, diverged, unmatched, unknown, error),
`dumpstore_result` (its pass / warning / error), `dumpstore_detail` and `dumpstore_message` (a JSON list naming
the metric and threshold), `dumpstore_paired_with` (the reference leaf dumpstore paired the row with, N/A for none).
msprobe's columns follow msprobe's own pairing (msprobe_pairing.py: by name, backward calls renumbered): where an
extra or missing call makes dumpstore pair a row with another reference leaf than msprobe does, `Bench Name` and
the other msprobe cells describe msprobe's pair and dumpstore's columns its own.

`write_csv` (csvwrite.py) is the one function that writes the file: by columns (csvcols.py: statistics, md5 and
tensor mode, runs of different modes) or row by row from here (rows msprobe pairs otherwise), the same bytes;
`iter_csv_rows` / `csv_rows` build the rows one op at a time, `_csv_row` one row and `dumpstore.csvsafe`
neutralises each cell.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import polars as pl

from .. import msprobe_csv, msprobe_pairing
from ..compare import Comparison
from .data import fetch
from .text import fmt

__all__ = [
    "CSV_COLUMNS",
    "DUMPSTORE_COLUMNS",
    "MSPROBE_COLUMNS",
    "RESULT_OF_STATUS",
    "csv_rows",
    "iter_csv_rows",
]

N_A = "N/A"
PROGRESS_ROWS = 50_000
Progress = Callable[[str, int, int], None]  # (stage, done, total)


MSPROBE_COLUMNS: tuple[str, ...] = (
    "NPU Name",
    "Bench Name",
    "NPU Dtype",
    "Bench Dtype",
    "NPU Tensor Shape",
    "Bench Tensor Shape",
    "NPU Requires_grad",
    "Bench Requires_grad",
    *msprobe_csv.TENSOR_METRIC_COLUMNS,
    *msprobe_csv.DIFF_COLUMNS,
    "NPU max",
    "NPU min",
    "NPU mean",
    "NPU l2norm",
    "Bench max",
    "Bench min",
    "Bench mean",
    "Bench l2norm",
    "Requires_grad Consistent",
    "Result",
    "Err_message",
    "NPU_Stack_Info",
    "Data_name",
)
DUMPSTORE_COLUMNS: tuple[str, ...] = (
    "step",
    "rank",
    "seq",
    "op",
    "io",
    "match",
    "rel_l2",
    "err_source",
    "err_bound",
    "tol",
    "tol_dtype",
    "severity",
    "dumpstore_result",
    "dumpstore_status",
    "dumpstore_detail",
    "dumpstore_message",
    "dumpstore_paired_with",
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
# what a row's msprobe cells must not take from dumpstore's pair when msprobe pairs the row otherwise
_PAIR_ONLY = (
    *(c for pair in _METRIC_SOURCES.values() for c in pair),
    "max_diff",
    "min_diff",
    "mean_diff",
    "norm_diff",
    "msprobe_message",
)
RESULT_OF_STATUS = {"pass": "pass", "diverged": "error", "error": "error", "unmatched": "warning", "unknown": "warning"}
_STATS = (("max", "max"), ("min", "min"), ("mean", "mean"), ("norm", "l2norm"))

_SIDE_INPUTS = (
    "name",
    "index_path",
    "kind",
    "dtype",
    "dtype_raw",
    "value_type",
    "value",
    "scalar_value",
    "shape",
    "checksum",
    "requires_grad",
    "data_name",
    "record",
    "seq",
    "io",
    "stack_id",
    "max",
    "min",
    "mean",
    "norm",
    "dump_max",
    "dump_min",
    "dump_mean",
    "dump_norm",
)
_CSV_INPUTS = frozenset(
    _SIDE_INPUTS
    + tuple(c for pair in _METRIC_SOURCES.values() for c in pair)
    + (
        "step",
        "rank",
        "source",
        "match",
        "err",
        "err_source",
        "err_bound",
        "tol",
        "tol_dtype",
        "severity",
        "status",
        "detail",
        "nonfinite_mismatch",
        "max_diff",
        "min_diff",
        "mean_diff",
        "norm_diff",
        "msprobe_message",
    )
)

RAW_SQL = (
    "SELECT step, rank, source, leaf, dtype_raw, dump_max, dump_min, dump_mean, dump_norm FROM tensors WHERE run = $run"
)
STACKS_SQL = "SELECT step, rank, stack_id, frames FROM stacks WHERE run = $run"
STACK_SQL = "SELECT frames FROM stacks WHERE run = $run AND step = $step AND rank = $rank AND stack_id = $sid"


def csv_rows(cmp: Comparison, *, store=None) -> list[dict[str, Any]]:
    """The CSV rows as dicts keyed by CSV_COLUMNS (msprobe's cells as msprobe writes them; dumpstore's numbers as
    float/int, None when unknown)."""
    return list(iter_csv_rows(cmp, store=store))


def iter_csv_rows(cmp: Comparison, *, store=None) -> Iterator[dict[str, Any]]:
    """csv_rows one at a time (what write_csv streams)."""
    rows = _with_raw(cmp, store)
    rows = rows.select([c for c in rows.columns if c.removeprefix("ref_") in _CSV_INPUTS])
    stacks = _all_stacks(store, cmp.target) if store is not None else {}
    seen_ops, mode = set(), msprobe_csv.dump_mode(cmp, store)
    # msprobe's columns follow msprobe's own pairing (msprobe_pairing.py), dumpstore's columns its own
    own_pairing = not msprobe_pairing.applies(cmp, store)
    ms_pairs = {} if own_pairing else msprobe_pairing.msprobe_pairs(rows)
    benches = {j: rows.row(j, named=True) for j in set(ms_pairs.values()) if j is not None}
    cells = msprobe_pairing.exact_cells(store, cmp, ms_pairs) if ms_pairs and mode == "tensor" else {}

    def view(i: int, r: dict[str, Any]) -> dict[str, Any]:
        """The leaf pair msprobe's cells describe: msprobe's pair of the row's target leaf."""
        if i in ms_pairs:
            j = ms_pairs[i]
            r = msprobe_pairing.repaired(r, benches[j] if j is not None else None, _PAIR_ONLY)
            r.update(cells.get(i, {}))
        if own_pairing or r.get("name") is None or r.get("ref_name") is None:
            return r
        if msprobe_pairing.dtype_match(_msprobe_dtype(r, ""), _msprobe_dtype(r, "ref_")):
            return r
        return msprobe_pairing.repaired(r, None, _PAIR_ONLY)  # dtypes msprobe does not pair: unmatched

    # a summary column msprobe's pandas table holds as float64 prints its integers as floats: one pass to find them
    helds = (msprobe_csv.held_summary(view(i, r)) for i, r in enumerate(rows.iter_rows(named=True)) if r["name"])
    floats = msprobe_csv.float_columns(helds) if mode in ("statistics", "tensor", "md5") else frozenset()
    group: list[dict[str, Any]] = []  # the rows of one op: msprobe's verdict rules run per op
    group_key = None
    for i, r in enumerate(rows.iter_rows(named=True)):
        d = _csv_row(r)
        d["dumpstore_paired_with"] = r["ref_name"] if r.get("ref_name") is not None else N_A
        ms = view(i, r)
        if ms is not r:
            d.update({c: v for c, v in _csv_row(ms).items() if c in MSPROBE_COLUMNS})
        msprobe_csv.fill(d, ms, mode, floats)  # msprobe's cells as msprobe writes them for this dump mode
        # a reference-only row is an op of its own, even where the target has a record of the same name
        op_key = (r["step"], r["rank"], r["source"], r["record"] or ("", r.get("ref_record")))
        frames = stacks.get((r["step"], r["rank"], r["stack_id"])) if r["record"] else None
        if frames is not None and op_key not in seen_ops:
            d["NPU_Stack_Info"] = str(list(frames))
        seen_ops.add(op_key)
        if op_key != group_key and group:
            msprobe_csv.verdicts(group, mode)
            yield from group
            group = []
        group_key = op_key
        group.append(d)
    if group:
        msprobe_csv.verdicts(group, mode)
        yield from group


def _with_raw(cmp: Comparison, store) -> pl.DataFrame:
    """cmp.rows plus the dumped dtype and the dumper's statistics of both sides (when the store is given)."""
    rows = cmp.rows
    if store is None:
        return rows
    keys = ["step", "rank", "source", "leaf"]
    rows = rows.with_row_index("_row")
    for run, prefix in ((cmp.target, ""), (cmp.ref, "ref_")):
        raw = fetch(store, run, RAW_SQL, {"run": run})
        if raw is None:
            continue
        raw = raw.rename({c: f"{prefix}{c}" for c in raw.columns if c not in keys or c == "leaf"})
        on = ["step", "rank", "source", f"{prefix}leaf"]
        raw = raw.with_columns([pl.col(c).cast(rows.schema[c]) for c in on if c in rows.columns])
        rows = rows.join(raw, on=on, how="left")
    return rows.sort("_row").drop("_row")


def _all_stacks(store, run: str) -> dict[tuple, list[str]]:
    df = fetch(store, run, STACKS_SQL, {"run": run})
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
        d[f"{label} diff"] = _stat_diff(
            d[f"NPU {'l2norm' if stat == 'norm' else stat}"],
            d[f"Bench {'l2norm' if stat == 'norm' else stat}"],
            r.get(f"{stat}_diff"),
        )
    d["Requires_grad Consistent"] = str(d["NPU Requires_grad"]) == str(d["Bench Requires_grad"])  # N/A == N/A
    d["Result"], d["Err_message"] = "pass", "[]"  # msprobe's verdict, set per op by msprobe_csv.verdicts
    d["NPU_Stack_Info"] = N_A
    d["Data_name"] = str([_data_name(r.get("data_name"), t_here), _data_name(r.get("ref_data_name"), r_here)])
    d.update(
        step=r["step"],
        rank=r["rank"],
        seq=r.get("seq") if r.get("seq") is not None else r.get("ref_seq"),
        op=r.get("record") or r.get("ref_record"),
        io=r.get("io") or r.get("ref_io"),
        match=r.get("match"),
        rel_l2=r.get("err"),
        err_source=r.get("err_source"),
        err_bound=r.get("err_bound"),
        tol=r.get("tol"),
        tol_dtype=r.get("tol_dtype"),
        severity=r.get("severity"),
        dumpstore_result=RESULT_OF_STATUS.get(r["status"] or "", N_A),
        dumpstore_status=r.get("status"),
        dumpstore_detail=r.get("detail"),
        dumpstore_message=json.dumps(_messages(r, d)),
    )
    return d


def _msprobe_dtype(r: dict, pre: str) -> str:
    kind = r.get(f"{pre}kind")
    if kind == "null":
        return N_A
    if kind == "tensor":
        raw = r.get(f"{pre}dtype_raw")
        return raw or (f"torch.{r[f'{pre}dtype']}" if r.get(f"{pre}dtype") else N_A)
    if kind == "scalar":
        return msprobe_csv.argument_cells(r, pre)[0]
    return r.get(f"{pre}dtype") or N_A


def _msprobe_shape(r: dict, pre: str) -> str:
    kind = r.get(f"{pre}kind")
    if kind == "null":
        return N_A
    shape = r.get(f"{pre}shape")
    if kind == "tensor" and shape is not None:
        return "[" + ", ".join(str(int(x)) for x in shape) + "]"
    return msprobe_csv.argument_cells(r, pre)[1] if kind == "scalar" else N_A


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
            out.append(
                f"error: rel_l2 {fmt(r.get('err'))} > tol {fmt(r.get('tol'))} ({r.get('tol_dtype')}), "
                f"from {r.get('err_source')}" + (f"; {r['detail']}" if r.get("detail") else "")
            )
    elif status == "error":
        out.append(f"error: {r.get('detail') or 'leaf could not be read'}")
    elif status == "unmatched":
        out.append(
            "warning: No bench data matched."
            if r.get("name") is not None
            else "warning: only in the reference (bench); no target data matched."
        )
    elif status == "unknown":
        out.append("warning: not comparable from what was dumped (no norm, sketch or checksum on both sides)")
    if r.get("msprobe_message"):
        out.append(f"info: msprobe: {r['msprobe_message']}")
    if d["NPU Requires_grad"] != d["Bench Requires_grad"] and status != "unmatched":
        out.append(f"warning: requires_grad {d['NPU Requires_grad']} vs {d['Bench Requires_grad']}")
    return out


def _data_name(name: str | None, here: bool) -> str:
    """msprobe's Data_name entry: the file name, '-1' for a leaf without a file, 'N/A' for a side without a leaf."""
    return N_A if not here else name or "-1"

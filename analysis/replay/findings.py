"""Findings from stored replay tables: the first op over its standard (culprit kind `kernel`), side by side with a
reference run's replay when there is one."""

from __future__ import annotations

from typing import Any

import polars as pl

from dumpstore.replaytable import read_replay
from dumpstore.store import Store

from ..verdict import Finding

KERNEL = "kernel"
_JOIN = ["step", "rank", "record", "output"]


def _table(store: Store, run: str) -> pl.DataFrame | None:
    table = read_replay(store, run)
    if table is None:
        return None
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    return df.sort(["step", "rank", "seq"], maintain_order=True)


def first_failure(df: pl.DataFrame) -> dict[str, Any] | None:
    """The first failed output in execution order (step, rank, seq, then the output's order)."""
    bad = df.filter(pl.col("status") == "fail")
    return bad.row(0, named=True) if bad.height else None


def kernel_message(row: dict[str, Any], ref: dict[str, Any] | None = None) -> str:
    """`gelu is 2,000× farther from float64 than the CPU's float32 gelu (rel_l2 2e-4 vs 1e-7; judged ratio 700 > 2,
    the CPU's error floored at 2.8e-7)`; with the reference's row: `; the reference's is 1×`. "Farther" is the plain
    ratio of the two errors; the verdict's ratio floors the CPU's error (docs/replay.md)."""
    api, dtype = row["api"], row["dtype"]
    if row.get("metric") == "inf_nan":
        text = f"{row['name']}: {row['reason']}"
    elif row.get("standard") == "binary":
        text = f"{row['name']}: {row['reason']} (binary standard: {dtype} outputs must be equal)"
    else:
        under = f" or at the run's autocast {row['autocast']}" if row.get("autocast") else ""
        text = (
            f"{row['name']}: {api} is {_times(_plain(row))} farther from float64 than the CPU's {dtype} {api}{under} "
            f"({row['metric']} {_num(row.get('err'))} vs {_num(row.get('cpu_err'))}; judged ratio "
            f"{_num(row.get('ratio'))} > {_num(row['threshold'])}; msprobe's benchmark standard: "
            f"{row.get('msprobe_status')})"
        )
    if ref is not None:
        text += f"; the reference's is {_times(_plain(ref))}" + (
            f" ({ref['status']})" if ref.get("status") not in ("pass", "fail") else ""
        )
    return text


def _plain(row: dict[str, Any]) -> float | None:
    """err / cpu_err, or the judged ratio where the CPU's error is 0 or missing."""
    err, cpu = row.get("err"), row.get("cpu_err")
    if err is None or not cpu:
        return row.get("ratio")
    return err / cpu


def _times(v: Any) -> str:
    if v is None:
        return "n/a"
    if v != v or v == float("inf"):
        return "inf×"
    return f"{v:.2g}×" if v < 10 else f"{v:,.0f}×"


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def replayed(store: Store, run: str) -> bool:
    """Whether `run` was replayed (`dumpstore replay`) since its last ingest."""
    from dumpstore.replaytable import replay_path

    return replay_path(store, run, store.run_info(run)["ingest_id"]).is_file()


def kernel_finding(store: Store, run: str, *, ref: str | None = None) -> Finding | None:
    """The first op of `run` (execution order) whose output is farther from float64 than its standard allows, from
    the stored replay (run `dumpstore replay` first); None when not replayed or nothing failed. With `ref` (also
    replayed), the reference's local error of the same output goes into the evidence and the detail."""
    df = _table(store, run)
    if df is None:
        return None
    row = first_failure(df)
    if row is None:
        return None
    ref_row = None
    if ref is not None:
        rdf = _table(store, ref)
        if rdf is not None:
            hit = rdf.filter(*(pl.col(k) == row[k] for k in _JOIN))
            ref_row = hit.row(0, named=True) if hit.height else None
    evidence = {
        k: row.get(k) for k in ("err", "cpu_err", "ratio", "standard", "api_level", "msprobe_status", "msprobe_reason")
    }
    if ref_row is not None:
        evidence.update(ref_ratio=ref_row.get("ratio"), ref_err=ref_row.get("err"), ref_status=ref_row.get("status"))
    return Finding(
        step=int(row["step"]),
        rank=int(row["rank"]),
        op=str(row["record"]),
        name=row["name"],
        kind=KERNEL,
        metric=f"{row['metric']}_ratio" if row.get("metric") == "rel_l2" else row.get("metric"),
        value=row.get("ratio"),
        threshold=row.get("threshold"),
        source="replay",
        dtype=row.get("dtype"),
        detail=kernel_message(row, ref_row),
        evidence=evidence,
    )


def side_by_side(store: Store, target: str, ref: str) -> pl.DataFrame:
    """Per output of the target's replayed ops: the target's and the reference's local error, ratio and status."""
    t, r = _table(store, target), _table(store, ref)
    if t is None or r is None:
        missing = target if t is None else ref
        from .plan import ReplayError

        raise ReplayError(f"run {missing!r} has no replay table; run: dumpstore replay --run {missing}")
    cols = ["metric", "err", "cpu_err", "ratio", "status"]
    left = t.filter(pl.col("output").is_not_null()).select(
        "step", "rank", "seq", "record", "output", "name", "dtype", "threshold", *cols
    )
    right = r.filter(pl.col("output").is_not_null()).select(*_JOIN, *[pl.col(c).alias("ref_" + c) for c in cols])
    return left.join(right, on=_JOIN, how="left").sort(["step", "rank", "seq"], maintain_order=True)

"""Read the rows of one run from the store into Polars (one DuckDB statement, partition-pruned)."""

from __future__ import annotations

import glob

import duckdb
import polars as pl

from dumpstore.query import _HIVE, _literal_list, connect, fetch_arrow
from dumpstore.store import Store

COLUMNS = ("step, rank, source, rank_dir, seq, leaf, record, prefix, api, op_type, direction, module, io, "
           "index_path, name, kind, value_type, value, scalar_value, dtype, shape, numel, requires_grad, "
           "min, max, mean, norm, stats_source, nan_count, posinf_count, neginf_count, sat_count, has_nan, "
           "has_posinf, has_neginf, has_sat, checksum, checksum_kind, data_name, file_status, sample, sketch, "
           "stack_id, error")

LOAD_SQL = f"SELECT {COLUMNS} FROM tensors WHERE run = $run {{where}}"


def load_run(store: Store, run: str, *, steps: list[int] | None = None, ranks: list[int] | None = None,
             units: list[tuple[int, int]] | None = None, sketches: bool = True) -> pl.DataFrame:
    """All leaf rows of `run` (optionally only some steps/ranks, or only some (step, rank) pairs), in execution
    order."""
    info = store.run_info(run)
    sketches = sketches and bool(info.get("n_tensor_files"))
    if units is not None:
        files = _unit_files(store, run, units, steps, ranks)
        if files:
            return _load_files(files, sketches)
    con = connect(store, runs=[run])
    where, params = [], {"run": run}
    if units is not None:  # the step and rank lists prune partitions; the pair filter keeps only those pairs
        steps = sorted({s for s, _ in units} & (set(steps) if steps is not None else {s for s, _ in units}))
        ranks = sorted({k for _, k in units} & (set(ranks) if ranks is not None else {k for _, k in units}))
        where.append(f"AND (step * 4294967296 + rank) IN ({_ints(int(s) * 4294967296 + int(k) for s, k in units)})")
    # literal lists (not parameters), so that DuckDB prunes the hive partitions before opening files
    if steps is not None:
        where.append(f"AND step IN ({_ints(steps)})")
    if ranks is not None:
        where.append(f"AND rank IN ({_ints(ranks)})")
    sql = LOAD_SQL.format(where=" ".join(where))
    if not sketches:
        sql = sql.replace(", sample, sketch,", ",")
    try:
        df = pl.from_arrow(fetch_arrow(con, sql, params))
    finally:
        con.close()
    if not sketches:  # same columns either way, so callers need not care
        df = df.with_columns(pl.lit(None, pl.List(pl.Float64)).alias("sample"),
                             pl.lit(None, pl.List(pl.Float64)).alias("sketch"))
    return df.sort(["step", "rank", "source", "leaf"])  # type: ignore[union-attr]


def _unit_files(store: Store, run: str, units: list[tuple[int, int]], steps: list[int] | None,
                ranks: list[int] | None) -> list[str]:
    """The live ingest's files of `run` for the (step, rank) pairs asked (within `steps` and `ranks`)."""
    want = {(int(s), int(k)) for s, k in units if (steps is None or s in steps) and (ranks is None or k in ranks)}
    out = []
    for pattern in store.tensor_files([run]):
        head, tail = pattern.rsplit("/*/*/", 1)
        for s, k in sorted(want):
            out += sorted(glob.glob(f"{head}/step={s}/rank={k}/{tail}"))
    return out


def _load_files(files: list[str], sketches: bool) -> pl.DataFrame:
    """The rows of these files (one DuckDB statement over just them; no views needed)."""
    con = duckdb.connect(":memory:")
    try:
        cols = COLUMNS if sketches else COLUMNS.replace(", sample, sketch,", ",")
        sql = f"SELECT {cols} FROM read_parquet({_literal_list(files)}, {_HIVE})"
        df = pl.from_arrow(fetch_arrow(con, sql))
    finally:
        con.close()
    if not sketches:
        df = df.with_columns(pl.lit(None, pl.List(pl.Float64)).alias("sample"),
                             pl.lit(None, pl.List(pl.Float64)).alias("sketch"))
    return df.sort(["step", "rank", "source", "leaf"])  # type: ignore[union-attr]


def _ints(values) -> str:
    """A SQL list of integers; NULL for none (so that `x IN (NULL)` matches nothing)."""
    return ", ".join(str(int(v)) for v in values) or "NULL"

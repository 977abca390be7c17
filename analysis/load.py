"""Read the rows of one run from the store into Polars (one DuckDB statement, partition-pruned)."""

from __future__ import annotations

import polars as pl

from dumpstore.query import connect, fetch_arrow
from dumpstore.store import Store

COLUMNS = ("step, rank, source, rank_dir, seq, leaf, record, prefix, api, op_type, direction, module, io, "
           "index_path, name, kind, value_type, value, scalar_value, dtype, shape, numel, requires_grad, "
           "min, max, mean, norm, stats_source, nan_count, posinf_count, neginf_count, sat_count, has_nan, "
           "has_posinf, has_neginf, has_sat, checksum, checksum_kind, data_name, file_status, sample, sketch, "
           "stack_id, error")

LOAD_SQL = f"SELECT {COLUMNS} FROM tensors WHERE run = $run {{where}}"


def load_run(store: Store, run: str, *, steps: list[int] | None = None, ranks: list[int] | None = None,
             sketches: bool = True) -> pl.DataFrame:
    """All leaf rows of `run` (optionally only some steps/ranks), in execution order."""
    info = store.run_info(run)
    sketches = sketches and bool(info.get("n_tensor_files"))
    con = connect(store, runs=[run])
    where, params = [], {"run": run}
    if steps is not None:
        where.append("AND step IN (SELECT unnest($steps))")
        params["steps"] = list(steps)
    if ranks is not None:
        where.append("AND rank IN (SELECT unnest($ranks))")
        params["ranks"] = list(ranks)
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

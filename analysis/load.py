"""Read the rows of one run from the store into Polars: the live ingest's files of the steps and ranks asked.

The files are found from the hive layout (`tensors/run=/step=/rank=/part-<ingest>*.parquet`, only the live
ingest's) and read with Polars' Parquet reader, so a comparison does not start DuckDB.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable
from typing import Any

import polars as pl

from dumpstore.store import Store

from .order import sort_rows

COLUMNS = (
    "step, rank, source, rank_dir, seq, leaf, record, prefix, api, op_type, direction, module, io, "
    "index_path, name, kind, value_type, value, scalar_value, dtype, shape, numel, requires_grad, "
    "min, max, mean, norm, stats_source, nan_count, posinf_count, neginf_count, sat_count, has_nan, "
    "has_posinf, has_neginf, has_sat, checksum, checksum_kind, data_name, file_status, sample, sketch, "
    "stack_id, error"
)
_FILE_COLUMNS = [c for c in COLUMNS.split(", ") if c not in ("step", "rank")]
_LISTS = ("sample", "sketch")  # read by pyarrow (`_read_file`)
_PARTITION = re.compile(r"/step=(-?\d+)/rank=(-?\d+)/[^/]+$")


def load_run(
    store: Store,
    run: str,
    *,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    units: list[tuple[int, int]] | None = None,
    sketches: bool = True,
) -> pl.DataFrame:
    """All leaf rows of `run` (optionally only some steps/ranks, or only some (step, rank) pairs), in execution
    order."""
    info = store.run_info(run)
    sketches = sketches and bool(info.get("n_tensor_files"))
    files = run_files(store, run, steps=steps, ranks=ranks, units=units)
    return _load_files(files, sketches)


def run_files(
    store: Store,
    run: str,
    *,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    units: Iterable[tuple[int, int]] | None = None,
) -> list[tuple[str, int, int]]:
    """(path, step, rank) of the live ingest's Parquet files of `run`, optionally only some steps/ranks, or only
    some (step, rank) pairs."""
    want = None if units is None else {(int(s), int(k)) for s, k in units}
    files = []
    for pattern in store.tensor_files([run]):
        for path in sorted(glob.glob(pattern)):
            m = _PARTITION.search(path)
            if m is None:
                continue
            step, rank = int(m.group(1)), int(m.group(2))
            if (
                (steps is None or step in steps)
                and (ranks is None or rank in ranks)
                and (want is None or (step, rank) in want)
            ):
                files.append((path, step, rank))
    return files


def _load_files(files: list[tuple[str, int, int]], sketches: bool) -> pl.DataFrame:
    cols = _FILE_COLUMNS if sketches else [c for c in _FILE_COLUMNS if c not in ("sample", "sketch")]
    if files:
        frames = [
            _read_file(path, cols).with_columns(_lit(rank, "rank"), _lit(step, "step")) for path, step, rank in files
        ]
        df = pl.concat(frames, how="vertical").select("step", "rank", *cols)
    else:
        import pyarrow as pa

        from dumpstore.schema import TENSOR_SCHEMA

        schema = pa.schema(
            [pa.field("step", pa.int64()), pa.field("rank", pa.int64())] + [TENSOR_SCHEMA.field(c) for c in cols]
        )
        df = _frame(schema.empty_table())
    if not sketches:  # same columns either way, so callers need not care
        df = df.with_columns(
            pl.lit(None, pl.List(pl.Float64)).alias("sample"), pl.lit(None, pl.List(pl.Float64)).alias("sketch")
        )
    return sort_rows(df, ["step", "rank", "source", "leaf"])


def _lit(value: int, name: str) -> pl.Expr:
    return pl.lit(value, pl.Int64).alias(name)


def _read_file(path: str, cols: list[str]) -> pl.DataFrame:
    """The columns of one file: the flat ones by Polars' reader (2.5x pyarrow's read plus the conversion), the
    sample and sketch lists by pyarrow's (Polars took 0.15-0.18 s for the bench tensor dump's, pyarrow with the
    conversion 0.06-0.08 s)."""
    lists = [c for c in cols if c in _LISTS]
    flat = pl.read_parquet(path, columns=[c for c in cols if c not in _LISTS])
    if not lists:
        return flat
    from dumpstore.arrays import table_to_polars
    from dumpstore.parquetio import read_columns

    return pl.concat([flat, table_to_polars(read_columns(path, lists)).select(lists)], how="horizontal")


def _frame(table: Any) -> pl.DataFrame:
    """An Arrow table as a DataFrame (pl.from_arrow is typed DataFrame | Series)."""
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    return df

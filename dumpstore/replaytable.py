"""The store's `replay` table: per op and output, a run's recorded output judged against a float64 replay.

Written by `dumpstore.analysis.replay` (`dumpstore replay`), one file per run and live ingest:
`<store>/replay/run=<run>/part-<ingest_id>.parquet`. A re-ingest of the run gives it a new ingest id, so results
of the old dump stop showing (the view reads only the live ingests' files). Read through the DuckDB view
`replay` (`dumpstore query`) like every other table; the columns are described in REPLAY_FIELDS.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    import duckdb

    from .store import Store

REPLAY_DIR = "replay"

REPLAY_FIELDS = [
    ("step", pa.int64(), "step"),
    ("rank", pa.int64(), "rank"),
    ("seq", pa.int32(), "execution order of the record within step and rank (as in `tensors`)"),
    ("record", pa.string(), "msprobe record key, e.g. Functional.gelu.0.forward"),
    ("prefix", pa.string(), "Functional, Torch, Tensor, Aten, ..."),
    ("api", pa.string(), "API name"),
    ("direction", pa.string(), "forward / backward"),
    ("output", pa.string(), "index path of the output leaf ('0', '1', ...); null for a record not replayed"),
    ("name", pa.string(), "msprobe row name of the output: record.output.index"),
    ("dtype", pa.string(), "recorded dtype of the output"),
    ("shape", pa.list_(pa.int64()), "recorded shape of the output"),
    ("status", pa.string(), "pass / fail / skipped / error / no_standard"),
    ("reason", pa.string(), "why skipped, why an error, or what failed (metric, ratio, threshold)"),
    ("standard", pa.string(), "benchmark / binary: the precision standard applied (docs/replay.md)"),
    ("api_level", pa.string(), "msprobe's benchmark level of the API: L0 / L1 / L2"),
    ("metric", pa.string(), "the deciding metric: rel_l2 (float outputs), inf_nan, error_rate (binary)"),
    ("err", pa.float64(), "that metric of the run's output against float64"),
    ("cpu_err", pa.float64(), "that metric of the CPU same-dtype output against float64"),
    ("ratio", pa.float64(), "err / max(cpu_err, the dtype's floor)"),
    ("threshold", pa.float64(), "the ratio above which the output fails"),
    ("rel_l2", pa.float64(), "||run - fp64|| / ||fp64|| over finite positions"),
    ("cpu_rel_l2", pa.float64(), "||cpu - fp64|| / ||fp64||"),
    ("max_abs_err", pa.float64(), "max |run - fp64|"),
    ("cosine", pa.float64(), "cosine of run and fp64"),
    ("rmse", pa.float64(), "root mean square error of the run (msprobe, small values and inf/nan masked)"),
    ("cpu_rmse", pa.float64(), "the same of the CPU same-dtype output"),
    ("max_rel_err", pa.float64(), "largest relative error of the run (small values masked)"),
    ("cpu_max_rel_err", pa.float64(), "the same of the CPU same-dtype output"),
    ("mean_rel_err", pa.float64(), "mean relative error of the run"),
    ("cpu_mean_rel_err", pa.float64(), "the same of the CPU same-dtype output"),
    ("small_value_err", pa.float64(), "share of small values (|fp64| <= small_value) off by more than atol"),
    ("cpu_small_value_err", pa.float64(), "the same of the CPU same-dtype output"),
    ("eb", pa.float64(), "error balance of the run |#above - #below| / n (reported, not judged)"),
    ("cpu_eb", pa.float64(), "the same of the CPU same-dtype output"),
    ("error_rate", pa.float64(), "binary standard: share of elements unequal to the CPU same-dtype output"),
    (
        "autocast",
        pa.string(),
        "the run's autocast dtype where cpu_err is the larger of the CPU's error in the recorded dtype and at that "
        "dtype (an fp32 op a device's autocast policy may run in bf16)",
    ),
    (
        "msprobe_status",
        pa.string(),
        "msprobe's benchmark verdict (its ratio floors and L0/L1/L2 thresholds): pass / error",
    ),
    ("msprobe_reason", pa.string(), "the msprobe ratios over their thresholds"),
    ("same_as", pa.string(), "record whose identical call (same inputs and outputs) was replayed instead"),
]
REPLAY_SCHEMA = pa.schema([pa.field(n, t) for n, t, _ in REPLAY_FIELDS])


def replay_path(store: Store, run: str, ingest_id: str) -> Path:
    return store.root / REPLAY_DIR / f"run={run}" / f"part-{ingest_id}.parquet"


def replay_files(store: Store, runs: list[str] | None = None, catalog: pa.Table | None = None) -> list[str]:
    """The replay files of the live ingests (of `runs`, default all)."""
    out = []
    for row in (catalog if catalog is not None else store.runs()).to_pylist():
        if runs is None or row["run"] in runs:
            path = replay_path(store, row["run"], row["ingest_id"])
            if path.is_file():
                out.append(str(path))
    return out


def write_replay(store: Store, run: str, table: pa.Table) -> Path:
    """Replace the run's replay table (of its live ingest) in one rename; other ingests' files are removed."""
    from .parquetio import write_table

    ingest_id = store.run_info(run)["ingest_id"]
    path = replay_path(store, run, ingest_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_table(table.select(REPLAY_SCHEMA.names).cast(REPLAY_SCHEMA), tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    for old in path.parent.glob("part-*.parquet"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


def read_replay(store: Store, run: str) -> pa.Table | None:
    """The run's replay table of its live ingest, or None when it was not replayed (since its last ingest)."""
    from .parquetio import read_table

    path = replay_path(store, run, store.run_info(run)["ingest_id"])
    return read_table(path) if path.is_file() else None


def create_replay_view(con: duckdb.DuckDBPyConnection, store: Store, catalog: pa.Table) -> None:
    """The view `replay` (with a `run` column) over the live replay files; empty when there are none."""
    from .views import partitioned_view

    partitioned_view(con, "replay", replay_files(store, None, catalog), REPLAY_SCHEMA)

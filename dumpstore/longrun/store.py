"""Long runs in the store: their own catalog and Parquet tables, next to the dump runs.

  <store>/longruns.parquet                              the catalog: one row per long run
  <store>/longrun/scalars/run=<run>/part-<id>.parquet   rank, step, consumed_samples, tag, value
  <store>/longrun/monitor/run=<run>/part-<id>.parquet   the monitor statistics (see longrun.monitor)
  <store>/longrun/monitor_anomalies/run=<run>/part-<id>.parquet   msprobe monitor's own alarms (longrun.anomalies)

A long run is cataloged apart from the dump runs (runs.parquet): the commands that read dumps never meet a run
with no tensors, and a name may be both a dump run and a long run (a job's dump and its log). Re-ingesting a
run replaces it whole (the new files are written first, the catalog row is swapped under a lock, the old files
are then removed). DuckDB views `scalars`, `monitor`, `monitor_anomalies` and `longruns` are created in every
connection of the store (`dumpstore query`).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import StoreError
from ..store import Store, open_store
from .anomalies import SCHEMA as ANOMALY_SCHEMA
from .monitor import SCHEMA as MONITOR_PARTS_SCHEMA

CATALOG = "longruns.parquet"
BASE = "longrun"
KINDS = ("scalars", "monitor", "monitor_anomalies")

SCALAR_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int64()),
        pa.field("step", pa.int64()),
        pa.field("consumed_samples", pa.int64()),
        pa.field("tag", pa.string()),
        pa.field("value", pa.float64()),
    ]
)
# the monitor table with plain strings (monitor.SCHEMA, the parts' schema, has them dictionary-encoded)
MONITOR_SCHEMA = pa.schema(
    [pa.field(f.name, pa.string() if pa.types.is_dictionary(f.type) else f.type) for f in MONITOR_PARTS_SCHEMA]
)
SCHEMAS = {"scalars": SCALAR_SCHEMA, "monitor": MONITOR_SCHEMA, "monitor_anomalies": ANOMALY_SCHEMA}
CATALOG_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string()),
        pa.field("ingest_id", pa.string()),
        pa.field("kinds", pa.list_(pa.string())),
        pa.field("formats", pa.list_(pa.string())),
        pa.field("sources", pa.list_(pa.string())),
        pa.field("tags", pa.list_(pa.string())),
        pa.field("ranks", pa.list_(pa.int64())),
        pa.field("first_step", pa.int64()),
        pa.field("last_step", pa.int64()),
        pa.field("n_scalars", pa.int64()),
        pa.field("n_monitor", pa.int64()),
        pa.field("created_at", pa.string()),
    ]
)


@dataclass
class LongRun:
    """What one ingest of a long run read."""

    run: str
    scalars: pa.Table | None = None
    monitor: pa.Table | None = None
    monitor_roots: list[Path] = field(default_factory=list)  # monitor output folders, read while written
    monitor_listings: list[list] = field(default_factory=list)  # their monitor.monitor_csv (when listed)
    anomalies: pa.Table | None = None  # msprobe monitor's own alarms (anomaly_detected/rank<r>/anomaly.json)
    formats: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def catalog(store: Store) -> pa.Table:
    from ..parquetio import read_table

    path = store.root / CATALOG
    if not path.exists():
        return CATALOG_SCHEMA.empty_table()
    return read_table(path)


def run_row(store: Store, run: str) -> dict[str, Any]:
    rows = catalog(store).to_pylist()
    for row in rows:
        if row["run"] == run:
            return dict(row)
    known = ", ".join(r["run"] for r in rows) or "none"
    raise StoreError(
        f"long run {run!r} is not in store {store.root} (long runs: {known}); ingest its log, TensorBoard "
        f"events or monitor output first: dumpstore longrun-ingest PATH --run {run}"
    )


def _parts(store: Store, kind: str, run: str, ingest_id: str) -> list[Path]:
    d = store.root / BASE / kind / f"run={run}"
    return sorted(d.glob(f"part-{ingest_id}*.parquet")) if d.is_dir() else []


def files(store: Store, kind: str, runs: list[str] | None = None) -> list[str]:
    out = []
    for row in catalog(store).to_pylist():
        if (runs is None or row["run"] in runs) and kind in (row["kinds"] or []):
            out += [str(p) for p in _parts(store, kind, row["run"], row["ingest_id"])]
    return out


def read(
    store: Store, kind: str, run: str, *, dictionary: list[str] | None = None, columns: list[str] | None = None
) -> pa.Table:
    """The `kind` table of one long run (empty with the schema when the run has none); the `dictionary`
    columns dictionary-encoded, as Parquet stores them (no hashing of a tag per row, a name stored once per row
    group instead of once per row); only `columns` when given (a monitor run is tens of millions of rows)."""
    from ..parquetio import read_columns, read_table

    row = run_row(store, run)
    parts = _parts(store, kind, run, row["ingest_id"]) if kind in (row["kinds"] or []) else []
    if not parts:
        empty = SCHEMAS[kind].empty_table()
        return empty.select(columns) if columns is not None else empty
    if columns is not None:
        tables = [read_columns(p, columns, dictionary) for p in parts]
    else:
        tables = [read_table(p, read_dictionary=dictionary) for p in parts]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")


def monitor_chunks(store: Store, runs: list[str]) -> list[tuple[tuple, dict[str, list[Path]]]]:
    """The monitor part files of `runs` in chunks that no series crosses, to read a chunk at a time (a run is
    tens of millions of rows): a chunk per (rank, prefix) when every part holds one rank and one prefix (as the
    ingest writes a TrainerMon folder: a part per rank, prefix and header), else per rank when every part holds
    one rank, else one chunk: (key: (rank, prefix), (rank,) or (), {run: its files of the chunk, in part order}),
    chunks in order of first appearance. Which rank and prefix a part holds is read from its row groups'
    statistics."""
    from ..parquetio import ParquetReader

    parts: dict[str, list[tuple[Path, tuple | None, tuple | None]]] = {}
    for run in runs:
        row = run_row(store, run)
        parts[run] = []
        for path in _parts(store, "monitor", run, row["ingest_id"]) if "monitor" in (row["kinds"] or []) else []:
            reader = ParquetReader()
            reader.open(os.fspath(path))
            md = reader.metadata
            names = [md.schema.column(i).name for i in range(len(md.schema))]
            one: dict[str, Any] = {}
            for col in ("rank", "prefix"):
                seen = set()
                j = names.index(col) if col in names else -1
                for g in range(md.num_row_groups):
                    st = md.row_group(g).column(j).statistics if j >= 0 else None
                    if st is None or not st.has_min_max or st.null_count or st.min != st.max:
                        seen = {None, "mixed"}
                        break
                    seen.add(st.min)
                one[col] = next(iter(seen)) if len(seen) == 1 else None
            rank = (one["rank"],) if one["rank"] is not None else None
            pair = (one["rank"], one["prefix"]) if rank is not None and one["prefix"] is not None else None
            parts[run].append((path, pair, rank))
    every = [item for items in parts.values() for item in items]
    level = 1 if all(i[1] is not None for i in every) else 2 if all(i[2] is not None for i in every) else 0
    chunks: dict[Any, dict[str, list[Path]]] = {}
    for run, items in parts.items():
        for path, pair, rank in items:
            key = pair if level == 1 else rank if level == 2 else ()
            chunks.setdefault(key, {r: [] for r in runs})[run].append(path)
    return list(chunks.items())


def read_parts(paths: list[Path], kind: str, *, columns: list[str], dictionary: list[str] | None = None) -> pa.Table:
    """`columns` of the given part files of `kind` as one table (empty with the schema when none). The reader's
    scratch memory (decompressed pages: about as much again as the table for a chunk of monitor rows) is handed
    back to the system after the read: Arrow's allocator keeps it otherwise, beside what Polars then allocates for
    the work on the table."""
    from ..parquetio import read_columns

    if not paths:
        return SCHEMAS[kind].empty_table().select(columns)
    tables = [read_columns(p, columns, dictionary) for p in paths]
    out = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")
    pa.default_memory_pool().release_unused()
    return out


def write(path: str | os.PathLike | None, lr: LongRun) -> dict[str, Any]:
    """Publish a long run (replacing one of the same name); returns its catalog row."""
    from ..lock import hold
    from ..parquetio import write_table
    from ..store import store_errors

    with store_errors(path):
        store = open_store(path, create=True)
        ingest_id = uuid.uuid4().hex[:12]
        kinds, written = [], []
        try:
            stats: dict[str, Any] = {}
            for kind, table in (("scalars", lr.scalars), ("monitor", lr.monitor), ("monitor_anomalies", lr.anomalies)):
                if table is None or table.num_rows == 0:
                    continue
                dest = store.root / BASE / kind / f"run={lr.run}" / f"part-{ingest_id}.parquet"
                dest.parent.mkdir(parents=True, exist_ok=True)
                written.append(dest)
                write_table(table.select(SCHEMAS[kind].names).cast(SCHEMAS[kind]), dest)
                kinds.append(kind)
            if lr.monitor_roots and lr.monitor is None:
                folder = store.root / BASE / "monitor" / f"run={lr.run}"
                folder.mkdir(parents=True, exist_ok=True)
                stats = _write_monitor(lr.monitor_roots, folder, ingest_id, written, listings=lr.monitor_listings)
                kinds.append("monitor")
            row = _row(lr, ingest_id, kinds, stats)
            locks = store.root / ".locks"
            locks.mkdir(parents=True, exist_ok=True)
            with hold(locks / "longruns.lock", f"long-run catalog of store {store.root}"):
                rows = [r for r in catalog(store).to_pylist() if r["run"] != lr.run]
                rows.append(row)
                rows.sort(key=lambda r: r["run"])
                tmp = store.root / f".{CATALOG}.{os.getpid()}.tmp"
                write_table(pa.Table.from_pylist(rows, CATALOG_SCHEMA), tmp)
                os.replace(tmp, store.root / CATALOG)
        except BaseException:
            for p in written:
                p.unlink(missing_ok=True)
            raise
        for kind in KINDS:  # the replaced ingest's files (readers hold open files: unlinking is safe)
            d = store.root / BASE / kind / f"run={lr.run}"
            for p in d.glob("part-*.parquet") if d.is_dir() else []:
                if not p.name.startswith(f"part-{ingest_id}"):
                    p.unlink(missing_ok=True)
    return row


def _write_monitor(
    roots: list[Path],
    folder: Path,
    ingest_id: str,
    written: list[Path],
    *,
    max_rows: int = 4_000_000,
    listings: list[list] | None = None,
) -> dict[str, Any]:
    """Stream the monitor output under `roots` into Parquet part files (`part-<id>-<k>.parquet`: one per (rank,
    prefix, header) group of files, a new one after `max_rows` rows), row groups of ~256k rows, written while the
    next files are parsed; returns rows, steps, ranks. The text columns are dictionary-encoded, the statistics
    plain (a float column's dictionary never pays: the writer would build it and drop it)."""
    import numpy as np

    from ..parquetio import Writer
    from .arrow import to_numpy
    from .monitor import SCHEMA, TEXT_COLUMNS, iter_monitor_tables

    rows, lo, hi, ranks = 0, None, None, set()
    state: dict[str, Any] = {"writer": None, "key": None, "rows": 0, "k": 0}
    # min/max of every column but the names (a row group holds all names: their range prunes nothing, and it
    # costs a quarter of the write)
    stats = [c for c in SCHEMA.names if c not in TEXT_COLUMNS or c == "prefix"]
    buf: list[pa.Table] = []

    def flush() -> None:
        if buf:
            table = pa.concat_tables(buf).unify_dictionaries()
            state["writer"].write_table(table, row_group_size=table.num_rows)
            buf.clear()

    def close(ok: bool = True) -> None:
        if ok:
            flush()
        buf.clear()
        if state["writer"] is not None:
            state["writer"].close()
            state["writer"] = None

    try:
        for k, root in enumerate(roots):
            listing = listings[k] if listings and k < len(listings) else None
            for key, table in iter_monitor_tables(root, files=listing):
                if state["writer"] is None or key != state["key"] or state["rows"] >= max_rows:
                    close()
                    dest = folder / f"part-{ingest_id}-{state['k']:05d}.parquet"
                    written.append(dest)
                    state.update(
                        writer=Writer(
                            dest, SCHEMA, compression="snappy", use_dictionary=TEXT_COLUMNS, write_statistics=stats
                        ),
                        key=key,
                        rows=0,
                        k=state["k"] + 1,
                    )
                buf.append(table)
                state["rows"] += table.num_rows
                if sum(t.num_rows for t in buf) >= _ROW_GROUP:
                    flush()
                steps = to_numpy(table.column("step"), np.float64, np.nan)
                a, b = (int(np.nanmin(steps)), int(np.nanmax(steps))) if (steps == steps).any() else (None, None)
                lo = a if lo is None or (a is not None and a < lo) else lo
                hi = b if hi is None or (b is not None and b > hi) else hi
                ranks.add(key[0])
                rows += table.num_rows
    except BaseException:
        close(ok=False)  # the caller removes the parts written
        raise
    close()
    return {"rows": rows, "lo": lo, "hi": hi, "ranks": ranks}


_ROW_GROUP = 1 << 18


def _row(lr: LongRun, ingest_id: str, kinds: list[str], stats: dict[str, Any]) -> dict[str, Any]:
    steps: list[int] = []
    ranks: set[int] = set(stats.get("ranks", ()))
    tags: list[str] = []
    for table in (lr.scalars, lr.monitor):
        if table is not None and table.num_rows:
            import pyarrow.compute as pc  # (not for a monitor folder: streamed, counted by _write_monitor)

            mm = pc.min_max(table.column("step"))
            steps += [mm["min"].as_py(), mm["max"].as_py()]
            ranks |= set(pc.unique(table.column("rank")).to_pylist())
    steps += [v for v in (stats.get("lo"), stats.get("hi")) if v is not None]
    if lr.scalars is not None and lr.scalars.num_rows:
        import pyarrow.compute as pc

        tags = sorted(pc.unique(lr.scalars.column("tag")).to_pylist())
    n_monitor = lr.monitor.num_rows if lr.monitor is not None else stats.get("rows", 0)
    return {
        "run": lr.run,
        "ingest_id": ingest_id,
        "kinds": kinds,
        "formats": sorted(set(lr.formats)),
        "sources": lr.sources,
        "tags": tags,
        "ranks": sorted(ranks),
        "first_step": min(steps) if steps else None,
        "last_step": max(steps) if steps else None,
        "n_scalars": lr.scalars.num_rows if lr.scalars is not None else 0,
        "n_monitor": n_monitor,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def create_views(con, store: Store) -> None:
    """Views `scalars`, `monitor` (with a `run` column) and `longruns` in a DuckDB connection of the store."""
    cat = catalog(store)
    con.register("__longruns", cat)
    con.execute("CREATE OR REPLACE VIEW longruns AS SELECT * FROM __longruns")
    from ..views import partitioned_view

    for kind in KINDS:
        partitioned_view(con, kind, files(store, kind), SCHEMAS[kind])


def source_path(p: Path) -> str:
    return str(p.resolve())

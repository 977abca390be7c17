"""The catalog can be rebuilt from the data: each ingest's record beside its Parquet files, and `dumpstore repair`.

Every published ingest keeps, in its own folder `.ingests/run=<run>/<ingest>/`, a `run.json`: its catalog row and
the identity of the dump folder it read (`source_identity`: the files' names, sizes and mtimes and a content hash
of the JSON files), written before the catalog names it, and a `.published` marker, touched just before the catalog
is replaced (a replaced ingest also gets `.replaced`). `repair` rebuilds `runs.parquet` from those records: for
each run, the newest published ingest not replaced since. It also reads every live Parquet file's footer and names
the runs whose files are damaged (they must be ingested again).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .errors import StoreError
from .runrecord import (  # noqa: F401  (the record's names, as they were imported from here)
    _JSON_NAMES,
    _REPLACED,
    _STAGING,
    PUBLISHED,
    RUN_RECORD,
    _subdirs,
    identity_change,
    live_records,
    mark_published,
    read_run_record,
    recorded_identity,
    runs_with_data,
    source_identity,
    write_run_record,
)


# ------------------------------------------------------------------------------------------------ repair
@dataclass
class RepairResult:
    runs: list[str] = field(default_factory=list)  # runs in the rebuilt catalog
    unrecorded: list[str] = field(default_factory=list)  # runs with data but no record (ingest them again)
    damaged: dict[str, str] = field(default_factory=dict)  # run -> first damaged file and why
    rewritten: bool = False


def repair(store: str | os.PathLike | None = None) -> RepairResult:
    """Rebuild the catalog from the ingests' records (runs.parquet missing, unreadable, or not naming them), then
    check the live Parquet files' footers. Runs of the old catalog without records are kept when it was readable."""
    from .store import CATALOG, open_store

    st = open_store(store)
    res = RepairResult()
    records = live_records(st.root)
    with st._lock("catalog", f"catalog of store {st.root}"):
        try:
            current = {r["run"]: r for r in st.raw_runs()}
        except StoreError:
            current = {}
        rows = dict(records)
        for run, row in current.items():
            if run not in rows:
                rows[run] = row  # an old store's run: kept as the catalog had it
        res.unrecorded = [r for r in runs_with_data(st.root) if r not in rows]
        ordered = [_as_current(rows[r]) for r in sorted(rows)]
        same = [current.get(r["run"], {}).get("ingest_id") for r in ordered] == [r["ingest_id"] for r in ordered]
        if not (same and len(current) == len(ordered) and (st.root / CATALOG).exists()):
            st._write_catalog(ordered)
            res.rewritten = True
        res.runs = [r["run"] for r in ordered]
    res.damaged = damaged_files(st)
    return res


def _as_current(row: dict[str, Any]) -> dict[str, Any]:
    from .schema import RUN_SCHEMA

    return {name: row.get(name) for name in RUN_SCHEMA.names}


def damaged_files(st: Any) -> dict[str, str]:
    """run -> 'FILE: why' for the first live Parquet file of each run whose footer cannot be read."""
    import glob

    from pyarrow._parquet import ParquetReader

    out: dict[str, str] = {}
    try:
        catalog = st.runs()
    except StoreError:
        return out
    for row in catalog.to_pylist():
        for pattern in st.tensor_files([row["run"]], catalog):
            for path in sorted(glob.glob(pattern)):
                try:
                    reader = ParquetReader()
                    reader.open(path)
                    reader.metadata  # noqa: B018  (the footer is read on open; touch it anyway)
                except (OSError, ValueError) as exc:
                    out[row["run"]] = f"{path}: {' '.join(str(exc).split())[:160]}"
                    break
            if row["run"] in out:
                break
    return out

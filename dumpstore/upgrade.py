"""`dumpstore upgrade` as one transaction: every old run re-ingested into its own staging folder, checked, then
published together with the catalog in one atomic rename.

Until that rename the catalog and every file it names are untouched, so a failure (a dump folder that became
unreadable, a full disk) or a signal (SIGINT, SIGTERM, SIGKILL) at any moment leaves the store as it was: what the
staged ingests wrote is removed on the way out, or, after a SIGKILL, by the next command that takes the runs' locks.
Each run's dump folder is checked against the identity recorded when it was ingested (`repair.source_identity`,
or for stores older than that record, the files' mtimes against the ingest time): a folder that changed is refused
with one line unless `from_source` says to re-ingest what is there now. A store written by a newer dumpstore is
refused, never downgraded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import StoreError
from .repair import (
    _REPLACED,
    identity_change,
    mark_published,
    recorded_identity,
    source_identity,
    write_run_record,
)
from .store import Store, _touch, newer_schema_message, open_store, store_errors


def upgrade(
    store: str | os.PathLike | None = None,
    *,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    from_source: bool = False,
) -> list[Any]:
    """Re-ingest every run written by an older schema from its dump folder, all published at once (module doc).
    Returns the runs' IngestResults (none when every run is current)."""
    from ._ingest import IngestOptions, ingest
    from .schema import SCHEMA_VERSION
    from .summary import DEFAULT_SAMPLE_K, DEFAULT_SKETCH_M

    st = open_store(store)
    rows = st.raw_runs()
    if any(isinstance(r.get("schema_version"), int) and r["schema_version"] > SCHEMA_VERSION for r in rows):
        raise StoreError(newer_schema_message(st.root, rows))
    old = [r for r in rows if r.get("schema_version") != SCHEMA_VERSION]
    if not old:
        return []
    _check_sources(st, old, from_source)
    results: list[Any] = []
    staged: list[dict[str, Any]] = []
    with store_errors(st.root), ExitStack() as locks:
        for r in old:  # held until the catalog names the new ingests: nothing else touches these runs meanwhile
            locks.enter_context(st.run_lock(r["run"]))
        try:
            for r in old:
                opts = IngestOptions(
                    sample_k=r.get("sample_k") or DEFAULT_SAMPLE_K, sketch_m=r.get("sketch_m") or DEFAULT_SKETCH_M
                )
                results.append(
                    ingest(
                        r["source_path"],
                        r["run"],
                        store=st.root,
                        jobs=jobs,
                        progress=progress,
                        options=opts,
                        staged=staged.append,
                    )
                )
            _check_staged(st, staged)
            publish_all(st, staged)
        except BaseException:
            for row in staged:
                st.discard(row["run"], row["ingest_id"])
            raise
    return results


def _check_sources(st: Store, old: list[dict[str, Any]], from_source: bool) -> None:
    """Every old run's dump folder exists and (unless `from_source`) is the one that was ingested."""
    missing = [r["run"] for r in old if not r.get("source_path") or not Path(str(r["source_path"])).exists()]
    if missing:
        raise StoreError(
            f"{st.root}: cannot upgrade runs {', '.join(missing)}: their dump folders are gone; nothing was changed; "
            "ingest them again from a copy into a new store"
        )
    if from_source:
        return
    for r in old:
        src = str(r["source_path"])
        recorded = recorded_identity(st.root, r["run"], r["ingest_id"])
        if recorded is not None:
            change = identity_change(recorded, source_identity(src))
        else:
            change = _modified_since(src, r.get("created_at"))
        if change:
            raise StoreError(
                f"run {r['run']!r}: its dump folder {src} changed since it was ingested ({change}); nothing was "
                "changed; `dumpstore upgrade --from-source` re-ingests what is there now, or ingest it into a new store"
            )


def _modified_since(src: str, created_at: Any) -> str | None:
    """For runs ingested before their source's identity was recorded: a file of the folder modified after the
    ingest (its catalog row's created_at, UTC seconds)."""
    try:
        when = datetime.fromisoformat(str(created_at)).timestamp()
    except ValueError:
        return None
    root = Path(src)
    paths = [root] if root.is_file() else (Path(d) / f for d, _, files in os.walk(root) for f in files)
    for path in paths:
        try:
            if path.lstat().st_mtime > when + 1:
                return f"{path} was modified after the ingest"
        except OSError:
            continue
    return None


def _check_staged(st: Store, staged: list[dict[str, Any]]) -> None:
    """Every staged ingest's folder holds Parquet files for its rows before anything is published."""
    for row in staged:
        d = st.staging_dir(row["run"], row["ingest_id"]) / "tensors"
        if row.get("n_rows") and not next(d.rglob("part-*.parquet"), None):
            raise StoreError(f"upgrade of run {row['run']!r}: its staged files are missing ({d}); nothing was changed")


def publish_all(st: Store, staged: list[dict[str, Any]]) -> None:
    """Make the staged ingests live together: their files linked into the tree, then ONE atomic catalog rename
    naming all of them (the old catalog rows replaced); the replaced ingests' files go afterwards."""
    if not staged:
        return
    for row in staged:
        folder = st.staging_dir(row["run"], row["ingest_id"])
        write_run_record(folder, row)
        st._link_into_tree(folder, row["run"])
    new = {row["run"]: row for row in staged}
    with st._lock("catalog", f"catalog of store {st.root}"):
        before = st.raw_runs()
        replaced = {r["run"]: r["ingest_id"] for r in before if r["run"] in new}
        rows = [new.get(r["run"], r) for r in before] + [row for run, row in new.items() if run not in replaced]
        rows.sort(key=lambda r: r["run"])
        for row in staged:
            mark_published(st.staging_dir(row["run"], row["ingest_id"]))
        st._write_catalog([_current(r) for r in rows])
    for run, old_id in replaced.items():
        if old_id != new[run]["ingest_id"]:
            _touch(st.staging_dir(run, old_id) / _REPLACED)
        st.collect_garbage(run, keep=new[run]["ingest_id"])


def _current(row: dict[str, Any]) -> dict[str, Any]:
    from .schema import RUN_SCHEMA

    return {name: row.get(name) for name in RUN_SCHEMA.names}

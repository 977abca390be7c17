"""The catalog can be rebuilt from the data: each ingest's record beside its Parquet files, and `dumpstore repair`.

Every published ingest keeps, in its own folder `.ingests/run=<run>/<ingest>/`, a `run.json`: its catalog row and
the identity of the dump folder it read (`source_identity`: the files' names, sizes and mtimes and a content hash
of the JSON files), written before the catalog names it, and a `.published` marker, touched just before the catalog
is replaced (a replaced ingest also gets `.replaced`). `repair` rebuilds `runs.parquet` from those records: for
each run, the newest published ingest not replaced since. It also reads every live Parquet file's footer and names
the runs whose files are damaged (they must be ingested again).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import StoreError

RUN_RECORD = "run.json"
PUBLISHED = ".published"
_STAGING = ".ingests"
_REPLACED = ".replaced"
_JSON_NAMES = ("dump.json", "debug.json", "construct.json", "stack.json")


# ------------------------------------------------------------------------------------------------ source identity
def source_identity(path: str | os.PathLike) -> dict[str, Any]:
    """What a dump folder holds, cheaply: the number and total size of its files, a digest of their relative paths,
    sizes and mtimes, and an XXH3-128 of the bytes of its JSON files (dump.json, ...). Links are not followed.

    `upgrade` compares it with the one recorded at ingest: a re-dump into the same folder is another run."""
    import xxhash

    root = Path(path)
    names = xxhash.xxh3_128()
    content = xxhash.xxh3_128()
    files = size = 0
    entries: list[tuple[str, int, int, bool]] = []
    if root.is_file():  # (is_file: a regular file)
        st = root.stat()
        entries.append((root.name, st.st_size, st.st_mtime_ns, root.name in _JSON_NAMES))
        base = root.parent
    else:
        base = root
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                regular = stat.S_ISREG(st.st_mode)  # a FIFO or device is never opened (it could block)
                entries.append(
                    (os.path.relpath(full, root), st.st_size, st.st_mtime_ns, regular and name in _JSON_NAMES)
                )
    for rel, nbytes, mtime, is_json in entries:
        files += 1
        size += nbytes
        # a JSON file's contents are hashed (below): its mtime alone (a touch, a copy) is no change
        names.update(os.fsencode(rel) + f"\0{nbytes}\0{0 if is_json else mtime}\0".encode())
        if is_json:
            try:
                with open(base / rel, "rb") as fh:
                    while chunk := fh.read(1 << 24):
                        content.update(chunk)
            except OSError:
                content.update(b"unreadable")
    return {"files": files, "bytes": size, "stamps": names.hexdigest(), "json_content": content.hexdigest()}


def identity_change(recorded: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How a dump folder changed since `recorded` (None when it did not): the words of an upgrade's refusal."""
    if recorded.get("json_content") != now.get("json_content"):
        return "its JSON files (dump.json ...) have other contents"
    if (recorded.get("files"), recorded.get("bytes")) != (now.get("files"), now.get("bytes")):
        return (
            f"it held {recorded.get('files')} files of {recorded.get('bytes')} bytes, now "
            f"{now.get('files')} of {now.get('bytes')}"
        )
    if recorded.get("stamps") != now.get("stamps"):
        return "its files were rewritten (names, sizes or modification times differ)"
    return None


# ------------------------------------------------------------------------------------------------ records
def write_run_record(staged: Path, row: dict[str, Any]) -> None:
    """Write `run.json` (the catalog row and the source's identity) into an ingest's folder, atomically."""
    source = row.get("source_path")
    identity = None
    if source:
        try:
            identity = source_identity(source)
        except OSError:
            identity = None
    staged.mkdir(parents=True, exist_ok=True)
    tmp = staged / f".{RUN_RECORD}.tmp"
    tmp.write_text(json.dumps({"row": row, "source_identity": identity}, default=str))
    os.replace(tmp, staged / RUN_RECORD)


def mark_published(staged: Path) -> None:
    try:
        (staged / PUBLISHED).touch()
    except FileNotFoundError:  # a store written before staging existed
        pass


def read_run_record(staged: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((staged / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("row"), dict) else None


def recorded_identity(root: Path, run: str, ingest_id: str) -> dict[str, Any] | None:
    """The source identity recorded by ingest `ingest_id` of `run`, or None (ingested before it was recorded)."""
    doc = read_run_record(root / _STAGING / f"run={run}" / ingest_id)
    return doc.get("source_identity") if doc else None


def runs_with_data(root: Path) -> list[str]:
    """Runs the store holds data of: published ingest folders, and runs of stores older than those folders (files in
    tensors/ without any ingest folder of the run). Unpublished leftovers of killed ingests do not count."""
    out = set()
    staging = root / _STAGING
    for d in _subdirs(staging):
        if d.name.startswith("run=") and any((i / PUBLISHED).exists() for i in _subdirs(d)):
            out.add(d.name[4:])
    for d in _subdirs(root / "tensors"):
        if d.name.startswith("run=") and not (staging / d.name).exists() and next(d.rglob("part-*.parquet"), None):
            out.add(d.name[4:])
    return sorted(out)


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


# ------------------------------------------------------------------------------------------------ repair
@dataclass
class RepairResult:
    runs: list[str] = field(default_factory=list)  # runs in the rebuilt catalog
    unrecorded: list[str] = field(default_factory=list)  # runs with data but no record (ingest them again)
    damaged: dict[str, str] = field(default_factory=dict)  # run -> first damaged file and why
    rewritten: bool = False


def live_records(root: Path) -> dict[str, dict[str, Any]]:
    """For each run, the catalog row of its newest published, not replaced ingest (from the ingests' run.json)."""
    best: dict[str, dict[str, Any]] = {}
    for d in _subdirs(root / _STAGING):
        if not d.name.startswith("run="):
            continue
        for ing in _subdirs(d):
            if not (ing / PUBLISHED).exists() or (ing / _REPLACED).exists():
                continue
            doc = read_run_record(ing)
            if doc is None or doc["row"].get("ingest_id") != ing.name or doc["row"].get("run") != d.name[4:]:
                continue
            row = doc["row"]
            if row["run"] not in best or str(row.get("created_at")) > str(best[row["run"]].get("created_at")):
                best[row["run"]] = row
    return best


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

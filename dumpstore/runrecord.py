"""Each ingest's record beside its Parquet files (run.json, `.published`, `.replaced`): written by the store as it
publishes, read by `dumpstore repair` and `dumpstore upgrade` (see dumpstore/repair.py).  Below the store: it
imports nothing of it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

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

"""Memoized answers: a verdict is kept in the store, keyed by the question, and valid while both runs are.

Asking the same question of an unchanged store again (the common loop: `divergence`, read, `divergence
--json | jq`, `report`) should not redo the work.  An answer is saved under `<store>/memo/<key>.json`, where
the key hashes the question (command, runs, steps, ranks, tolerances, mapping file contents, exact) and
the dumpstore code that answered it.  It is used again only while the live ingests of its runs are the ones
it was computed from: the memo records the catalog file's identity (inode, size, mtime, ctime; the catalog is
only ever replaced by an atomic rename) and the runs' ingest ids.  Checking the identity is one stat, so a
repeated question costs no pyarrow, DuckDB or Polars import; when the catalog changed, the ingest ids decide.

This module stays light (standard library and dumpstore.store, which loads pyarrow only when used).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dumpstore.store import CATALOG

FORMAT = 1
DIR = "memo"


def key(question: dict[str, Any]) -> str:
    """A stable hex key for a question (JSON-able dict) and the code answering it."""
    blob = json.dumps({"q": question, "code": _code_signature(), "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def file_digest(path: str | os.PathLike) -> str:
    """Content hash of an input file named in a question (e.g. a mapping YAML)."""
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def lookup(root: Path, k: str, live_ids: Callable[[], dict[str, Any]], *, folder: str = DIR) -> Any | None:
    """The saved answer for key `k`, or None when missing or computed from other ingests than the live ones.

    `live_ids()` reads the runs' live ingest ids; it is called only when the catalog file changed.  `folder`:
    where under the store the answers of this kind are kept (verdicts in `memo`)."""
    path = root / folder / f"{k}.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        return None
    sig = catalog_signature(root)
    if sig is None:
        return None
    files = saved.get("files")
    if files is not None and folders_digest(files.get("dirs", [])) != files.get("digest"):
        return None  # a tensor file an --exact answer read was added, removed, replaced or edited since
    if saved.get("catalog") != sig:
        if saved.get("ingest_ids") != live_ids():
            return None
        saved["catalog"] = sig
        _write(path, saved)  # the catalog changed for other runs: remember that this answer still holds
    return saved.get("value")


def save(
    root: Path,
    k: str,
    ingest_ids: dict[str, Any],
    catalog: list | None,
    value: Any,
    files: dict | None = None,
    *,
    folder: str = DIR,
) -> None:
    """Keep `value` for key `k`; `catalog` is catalog_signature() taken before the answer was computed (the
    answer is not kept when an ingest published in the meantime).  Best effort: a read-only store keeps
    nothing."""
    if catalog is None or catalog != catalog_signature(root):
        return
    payload = {"format": FORMAT, "catalog": catalog, "ingest_ids": ingest_ids, "value": value}
    if files is not None:
        payload["files"] = files
    _write(root / folder / f"{k}.json", payload)


def folders_digest(dirs: list[str]) -> str:
    """A digest of what the folders `dirs` hold: each entry's name, inode, size, mtime and ctime (an in-place edit
    that puts size and mtime back still moves ctime). One scandir and one stat per entry; no file is opened."""
    h = hashlib.sha256()
    for d in dirs:
        h.update(f"{d}\0".encode())
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            h.update(f"unreadable {exc.errno}\0".encode())
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                h.update(f"{e.name}\0gone\0".encode())
                continue
            h.update(f"{e.name}\0{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}\0".encode())
    return h.hexdigest()


def catalog_signature(root: Path) -> list | None:
    try:
        st = os.stat(root / CATALOG)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(payload, default=str))
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def _code_signature() -> list:
    """Names, sizes and mtimes of the dumpstore modules: a changed analysis never reuses an old answer."""
    import dumpstore

    out: list = [dumpstore.__version__]
    for dirs in (list(dumpstore.__path__), [os.path.dirname(os.path.abspath(__file__))]):  # dumpstore, analysis
        for d in dirs:
            for entry in sorted(os.scandir(d), key=lambda e: e.name):
                if entry.name.endswith(".py"):
                    st = entry.stat()
                    out.append([entry.name, st.st_size, st.st_mtime_ns])
    return out

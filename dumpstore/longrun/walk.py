"""One listing of a folder's files for the long-run readers (a monitor run is tens of thousands of files: one
os.scandir walk, strings not Path objects, shared by the log, event-file, anomaly and monitor readers)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DumpstoreError

Listing = list[tuple[str, str]]  # (folder, file name)


def walk(root: Path | str) -> Listing:
    """(folder, name) of every file under `root` (links to files included, links to folders not entered: as
    Path.rglob)."""
    out: Listing = []
    _walk(str(root), out)
    return out


def _walk(folder: str, out: Listing) -> None:
    try:
        with os.scandir(folder) as it:
            entries = list(it)
    except OSError as exc:
        raise DumpstoreError(f"{folder}: cannot list ({exc.strerror})") from None
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            _walk(e.path, out)
        elif e.is_file():
            out.append((folder, e.name))


def sorted_paths(found: Listing) -> list[Path]:
    """The files as Paths in Path order (by their parts)."""
    return [Path(d, n) for d, n in sorted(found, key=lambda f: (*f[0].split(os.sep), f[1]))]

"""msprobe's dump.json (or debug.json): one file of records per step and rank, its tensors in dump_tensor_data/
beside it (rows: dumpstore._ingest's record pipeline)."""

from __future__ import annotations

from pathlib import Path

from ..errors import DumpFormatError
from . import Claim

NAME = "msprobe"
ORDER = 0
FILES = ("dump.json", "debug.json")  # the first present in a folder is its unit


def claim(folder: Path, filenames: list[str]) -> Claim | None:
    """The folder's dump.json (else debug.json), which takes the folder below it (dump_tensor_data belongs to it)."""
    dump = next((f for f in FILES if f in filenames), None)
    if dump is None:
        return None
    if (folder / dump).is_symlink():  # it could lead anywhere; tensor files that are links are refused too
        raise DumpFormatError(f"{folder / dump}: is a link; refusing to read it (copy the file instead)")
    return Claim(folder / dump, "dump", whole=True)

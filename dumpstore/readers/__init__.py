"""Input formats: one module per format in this package, found here by name, and detection in one place.

A reader module defines:

    NAME      the format's name ("msprobe", "pt", "npy", ...): a Unit's `reader`
    ORDER     its rank when several formats could claim one folder (lower claims first)
    claim(folder, filenames) -> Claim | None
              whether `folder` (its file names given) holds this format's input, and the unit it makes

and then, by the kind of unit it claims:

    "dump"    one file of records whose tensors lie in its dump_tensor_data/ folder (msprobe's dump.json): the
              ingest's record pipeline (dumpstore._ingest) turns it into rows;
    "files"   a folder of tensor files, one row each: the module also defines SUFFIX (".pt") and
              load(path, *, max_bytes=None) -> (array, stored dtype), which reads one file without running code;
    its NAME  a format with rows of its own: the module defines rows(unit, res) -> Iterator[dict], one dict of
              row columns (dumpstore._ingest.model.ROW_COLUMNS; a missing key is null) per row, counting the files
              and records it reads into `res` (a UnitResult); with ROWS_OPTIONS = True it is called as
              rows(unit, res, opts, stacks): it reads tensor files as `opts` (IngestOptions) asks and appends the
              call stacks its rows' stack_id index to `stacks`.  It may define place(path) -> (step, rank, rank
              folder, source) where its folders are not stepN/rankN (MindSpore graph dumps).

Adding a format is adding a module here (and its test): `READERS` imports every module of this package.  Formats
with tables of their own (logs, monitor CSVs) keep their own modules and are not readers of dump units.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..errors import DumpFormatError

TENSOR_DIR = "dump_tensor_data"  # a record file's tensor files (msprobe); never a folder of its own

__all__ = [
    "READERS",
    "TENSOR_DIR",
    "Claim",
    "claim",
    "detect",
    "load_tensor",
    "reader",
    "tensor_reader",
    "tensor_suffixes",
]


@dataclass(frozen=True)
class Claim:
    """A unit found by a reader: its path (the record file, or the folder of tensor files), its kind ("dump",
    "files" or the reader's NAME) and whether the folder's subfolders belong to it (not searched further)."""

    path: Path
    kind: str
    whole: bool = False


@functools.cache
def _modules() -> tuple[ModuleType, ...]:
    found = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)]
    return tuple(sorted(found, key=lambda m: (m.ORDER, m.NAME)))


def __getattr__(name: str):
    if name == "READERS":  # every reader module, in claiming order (imported on first use)
        return _modules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reader(name: str) -> ModuleType:
    """The reader module whose NAME is `name`."""
    found = next((r for r in _modules() if r.NAME == name), None)
    if found is None:
        raise DumpFormatError(f"no reader of format {name!r}; known: {', '.join(r.NAME for r in _modules())}")
    return found


def claim(folder: Path, filenames: list[str]) -> tuple[ModuleType, Claim] | None:
    """The first reader (by ORDER) that claims `folder`, and its claim; None when none does."""
    for reader in _modules():
        got = reader.claim(folder, filenames)
        if got is not None:
            return reader, got
    return None


def tensor_folder(folder: Path, filenames: list[str], suffix: str) -> Claim | None:
    """The claim of a tensor-file format: `folder` is one unit when it holds a file of `suffix` (any case) and is not
    a record file's tensor folder (TENSOR_DIR)."""
    if folder.name == TENSOR_DIR or not any(f.lower().endswith(suffix) for f in filenames):
        return None
    return Claim(folder, "files")


def detect(path: str | os.PathLike) -> str | None:
    """The NAME of the format of the input at `path` (a record file, or the first folder under `path` that a
    reader claims); None when no reader claims anything there."""
    path = Path(path)
    if path.is_file():
        got = claim(path.parent, [path.name])
        return got[0].NAME if got and got[1].path == path else None
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        dirnames.sort()
        got = claim(Path(dirpath), sorted(filenames))
        if got is not None:
            return got[0].NAME
    return None


@functools.cache
def tensor_suffixes() -> tuple[str, ...]:
    """The suffixes of the tensor-file formats (".pt", ".npy"), lower case, in claiming order."""
    return tuple(r.SUFFIX for r in _modules() if hasattr(r, "SUFFIX"))


def tensor_reader(path: str | os.PathLike) -> ModuleType | None:
    """The reader of a tensor file, by its suffix (any case); None for another file."""
    suffix = os.path.splitext(path)[1].lower()
    return next((r for r in _modules() if getattr(r, "SUFFIX", None) == suffix), None)


def load_tensor(path: Path, *, max_bytes: int | None = None):
    """(values, stored dtype) of a tensor file, read by the reader of its suffix."""
    reader = tensor_reader(path)
    if reader is None:
        raise DumpFormatError(f"{path}: unknown tensor file type; expected {' or '.join(tensor_suffixes())}")
    return reader.load(path, max_bytes=max_bytes)

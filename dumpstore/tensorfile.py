"""Resolve a leaf's tensor file inside its dump folder (never outside) and load it without running code."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import numpy as np

from .errors import DumpFormatError
from .readers import TENSOR_DIR, load_tensor

T = TypeVar("T")
L = TypeVar("L")


def forget_folders() -> None:
    """Drop the cached folder checks of `resolve` (call when starting on a dump that may have changed)."""
    _tensor_dir.cache_clear()


def resolve(dump_dir: Path, data_name: str) -> Path:
    """`<dump_dir>/dump_tensor_data/<data_name>`, refusing names that leave that folder.

    Whether dump_tensor_data/ stays inside the dump folder is checked once per folder (cached until
    `forget_folders()`); each file costs one lstat.
    """
    _check_name(data_name)
    base, inside = _tensor_dir(str(dump_dir))
    path = base / data_name
    try:
        # a plain name inside a folder that is itself inside the dump: only a link can lead elsewhere
        outside = not inside or path.is_symlink()
    except OSError as exc:  # e.g. a data_name longer than the file system allows
        raise DumpFormatError(f"{path}: cannot look up the tensor file ({exc.strerror})") from None
    if outside:
        raise _refused(path, base)
    return path


def _refused(path: str | Path, base: Path) -> DumpFormatError:
    """The error for a tensor file that is a link or lies outside the dump's tensor folder `base`."""
    return DumpFormatError(f"{path}: tensor file is a link or lies outside {base}; refusing to read it")


def _check_name(data_name: str) -> None:
    # a name without "/" is not absolute either
    if not data_name or "/" in data_name or "\\" in data_name or data_name in (".", "..") or "\x00" in data_name:
        raise DumpFormatError(f"data_name {data_name!r} is not a plain file name inside {TENSOR_DIR}/")


@functools.lru_cache(maxsize=256)
def _tensor_dir(dump_dir: str) -> tuple[Path, bool]:
    """(<dump_dir>/dump_tensor_data, whether it resolves inside <dump_dir>: a linked folder may lead out)."""
    base = os.path.realpath(os.path.join(dump_dir, TENSOR_DIR))
    root = os.path.realpath(dump_dir)
    try:
        inside = os.path.commonpath([base, root]) == root
    except ValueError:
        inside = False
    return Path(dump_dir) / TENSOR_DIR, inside


def load(path: Path, *, max_bytes: int | None = None) -> tuple[np.ndarray, str]:
    """(values, stored dtype) from a tensor file (.pt, .npy: dumpstore.readers by its suffix); bf16/fp8 widen
    losslessly to float32."""
    return load_tensor(path, max_bytes=max_bytes)


class MissingFile(DumpFormatError):
    """A leaf's tensor file is not there (`load_leaf`): the leaf is 'missing', not an error."""


Stamp = tuple[int, int]  # (size, mtime in ns) of a tensor file when it was read


def load_leaf(dump_dir: Path, data_name: str, *, max_bytes: int | None = None) -> tuple[np.ndarray, str, Stamp]:
    """(values, stored dtype, stamp) of the file `resolve(dump_dir, data_name)` names, with its checks.

    A .pt file costs one lstat, one open (that refuses a link as well: a link made after the lstat), one fstat
    and one read. Raises MissingFile when there is no file, DumpFormatError for a link, a name or folder that
    leads outside the dump, or an unreadable file.
    """
    _check_name(data_name)  # what resolve() checks first too
    if not _is_pt_name(data_name):
        path = resolve(dump_dir, data_name)
        if not path.exists():
            raise MissingFile(f"tensor file {path} is missing")
        before = stamp(path)
        arr, stored = load(path, max_bytes=max_bytes)
        return arr, stored, before
    base, inside = _tensor_dir(str(dump_dir))
    where = f"{base}{os.sep}{data_name}"  # os.path.join(base, data_name): base never ends in a separator
    # a plain name inside a folder that is itself inside the dump: only a link can lead elsewhere (checked before
    # the open, which refuses links too: nothing is ever opened through one, nor is an open of one attempted)
    if not inside or _islink(where):
        raise _refused(where, base)
    pt = _ptfile()
    try:
        return pt.read_pt_stamped(where, max_bytes=max_bytes, follow_links=False)
    except pt.MissingTensorFile:
        raise MissingFile(f"tensor file {where} is missing") from None
    except pt.LinkedTensorFile:
        raise _refused(where, base) from None


_islink = os.path.islink  # load_leaf's lstat (a name of its own: tests make a link appear after it)


def _is_pt_name(data_name: str) -> bool:
    """Whether os.path.splitext(data_name)[1].lower() == ".pt" for a name without a separator (in a third of the time:
    the extension is after the last dot, unless only dots precede it)."""
    return data_name[-3:].lower() == ".pt" and bool(data_name[:-3].strip("."))


@functools.cache
def _ptfile() -> ModuleType:
    """dumpstore.ptfile, imported on the first .pt read (a statistics ingest reads none: zipfile & co cost ~7 ms)."""
    from . import ptfile

    return ptfile


LOADED_BYTES = 16 << 20  # tensor files are loaded until they hold this much, then worked on


def loaded_in_batches(
    items: Iterable[T], load: Callable[[T], L], nbytes: Callable[[L], int]
) -> Iterator[list[tuple[T, L]]]:
    """(item, load(item)) in order, in lists that hold up to LOADED_BYTES of loaded values (`nbytes` of each): files
    are loaded a few at a time before their values are worked on, since numpy work right after a file's system
    calls runs slower (cold caches and predictors; about a third, measured on the bench's 8,416 small files)."""
    batch: list[tuple[T, L]] = []
    held = 0
    for item in items:
        got = load(item)
        batch.append((item, got))
        held += nbytes(got)
        if held >= LOADED_BYTES:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def stamp(path: str | os.PathLike[str]) -> Stamp:
    """(size, mtime in ns) of a file now (raises OSError): a file whose stamp changed may have new contents."""
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def fingerprint(arr: np.ndarray, stored: str) -> bytes:
    """The XXH3-128 of a loaded tensor: its stored dtype, numpy dtype, shape and values (C order).

    Two tensor files with the same fingerprint load into identical arrays, so any comparison of the two is the
    comparison of one array with itself.  XXH3 (16 GB/s here; SHA-256 1.4 GB/s cost large tensors a third of the
    ingest) is not cryptographic: the equality it proves is against accident, not against dumps crafted to collide
    (`--exact` also requires the ingest's exact statistics of the two files to agree)."""
    import xxhash

    h = xxhash.xxh3_128(f"{stored}|{arr.dtype.str}|{arr.shape}|".encode())
    h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
    return h.digest()

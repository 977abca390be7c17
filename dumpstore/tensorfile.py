"""Resolve a leaf's tensor file inside its dump folder (never outside) and load it without running code."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .dtypes import canonical
from .errors import DumpFormatError

TENSOR_DIR = "dump_tensor_data"


def resolve(dump_dir: Path, data_name: str) -> Path:
    """`<dump_dir>/dump_tensor_data/<data_name>`, refusing names that leave that folder."""
    if (not data_name or "/" in data_name or "\\" in data_name or data_name in (".", "..")
            or "\x00" in data_name or os.path.isabs(data_name)):
        raise DumpFormatError(f"data_name {data_name!r} is not a plain file name inside {TENSOR_DIR}/")
    base = dump_dir / TENSOR_DIR
    path = base / data_name
    # a linked dump_tensor_data/ that leads out of the dump folder counts as outside too
    if path.is_symlink() or not _inside(path, base) or not _inside(base, dump_dir):
        raise DumpFormatError(f"{path}: tensor file is a link or lies outside {base}; refusing to read it")
    return path


def _inside(path: Path, base: Path) -> bool:
    try:
        return os.path.commonpath([os.path.realpath(path), os.path.realpath(base)]) == os.path.realpath(base)
    except ValueError:
        return False


def load(path: Path, *, max_bytes: int | None = None) -> tuple[np.ndarray, str]:
    """(values, stored dtype) from a .pt or .npy file; bf16/fp8 widen losslessly to float32."""
    suffix = path.suffix.lower()
    if suffix == ".pt":
        from .ptfile import read_pt

        return read_pt(path, max_bytes=max_bytes)
    if suffix == ".npy":
        return _load_npy(path)
    raise DumpFormatError(f"{path}: unknown tensor file type; expected .pt or .npy")


def _load_npy(path: Path) -> tuple[np.ndarray, str]:
    if not path.is_file():  # a FIFO or device would block or stream forever
        raise DumpFormatError(f"{path}: not a regular file")
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode=None)
    except (ValueError, OSError, EOFError) as exc:
        raise DumpFormatError(f"{path}: unreadable .npy file ({_first_line(exc)})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biufc":
        raise DumpFormatError(f"{path}: .npy holds {getattr(arr, 'dtype', type(arr))}, not a numeric array")
    return arr, canonical(arr.dtype.name)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

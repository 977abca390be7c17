"""A folder of numpy `.npy` tensor files, one row each (numeric arrays only; no pickle)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..dtypes import canonical
from ..errors import DumpFormatError
from . import Claim, tensor_folder

NAME = "npy"
ORDER = 11
SUFFIX = ".npy"


def claim(folder: Path, filenames: list[str]) -> Claim | None:
    return tensor_folder(folder, filenames, SUFFIX)


def load(path: Path, *, max_bytes: int | None = None) -> tuple[np.ndarray, str]:
    """(values, stored dtype) of a .npy file (`max_bytes` unused: the header's claim is checked against the file)."""
    if not path.is_file():  # a FIFO or device would block or stream forever
        raise DumpFormatError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as fh:
            _check_npy_size(path, fh)
            arr = np.load(fh, allow_pickle=False, mmap_mode=None)
    except (ValueError, OSError, EOFError) as exc:
        raise DumpFormatError(f"{path}: unreadable .npy file ({_first_line(exc)})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biufc":
        raise DumpFormatError(f"{path}: .npy holds {getattr(arr, 'dtype', type(arr))}, not a numeric array")
    return arr, canonical(arr.dtype.name)


def _check_npy_size(path: Path, fh: BinaryIO) -> None:
    """Refuse a header that claims more data than the file holds (numpy would allocate it all first)."""
    major, _minor = np.lib.format.read_magic(fh)
    if major not in (1, 2, 3):
        raise DumpFormatError(f"{path}: .npy format version {major} is not supported")
    # 3.0 differs from 2.0 only in the header's text encoding (UTF-8), ASCII for every numeric dtype
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _fortran, dtype = read(fh)
    need, have = math.prod(shape) * dtype.itemsize, os.fstat(fh.fileno()).st_size - fh.tell()
    if need > have:
        raise DumpFormatError(
            f"{path}: truncated .npy file: its header claims shape {list(shape)} of {dtype} "
            f"({need} bytes), the file holds {have}"
        )
    fh.seek(0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

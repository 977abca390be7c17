"""A folder of PyTorch `.pt` tensor files (torch.save), one row each, read by dumpstore.ptfile (no pickle code)."""

from __future__ import annotations

from pathlib import Path

from . import Claim, tensor_folder

NAME = "pt"
ORDER = 10
SUFFIX = ".pt"


def claim(folder: Path, filenames: list[str]) -> Claim | None:
    return tensor_folder(folder, filenames, SUFFIX)


def load(path: Path, *, max_bytes: int | None = None):
    """(values, stored dtype) of a .pt file: bf16/fp8 widened losslessly to float32 (see ptfile.read_pt)."""
    from ..ptfile import read_pt  # here: a statistics ingest needs no .pt reader (zipfile & co: ~7 ms)

    return read_pt(path, max_bytes=max_bytes)

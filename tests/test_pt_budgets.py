"""Pickle and decompression budgets of the .pt reader: tiny hostile files fail fast, in one line, in little memory.

Each file is read in a child process with a time limit, so a reader that walks a 2**40-leaf structure or inflates
gigabytes fails the test instead of hanging it; the child reports its peak memory growth (ru_maxrss)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

_STORAGE = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQ"
_HEAD = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + _STORAGE
_TAIL = b"K\x0c\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR."  # size (12,), stride (1,), False, hooks


def _shared(levels: int, close: bytes) -> bytes:
    """Opcodes that leave one container on the stack holding 2**levels leaves, each level the previous one twice
    (memo GETs: a few bytes a level). `close` is b"l" for lists, b"t" for tuples."""
    out = b"(NN" + close + b"q\x00" + b"0"
    for i in range(levels - 1):
        out += b"(h" + bytes([i]) + b"h" + bytes([i]) + close + b"q" + bytes([i + 1]) + b"0"
    return out + b"h" + bytes([levels - 1])


def _pt(path: Path, pkl: bytes, compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/data/0", np.arange(12, dtype="<f4").tobytes())
        z.writestr("archive/version", b"3\n")
    return path


_CHILD = """
import json, resource, sys, time
from dumpstore.errors import DumpFormatError
from dumpstore.ptfile import read_pt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    read_pt(sys.argv[1])
    error = None
except DumpFormatError as exc:
    error = str(exc)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"error": error, "grown_kib": grown, "seconds": time.perf_counter() - t0}))
"""


def _read_in_child(path: Path, timeout: float = 60) -> dict:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {path.name} did not finish in {timeout} s")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _one_line(result: dict, path: Path, words: str) -> None:
    error = result["error"]
    assert error is not None and error.startswith(f"{path}: ") and "\n" not in error and len(error) < 400, error
    assert words in error, error


def test_offset_with_2_to_the_40_shared_leaves_fails_fast(tmp_path):
    path = _pt(tmp_path / "bomb.pt", _HEAD + _shared(40, b"l") + _TAIL)  # the list stands where the offset goes
    assert path.stat().st_size < 1600
    result = _read_in_child(path)
    _one_line(result, path, "refused to load: pickle describes more than 1000000 objects")
    assert result["grown_kib"] < 50_000


def test_dict_key_with_2_to_the_40_shared_leaves_fails_fast(tmp_path):
    """Hashing a key walks it: the unpickler itself would never finish building this dict."""
    metadata = b"}" + _shared(40, b"t") + b"Ns"  # {shared tuple: None} as the tensor's metadata
    pkl = _HEAD + b"K\x00K\x0c\x85K\x01\x85\x89ccollections\nOrderedDict\n)R" + metadata + b"tR."
    path = _pt(tmp_path / "key.pt", pkl)
    result = _read_in_child(path)
    _one_line(result, path, "refused to load: pickle describes more than 1000000 objects")


def test_huge_memo_index_fails_without_allocating(tmp_path):
    """LONG_BINPUT 2**28: the C unpickler would size its memo table to 2**29 slots (4 GiB) first."""
    path = _pt(tmp_path / "memo.pt", b"\x80\x02Nr\x00\x00\x00\x10.")
    result = _read_in_child(path)
    _one_line(result, path, "refused to load: pickle memo index over 65536")
    assert result["grown_kib"] < 50_000


def test_render_of_a_bad_offset_is_bounded(tmp_path):
    """An offset that is a (non-shared) list of 5000 numbers is named by its type, not printed."""
    flat = b"(" + b"K\x07" * 5000 + b"l"
    path = _pt(tmp_path / "flat.pt", _HEAD + flat + _TAIL)
    result = _read_in_child(path)
    _one_line(result, path, "corrupt pickle: storage offset <list of 5000 items> is not a non-negative int")


@pytest.fixture(scope="module")
def deflate_bomb(tmp_path_factory) -> Path:
    """A .pt whose data.pkl is 1 GiB of BINBYTES zeros, deflated to about 1 MB."""
    n = 1 << 30
    path = tmp_path_factory.mktemp("bomb") / "deflated.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("archive/data.pkl", "w", force_zip64=True) as fh:
            fh.write(b"\x80\x04\x8e" + n.to_bytes(8, "little"))
            zeros = bytes(1 << 24)
            for _ in range(n >> 24):
                fh.write(zeros)
            fh.write(b".")
        z.writestr("archive/byteorder", b"little")
    return path


def test_deflate_bomb_fails_in_bounded_memory(deflate_bomb):
    assert deflate_bomb.stat().st_size < 8 << 20
    result = _read_in_child(deflate_bomb)
    _one_line(result, deflate_bomb, "(more than 100x: a zip bomb?)")
    assert result["grown_kib"] < 100_000  # refused before inflating: the 1 GiB was never made


def test_plain_compressed_member_still_reads(tmp_path):
    """Compression itself is fine: a deflated pickle of ordinary size and ratio reads as before."""
    pkl = _HEAD + b"K\x00" + _TAIL
    path = _pt(tmp_path / "ok.pt", pkl, zipfile.ZIP_DEFLATED)
    result = _read_in_child(path)
    assert result["error"] is None

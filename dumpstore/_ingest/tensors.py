"""Tensor files summarised into their leaves' columns: read in chunks (by the pool's workers, or here), checked
against what dump.json says, summarised (statistics, sample, sketch, content hash)."""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import summary
from ..errors import DumpFormatError
from ..layout import Unit
from ..schema import TENSOR_FILE_COLUMNS
from ..tensorfile import (
    TENSOR_DIR,
    MissingFile,
    Stamp,
    fingerprint,
    load_leaf,
    loaded_in_batches,
    stamp,
)
from .model import Batch, IngestOptions, UnitResult

if TYPE_CHECKING:  # imported where a pool is made: concurrent.futures and multiprocessing cost a statistics
    from concurrent.futures import Future  # ingest ~25 ms of start-up for nothing

    from .pool import _LazyPool  # the pool's workers load this module's reader (pool imports tensors)

_MIN_FILE_CAP = 1 << 20  # tensor files may always expand to this much (a small view of a larger storage)
_FILE_FIELDS = ("data_name", "dtype", "shape", "numel")
# what a loaded tensor file gives its leaf (besides file_status, the flags, stats_source, sample and sketch)
_SUMMARY_COLUMNS = (
    "min",
    "max",
    "mean",
    "norm",
    "nan_count",
    "posinf_count",
    "neginf_count",
    "zero_count",
    "sat_count",
    *TENSOR_FILE_COLUMNS,
)


_FLAGS = (
    ("has_nan", "nan_count"),
    ("has_posinf", "posinf_count"),
    ("has_neginf", "neginf_count"),
    ("has_sat", "sat_count"),
)


_CHUNK_FILES = 64  # tensor files read by one worker call (amortises the inter-process round trip)
_AHEAD_BATCHES = 2  # batches whose files are being read while the next one is built (the workers never idle)


@dataclass
class _Summaries:
    """What the tensor files of a chunk of leaves gave, by column (a worker's answer: no dict per leaf).

    `failed`: (position in the chunk, file_status, error) of each leaf whose file was not loaded; `loaded`: the
    positions of the others, whose _SUMMARY_COLUMNS are `columns` (in that order) and whose samples and sketches
    lie one after another in `values` (float64) once `packed`, `lengths` two per loaded leaf; `files`: tensor files
    read."""

    failed: list[tuple[int, str, str]] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)
    columns: list[list[Any]] = field(default_factory=lambda: [[] for _ in _SUMMARY_COLUMNS])
    parts: list[np.ndarray] = field(default_factory=list)
    values: np.ndarray | None = None
    lengths: list[int] = field(default_factory=list)
    files: int = 0

    def add(self, j: int, summary_row: tuple, sample: np.ndarray, sketch: np.ndarray) -> None:
        self.loaded.append(j)
        for col, v in zip(self.columns, summary_row):
            col.append(v)
        self.parts += (sample, sketch)

    def packed(self) -> _Summaries:
        """The samples and sketches as one buffer (one pickled array instead of two per file)."""
        self.lengths = [p.size for p in self.parts]
        self.values = np.concatenate(self.parts) if self.parts else np.zeros(0)
        self.parts = []
        return self


def _submit(pool: _LazyPool | None, dump_dir: str, chunk: list[tuple], opts: IngestOptions) -> Future:
    """The chunk's files read by the pool; without one, read here (the future done with their summaries)."""
    if pool is not None:
        return pool.submit(_summarize_files, (dump_dir, chunk, opts))
    from concurrent.futures import Future

    done: Future = Future()
    done.set_result(_summaries(chunk, Path(dump_dir), opts).packed())
    return done


def _summarize_files(job: tuple[str, list[tuple], IngestOptions]) -> _Summaries:
    """Worker: `_summaries` of a chunk of leaves ((data_name, dtype, shape, numel) each), packed."""
    dump_dir, chunk, opts = job
    return _summaries(chunk, Path(dump_dir), opts).packed()


def _summaries(chunk: list[tuple], path: Path, opts: IngestOptions) -> _Summaries:
    """Load and summarise the tensor file of each leaf of a chunk (_load_tensor, _summary), a few files at a time
    (tensorfile.loaded_in_batches)."""
    out = _Summaries()
    for batch in loaded_in_batches(enumerate(chunk), lambda item: _load_tensor(item, path, out), _loaded_bytes):
        for (j, leaf), got in batch:
            if got is not None:
                arr, stored, file_stamp = got
                out.add(j, *_summary(arr, stored, file_stamp, leaf[1] or stored, opts))
    return out


def _loaded_bytes(got: _Loaded | None) -> int:
    return 0 if got is None else got[0].nbytes


_Chunks = list[tuple[list[int], "Future"]]  # the batch positions of a chunk's leaves, and their summaries


def _with_tensor_files(
    batches: Iterator[Batch], unit: Unit, opts: IngestOptions, res: UnitResult, pool: _LazyPool | None
) -> Iterator[Batch]:
    """The batches with the tensor file of every leaf that names one summarised into their columns, read in chunks
    (_summaries); with a pool, a batch's chunks are read by its workers while the next batches are built."""
    if not opts.load_tensors:
        yield from batches
        return
    pending: deque[tuple[Batch, _Chunks]] = deque()
    for cols in batches:
        pending.append((cols, _submitted(cols, unit, opts, pool)))
        if len(pending) > _AHEAD_BATCHES:
            yield _patched(*pending.popleft(), res)
    while pending:
        yield _patched(*pending.popleft(), res)


def _submitted(cols: Batch, unit: Unit, opts: IngestOptions, pool: _LazyPool | None) -> _Chunks:
    """The files of the batch's leaves that name one, in chunks: handed to the pool, or (without one) read here."""
    dump_dir = str(unit.path.parent)
    at = [i for i, dn in enumerate(cols["data_name"]) if dn]
    fields = list(zip(*(cols[c] for c in _FILE_FIELDS)))
    chunks = [at[i : i + _CHUNK_FILES] for i in range(0, len(at), _CHUNK_FILES)]
    return [(c, _submit(pool, dump_dir, [fields[i] for i in c], opts)) for c in chunks]


def _patched(cols: Batch, chunks: _Chunks, res: UnitResult) -> Batch:
    """The batch with its leaves' summaries (waited for, when read by the pool) in its columns."""
    for where, future in chunks:
        _apply(cols, where, future.result(), res)
    return cols


def _apply(cols: Batch, where: list[int], got: _Summaries, res: UnitResult) -> None:
    """Put a chunk's summaries into the batch's columns (`where`: the batch position of each leaf of the chunk)."""
    res.tensor_files += got.files
    for j, status, error in got.failed:
        cols["file_status"][where[j]], cols["error"][where[j]] = status, error
    at = [where[j] for j in got.loaded]
    for name, values in zip(_SUMMARY_COLUMNS, got.columns):
        _put(cols[name], at, values)
    by_name = dict(zip(_SUMMARY_COLUMNS, got.columns))
    for flag, count in _FLAGS:
        _put(cols[flag], at, [n > 0 for n in by_name[count]])
    _put(cols["file_status"], at, ["loaded"] * len(at))
    _put(cols["stats_source"], at, ["tensor"] * len(at))
    ends = np.cumsum(got.lengths).tolist()
    starts = [0, *ends[:-1]]
    flat = got.values
    assert flat is not None  # packed where it was made
    _put(cols["sample"], at, [flat[starts[k] : ends[k]] for k in range(0, len(ends), 2)])
    _put(cols["sketch"], at, [flat[starts[k] : ends[k]] for k in range(1, len(ends), 2)])


def _put(column: list[Any], at: list[int], values: list[Any]) -> None:
    for i, v in zip(at, values):
        column[i] = v


_Loaded = tuple[Any, str, Stamp]  # a tensor file's values, stored dtype and stamp


def _load_tensor(item: tuple[int, tuple], dump_dir: Path, out: _Summaries) -> _Loaded | None:
    """Load the tensor file of a chunk's `item` (position, (data_name, dtype, shape, numel)); None (and `out` says
    why) when it is missing, unreadable or disagrees with the leaf."""
    j, (data_name, dtype, shape, numel) = item
    try:
        arr, stored, file_stamp = load_leaf(dump_dir, data_name, max_bytes=_max_bytes(numel))
    except MissingFile as exc:
        out.failed.append((j, "missing", str(exc)))
        return None
    except DumpFormatError as exc:
        out.failed.append((j, "error", str(exc)))
        return None
    out.files += 1
    problem = _mismatch(shape, dtype, arr, stored)
    if problem:
        out.failed.append((j, "error", f"{os.path.join(dump_dir, TENSOR_DIR, data_name)}: {problem}"))
        return None
    return arr, stored, file_stamp


def _summary(arr, stored: str, file_stamp: Stamp, dtype: str, opts: IngestOptions) -> tuple[tuple, Any, Any]:
    """(the _SUMMARY_COLUMNS, sample, sketch) of a loaded tensor: exact statistics of its values (as `dtype`), its
    content hash (`--exact` compares equal contents once) and its file's size and mtime."""
    s, sample, sketch = summary.summarize(arr, dtype, opts.sample_k, opts.sketch_m)  # one pass over the data
    stats = (s.min, s.max, s.mean, s.norm, s.nan_count, s.posinf_count, s.neginf_count, s.zero_count, s.sat_count)
    return (*stats, fingerprint(arr, stored), *file_stamp), sample, sketch  # 1-D float64 arrays for Arrow


def _fill_loaded(row: dict[str, Any], arr, stored: str, file_stamp: Stamp, opts: IngestOptions) -> None:
    """A loaded tensor's summary into its row (plain tensor folders: rows are dicts)."""
    values, sample, sketch = _summary(arr, stored, file_stamp, row.get("dtype") or stored, opts)
    row.update(zip(_SUMMARY_COLUMNS, values))
    row.update({flag: row[count] > 0 for flag, count in _FLAGS})
    row.update(file_status="loaded", stats_source="tensor", sample=sample, sketch=sketch)


def load_file_into(
    row: dict[str, Any],
    path: Path,
    load: Callable[[Path], tuple[Any, str]],
    opts: IngestOptions,
    res: UnitResult,
    saved_as: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """Read one tensor file that is a record of its own (a plain folder's file, a kernel dump's file) into its row:
    dtype, shape and summary, or an error row when it is a link, gone since its folder was listed or unreadable.
    `saved_as`: a stored dtype and the dtypes a row may already name for it (MindSpore writes bfloat16 as float32),
    kept as the row's dtype."""
    try:
        if path.is_symlink():
            raise DumpFormatError(f"{path}: tensor file is a link; refusing to read it (copy the file instead)")
        file_stamp = stamp(path)
        arr, stored = load(path)
        res.tensor_files += 1
        dtype = row["dtype"] if row.get("dtype") in (saved_as or {}).get(stored, ()) else stored
        row.update(dtype=dtype, dtype_raw=row.get("dtype_raw") or stored, shape=list(arr.shape), numel=int(arr.size))
        _fill_loaded(row, arr, stored, file_stamp, opts)
    except OSError as exc:  # the stat: gone since the folder was listed
        row.update(file_status="error", error=f"{path}: cannot read tensor file: {exc.strerror}", stats_source="none")
    except DumpFormatError as exc:
        row.update(file_status="error", error=str(exc), stats_source="none")


def _max_bytes(numel: int | None) -> int | None:
    """Cap on what a .pt file may expand to: a file that matches dump.json's shape needs at most 16 bytes an
    element (complex128); the cap keeps a tiny file that claims gigabytes (stride 0) from being expanded."""
    return None if numel is None else max(min(16 * numel, _pt_max_bytes()), _MIN_FILE_CAP)


@functools.cache
def _pt_max_bytes() -> int:
    from ..ptfile import DEFAULT_MAX_BYTES  # here: a statistics ingest needs no .pt reader (zipfile & co: ~7 ms)

    return DEFAULT_MAX_BYTES


def _mismatch(shape: list[int] | None, dtype: str | None, arr, stored: str) -> str | None:
    if shape is not None and list(arr.shape) != list(shape):
        return f"tensor file has shape {list(arr.shape)} but dump.json says {shape}"
    # MindSpore saves bf16 as float32 .npy while dump.json says BFloat16
    if dtype and stored != dtype and not (dtype == "bfloat16" and stored == "float32"):
        if dtype in ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"):
            return f"tensor file has dtype {stored} but dump.json says {dtype}"
    return None

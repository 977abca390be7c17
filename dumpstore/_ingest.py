"""Ingest a dump tree into the store: one Parquet file per step and rank, published atomically per run."""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import stat
import threading
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import ujson

from . import jsonsplit, msgraph, parquetio, summary
from . import retain as _retained
from .arrays import to_arrow
from .errors import DumpFormatError, DumpstoreWarning, StoreError
from .framework import detect_framework
from .layout import Unit, find_units
from .names import parse_record
from .records import LEAF_COLUMNS, leaf_column_lists, record_leaves
from .retain import retain
from .schema import STACK_SCHEMA, TENSOR_FILE_COLUMNS, TENSOR_SCHEMA
from .store import Store, open_store, staging_dir, store_errors
from .tensorfile import (
    TENSOR_DIR,
    MissingFile,
    Stamp,
    fingerprint,
    forget_folders,
    load,
    load_leaf,
    loaded_in_batches,
    stamp,
)
from .workers import worker_init

if TYPE_CHECKING:  # imported where a pool is made: concurrent.futures and multiprocessing cost a statistics
    from concurrent.futures import Future, ProcessPoolExecutor  # ingest ~25 ms of start-up for nothing

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BATCH_ROWS = 4096  # rows turned into Arrow at a time
_GROUP_ROWS = 1 << 16  # a Parquet row group holds up to this many rows ...
_GROUP_BYTES = 32 << 20  # ... and about this much Arrow data (tensor rows carry a sample and a sketch)
# zstd's fastest level: on the bench's tensor dump (9.4k rows, 34 MB of Arrow data) the write takes 0.22 s instead of
# level 3's 0.30 s (at the end of an ingest, on one core) for a file 1.4 % larger (6.85 MB); statistics files ~4 %
_ZSTD_LEVEL = 1
# The sample and sketch values are stored byte-stream-split (Parquet's encoding for floats: the values' bytes by
# position): on the bench's tensor dump a quarter less time to write and 15 % smaller than plain with zstd.
_SPLIT_FLOATS = ["sample.list.element", "sketch.list.element"]
# Dictionary-encode only the columns that repeat a few values (names, numbers and statistics rarely repeat:
# their dictionaries cost time and make the file larger)
_DICTIONARY_COLUMNS = [
    "ingest_id",
    "rank_dir",
    "source",
    "prefix",
    "api",
    "op_type",
    "direction",
    "module",
    "io",
    "index_path",
    "kind",
    "value_type",
    "dtype",
    "dtype_raw",
    "stats_source",
    "checksum_kind",
    "file_status",
]
_INT32_MAX = (1 << 31) - 1
MAX_DUMP_JSON_BYTES = 4 << 30
_MIN_FILE_CAP = 1 << 20  # tensor files may always expand to this much (a small view of a larger storage)


@dataclass(frozen=True)
class IngestOptions:
    sample_k: int = summary.DEFAULT_SAMPLE_K
    sketch_m: int = summary.DEFAULT_SKETCH_M
    load_tensors: bool = True


@dataclass
class UnitResult:
    step: int
    rank: int
    files: int = 0
    records: int = 0
    rows: int = 0
    tensors: int = 0
    tensor_files: int = 0
    errors: int = 0
    first_error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class IngestResult:
    run: str
    ingest_id: str
    units: int
    records: int
    rows: int
    tensors: int
    tensor_files: int
    errors: int
    first_error: str | None
    steps: list[int]
    ranks: list[int]


def ingest(
    path: str | os.PathLike,
    run: str,
    *,
    store: str | os.PathLike | None = None,
    options: IngestOptions | None = None,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    engine: str = "local",
    engine_options: dict[str, Any] | None = None,
) -> IngestResult:
    """Ingest every dump under `path` as run `run`; replaces an earlier run of that name atomically.

    `engine`: 'local' (a process pool on this machine) or 'ray' (tasks on a Ray cluster writing into a store
    every node reaches; `engine_options` go to `engine_ray.run_units`: address, batch, retries)."""
    opts = options or IngestOptions()
    summary.check_sketch_m(opts.sketch_m)
    if engine not in ("local", "ray"):
        raise StoreError(f"engine {engine!r} is not known; use 'local' or 'ray'")
    if not _RUN_NAME.match(run):
        raise StoreError(f"run name {run!r} is not allowed; use letters, digits, '.', '_' or '-' (max 128)")
    try:
        units = find_units(path)
        with store_errors(store):
            st = open_store(store, create=True)
            ingest_id = uuid.uuid4().hex[:12]
            # errors are worded inside: a full file system is told from one without inodes before the cleanup
            with st.run_lock(run), _discarded_on_failure(st, run, ingest_id), store_errors(st.root):
                if engine == "ray":
                    from .engine_ray import run_units as ray_units

                    results = ray_units(st, run, ingest_id, units, opts, progress=progress, **(engine_options or {}))
                else:
                    results = _run_units(st, run, ingest_id, units, opts, jobs, progress)
                total = _combine(run, ingest_id, results)
                _warn(results)
                st.publish_run(_catalog_row(run, ingest_id, path, units, results, total, opts))
    except DumpFormatError as exc:
        if one_line(str(exc)) == str(exc):
            raise
        raise DumpFormatError(one_line(str(exc))) from None  # a folder or file name with a line break
    return total


@contextmanager
def _discarded_on_failure(st: Store, run: str, ingest_id: str) -> Iterator[None]:
    """Remove what the ingest wrote when it fails (an error, Ctrl-C): the store stays as it was."""
    try:
        yield
    except BaseException:
        st.discard(run, ingest_id)
        raise


def one_line(text: str) -> str:
    """`text` with its line breaks escaped: errors are one line even when a file name holds a newline."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _run_units(
    st: Store,
    run: str,
    ingest_id: str,
    units: list[Unit],
    opts: IngestOptions,
    jobs: int | None,
    progress: Callable[[int, int], None] | None,
) -> list[UnitResult]:
    tasks = [(u, str(st.root), run, ingest_id, opts) for u in units]
    n_jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    results: list[UnitResult] = []
    if progress:
        progress(0, len(tasks))
    if n_jobs == 1:
        cores = (jobs or os.cpu_count() or 1) if len(tasks) == 1 else 1
        spare = cores if opts.load_tensors else 1
        with _maybe_pool(spare) as files_pool:  # one dump file: its tensor files are read in parallel
            for t in tasks:
                results.append(_ingest_unit(*t, files_pool=files_pool, cores=cores))
                if progress:
                    progress(len(results), len(tasks))
        return results
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=n_jobs, initializer=worker_init, initargs=(os.getpid(),)) as pool:
        for res in pool.map(_ingest_unit_star, tasks):
            results.append(res)
            if progress:
                progress(len(results), len(tasks))
    return results


def _ingest_unit_star(args: tuple) -> UnitResult:
    return _ingest_unit(*args)


@contextmanager
def _maybe_pool(workers: int) -> Iterator[_LazyPool | None]:
    if workers < 2:
        yield None
        return
    pool = _LazyPool(workers)
    try:
        yield pool
    finally:
        pool.shutdown()


class _LazyPool:
    """A process pool for tensor files, started by its first task: a statistics dump has no files to read, and
    concurrent.futures with multiprocessing costs ~25 ms to import."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None

    def submit(self, fn: Callable, *args: Any) -> Future:
        if self.pool is None:
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(
                max_workers=self.workers, initializer=_files_worker_init, initargs=(os.getpid(),)
            )
        return self.pool.submit(fn, *args)

    def start(self) -> None:
        """Start the workers now: they get ready for tensor files while this process reads the dump."""
        if self.pool is None:
            self.submit(_ready)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _files_worker_init(owner: int) -> None:
    """A tensor-file worker: ends with its parent (worker_init); loads what every task needs before the first."""
    worker_init(owner)
    _pt_max_bytes()  # the .pt reader
    import xxhash  # noqa: F401  (the content hash)

    summary._sign_tables()


def _ready() -> None:
    """The task that starts a pool's workers."""


def _ingest_unit(
    unit: Unit,
    root: str,
    run: str,
    ingest_id: str,
    opts: IngestOptions,
    files_pool: _LazyPool | None = None,
    cores: int = 1,
) -> UnitResult:
    forget_folders()
    retain(None)  # the previous unit's dump is freed before this one is parsed: one at a time in memory
    res = UnitResult(unit.step, unit.rank)
    part = staging_dir(root, run, ingest_id) / "tensors" / f"step={unit.step}" / f"rank={unit.rank}"
    part.mkdir(parents=True, exist_ok=True)
    suffix = f"-{unit.source}" if unit.source else ""
    out = part / f"part-{ingest_id}{suffix}.parquet"
    with _gc_paused():
        _write_unit(unit, out, root, run, ingest_id, opts, res, files_pool, cores)
    return res


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: a parsed dump.json is millions of objects that a collection would scan
    again and again while the rows are built (they form no cycles, so nothing waits to be collected)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _retained.RETAINED:  # the dump kept to the end of the process (dumpstore.retain) is never scanned again:
            gc.freeze()  # the first collection after the pause would walk its millions of objects (60-90 ms)
        if enabled:
            gc.enable()


def _write_unit(
    unit: Unit,
    out: Path,
    root: str,
    run: str,
    ingest_id: str,
    opts: IngestOptions,
    res: UnitResult,
    files_pool: _LazyPool | None,
    cores: int = 1,
) -> None:
    constants: dict[str, str | None] = {"ingest_id": ingest_id, "rank_dir": unit.rank_dir, "source": unit.source}
    if unit.kind == "dump":
        tables, stacks = _dump_tables(unit, opts, res, files_pool, constants, cores)
    elif unit.kind == msgraph.KIND:
        batches, stacks = _graph_batches(unit, opts, res)
        tables = (_batch_table(b, constants, res) for b in batches)
    else:
        batches = _file_batches(unit, opts, res)
        tables, stacks = (_batch_table(b, constants, res) for b in batches), []
    with parquetio.Writer(
        out,
        TENSOR_SCHEMA,
        compression="zstd",
        compression_level=_ZSTD_LEVEL,
        use_dictionary=_DICTIONARY_COLUMNS,
        use_byte_stream_split=_SPLIT_FLOATS,
    ) as writer:
        groups = _RowGroups(writer)
        for table in tables:
            groups.add(table)
        groups.close()
    if stacks:
        _write_stacks(Path(root), run, ingest_id, unit, stacks)


def _write_stacks(root: Path, run: str, ingest_id: str, unit: Unit, stacks: list[list[str]]) -> None:
    d = staging_dir(root, run, ingest_id) / "stacks"
    d.mkdir(parents=True, exist_ok=True)
    name = f"part-{ingest_id}-{unit.step}-{unit.rank}{'-' + unit.source if unit.source else ''}.parquet"
    n = len(stacks)
    columns: dict[str, Any] = {
        "ingest_id": [ingest_id] * n,
        "step": [unit.step] * n,
        "rank": [unit.rank] * n,
        "stack_id": range(n),
        "frames": stacks,
    }
    parquetio.write_table(
        pa.Table.from_arrays(_arrays(columns, STACK_SCHEMA), schema=STACK_SCHEMA), d / name, compression="zstd"
    )


# A row's columns: the record's, the leaf's place in it, then what describes the leaf.
_RECORD_COLUMNS = (
    "seq",
    "record",
    "prefix",
    "api",
    "op_type",
    "call",
    "direction",
    "module",
    "is_recompute",
    "stack_id",
)
ROW_COLUMNS = _RECORD_COLUMNS + ("io", "index_path", "name", "leaf") + LEAF_COLUMNS
_LIST_COLUMNS = ("sample", "sketch")  # float lists: numpy arrays or Python lists per row
Batch = dict[str, Any]  # column -> a list of Python values (None = null), or an Arrow array


def _batch_table(batch: Batch, constants: dict[str, str | None], res: UnitResult) -> pa.Table:
    """A non-empty batch (every column of ROW_COLUMNS and TENSOR_FILE_COLUMNS) as a table of TENSOR_SCHEMA, counted
    into `res`."""
    _count(batch, res)
    n = len(batch["kind"])
    columns = {**batch, **{c: pa.repeat(pa.scalar(v, TENSOR_SCHEMA.field(c).type), n) for c, v in constants.items()}}
    return pa.Table.from_arrays(_arrays(columns, TENSOR_SCHEMA), schema=TENSOR_SCHEMA)


def _arrays(columns: dict[str, Any], schema: pa.Schema) -> list[pa.Array]:
    """The columns (Arrow arrays, or lists of Python values with None = null) as Arrow arrays in the schema's
    order."""
    out = []
    for f in schema:
        values = columns[f.name]
        if isinstance(values, pa.Array):
            out.append(values)
        elif f.name in _LIST_COLUMNS:
            out.append(_float_lists(values, f.type))
        else:
            out.append(_array(values, f.type))
    return out


def _array(values: Sequence[Any] | np.ndarray, type_: pa.DataType) -> pa.Array:
    try:
        return pa.array(values, type_)
    except UnicodeEncodeError:  # lone surrogates: JSON \udcxx escapes, file names that are not UTF-8
        return pa.array([utf8(v) for v in values], type_)


def _float_lists(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    """A list<float64> array from per-row 1-D numpy arrays or lists (None = null), through one concatenation."""
    present = [v for v in values if v is not None]
    if not present:
        return pa.nulls(len(values), type_)
    lengths = np.fromiter((0 if v is None else len(v) for v in values), np.int32, len(values))
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([np.asarray(v, np.float64) for v in present]) if offsets[-1] else np.zeros(0)
    nulls = None if len(present) == len(values) else np.fromiter((v is None for v in values), np.bool_, len(values))
    return to_arrow(offsets, type_, nulls, child=to_arrow(flat, pa.float64()))


class _RowGroups:
    """Collects batches into row groups of up to _GROUP_ROWS rows or _GROUP_BYTES bytes: fewer, larger groups
    compress better and read faster, while memory stays bounded by one group."""

    def __init__(self, writer: parquetio.Writer):
        self.writer = writer
        self.pending: list[pa.Table] = []
        self.rows = self.bytes = self.written = 0

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.rows += table.num_rows
        self.bytes += table.nbytes
        if self.rows >= _GROUP_ROWS or self.bytes >= _GROUP_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            table = pa.concat_tables(self.pending)
            self.writer.write_table(table, row_group_size=max(1, table.num_rows))
            self.written += table.num_rows
        self.pending, self.rows, self.bytes = [], 0, 0

    def close(self) -> None:
        if not self.written and not self.rows:  # a unit without rows still gets its (empty) file
            self.pending.append(TENSOR_SCHEMA.empty_table())
        self.flush()


def utf8(value: Any) -> Any:
    """`value` with its strings storable as UTF-8: bytes of a non-UTF-8 file name become \\xNN, other lone
    surrogates \\uXXXX (lists are converted element-wise; other values are returned as they are)."""
    if isinstance(value, list):
        return [utf8(v) for v in value]
    if not isinstance(value, str):
        return value
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def read_json(path: Path) -> Any:
    """Parse a dump JSON file (bare NaN/Infinity allowed), or raise a one-line DumpFormatError."""
    return _decode_json(path, _read_bytes(path))


def _read_bytes(path: Path) -> bytes:
    """A dump JSON file's bytes (a regular file within the size limit), or a one-line DumpFormatError."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise DumpFormatError(f"{path}: not a regular file; expected msprobe's JSON")
        size = info.st_size
        if size > MAX_DUMP_JSON_BYTES:
            raise DumpFormatError(f"{path}: {size} bytes is larger than the {MAX_DUMP_JSON_BYTES} byte limit")
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read ({exc.strerror})") from None


def _decode_json(path: Path, data: bytes) -> Any:
    """The JSON text `data` of `path` parsed (see parse_json), or a one-line DumpFormatError."""
    try:
        return parse_json(data)
    except json.JSONDecodeError as exc:
        raise DumpFormatError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); "
            "the file may be truncated: copy it again or re-run the dump"
        ) from None
    except UnicodeDecodeError:
        raise DumpFormatError(f"{path}: not UTF-8 text; expected msprobe's JSON") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's digit limit
        raise DumpFormatError(f"{path}: invalid JSON ({' '.join(str(exc).split())[:200]})") from None
    except RecursionError:
        raise DumpFormatError(f"{path}: JSON nested too deeply") from None


def parse_json(data: bytes) -> Any:
    """JSON text (bare NaN / Infinity / -Infinity allowed) as Python values: ujson (C, 1.4x faster than json on a
    dump.json), or json where ujson refuses the text, so that json's error (with its line and column) is raised."""
    try:
        return ujson.loads(data)
    except (ujson.JSONDecodeError, ValueError, OverflowError, TypeError):
        return json.loads(data)


def _aux_json(path: Path, res: UnitResult, lost: str) -> Any:
    """A dump's construct.json or stack.json, parsed; None where there is none, or it is a link or unreadable (a
    warning for the unit's result saying what the rows go without: `lost`)."""
    if path.is_symlink():
        res.meta.setdefault("warnings", []).append(f"{path}: a link; not read (copy the file instead); {lost}")
        return None
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except DumpFormatError as exc:
        res.meta.setdefault("warnings", []).append(f"{exc}; {lost}")
        return None


def _warn(results: list[UnitResult]) -> None:
    """The units' warnings (gathered where each unit was ingested, maybe another process) as DumpstoreWarnings."""
    for res in results:
        for message in res.meta.get("warnings", []):
            warnings.warn(message, DumpstoreWarning, stacklevel=3)


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


def _dump_tables(
    unit: Unit,
    opts: IngestOptions,
    res: UnitResult,
    files_pool: _LazyPool | None,
    constants: dict[str, str | None],
    cores: int,
) -> tuple[Iterator[pa.Table], list[list[str]]]:
    if files_pool is not None and opts.load_tensors and os.path.isdir(unit.path.parent / TENSOR_DIR):
        files_pool.start()  # forked before the dump is parsed: the workers get ready meanwhile, and copy less
    raw = _read_bytes(unit.path)
    if cores > 1 and len(raw) >= _SPLIT_MIN_BYTES and threading.active_count() == 1:  # see _split_tables
        cut = _text_split(raw, cores, unit, opts, res, constants)
        if cut is not None:
            return iter(cut[0]), cut[1]
    doc, construct, stack_ids, stacks = _open_dump(unit, res, raw)
    retain(doc)  # the console script exits without freeing it (dumpstore.retain)
    tensor_task = _tensor_task(doc)
    job = _Slices(list(doc["data"].items()), construct, stack_ids, tensor_task, unit, opts, constants)
    if (
        cores > 1
        and len(job.records) >= _SPLIT_MIN_RECORDS
        and not (tensor_task and opts.load_tensors)
        and threading.active_count() == 1  # fork only a single-threaded process (a lock held by another thread
    ):  # would stay held in the child)
        return iter(_split_tables(job, cores, res)), stacks
    batches = _record_batches(job.records, 0, construct, stack_ids, res)
    rows = _with_tensor_files((_leaf_batch(b, tensor_task, res) for b in batches), unit, opts, res, files_pool)
    return (_batch_table(b, constants, res) for b in rows), stacks


def _tensor_task(doc: dict) -> bool:
    return doc.get("task") not in ("statistics", "md5", "overflow_check")


def _open_dump(unit: Unit, res: UnitResult, raw: bytes) -> tuple[dict, dict, dict[str, int], list[list[str]]]:
    """The unit's dump.json (its bytes `raw`; checked to hold a 'data' object), construct.json and stack.json."""
    doc = _decode_json(unit.path, raw)
    if unit.path.name == "debug.json" and isinstance(doc, dict) and "data" not in doc:
        doc = {"data": doc, "level": "debug"}
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise DumpFormatError(
            f"{unit.path}: expected an object with a 'data' object of records "
            "(msprobe dump.json); is this the right file?"
        )
    _set_meta(res, doc)
    return (doc, *_aux_files(unit, res))


def _set_meta(res: UnitResult, doc: Any) -> None:
    res.files = 1
    res.meta.update({k: doc.get(k) for k in ("task", "level", "framework") if isinstance(doc.get(k), str)})
    if "framework" not in res.meta and (found := detect_framework(doc)):
        res.meta["framework"] = found


def _aux_files(unit: Unit, res: UnitResult) -> tuple[dict, dict[str, int], list[list[str]]]:
    """construct.json (a dict), and stack.json as stack ids by record and the stacks."""
    construct = _aux_json(unit.path.parent / "construct.json", res, "ingested without module parents")
    stack_ids, stacks = _stack_index(_aux_json(unit.path.parent / "stack.json", res, "ingested without call stacks"))
    return construct if isinstance(construct, dict) else {}, stack_ids, stacks


# A statistics dump with this many records is turned into rows by `cores` processes at once when the run has fewer
# units than cores (the other cores would idle): forked children inherit the parsed JSON, nothing is pickled to them.
_SPLIT_MIN_RECORDS = 4096
# A dump.json this large is cut as text (dumpstore/jsonsplit.py) and each of `cores` processes parses its part and
# builds its rows: no process parses the whole file, and no child touches (and so copies) the parent's objects.
_SPLIT_MIN_BYTES = 2 << 20


@dataclass
class _Slices:
    records: list[tuple[Any, Any]]
    construct: dict
    stack_ids: dict[str, int]
    tensor_task: bool
    unit: Unit
    opts: IngestOptions
    constants: dict[str, str | None]

    def table(self, part: int, parts: int) -> tuple[pa.Table | None, UnitResult]:
        """Rows of the part-th of `parts` equal runs of records (leaf numbers from 0: the caller shifts them)."""
        lo, hi = len(self.records) * part // parts, len(self.records) * (part + 1) // parts
        res = UnitResult(self.unit.step, self.unit.rank)
        batches = _record_batches(self.records[lo:hi], lo, self.construct, self.stack_ids, res)
        rows = _with_tensor_files(
            (_leaf_batch(b, self.tensor_task, res) for b in batches), self.unit, self.opts, res, None
        )
        tables = [_batch_table(b, self.constants, res) for b in rows]
        return (pa.concat_tables(tables) if tables else None), res


def _split_tables(job: _Slices, cores: int, res: UnitResult) -> list[pa.Table]:
    """The dump's tables built by `cores` processes: this one takes the first run of records, forked children the
    others."""
    return _joined(
        _in_parts(lambda: job.table(0, cores), [functools.partial(job.table, p, cores) for p in range(1, cores)]), res
    )


class _NotCut(Exception):
    """The first part of a dump's text is not what jsonsplit requires: the dump is parsed whole."""


def _text_split(
    raw: bytes, cores: int, unit: Unit, opts: IngestOptions, res: UnitResult, constants: dict[str, str | None]
) -> tuple[list[pa.Table], list[list[str]]] | None:
    """The dump's tables and stacks built by `cores` processes that each parse one part of its text (jsonsplit);
    None where the text does not cut so (then it is parsed whole)."""
    cut = jsonsplit.cuts(raw, cores)
    pre = None if cut is None else _parsed(jsonsplit.preamble(raw, cut))
    if cut is None or not isinstance(pre, dict) or (_tensor_task(pre) and opts.load_tensors):
        return None
    job = _TextParts(raw, cut, _tensor_task(pre), unit, opts, constants)
    got: dict[str, Any] = {}

    def first() -> tuple[pa.Table | None, tuple[UnitResult | None, list, str | None]]:
        built = job.built(0, res)
        if built is None:
            raise _NotCut
        got["doc"], records, got["stacks"], table, part_res = built
        _set_meta(res, got["doc"])
        return table, (part_res, list(records), None)

    try:
        parts = _in_parts(first, [functools.partial(job.child, i) for i in range(1, cut.parts)])
    except _NotCut:
        return None
    if any(part_res is None for _, (part_res, _, _) in parts):
        return None  # a later part does not parse as required
    names = [name for _, (_, keys, _) in parts for name in keys]
    if len(set(names)) != len(names):
        return None  # a record name in two parts: the whole text merges them
    retain(got["doc"])
    found = next((framework for _, (_, _, framework) in parts if framework), None)
    if "framework" not in res.meta and found:  # none in the first part: a later part's first framework-typed value
        res.meta["framework"] = found
    return _joined([(table, part_res) for table, (part_res, _, _) in parts], res, shift_seq=True), got["stacks"]


@dataclass
class _TextParts:
    """A dump's text cut by jsonsplit, and what the rows of each part need."""

    raw: bytes
    cut: jsonsplit.Cuts
    tensor_task: bool
    unit: Unit
    opts: IngestOptions
    constants: dict[str, str | None]

    def built(self, i: int, res: UnitResult) -> tuple[Any, dict, list[list[str]], pa.Table | None, UnitResult] | None:
        """Part `i` parsed and built: (its document, its records, the stacks, its rows, their counts); None where it
        does not parse as jsonsplit requires. construct.json's and stack.json's warnings go to `res`."""
        doc = _parsed(jsonsplit.part(self.raw, self.cut, i))
        records = jsonsplit.records_of(doc, i)
        if records is None:
            return None
        construct, stack_ids, stacks = _aux_files(self.unit, res)
        job = _Slices(
            list(records.items()), construct, stack_ids, self.tensor_task, self.unit, self.opts, self.constants
        )
        return (doc, records, stacks, *job.table(0, 1))

    def child(self, i: int) -> tuple[pa.Table | None, tuple[UnitResult | None, list, str | None]]:
        """Part `i` built in a forked child: (rows, (counts, the records' names, the framework of its first
        framework-typed value)); (None, (None, [], None)) where the part does not parse as required."""
        # construct.json's and stack.json's warnings are the parent's to give: this part's go to a throwaway result
        built = self.built(i, UnitResult(self.unit.step, self.unit.rank))
        if built is None:
            return None, (None, [], None)
        doc, records, _, table, part_res = built
        return table, (part_res, list(records), detect_framework(doc))


def _parsed(text: bytes) -> Any:
    """`text` parsed by ujson alone (as parse_json would, were ujson to accept the whole file), or None."""
    try:
        return ujson.loads(text)
    except (ujson.JSONDecodeError, ValueError, OverflowError, TypeError, RecursionError):
        return None


def _joined(
    parts: list[tuple[pa.Table | None, UnitResult]], res: UnitResult, shift_seq: bool = False
) -> list[pa.Table]:
    """The parts' tables with leaf numbers (and record numbers, `shift_seq`) counted on from the parts before;
    their counts added to `res`."""
    tables = []
    for table, part_res in parts:
        if table is not None:
            table = _plus(table, "leaf", res.rows)
            tables.append(_plus(table, "seq", res.records) if shift_seq else table)
        _merge(res, part_res)
    return tables


def _plus(table: pa.Table, column: str, n: int) -> pa.Table:
    """`table` with n added to an int32 column without nulls (from its buffers: to_numpy's first call costs 20 ms
    of set-up)."""
    if not n:
        return table
    i = TENSOR_SCHEMA.get_field_index(column)
    chunks = []
    for chunk in table.column(i).chunks:
        values = np.frombuffer(chunk.buffers()[1], np.int32, len(chunk), chunk.offset * 4)
        chunks.append(to_arrow(values + np.int32(n), pa.int32()))
    return table.set_column(i, TENSOR_SCHEMA.field(i), pa.chunked_array(chunks, pa.int32()))


def _in_parts(
    first: Callable[[], tuple[pa.Table | None, Any]], others: Sequence[Callable[[], tuple[pa.Table | None, Any]]]
) -> list:
    """[first(), *(o() for o in others)], each of `others` run in a forked child at once while this process runs
    `first` (a child hands its part back through a pipe and leaves at once: no interpreter shutdown over its copy
    of the parent's objects).  Run before the Parquet file is opened, so no child holds it; the children are reaped
    whatever happens."""
    children = deque(_forked(build) for build in others)
    try:
        parts = [first()]
        while children:
            parts.append(_part_of(*children.popleft()))  # waits for the child whatever happens
    except BaseException:
        for pid, fd in children:  # a child blocked on a full pipe would wait for ever
            _reap(pid, fd)
        raise
    return parts


def _forked(build: Callable[[], tuple[pa.Table | None, Any]]) -> tuple[int, int]:
    """Fork a child that runs `build` and writes its result to a pipe (see _send): (pid, read end)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    code = 1  # the child: never returns
    try:
        os.close(read)
        worker_init(os.getppid())
        with os.fdopen(write, "wb") as fh:
            _send(fh, build)
        code = 0
    finally:
        os._exit(code)


def _send(fh: Any, build: Callable[[], tuple[pa.Table | None, Any]]) -> None:
    """A part as: 8-byte length of a pickled (ok, value or exception), that pickle, then the rows as an Arrow IPC
    stream (half the bytes of a pickled table, and read without a copy)."""
    import pickle

    import pyarrow.ipc as ipc

    try:
        table, value = build()
        header = pickle.dumps((True, value))
    except BaseException as exc:  # handed to the parent, which raises it
        table, header = None, pickle.dumps((False, exc if _picklable(exc) else RuntimeError(f"{exc!r}")))
    fh.write(len(header).to_bytes(8, "little") + header)
    if table is not None:
        with ipc.new_stream(fh, table.schema) as out:
            out.write_table(table)


def _picklable(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True


def _reap(pid: int, fd: int) -> None:
    import signal

    for step in (lambda: os.close(fd), lambda: os.kill(pid, signal.SIGKILL), lambda: os.waitpid(pid, 0)):
        try:
            step()
        except OSError:  # already closed, or already reaped by _part_of
            pass


def _part_of(pid: int, fd: int) -> tuple[pa.Table | None, UnitResult]:
    """What the child `pid` built (its exception raised here)."""
    import pickle

    import pyarrow.ipc as ipc

    try:
        with os.fdopen(fd, "rb") as fh:
            payload = fh.read()
    finally:  # (a child whose pipe is closed unread gets EPIPE and leaves)
        _, status = os.waitpid(pid, 0)
    n = int.from_bytes(payload[:8], "little")
    if status or len(payload) < 8 + n:
        raise StoreError(f"an ingest worker ended without its rows (wait status {status}); run the ingest again")
    ok, value = pickle.loads(payload[8 : 8 + n])
    if not ok:
        raise value
    rows = memoryview(payload)[8 + n :]
    return (ipc.open_stream(pa.py_buffer(rows)).read_all() if len(rows) else None), value


def _merge(res: UnitResult, part: UnitResult) -> None:
    """Add a part's counts to the unit's (its first error only if the unit has none yet)."""
    res.records += part.records
    res.rows += part.rows
    res.tensors += part.tensors
    res.errors += part.errors
    res.first_error = res.first_error or part.first_error
    res.meta.update({k: v for k, v in part.meta.items() if k in ("checksum", "generation")})


def _stack_index(doc: Any) -> tuple[dict[str, int], list[list[str]]]:
    ids: dict[str, int] = {}
    stacks: list[list[str]] = []
    if not isinstance(doc, dict):
        return ids, stacks
    for key, value in doc.items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list) and isinstance(value[1], list):
            names, frames = value  # 8.3.3 / 26.x: {"0": [[record keys], [frames]]}
        else:
            names, frames = [key], value if isinstance(value, list) else []  # 1.x: {record: [frames]}
        stacks.append([str(f) for f in frames])
        for n in names:
            ids[str(n)] = len(stacks) - 1
    return ids, stacks


def _parent(construct: dict, key: str) -> str | None:
    parent = construct.get(key)
    if isinstance(parent, list):
        parent = parent[0] if parent else None
    return parent if isinstance(parent, str) else None


@dataclass
class _Records:
    """A batch of whole records: one row of record columns per record, and its leaves (io, index, name, value)."""

    first_leaf: int
    idents: list[tuple] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    leaves: list[tuple[str, str, str, Any]] = field(default_factory=list)


def _record_batches(
    records: list[tuple[Any, Any]], first_seq: int, construct: dict, stack_ids: dict[str, int], res: UnitResult
) -> Iterator[_Records]:
    """The records (numbered from first_seq) with at least one leaf, in batches of about _BATCH_ROWS leaves."""
    batch = _Records(0)
    for seq, (key, record) in enumerate(records, first_seq):
        res.records += 1
        key = str(key)
        rn = parse_record(key)
        leaves = record_leaves(key, record, rn.direction)
        if not leaves:
            continue
        recompute = record.get("is_recompute") if isinstance(record, dict) else None
        batch.idents.append(
            (
                seq,
                key,
                rn.prefix,
                rn.api,
                rn.op_type,
                _int32(rn.call),
                rn.direction,
                _parent(construct, key),
                recompute if isinstance(recompute, bool) else None,
                stack_ids.get(key),
            )
        )
        batch.counts.append(len(leaves))
        batch.leaves.extend(leaves)
        if len(batch.leaves) >= _BATCH_ROWS:
            yield batch
            batch = _Records(batch.first_leaf + len(batch.leaves))
    if batch.leaves:
        yield batch


def _leaf_batch(recs: _Records, tensor_task: bool, res: UnitResult) -> Batch:
    """The columns of a batch of records' leaves, from the dump alone (see _with_tensor_files)."""
    ios, index_paths, names, values = (list(c) for c in zip(*recs.leaves))
    cols: Batch = leaf_column_lists(values, tensor_task)
    cols.update({c: [None] * len(values) for c in TENSOR_FILE_COLUMNS})  # set by _with_tensor_files
    cols.update(io=ios, index_path=index_paths, name=names)
    cols["leaf"] = to_arrow(np.arange(recs.first_leaf, recs.first_leaf + len(values)), pa.int32())
    for c, per_record in zip(_RECORD_COLUMNS, zip(*recs.idents)):  # np.repeat: Arrow's take loads pyarrow.compute
        repeated = np.repeat(np.array(per_record, dtype=object), recs.counts).tolist()  # a list: see dumpstore.arrays
        cols[c] = _array(repeated, TENSOR_SCHEMA.field(c).type)
    if any(r[8] is not None or (r[6] == "parameters_grad" and r[5] is None) for r in recs.idents):
        res.meta["generation"] = "8.x"  # is_recompute, or gradients without a call number
    return cols


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


def _file_batches(unit: Unit, opts: IngestOptions, res: UnitResult):
    """The batches of a folder of plain tensor files."""
    rows = _file_rows(unit, opts, res)
    while batch := list(islice(rows, _BATCH_ROWS)):
        yield {c: [r.get(c) for r in batch] for c in ROW_COLUMNS + TENSOR_FILE_COLUMNS}


def _graph_batches(unit: Unit, opts: IngestOptions, res: UnitResult) -> tuple[Iterator[Batch], list[list[str]]]:
    """The batches of one iteration of a MindSpore graph dump (dumpstore.msgraph) and its source lines."""
    rows, stacks, res.meta = msgraph.rows(unit.path, unit.step)

    def loaded() -> Iterator[dict[str, Any]]:
        seen = set()
        for row in rows:
            if row["seq"] not in seen:
                seen.add(row["seq"])
                res.records += 1
            path = row.pop("path")
            if path is None:
                row["file_status"] = "none"
                row.setdefault("stats_source", "none")
                yield row
                continue
            res.files += 1
            if not opts.load_tensors:
                row.update(file_status="none", stats_source="none")
                yield row
                continue
            _read_file(row, path, opts, res, named_dtype=True)
            yield row

    def batches() -> Iterator[Batch]:
        it = loaded()
        while batch := list(islice(it, _BATCH_ROWS)):
            yield {c: [r.get(c) for r in batch] for c in ROW_COLUMNS + TENSOR_FILE_COLUMNS}

    return batches(), stacks


# MindSpore saves bf16 tensors as float32 and int4 as int8: the name's dtype is kept
_SAVED_AS = {"float32": ("bfloat16",), "int8": ("Int4", "int4")}


def _int32(value: int | None) -> int | None:
    """A call counter for the int32 column; None when it does not fit (the record key keeps the digits)."""
    return value if value is not None and value <= _INT32_MAX else None


def _count(columns: Batch, res: UnitResult) -> None:
    """Count a batch's rows, tensors and errors into `res` (and make its errors one line)."""
    kinds, errors = columns["kind"], columns["error"]
    res.rows += len(kinds)
    res.tensors += kinds.count("tensor")
    if any(columns["checksum_kind"]):
        res.meta["checksum"] = next(k for k in reversed(columns["checksum_kind"]) if k)
    if any(errors):
        errors = columns["error"] = [one_line(e) if e else e for e in errors]
        res.errors += sum(1 for e in errors if e)
        if res.first_error is None:
            first = next(i for i, e in enumerate(errors) if e)
            res.first_error = f"{columns['name'][first]}: {errors[first]}"


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


def _max_bytes(numel: int | None) -> int | None:
    """Cap on what a .pt file may expand to: a file that matches dump.json's shape needs at most 16 bytes an
    element (complex128); the cap keeps a tiny file that claims gigabytes (stride 0) from being expanded."""
    return None if numel is None else max(min(16 * numel, _pt_max_bytes()), _MIN_FILE_CAP)


@functools.cache
def _pt_max_bytes() -> int:
    from .ptfile import DEFAULT_MAX_BYTES  # here: a statistics ingest needs no .pt reader (zipfile & co: ~7 ms)

    return DEFAULT_MAX_BYTES


def _mismatch(shape: list[int] | None, dtype: str | None, arr, stored: str) -> str | None:
    if shape is not None and list(arr.shape) != list(shape):
        return f"tensor file has shape {list(arr.shape)} but dump.json says {shape}"
    # MindSpore saves bf16 as float32 .npy while dump.json says BFloat16
    if dtype and stored != dtype and not (dtype == "bfloat16" and stored == "float32"):
        if dtype in ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"):
            return f"tensor file has dtype {stored} but dump.json says {dtype}"
    return None


def _file_rows(unit: Unit, opts: IngestOptions, res: UnitResult):
    # links and other non-folders with a tensor suffix become error rows, not silent gaps
    files = sorted(
        p for p in unit.path.iterdir() if p.suffix.lower() in (".pt", ".npy") and (p.is_symlink() or not p.is_dir())
    )
    for seq, path in enumerate(files):
        res.files += 1
        res.records += 1
        row: dict[str, Any] = {
            "seq": seq,
            "leaf": seq,
            "record": path.stem,
            "prefix": "file",
            "api": path.stem,
            "op_type": path.stem,
            "direction": "tensor",
            "io": "tensor",
            "index_path": "",
            "name": path.stem,
            "kind": "tensor",
            "data_name": path.name,
            "value_type": path.suffix.lstrip("."),
        }
        _read_file(row, path, opts, res)
        yield row


def _read_file(
    row: dict[str, Any], path: Path, opts: IngestOptions, res: UnitResult, named_dtype: bool = False
) -> None:
    """Load one plain tensor file into its row (an error row when it cannot be read).  `named_dtype`: keep the
    row's dtype where the file stores it in a wider type (MindSpore: bf16 as float32, int4 as int8)."""
    try:
        if path.is_symlink():
            raise DumpFormatError(f"{path}: tensor file is a link; refusing to read it (copy the file instead)")
        file_stamp = stamp(path)
        arr, stored = load(path)
        res.tensor_files += 1
        dtype = row.get("dtype") if named_dtype and row.get("dtype") in _SAVED_AS.get(stored, ()) else stored
        raw = (row.get("dtype_raw") or stored) if named_dtype else stored
        row.update(dtype=dtype, dtype_raw=raw, shape=list(arr.shape), numel=int(arr.size))
        _fill_loaded(row, arr, stored, file_stamp, opts)
    except OSError as exc:  # the stat: gone since the folder was listed
        why = f"{path}: cannot read tensor file: {exc.strerror}"
        row.update(file_status="error", error=why, stats_source="none")
    except DumpFormatError as exc:
        row.update(file_status="error", error=str(exc), stats_source="none")


def _combine(run: str, ingest_id: str, results: list[UnitResult]) -> IngestResult:
    first = next((r.first_error for r in results if r.first_error), None)
    return IngestResult(
        run,
        ingest_id,
        len(results),
        sum(r.records for r in results),
        sum(r.rows for r in results),
        sum(r.tensors for r in results),
        sum(r.tensor_files for r in results),
        sum(r.errors for r in results),
        first,
        sorted({r.step for r in results}),
        sorted({r.rank for r in results}),
    )


def _catalog_row(
    run: str,
    ingest_id: str,
    path,
    units: list[Unit],
    results: list[UnitResult],
    total: IngestResult,
    opts: IngestOptions,
) -> dict[str, Any]:
    from datetime import datetime, timezone

    from . import __version__
    from .schema import SCHEMA_VERSION

    metas = [r.meta for r in results if r.meta]

    def joined(key: str, default: str) -> str:
        vals = sorted({utf8(str(m[key])) for m in metas if m.get(key)})
        return ",".join(vals) if vals else default

    task = joined("task", "files" if all(u.kind == "files" for u in units) else "")
    return {
        "run": run,
        "ingest_id": ingest_id,
        "schema_version": SCHEMA_VERSION,
        "source_path": utf8(str(Path(path).resolve())),
        "framework": joined("framework", "files"),
        "task": task,
        "level": joined("level", ""),
        "dump_mode": _dump_mode(task, metas),
        "generation": _generation(metas),
        "steps": total.steps,
        "ranks": total.ranks,
        "n_files": sum(r.files for r in results) + total.tensor_files,
        "n_records": total.records,
        "n_rows": total.rows,
        "n_tensors": total.tensors,
        "n_tensor_files": total.tensor_files,
        "n_errors": total.errors,
        "sample_k": opts.sample_k,
        "sketch_m": opts.sketch_m,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dumpstore_version": __version__,
    }


def _dump_mode(task: str, metas: list[dict[str, Any]]) -> str:
    """msprobe's compare mode: tensor, md5 (CRC-32), xor, statistics; 'files' for plain tensor folders."""
    if task in ("files", "tensor"):
        return task
    kinds = {m["checksum"] for m in metas if m.get("checksum")}
    if kinds:
        return "md5" if kinds == {"crc32"} else ",".join(sorted(kinds))
    return "statistics" if task else ""


def _generation(metas: list[dict[str, Any]]) -> str:
    if not any(m.get("task") for m in metas):
        return ""
    return "8.x" if any(m.get("generation") == "8.x" for m in metas) else "26.x"


def upgrade(
    store: str | os.PathLike | None = None,
    *,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[IngestResult]:
    """Re-ingest every run of a store written by an older schema from the dump folder it came from."""
    from .schema import SCHEMA_VERSION

    st = open_store(store)
    old = [r for r in st.raw_runs() if r.get("schema_version") != SCHEMA_VERSION]
    missing = [r["run"] for r in old if not Path(str(r.get("source_path"))).exists()]
    if missing:
        raise StoreError(
            f"{st.root}: cannot upgrade runs {', '.join(missing)}: their dump folders are gone; "
            "ingest them again from a copy into a new store"
        )
    keep = [r for r in st.raw_runs() if r.get("schema_version") == SCHEMA_VERSION]
    st.rewrite_catalog(keep)
    return [
        ingest(
            r["source_path"],
            r["run"],
            store=st.root,
            jobs=jobs,
            progress=progress,
            options=IngestOptions(
                sample_k=r.get("sample_k") or summary.DEFAULT_SAMPLE_K,
                sketch_m=r.get("sketch_m") or summary.DEFAULT_SKETCH_M,
            ),
        )
        for r in old
    ]

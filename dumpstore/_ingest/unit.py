"""One ingest unit (a dump.json, or a folder of tensor files, of one step and rank) into its Parquet part file:
the code the local pool and the Ray engine's tasks both run."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

from .. import parquetio
from .. import retain as _retained
from ..layout import Unit
from ..retain import retain
from ..schema import TENSOR_SCHEMA
from ..store import staging_dir
from ..tensorfile import (
    TENSOR_DIR,
    forget_folders,
)
from .batches import _file_batches, _leaf_batch, _record_batches
from .dumpjson import _open_dump, _read_bytes, _tensor_task
from .model import IngestOptions, UnitResult
from .pool import _LazyPool
from .split import _Slices, _split_tables, _text_split
from .tensors import _with_tensor_files
from .writer import _DICTIONARY_COLUMNS, _SPLIT_FLOATS, _ZSTD_LEVEL, _batch_table, _RowGroups, _write_stacks

# A statistics dump with this many records is turned into rows by `cores` processes at once when the run has fewer
# units than cores (the other cores would idle): forked children inherit the parsed JSON, nothing is pickled to them.
_SPLIT_MIN_RECORDS = 4096
# A dump.json this large is cut as text (dumpstore/jsonsplit.py) and each of `cores` processes parses its part and
# builds its rows: no process parses the whole file, and no child touches (and so copies) the parent's objects.
_SPLIT_MIN_BYTES = 2 << 20


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
    else:
        stacks = []  # filled as the rows are made (a reader's source lines), written after them
        batches = _file_batches(unit, opts, res, stacks)
        tables = (_batch_table(b, constants, res) for b in batches)
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

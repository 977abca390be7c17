"""Records into batches of leaf rows: a dump.json's records (parsed names, module parents, stacks), and the files of
a plain tensor folder."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import pyarrow as pa

from .. import readers
from ..arrays import to_arrow
from ..layout import Unit
from ..names import parse_record
from ..records import leaf_column_lists, record_leaves
from ..schema import TENSOR_FILE_COLUMNS, TENSOR_SCHEMA
from ..tensorfile import (
    load,
)
from .dumpjson import _parent
from .model import _RECORD_COLUMNS, ROW_COLUMNS, Batch, IngestOptions, UnitResult, _int32
from .tensors import load_file_into
from .writer import _array

_BATCH_ROWS = 4096  # rows turned into Arrow at a time


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


def _file_batches(unit: Unit, opts: IngestOptions, res: UnitResult, stacks: list[list[str]] | None = None):
    """The batches of a folder of plain tensor files, or of a unit whose reader makes its own rows (the call stacks
    its rows point at go into `stacks`)."""
    if unit.kind == "files":
        rows = _file_rows(unit, opts, res)
    else:
        reader = readers.reader(unit.kind)
        if getattr(reader, "ROWS_OPTIONS", False):
            rows = reader.rows(unit, res, opts, [] if stacks is None else stacks)
        else:
            rows = reader.rows(unit, res)
    while batch := list(islice(rows, _BATCH_ROWS)):
        yield {c: [r.get(c) for r in batch] for c in ROW_COLUMNS + TENSOR_FILE_COLUMNS}


def _file_rows(unit: Unit, opts: IngestOptions, res: UnitResult):
    # links and other non-folders with a tensor suffix become error rows, not silent gaps
    suffixes = readers.tensor_suffixes()
    files = sorted(
        p for p in unit.path.iterdir() if p.suffix.lower() in suffixes and (p.is_symlink() or not p.is_dir())
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
        load_file_into(row, path, load, opts, res)
        yield row

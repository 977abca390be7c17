"""Batches of rows into Parquet: Arrow arrays in the store's schema, row groups, encodings, the stacks file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .. import parquetio
from ..arrays import to_arrow
from ..layout import Unit
from ..schema import STACK_SCHEMA, TENSOR_SCHEMA
from ..store import staging_dir
from .model import Batch, UnitResult, _count, utf8

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


_LIST_COLUMNS = ("sample", "sketch")  # float lists: numpy arrays or Python lists per row


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

"""One large dump.json turned into rows by several processes: its records in equal runs (forked children share
the parsed JSON), or its text cut by jsonsplit (each child parses its own part)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .. import jsonsplit
from ..arrays import to_arrow
from ..dupkeys import record_lines
from ..framework import detect_framework
from ..layout import Unit
from ..retain import retain
from ..schema import TENSOR_SCHEMA
from .batches import _leaf_batch, _record_batches
from .dumpjson import _aux_files, _parsed, _set_meta, _tensor_task
from .forks import _in_parts
from .model import IngestOptions, UnitResult, _merge
from .tensors import _with_tensor_files
from .writer import _batch_table


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
    if len(set(names)) != len(names) or record_lines(job.raw) != len(names):
        return None  # a record name twice (in two parts, or in one): the whole text merges them, and says so
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

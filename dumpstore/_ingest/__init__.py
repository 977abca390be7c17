"""Ingest: a dump tree into the store's Parquet files.

    driver    ingest(): units found, run by a local pool or on Ray, the run published atomically (upgrade:
              dumpstore/upgrade.py)
    unit      one (step, rank) unit into its part file: the code both engines run
    dumpjson  dump.json / debug.json, construct.json, stack.json read (size limit, one-line errors)
    batches   records (or a plain tensor folder's files) into batches of leaf rows
    tensors   tensor files read in chunks and summarised into their leaves' columns
    pool      the process pool that reads tensor files
    split     one large dump.json built by several processes (records in runs, or its text cut)
    forks     forked children that hand their part back through a pipe
    writer    batches into Parquet (schema, row groups, encodings) and the stacks file
    catalog   the run's catalog row and totals
    model     options, results and the row columns

The package is named `_ingest` (private) so that `dumpstore.ingest` stays the function.
"""

from __future__ import annotations

from .driver import ingest
from .dumpjson import MAX_DUMP_JSON_BYTES, parse_json, read_json
from .model import ROW_COLUMNS, IngestOptions, IngestResult, UnitResult, one_line, utf8

__all__ = [
    "MAX_DUMP_JSON_BYTES",
    "ROW_COLUMNS",
    "IngestOptions",
    "IngestResult",
    "UnitResult",
    "ingest",
    "one_line",
    "parse_json",
    "read_json",
    "utf8",
]

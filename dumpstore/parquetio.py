"""Local Parquet files through pyarrow's reader and writer classes (`pyarrow._parquet`).

`pyarrow.parquet` wraps them in a filesystem layer (`pyarrow.fs`, which loads ssl and more: ~28 ms of every
command that imports it) that files on a local path do not need.  The writer gets the settings
`pyarrow.parquet.ParquetWriter` gives it by default (format 2.6, statistics, data page 1.0, the Arrow schema
stored), so the files are those `pyarrow.parquet` writes.  `analysis/screen.py` reads through the same classes.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
from pyarrow._parquet import ParquetReader, ParquetWriter

_DEFAULTS = {"version": "2.6", "write_statistics": True, "writer_engine_version": "V2", "data_page_version": "1.0"}


def read_table(path: str | os.PathLike, read_dictionary: list[str] | None = None) -> pa.Table:
    """The whole file as a table (`pyarrow.parquet.ParquetFile(path, read_dictionary=...).read()`)."""
    reader = ParquetReader()
    reader.open(os.fspath(path), read_dictionary=read_dictionary)
    return reader.read_all()


def read_columns(path: str | os.PathLike, names: list[str], read_dictionary: list[str] | None = None) -> pa.Table:
    """The named top-level columns of a file, nested ones whole, in the file's order, read on this thread
    (`pyarrow.parquet.read_table(path, columns=names, use_threads=False, read_dictionary=...)`)."""
    return Reader(path, read_dictionary).read(names)


class Reader:
    """An open file read by columns, whole or a row group at a time (`pyarrow.parquet.ParquetFile`'s `read` and
    `read_row_group` with `columns=names, use_threads=False`)."""

    def __init__(self, path: str | os.PathLike, read_dictionary: list[str] | None = None):
        self.reader = ParquetReader()
        self.reader.open(os.fspath(path), read_dictionary=read_dictionary)
        self.num_rows: int = self.reader.metadata.num_rows
        self.num_row_groups: int = self.reader.num_row_groups
        self.columns: list[str] = self.reader.schema_arrow.names  # the top-level columns

    def read(self, names: list[str], row_group: int | None = None) -> pa.Table:
        """The named top-level columns (nested ones whole), in the file's order: all rows, or one row group's."""
        schema = self.reader.metadata.schema
        wanted = set(names)
        leaves = [i for i in range(len(schema)) if schema.column(i).path.split(".")[0] in wanted]
        if row_group is None:
            return self.reader.read_all(column_indices=leaves, use_threads=False)
        return self.reader.read_row_group(row_group, column_indices=leaves, use_threads=False)


class Writer:
    """`pyarrow.parquet.ParquetWriter(path, schema, **options)` for a local path: write_table, close, `with`."""

    def __init__(self, path: str | os.PathLike, schema: pa.Schema, **options: Any):
        self.writer = ParquetWriter(os.fspath(path), schema, **{**_DEFAULTS, **options})

    def write_table(self, table: pa.Table, row_group_size: int | None = None) -> None:
        self.writer.write_table(table, row_group_size=row_group_size)

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_table(table: pa.Table, path: str | os.PathLike, **options: Any) -> None:
    """`pyarrow.parquet.write_table(table, path, **options)` for a local path (its default compression: snappy)."""
    with Writer(path, table.schema, **{"compression": "snappy", **options}) as out:
        out.write_table(table)

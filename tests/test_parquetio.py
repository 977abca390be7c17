"""dumpstore.parquetio writes the bytes pyarrow.parquet writes, and reads what it reads."""

import pyarrow as pa
import pyarrow.parquet as pq

from dumpstore import parquetio
from dumpstore.schema import RUN_SCHEMA, TENSOR_SCHEMA


def _table() -> pa.Table:
    rows = [
        {"seq": i, "leaf": i, "record": f"Functional.linear.{i % 3}.forward", "max": float(i) / 3, "shape": [i, 2]}
        for i in range(50)
    ]
    rows[7]["max"] = float("nan")
    return pa.Table.from_pylist(rows, TENSOR_SCHEMA)


def test_writer_files_are_those_of_pyarrow_parquet(tmp_path):
    table = _table()
    options = {"compression": "zstd", "compression_level": 3, "use_dictionary": ["record"]}
    with pq.ParquetWriter(tmp_path / "a.parquet", TENSOR_SCHEMA, **options) as w:
        w.write_table(table, row_group_size=20)
    with parquetio.Writer(tmp_path / "b.parquet", TENSOR_SCHEMA, **options) as w:
        w.write_table(table, row_group_size=20)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert pq.ParquetFile(tmp_path / "b.parquet").metadata.num_row_groups == 3


def test_write_table_and_read_table_as_pyarrow_parquet(tmp_path):
    table = pa.Table.from_pylist([{"run": "ref", "steps": [0, 1], "n_rows": 3}], RUN_SCHEMA)
    pq.write_table(table, tmp_path / "a.parquet")
    parquetio.write_table(table, tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    got = parquetio.read_table(tmp_path / "b.parquet")
    assert got.equals(pq.ParquetFile(tmp_path / "b.parquet").read()) and got.schema.equals(RUN_SCHEMA)


def test_read_columns_as_pyarrow_parquet_nested_whole(tmp_path):
    rows = [{"seq": i, "sample": None if i % 4 == 0 else [i / 7, -0.0, float("nan")][: i % 3 + 1]} for i in range(30)]
    rows[5]["sketch"] = [1.5, float("inf")]
    parquetio.write_table(pa.Table.from_pylist(rows, TENSOR_SCHEMA), tmp_path / "a.parquet")
    for names in (["sample"], ["sketch", "seq"], ["sample", "sketch"]):
        got = parquetio.read_columns(tmp_path / "a.parquet", names)
        want = pq.read_table(tmp_path / "a.parquet", columns=[c for c in TENSOR_SCHEMA.names if c in names])
        assert got.schema.equals(want.schema) and repr(got.to_pylist()) == repr(want.to_pylist())  # NaN: by text

"""How the ingest lays rows out: leaf columns by name, row groups bounded by rows, the collector left as found."""

from __future__ import annotations

import gc
import importlib
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dumpstore._ingest import ingest
from dumpstore.errors import DumpFormatError
from dumpstore.names import parse_record
from dumpstore.records import LEAF_COLUMNS, leaf_column_lists, leaf_columns, record_leaves
from helpers import MSPROBE, SAMPLES, child_processes

batches = importlib.import_module(
    "dumpstore._ingest.batches"
)  # modules of the package (dumpstore.ingest: the function)
split = importlib.import_module("dumpstore._ingest.split")
unit = importlib.import_module("dumpstore._ingest.unit")
writer = importlib.import_module("dumpstore._ingest.writer")


def _described(leaf) -> dict:
    values = leaf_columns(leaf)
    assert len(values) == len(LEAF_COLUMNS)
    return {k: v for k, v in zip(LEAF_COLUMNS, values) if v is not None}


def test_tensor_leaf_columns_by_name():
    leaf = {
        "type": "torch.Tensor",
        "dtype": "torch.bfloat16",
        "shape": [2, 3],
        "Max": 3.5e38,
        "Min": -math.inf,
        "Mean": 1,
        "Norm": None,
        "requires_grad": True,
        "data_name": "x.pt",
        "md5": "0x1f",
    }
    assert _described(leaf) == {
        "kind": "tensor",
        "value_type": "torch.Tensor",
        "dtype": "bfloat16",
        "dtype_raw": "torch.bfloat16",
        "shape": [2, 3],
        "numel": 6,
        "requires_grad": True,
        "min": -math.inf,
        "max": 3.5e38,
        "mean": 1.0,
        "stats_source": "dump",
        "has_nan": False,
        "has_posinf": False,
        "has_neginf": True,
        "has_sat": True,
        "dump_max": 3.5e38,
        "dump_min": -math.inf,
        "dump_mean": 1.0,
        "checksum": "0x1f",
        "checksum_kind": "xor",
        "data_name": "x.pt",
        "file_status": "none",
    }


def test_scalar_null_and_bad_shape_leaf_columns_by_name():
    assert _described({"type": "float", "value": -math.inf}) == {
        "kind": "scalar",
        "value_type": "float",
        "value": "-Infinity",
        "scalar_value": -math.inf,
        "stats_source": "none",
        "file_status": "none",
    }
    assert _described({"type": "slice", "value": [1, None]})["value"] == "[1, null]"
    assert _described(None) == {"kind": "null", "stats_source": "none", "file_status": "none"}
    bad = _described({"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2, 1 << 62]})
    assert bad["error"].endswith("a dimension or the element count does not fit in int64")
    assert "shape" not in bad and "numel" not in bad
    assert _described({"type": "torch.Tensor", "dtype": "x", "shape": [0, 1 << 63]})["error"].startswith(
        "invalid shape"
    )
    assert _described({"type": "torch.Tensor", "dtype": "x", "shape": []})["numel"] == 1


def _part_files(store: Path) -> list[Path]:
    return sorted((store / "tensors").rglob("*.parquet"))


def test_row_groups_are_bounded_and_rows_unchanged(tmp_path, monkeypatch):
    ingest(MSPROBE / "v8_statistics", "r", store=tmp_path / "one", jobs=1)
    monkeypatch.setattr(batches, "_BATCH_ROWS", 7)
    monkeypatch.setattr(writer, "_GROUP_ROWS", 20)
    ingest(MSPROBE / "v8_statistics", "r", store=tmp_path / "many", jobs=1)
    [one], [many] = _part_files(tmp_path / "one"), _part_files(tmp_path / "many")
    meta = pq.ParquetFile(many).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    a, b = pq.read_table(one).drop(["ingest_id"]), pq.read_table(many).drop(["ingest_id"])
    widest = max(a.group_by("record").aggregate([("leaf", "count")])["leaf_count"].to_pylist())
    # a batch holds whole records: it closes at the first record that takes it to 7 rows or more
    assert len(sizes) > 1 and all(s < 20 + 7 + widest for s in sizes) and sum(sizes) == meta.num_rows
    assert pq.ParquetFile(one).metadata.num_row_groups == 1
    assert a.to_pylist() == b.to_pylist()


@pytest.mark.parametrize("enabled", [True, False])
def test_garbage_collector_left_as_found(tmp_path, enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        ingest(MSPROBE / "v8_statistics", "r", store=tmp_path, jobs=1)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


_ODD_LEAVES = [
    None,
    {"type": "int", "value": 3},
    {"type": "float", "value": -math.inf},
    {"dtype": "x", "shape": [1, -2]},
    {"dtype": ["a"], "shape": [2, 3], "Max": 1, "Min": True, "Mean": None, "Norm": 10**400},
    {"dtype": "torch.float16", "shape": [], "Max": 65504.0, "Min": -1.0, "data_name": ""},
    {"dtype": "torch.float16", "shape": [], "data_name": None},
    {"dtype": "torch.float16", "shape": [], "data_name": 5, "md5": "0xab"},
    {"dtype": "torch.bfloat16", "shape": [3], "md5": 17, "Max": math.nan, "Min": -math.inf, "type": 7},
    {"dtype": "torch.float32", "shape": [2], "Max": math.inf, "Min": 3.4028234663852886e38, "requires_grad": 1},
    {"type": {"a": 1}},
    {"shape": [1]},
    {"dtype": "torch.int64", "shape": [2, 1 << 62]},
]


@pytest.mark.parametrize("tensor_task", [True, False])
def test_leaf_column_lists_equal_leaf_columns_leaf_by_leaf(tensor_task):
    """The columnar builder of the ingest gives every leaf exactly the columns leaf_columns gives it."""
    leaves = list(_ODD_LEAVES)
    for name in ("overflow_stats", "ref_tensor", "saturation_stats"):
        doc = json.loads((SAMPLES / name / "step0" / "rank0" / "dump.json").read_text())
        for key, record in doc["data"].items():
            leaves += [leaf for *_, leaf in record_leaves(key, record, parse_record(key).direction)]
    leaves += _ODD_LEAVES
    cols = leaf_column_lists(leaves, tensor_task)
    assert sorted(cols) == sorted(LEAF_COLUMNS) and {len(v) for v in cols.values()} == {len(leaves)}
    for i, leaf in enumerate(leaves):
        got = tuple(cols[c][i] for c in LEAF_COLUMNS)
        assert got == leaf_columns(leaf, tensor_task), (i, leaf)


@pytest.mark.parametrize("name", ["ref_stats", "overflow_stats"])
def test_a_lone_statistics_dump_split_over_cores_gives_the_same_rows(tmp_path, monkeypatch, name):
    """A statistics dump built by forked workers (a run of one unit, two cores) equals the one-process build."""
    src = SAMPLES / name / "step0" / "rank0"
    one = ingest(src, "r", store=tmp_path / "one", jobs=1)
    monkeypatch.setattr(unit, "_SPLIT_MIN_RECORDS", 1)
    calls = []
    monkeypatch.setattr(split, "_merge", lambda res, part: calls.append(part) or merge(res, part))
    two = ingest(src, "r", store=tmp_path / "two", jobs=2)
    assert len(calls) == 2  # really split: one part here, one in a forked worker
    assert {k: v for k, v in vars(one).items() if k != "ingest_id"} == {
        k: v for k, v in vars(two).items() if k != "ingest_id"
    }
    [a], [b] = _part_files(tmp_path / "one"), _part_files(tmp_path / "two")
    rows_a, rows_b = (pq.read_table(f).drop(["ingest_id"]).to_pylist() for f in (a, b))
    assert repr(rows_a) == repr(rows_b)  # repr: NaN statistics compare equal
    assert pq.read_table(a)["leaf"].to_pylist() == list(range(one.rows))


merge = split._merge


@pytest.mark.parametrize("failing_part", [0, 1])
def test_a_failing_part_of_a_split_dump_fails_the_ingest_in_one_line(tmp_path, monkeypatch, failing_part):
    """An error in either process of a split build (this one or the forked child) is the ingest's error; nothing
    is published and no child is left behind."""
    monkeypatch.setattr(unit, "_SPLIT_MIN_RECORDS", 1)
    table = split._Slices.table

    def broken(self, part, parts):
        if part == failing_part:
            raise DumpFormatError(f"part {part} is broken")
        return table(self, part, parts)

    monkeypatch.setattr(split._Slices, "table", broken)
    before = child_processes()
    with pytest.raises(DumpFormatError, match=f"^part {failing_part} is broken$"):
        ingest(SAMPLES / "ref_stats" / "step0" / "rank0", "r", store=tmp_path / "s", jobs=2)
    assert not list((tmp_path / "s").rglob("part-*.parquet"))
    assert child_processes() == before  # the forked child was reaped (no zombie, no orphan)


def test_a_process_with_other_threads_is_not_forked(tmp_path, monkeypatch):
    """A library user's process with threads builds a lone dump in one process (no fork under held locks)."""
    import threading

    monkeypatch.setattr(unit, "_SPLIT_MIN_RECORDS", 1)
    monkeypatch.setattr(unit, "_split_tables", lambda *a: pytest.fail("forked with a thread running"))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        res = ingest(SAMPLES / "ref_stats" / "step0" / "rank0", "r", store=tmp_path / "s", jobs=2)
    finally:
        stop.set()
        other.join()
    assert res.rows > 0 and res.errors == 0


def test_samples_and_sketches_are_stored_byte_stream_split_and_read_alike(tmp_path):
    """The float lists use Parquet's BYTE_STREAM_SPLIT encoding; pyarrow, Polars and DuckDB read the same values."""
    import duckdb
    import polars as pl

    ingest(SAMPLES / "ref_tensor" / "step0" / "rank0", "r", store=tmp_path / "s", jobs=1)
    [path] = _part_files(tmp_path / "s")
    meta = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
    assert "BYTE_STREAM_SPLIT" in encodings["sample.list.element"]
    assert "BYTE_STREAM_SPLIT" in encodings["sketch.list.element"]
    assert "BYTE_STREAM_SPLIT" not in encodings["max"]
    table = pq.read_table(path, columns=["leaf", "sample", "sketch"])
    want = [(r["leaf"], r["sample"], r["sketch"]) for r in table.to_pylist()]
    got_pl = pl.read_parquet(path, columns=["leaf", "sample", "sketch"]).rows()
    got_duck = duckdb.sql(f"SELECT leaf, sample, sketch FROM '{path}' ORDER BY leaf").fetchall()
    assert any(s is not None for _, s, _ in want)
    assert repr(got_pl) == repr(want) and repr([tuple(r) for r in got_duck]) == repr(want)

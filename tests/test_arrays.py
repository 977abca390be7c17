"""dumpstore.arrays: numpy columns into Arrow and Polars, the same values as pyarrow's and Polars' own converters."""

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from dumpstore.arrays import table_to_polars, to_arrow, to_polars


@pytest.mark.parametrize(
    "values, type_",
    [
        (np.array([3, -1, 2**31 - 1], np.int64), pa.int32()),
        (np.array([0, 2**40, -5], np.int64), pa.int64()),
        (np.array([1.5, np.nan, -np.inf, 0.0]), pa.float64()),
        (np.array([True, False, True] * 5), pa.bool_()),  # 15 values: a partial last byte
        (np.array([], np.float64), pa.float64()),
    ],
)
def test_to_arrow_equals_pyarrow(values, type_):
    got, want = to_arrow(values, type_), pa.array(values, type_)
    assert got.type == want.type and got.null_count == want.null_count == 0
    assert repr(got.to_pylist()) == repr(want.to_pylist())  # NaN as NaN


def test_to_arrow_nulls():
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    nulls = np.array([False, True, False, False, False, False, False, False, True])
    got = to_arrow(values, pa.float64(), nulls)
    assert got.to_pylist() == [1.0, None, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, None]
    assert got.null_count == 2
    assert to_arrow(values, pa.float64(), np.zeros(9, bool)).null_count == 0


def test_to_arrow_list_of_floats():
    flat = to_arrow(np.array([1.0, 2.0, 3.0]), pa.float64())
    offsets = np.array([0, 2, 2, 2, 3])
    got = to_arrow(offsets, pa.list_(pa.float64()), np.array([False, True, False, False]), child=flat)
    assert got.to_pylist() == [[1.0, 2.0], None, [], [3.0]]
    assert got.type == pa.list_(pa.float64())


def test_to_polars_keeps_name_type_nan_and_nulls():
    values = np.array([0.5, np.nan, 2.0])
    s = to_polars("x", values)
    assert s.name == "x" and s.dtype == pl.Float64
    assert s.is_nan().to_list() == [False, True, False]
    masked = to_polars("y", values, nulls=np.isnan(values))
    assert masked.to_list() == [0.5, None, 2.0]
    flags = to_polars("f", np.array([True, False, True]))
    assert flags.dtype == pl.Boolean and flags.to_list() == [True, False, True]
    codes = to_polars("c", np.array([2, 0], np.uint32))
    assert codes.dtype == pl.UInt32 and codes.to_list() == [2, 0]


def test_table_to_polars_equals_from_arrow():
    table = pa.table(
        {
            "sketch": pa.array([[1.0, float("nan")], None, [], [-0.0]], pa.list_(pa.float64())),
            "name": pa.array(["a", None, "c", "d"]),
        }
    )
    got = table_to_polars(table)
    want = pl.from_arrow(table)
    assert got.equals(want) and got.schema == want.schema

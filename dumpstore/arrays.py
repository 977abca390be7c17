"""numpy arrays into Arrow and Polars without the imports their converters pay for.

`pa.array(ndarray)` and `pl.Series(name, ndarray)` look up `numpy.ma` (its import costs 20-60 ms, per process);
`pl.from_arrow` and `pl.Series(pa.Array)` import `pyarrow.compute` (45-65 ms).  A command that answers in a
second pays both for nothing, so columns made in numpy go through here: straight from the array's memory into an
Arrow array, and into Polars through the Arrow PyCapsule interface.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

_NUMPY = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
}


def to_arrow(
    values: np.ndarray, type_: pa.DataType, nulls: np.ndarray | None = None, child: pa.Array | None = None
) -> pa.Array:
    """A 1-D numpy array of numbers or booleans as an Arrow array of `type_` (`nulls`: where it is null); for
    a list type, `values` are the offsets (one more than the rows) into the `child` array."""
    if child is not None:
        n, data = len(values) - 1, pa.py_buffer(np.ascontiguousarray(values, np.int32))
    elif type_ == pa.bool_():
        n, data = len(values), pa.py_buffer(np.packbits(np.asarray(values, np.bool_), bitorder="little"))
    else:
        n, data = len(values), pa.py_buffer(np.ascontiguousarray(values, _NUMPY[type_]))
    if nulls is None or not nulls.any():
        return pa.Array.from_buffers(type_, n, [None, data], null_count=0, children=None if child is None else [child])
    valid = pa.py_buffer(np.packbits(~nulls, bitorder="little"))
    return pa.Array.from_buffers(type_, n, [valid, data], children=None if child is None else [child])


class _Capsule:
    """An Arrow array seen only through the Arrow PyCapsule interface (Polars imports it without pyarrow)."""

    __slots__ = ("array",)

    def __init__(self, array: pa.Array):
        self.array = array

    def __arrow_c_array__(self, requested_schema: Any = None) -> Any:
        return self.array.__arrow_c_array__(requested_schema)


def to_polars(name: str, values: np.ndarray, nulls: np.ndarray | None = None):
    """A 1-D numpy array of numbers or booleans as a Polars Series of the same type (see `to_arrow`)."""
    import polars as pl

    type_ = pa.from_numpy_dtype(values.dtype)
    return pl.Series(_Capsule(to_arrow(values, type_, nulls))).alias(name)


class _Stream:
    """An Arrow table seen only through the Arrow PyCapsule stream interface."""

    __slots__ = ("table",)

    def __init__(self, table: pa.Table):
        self.table = table

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self.table.__arrow_c_stream__(requested_schema)


def table_to_polars(table: pa.Table):
    """An Arrow table as a Polars DataFrame (without `pl.from_arrow`'s import of pyarrow.compute)."""
    import polars as pl

    return pl.DataFrame(_Stream(table))

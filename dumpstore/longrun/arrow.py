"""Arrow <-> numpy for the long-run code, through the arrays' buffers: pyarrow's `pa.array`, `pa.scalar`,
`Array.to_numpy` and `__array__` import pandas (0.3-0.5 s of CPU), and `pyarrow.compute` costs 0.1-0.2 s to
import; a long-run command needs neither for its numeric columns (numpy to Arrow: dumpstore/arrays.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..arrays import _NUMPY, to_arrow


def valid(arr: pa.Array) -> np.ndarray:
    """The array's validity as a bool numpy array."""
    bits = arr.buffers()[0]
    if bits is None or arr.null_count == 0:
        return np.ones(len(arr), bool)
    unpacked = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")
    return unpacked[arr.offset : arr.offset + len(arr)].astype(bool)


def to_numpy(col: pa.Array | pa.ChunkedArray, dtype: type, null: float | int) -> np.ndarray:
    """A numeric column as a new numpy array of `dtype`, nulls as `null` (other types: through
    pyarrow.compute)."""
    if isinstance(col, pa.ChunkedArray):
        parts = [to_numpy(c, dtype, null) for c in col.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)
    src = _NUMPY.get(col.type)
    if src is None:
        import pyarrow.compute as pc

        col = pc.cast(col, pa.float64() if np.dtype(dtype).kind == "f" else pa.int64())
        src = _NUMPY[col.type]
    if len(col) == 0:
        return np.zeros(0, dtype)
    width = np.dtype(src).itemsize
    out: np.ndarray = np.frombuffer(col.buffers()[1], src, len(col), col.offset * width).astype(dtype)
    if col.null_count:
        out[~valid(col)] = null
    return out


def codes(col: pa.DictionaryArray) -> np.ndarray:
    """A dictionary array's codes as int64 numpy, -1 for a null."""
    return to_numpy(col.indices, np.int64, -1)


def int_array(values: np.ndarray, typ: pa.DataType, ok: np.ndarray | None = None) -> pa.Array:
    """An integer array of `typ` from numpy values (`ok`: which are valid; arrays.to_arrow)."""
    return to_arrow(values, typ, None if ok is None else ~ok)


def bool_array(values: np.ndarray) -> pa.Array:
    return to_arrow(values, pa.bool_())


def strings(values: list[str | None]) -> pa.Array:
    """A string array (None: null)."""
    data = [b"" if v is None else v.encode("utf-8") for v in values]
    offsets = np.zeros(len(data) + 1, np.int32)
    np.cumsum([len(b) for b in data], out=offsets[1:])
    ok = np.array([v is not None for v in values], bool)
    bitmap = None if ok.all() else pa.py_buffer(np.packbits(ok, bitorder="little"))
    return pa.Array.from_buffers(
        pa.string(), len(values), [bitmap, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))]
    )

"""What every part of the .pt reader shares: the refusal it raises inside (worded by `read_pt` with the path), the
caps, and the dtype tables."""

from __future__ import annotations

import re
import sys
from typing import Any

DEFAULT_MAX_BYTES = 8 << 30  # cap on the claimed size of a tensor or storage, checked before reading
_MAX_NDIM = 64
_INT64 = 1 << 63  # sizes, strides and offsets are int64 in torch
_WHOLE_FILE = 1 << 22  # files up to this size are read in one call and parsed in memory
_KEY_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
# canonical dtype -> numpy code of one stored element (byte order added at read time)
_STORED_CODE = {
    "float16": "f2",
    "bfloat16": "u2",
    "float32": "f4",
    "float64": "f8",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
    "bool": "u1",
    "complex32": "f2",
    "complex64": "c8",
    "complex128": "c16",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
    "float8_e4m3fnuz": "u1",
    "float8_e5m2fnuz": "u1",
}


_ITEMSIZE = {name: (4 if name == "complex32" else int(code[1:])) for name, code in _STORED_CODE.items()}
_LEGACY_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}


_NUMPY_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
# float8 formats: (exponent bits, mantissa bits, exponent bias, NaN/Inf convention)
_FP8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}


class _Bad(Exception):
    """Internal: what is wrong with the file; read_pt prefixes the path and raises DumpFormatError."""


def _brief(value: Any, limit: int) -> str:
    """A bounded rendering of an untrusted value: never walks a container or prints a huge number."""
    if value is None or type(value) in (bool, float):
        text = repr(value)
    elif type(value) is int:
        text = repr(value) if value.bit_length() <= 64 else f"<int of {value.bit_length()} bits>"
    elif type(value) in (str, bytes, bytearray):
        text = repr(value[:limit])
    elif type(value) in (tuple, list, dict, set, frozenset):
        flat = (
            type(value) in (tuple, list)
            and len(value) <= _MAX_NDIM
            and all(v is None or type(v) in (bool, float) or (type(v) is int and v.bit_length() <= 64) for v in value)
        )
        text = repr(value) if flat else f"<{type(value).__name__} of {len(value)} items>"
    else:
        text = f"<{type(value).__name__.lstrip('_')}>"
    return text[:limit]


_NATIVE = "<" if sys.byteorder == "little" else ">"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__

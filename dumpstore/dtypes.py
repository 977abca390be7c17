"""One dtype vocabulary for torch, numpy, MindSpore and Arrow names.

Canonical names are numpy-style lower-case strings: ``float32``, ``bfloat16``, ``int64``, ``bool`` …
Unknown names are kept verbatim (so nothing is lost), and :func:`is_float` etc. answer False for them.
"""

from __future__ import annotations

import functools

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
DISCRETE_DTYPES = (*INT_DTYPES, "bool")  # integers and booleans: no rounding noise
COMPLEX_DTYPES = ("complex32", "complex64", "complex128")

_ALIASES = {
    # torch
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "bfloat16": "bfloat16",
    "bool": "bool",
    "cfloat": "complex64",
    "cdouble": "complex128",
    # MindSpore
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "bfloat16_": "bfloat16",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "complex64": "complex64",
    "complex128": "complex128",
}

# eps (2**-mantissa bits), finfo.max for the float dtypes we judge.
EPS = {
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float32": 2.0**-23,
    "float64": 2.0**-52,
    "tf32": 2.0**-10,  # not a storage dtype: float32 matmuls with 10-bit-mantissa inputs (analysis/prior.py)
    "float8_e4m3fn": 2.0**-3,
    "float8_e5m2": 2.0**-2,
}
FINFO_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
}


def canonical(name: object) -> str:
    """Map ``torch.float32``, ``Float32``, ``BFloat16``, ``<class 'numpy.float32'>``, ``float32`` … to one name."""
    if name is None:
        return ""
    if isinstance(name, str) and len(name) < 64:
        return _canonical_str(name)
    return _canonical(str(name))


@functools.lru_cache(maxsize=1024)
def _canonical_str(name: str) -> str:
    return _canonical(name)


def _canonical(name: str) -> str:
    raw = name.strip()
    s = raw
    for prefix in ("torch_npu.", "torch.", "mindspore.", "ms.", "numpy.", "np."):
        if s.startswith(prefix):
            s = s[len(prefix) :]
            break
    low = s.lower()
    if low in _ALIASES:
        return _ALIASES[low]
    if low in FLOAT8_DTYPES or low in COMPLEX_DTYPES:
        return low
    return raw


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES or dtype in FLOAT8_DTYPES


def eps(dtype: str) -> float:
    """Machine epsilon of a float dtype; 0 for exact types; fp32's for unknown names."""
    if dtype in EPS:
        return EPS[dtype]
    if dtype in DISCRETE_DTYPES:
        return 0.0
    return EPS["float32"]


def finfo_max(dtype: str) -> float | None:
    return FINFO_MAX.get(dtype)

"""A tensor's stored bytes into a numpy array: its view (shape, strides, offset) checked against the storage,
gathered, and decoded (byte order; bfloat16, float8, complex32 and bool widened)."""

from __future__ import annotations

import functools
import math

import numpy as np

from .base import _FP8, _ITEMSIZE, _STORED_CODE, _Bad
from .unpickler import _Tensor
from .zipread import _Archive


@functools.cache
def _fp8_table(dtype: str) -> np.ndarray:
    """float32 value of each of the 256 codes of a float8 format (exact: every fp8 value is an fp32 value)."""
    ebits, mbits, bias, style = _FP8[dtype]
    codes = np.arange(256)
    exp, man = (codes >> mbits) & ((1 << ebits) - 1), (codes & ((1 << mbits) - 1)).astype(np.float64)
    value = np.where(exp == 0, man * 2.0 ** (1 - bias - mbits), (1 + man / 2**mbits) * 2.0 ** (exp - bias))
    value = np.where(codes >= 128, -value, value)  # NaN and Inf below keep the code's sign, as torch does
    if style == "fn":
        nan = (codes & 0x7F) == 0x7F
        value[nan] = np.copysign(np.nan, value[nan])
    elif style == "ieee":
        top = exp == (1 << ebits) - 1
        value[top] = np.copysign(np.where(man[top] == 0, np.inf, np.nan), value[top])
    else:
        value[0x80] = np.nan
    table = value.astype(np.float32)
    table.flags.writeable = False
    return table


@functools.cache
def _out_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16" or dtype in _FP8:
        return np.dtype(np.float32)
    if dtype == "complex32":
        return np.dtype(np.complex64)
    if dtype == "bool":
        return np.dtype(np.bool_)
    return np.dtype(_STORED_CODE[dtype])


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _check_view(t: _Tensor, max_bytes: int) -> int:
    """Number of elements of `t`; raises unless shape, strides and offset fit the storage and the cap."""
    if t.dtype not in _STORED_CODE:
        raise _Bad(f"unsupported tensor dtype {t.dtype}")
    numel = math.prod(t.size)
    out_bytes = numel * _out_dtype(t.dtype).itemsize
    if out_bytes > max_bytes:
        raise _Bad(
            f"tensor of shape {list(t.size)} ({out_bytes} bytes as {_out_dtype(t.dtype)}) exceeds max_bytes={max_bytes}"
        )
    if numel == 0:
        return 0
    extent = t.offset + sum((n - 1) * s for n, s in zip(t.size, t.stride)) + 1
    held = t.storage.nbytes // _ITEMSIZE[t.dtype]
    if extent > held:
        raise _Bad(
            f"storage too small: {t.dtype} shape {list(t.size)} stride {list(t.stride)} "
            f"offset {t.offset} needs {extent} elements, storage {t.storage.key} holds {held}"
        )
    return numel


@functools.cache
def _storage_dtype(dtype: str, order: str) -> np.dtype:
    code = order + _STORED_CODE[dtype]
    if dtype == "complex32":
        return np.dtype([("re", code), ("im", code)])
    return np.dtype(code)


def _gather(raw: np.ndarray, t: _Tensor, order: str, numel: int) -> np.ndarray:
    """The tensor's elements in their stored encoding, C-contiguous, shape applied."""
    sdtype = _storage_dtype(t.dtype, order)
    flat = np.frombuffer(raw, dtype=sdtype, count=len(raw) // sdtype.itemsize)
    if _is_contiguous(t.size, t.stride):
        return flat[t.offset : t.offset + numel].reshape(t.size)
    strides = tuple(s * sdtype.itemsize for s in t.stride)
    view = np.lib.stride_tricks.as_strided(flat[t.offset :], shape=t.size, strides=strides, writeable=False)
    return np.ascontiguousarray(view)


def _decode(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Widen the stored encoding to the numpy dtype that holds `dtype` exactly (native byte order)."""
    if dtype == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    if dtype in _FP8:
        widened: np.ndarray = _fp8_table(dtype)[stored]
        return widened
    if dtype == "complex32":
        out = np.empty(stored.shape, np.complex64)
        out.real, out.imag = stored["re"], stored["im"]
        return out
    if dtype == "bool":
        return stored.astype(np.bool_)  # any non-zero byte is True, as in torch
    if not stored.dtype.isnative:
        return stored.astype(stored.dtype.newbyteorder("="))
    return stored


def _tensor_array(archive: _Archive, t: _Tensor, max_bytes: int) -> np.ndarray:
    numel = _check_view(t, max_bytes)
    if numel == 0:
        return np.empty(t.size, _out_dtype(t.dtype))
    if t.storage.nbytes > max_bytes:
        raise _Bad(f"storage {t.storage.key} claims {t.storage.nbytes} bytes, more than max_bytes={max_bytes}")
    raw = archive.read(f"{archive.prefix}data/{t.storage.key}", max_bytes, t.storage.nbytes)
    return _array(raw, t, archive.order, numel)


def _array(raw: np.ndarray, t: _Tensor, order: str, numel: int) -> np.ndarray:
    """The tensor `t` (checked by _check_view: `numel` > 0 elements) from its storage's bytes `raw`."""
    out = _decode(_gather(raw, t, order, numel), t.dtype)
    if t.conj:
        out = np.conjugate(out)
    if t.neg:
        out = np.negative(out)
    return out if type(out) is np.ndarray else np.array(out)  # numpy ops on 0-d arrays return scalars


def _numpy_array(arr: np.ndarray, max_bytes: int) -> np.ndarray:
    if arr.nbytes > max_bytes:
        raise _Bad(f"numpy array of {arr.nbytes} bytes exceeds max_bytes={max_bytes}")
    if arr.dtype.kind == "b":
        return arr.view(np.uint8).astype(np.bool_)  # any non-zero byte is True, as in torch
    return np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C")

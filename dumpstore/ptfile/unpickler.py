"""The allow-listed unpickler: data.pkl's few globals mapped onto inert stand-ins, so nothing the file names is
imported or called; the pickle's budgets checked on its opcodes first."""

from __future__ import annotations

import _compat_pickle
import functools
import io
import math
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from dumpstore.picklescan import PickleBudgetError, check_pickle

from .base import _INT64, _ITEMSIZE, _KEY_RE, _LEGACY_STORAGES, _MAX_NDIM, _NUMPY_CODES, _STORED_CODE, _Bad, _brief

_SMALL_PICKLE = 4096  # pickles up to this size are memoised by content (see _unpickle_small)


class _Inert:
    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise _Bad(
            f"refused to load: pickle sets state on {type(self).__name__.lstrip('_')}; only plain tensors are accepted"
        )


class _StorageType(_Inert):
    """Stands for ``torch.FloatStorage`` etc.; ``UntypedStorage`` counts bytes (uint8)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _TorchDType(_Inert):
    """Stands for ``torch.float8_e4m3fn`` etc. (the dtype argument of ``_rebuild_tensor_v3``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Marker(_Inert):
    """Stands for a class only used as a tag (``numpy.ndarray``)."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label


class _Func(_Inert):
    """A callable stand-in for an allowed global function."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class _Storage(_Inert):
    """A storage reference from a persistent id: zip member key, element dtype, size in bytes."""

    __slots__ = ("dtype", "key", "nbytes")

    def __init__(self, key: str, dtype: str, nbytes: int) -> None:
        self.key, self.dtype, self.nbytes = key, dtype, nbytes


class _Tensor(_Inert):
    """What a rebuild call produced: a storage view, validated later by :func:`_tensor_array`."""

    __slots__ = ("conj", "dtype", "neg", "offset", "size", "storage", "stride")

    def __init__(
        self,
        storage: _Storage,
        offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: str,
        conj: bool,
        neg: bool,
    ) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.dtype, self.conj, self.neg = dtype, conj, neg


class _NpDType(_Inert):
    """Stands for ``numpy.dtype(code)``; takes its one pickled state (byte order) and keeps a real dtype."""

    __slots__ = ("code", "dtype")

    def __init__(self, code: str) -> None:
        self.code = code
        self.dtype: np.dtype | None = None

    def __setstate__(self, state: object) -> None:
        if self.dtype is not None or type(state) is not tuple or len(state) < 5:
            raise _Bad("corrupt numpy dtype in pickle")
        endian, subarray, names, fields = state[1:5]
        if subarray is not None or names is not None or fields is not None:
            raise _Bad("refused to load: structured numpy dtype; only plain numeric arrays are accepted")
        if endian not in ("<", ">", "|", "="):
            raise _Bad(f"corrupt numpy dtype byte order {_brief(endian, 20)}")
        self.dtype = np.dtype(self.code).newbyteorder("=" if endian in "|=" else endian)


class _NdArray(_Inert):
    """Stands for ``numpy.ndarray`` from ``_reconstruct``; takes its one state (shape, dtype, bytes)."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        if self.array is not None or type(state) is not tuple or len(state) != 5:
            raise _Bad("corrupt numpy array in pickle")
        _version, shape, dtype, fortran, raw = state
        self.array = _np_from_bytes(raw, _np_dtype(dtype), _shape(shape, "numpy shape"), fortran is True)


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_NDIM:
        raise _Bad(f"corrupt pickle: {what} is not a sequence of at most {_MAX_NDIM} ints")
    dims = tuple(value)
    if any(type(d) is not int or d < 0 or d >= _INT64 for d in dims):
        raise _Bad(f"corrupt pickle: {what} {_brief(list(dims), 80)} holds a negative or non-int entry")
    return dims


def _offset(value: object) -> int:
    if type(value) is not int or value < 0 or value >= _INT64:
        raise _Bad(f"corrupt pickle: storage offset {_brief(value, 40)} is not a non-negative int")
    return value


def _np_dtype(value: object) -> np.dtype:
    if not isinstance(value, _NpDType) or value.dtype is None:
        raise _Bad("corrupt pickle: numpy array without a plain numpy dtype")
    return value.dtype


def _np_from_bytes(raw: object, dtype: np.dtype, shape: tuple[int, ...], fortran: bool) -> np.ndarray:
    if not isinstance(raw, (bytes, bytearray)):
        raise _Bad("refused to load: numpy array payload is not raw bytes (object array?)")
    need = math.prod(shape) * dtype.itemsize
    if len(raw) != need:
        raise _Bad(f"numpy array of shape {list(shape)} needs {need} bytes, pickle holds {len(raw)}")
    flat = np.frombuffer(raw, dtype=dtype)
    return flat.reshape(shape, order="F" if fortran else "C")


def _metadata(value: object) -> tuple[bool, bool]:
    if value is None:
        return False, False
    if type(value) is not dict or not set(value) <= {"conj", "neg"}:
        raise _Bad(f"unsupported tensor metadata {_brief(value, 60)}")
    return value.get("conj") is True, value.get("neg") is True


def _make_tensor(
    storage: object, offset: object, size: object, stride: object, dtype: str | None, metadata: object = None
) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise _Bad("corrupt pickle: tensor rebuilt from something other than a storage")
    dims, strides = _shape(size, "size"), _shape(stride, "stride")
    if len(dims) != len(strides):
        raise _Bad(f"corrupt pickle: size {list(dims)} and stride {list(strides)} differ in length")
    conj, neg = _metadata(metadata)
    return _Tensor(storage, _offset(offset), dims, strides, dtype or storage.dtype, conj, neg)


def _rebuild_tensor(storage: object, offset: object, size: object, stride: object) -> _Tensor:
    return _make_tensor(storage, offset, size, stride, None)


def _rebuild_tensor_v2(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    _requires_grad: object = None,
    _hooks: object = None,
    metadata: object = None,
) -> _Tensor:
    return _make_tensor(storage, offset, size, stride, None, metadata)


def _rebuild_tensor_v3(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    _requires_grad: object,
    _hooks: object,
    dtype: object,
    metadata: object = None,
) -> _Tensor:
    if not isinstance(dtype, _TorchDType):
        raise _Bad("corrupt pickle: _rebuild_tensor_v3 without a torch dtype")
    return _make_tensor(storage, offset, size, stride, dtype.name, metadata)


def _rebuild_parameter(data: object, *_rest: object) -> _Tensor:
    if not isinstance(data, _Tensor):
        raise _Bad("corrupt pickle: Parameter wraps something other than a tensor")
    return data


def _reconstruct(cls: object, _shape_arg: object, _typecode: object) -> _NdArray:
    if not (isinstance(cls, _Marker) and cls.label == "ndarray"):
        raise _Bad("refused to load: numpy _reconstruct of something other than numpy.ndarray")
    return _NdArray()


def _numpy_dtype(code: object, _align: object = False, _copy: object = True) -> _NpDType:
    if type(code) is not str or code not in _NUMPY_CODES:
        raise _Bad(f"refused to load: numpy dtype {_brief(code, 40)}; only numeric dtypes are accepted")
    return _NpDType(code)


def _numpy_scalar(dtype: object, raw: object = None) -> _NdArray:
    out = _NdArray()
    out.array = _np_from_bytes(raw, _np_dtype(dtype), (), False)
    return out


def _codecs_encode(text: object, encoding: object = "utf-8") -> bytes:
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise _Bad("refused to load: _codecs.encode is allowed only as protocol 2's latin1 bytes")
    return text.encode("latin1")


def _hooks(*_args: object) -> dict[Any, Any]:
    return {}  # backward hooks (an empty OrderedDict in every torch.save) are ignored


def _allowed_globals() -> dict[tuple[str, str], object]:
    allowed: dict[tuple[str, str], object] = {
        ("torch._utils", "_rebuild_tensor"): _Func(_rebuild_tensor),
        ("torch._utils", "_rebuild_tensor_v2"): _Func(_rebuild_tensor_v2),
        ("torch._utils", "_rebuild_tensor_v3"): _Func(_rebuild_tensor_v3),
        ("torch._utils", "_rebuild_parameter"): _Func(_rebuild_parameter),
        ("torch._utils", "_rebuild_parameter_with_state"): _Func(_rebuild_parameter),
        ("collections", "OrderedDict"): _Func(_hooks),
        ("torch", "UntypedStorage"): _StorageType("uint8"),
        ("torch.storage", "UntypedStorage"): _StorageType("uint8"),
        ("numpy", "ndarray"): _Marker("ndarray"),
        ("numpy", "dtype"): _Func(_numpy_dtype),
        ("_codecs", "encode"): _Func(_codecs_encode),
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = _Func(_reconstruct)
        allowed[(module, "scalar")] = _Func(_numpy_scalar)
    for name, dtype in _LEGACY_STORAGES.items():
        allowed[("torch", name)] = _StorageType(dtype)
        allowed[("torch.cuda", name)] = _StorageType(dtype)
    for name in _STORED_CODE:
        allowed[("torch", name)] = _TorchDType(name)
    return allowed


_ALLOWED = _allowed_globals()


def _py3_name(module: str, name: str) -> tuple[str, str]:
    """Python 3 spelling of a global that protocol 2 wrote with its Python 2 name (``__builtin__.eval``)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class _SafeUnpickler(pickle.Unpickler):
    """Resolves globals only through ``_ALLOWED`` and storages only to :class:`_Storage` references."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = _py3_name(module, name)
        found = _ALLOWED.get((module, name))
        if found is None:
            raise _Bad(f"refused to load: pickle references {module}.{name}; only plain tensors are accepted")
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
            raise _Bad(f"corrupt pickle: unknown persistent id {_brief(pid, 60)}")
        _kind, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType):
            raise _Bad("corrupt pickle: storage reference without a storage type")
        if type(key) is not str or not _KEY_RE.fullmatch(key):
            raise _Bad(f"corrupt pickle: bad storage key {_brief(key, 40)}")
        if type(numel) is not int or numel < 0:
            raise _Bad(f"corrupt pickle: storage size {_brief(numel, 40)} is not a non-negative int")
        return _Storage(key, stype.dtype, numel * _ITEMSIZE[stype.dtype])


_CORRUPT = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    OverflowError,
    UnicodeError,
    struct.error,
    zlib.error,
    NotImplementedError,
    RuntimeError,
    MemoryError,
)  # what corrupt bytes make zipfile, pickle, numpy raise


def _unpickle(data: bytes | memoryview) -> object:
    """Check the pickle's budgets (opcodes, memo, nesting, logical size) on its opcodes, then unpickle it."""
    try:
        check_pickle(data)
    except PickleBudgetError as exc:
        raise _Bad(f"refused to load: {exc}; only plain tensors are accepted") from None
    return _SafeUnpickler(io.BytesIO(data)).load()


@functools.lru_cache(maxsize=1024)
def _unpickle_small(data: bytes) -> object:
    """Tensor pickles repeat across a dump (same shape, dtype and storage key): unpickle each distinct one once.

    The result only describes the tensor (inert stand-ins that nothing changes after loading); the array is
    always built afresh from the file's own storage. Errors are raised again for every file (not cached).
    """
    return _unpickle(data)

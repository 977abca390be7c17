"""Safe reader for PyTorch ``.pt`` tensor files: torch.save's zip + pickle, read without torch or pickle code.

``torch.save(tensor)`` writes a zip holding ``<archive>/data.pkl`` (a pickle that rebuilds the tensor from a
storage), ``<archive>/data/<key>`` (the raw storage bytes) and ``<archive>/byteorder``. :func:`read_pt`
unpickles ``data.pkl`` with an allow-list that maps the few globals a plain tensor needs onto inert stand-ins,
so nothing the file names is ever imported or called; it then checks shape, strides and offset against the
storage and reads the bytes with numpy. A numpy array pickled by ``torch.save(ndarray)`` is read the same way
(numeric dtypes only). Anything else is refused with :class:`~dumpstore.errors.DumpFormatError` naming the
path and the problem.
"""

from __future__ import annotations

import _compat_pickle
import errno
import functools
import io
import math
import os
import pickle
import re
import stat
import struct
import sys
import zipfile
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from dumpstore.errors import DumpFormatError
from dumpstore.picklescan import PickleBudgetError, check_pickle

__all__ = ["DEFAULT_MAX_BYTES", "NO_FOLLOW", "LinkedTensorFile", "MissingTensorFile", "read_pt", "read_pt_stamped"]

DEFAULT_MAX_BYTES = 8 << 30  # cap on the claimed size of a tensor or storage, checked before reading
_MAX_NDIM = 64
_INT64 = 1 << 63  # sizes, strides and offsets are int64 in torch
_INFLATE_FREE = 1 << 20  # a compressed member may always expand to this much ...
_MAX_RATIO = 100  # ... and beyond it at most this many times its compressed size (a zip bomb reaches ~1000)
_WHOLE_FILE = 1 << 22  # files up to this size are read in one call and parsed in memory
_CHUNK = 1 << 24  # compressed members are inflated in chunks of this size (bounds transient memory)
_SMALL_PICKLE = 4096  # pickles up to this size are memoised by content (see _unpickle_small)
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


# ------------------------------------------------------------------------------------------------------------
# Inert stand-ins handed to the unpickler. Each refuses BUILD (``__setstate__``) unless it expects one state.


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


# ------------------------------------------------------------------------------------------------------------
# Argument checks for the stand-ins (the pickle chooses every argument).


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_NDIM:
        raise _Bad(f"corrupt pickle: {what} is not a sequence of at most {_MAX_NDIM} ints")
    dims = tuple(value)
    if any(type(d) is not int or d < 0 or d >= _INT64 for d in dims):
        raise _Bad(f"corrupt pickle: {what} {_brief(list(dims), 80)} holds a negative or non-int entry")
    return dims


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


# ------------------------------------------------------------------------------------------------------------
# The zip container.

_EOCD = struct.Struct("<4s4H2LH")
_LOC64 = struct.Struct("<4sLQL")  # zip64 end locator: signature, disk, offset of the zip64 end record, disks
_EOCD64 = struct.Struct("<4sQ4x2L4Q")  # zip64 end record: signature, size, versions, disks, counts, size, offset
# directory entry: signature, flags, method, crc, sizes, name length, (extra and comment lengths, disk), offset
_CDIR = struct.Struct("<4s4xH2s4x3LH6s6xL")
_ZERO2, _ZERO6 = bytes(2), bytes(6)
_TAIL64 = struct.Struct("<" + _EOCD64.format[1:] + _LOC64.format[1:] + _EOCD.format[1:])  # the three, in order
_LOCAL = struct.Struct("<4s22xHH")  # local header: signature, name and extra lengths
_CDIR_SIG, _LOCAL_SIG = b"PK\x01\x02", b"PK\x03\x04"

# A plain member found by _central_directory: (CRC-32, size, offset of its local header)
_Plain = tuple[int, int, int]


def _central_directory(data: np.ndarray) -> dict[str, _Plain] | None:
    """Members of a small zip held in memory, from its central directory, when the zip is plain.

    Plain is what torch.save writes: the end record at the very end (no comment), zip64 end records right
    before it, the directory right before those, and every member stored (not compressed or encrypted), with
    no extra field or comment in the directory, a unique ASCII name, sizes below 4 GiB, lying before the
    directory. Anything else returns None and is left to :mod:`zipfile`, which reads any zip (and words the
    errors).
    """
    members = _plain_members(data.data)
    return None if members is None else {name.decode(): info for name, info in members.items()}


def _plain_members(raw: memoryview) -> dict[bytes, _Plain] | None:
    """:func:`_central_directory`'s members, named by their bytes (ASCII without NUL), or None."""
    end = _directory_end(raw)
    if end is None:
        return None
    cd_off, cd_end, n_total = end
    directory = raw[cd_off:cd_end].tobytes()
    members: dict[bytes, _Plain] = {}
    unpack, cd_size, pos = _CDIR.unpack_from, cd_end - cd_off, 0
    try:  # an entry's fixed part past the end raises struct.error
        for _ in range(n_total):
            sig, flags, method, crc, csize, usize, name_len, no_extra, offset = unpack(directory, pos)
            start = pos + 46
            pos = start + name_len
            if (
                sig != _CDIR_SIG
                or method != _ZERO2  # not ZIP_STORED
                or no_extra != _ZERO6  # an extra field, a comment, another disk
                or flags & 1
                or csize != usize
                or offset + usize > cd_off
            ):
                return None
            members[directory[start:pos]] = (crc, usize, offset)
    except struct.error:
        return None
    names = b"".join(members)
    if pos != cd_size or len(members) != n_total or not names.isascii() or 0 in names:
        return None  # trailing bytes or a name cut short, a name given twice, a name not ASCII or holding NUL
    return members


def _directory_end(raw: memoryview) -> tuple[int, int, int] | None:
    """(offset, end, entries) of the central directory of a plain zip from its end records, else None."""
    size = len(raw)
    if size >= _TAIL64.size:  # torch.save's three end records read at once: the checks of _end_records in one
        fields = _TAIL64.unpack_from(raw, size - _TAIL64.size)
        sig64, rec_size, disk64, cd_disk64, n_disk64, n_total64, cd_size, cd_off = fields[:8]
        loc_sig, loc_disk, rec_off, n_disks, sig, disk, cd_disk, n_disk, n_total, _size, _off, comment = fields[8:]
        if loc_sig == b"PK\x06\x07" and sig == b"PK\x05\x06":
            end = size - _TAIL64.size
            if (
                disk
                or cd_disk
                or n_disk != n_total
                or comment
                or loc_disk
                or n_disks != 1
                or rec_off != end
                or sig64 != b"PK\x06\x06"
                or rec_size != _EOCD64.size - 12
                or disk64
                or cd_disk64
                or n_disk64 != n_total64
                or cd_off + cd_size != end
            ):
                return None
            return cd_off, end, n_total64
    return _end_records(raw, size)


def _end_records(raw: memoryview, size: int) -> tuple[int, int, int] | None:
    """:func:`_directory_end` record by record."""
    if size < _EOCD.size:
        return None
    end = size - _EOCD.size
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_off, comment = _EOCD.unpack_from(raw, end)
    if sig != b"PK\x05\x06" or disk or cd_disk or n_disk != n_total or comment:
        return None
    if end >= _LOC64.size + _EOCD64.size and raw[end - _LOC64.size : end - _LOC64.size + 4] == b"PK\x06\x07":
        # torch.save always writes zip64 end records (locator, then record, right before the end record)
        _sig, loc_disk, rec_off, n_disks = _LOC64.unpack_from(raw, end - _LOC64.size)
        end -= _LOC64.size + _EOCD64.size
        if loc_disk or n_disks != 1 or rec_off != end:
            return None
        sig, rec_size, disk, cd_disk, n_disk, n_total, cd_size, cd_off = _EOCD64.unpack_from(raw, end)
        if sig != b"PK\x06\x06" or rec_size != _EOCD64.size - 12 or disk or cd_disk or n_disk != n_total:
            return None
    if cd_off + cd_size != end:
        return None
    return cd_off, end, n_total


class _Archive:
    """An open torch.save zip: the ``<archive>/`` prefix, its byte order, members read by name only.

    A small file is read whole into one writable buffer; when its zip is plain (:func:`_central_directory`)
    members are views of that buffer (no zipfile, no copy). Other files go through :mod:`zipfile`.
    """

    def __init__(self, fd: int, size: int, whole: np.ndarray | None = None) -> None:
        """`whole`: the file's bytes when the caller has read them already (a file of at most _WHOLE_FILE bytes)."""
        self.fd = fd
        self.src: io.BufferedIOBase | None = None
        self.whole: np.ndarray | None = None
        self.zip: zipfile.ZipFile | None = None
        self.members: dict[str, Any] = self._open_zip(size, whole)
        self.prefix = self._prefix(self.members)
        self.order = self._byteorder(self.prefix + "byteorder" in self.members)

    def _open_zip(self, size: int, whole: np.ndarray | None) -> dict[str, Any]:
        """Small files are read in one call and parsed in memory; large ones from the file."""
        if size <= _WHOLE_FILE:
            whole = _read_all(self.fd, size) if whole is None else whole
            members = _central_directory(whole)
            if members is not None:
                self.whole = whole
                return members
            self.src = io.BytesIO(whole.tobytes())
        else:  # zipfile reads records a few bytes at a time
            self.src = io.BufferedReader(io.FileIO(self.fd, "rb", closefd=False))
        head = self.src.read(2)
        try:
            self.zip = zipfile.ZipFile(self.src)
        except zipfile.BadZipFile as exc:
            if head == b"\x80\x02":
                raise _Bad("legacy (non-zip) torch.save format is not supported; re-save with torch >= 1.6") from None
            raise _Bad(f"not a zip file, or truncated ({_one_line(exc)})") from None
        return self.zip.NameToInfo

    @staticmethod
    def _prefix(names: Iterable[str]) -> str:
        prefixes = {n[:-8] for n in names if n.endswith("/data.pkl") and n.count("/") == 1}
        if len(prefixes) != 1:
            what = "no <archive>/data.pkl" if not prefixes else "several <archive>/data.pkl members"
            raise _Bad(f"zip holds {what}; not a torch.save file")
        return prefixes.pop()

    def _byteorder(self, recorded: bool) -> str:
        if not recorded:
            return "<"  # files without the record predate big-endian support and are little-endian
        mark = self.read(self.prefix + "byteorder", 16).tobytes()
        if mark not in (b"little", b"big"):
            raise _Bad(f"unknown byteorder record {_brief(mark, 30)}")
        return "<" if mark == b"little" else ">"

    def read(self, name: str, limit: int, want: int | None = None) -> np.ndarray:
        """Member `name` (first `want` bytes, default all) as a writable uint8 array; cap at `limit`."""
        info = self.members.get(name)
        if info is None:
            raise _Bad(f"zip member {name} is missing")
        size = info[1] if self.whole is not None else info.file_size
        want = size if want is None else want
        if want > size:
            raise _Bad(f"zip member {name} holds {size} bytes, pickle claims {want}")
        if want > limit:
            raise _Bad(f"zip member {name} claims {want} bytes, more than max_bytes={limit}")
        if self.whole is not None:
            return _view(self.whole, name, info, want)
        if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 1:
            return self._stored(info, want)
        packed = max(1, getattr(info, "compress_size", 0))
        if want > _INFLATE_FREE and want > _MAX_RATIO * packed:
            raise _Bad(
                f"zip member {name} would expand {packed} compressed bytes to {want} (more than "
                f"{_MAX_RATIO}x: a zip bomb?); torch.save stores members uncompressed, save the tensor again"
            )
        return self._inflate(info, want)

    def _stored(self, info: zipfile.ZipInfo, want: int) -> np.ndarray:
        """An uncompressed member of a file read through zipfile: one seek and read; CRC checked."""
        assert self.src is not None  # set whenever zipfile reads the file
        self.src.seek(info.header_offset)
        header = self.src.read(30)
        if len(header) < 30 or header[:4] != _LOCAL_SIG:
            raise _Bad(f"zip member {info.filename} has a bad local header")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        self.src.seek(info.header_offset + 30 + name_len + extra_len)
        buf = np.empty(want, np.uint8)
        got = self.src.readinto(buf.data)
        if got != want:
            raise _Bad(f"zip member {info.filename} is truncated ({got} of {want} bytes)")
        if want == info.file_size and zlib.crc32(buf.data) != info.CRC:
            raise _Bad(f"zip member {info.filename} fails its CRC check (corrupt file)")
        return buf

    def _inflate(self, info: zipfile.ZipInfo, want: int) -> np.ndarray:
        """Compressed members (not written by torch.save), through zipfile, in bounded chunks."""
        assert self.zip is not None  # compressed members only come from zipfile's directory
        buf = np.empty(want, np.uint8)
        view = buf.data
        with self.zip.open(info) as f:
            done = 0
            while done < want:
                chunk = f.read(min(_CHUNK, want - done))
                if not chunk:
                    raise _Bad(f"zip member {info.filename} is truncated ({done} of {want} bytes)")
                view[done : done + len(chunk)] = chunk
                done += len(chunk)
        return buf

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()


def _read_all(fd: int, size: int) -> np.ndarray:
    """Up to `size` bytes from the start of `fd` into a new writable buffer (fewer if the file is shorter)."""
    whole = np.empty(size, np.uint8)
    got = os.preadv(fd, [whole.data], 0) if size else 0
    while 0 < got < size:
        step = os.preadv(fd, [whole.data[got:]], got)
        if not step:
            break
        got += step
    return whole if got == size else whole[:got]


def _view(whole: np.ndarray, name: str, info: _Plain, want: int) -> np.ndarray:
    """The first `want` bytes of a stored member of a zip held in memory, as a view (aligned) or a copy;
    the member's CRC is checked when all of it is read."""
    crc, size, at = info
    raw = whole.data
    start = _member_start(raw, at)
    if start is None:
        raise _Bad(f"zip member {name} has a bad local header")
    got = max(0, min(want, len(raw) - start))
    if got != want:
        raise _Bad(f"zip member {name} is truncated ({got} of {want} bytes)")
    if want == size and zlib.crc32(raw[start : start + want]) != crc:
        raise _Bad(f"zip member {name} fails its CRC check (corrupt file)")
    buf = whole[start : start + want]
    return buf if start % 16 == 0 else buf.copy()  # torch.save aligns storages to 64 bytes


# ------------------------------------------------------------------------------------------------------------
# From a validated tensor description to a numpy array.


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


# ------------------------------------------------------------------------------------------------------------

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


def _load(archive: _Archive, max_bytes: int) -> tuple[np.ndarray, str]:
    pkl = archive.read(archive.prefix + "data.pkl", 2 * max_bytes + (1 << 20))
    obj = _unpickle_small(pkl.tobytes()) if pkl.size <= _SMALL_PICKLE else _unpickle(pkl.data)
    if isinstance(obj, _Tensor):
        return _tensor_array(archive, obj, max_bytes), obj.dtype
    if isinstance(obj, _NdArray) and obj.array is not None:
        return _numpy_array(obj.array, max_bytes), obj.array.dtype.name
    raise _Bad(f"object is not a tensor (the pickle holds a {type(obj).__name__.lstrip('_')})")


# ------------------------------------------------------------------------------------------------------------
# The fast path: a small plain torch.save file of one tensor, read from memory in one pass.


def _fast(whole: np.ndarray, max_bytes: int) -> tuple[np.ndarray, str] | None:
    """(array, dtype) of a plain torch.save file held in memory (the common case), or None: then the general path
    (_Archive, _load) reads it and words any error.

    It takes the general path's steps with the same checks (the same directory, member bounds and CRCs, byte
    order record, allow-listed and budgeted unpickling, tensor checks against storage and `max_bytes`), and
    returns None at the first that does not pass, so a file it reads is one the general path reads the same. A
    pickle that is refused raises here as it does there (the steps before it having passed the same way).
    """
    raw = whole.data
    members = _plain_members(raw)
    if members is None:
        return None
    prefix = _archive_prefix(members)
    if prefix is None:
        return None
    order = "<"
    recorded = members.get(prefix + b"byteorder")
    if recorded is not None:
        mark = _small_member(raw, recorded, 16)
        if mark != b"little":
            if mark != b"big":
                return None
            order = ">"
    pkl = _small_member(raw, members[prefix + b"data.pkl"], _SMALL_PICKLE)
    plan = None if pkl is None else _plan(pkl)
    if plan is None:
        return None
    t, member, numel, out_bytes, direct = plan
    info = members.get(prefix + member)
    want = t.storage.nbytes
    if info is None or out_bytes > max_bytes or want > max_bytes:
        return None
    crc, size, at = info
    start = _member_start(raw, at)
    if start is None or want > size or start + want > len(raw):
        return None
    if want == size and zlib.crc32(raw[start : start + want]) != crc:
        return None
    if direct is not None and order == _NATIVE and start % 16 == 0:  # as _array would make it, without copies
        itemsize = direct.itemsize
        return np.frombuffer(whole, direct, numel, start + t.offset * itemsize).reshape(t.size), t.dtype
    buf = whole[start : start + want]
    return _array(buf if start % 16 == 0 else buf.copy(), t, order, numel), t.dtype


_NATIVE = "<" if sys.byteorder == "little" else ">"


def _archive_prefix(members: dict[bytes, _Plain]) -> bytes | None:
    """`<archive>/` when the first member is its data.pkl, the one member so named (what torch.save writes);
    None otherwise (the general path's _Archive._prefix then decides)."""
    first = next(iter(members), b"")
    if not first.endswith(b"/data.pkl") or first.count(b"/") != 1:
        return None
    if (b"\x00".join(members) + b"\x00").count(b"/data.pkl\x00") != 1:  # names hold no NUL
        return None
    return first[:-8]


def _member_start(raw: memoryview, at: int) -> int | None:
    """Where the data of the member whose local header is at `at` starts, or None for a bad local header."""
    if at + _LOCAL.size > len(raw):
        return None
    sig, name_len, extra_len = _LOCAL.unpack_from(raw, at)
    return at + 30 + name_len + extra_len if sig == _LOCAL_SIG else None


def _small_member(raw: memoryview, info: _Plain, cap: int) -> bytes | None:
    """All of a member of at most `cap` bytes (local header, bounds and CRC checked as _view checks them), or None."""
    crc, size, at = info
    start = _member_start(raw, at) if size <= cap else None
    if start is None:
        return None
    data = raw[start : start + size].tobytes()
    return data if len(data) == size and zlib.crc32(data) == crc else None


@functools.lru_cache(maxsize=1024)
def _plan(pkl: bytes) -> tuple[_Tensor, bytes, int, int, np.dtype | None] | None:
    """What the fast path needs of a small tensor pickle, memoised as _unpickle_small is: the tensor, its storage
    member after the prefix, its elements, its bytes as read, and the dtype of its stored elements in native byte
    order if it is read as they are (contiguous, no widening or conjugation), else None. None for a pickle that
    is not a tensor passing _check_view's checks but the cap; one that is refused raises (each time)."""
    t = _unpickle_small(pkl)
    if type(t) is not _Tensor:
        return None
    try:
        numel = _check_view(t, _NO_CAP)  # the cap is the caller's (it varies by file)
    except _Bad:
        return None
    if numel == 0:
        return None
    stored = _storage_dtype(t.dtype, _NATIVE)
    plain = t.dtype not in _WIDENED and not (t.conj or t.neg) and _is_contiguous(t.size, t.stride)
    member = b"data/" + t.storage.key.encode()
    return t, member, numel, numel * _out_dtype(t.dtype).itemsize, stored if plain else None


_NO_CAP = 1 << 128  # larger than any tensor's bytes
_WIDENED = frozenset({"bfloat16", "bool", "complex32", *_FP8})  # what _decode changes besides the byte order


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO does not block the open
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
NO_FOLLOW = bool(_NO_FOLLOW)  # whether `follow_links=False` is the open's own refusal (else a check before it)


def _read(path: str, max_bytes: int, follow_links: bool) -> tuple[np.ndarray, str, tuple[int, int]]:
    """One open, one fstat, one read for a small file (the syscalls a .pt costs)."""
    if not (follow_links or NO_FOLLOW) and os.path.islink(path):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))  # as O_NOFOLLOW refuses it
    fd = os.open(path, _OPEN_FLAGS if follow_links else _OPEN_FLAGS | _NO_FOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block, /dev/zero never end
            raise _Bad("not a regular file")
        size, whole = info.st_size, None
        if size <= _WHOLE_FILE:
            whole = _read_all(fd, size)
            got = _fast(whole, max_bytes)
            if got is not None:
                return got[0], got[1], (size, info.st_mtime_ns)
        archive = _Archive(fd, size, whole)
        try:
            return (*_load(archive, max_bytes), (size, info.st_mtime_ns))
        finally:
            archive.close()
    finally:
        os.close(fd)


class MissingTensorFile(DumpFormatError):
    """The tensor file does not exist (:func:`read_pt`'s error when there is no file at the path)."""


class LinkedTensorFile(DumpFormatError):
    """The path is a symbolic link, refused (:func:`read_pt`'s error with `follow_links=False`)."""


def read_pt(
    path: str | os.PathLike[str], *, max_bytes: int | None = None, follow_links: bool = True
) -> tuple[np.ndarray, str]:
    """Read one tensor saved by torch.save without importing torch or running pickle code.

    Returns (array, dtype) where dtype is the canonical name of the *stored* dtype and array holds
    the values losslessly in a numpy dtype: bfloat16 and float8 widen to float32 (exact), complex32 to
    complex64, everything else its own numpy dtype; shape and strides applied (non-contiguous/offset views
    handled); 0-d and empty tensors supported. The array is C-contiguous, native byte order and writable.

    `max_bytes` (default :data:`DEFAULT_MAX_BYTES`, 8 GiB) caps the claimed size of the tensor and of its
    storage before anything is read. Raises :class:`DumpFormatError` naming `path` for a file that is not
    a plain tensor (or numeric numpy array) saved by torch.save, is corrupt or unreadable, or exceeds
    `max_bytes` (:class:`MissingTensorFile` where there is no file); with `follow_links=False`, for a path
    that is a symbolic link.
    """
    arr, dtype, _stamp = read_pt_stamped(path, max_bytes=max_bytes, follow_links=follow_links)
    return arr, dtype


def read_pt_stamped(
    path: str | os.PathLike[str], *, max_bytes: int | None = None, follow_links: bool = True
) -> tuple[np.ndarray, str, tuple[int, int]]:
    """:func:`read_pt`, and the (size, mtime in ns) of the file it read (from the fstat it makes anyway)."""
    where = os.fspath(path)
    limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if limit < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    try:
        return _read(where, limit, follow_links)
    except _Bad as exc:
        raise DumpFormatError(f"{where}: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links and os.path.islink(where):
            raise LinkedTensorFile(f"{where}: tensor file is a link; refusing to read it") from None
        kind = MissingTensorFile if exc.errno == errno.ENOENT else DumpFormatError
        raise kind(f"{where}: cannot read tensor file: {exc.strerror or exc}") from exc
    except _CORRUPT as exc:
        what = f"{type(exc).__name__}: {_one_line(exc)}"
        raise DumpFormatError(f"{where}: corrupt tensor file: {what}") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__

"""The fast path: a small plain torch.save file of one tensor, read from memory in one pass (None: the general
path reads it)."""

from __future__ import annotations

import functools
import zlib

import numpy as np

from .base import _FP8, _NATIVE, _Bad
from .decode import _array, _check_view, _is_contiguous, _out_dtype, _storage_dtype
from .unpickler import _SMALL_PICKLE, _Tensor, _unpickle_small
from .zipread import _member_start, _Plain, _plain_members, _small_member


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


def _archive_prefix(members: dict[bytes, _Plain]) -> bytes | None:
    """`<archive>/` when the first member is its data.pkl, the one member so named (what torch.save writes);
    None otherwise (the general path's _Archive._prefix then decides)."""
    first = next(iter(members), b"")
    if not first.endswith(b"/data.pkl") or first.count(b"/") != 1:
        return None
    if (b"\x00".join(members) + b"\x00").count(b"/data.pkl\x00") != 1:  # names hold no NUL
        return None
    return first[:-8]


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

"""read_pt: one open, fstat and read of a .pt file, the fast path or the general one, every error one
DumpFormatError naming the path."""

from __future__ import annotations

import errno
import os
import stat

import numpy as np

from dumpstore.errors import DumpFormatError

from .base import _WHOLE_FILE, DEFAULT_MAX_BYTES, _Bad, _one_line
from .decode import _numpy_array, _tensor_array
from .fast import _fast
from .unpickler import _CORRUPT, _SMALL_PICKLE, _NdArray, _Tensor, _unpickle, _unpickle_small
from .zipread import _Archive, _read_all


def _load(archive: _Archive, max_bytes: int) -> tuple[np.ndarray, str]:
    pkl = archive.read(archive.prefix + "data.pkl", 2 * max_bytes + (1 << 20))
    obj = _unpickle_small(pkl.tobytes()) if pkl.size <= _SMALL_PICKLE else _unpickle(pkl.data)
    if isinstance(obj, _Tensor):
        return _tensor_array(archive, obj, max_bytes), obj.dtype
    if isinstance(obj, _NdArray) and obj.array is not None:
        return _numpy_array(obj.array, max_bytes), obj.array.dtype.name
    raise _Bad(f"object is not a tensor (the pickle holds a {type(obj).__name__.lstrip('_')})")


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

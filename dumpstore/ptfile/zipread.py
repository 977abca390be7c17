"""The .pt file's zip read with its own parser: the end records and central directory of a plain zip in memory,
members with bounded inflation and checked CRCs (zipfile for anything unusual)."""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from .base import _WHOLE_FILE, _Bad, _brief, _one_line

_INFLATE_FREE = 1 << 20  # a compressed member may always expand to this much ...
_MAX_RATIO = 100  # ... and beyond it at most this many times its compressed size (a zip bomb reaches ~1000)
_CHUNK = 1 << 24  # compressed members are inflated in chunks of this size (bounds transient memory)
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

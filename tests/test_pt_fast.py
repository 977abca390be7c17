"""The .pt reader's fast path (ptfile.fast._fast) against its general path: the same arrays, dtypes, stamps and errors.

Every file is read twice, once as read_pt reads it and once with the fast path turned off (the general path: _Archive
and _load, or zipfile), and the two outcomes must be identical: the array bit for bit with its dtype, shape and flags,
or the error's class and text. The fast path must also be the one taken for what torch.save writes.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dumpstore import ptfile, tensorfile
from dumpstore.errors import DumpFormatError
from dumpstore.ptfile import fast as fast_path
from dumpstore.ptfile import reader, zipread
from dumpstore.tensorfile import MissingFile, load_leaf

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

DATA = Path(__file__).resolve().parent / "data"
SHARED = Path("/work/shared/msprobe_examples")
REAL = sorted(DATA.rglob("*.pt")) + (sorted(SHARED.rglob("*.pt")) if SHARED.is_dir() else [])


def _outcome(path: Path, **kw: Any) -> tuple:
    """What read_pt_stamped makes of `path`: the array's bytes and properties, or the error's class and text."""
    try:
        arr, dtype, stamp = ptfile.read_pt_stamped(path, **kw)
    except Exception as exc:  # any class: a difference in it is what the tests look for
        return "error", type(exc).__name__, str(exc)
    flags = arr.flags
    props = (arr.dtype.str, arr.shape, flags.c_contiguous, flags.writeable, flags.aligned, arr.dtype.isnative)
    return "array", dtype, stamp, type(arr).__name__, props, arr.tobytes()


def _general(monkeypatch: Any, path: Path, **kw: Any) -> tuple:
    with monkeypatch.context() as m:
        m.setattr(reader, "_fast", lambda _whole, _max_bytes: None)
        return _outcome(path, **kw)


def _takes_fast_path(path: Path, max_bytes: int = ptfile.DEFAULT_MAX_BYTES) -> bool:
    return fast_path._fast(np.fromfile(path, np.uint8), max_bytes) is not None


def _same_both_ways(monkeypatch: Any, path: Path, **kw: Any) -> tuple:
    fast = _outcome(path, **kw)
    assert fast == _general(monkeypatch, path, **kw), path
    return fast


# ----------------------------------------------------------------------------------------- files that read


def test_every_real_file_reads_the_same_on_both_paths(monkeypatch: Any) -> None:
    assert len(REAL) >= 3
    for path in REAL:
        assert _same_both_ways(monkeypatch, path)[0] == "array"
        assert _takes_fast_path(path), path  # all are torch.save files of plain tensors


VARIANTS = {  # what to save, made from x = 60 float64 values (built in the test, not at collection)
    "f32": lambda x: x.float(),
    "f16_3d": lambda x: x.half().reshape(3, 4, 5),
    "bf16": lambda x: x.bfloat16().reshape(6, 10),
    "f64_transposed": lambda x: x.reshape(6, 10).t(),
    "i64_sliced": lambda x: x.long().reshape(6, 10)[1:5:2, 3:9:2],
    "offset": lambda x: x.float()[7:19],
    "0d": lambda x: x.float()[3].clone(),
    "0d_view": lambda x: x.float()[5],
    "empty": lambda x: x.float()[:0].clone(),
    "bool": lambda x: (x > 0).reshape(6, 10),
    "u8": lambda x: x.abs().to(torch.uint8),
    "i8": lambda x: x.to(torch.int8),
    "fp8_e4m3fn": lambda x: x.to(torch.float8_e4m3fn),
    "fp8_e5m2": lambda x: x.to(torch.float8_e5m2).reshape(2, 30).t(),
    "c64": lambda x: (x.float() * (1 - 2j)).to(torch.complex64),
    "c64_conj": lambda x: (x.float() * (1 - 2j)).to(torch.complex64).conj(),
    "c32": lambda x: x.to(torch.complex32),
    "neg_bit": lambda x: torch.ones(3, dtype=torch.complex64).conj().imag,
    "parameter": lambda x: torch.nn.Parameter(torch.ones(2, 3)),
    "u16": lambda x: x.abs().to(torch.uint16),
    "numpy": lambda x: x.numpy().reshape(6, 10),
    "numpy_big_endian": lambda x: x.numpy().astype(">i4"),
    "numpy_bool": lambda x: (x > 0).numpy(),
    "list": lambda x: [x.float()],
    "dict": lambda x: {"a": x.float()},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_torch_save_variants_read_the_same_on_both_paths(tmp_path: Path, monkeypatch: Any, name: str) -> None:
    path = tmp_path / f"{name}.pt"
    torch.save(VARIANTS[name](torch.arange(-30, 30, dtype=torch.float64) / 7), path)
    got = _same_both_ways(monkeypatch, path)
    if name in ("list", "dict"):
        assert got[0] == "error" and "is not a tensor" in got[2]
    else:
        assert got[0] == "array"
    # plain tensors with elements take the fast path; numpy payloads, containers and empty tensors leave it
    assert _takes_fast_path(path) == (got[0] == "array" and not name.startswith("numpy") and name != "empty")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex32, torch.bool])
def test_big_endian_file_reads_the_same_on_both_paths(tmp_path: Path, monkeypatch: Any, dtype: Any) -> None:
    x = (torch.arange(12, dtype=torch.float64) - 5).to(dtype).reshape(3, 4)
    torch.save(x, tmp_path / "le.pt")
    with zipfile.ZipFile(tmp_path / "le.pt") as z:
        members = {"archive/" + n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
    width = 2 if dtype == torch.complex32 else x.element_size()
    raw = np.frombuffer(members["archive/data/0"], dtype=f"<u{width}")
    members["archive/data/0"] = raw.astype(f">u{width}").tobytes()
    members["archive/byteorder"] = b"big"
    path = tmp_path / "be.pt"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    got = _same_both_ways(monkeypatch, path)
    assert got[0] == "array" and _takes_fast_path(path)
    same = _outcome(tmp_path / "le.pt")
    assert got[4] == same[4] and got[5] == same[5]  # the same values as the little-endian file


def test_unaligned_storage_is_copied_on_both_paths(tmp_path: Path, monkeypatch: Any) -> None:
    """A storage that does not start on a 16-byte boundary (zipfile, not torch.save, wrote it) comes back copied."""
    x = torch.arange(10, dtype=torch.float64)
    torch.save(x, tmp_path / "x.pt")
    with zipfile.ZipFile(tmp_path / "x.pt") as src, zipfile.ZipFile(tmp_path / "u.pt", "w") as dst:
        for name in src.namelist():
            dst.writestr("a/" + name.split("/", 1)[1], src.read(name))
    got = _same_both_ways(monkeypatch, tmp_path / "u.pt")
    assert got[0] == "array" and got[4][4]  # aligned
    assert _takes_fast_path(tmp_path / "u.pt")


def test_max_bytes_caps_the_same_on_both_paths(monkeypatch: Any) -> None:
    path = REAL[0]
    size = _outcome(path)[5].__len__()
    for cap in (0, size - 1, size, size + 1):
        _same_both_ways(monkeypatch, path, max_bytes=cap)
    assert not _takes_fast_path(path, size - 1)
    assert _takes_fast_path(path, size)


# ----------------------------------------------------------------------------------------- files that do not


def _small_file(tmp_path: Path) -> Path:
    path = tmp_path / "s.pt"
    torch.save(torch.tensor([[1.5, -2.0], [0.25, 4.0]]), path)
    return path


def test_every_one_byte_change_reads_the_same_on_both_paths(tmp_path: Path, monkeypatch: Any) -> None:
    """Each byte of a small torch.save file flipped in turn: the fast path reads or refuses it as the general path."""
    original = _small_file(tmp_path).read_bytes()
    path = tmp_path / "m.pt"
    kinds = set()
    for at in range(len(original)):
        for mask in (0xFF, 0x01):
            changed = bytearray(original)
            changed[at] ^= mask
            path.write_bytes(changed)
            got = _same_both_ways(monkeypatch, path)
            kinds.add(got[0] if got[0] == "array" else got[2].split(": ", 1)[1][:20])
    assert "array" in kinds and len(kinds) >= 6  # untouched fields read, the rest fail in several ways


def test_every_truncation_reads_the_same_on_both_paths(tmp_path: Path, monkeypatch: Any) -> None:
    original = _small_file(tmp_path).read_bytes()
    path = tmp_path / "t.pt"
    for size in range(len(original) + 1):
        path.write_bytes(original[:size])
        assert _same_both_ways(monkeypatch, path)[0] == ("array" if size == len(original) else "error")


def test_refused_pickle_is_refused_each_time(tmp_path: Path) -> None:
    """The fast path's memo keeps descriptions of tensors, never a refusal: each read raises it again."""
    import pickle

    path = _small_file(tmp_path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    members[pkl] = pickle.dumps(os.system, protocol=2)
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(bad, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    for _ in range(2):
        with pytest.raises(DumpFormatError, match=r"bad\.pt: refused to load: pickle references posix\.system"):
            ptfile.read_pt(bad)


# ----------------------------------------------------------------------------------------- links and names


def _dump(tmp_path: Path) -> Path:
    folder = tmp_path / "dump" / "dump_tensor_data"
    folder.mkdir(parents=True)
    torch.save(torch.ones(3), folder / "x.pt")
    return folder.parent


@pytest.mark.parametrize("target", ["x.pt", "../../outside.pt", "gone.pt"])
def test_load_leaf_refuses_a_link_with_its_message(tmp_path: Path, monkeypatch: Any, target: str) -> None:
    """An lstat refuses the link before any open; read_pt_stamped's open refuses it too (O_NOFOLLOW, or where a
    platform has none, a check before the open), with load_leaf's message."""
    dump = _dump(tmp_path)
    torch.save(torch.zeros(2), tmp_path / "outside.pt")
    (dump / "dump_tensor_data" / "l.pt").symlink_to(target)
    where = dump / "dump_tensor_data" / "l.pt"
    message = f"{where}: tensor file is a link or lies outside {dump / 'dump_tensor_data'}; refusing to read it"
    for no_follow in (True, False):
        with monkeypatch.context() as m:
            if not no_follow:
                m.setattr(reader, "NO_FOLLOW", False)
                m.setattr(reader, "_NO_FOLLOW", 0)
            for lstat_sees_it in (True, False):  # False: the link made after load_leaf's lstat
                m.setattr(tensorfile, "_islink", os.path.islink if lstat_sees_it else lambda _path: False)
                with pytest.raises(DumpFormatError) as info:
                    load_leaf(dump, "l.pt")
                assert str(info.value) == message and type(info.value) is DumpFormatError
            with pytest.raises(ptfile.LinkedTensorFile, match=r"l\.pt: tensor file is a link; refusing to read it$"):
                ptfile.read_pt_stamped(where, follow_links=False)
    assert load_leaf(dump, "x.pt")[1] == "float32"
    with pytest.raises(MissingFile, match=r"tensor file .*missing\.pt is missing"):
        load_leaf(dump, "missing.pt")


def test_linked_tensor_folder_leading_outside_is_refused(tmp_path: Path) -> None:
    elsewhere = _dump(tmp_path / "else") / "dump_tensor_data"
    dump = tmp_path / "dump2"
    dump.mkdir()
    (dump / "dump_tensor_data").symlink_to(elsewhere, target_is_directory=True)
    tensorfile.forget_folders()
    base = dump / "dump_tensor_data"
    with pytest.raises(DumpFormatError) as info:
        load_leaf(dump, "x.pt")
    assert str(info.value) == f"{base}{os.sep}x.pt: tensor file is a link or lies outside {base}; refusing to read it"


NAMES = ["a.pt", "a.PT", "a.Pt", ".pt", "..pt", "...pt", "a..pt", ".a.pt", "pt", "a.pt.npy", "a.npy.pt", "a.ptx"]
NAMES += [". .pt", "a.", "a", "x.pt.", "ab.pT", ".pt.pt", "é.pt", "a.p", "a.t", ".PT", "_.pt"]


@pytest.mark.parametrize("name", NAMES)
def test_pt_names_are_what_splitext_says(name: str) -> None:
    assert tensorfile._is_pt_name(name) == (os.path.splitext(name)[1].lower() == ".pt")


def test_end_records_read_at_once_as_one_by_one(tmp_path: Path) -> None:
    """_directory_end's reading of torch.save's three end records in one gives what reading them in turn gives."""
    original = _small_file(tmp_path).read_bytes()
    tail = len(original) - zipread._TAIL64.size
    seen = set()
    for at in range(tail - 8, len(original)):
        for mask in (0xFF, 0x01):
            changed = bytearray(original)
            changed[at] ^= mask
            raw = memoryview(bytes(changed))
            got = zipread._directory_end(raw)
            assert got == zipread._end_records(raw, len(raw)), at
            seen.add(got is None)
    for size in range(len(original) + 1):
        raw = memoryview(original[:size])
        assert zipread._directory_end(raw) == zipread._end_records(raw, size)
    assert seen == {True, False}

"""Tests of the torch-free `.pt` reader: round-trips against torch.load, real msprobe files, hostile input."""

from __future__ import annotations

import collections
import io
import os
import pickle
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dumpstore.errors import DumpFormatError
from dumpstore.ptfile import read_pt

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

DATA_PT = Path(__file__).resolve().parent / "data" / "pt"
SHARED_PT = Path("/work/shared/msprobe_examples/v26.2.0/ref_tensor/step0/rank0/dump_tensor_data")

# what msprobe can dump (float16 … float8_e5m2), then the other dtypes torch.save writes for plain tensors
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex128,
    torch.complex32,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
WIDENED = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
FAST = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SPECIAL = [0.0, -0.0, 1.5, -2.25, float("nan"), float("inf"), -float("inf"), 1e-3, 300.0, 65504.0, 1e-7, 3.0]


# ----------------------------------------------------------------------------------------------- helpers


def _ref(t: Any) -> np.ndarray:
    """What torch itself says the file holds, widened like read_pt widens."""
    t = t.resolve_conj().resolve_neg()
    if t.dtype in WIDENED:
        t = t.float()
    elif t.dtype == torch.complex32:
        t = t.to(torch.complex64)
    return t.numpy()


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype.kind not in "fc":
        assert np.array_equal(got, want)
        return
    assert np.array_equal(got, want, equal_nan=True)
    for part in (np.real, np.imag) if got.dtype.kind == "c" else (np.asarray,):
        g, w = part(got), part(want)
        keep = ~np.isnan(w)
        assert np.array_equal(np.signbit(g[keep]), np.signbit(w[keep]))  # -0.0 stays -0.0


def _check_roundtrip(path: Path, tensor: Any) -> None:
    torch.save(tensor, path)
    got, dtype = read_pt(path)
    want = torch.load(path, weights_only=True)
    assert dtype == str(want.dtype).removeprefix("torch.")
    _assert_same(got, _ref(want))
    assert got.flags.c_contiguous and got.flags.writeable


def _values(dtype: Any, n: int = 60) -> Any:
    base = torch.tensor((SPECIAL * (n // len(SPECIAL) + 1))[:n], dtype=torch.float64)
    if dtype.is_floating_point or dtype.is_complex:
        out = base.to(dtype)
        return out * (1 - 2j) if dtype.is_complex else out
    return torch.arange(n, dtype=torch.int64).remainder(7 if dtype == torch.bool else 120).to(dtype)


LAYOUTS = {
    "0d": lambda x: x[3].clone(),
    "empty": lambda x: x[:0].clone(),
    "empty_0x3": lambda x: x[:0].reshape(0, 3).clone(),
    "one": lambda x: x[:1].clone(),
    "3x4x5": lambda x: x.reshape(3, 4, 5).clone(),
    "transposed": lambda x: x.reshape(3, 4, 5).transpose(0, 2),
    "sliced": lambda x: x.reshape(6, 10)[1:5:2, 3:9:2],
    "offset": lambda x: x[7:19],
}


class _FakeStorage:
    def __init__(self, key: str, numel: int, cls: Any = None) -> None:
        self.key, self.numel, self.cls = key, numel, cls or torch.FloatStorage


class _FakeTensor:
    """Pickles like a torch tensor, but with whatever offset, size and stride a test claims."""

    def __init__(self, storage: _FakeStorage, offset: Any, size: Any, stride: Any) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> Any:
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _FakeStorage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _write_zip(
    path: Path,
    pkl: bytes,
    members: dict[str, bytes],
    byteorder: bytes = b"little",
    compression: int = zipfile.ZIP_STORED,
) -> Path:
    with zipfile.ZipFile(path, "w", compression) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", byteorder)
        for key, data in members.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", b"3\n")
    return path


def _crafted(path: Path, offset: Any, size: Any, stride: Any, numel: int = 12, member_bytes: int = 48) -> Path:
    tensor = _FakeTensor(_FakeStorage("0", numel), offset, size, stride)
    data = np.arange(member_bytes // 4, dtype="<f4").tobytes()
    return _write_zip(path, _pickle(tensor), {"0": data})


def _members(path: Path) -> dict[str, bytes]:
    """Members of a torch.save zip, renamed to the `archive/` prefix (torch names it after the file)."""
    with zipfile.ZipFile(path) as z:
        return {"archive/" + name.split("/", 1)[1]: z.read(name) for name in z.namelist()}


def _rezip(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


# ----------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_roundtrip_matches_torch_load(tmp_path: Path, dtype: Any, layout: str) -> None:
    _check_roundtrip(tmp_path / "t.pt", LAYOUTS[layout](_values(dtype)))


def test_view_keeps_its_whole_storage(tmp_path: Path) -> None:
    base = torch.arange(100, dtype=torch.float32)
    view = base[10:40].reshape(5, 6)[:, ::2]
    torch.save(view, tmp_path / "v.pt")
    assert _members(tmp_path / "v.pt")["archive/data/0"] == base.numpy().tobytes()  # the premise
    got, _ = read_pt(tmp_path / "v.pt")
    np.testing.assert_array_equal(got, view.numpy())


def test_special_float_values_bitwise(tmp_path: Path) -> None:
    x = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -3.5])
    torch.save(x, tmp_path / "s.pt")
    got, dtype = read_pt(tmp_path / "s.pt")
    assert dtype == "float32" and got.tobytes() == x.numpy().tobytes()
    torch.save(x.bfloat16(), tmp_path / "b.pt")
    got, dtype = read_pt(tmp_path / "b.pt")
    assert dtype == "bfloat16" and got.tobytes() == x.bfloat16().float().numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_every_float8_code(tmp_path: Path, dtype: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype))
    torch.save(codes, tmp_path / "f8.pt")
    got, name = read_pt(tmp_path / "f8.pt")
    assert name == dtype
    _assert_same(got, codes.float().numpy())


def test_conj_bit_and_parameter(tmp_path: Path) -> None:
    z = (torch.arange(6.0).reshape(2, 3) * (1 + 2j)).to(torch.complex64)
    _check_roundtrip(tmp_path / "c.pt", z.conj())
    got, dtype = read_pt(_save(tmp_path / "p.pt", torch.nn.Parameter(torch.ones(2, 3))))
    assert dtype == "float32" and np.array_equal(got, np.ones((2, 3), np.float32))


def _save(path: Path, obj: Any) -> Path:
    torch.save(obj, path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex32, torch.uint16])
def test_big_endian_file(tmp_path: Path, dtype: Any) -> None:
    x = _values(dtype, 12).reshape(3, 4)
    members = _members(_save(tmp_path / "le.pt", x))
    width = 2 if dtype == torch.complex32 else x.element_size()
    raw = np.frombuffer(members["archive/data/0"], dtype=f"<u{width}")
    members["archive/data/0"] = raw.astype(f">u{width}").tobytes()
    members["archive/byteorder"] = b"big"
    path = _rezip(tmp_path / "be.pt", members)
    got, _ = read_pt(path)
    _assert_same(got, _ref(x))
    assert got.dtype.isnative
    if dtype not in (torch.complex32, torch.uint16):  # torch.load skips byteswap of _rebuild_tensor_v3 data
        _assert_same(got, _ref(torch.load(path, weights_only=True)))


def test_compressed_and_large_files(tmp_path: Path) -> None:
    x = torch.randn(3, 4)
    deflated = _rezip(tmp_path / "z.pt", _members(_save(tmp_path / "x.pt", x)), zipfile.ZIP_DEFLATED)
    np.testing.assert_array_equal(read_pt(deflated)[0], x.numpy())
    big = torch.arange(1_200_000, dtype=torch.float32)[::2]  # 4.8 MB file: streamed, not read whole
    got, _ = read_pt(_save(tmp_path / "big.pt", big))
    np.testing.assert_array_equal(got, big.numpy())


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(6).reshape(2, 3),
        np.zeros((2, 3), np.float16).T,
        np.array(3.5),
        np.arange(4, dtype=">i4"),
        np.array([True, False]),
        np.array([1 + 2j], np.complex64),
        np.float64(2.5),
    ],
    ids=["int64", "fortran_f16", "0d", "big_endian", "bool", "complex", "scalar"],
)
def test_numpy_payload(tmp_path: Path, arr: np.ndarray) -> None:
    got, dtype = read_pt(_save(tmp_path / "n.pt", arr))
    assert dtype == np.asarray(arr).dtype.name and got.dtype.isnative and got.flags.c_contiguous
    np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize(
    "arr",
    [np.array([1, "a"], dtype=object), np.zeros(2, dtype=[("a", "<f4")]), np.array(["ab"])],
    ids=["object", "structured", "str"],
)
def test_numpy_payload_refused(tmp_path: Path, arr: np.ndarray) -> None:
    with pytest.raises(DumpFormatError, match=r"n\.pt: refused to load: "):
        read_pt(_save(tmp_path / "n.pt", arr))


_FLOATS = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
_INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


@FAST
@given(data=st.data(), dtype=st.sampled_from(_FLOATS + _INTS), layout=st.sampled_from(["c", "t", "slice"]))
def test_property_roundtrip(tmp_path: Path, data: st.DataObject, dtype: Any, layout: str) -> None:
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    if dtype in _INTS:
        low, high = {torch.bool: (0, 1), torch.uint8: (0, 255)}.get(dtype, (-100, 100))
        arr = data.draw(hnp.arrays(np.int64, shape, elements=st.integers(low, high)))
    else:
        floats = st.floats(allow_nan=True, allow_infinity=True)
        arr = data.draw(hnp.arrays(np.float64, shape, elements=floats))
    x = torch.from_numpy(arr).to(dtype)
    if layout == "t" and x.dim() >= 2:
        x = x.transpose(0, -1)
    elif layout == "slice" and x.dim() >= 1:
        x = x[1::2]
    _check_roundtrip(tmp_path / "h.pt", x)


# ----------------------------------------------------------------------------------------- real msprobe files


@pytest.mark.parametrize("path", sorted(DATA_PT.glob("*.pt")), ids=lambda p: p.name)
def test_real_msprobe_files(path: Path) -> None:
    got, dtype = read_pt(path)
    want = torch.load(path, weights_only=True)
    assert dtype == str(want.dtype).removeprefix("torch.")
    _assert_same(got, want.numpy())


def test_all_shared_example_files() -> None:
    if not SHARED_PT.is_dir():
        pytest.skip(f"{SHARED_PT} not present")
    files = sorted(SHARED_PT.glob("*.pt"))
    assert files
    for path in files:
        got, _ = read_pt(path)
        _assert_same(got, torch.load(path, weights_only=True).numpy())


def test_reader_does_not_import_torch() -> None:
    path = next(DATA_PT.glob("*.pt"))
    code = (
        f"import sys; from dumpstore.ptfile import read_pt; read_pt({str(path)!r}); "
        "assert 'torch' not in sys.modules and 'pickle' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------- hostile input


class _RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return os.system, (f"touch {self.marker}",)


class _Evals:
    def __reduce__(self) -> Any:
        return eval, ("1 + 1",)


def test_pickle_running_a_shell_command_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = _save(tmp_path / "evil.pt", _RunsShell(marker))
    message = (
        r"evil\.pt: refused to load: pickle references (posix|nt|os)\.system; "
        "only plain tensors are accepted"
    )
    with pytest.raises(DumpFormatError, match=message):
        read_pt(path)
    assert not marker.exists()


def test_pickle_referencing_eval_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "eval.pt", {"x": torch.ones(2), "y": _Evals()})
    msg = f"{path}: refused to load: pickle references builtins.eval; only plain tensors are accepted"
    with pytest.raises(DumpFormatError) as err:
        read_pt(path)
    assert str(err.value) == msg


def test_build_on_allowed_global_is_refused(tmp_path: Path) -> None:
    pkl = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00}q\x01b."  # BUILD sets state on the function
    with pytest.raises(DumpFormatError, match="refused to load: pickle sets state"):
        read_pt(_write_zip(tmp_path / "b.pt", pkl, {}))


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", r"not a zip file, or truncated"),
        (bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)), "not a zip file, or truncated"),
    ],
)
def test_not_a_zip(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "junk.pt"
    path.write_bytes(content)
    with pytest.raises(DumpFormatError, match=rf"junk\.pt: {message}"):
        read_pt(path)


def test_truncated_zip(tmp_path: Path) -> None:
    data = _save(tmp_path / "t.pt", torch.ones(100)).read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(DumpFormatError, match=r"t\.pt: not a zip file, or truncated"):
        read_pt(tmp_path / "t.pt")


def test_legacy_format_and_missing_file(tmp_path: Path) -> None:
    torch.save(torch.ones(2), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(DumpFormatError, match="legacy .non-zip. torch.save format is not supported"):
        read_pt(tmp_path / "old.pt")
    with pytest.raises(DumpFormatError, match=r"nope\.pt: cannot read tensor file: No such file"):
        read_pt(tmp_path / "nope.pt")


def test_special_files_are_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / "zero.pt").symlink_to("/dev/zero")
    for name in ("fifo.pt", "zero.pt"):
        with pytest.raises(DumpFormatError, match=rf"{name}: not a regular file"):
            read_pt(tmp_path / name)


def test_zip_without_data_pkl(tmp_path: Path) -> None:
    path = _rezip(tmp_path / "z.pt", {"archive/version": b"3\n", "../evil/data.pkl": b"."})
    message = r"z\.pt: zip holds no <archive>/data\.pkl; not a torch\.save file"
    with pytest.raises(DumpFormatError, match=message):
        read_pt(path)


def test_corrupt_storage_bytes_fail_crc(tmp_path: Path) -> None:
    members = _members(_save(tmp_path / "x.pt", torch.ones(8)))
    members["archive/data/0"] = b"\x00" * len(members["archive/data/0"])
    path = tmp_path / "x.pt"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    raw = bytearray(path.read_bytes())
    start = raw.index(b"\x00" * 32)
    raw[start] = 1  # flip one storage byte behind the CRC's back
    path.write_bytes(bytes(raw))
    with pytest.raises(DumpFormatError, match="fails its CRC check"):
        read_pt(path)


def test_crafted_file_reads_when_claims_are_true(tmp_path: Path) -> None:
    got, dtype = read_pt(_crafted(tmp_path / "ok.pt", 2, (2, 3), (1, 2)))
    assert dtype == "float32"
    np.testing.assert_array_equal(got, np.array([[2, 4, 6], [3, 5, 7]], np.float32))  # storage[2 + i + 2j]


@pytest.mark.parametrize(
    "offset, size, stride, numel, member, message",
    [
        (
            0,
            (4, 4),
            (4, 1),
            12,
            48,
            (
                r"storage too small: float32 shape \[4, 4\] stride \[4, 1\] offset 0 "
                r"needs 16 elements, storage 0 holds 12"
            ),
        ),
        (10, (3,), (1,), 12, 48, "storage too small"),
        (0, (3,), (6,), 12, 48, "storage too small"),
        (0, (12,), (1,), 12, 20, r"zip member archive/data/0 holds 20 bytes, pickle claims 48"),
        (0, (-1, 3), (3, 1), 12, 48, r"corrupt pickle: size \[-1, 3\] holds a negative or non-int entry"),
        (0, (3,), (-1,), 12, 48, "corrupt pickle: stride"),
        (-1, (3,), (1,), 12, 48, "corrupt pickle: storage offset -1"),
        (0, (3, 4), (1,), 12, 48, "differ in length"),
        (0, ("3",), (1,), 12, 48, "non-int"),
        (0, (1,) * 65, (1,) * 65, 12, 48, "at most 64 ints"),
    ],
)
def test_inconsistent_claims(
    tmp_path: Path, offset: Any, size: Any, stride: Any, numel: int, member: int, message: str
) -> None:
    path = _crafted(tmp_path / "c.pt", offset, size, stride, numel, member)
    with pytest.raises(DumpFormatError, match=rf"c\.pt: (corrupt pickle: )?.*{message}"):
        read_pt(path)


def test_bool_storage_bytes_other_than_one_are_true(tmp_path: Path) -> None:
    tensor = _FakeTensor(_FakeStorage("0", 4, torch.BoolStorage), 0, (4,), (1,))
    path = _write_zip(tmp_path / "b.pt", _pickle(tensor), {"0": bytes([0, 1, 2, 255])})
    got, dtype = read_pt(path)
    assert dtype == "bool" and got.tolist() == [False, True, True, True]
    assert got.view(np.uint8).tolist() == [0, 1, 1, 1]


def test_missing_storage_member(tmp_path: Path) -> None:
    path = _write_zip(tmp_path / "m.pt", _pickle(_FakeTensor(_FakeStorage("7", 3), 0, (3,), (1,))), {})
    with pytest.raises(DumpFormatError, match=r"m\.pt: zip member archive/data/7 is missing"):
        read_pt(path)


@pytest.mark.parametrize("key", ["../../etc/passwd", "/abs", "a/b", ""])
def test_storage_key_outside_archive_is_refused(tmp_path: Path, key: str) -> None:
    path = _write_zip(tmp_path / "k.pt", _pickle(_FakeTensor(_FakeStorage(key, 3), 0, (3,), (1,))), {})
    with pytest.raises(DumpFormatError, match="bad storage key"):
        read_pt(path)


def test_huge_claims_refused_without_allocating(tmp_path: Path) -> None:
    shape_bomb = _crafted(tmp_path / "s.pt", 0, (10**6, 10**6), (10**6, 1), numel=10**12)
    storage_bomb = _crafted(tmp_path / "st.pt", 0, (3,), (1,), numel=10**12)
    tracemalloc.start()
    try:
        with pytest.raises(DumpFormatError, match=r"s\.pt: tensor of shape \[1000000, 1000000\] .*max_bytes"):
            read_pt(shape_bomb)
        with pytest.raises(DumpFormatError, match=r"st\.pt: storage 0 claims 4000000000000 bytes"):
            read_pt(storage_bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_max_bytes_caps_a_real_file(tmp_path: Path) -> None:
    path = _save(tmp_path / "x.pt", torch.ones(100))
    with pytest.raises(DumpFormatError, match=r"exceeds max_bytes=64"):
        read_pt(path, max_bytes=64)
    assert read_pt(path, max_bytes=400)[0].shape == (100,)


@pytest.mark.parametrize("obj, kind", [({"a": 1}, "dict"), ([1.0], "list"), (3, "int")])
def test_object_that_is_not_a_tensor(tmp_path: Path, obj: Any, kind: str) -> None:
    message = rf"o\.pt: object is not a tensor \(the pickle holds a {kind}\)"
    with pytest.raises(DumpFormatError, match=message):
        read_pt(_save(tmp_path / "o.pt", obj))


def test_tensor_in_a_container_is_not_a_tensor(tmp_path: Path) -> None:
    with pytest.raises(DumpFormatError, match=r"object is not a tensor \(the pickle holds a list\)"):
        read_pt(_save(tmp_path / "l.pt", [torch.ones(2)]))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("kind, rebuild", [("sparse", "_rebuild_sparse_tensor"), ("quantized", "_rebuild_qtensor")])
def test_unsupported_tensor_kinds_are_refused(tmp_path: Path, kind: str, rebuild: str) -> None:
    x = torch.ones(2)
    x = x.to_sparse() if kind == "sparse" else torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
    with pytest.raises(DumpFormatError, match=f"refused to load: pickle references torch._utils.{rebuild}; "):
        read_pt(_save(tmp_path / "u.pt", x))


@FAST
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, 10**6),
)
def test_fuzzed_pickle_only_raises_dump_format_error(
    tmp_path: Path, edits: list[tuple[int, int]], cut: int | None
) -> None:
    members = _members(_save(tmp_path / "f.pt", torch.arange(6.0).reshape(2, 3).t()))
    pkl = bytearray(members["archive/data.pkl"])
    for pos, value in edits:
        pkl[pos % len(pkl)] = value
    members["archive/data.pkl"] = bytes(pkl[: cut % len(pkl)] if cut is not None else pkl)
    path = _rezip(tmp_path / "f.pt", members)
    try:
        got, _ = read_pt(path)
    except DumpFormatError as exc:
        assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
    else:
        assert isinstance(got, np.ndarray)


def test_pickle_claiming_huge_bytes_object_is_refused(tmp_path: Path) -> None:
    """BINBYTES8 with an 8-byte length makes pickle allocate before reading: a one-line error, not MemoryError."""
    members = _members(_save(tmp_path / "f.pt", torch.arange(6.0)))
    members["archive/data.pkl"] = b"\x8e" + members["archive/data.pkl"][1:]
    path = _rezip(tmp_path / "f.pt", members)
    with pytest.raises(DumpFormatError, match=str(path)):
        read_pt(path)


# ----------------------------------------------------------------------------------------------- in-memory zip path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_small_files_parse_their_own_directory_like_zipfile(tmp_path: Path, monkeypatch: Any, dtype: Any) -> None:
    """A torch.save file (zip64 end records) takes the in-memory path; zipfile reads it the same."""
    from dumpstore.ptfile import reader, zipread

    path = _save(tmp_path / "x.pt", torch.arange(-20, 40).reshape(6, 10).to(dtype).t())
    assert zipread._central_directory(np.fromfile(path, np.uint8)) is not None
    fast = read_pt(path)
    monkeypatch.setattr(zipread, "_central_directory", lambda _data: None)
    monkeypatch.setattr(reader, "_fast", lambda _whole, _max_bytes: None)  # which reads the directory too
    slow = read_pt(path)
    assert fast[1] == slow[1]
    _assert_same(fast[0], slow[0])
    assert fast[0].flags.writeable and fast[0].flags.c_contiguous


def test_unusual_zips_are_left_to_zipfile(tmp_path: Path) -> None:
    from dumpstore.ptfile import zipread

    members = _members(_save(tmp_path / "x.pt", torch.ones(5)))
    plain = _rezip(tmp_path / "plain.pt", members)
    assert zipread._central_directory(np.fromfile(plain, np.uint8)) is not None
    with zipfile.ZipFile(tmp_path / "comment.pt", "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.comment = b"hello"
    deflated = _rezip(tmp_path / "z.pt", members, zipfile.ZIP_DEFLATED)
    for path in (tmp_path / "comment.pt", deflated):
        assert zipread._central_directory(np.fromfile(path, np.uint8)) is None
        np.testing.assert_array_equal(read_pt(path)[0], np.ones(5, np.float32))


@pytest.mark.parametrize("field, value", [(42, 1 << 30), (42, 10), (20, 1 << 20), (28, 200)])
def test_lying_central_directory_is_one_error(tmp_path: Path, field: int, value: int) -> None:
    """A directory entry whose offset or sizes lie (in the in-memory path) is a DumpFormatError."""
    path = _rezip(tmp_path / "x.pt", _members(_save(tmp_path / "x.pt", torch.ones(5))))
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"PK\x01\x02", raw.index(b"PK\x01\x02") + 1)  # the second member's directory entry
    width = 2 if field == 28 else 4
    raw[entry + field : entry + field + width] = value.to_bytes(width, "little")
    path.write_bytes(bytes(raw))
    try:
        got, _dtype = read_pt(path)
    except DumpFormatError:
        return
    np.testing.assert_array_equal(got, np.ones(5, np.float32))  # a lie about a member it does not read

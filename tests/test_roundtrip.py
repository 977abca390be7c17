"""Property tests: tensors written as files or as an msprobe dump come back from the store exactly.

Every array is ingested, queried back with SQL and checked against numpy's float64 results on the same values:
dtype, shape, numel, min/max/mean/norm, value counts, the deterministic sample and the linear sketch.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DumpWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dumpstore import summary
from dumpstore._ingest import IngestOptions, ingest
from dumpstore.dtypes import finfo_max
from dumpstore.query import run_query
from dumpstore.store import open_store
from helpers import leaf

SETTINGS = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
NUMPY_DTYPES = ("float16", "float32", "float64", "int8", "int32", "int64", "bool")
SHAPES = ((), (0,), (0, 3), (1,), (7,), (3, 4), (2, 3, 5), (40,))
COLUMNS = (
    "name, dtype, shape, numel, min, max, mean, norm, nan_count, posinf_count, neginf_count, zero_count, "
    "sat_count, sample, sketch, file_status, stats_source, error"
)


def _torch():
    return pytest.importorskip("torch")


def _specials(dtype: str) -> list[float]:
    big = finfo_max(dtype)
    return [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -1.0, big, -big]


def _float_elements(dtype: str) -> st.SearchStrategy[float]:
    width = {"float16": 16, "float32": 32, "float64": 64, "bfloat16": 32}[dtype]
    return st.one_of(st.sampled_from(_specials(dtype)), st.floats(width=width))


@st.composite
def tensors(draw: st.DrawFn, *, allow_bf16: bool = True) -> tuple[str, Any]:
    """(dtype name, values): a numpy array, or for bfloat16 a float32 array of bf16-representable values."""
    dtype = draw(st.sampled_from(NUMPY_DTYPES + (("bfloat16",) if allow_bf16 else ())))
    shape = draw(st.sampled_from(SHAPES))
    if dtype == "bfloat16":
        torch = _torch()
        a32 = draw(hnp.arrays(np.float32, shape, elements=_float_elements(dtype)))
        return dtype, torch.from_numpy(a32).to(torch.bfloat16).float().numpy()
    elements = _float_elements(dtype) if dtype.startswith("float") else None
    return dtype, draw(hnp.arrays(np.dtype(dtype), shape, elements=elements))


def _to_torch(dtype: str, values: np.ndarray):
    torch = _torch()
    t = torch.from_numpy(values.copy(order="C"))  # ascontiguousarray would make 0-d 1-d
    return t.to(torch.bfloat16) if dtype == "bfloat16" else t


def _save(path_no_suffix: Path, dtype: str, values: np.ndarray, fmt: str) -> str:
    """Write one tensor file (bf16 always as .pt, msprobe's PyTorch format); return its file name."""
    if fmt == "pt" or dtype == "bfloat16":
        _torch().save(_to_torch(dtype, values), path_no_suffix.with_name(path_no_suffix.name + ".pt"))
        return path_no_suffix.name + ".pt"
    np.save(path_no_suffix.with_name(path_no_suffix.name + ".npy"), values)
    return path_no_suffix.name + ".npy"


def _rows(store: Path, run: str) -> dict[str, dict[str, Any]]:
    table = run_query(open_store(store), f"select {COLUMNS} from tensors where run='{run}' and kind='tensor'")
    return {r["name"]: r for r in table.to_pylist()}


def _same_floats(got: list[float] | None, want: np.ndarray) -> bool:
    """Bit-for-bit equality (NaN equals NaN, -0.0 differs from 0.0)."""
    g = np.asarray(got if got is not None else [], dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    return g.shape == w.shape and bool(np.array_equal(g.view(np.uint64), w.view(np.uint64)))


def _check(row: dict[str, Any], dtype: str, values: np.ndarray, opts: IngestOptions) -> None:
    a = values.astype(np.float64).reshape(-1)
    n = a.size
    assert row["error"] is None and row["file_status"] == "loaded" and row["stats_source"] == "tensor"
    assert row["dtype"] == dtype
    assert row["shape"] == list(values.shape)
    assert row["numel"] == n
    if n == 0:
        assert (row["min"], row["max"], row["mean"], row["norm"]) == (None, None, None, None)
    else:
        with np.errstate(all="ignore"):
            want_min, want_max, want_mean, want_norm = a.min(), a.max(), a.mean(), np.sqrt((a * a).sum())
        for got, want in ((row["min"], want_min), (row["max"], want_max)):
            assert got == want or (np.isnan(got) and np.isnan(want)), (got, want)
        for got, want in ((row["mean"], want_mean), (row["norm"], want_norm)):
            assert (np.isnan(got) and np.isnan(want)) or got == pytest.approx(want, rel=1e-12, abs=0), (got, want)
    assert row["nan_count"] == int(np.isnan(a).sum())
    assert row["posinf_count"] == int((a == np.inf).sum())
    assert row["neginf_count"] == int((a == -np.inf).sum())
    assert row["zero_count"] == int((a == 0).sum())
    fmax = finfo_max(dtype)
    assert row["sat_count"] == (int((np.abs(a) == fmax).sum()) if fmax is not None else 0)
    assert _same_floats(row["sample"], a[summary.sample_positions(n, opts.sample_k)])
    assert len(row["sketch"]) == min(n, opts.sketch_m)
    assert _same_floats(row["sketch"], summary.sketch(values, opts.sketch_m))


options = st.builds(IngestOptions, sample_k=st.sampled_from([1, 5, 64]), sketch_m=st.sampled_from([1, 4, 16, 512]))


@SETTINGS
@given(
    arrays=st.lists(tensors(), min_size=1, max_size=4),
    fmts=st.lists(st.sampled_from(["npy", "pt"]), min_size=4, max_size=4),
    opts=options,
)
def test_plain_folder_roundtrip(arrays, fmts, opts):
    if "pt" in fmts:
        _torch()
    with tempfile.TemporaryDirectory() as tmp:
        folder, store = Path(tmp) / "tensors", Path(tmp) / "store"
        folder.mkdir()
        for i, ((dtype, values), fmt) in enumerate(zip(arrays, fmts)):
            _save(folder / f"t{i}", dtype, values, fmt)
        res = ingest(folder, "files", store=store, options=opts, jobs=1)
        assert (res.rows, res.errors) == (len(arrays), 0), res.first_error
        rows = _rows(store, "files")
        assert len(rows) == len(arrays)
        for i, (dtype, values) in enumerate(arrays):
            _check(rows[f"t{i}"], dtype, values, opts)


@SETTINGS
@given(
    arrays=st.lists(tensors(), min_size=1, max_size=4),
    fmts=st.lists(st.sampled_from(["npy", "pt"]), min_size=4, max_size=4),
    opts=options,
)
def test_msprobe_dump_roundtrip(arrays, fmts, opts):
    if "pt" in fmts:
        _torch()
    with tempfile.TemporaryDirectory() as tmp:
        writer, store = DumpWriter(Path(tmp) / "dump", "tensor"), Path(tmp) / "store"
        records: dict[str, dict[str, list]] = {}
        pt_files: list[tuple[str, str, np.ndarray]] = []
        for i, ((dtype, values), fmt) in enumerate(zip(arrays, fmts)):
            key = f"Functional.op{i}.0.forward"
            if fmt == "pt" or dtype == "bfloat16":  # msprobe's PyTorch file: torch.save in the original dtype
                records[key] = {"input_args": [leaf(values, stats=(), data_name=f"{key}.input.0.pt", dtype=dtype)]}
                pt_files.append((key, dtype, values))
            else:  # the writer saves the array as .npy and writes its statistics
                records[key] = {"input_args": [values]}
        with np.errstate(all="ignore"):  # the writer's dumper statistics overflow on finfo.max values
            dump_json = writer.write(records)
        for key, dtype, values in pt_files:
            _save(dump_json.parent / "dump_tensor_data" / f"{key}.input.0", dtype, values, "pt")
        res = ingest(writer.root, "dump", store=store, options=opts, jobs=1)
        assert (res.rows, res.errors) == (len(arrays), 0), res.first_error
        rows = _rows(store, "dump")
        for i, (dtype, values) in enumerate(arrays):
            _check(rows[f"Functional.op{i}.0.forward.input.0"], dtype, values, opts)


@settings(max_examples=30, deadline=None, database=None)
@given(numel=st.integers(0, 3000), k=st.integers(1, 100), data=st.data())
def test_sample_positions_depend_only_on_numel(numel, k, data):
    """Two different tensors of one numel, ingested as two runs, are sampled at the same positions."""
    shape_b = data.draw(st.sampled_from([(numel,), (1, numel), (numel, 1)]))
    a = np.arange(numel, dtype=np.int64)  # value == flat position, so the sample shows the positions
    b = np.arange(numel, dtype=np.float64).reshape(shape_b)
    pos = summary.sample_positions(numel, k)
    assert np.array_equal(pos, summary.sample_positions(numel, k))
    assert len(pos) == min(k, numel) and len(set(pos.tolist())) == len(pos)
    assert all(0 <= p < numel for p in pos.tolist()) and pos.tolist() == sorted(pos.tolist())
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        for run, arr, name in (("one", a, "x"), ("two", b, "some_other_name")):
            folder = Path(tmp) / run
            folder.mkdir()
            np.save(folder / f"{name}.npy", arr)
            ingest(folder, run, store=store, options=IngestOptions(sample_k=k), jobs=1)
        got = run_query(open_store(store), "select run, sample from tensors order by run").to_pylist()
    assert [r["run"] for r in got] == ["one", "two"]
    assert got[0]["sample"] == got[1]["sample"] == [float(p) for p in pos.tolist()]


@settings(max_examples=10, deadline=None, database=None)
@given(arrays=st.lists(tensors(allow_bf16=False), min_size=1, max_size=3))
def test_reingest_differs_only_in_ingest_id(arrays):
    """The same folder ingested as two runs gives identical rows apart from run and ingest_id."""
    with tempfile.TemporaryDirectory() as tmp:
        folder, store = Path(tmp) / "tensors", Path(tmp) / "store"
        folder.mkdir()
        for i, (_dtype, values) in enumerate(arrays):
            np.save(folder / f"t{i}.npy", values)
        ingest(folder, "a", store=store, jobs=1)
        ingest(folder, "b", store=store, jobs=1)
        rows = run_query(open_store(store), "select * exclude (ingest_id) from tensors order by run, leaf").to_pylist()
    n = len(arrays)
    first, second = rows[:n], rows[n:]
    assert {r["run"] for r in first} == {"a"} and {r["run"] for r in second} == {"b"}
    for x, y in zip(first, second):
        x.pop("run"), y.pop("run")
        assert json.dumps(x, sort_keys=True, default=str) == json.dumps(y, sort_keys=True, default=str)


def test_sat_count_with_nan():
    s = summary.tensor_stats(np.array([np.nan, 65504.0, -65504.0, 1.0], np.float16), "float16")
    assert s.nan_count == 1 and s.sat_count == 2

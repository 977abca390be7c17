"""`--exact` compares each pair of tensor contents once (content hashes recorded at ingest): the rows are those of
reading every file pair, column for column, on the sample dumps and on identical NaN/Inf/zero/0-d/empty tensors."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from dumpstore import tensorfile
from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.schema import TENSOR_FILE_COLUMNS
from dumpstore.store import open_store
from helpers import ExactLoads

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"
PAIRS = [
    ("weight_1pct_tensor", "ref_tensor"),
    ("bf16_tensor", "ref_tensor"),
    ("gelu_tanh_tensor", "ref_tensor"),
    ("ref_tensor", "ref_tensor_again"),  # every pair identical
    ("xdev_clean_tensor", "xdev_ref_tensor"),
    ("xdev_weight5pct_tensor", "xdev_ref_tensor"),
    ("xdev_no_mask_tensor", "xdev_ref_tensor"),
]


def _without_hashes(store: Path, to: Path) -> Path:
    """A copy of `store` as a store written before content hashes (the columns dropped from every file)."""
    shutil.copytree(store, to)
    for path in glob.glob(str(to / "**" / "*.parquet"), recursive=True, include_hidden=True):
        table = pq.read_table(path)
        if set(TENSOR_FILE_COLUMNS) <= set(table.column_names):
            pq.write_table(table.drop_columns(list(TENSOR_FILE_COLUMNS)), path)
    return to


def _exact_rows(store: Path, target: str, ref: str, loads: ExactLoads) -> tuple[pl.DataFrame, int]:
    before = loads.n
    rows = compare_runs(open_store(store), target, ref, exact=True).rows
    return rows, loads.n - before


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    names = sorted({n for pair in PAIRS for n in pair} - {"ref_tensor_again"})
    for name in names:
        ingest(SAMPLES / name, name, store=root / "new", jobs=1)
    ingest(SAMPLES / "ref_tensor", "ref_tensor_again", store=root / "new", jobs=1)
    return root / "new", _without_hashes(root / "new", root / "old")


def _hash_pairs(store: Path, target: str, ref: str, rows: pl.DataFrame) -> list[tuple[bytes, bytes]]:
    """The (target, ref) content hashes of the rows that both sides loaded, read from the store's files."""
    con = open_store(store)
    known = {}
    for run in (target, ref):
        for pattern in con.tensor_files([run]):
            for path in glob.glob(pattern, include_hidden=True):
                t = pq.read_table(path, columns=["data_name", "content_hash", "file_status"]).to_pylist()
                step = int(path.split("/step=")[1].split("/")[0])
                known[run] = known.get(run, {}) | {(step, r["data_name"]): r["content_hash"] for r in t}
    cand = rows.filter((pl.col("file_status") == "loaded") & (pl.col("ref_file_status") == "loaded"))
    return [
        (known[target][(s, d)], known[ref][(s, rd)])
        for s, d, rd in cand.select("step", "data_name", "ref_data_name").iter_rows()
    ]


@pytest.mark.parametrize("target, ref", PAIRS)
def test_reused_rows_equal_read_rows(stores, monkeypatch, target, ref):
    new, old = stores
    loads = ExactLoads(monkeypatch)
    reused, n_reused = _exact_rows(new, target, ref, loads)
    read, n_read = _exact_rows(old, target, ref, loads)
    assert reused.columns == read.columns and reused.height == read.height
    for c in reused.columns:  # repr: NaN equals NaN, -0.0 differs from 0.0, every float bit by bit
        assert repr(reused[c].to_list()) == repr(read[c].to_list()), c
    pairs = _hash_pairs(new, target, ref, reused)
    assert n_read == 2 * len(pairs) and len(pairs) > 100
    assert n_reused == sum(1 if a == b else 2 for a, b in set(pairs))
    assert n_reused < n_read
    if target == "ref_tensor":
        assert n_reused == len(set(pairs)) and set(reused.filter(pl.col("err_source") == "exact")["err"]) == {0.0}


def _edge_arrays() -> dict[str, np.ndarray]:
    nan = np.array([1.0, np.nan, -2.0, 0.0], np.float32)
    return {
        "nan": nan,
        "nan_again": nan.copy(),
        "inf": np.array([np.inf, -np.inf, 3.0], np.float32),
        "all_nan": np.full(3, np.nan, np.float32),
        "zeros": np.zeros((2, 3), np.float32),
        "neg_zero": np.array([-0.0, 0.0], np.float32),
        "scalar": np.array(2.5, np.float32),
        "scalar_nan": np.array(np.nan, np.float32),
        "scalar_inf": np.array(-np.inf, np.float32),
        "one": np.array([7.0], np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "ints": np.arange(-3, 9, dtype=np.int64),
        "bools": np.array([True, False, True]),
        "huge": np.array([1e200, -3e200, 5e199], np.float64),  # the squares overflow: msprobe's cosine is NaN
        "tiny": np.array([1e-170, 2e-170], np.float64),  # the norm is below eps
        "big_ratio": np.array([1e-30, 1.0, 3e5], np.float32),
    }


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # the dump writer's statistics of inf and 1e200
def test_identical_edge_tensors_and_repeated_pairs(dump_writer, monkeypatch, tmp_path):
    arrays = _edge_arrays()
    rng = np.random.default_rng(3)
    base = rng.standard_normal(50).astype(np.float32)
    other = base * np.float32(1.01)
    recs_t, recs_r = {}, {}
    for i, (name, a) in enumerate(arrays.items()):
        changed = a.copy()
        if name in ("nan", "inf") and a.size:
            changed[-1] = a[-1] + 1  # same NaN/Inf positions, one value differs
        recs_t[f"Functional.{name}.{i}.forward"] = {"input_args": [a], "output": [changed]}
        recs_r[f"Functional.{name}.{i}.forward"] = {"input_args": [a.copy()], "output": [a.copy()]}
    for i in range(4):  # the same differing pair at four leaves: compared once
        recs_t[f"Functional.linear.{i}.forward"] = {"input_args": [base], "output": [other]}
        recs_r[f"Functional.linear.{i}.forward"] = {"input_args": [base], "output": [base]}
    store = tmp_path / "store"
    t_dump = dump_writer("t").write(recs_t).parent.parent.parent
    r_dump = dump_writer("r").write(recs_r).parent.parent.parent
    ingest(t_dump, "t", store=store, jobs=1)
    ingest(r_dump, "r", store=store, jobs=1)
    old = _without_hashes(store, tmp_path / "old")
    loads = ExactLoads(monkeypatch)
    reused, n_reused = _exact_rows(store, "t", "r", loads)
    read, n_read = _exact_rows(old, "t", "r", loads)
    for c in reused.columns:
        assert repr(reused[c].to_list()) == repr(read[c].to_list()), c
    leaves = 2 * len(arrays) + 8
    assert n_read == 2 * leaves
    # pairs of equal contents, one read each: the edge inputs (nan and nan_again hold one content; the unchanged
    # outputs are those same contents) and linear's input; two reads each: the nan and inf outputs, linear's output
    assert n_reused == (len(arrays) - 1) + 1 + 2 * 2 + 2
    by = {r["name"]: r for r in reused.iter_rows(named=True)}
    nan_in = by["Functional.nan.0.forward.input.0"]
    assert (nan_in["err"], nan_in["nonfinite_mismatch"], nan_in["status"]) == (0.0, False, "pass")
    assert by["Functional.huge.13.forward.input.0"]["msprobe_cosine"] == "Nan"
    assert by["Functional.tiny.14.forward.input.0"]["msprobe_cosine"] == "1.0"
    assert by["Functional.scalar_nan.7.forward.input.0"]["msprobe_max_abs_err"] == "Nan"
    assert by["Functional.empty.10.forward.input.0"]["msprobe_cosine"] == "unsupported"


def test_changed_files_are_read_again(tmp_path, monkeypatch):
    """A file whose size or mtime changed since ingest is read (its pair is not taken from the hashes)."""
    for run in ("ref_tensor", "weight_1pct_tensor"):
        shutil.copytree(SAMPLES / run, tmp_path / run)
        ingest(tmp_path / run, run, store=tmp_path / "store", jobs=1)
    loads = ExactLoads(monkeypatch)
    rows, n_before = _exact_rows(tmp_path / "store", "weight_1pct_tensor", "ref_tensor", loads)
    same = rows.filter(pl.col("msprobe_cosine") == "1.0").filter(pl.col("err") == 0.0)
    touched = tmp_path / "weight_1pct_tensor" / "step0" / "rank0" / "dump_tensor_data" / same["data_name"][0]
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
    again, n_after = _exact_rows(tmp_path / "store", "weight_1pct_tensor", "ref_tensor", loads)
    pairs = _hash_pairs(tmp_path / "store", "weight_1pct_tensor", "ref_tensor", rows)
    both = rows.filter((pl.col("file_status") == "loaded") & (pl.col("ref_file_status") == "loaded"))
    touched_pair = pairs[both["data_name"].to_list().index(touched.name)]
    shared = pairs.count(touched_pair) > 1  # the others of its group are still read once: one more read, else two
    assert n_after == n_before + (2 if shared else 1)
    for c in rows.columns:
        assert repr(rows[c].to_list()) == repr(again[c].to_list()), c


@pytest.mark.parametrize("loaded", [1, 20_000])
def test_pairs_compared_after_any_number_of_reads(stores, monkeypatch, loaded):
    """Pairs are loaded up to a byte budget before they are compared: any budget gives the same rows."""
    new, _old = stores
    rows = compare_runs(open_store(new), "weight_1pct_tensor", "ref_tensor", exact=True).rows
    monkeypatch.setattr(tensorfile, "LOADED_BYTES", loaded)
    again = compare_runs(open_store(new), "weight_1pct_tensor", "ref_tensor", exact=True).rows
    for c in rows.columns:
        assert repr(rows[c].to_list()) == repr(again[c].to_list()), c

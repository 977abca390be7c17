"""Ingest real msprobe dumps: row counts, columns, statistics against numpy, sample and sketch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dumpstore._ingest import ingest
from dumpstore.errors import DumpFormatError
from dumpstore.query import run_query
from dumpstore.store import open_store
from dumpstore.summary import sample_positions
from helpers import MSPROBE, count_leaves, dump_files, msprobe_datasets


def _q(store_dir, sql):
    return run_query(open_store(store_dir), sql).to_pylist()


@pytest.mark.parametrize("dataset", msprobe_datasets(), ids=lambda p: p.name)
def test_row_count_equals_leaves_in_json(dataset, store_dir):
    expected = sum(count_leaves(json.loads(p.read_text())) for p in dump_files(dataset))
    res = ingest(dataset, "r", store=store_dir, jobs=1)
    assert res.rows == expected
    assert _q(store_dir, "select count(*) n from tensors where run='r'") == [{"n": expected}]
    assert res.errors == 0


def test_identity_columns_statistics_dump(store_dir):
    ingest(MSPROBE / "v8_statistics", "v8", store=store_dir, jobs=1)
    rows = _q(
        store_dir, "select * from tensors where run='v8' and record='Functional.layer_norm.0.forward' order by leaf"
    )
    assert [r["name"] for r in rows] == [
        "Functional.layer_norm.0.forward.input.0",
        "Functional.layer_norm.0.forward.input.1.0",
        "Functional.layer_norm.0.forward.input.2",
        "Functional.layer_norm.0.forward.input.3",
        "Functional.layer_norm.0.forward.input.4",
        "Functional.layer_norm.0.forward.output.0",
    ]
    r0, eps = rows[0], rows[4]
    assert (r0["step"], r0["rank"], r0["rank_dir"], r0["prefix"], r0["api"], r0["call"], r0["direction"]) == (
        0,
        0,
        "rank0",
        "Functional",
        "layer_norm",
        0,
        "forward",
    )
    assert r0["module"] == "Module.layers.0.ln1.LayerNorm.forward.0"
    assert r0["is_recompute"] is False
    assert r0["stats_source"] == "dump" and r0["dtype"] == "float32" and r0["shape"] == [4, 8, 32]
    assert (eps["kind"], eps["value_type"], eps["value"], eps["scalar_value"]) == ("scalar", "float", "1e-05", 1e-05)
    assert rows[1]["value"] == "32" and rows[1]["index_path"] == "1.0"


def test_parameters_grad_names_both_generations(store_dir):
    ingest(MSPROBE / "v8_statistics", "v8", store=store_dir, jobs=1)
    ingest(MSPROBE / "v26_md5", "v26", store=store_dir, jobs=1)
    names = {
        r["run"]: r["name"]
        for r in _q(
            store_dir,
            "select run, name from tensors where direction='parameters_grad' and name like '%head.Linear%weight'",
        )
    }
    assert names == {
        "v8": "Module.head.Linear.parameters_grad.weight",
        "v26": "Module.head.Linear.parameters_grad.0.weight",
    }


def test_nan_and_inf_tokens_become_flags(store_dir):
    ingest(MSPROBE / "v8_nan", "nan", store=store_dir, jobs=1)
    rows = _q(
        store_dir,
        "select name, max, min, mean, has_nan, has_posinf, has_neginf from tensors "
        "where run='nan' and has_posinf order by leaf limit 1",
    )
    assert rows and rows[0]["max"] == math.inf and rows[0]["has_posinf"] is True


def test_checksums_kept(store_dir):
    ingest(MSPROBE / "v26_md5", "md5", store=store_dir, jobs=1)
    ingest(MSPROBE / "v26_xor", "xor", store=store_dir, jobs=1)
    kinds = _q(
        store_dir,
        "select run, checksum_kind, count(*) n from tensors where checksum is not null group by all order by run",
    )
    assert [(k["run"], k["checksum_kind"]) for k in kinds] == [("md5", "crc32"), ("xor", "xor")]
    xor = _q(store_dir, "select checksum, min, stats_source from tensors where run='xor' and kind='tensor' limit 1")[0]
    assert xor["checksum"].startswith("0x") and xor["min"] is None and xor["stats_source"] == "none"


def test_mindspore_tensor_stats_match_numpy(store_dir):
    ds = MSPROBE / "ms_tensor"
    ingest(ds, "ms", store=store_dir, jobs=1)
    rows = _q(store_dir, "select * from tensors where run='ms' and kind='tensor' and data_name is not null")
    assert len(rows) > 100
    folder = dump_files(ds)[0].parent / "dump_tensor_data"
    for r in rows:
        arr = np.load(folder / r["data_name"]).astype(np.float64)
        assert r["file_status"] == "loaded" and r["stats_source"] == "tensor"
        assert r["min"] == arr.min() and r["max"] == arr.max()
        assert r["mean"] == pytest.approx(arr.mean(), rel=1e-12, abs=1e-300)
        assert r["norm"] == pytest.approx(np.sqrt((arr * arr).sum()), rel=1e-12)
        assert r["zero_count"] == int((arr == 0).sum()) and r["nan_count"] == 0
        assert r["sample"] == arr.reshape(-1)[sample_positions(arr.size, 64)].tolist()
        # the dumper's own statistics sit beside ours
        assert r["dump_max"] == pytest.approx(r["max"], rel=1e-6, abs=1e-6)
    assert {r["source"] for r in rows} == {""} and {r["rank_dir"] for r in rows} == {"proc25096"}


def test_module_and_stack_from_side_files(store_dir):
    ingest(MSPROBE / "ms_statistics", "ms", store=store_dir, jobs=1)
    rows = _q(
        store_dir,
        "select t.record, t.module, s.frames from tensors t join stacks s "
        "on t.run=s.run and t.step=s.step and t.rank=s.rank and t.stack_id=s.stack_id "
        "where t.run='ms' and t.step=0 and t.record='Cell.layers.0.fc1.Dense.forward.0' limit 1",
    )
    assert rows and rows[0]["module"] == "Cell.layers.0.TinyBlock.forward.0"
    assert any("File " in f for f in rows[0]["frames"])


def test_entry_points_step_rank_file(store_dir):
    ds = MSPROBE / "v26_md5"
    f = dump_files(ds)[1]
    for run, path in (("root", ds), ("step", f.parent.parent), ("rank", f.parent), ("file", f)):
        ingest(path, run, store=store_dir, jobs=1)
    got = {
        r["run"]: (r["n"], r["steps"])
        for r in _q(
            store_dir, "select run, count(*) n, list(distinct step order by step) steps from tensors group by run"
        )
    }
    full = got["root"][0]
    assert got["root"][1] == [0, 1]
    assert got["step"] == got["rank"] == got["file"] == (full // 2, [1])


def test_parallel_and_serial_ingest_give_same_rows(store_dir):
    ds = MSPROBE / "ms_statistics"
    ingest(ds, "a", store=store_dir, jobs=1)
    ingest(ds, "b", store=store_dir, jobs=2)
    cols = "step, rank, leaf, name, kind, dtype, min, max, mean, norm, value"
    a = _q(store_dir, f"select {cols} from tensors where run='a' order by step, rank, leaf")
    b = _q(store_dir, f"select {cols} from tensors where run='b' order by step, rank, leaf")
    assert a == b and len(a) > 1000


def test_reingest_replaces_run(store_dir):
    ds = MSPROBE / "v26_L0"
    ingest(ds, "x", store=store_dir, jobs=1)
    first = _q(store_dir, "select count(*) n from tensors")[0]["n"]
    ingest(ds, "x", store=store_dir, jobs=1)
    assert _q(store_dir, "select count(*) n from tensors")[0]["n"] == first
    live = open_store(store_dir).run_info("x")["ingest_id"]
    files = list((store_dir / "tensors" / "run=x").rglob("*.parquet"))
    assert [f.name.startswith(f"part-{live}") for f in files] == [True]  # the replaced file left the tree at once
    staged = sorted(p.name for p in (store_dir / ".ingests" / "run=x").iterdir())
    assert len(staged) == 2 and live in staged  # the replaced ingest's own copy stays for the grace period
    open_store(store_dir).collect_garbage("x", keep=live, grace=0)
    assert [p.name for p in (store_dir / ".ingests" / "run=x").iterdir()] == [live]


def test_debug_json(store_dir):
    ingest(MSPROBE / "v26_debug", "dbg", store=store_dir, jobs=1)
    rows = _q(store_dir, "select name, kind, direction, io from tensors where run='dbg' and step=0 order by leaf")
    assert {r["direction"] for r in rows} == {"debug"}
    assert any(r["kind"] == "null" for r in rows) and any(r["kind"] == "scalar" for r in rows)


def test_unknown_layout_is_one_line_error(tmp_path, store_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpFormatError, match="no dump.json, debug.json or .pt/.npy tensor files found"):
        ingest(tmp_path / "empty", "e", store=store_dir)


def test_tensor_files_read_in_parallel_give_same_rows(store_dir, tmp_path):
    import shutil

    ds = tmp_path / "ms_tensor"
    shutil.copytree(MSPROBE / "ms_tensor", ds)
    files = sorted((dump_files(ds)[0].parent / "dump_tensor_data").iterdir())
    files[3].write_bytes(files[3].read_bytes()[:40])  # one truncated .npy: an error row, counted
    a = ingest(ds, "serial", store=store_dir, jobs=1)
    b = ingest(ds, "parallel", store=store_dir, jobs=2)  # one dump file: its tensor files go to a pool
    assert (a.rows, a.tensor_files, a.errors, a.first_error) == (b.rows, b.tensor_files, b.errors, b.first_error)
    assert a.errors == 1
    cols = "leaf, name, kind, dtype, min, max, mean, norm, nan_count, zero_count, sample, sketch, file_status, error"
    assert _q(store_dir, f"select {cols} from tensors where run='serial' order by leaf") == _q(
        store_dir, f"select {cols} from tensors where run='parallel' order by leaf"
    )

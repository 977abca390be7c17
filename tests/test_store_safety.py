"""The store never shows half a run: killed ingests, concurrent ingests, queries during ingest, old schemas."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dumpstore.cli.main import main
from dumpstore.errors import StoreError
from dumpstore.ingest import ingest
from dumpstore.query import run_query
from dumpstore.store import open_store
from helpers import MSPROBE, SAMPLES

DATASET = SAMPLES / "ref_stats"          # 3 dump files
INGEST = [sys.executable, "-m", "dumpstore.cli.main", "ingest"]


def _rows(store_dir, run: str) -> list[tuple]:
    return [tuple(r.values()) for r in run_query(open_store(store_dir), (
        f"select step, rank, leaf, name, min, max from tensors where run='{run}' order by step, rank, leaf"
    )).to_pylist()]


def test_sigkill_at_random_points_leaves_run_absent_or_complete(store_dir, tmp_path):
    ingest(DATASET, "good", store=store_dir, jobs=1)
    expected = _rows(store_dir, "good")
    rng = random.Random(1234)
    outcomes = set()
    for _ in range(8):
        proc = subprocess.Popen(INGEST + [str(DATASET), "--run", "victim", "--store", str(store_dir), "-j", "2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(rng.uniform(0.2, 1.6))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        st = open_store(store_dir)  # always opens
        names = st.run_names()
        if "victim" in names:
            assert _rows(store_dir, "victim") == expected
            outcomes.add("complete")
        else:
            outcomes.add("absent")
        assert _rows(store_dir, "good") == expected
    ingest(DATASET, "victim", store=store_dir, jobs=1)
    assert _rows(store_dir, "victim") == expected
    assert outcomes  # at least one kill landed


def test_two_concurrent_ingests_both_land(store_dir):
    procs = [subprocess.Popen(INGEST + [str(DATASET), "--run", name, "--store", str(store_dir), "-j", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert sorted(open_store(store_dir).run_names()) == ["a", "b"]
    assert _rows(store_dir, "a") == _rows(store_dir, "b")


def test_same_run_twice_at_once_serializes(store_dir):
    procs = [subprocess.Popen(INGEST + [str(DATASET), "--run", "same", "--store", str(store_dir), "-j", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    ingest(DATASET, "ref", store=store_dir, jobs=1)
    assert _rows(store_dir, "same") == _rows(store_dir, "ref")


def test_query_during_reingest_sees_old_or_new(store_dir):
    ingest(MSPROBE / "v26_L0", "x", store=store_dir, jobs=1)  # 110 rows
    old = run_query(open_store(store_dir), "select count(*) n from tensors where run='x'").to_pylist()[0]["n"]
    proc = subprocess.Popen(INGEST + [str(DATASET), "--run", "x", "--store", str(store_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = set()
    while proc.poll() is None:
        seen.add(run_query(open_store(store_dir), "select count(*) n from tensors where run='x'").to_pylist()[0]["n"])
    new = run_query(open_store(store_dir), "select count(*) n from tensors where run='x'").to_pylist()[0]["n"]
    assert proc.returncode == 0 and new != old
    assert seen <= {old, new}


def _age_catalog(store_dir, version: int) -> None:
    path = store_dir / "runs.parquet"
    table = pq.read_table(path)
    idx = table.schema.get_field_index("schema_version")
    table = table.set_column(idx, "schema_version", pa.array([version] * table.num_rows, pa.int32()))
    pq.write_table(table, path)


def test_old_schema_says_how_to_upgrade_and_upgrade_works(store_dir):
    ingest(MSPROBE / "v26_L0", "x", store=store_dir, jobs=1)
    before = _rows(store_dir, "x")
    _age_catalog(store_dir, 0)
    with pytest.raises(StoreError, match=r"schema version 0, this dumpstore reads version 1; run `dumpstore "
                                         r"upgrade --store"):
        open_store(store_dir).runs()
    res = CliRunner().invoke(main, ["runs", "--store", str(store_dir)])
    assert res.exit_code == 1 and res.output.startswith("Error: ") and res.output.count("\n") == 1
    res = CliRunner().invoke(main, ["upgrade", "--store", str(store_dir)])
    assert res.exit_code == 0 and res.output == "upgraded 1 runs: x\n"
    assert _rows(store_dir, "x") == before

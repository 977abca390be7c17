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

from dumpstore._ingest import ingest
from dumpstore.cli.main import main
from dumpstore.errors import StoreError
from dumpstore.query import run_query
from dumpstore.store import open_store
from helpers import MSPROBE, SAMPLES

DATASET = SAMPLES / "ref_stats"  # 3 dump files
INGEST = [sys.executable, "-m", "dumpstore.cli.main", "ingest"]


def _rows(store_dir, run: str) -> list[tuple]:
    return [
        tuple(r.values())
        for r in run_query(
            open_store(store_dir),
            (f"select step, rank, leaf, name, min, max from tensors where run='{run}' order by step, rank, leaf"),
        ).to_pylist()
    ]


@pytest.mark.processes
def test_sigkill_at_random_points_leaves_run_absent_or_complete(store_dir, tmp_path):
    ingest(DATASET, "good", store=store_dir, jobs=1)
    expected = _rows(store_dir, "good")
    rng = random.Random(1234)
    outcomes = set()
    for _ in range(8):
        proc = subprocess.Popen(
            INGEST + [str(DATASET), "--run", "victim", "--store", str(store_dir), "-j", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
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
    procs = [
        subprocess.Popen(
            INGEST + [str(DATASET), "--run", name, "--store", str(store_dir), "-j", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert sorted(open_store(store_dir).run_names()) == ["a", "b"]
    assert _rows(store_dir, "a") == _rows(store_dir, "b")


def test_an_ingest_is_marked_published_only_after_the_catalog_lists_it(store_dir, monkeypatch):
    """A reader that finds a published ingest and no catalog reports a lost catalog (`dumpstore repair`): so the
    catalog is written before the ingest is marked published, or another run's ingest into the same fresh store,
    reading the catalog at that moment, fails (seen under load: `ingest REF TARGET` into a new store)."""
    import dumpstore.runrecord as runrecord

    seen: list[list[str]] = []
    original = runrecord.mark_published

    def spy(staged):
        seen.append(open_store(store_dir).run_names())  # what any reader sees at this moment
        original(staged)

    monkeypatch.setattr(runrecord, "mark_published", spy)
    ingest(DATASET, "a", store=store_dir, jobs=1)
    ingest(DATASET, "b", store=store_dir, jobs=1)
    assert seen == [["a"], ["a", "b"]]


def test_same_run_twice_at_once_serializes(store_dir):
    procs = [
        subprocess.Popen(
            INGEST + [str(DATASET), "--run", "same", "--store", str(store_dir), "-j", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    ingest(DATASET, "ref", store=store_dir, jobs=1)
    assert _rows(store_dir, "same") == _rows(store_dir, "ref")


def test_query_during_reingest_sees_old_or_new(store_dir):
    ingest(MSPROBE / "v26_L0", "x", store=store_dir, jobs=1)  # 110 rows
    old = run_query(open_store(store_dir), "select count(*) n from tensors where run='x'").to_pylist()[0]["n"]
    proc = subprocess.Popen(
        INGEST + [str(DATASET), "--run", "x", "--store", str(store_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
    with pytest.raises(
        StoreError,
        match=r"schema version 0, this dumpstore reads version 1; run `dumpstore "
        r"upgrade --store",
    ):
        open_store(store_dir).runs()
    res = CliRunner().invoke(main, ["runs", "--store", str(store_dir)])
    assert res.exit_code == 1 and res.output.startswith("Error: ") and res.output.count("\n") == 1
    res = CliRunner().invoke(main, ["upgrade", "--store", str(store_dir)])
    assert res.exit_code == 0 and res.output == "upgraded 1 runs: x\n"
    assert _rows(store_dir, "x") == before


def _children(pid: int) -> list[int]:
    try:
        text = open(f"/proc/{pid}/task/{pid}/children").read()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _many_units(tmp_path, n: int = 12):
    import shutil

    root = tmp_path / "many"
    for step in range(n):
        shutil.copytree(SAMPLES / "ref_tensor" / "step0", root / f"step{step}")
    return root


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the worker processes")
def test_sigkill_of_main_process_only_frees_the_run(store_dir, tmp_path):
    """Killing only the main ingest process (not its group) ends its workers and frees the run's lock: the next
    ingest of that run completes, with a one-line notice that it took over the lock, and the store holds it.
    The kill must land while the ingest runs: a fast idle machine ingests 12 units in 0.3 s, so an ingest that
    finished first (exit status 0, not SIGKILL) is tried again with 4x the units, into a new store."""
    for n in (24, 96, 384):
        ds = _many_units(tmp_path / f"n{n}", n)
        store = store_dir.parent / f"{store_dir.name}_{n}"
        proc = subprocess.Popen(
            INGEST + [str(ds), "--run", "victim", "--store", str(store), "-j", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not (workers := _children(proc.pid)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not workers or proc.poll() is not None:
            proc.wait()
            continue
        time.sleep(0.1)  # let them start on their units
        os.kill(proc.pid, signal.SIGKILL)  # the main process only: its workers are left to themselves
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            break
    else:
        pytest.fail("no ingest was still running when killed (or none ran its workers)")
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [w for w in workers if _alive(w)]
    for w in survivors:  # do not leave them behind whatever the outcome
        os.kill(w, signal.SIGKILL)
    assert not survivors, "workers outlived their killed parent"
    again = subprocess.run(
        INGEST + [str(ds), "--run", "victim", "--store", str(store), "-j", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    st = open_store(store)
    assert st.run_names() == ["victim"] and st.run_info("victim")["steps"] == list(range(n))
    notices = [line for line in again.stderr.splitlines() if "taking over the lock" in line]
    assert len(notices) == 1 and notices[0].startswith("warning: ingest of run 'victim' into ")
    assert f"process {proc.pid} " in notices[0]
    ids = {p.name[5:17] for p in (store / "tensors").rglob("*.parquet")}
    assert ids == {st.run_info("victim")["ingest_id"]}  # the killed ingest left nothing in the tree
    assert [p.name for p in (store / ".ingests" / "run=victim").iterdir()] == [st.run_info("victim")["ingest_id"]]


def test_stale_lock_is_taken_over_with_one_notice(store_dir):
    """A lock file that still names an owner that has ended is taken over (one warning line), not waited on."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    locks = store_dir / ".locks"
    locks.mkdir(parents=True)
    (locks / "run-r.lock").write_text(
        '{"pid": %d, "host": "%s", "start": null}' % (gone.pid, __import__("socket").gethostname())
    )
    res = subprocess.run(
        INGEST + [str(DATASET), "--run", "r", "--store", str(store_dir), "-j", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == (
        f"warning: ingest of run 'r' into {store_dir}: taking over the lock of process "
        f"{gone.pid} on {__import__('socket').gethostname()}, which ended without releasing it; "
        "cleaning up what it left\n"
    )
    assert (locks / "run-r.lock").read_text() == ""  # released cleanly

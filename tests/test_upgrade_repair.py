"""Nothing lost (issue 24): `upgrade` is one transaction (failures and SIGINT/SIGTERM/SIGKILL at random moments leave
the store as it was), checks the dump folders' identity and refuses newer stores; a missing or corrupt catalog is an
error naming `dumpstore repair`, which rebuilds it from the ingests' records; damaged Parquet files are one line."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_store_faults import _remount, tmpfs  # noqa: F401  (a fixture)

from dumpstore._ingest import ingest
from dumpstore.cli.main import main
from dumpstore.errors import StoreError
from dumpstore.query import run_query
from dumpstore.repair import repair
from dumpstore.store import open_store
from helpers import SAMPLES

CLI = [sys.executable, "-m", "dumpstore.cli.main"]


def _rows(store: Path, run: str) -> list[tuple]:
    sql = f"select step, rank, leaf, name, min, max, norm from tensors where run='{run}' order by step, rank, leaf"
    return [tuple(r.values()) for r in run_query(open_store(store), sql).to_pylist()]


def _age(store: Path, version: int = 0) -> None:
    """The catalog as an older dumpstore would have written it (schema version `version`)."""
    path = store / "runs.parquet"
    table = pq.read_table(path)
    i = table.schema.get_field_index("schema_version")
    pq.write_table(table.set_column(i, "schema_version", pa.array([version] * table.num_rows, pa.int32())), path)


def _raw(store: Path) -> list[tuple]:
    return [(r["run"], r["ingest_id"], r["schema_version"]) for r in pq.read_table(store / "runs.parquet").to_pylist()]


@pytest.fixture
def two_runs(tmp_path):
    """A store of two runs (a tensor-mode dump, the slow one, and a statistics dump) from copies of the samples."""
    for name, sample in (("a", "ref_tensor"), ("b", "ref_stats")):
        shutil.copytree(SAMPLES / sample, tmp_path / name)
    store = tmp_path / "store"
    for name in ("a", "b"):
        ingest(tmp_path / name, name, store=store, jobs=1)
    return store, {name: _rows(store, name) for name in ("a", "b")}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=300)


def _one_line(*args: str) -> SimpleNamespace:
    """A command run in this process (what `_cli` checks of an error: exit status and stderr, without a process's
    start-up): an exception the command lets through fails the test, as a traceback would."""
    res = CliRunner().invoke(main, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return SimpleNamespace(returncode=res.exit_code, stderr=res.stderr)


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and process groups")
def test_upgrade_under_signals_at_random_moments_loses_nothing(two_runs):
    store, before = two_runs
    _age(store)
    rng = random.Random(24)
    seen = set()
    for sig in [signal.SIGKILL, signal.SIGINT, signal.SIGTERM] * 3:
        old = _raw(store)
        proc = subprocess.Popen(
            CLI + ["upgrade", "--store", str(store), "-j", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        time.sleep(rng.uniform(0.3, 3.0))
        if sig == signal.SIGTERM:
            proc.send_signal(sig)  # `kill PID`
        else:
            os.killpg(proc.pid, sig)  # Ctrl-C or kill -9 of the whole group
        _, err = proc.communicate(timeout=120)
        now = _raw(store)
        assert sorted(r[0] for r in now) == ["a", "b"], (sig, err)  # no run ever vanishes
        if now == old:
            seen.add("unchanged")
            if proc.returncode != 0 and sig != signal.SIGKILL:
                *notes, last = err.splitlines()  # (a stale lock of the run killed before: taken over, said so)
                assert (
                    proc.returncode == 130 and last == "Error: interrupted; the store is as it was before this command"
                )
                assert all(n.startswith("warning: ") for n in notes), err
        else:  # published whole: every run upgraded at once
            assert {r[2] for r in now} == {1} and {r[1] for r in now}.isdisjoint({r[1] for r in old}), (old, now)
            seen.add("upgraded")
            assert {n: _rows(store, n) for n in ("a", "b")} == before
            _age(store)
        assert "Traceback" not in err
    done = _cli("upgrade", "--store", str(store))
    assert done.returncode == 0 and done.stdout == "upgraded 2 runs: a, b\n", done.stderr
    assert {n: _rows(store, n) for n in ("a", "b")} == before
    assert seen  # (which outcomes occur depends on the machine's speed)
    # what the killed upgrades staged is gone once the runs' locks are taken again
    live = {r["run"]: r["ingest_id"] for r in open_store(store).runs().to_pylist()}
    for name in ("a", "b"):
        left = {d.name for d in (store / ".ingests" / f"run={name}").iterdir()}
        assert live[name] in left
        assert all((store / ".ingests" / f"run={name}" / d / ".replaced").exists() for d in left - {live[name]})


def test_a_failing_reingest_leaves_the_store_as_it_was(two_runs, tmp_path):
    store, before = two_runs
    _age(store)
    old = _raw(store)
    catalog = (store / "runs.parquet").read_bytes()
    (tmp_path / "b" / "step1" / "rank0" / "dump.json").write_text("{not json")  # b's source became unreadable
    res = _cli("upgrade", "--store", str(store), "--from-source")
    assert res.returncode == 1 and res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert (store / "runs.parquet").read_bytes() == catalog and _raw(store) == old
    for name, ingest_id, _ in old:  # nothing of the failed transaction is left, the old files are all there
        assert {d.name for d in (store / ".ingests" / f"run={name}").iterdir()} == {ingest_id}
    again = _cli("upgrade", "--store", str(store))
    assert again.returncode == 1 and "changed since it was ingested" in again.stderr


def test_upgrade_checks_the_source_identity(two_runs, tmp_path):
    store, before = two_runs
    _age(store)
    os.utime(tmp_path / "a" / "step0" / "rank0" / "dump.json")  # touched, same contents: no change
    shutil.rmtree(tmp_path / "b")
    shutil.copytree(SAMPLES / "no_mask_stats", tmp_path / "b")  # a re-dump into the same folder
    res = _cli("upgrade", "--store", str(store))
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert res.stderr.startswith("Error: run 'b': its dump folder ") and "--from-source" in res.stderr
    assert _raw(store)[0][2] == 0  # nothing was changed
    res = _cli("upgrade", "--store", str(store), "--from-source")
    assert res.returncode == 0 and res.stdout == "upgraded 2 runs: a, b\n"
    assert _rows(store, "a") == before["a"] and _rows(store, "b") != before["b"]


def test_a_newer_store_is_refused_not_downgraded(two_runs):
    store, _ = two_runs
    _age(store, 9)
    catalog = (store / "runs.parquet").read_bytes()
    for args in (["upgrade"], ["runs"], ["divergence", "--target", "a", "--ref", "b"]):
        res = _cli(*args, "--store", str(store))
        assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
        assert "(schema version 9)" in res.stderr and res.stderr.endswith("upgrade dumpstore\n"), res.stderr
    assert (store / "runs.parquet").read_bytes() == catalog


def test_upgrade_on_a_read_only_store_is_one_line(tmpfs, tmp_path):  # noqa: F811
    store = tmpfs / "store"
    shutil.copytree(SAMPLES / "ref_stats", tmp_path / "src")
    ingest(tmp_path / "src", "x", store=store, jobs=1)
    _age(store)
    _remount(tmpfs, "ro")
    try:
        res = _cli("upgrade", "--store", str(store))
    finally:
        _remount(tmpfs, "rw")
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "read-only" in res.stderr, res.stderr


# ------------------------------------------------------------------------------------------ catalog lost or damaged
def test_a_missing_catalog_is_an_error_and_repair_rebuilds_it(two_runs):
    store, before = two_runs
    ingest(SAMPLES / "no_mask_stats", "b", store=store, jobs=1)  # b replaced: its old ingest must not come back
    want = _raw(store)
    (store / "runs.parquet").unlink()
    for args in (["runs"], ["ingest", str(SAMPLES / "ref_stats"), "--run", "c"], ["query", "select 1"]):
        res = _one_line(*args, "--store", str(store))
        assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
        assert "catalog is missing" in res.stderr and "dumpstore repair" in res.stderr and "a, b" in res.stderr
    assert not (store / ".ingests" / "run=c").exists() or not any((store / ".ingests" / "run=c").iterdir())
    res = CliRunner().invoke(main, ["repair", "--store", str(store)])
    assert res.exit_code == 0 and res.output == "rebuilt the catalog: 2 runs: a, b\n"
    assert _raw(store) == want and _rows(store, "a") == before["a"]
    res = CliRunner().invoke(main, ["repair", "--store", str(store)])
    assert res.exit_code == 0 and res.output == "the catalog is complete: 2 runs: a, b\n"


def test_a_catalog_published_while_a_reader_looked_is_read_not_lost(two_runs, monkeypatch):
    """An ingest side by side (`dumpstore ingest A B --run a --run b`) writes the catalog, then marks its data
    published; a reader that found no catalog and then sees published data finds the catalog there now and reads
    it (seen once in 89 pairs' ingests at load 14: "the catalog is missing, but the store holds data of runs ref")."""
    import dumpstore.runrecord as runrecord
    from dumpstore.store import Store

    store, _ = two_runs
    want = _raw(store)
    away = store / "runs.parquet.away"
    (store / "runs.parquet").rename(away)
    real = runrecord.runs_with_data

    def meanwhile(root):  # the other ingest's publish lands between the reader's two looks
        if away.exists():
            away.rename(store / "runs.parquet")
        return real(root)

    monkeypatch.setattr(runrecord, "runs_with_data", meanwhile)
    assert sorted(Store(store).run_names()) == ["a", "b"]
    assert _raw(store) == want
    (store / "runs.parquet").unlink()  # lost for good: still the one-line error
    with pytest.raises(StoreError, match="catalog is missing"):
        Store(store).run_names()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_a_damaged_catalog_is_one_line_and_repair_rebuilds_it(two_runs, damage):
    store, before = two_runs
    path = store / "runs.parquet"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        for i in range(len(data) - 40, len(data) - 8):
            data[i] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"PAR1" + os.urandom(200) + b"PAR1")
    path.write_bytes(bytes(data))
    for args in (["runs"], ["divergence", "--target", "a", "--ref", "b"], ["upgrade"]):
        res = _one_line(*args, "--store", str(store))
        assert res.returncode == 1 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
        assert str(path) in res.stderr and "dumpstore repair" in res.stderr
    assert repair(store).runs == ["a", "b"]
    assert _rows(store, "a") == before["a"] and _rows(store, "b") == before["b"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_tensor_file_is_one_line_naming_repair(two_runs, damage):
    store, _ = two_runs
    live = open_store(store).runs().to_pylist()
    ingest_id = next(r["ingest_id"] for r in live if r["run"] == "b")
    path = next((store / ".ingests" / "run=b" / ingest_id / "tensors" / "step=0").rglob("part-*.parquet"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-12:-8] = b"\xff\xff\xff\x7f"  # the footer's length
    elif damage == "truncate":
        data = data[: len(data) // 3]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    for args in (
        ["query", "select count(*) from tensors"],
        ["divergence", "--target", "a", "--ref", "b", "--no-cache"],
        ["compare", "--target", "a", "--ref", "b"],
    ):
        res = _one_line(*args, "--store", str(store))
        assert res.returncode == 1 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
        assert "dumpstore repair" in res.stderr
    res = CliRunner().invoke(main, ["repair", "--store", str(store)])
    assert res.exit_code == 1 and f"warning: run b: damaged file {path}" in res.output


def test_repair_without_records_names_the_runs_to_ingest_again(two_runs):
    store, _ = two_runs
    for rec in (store / ".ingests").rglob("run.json"):
        rec.unlink()
    (store / "runs.parquet").unlink()
    res = CliRunner().invoke(main, ["repair", "--store", str(store)])
    assert res.exit_code == 1
    assert "warning: run a: data without a record" in res.output and "warning: run b:" in res.output
    assert json.loads(json.dumps(open_store(store).run_names())) == []  # an empty, readable catalog now
    with pytest.raises(StoreError):
        open_store(store).run_info("a")

"""The store under faults: Parquet readers of tensors/ see exactly the live rows (after re-ingests, failed and
killed ingests); readers of a replaced ingest keep working; a full, inode-less or read-only file system gives
one line, removes the failed ingest's files and leaves the store as it was; a malformed data_name is an error row."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from dumpstore._ingest import ingest
from dumpstore.errors import DumpFormatError
from dumpstore.store import open_store
from helpers import MSPROBE, SAMPLES

CLI = [sys.executable, "-m", "dumpstore.cli.main"]


def _live_rows(store: Path) -> int:
    return sum(open_store(store).runs().column("n_rows").to_pylist())


def _raw_counts(store: Path) -> dict[str, int]:
    """Rows of tensors/ as three Parquet readers that know nothing of dumpstore count them."""
    tree = store / "tensors"
    out = {
        "pyarrow": pads.dataset(tree, format="parquet", partitioning="hive").count_rows(),
        "polars": pl.scan_parquet(f"{tree}/**/*.parquet", hive_partitioning=True).select(pl.len()).collect().item(),
    }
    out["duckdb"] = duckdb.sql(
        f"select count(*) from read_parquet('{tree}/**/*.parquet', hive_partitioning=1)"
    ).fetchall()[0][0]
    return out


def _age(store: Path, seconds: float = 600) -> None:
    """Make every file of the store look `seconds` old (a run ingested long ago)."""
    then = time.time() - seconds
    for path in store.rglob("*"):
        os.utime(path, (then, then))


def test_raw_readers_see_exactly_the_live_rows(store_dir, tmp_path):
    ingest(SAMPLES / "ref_stats", "a", store=store_dir, jobs=1)
    ingest(MSPROBE / "v26_L0", "b", store=store_dir, jobs=1)
    _age(store_dir)
    ingest(SAMPLES / "ref_stats", "a", store=store_dir, jobs=2)  # a re-ingest replaces a's files at once
    live = _live_rows(store_dir)
    assert live > 0 and _raw_counts(store_dir) == {"pyarrow": live, "polars": live, "duckdb": live}
    bad = tmp_path / "bad"
    shutil.copytree(SAMPLES / "ref_stats", bad)
    (bad / "step2" / "rank0" / "dump.json").write_text('{"data": {')  # the last unit fails after two are written
    with pytest.raises(DumpFormatError, match="invalid JSON"):
        ingest(bad, "a", store=store_dir, jobs=1)
    assert _raw_counts(store_dir) == {"pyarrow": live, "polars": live, "duckdb": live}
    staged = {p.name for p in (store_dir / ".ingests" / "run=a").iterdir()}
    assert open_store(store_dir).run_info("a")["ingest_id"] in staged and len(staged) == 2  # live + replaced


def test_reader_of_the_replaced_catalog_still_finds_its_files(store_dir):
    """A reader that resolved the live files just before a re-ingest replaced them (of a run ingested long ago)
    still reads them all: they leave tensors/ at once but stay where dumpstore's readers look for a grace period."""
    ingest(SAMPLES / "ref_stats", "a", store=store_dir, jobs=1)
    rows = _live_rows(store_dir)
    _age(store_dir)
    patterns = open_store(store_dir).tensor_files(["a"])  # what divergence/compare resolve first ...
    ingest(SAMPLES / "ref_stats", "a", store=store_dir, jobs=1)
    files = [f for p in patterns for f in glob.glob(p)]  # ... then read
    assert len(files) == 3 and sum(pq.read_table(f).num_rows for f in files) == rows


def _divergence(store: Path) -> subprocess.Popen:
    return subprocess.Popen(
        CLI + ["divergence", "--target", "target", "--ref", "ref", "--exact", "--no-cache", "--store", str(store)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.processes  # a divergence process read while the reference is ingested again, many times over
def test_divergence_exact_survives_reingests_meanwhile(store_dir):
    ingest(SAMPLES / "ref_tensor", "ref", store=store_dir, jobs=1)
    ingest(SAMPLES / "weight_1pct_tensor", "target", store=store_dir, jobs=1)
    _age(store_dir)
    expected = _divergence(store_dir).communicate(timeout=300)
    assert "FIRST DIVERGENCE" in expected[0]
    for _ in range(2):
        proc = _divergence(store_dir)
        reingests = 0
        while proc.poll() is None or not reingests:
            ingest(SAMPLES / "ref_tensor", "ref", store=store_dir, jobs=1)
            reingests += 1
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and (out, err) == expected, err


# ------------------------------------------------------------------------------------------ full file systems
@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs of our own (needs root and mount permission; skipped where the machine does not allow it)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=4096", "tmpfs", str(mnt)], capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("no mount command on this machine")
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.strip() or 'not permitted'}); "
            "the full-disk tests need root and mount permission"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mnt)], check=True, capture_output=True)


def _snapshot(store: Path) -> dict[str, bytes]:
    """Every visible file of the store (hidden staging and locks aside) with its bytes."""
    return {
        str(p.relative_to(store)): p.read_bytes()
        for p in sorted(store.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(store).parts)
    }


def _ingest_cli(src: Path, run: str, store: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + ["ingest", str(src), "--run", run, "--store", str(store), "-j", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
        except OSError:
            pass
    return filler


def _check_failed(res: subprocess.CompletedProcess, store: Path, before: dict[str, bytes], words: str) -> None:
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(f"Error: {store}: {words}"), res.stderr
    assert "Traceback" not in res.stderr and "--store" in res.stderr
    assert _snapshot(store) == before
    assert sorted(p.name for p in (store / ".ingests").iterdir()) == ["run=good"]  # the failed ingest's files: gone


def test_full_disk_is_one_line_and_leaves_the_store_as_it_was(tmpfs):
    store = tmpfs / "store"
    assert _ingest_cli(SAMPLES / "ref_stats", "good", store).returncode == 0
    before = _snapshot(store)
    filler = _fill(tmpfs)
    res = _ingest_cli(SAMPLES / "ref_tensor", "big", store)
    _check_failed(res, store, before, "the store's file system is full; nothing was ingested")
    filler.unlink()
    assert _ingest_cli(SAMPLES / "ref_tensor", "big", store).returncode == 0


def test_no_free_inodes_is_one_line_and_leaves_the_store_as_it_was(tmpfs):
    store = tmpfs / "store"
    assert _ingest_cli(SAMPLES / "ref_stats", "good", store).returncode == 0
    before = _snapshot(store)
    info = os.statvfs(tmpfs)
    _remount(tmpfs, f"nr_inodes={info.f_files - info.f_ffree + 3}")
    res = _ingest_cli(SAMPLES / "ref_stats", "more", store)
    _check_failed(res, store, before, "the store's file system has no free inodes; nothing was ingested")


def test_read_only_store_is_one_line_and_leaves_the_store_as_it_was(tmpfs):
    store = tmpfs / "store"
    assert _ingest_cli(SAMPLES / "ref_stats", "good", store).returncode == 0
    before = _snapshot(store)
    _remount(tmpfs, "ro")
    res = _ingest_cli(SAMPLES / "ref_stats", "more", store)
    _check_failed(res, store, before, "the store is on a read-only file system; nothing was ingested")
    _remount(tmpfs, "rw")


@pytest.mark.parametrize("data_name, shown", [(7, "7"), (["a.pt"], "<list of 1 items>"), ("", '""'), (None, "null")])
def test_malformed_data_name_is_an_error_row(store_dir, dump_writer, data_name, shown):
    """A data_name that is not a non-empty string is a counted error row naming the value, not dropped silently."""
    import json

    import numpy as np

    path = dump_writer().write(
        {"Functional.relu.0.forward": {"input_args": [np.ones(3, np.float32)], "output": [np.ones(3, np.float32)]}}
    )
    doc = json.loads(path.read_text())
    doc["data"]["Functional.relu.0.forward"]["output"][0]["data_name"] = data_name
    path.write_text(json.dumps(doc))
    res = ingest(path.parent, "r", store=store_dir, jobs=1)
    assert (res.rows, res.errors) == (2, 1)
    assert res.first_error == (
        f"Functional.relu.0.forward.output.0: data_name {shown} is not a file name; "
        "expected the name of the leaf's tensor file"
    )
    assert open_store(store_dir).run_info("r")["n_errors"] == 1


def test_readme_snippets_read_exactly_the_live_rows(tmp_path, monkeypatch):
    """The pandas, Polars and DuckDB lines of docs/store.md, run as written on a store with a replaced run and a
    failed ingest, see exactly the live rows and the run names."""
    import re

    from helpers import ROOT

    section = (ROOT / "docs" / "store.md").read_text().split("## Reading the store without dumpstore", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    assert len(blocks) == 3
    store = tmp_path / "dumpstore_store"
    ingest(SAMPLES / "ref_stats", "a", store=store, jobs=1)
    ingest(MSPROBE / "v26_L0", "b", store=store, jobs=1)
    ingest(SAMPLES / "ref_stats", "a", store=store, jobs=1)
    bad = tmp_path / "bad"
    shutil.copytree(SAMPLES / "ref_stats", bad)
    (bad / "step2" / "rank0" / "dump.json").write_text("{")  # fails after two units are written
    with pytest.raises(DumpFormatError):
        ingest(bad, "b", store=store, jobs=1)
    catalog = open_store(store).runs().to_pylist()
    monkeypatch.chdir(tmp_path)
    results = []
    for code in blocks:
        names: dict = {}
        exec(code, names)
        results.append(names)
    pandas_df, polars_df, counts = results[0]["tensors"], results[1]["tensors"], results[2]["counts"]
    assert counts == [(r["run"], r["n_rows"]) for r in catalog]
    assert len(pandas_df) == len(polars_df) == sum(r["n_rows"] for r in catalog)
    assert sorted(set(pandas_df["run"].astype(str))) == sorted(set(polars_df["run"])) == ["a", "b"]

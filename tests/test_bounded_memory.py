"""Bounded memory (issue 24): a query's result stops at a quarter of its memory limit with one line; --exact's
large pairs are compared in chunks (tests/test_exact_chunked.py; measured by bench/exact_memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dumpstore._ingest import ingest
from dumpstore.errors import QueryError
from dumpstore.query import Limits, result_cap, run_query
from dumpstore.store import open_store
from helpers import SAMPLES


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounded") / "store"
    ingest(SAMPLES / "ref_stats", "ref", store=root, jobs=1)
    return open_store(root)


def test_result_cap_is_a_quarter_of_the_limit():
    assert result_cap("512MB") == 128 * 1000**2
    assert result_cap("1GiB") == 256 << 20
    assert result_cap("8MB") == 2 * 1000**2


@pytest.mark.parametrize("limit, width", [("64MB", 100_000), ("16MB", 1000)])
def test_a_result_past_the_cap_is_one_line_not_gigabytes(store, limit, width):
    sql = f"select repeat('x', {width}) from range(400000)"
    with pytest.raises(QueryError, match=r"^the query's result passed \d+ MiB .* raise --memory-limit$"):
        run_query(store, sql, limits=Limits(memory_limit=limit))
    small = run_query(store, f"select repeat('x', {width}) s from range(3)", limits=Limits(memory_limit=limit))
    assert small.num_rows == 3 and small.column("s")[0].as_py() == "x" * width


def test_the_issue_query_stays_under_a_gigabyte(store):
    """`query --memory-limit 512MB "select repeat('x',100000) from range(15000)"`: one line, exit 1, peak RSS of
    the process well under the 1.5 GB result (it reached 5.9 GB before)."""
    code = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode); print(p.stderr)"
    )
    cmd = [sys.executable, "-m", "dumpstore.cli.main", "query", "--store", str(store.root), "--memory-limit", "512MB"]
    got = subprocess.run(
        [sys.executable, "-c", code, *cmd, "select repeat('x',100000) from range(15000)"],
        capture_output=True,
        text=True,
        check=True,
    )
    head, err = got.stdout.split("\n", 1)
    rss_kib, rc = map(int, head.split())
    assert rc == 1 and err.strip().startswith("Error: the query's result passed") and len(err.strip().splitlines()) == 1
    assert rss_kib < 1.2 * 2**20, rss_kib  # KiB: under 1.2 GiB

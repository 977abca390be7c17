"""`query` runs exactly one read-only statement, as DuckDB's own parser sees it, within memory, threads and time."""

from __future__ import annotations

import hashlib
import os

import pytest
from click.testing import CliRunner

from dumpstore.cli.main import main
from dumpstore.errors import QueryError
from dumpstore.query import Limits, memory_limit, read_only_statement, run_query
from dumpstore.store import open_store
from helpers import MSPROBE


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard") / "store"
    res = CliRunner().invoke(main, ["ingest", str(MSPROBE / "v26_L0"), "--run", "x", "--store", str(root)])
    assert res.exit_code == 0, res.output
    return root


def _tree(root) -> dict[str, str]:
    """Every file under the store with its content hash: what a refused statement must leave unchanged."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _query(store, sql: str, *extra: str):
    return CliRunner().invoke(main, ["query", "--store", str(store), *extra, "--", sql])


PROBES = [  # (sql, the start of the one-line error); '{s}' is the store folder
    ("/**/ COPY (SELECT * FROM runs LIMIT 0) TO '{s}/runs.parquet' (FORMAT parquet)", "Error: COPY is not allowed"),
    ("-- a comment\nCOPY (SELECT 1) TO '{s}/x.csv'", "Error: COPY is not allowed"),
    ("/* ' */ ; COPY (SELECT 1) TO '{s}/x.csv'", "Error: COPY is not allowed"),
    ("EXPORT DATABASE '{s}/exported'", "Error: EXPORT is not allowed"),
    ("/* hidden */ ATTACH '{s}/a.db' AS a; CREATE TABLE a.t AS SELECT 1", "Error: give exactly one SQL statement"),
    ("/* hidden */ ATTACH '{s}/a.db' AS a", "Error: ATTACH is not allowed"),
    ("/* ' */ CREATE TABLE t AS SELECT 1", "Error: CREATE is not allowed"),
    ("WITH a AS (SELECT 1 AS x) INSERT INTO t SELECT * FROM a", "Error: WITH is not allowed"),
    ("EXPLAIN ANALYZE COPY (SELECT 1) TO '{s}/y.csv'", "Error: EXPLAIN is allowed of one SELECT only"),
    ("EXPLAIN COPY (SELECT 1) TO '{s}/y.csv'", "Error: EXPLAIN is allowed of one SELECT only"),
    ("SET memory_limit = '1TB'", "Error: SET is not allowed"),
    ("RESET lock_configuration", "Error: RESET is not allowed"),
    ("PRAGMA enable_profiling", "Error: PRAGMA is not allowed"),
    ("CALL pragma_version()", "Error: CALL is not allowed"),
    ("INSTALL httpfs", "Error: INSTALL is not allowed"),
    ("LOAD httpfs", "Error: LOAD is not allowed"),
    ("PIVOT runs ON run", "Error: PIVOT is not allowed"),
    ("VACUUM", "Error: VACUUM is not allowed"),
    ("CHECKPOINT", "Error: CHECKPOINT is not allowed"),
    ("SELECT 1; SELECT 2", "Error: give exactly one SQL statement (2 given)"),
    ("SELECT 1; /* ' */ SELECT 2", "Error: give exactly one SQL statement (2 given)"),
    ("", "Error: give exactly one SQL statement (0 given)"),
    (" ; -- nothing", "Error: give exactly one SQL statement (0 given)"),
    ("SELECT * FROM query('COPY (SELECT 1) TO ''{s}/z.csv''')", "Error: Parser Error"),
    ("SELECT * FROM read_csv('/etc/passwd')", "Error: Permission Error"),
    ("SELECT * FROM read_text('{s}/../../../../etc/hostname')", "Error: Permission Error"),
]


@pytest.mark.parametrize(("sql", "error"), PROBES, ids=[p[0][:40] for p in PROBES])
def test_refused_statements_change_nothing(store, sql, error):
    before = _tree(store)
    res = _query(store, sql.replace("{s}", str(store)))
    assert res.exit_code == 1, res.output
    assert res.output.startswith(error) and res.output.count("\n") == 1, res.output
    assert _tree(store) == before
    assert _query(store, "select run from runs", "--csv").output == "run\nx\n"


@pytest.mark.parametrize(
    ("sql", "csv"),
    [
        ("/* ' */ ; SELECT 42 AS n", "n\n42\n"),  # DuckDB's parser: one statement (the empty one is no statement)
        ("-- why\nSELECT count(*) AS n FROM tensors", "n\n110\n"),
        ("WITH a AS (SELECT 2 AS n) SELECT * FROM a;", "n\n2\n"),
        ("FROM runs SELECT run", "run\nx\n"),
        ("VALUES (7)", "col0\n7\n"),
        ("SELECT * FROM (DESCRIBE runs) WHERE column_name = 'run'", None),
        ("SUMMARIZE SELECT 1 AS a", None),
        ("SHOW TABLES", None),
        ("EXPLAIN SELECT * FROM runs", None),
        ("/* plan */ EXPLAIN ANALYZE SELECT count(*) FROM tensors", None),
    ],
)
def test_read_only_statements_run(store, sql, csv):
    res = _query(store, sql, "--csv")
    assert res.exit_code == 0, res.output
    if csv is not None:
        assert res.output == csv


def test_only_the_parsed_statement_runs():
    assert read_only_statement("/* ' */ ; SELECT 42").strip() == "SELECT 42"
    with pytest.raises(QueryError, match="COPY is not allowed"):
        read_only_statement("/* ; */ COPY (SELECT 1) TO 'x.csv'")


def _setting(store, name: str, *extra: str) -> str:
    res = _query(store, f"SELECT current_setting('{name}') AS v", "--csv", *extra)
    assert res.exit_code == 0, res.output
    return res.output.splitlines()[1]


def _mib(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"KiB": 2**-10, "MiB": 1, "GiB": 2**10, "TiB": 2**20}[unit]


def test_memory_limit_and_threads(store):
    ram_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    # DuckDB prints one decimal (5.8 GiB)
    assert _mib(_setting(store, "memory_limit")) == pytest.approx(ram_mib / 2, rel=0.03)  # default: half the RAM
    assert _mib(_setting(store, "memory_limit", "--memory-limit", "25%")) == pytest.approx(ram_mib / 4, rel=0.03)
    assert _setting(store, "memory_limit", "--memory-limit", "256MiB") == "256.0 MiB"
    assert _setting(store, "threads", "--threads", "1") == "1"
    assert memory_limit("2GB") == "2GB" and memory_limit("512") == "512B"
    for bad in ("lots", "0", "150%", "-1GB", "4 parsecs"):
        res = _query(store, "select 1", "--memory-limit", bad)
        assert res.exit_code == 1 and res.output == (
            f"Error: memory limit {bad!r} is not a size: give e.g. 4GB, 512MB or 50% (of the RAM)\n"
        ), res.output
    assert _query(store, "select 1", "--threads", "0").exit_code == 2
    assert _query(store, "select 1", "--timeout", "-1").exit_code == 2


def test_a_query_too_big_for_its_memory_limit_is_one_line(store):
    res = _query(store, "SELECT list(i) FROM range(20000000) t(i) GROUP BY i % 5000000", "--memory-limit", "8MB")
    assert res.exit_code == 1 and res.output.startswith("Error: Out of Memory Error") and res.output.count("\n") == 1


def test_timeout_interrupts_the_query(store):
    res = _query(store, "SELECT sum(hash(i)) FROM range(1000000000000) t(i)", "--timeout", "0.5", "--threads", "1")
    assert res.exit_code == 1
    assert res.output == (
        "Error: the query ran past its time limit of 0.5 s and was stopped (raise --timeout, or narrow the query)\n"
    )


def test_library_limits(store):
    table = run_query(open_store(store), "select current_setting('threads') AS t", limits=Limits(threads=1))
    assert table.to_pylist() == [{"t": 1}]
    with pytest.raises(QueryError, match="time limit of 0.2 s"):
        run_query(open_store(store), "SELECT sum(hash(i)) FROM range(1000000000000) t(i)", limits=Limits(timeout=0.2))


def test_spills_to_a_private_temporary_folder_not_the_working_directory(store):
    import tempfile

    spill = _setting(store, "temp_directory")
    assert spill.startswith(os.path.join(tempfile.gettempdir(), "dumpstore-query-")) and not os.path.exists(spill)
    res = _query(
        store,
        "SELECT count(DISTINCT hash(i)) AS n FROM range(3000000) t(i)",
        "--memory-limit",
        "30MB",
        "--threads",
        "1",
        "--csv",
    )
    assert res.exit_code == 0 and res.output == "n\n3000000\n", res.output


def test_a_query_within_its_time_limit_runs(store):
    assert _query(store, "SELECT 1 AS one", "--timeout", "60", "--csv").output == "one\n1\n"

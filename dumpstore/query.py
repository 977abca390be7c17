"""DuckDB over the store: views `tensors`, `runs`, `stacks`; user SQL runs with external access locked."""

from __future__ import annotations

import os
import re
import tempfile
import threading
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from .errors import QueryError
from .schema import STACK_SCHEMA, TENSOR_SCHEMA
from .store import Store

_HIVE = "hive_partitioning=true, hive_types={'run': 'VARCHAR', 'step': 'BIGINT', 'rank': 'BIGINT'}"


def _literal_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def _empty_view(con: duckdb.DuckDBPyConnection, name: str, schema: pa.Schema, extra: list[str]) -> None:
    con.register(f"__empty_{name}", schema.empty_table())
    cols = ", ".join(f"CAST(NULL AS {t}) AS {c}" for c, t in (x.split(":") for x in extra))
    con.execute(f"CREATE VIEW {name} AS SELECT *, {cols} FROM __empty_{name} WHERE false")


@dataclass(frozen=True)
class Limits:
    """Bounds on one query: DuckDB's memory limit and threads, and a wall-clock time limit in seconds."""

    memory_limit: str | None = None  # a DuckDB size ('4GB', '512MB') or a share of RAM ('50%'); None: half the RAM
    threads: int | None = None  # None: DuckDB's default (one per core)
    timeout: float | None = None  # None: no time limit


def connect(
    store: Store,
    *,
    runs: list[str] | None = None,
    locked: bool = True,
    limits: Limits | None = None,
    temp_dir: str | None = None,
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the store's views; `locked` forbids files outside the store.

    `limits` bounds memory and threads; `temp_dir` is where DuckDB may spill (default `.tmp` in the working
    directory)."""
    con = duckdb.connect(":memory:")
    catalog = store.runs()
    con.register("__runs", catalog)
    con.execute("CREATE VIEW runs AS SELECT * FROM __runs")
    files = store.tensor_files(runs, catalog)
    if files:
        # union_by_name: runs ingested before a column was added (content_hash, file_size, file_mtime_ns) read
        # it as null instead of failing the glob
        con.execute(
            f"CREATE VIEW tensors AS SELECT * FROM read_parquet({_literal_list(files)}, {_HIVE}, union_by_name=true)"
        )
    else:
        _empty_view(con, "tensors", TENSOR_SCHEMA, ["run:VARCHAR", "step:BIGINT", "rank:BIGINT"])
    stacks = store.stack_files(catalog)
    if stacks:
        con.execute(
            f"CREATE VIEW stacks AS SELECT * FROM read_parquet({_literal_list(stacks)}, "
            "hive_partitioning=true, hive_types={'run': 'VARCHAR'})"
        )
    else:
        _empty_view(con, "stacks", STACK_SCHEMA, ["run:VARCHAR"])
    from .replaytable import create_replay_view
    from .views import create_views

    create_views(con)
    create_replay_view(con, store, catalog)
    from .longrun.store import create_views as longrun_views  # scalars, monitor, longruns (docs/longrun.md)

    longrun_views(con, store)
    if temp_dir is not None:
        con.execute(f"SET temp_directory = '{temp_dir.replace(chr(39), chr(39) * 2)}'")
    if limits is not None:
        con.execute(f"SET memory_limit = '{memory_limit(limits.memory_limit)}'")
        if limits.threads is not None:
            con.execute(f"SET threads = {int(limits.threads)}")
    if locked:
        lock_down(con, str(store.root.resolve()))
    return con


def lock_down(con: duckdb.DuckDBPyConnection, root: str) -> None:
    """Read-only: files only inside the store, no extensions, configuration frozen."""
    con.execute(f"SET allowed_directories = ['{root.replace(chr(39), chr(39) * 2)}/']")
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET lock_configuration = true")


DEFAULT_MEMORY_SHARE = 0.5  # of the machine's RAM, for one query (DuckDB's own default is 80 %)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B)?\s*$", re.I)


def memory_limit(value: str | None) -> str:
    """A DuckDB memory_limit from '4GB', '512MiB' or '50%' (of the RAM); None gives half the RAM."""
    if value is None:
        return f"{int(_ram_bytes() * DEFAULT_MEMORY_SHARE) // 2**20}MiB"
    m = _SIZE.match(value)
    if m is None or float(m.group(1)) <= 0 or (m.group(2) == "%" and float(m.group(1)) > 100):
        raise QueryError(f"memory limit {value!r} is not a size: give e.g. 4GB, 512MB or 50% (of the RAM)")
    if m.group(2) == "%":
        return f"{max(1, int(_ram_bytes() * float(m.group(1)) / 100) // 2**20)}MiB"
    return f"{m.group(1)}{m.group(2) or 'B'}"


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_READ_ONLY = "SELECT, WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, or EXPLAIN of one of those"


def read_only_statement(sql: str) -> str:
    """The one read-only statement in `sql` as DuckDB's parser sees it, or QueryError naming what was refused.

    DuckDB's own parser splits and classifies (comments and quotes cannot fool it); only a SELECT (which
    covers WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE) is accepted, and EXPLAIN [ANALYZE] of one."""
    statements = _parse(sql)
    if len(statements) != 1:
        raise QueryError(
            f"give exactly one SQL statement ({len(statements)} given): dumpstore query runs one "
            f"read-only statement ({_READ_ONLY})"
        )
    st = statements[0]
    if st.type == duckdb.StatementType.SELECT:
        return st.query
    if st.type == duckdb.StatementType.EXPLAIN:
        inner = _EXPLAIN.match(st.query)
        body = _parse(st.query[inner.end() :]) if inner else []
        if len(body) == 1 and body[0].type == duckdb.StatementType.SELECT:
            return st.query
        raise QueryError(f"EXPLAIN is allowed of one SELECT only: dumpstore query is read-only ({_READ_ONLY})")
    raise QueryError(f"{_keyword(st)} is not allowed: dumpstore query is read-only ({_READ_ONLY})")


_COMMENTS = r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*"
_EXPLAIN = re.compile(_COMMENTS + r"EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^()]*\)\s*)?", re.I | re.S)
_FIRST_WORD = re.compile(_COMMENTS + r"([A-Za-z_]+)", re.S)


def _parse(sql: str) -> list:
    try:
        return list(duckdb.extract_statements(sql))
    except duckdb.Error as exc:
        raise QueryError(_one_line(exc)) from None


def _keyword(st) -> str:
    m = _FIRST_WORD.match(st.query)
    return m.group(1).upper() if m else st.type.name


def run_query(store: Store, sql: str, *, limits: Limits | None = None) -> pa.Table:
    """Run one read-only SQL statement over the store and return its result as Arrow.

    `limits` bounds memory (default half the RAM), threads and time; a query past its time limit is interrupted.
    """
    limits = limits or Limits()
    statement = read_only_statement(sql)
    memory_limit(limits.memory_limit)  # a bad size is refused before the store is opened
    cap = result_cap(limits.memory_limit)
    with tempfile.TemporaryDirectory(prefix="dumpstore-query-") as spill:  # not the working directory
        return _run(connect(store, limits=limits, temp_dir=spill), statement, limits.timeout, cap)


RESULT_SHARE = 0.25  # of the memory limit: the result, fetched batch by batch, may hold at most this much


def result_cap(value: str | None) -> int:
    """The most bytes a query's result may hold: RESULT_SHARE of its memory limit (rendering it as text takes a
    few times that again; DuckDB's own memory is bounded by the limit itself)."""
    return max(1 << 20, int(_size_bytes(memory_limit(value)) * RESULT_SHARE))


_UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}
_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def _size_bytes(limit: str) -> int:
    m = _SIZE.match(limit)
    assert m is not None  # memory_limit() returns sizes only
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def _run(con: duckdb.DuckDBPyConnection, statement: str, timeout: float | None, cap: int | None = None) -> pa.Table:
    """Fetch `statement` on `con` batch by batch, stopped when the result passes `cap` bytes or after `timeout`
    seconds; closes `con`."""
    timer = None
    if timeout is not None:
        timer = threading.Timer(timeout, con.interrupt)
        timer.daemon = True
        timer.start()
    try:
        return fetch_arrow(con, statement) if cap is None else _fetch_capped(con, statement, cap)
    except duckdb.InterruptException:
        if timer is None or timer.is_alive():  # not our timer: Ctrl-C
            raise KeyboardInterrupt from None
        raise QueryError(
            f"the query ran past its time limit of {timeout:g} s and was stopped (raise --timeout, or narrow the query)"
        ) from None
    except duckdb.Error as exc:
        raise QueryError(_one_line(exc)) from None
    finally:
        if timer is not None:
            timer.cancel()
        con.close()


def _fetch_capped(con: duckdb.DuckDBPyConnection, sql: str, cap: int) -> pa.Table:
    """The result of `sql`, streamed in record batches; QueryError as soon as it holds more than `cap` bytes."""
    reader = con.sql(sql).to_arrow_reader(2048)  # one DuckDB vector per batch
    batches, held, rows = [], 0, 0
    for batch in reader:
        held += batch.nbytes
        rows += batch.num_rows
        if held > cap:
            reader.close()
            raise QueryError(
                f"the query's result passed {cap // 2**20} MiB (a quarter of the memory limit) after {rows} rows and "
                "was stopped; add a LIMIT, select fewer or shorter columns, or raise --memory-limit"
            )
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.schema)


def fetch_arrow(con: duckdb.DuckDBPyConnection, sql: str, params: list | dict | None = None) -> pa.Table:
    """Result of `sql` as an Arrow table (DuckDB 2 renamed `arrow()` to `to_arrow_table()`)."""
    rel = con.sql(sql, params=params)
    if rel is None:
        raise QueryError("the statement returned no rows")
    fetch = getattr(rel, "to_arrow_table", None) or rel.arrow
    return fetch()


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:500]

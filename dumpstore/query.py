"""DuckDB over the store: views `tensors`, `runs`, `stacks`; user SQL runs with external access locked."""

from __future__ import annotations

import re

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


def connect(store: Store, *, runs: list[str] | None = None, locked: bool = True) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the store's views; `locked` forbids files outside the store."""
    con = duckdb.connect(":memory:")
    catalog = store.runs()
    con.register("__runs", catalog)
    con.execute("CREATE VIEW runs AS SELECT * FROM __runs")
    files = store.tensor_files(runs, catalog)
    if files:
        con.execute(f"CREATE VIEW tensors AS SELECT * FROM read_parquet({_literal_list(files)}, {_HIVE})")
    else:
        _empty_view(con, "tensors", TENSOR_SCHEMA, ["run:VARCHAR", "step:BIGINT", "rank:BIGINT"])
    stacks = store.stack_files(catalog)
    if stacks:
        con.execute(f"CREATE VIEW stacks AS SELECT * FROM read_parquet({_literal_list(stacks)}, "
                    "hive_partitioning=true, hive_types={'run': 'VARCHAR'})")
    else:
        _empty_view(con, "stacks", STACK_SCHEMA, ["run:VARCHAR"])
    from dumpstore.analysis.views import create_views
    create_views(con)
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


_WRITE = re.compile(r"^\s*(copy|attach|detach|install|load|insert|update|delete|create|drop|alter|export|import|"
                    r"set|reset|pragma|call|checkpoint|vacuum|use|begin|commit|rollback)\b", re.I)


def run_query(store: Store, sql: str) -> pa.Table:
    """Run one read-only SQL statement over the store and return its result as Arrow."""
    statements = [s for s in _split_sql(sql) if s.strip()]
    if len(statements) != 1:
        raise QueryError("give exactly one SQL statement (a SELECT, WITH, DESCRIBE, SHOW or SUMMARIZE)")
    if _WRITE.match(statements[0]):
        word = statements[0].split()[0].upper()
        raise QueryError(f"{word} is not allowed: dumpstore query is read-only (SELECT/WITH/DESCRIBE/SHOW only)")
    con = connect(store)
    try:
        return fetch_arrow(con, statements[0])
    except duckdb.Error as exc:
        raise QueryError(_one_line(exc)) from None
    finally:
        con.close()


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


def _split_sql(sql: str) -> list[str]:
    """Split on semicolons outside quotes and comments."""
    out, cur, quote, i = [], [], None, 0
    while i < len(sql):
        ch = sql[i]
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
        elif ch in ("'", '"'):
            quote = ch
            cur.append(ch)
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = len(sql) if j < 0 else j
            continue
        elif ch == ";":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur))
    return out

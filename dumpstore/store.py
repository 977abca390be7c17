"""The store: a folder of hive-partitioned Parquet plus runs.parquet, opened as read-only DuckDB views."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import StoreError

if TYPE_CHECKING:
    import pyarrow as pa

ENV_STORE = "DUMPSTORE_STORE"
DEFAULT_STORE = "dumpstore_store"
CATALOG = "runs.parquet"
GC_GRACE_SECONDS = 120.0
_HIVE_TYPES = "{'run': 'VARCHAR', 'step': 'BIGINT', 'rank': 'BIGINT'}"


def default_store_path() -> Path:
    return Path(os.environ.get(ENV_STORE) or DEFAULT_STORE)


class Store:
    """A dumpstore folder. Runs become visible only through the catalog (runs.parquet)."""

    def __init__(self, root: Path):
        self.root = root

    # -- catalog -------------------------------------------------------------------------------------
    def runs(self) -> pa.Table:
        import pyarrow.parquet as pq

        from .schema import RUN_SCHEMA, SCHEMA_VERSION

        path = self.root / CATALOG
        if not path.exists():
            return RUN_SCHEMA.empty_table()
        table = pq.ParquetFile(path).read()
        versions = set(table.column("schema_version").to_pylist()) if "schema_version" in table.schema.names else {0}
        old = sorted(v for v in versions if v != SCHEMA_VERSION)
        if old:
            raise StoreError(f"{self.root}: store written with schema version {old[0]}, this dumpstore reads "
                             f"version {SCHEMA_VERSION}; run `dumpstore upgrade --store {self.root}` to re-ingest "
                             "its runs from their dump folders, or ingest them into a new store")
        return table

    def raw_runs(self) -> list[dict[str, Any]]:
        """Catalog rows whatever their schema version (for upgrades)."""
        import pyarrow.parquet as pq

        path = self.root / CATALOG
        return pq.ParquetFile(path).read().to_pylist() if path.exists() else []

    def run_names(self) -> list[str]:
        return [str(r) for r in self.runs().column("run").to_pylist()]

    def run_info(self, run: str) -> dict[str, Any]:
        for row in self.runs().to_pylist():
            if row["run"] == run:
                return row
        known = ", ".join(self.run_names()) or "none"
        raise StoreError(f"run {run!r} is not in store {self.root} (runs: {known}); "
                         f"ingest it first: dumpstore ingest PATH --run {run}")

    @contextmanager
    def _lock(self, name: str, wait_message: str | None = None) -> Iterator[None]:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{name}.lock", "w") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if wait_message:
                    import sys
                    sys.stderr.write(wait_message + "\n")
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def run_lock(self, run: str):
        """Held for a whole ingest of `run`: a second ingest of the same run waits."""
        return self._lock(f"run-{run}", f"waiting: another ingest of run {run!r} into {self.root} is running")

    def publish_run(self, row: dict[str, Any]) -> None:
        """Make an ingest live: replace the run's catalog row atomically, then remove its old files."""
        with self._lock("catalog"):
            rows = [r for r in self.runs().to_pylist() if r["run"] != row["run"]]
            rows.append(row)
            rows.sort(key=lambda r: r["run"])
            self._write_catalog(rows)
        self.collect_garbage(row["run"], keep=row["ingest_id"])

    def rewrite_catalog(self, rows: list[dict[str, Any]]) -> None:
        """Replace the catalog with `rows` (current schema) in one atomic rename."""
        with self._lock("catalog"):
            self._write_catalog(rows)

    def _write_catalog(self, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from .schema import RUN_SCHEMA

        tmp = self.root / f".{CATALOG}.{os.getpid()}.tmp"
        pq.write_table(pa.Table.from_pylist(rows, RUN_SCHEMA), tmp)
        os.replace(tmp, self.root / CATALOG)

    def collect_garbage(self, run: str, keep: str, *, grace: float = GC_GRACE_SECONDS) -> None:
        """Delete files of `run` written by other (replaced or killed) ingests, once older than `grace` seconds.

        The grace period lets a query that resolved its file list before the catalog changed finish reading.
        """
        now = time.time()
        for sub in ("tensors", "stacks"):
            base = self.root / sub / f"run={run}"
            if not base.exists():
                continue
            for path in base.rglob("part-*.parquet"):
                if not path.name.startswith(f"part-{keep}") and _age(path, now) >= grace:
                    _unlink_quietly(path)

    # -- reading -------------------------------------------------------------------------------------
    def tensor_files(self, runs: list[str] | None = None, catalog: pa.Table | None = None) -> list[str]:
        """Parquet files of the live ingests (globs), optionally only of `runs`; `catalog`: runs() if read."""
        out = []
        for row in (catalog if catalog is not None else self.runs()).to_pylist():
            if runs is None or row["run"] in runs:
                part = f"part-{row['ingest_id']}*.parquet"
                out.append(str(self.root / "tensors" / f"run={row['run']}" / "*" / "*" / part))
        return out

    def stack_files(self, catalog: pa.Table | None = None) -> list[str]:
        out = []
        for row in (catalog if catalog is not None else self.runs()).to_pylist():
            d = self.root / "stacks" / f"run={row['run']}"
            if any(d.glob(f"part-{row['ingest_id']}*.parquet")):
                out.append(str(d / f"part-{row['ingest_id']}*.parquet"))
        return out


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def open_store(path: str | os.PathLike | None = None, *, create: bool = False) -> Store:
    """Open (or with create=True, make) the store at `path` (default: $DUMPSTORE_STORE or ./dumpstore_store)."""
    root = Path(path) if path is not None else default_store_path()
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root}: exists and is not a folder; pick another --store")
    if not root.exists():
        if not create:
            raise StoreError(f"{root}: no store here; ingest a dump first (dumpstore ingest PATH --run NAME), "
                             f"or point --store / ${ENV_STORE} at an existing store")
        root.mkdir(parents=True, exist_ok=True)
    return Store(root)

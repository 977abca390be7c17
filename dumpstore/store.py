"""The store: a folder of hive-partitioned Parquet plus runs.parquet, opened as read-only DuckDB views."""

from __future__ import annotations

import errno
import os
import shutil
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
        self._catalog: tuple[tuple[int, ...], pa.Table, list[dict[str, Any]]] | None = None

    # -- catalog -------------------------------------------------------------------------------------
    def runs(self) -> pa.Table:
        return self._read_catalog()[0]

    def _read_catalog(self) -> tuple[pa.Table, list[dict[str, Any]]]:
        """The catalog as a table and as rows; read again only when the file was replaced (a command asks for it
        a dozen times)."""
        from .schema import RUN_SCHEMA

        path = self.root / CATALOG
        try:
            st = path.stat()
        except FileNotFoundError:
            if not self._no_catalog():
                return RUN_SCHEMA.empty_table(), []
            st = path.stat()  # another run's ingest published it while we looked
        key = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if self._catalog is None or self._catalog[0] != key:
            table = self._checked_catalog(path)
            self._catalog = key, table, table.to_pylist()
        return self._catalog[1], self._catalog[2]

    def _no_catalog(self) -> bool:
        """A store without runs.parquet is empty only when it holds no run's data: a catalog deleted or lost is an
        error naming the runs it held and the fix, never an empty store (an ingest would orphan their data).
        True when the catalog is there now: an ingest of another run side by side writes it before it marks its data
        published, so data seen published after the catalog was found missing means it came meanwhile (read it)."""
        from .runrecord import runs_with_data

        held = runs_with_data(self.root)
        if held and (self.root / CATALOG).exists():
            return True
        if held:
            raise StoreError(
                f"{self.root / CATALOG}: the store's catalog is missing, but the store holds data of runs "
                f"{', '.join(held[:10])}{' ...' if len(held) > 10 else ''}; rebuild it with "
                f"`dumpstore repair --store {self.root}`"
            )
        return False

    def _read_catalog_file(self, path: Path) -> pa.Table:
        """runs.parquet as a table; a file that is not a readable catalog is one StoreError naming it and the fix."""
        from .parquetio import read_table

        try:
            table = read_table(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise StoreError(
                f"{path}: the store's catalog is unreadable ({' '.join(str(exc).split())[:200]}); rebuild it with "
                f"`dumpstore repair --store {self.root}`"
            ) from None
        if "run" not in table.schema.names or "ingest_id" not in table.schema.names:
            raise StoreError(
                f"{path}: not a dumpstore catalog (no run / ingest_id columns); rebuild it with "
                f"`dumpstore repair --store {self.root}`"
            )
        return table

    def _checked_catalog(self, path: Path) -> pa.Table:
        from .schema import SCHEMA_VERSION

        table = self._read_catalog_file(path)
        versions = set(table.column("schema_version").to_pylist()) if "schema_version" in table.schema.names else {0}
        newer = sorted(v for v in versions if isinstance(v, int) and v > SCHEMA_VERSION)
        if newer:
            raise StoreError(newer_schema_message(self.root, table.to_pylist()))
        old = sorted(v for v in versions if v != SCHEMA_VERSION)
        if old:
            raise StoreError(
                f"{self.root}: store written with schema version {old[0]}, this dumpstore reads "
                f"version {SCHEMA_VERSION}; run `dumpstore upgrade --store {self.root}` to re-ingest "
                "its runs from their dump folders, or ingest them into a new store"
            )
        return table

    def raw_runs(self) -> list[dict[str, Any]]:
        """Catalog rows whatever their schema version (for upgrades); errors as `runs()` for a missing or unreadable
        catalog."""
        path = self.root / CATALOG
        if not path.exists() and not self._no_catalog():
            return []
        return self._read_catalog_file(path).to_pylist()

    def run_names(self) -> list[str]:
        return [str(r) for r in self.runs().column("run").to_pylist()]

    def run_info(self, run: str) -> dict[str, Any]:
        for row in self._read_catalog()[1]:
            if row["run"] == run:
                return dict(row)
        known = ", ".join(self.run_names()) or "none"
        raise StoreError(
            f"run {run!r} is not in store {self.root} (runs: {known}); "
            f"ingest it first: dumpstore ingest PATH --run {run}"
        )

    @contextmanager
    def _lock(self, name: str, what: str) -> Iterator[dict[str, Any] | None]:
        from .lock import hold

        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with hold(locks / f"{name}.lock", what) as stale:
            yield stale

    @contextmanager
    def run_lock(self, run: str) -> Iterator[None]:
        """Held for a whole ingest of `run`: a second ingest of the same run waits. What an ingest killed while
        holding it left behind (its staging folder, files of a publish cut short) is removed on taking it."""
        with self._lock(f"run-{run}", f"ingest of run {run!r} into {self.root}"):
            self.collect_garbage(run, keep=self._live_id(run))
            self.sweep_stale(but=run)
            yield

    def sweep_stale(self, but: str | None = None) -> None:
        """Remove what killed ingests of other runs left (staging of a new run nobody ingests again included): each
        run whose lock no one holds now is collected as its own next ingest would (`collect_garbage`)."""
        from .lock import try_hold

        base = self.root / _STAGING
        try:
            names = sorted(d.name[4:] for d in base.iterdir() if d.name.startswith("run=") and d.is_dir())
        except OSError:
            return
        try:
            live = {r["run"]: r["ingest_id"] for r in self.raw_runs()}
        except StoreError:  # a catalog that cannot be read: nothing is removed
            return
        now = time.time()
        for run in names:
            if run == but:
                continue
            try:  # cheap first: only a run with a folder to remove is locked and collected
                stale = [
                    d
                    for d in (base / f"run={run}").iterdir()
                    if d.name != live.get(run) and _replaced_for(d, now) >= GC_GRACE_SECONDS
                ]
            except OSError:
                continue
            if not stale:
                continue
            with try_hold(self.root / ".locks" / f"run-{run}.lock") as held:
                if held:
                    try:
                        self.collect_garbage(run, keep=self._live_id(run))
                    except StoreError:  # a catalog that cannot be read: nothing is removed
                        return
                    _rmdir_quietly(base / f"run={run}")

    def _live_id(self, run: str) -> str | None:
        return next((r["ingest_id"] for r in self.raw_runs() if r["run"] == run), None)

    def staging_dir(self, run: str, ingest_id: str) -> Path:
        """Where ingest `ingest_id` of `run` writes its files (outside tensors/ and stacks/ until published; kept
        there, linked, while live and for a grace period after being replaced, for readers of the old catalog)."""
        return staging_dir(self.root, run, ingest_id)

    def discard(self, run: str, ingest_id: str) -> None:
        """Remove what a failed ingest wrote (its staging folder and any file it published)."""
        live = self._live_id(run)
        if live == ingest_id:  # it was published: what failed came after (nothing to undo)
            return
        self._prune_tree(run, keep=live, only=ingest_id)
        _remove_tree(self.staging_dir(run, ingest_id))
        _rmdir_quietly(self.root / _STAGING / f"run={run}")

    def publish_run(self, row: dict[str, Any]) -> None:
        """Make an ingest live: link its files into tensors/ and stacks/, replace the run's catalog row atomically,
        then take the replaced ingest's files out of the tree at once (readers of the old catalog still find them
        in its staging folder for GC_GRACE_SECONDS; files already open stay readable)."""
        from .runrecord import mark_published, write_run_record

        run, new = row["run"], row["ingest_id"]
        staged = self.staging_dir(run, new)
        write_run_record(staged, row)  # the catalog can be rebuilt from the data (dumpstore repair)
        self._link_into_tree(staged, run)
        with self._lock("catalog", f"catalog of store {self.root}"):
            rows = [r for r in self.runs().to_pylist() if r["run"] != run]
            old = next((r["ingest_id"] for r in self.raw_runs() if r["run"] == run), None)
            rows.append(row)
            rows.sort(key=lambda r: r["run"])
            # the catalog first: a reader that finds a published ingest and no catalog takes it for a lost catalog
            # (another run's ingest into the same store reads the catalog while this one publishes)
            self._write_catalog(rows)
            mark_published(staged)
        if old is not None and old != new:
            _touch(self.staging_dir(run, old) / _REPLACED)
        self.collect_garbage(run, keep=new)

    def _link_into_tree(self, staged: Path, run: str) -> None:
        """Hard-link the staged files into tensors/run=<run>/ and stacks/run=<run>/ (copy where links fail)."""
        for sub in ("tensors", "stacks"):
            base = staged / sub
            if not base.exists():
                continue
            for path in sorted(base.rglob("part-*.parquet")):
                dest = self.root / sub / f"run={run}" / path.relative_to(base)
                dest.parent.mkdir(parents=True, exist_ok=True)
                _link(path, dest)

    def rewrite_catalog(self, rows: list[dict[str, Any]]) -> None:
        """Replace the catalog with `rows` (current schema) in one atomic rename."""
        with self._lock("catalog", f"catalog of store {self.root}"):
            self._write_catalog(rows)

    def _write_catalog(self, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa

        from .parquetio import write_table
        from .schema import RUN_SCHEMA

        tmp = self.root / f".{CATALOG}.{os.getpid()}.tmp"
        try:
            write_table(pa.Table.from_pylist(rows, RUN_SCHEMA), tmp)
            os.replace(tmp, self.root / CATALOG)
        finally:
            _unlink_quietly(tmp)

    def collect_garbage(self, run: str, keep: str | None, *, grace: float = GC_GRACE_SECONDS) -> None:
        """Take every file of `run` but those of ingest `keep` out of tensors/ and stacks/ now; delete staging
        folders of failed or killed ingests now, and of replaced ones `grace` seconds after their replacement
        (readers that read the catalog before the replacement may still be opening their files).
        Call with the run's lock held."""
        self._prune_tree(run, keep)
        base = self.root / _STAGING / f"run={run}"
        if not base.is_dir():
            return
        now = time.time()
        for d in base.iterdir():
            if d.name != keep and _replaced_for(d, now) >= grace:
                _remove_tree(d)

    def _prune_tree(self, run: str, keep: str | None, only: str | None = None) -> None:
        for sub in ("tensors", "stacks"):
            base = self.root / sub / f"run={run}"
            if not base.exists():
                continue
            for path in base.rglob("part-*.parquet"):
                ingest_id = path.name[5 : 5 + _ID_LEN]
                if ingest_id != keep and (only is None or ingest_id == only):
                    _unlink_quietly(path)
            _remove_empty_dirs(base)

    # -- reading -------------------------------------------------------------------------------------
    def tensor_files(self, runs: list[str] | None = None, catalog: pa.Table | None = None) -> list[str]:
        """Parquet files of the live ingests (globs), optionally only of `runs`; `catalog`: runs() if read.

        They are the ingests' own (staging) copies, which stay for a while after a re-ingest replaces them;
        stores written before staging existed keep their files in tensors/ only."""
        out = []
        for row in (catalog if catalog is not None else self.runs()).to_pylist():
            if runs is None or row["run"] in runs:
                run, ingest_id = row["run"], row["ingest_id"]
                part = f"part-{ingest_id}*.parquet"
                staged = self.staging_dir(run, ingest_id) / "tensors"
                base = staged if staged.is_dir() else self.root / "tensors" / f"run={run}"
                out.append(str(base / "*" / "*" / part))
        return out

    def stack_files(self, catalog: pa.Table | None = None) -> list[str]:
        out = []
        for row in (catalog if catalog is not None else self.runs()).to_pylist():
            run, ingest_id = row["run"], row["ingest_id"]
            staged = self.staging_dir(run, ingest_id)
            d = staged / "stacks" if staged.is_dir() else self.root / "stacks" / f"run={run}"
            if any(d.glob(f"part-{ingest_id}*.parquet")):
                out.append(str(d / f"part-{ingest_id}*.parquet"))
        return out


def newer_schema_message(root: Path, rows: list[dict[str, Any]]) -> str:
    """The refusal of a store written by a newer dumpstore (never read, upgraded or downgraded by this one)."""
    from . import __version__
    from .schema import SCHEMA_VERSION

    newest = max(
        (r for r in rows if isinstance(r.get("schema_version"), int)), key=lambda r: r["schema_version"], default={}
    )
    by = newest.get("dumpstore_version") or f"schema version {newest.get('schema_version')}"
    return (
        f"{root}: store written by dumpstore {by} (schema version {newest.get('schema_version')}); this is dumpstore "
        f"{__version__} (schema version {SCHEMA_VERSION}): upgrade dumpstore"
    )


_STAGING = ".ingests"  # hidden: Parquet readers of the store (and of tensors/) skip names starting with "."
_REPLACED = ".replaced"  # in a staging folder: its ingest was replaced at this file's mtime
_ID_LEN = 12  # ingest ids are 12 hex digits


def staging_dir(root: str | os.PathLike, run: str, ingest_id: str) -> Path:
    """`<store>/.ingests/run=<run>/<ingest_id>`: the files of one ingest (see Store.staging_dir)."""
    return Path(root) / _STAGING / f"run={run}" / ingest_id


def _replaced_for(d: Path, now: float) -> float:
    """Seconds since the staging folder's ingest was replaced; infinite for one never published (failed or
    killed: its run's lock is held, so it is not running)."""
    try:
        return now - (d / _REPLACED).stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _link(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except FileExistsError:
        dest.unlink()
        os.link(src, dest)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.copyfile(src, tmp)  # a file system without hard links: a copy, renamed in whole
        os.replace(tmp, dest)


def _touch(path: Path) -> None:
    try:
        path.touch()
    except FileNotFoundError:  # a store written before staging existed: nothing to keep
        pass


def _remove_tree(path: Path) -> None:
    """Delete a folder and what it holds, best effort, by absolute paths (links are removed, not followed)."""
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            _remove_quietly(Path(dirpath) / name)
        for name in dirnames:
            sub = Path(dirpath) / name
            _remove_quietly(sub) if sub.is_symlink() else _rmdir_quietly(sub)
    _rmdir_quietly(path)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _remove_empty_dirs(base: Path) -> None:
    for d in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _rmdir_quietly(d)
    _rmdir_quietly(base)


def _rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


_FULL = (errno.ENOSPC, errno.EDQUOT)
_WRITE_ERRORS = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
    "Permission denied": errno.EACCES,
}


@contextmanager
def store_errors(path: str | os.PathLike | None) -> Iterator[None]:
    """Turn a failed write into the store (full, out of inodes, read-only, not writable) into one StoreError line
    naming the store and the fix; other OSErrors pass unchanged."""
    try:
        yield
    except OSError as exc:
        root = Path(path) if path is not None else default_store_path()
        code = _write_errno(exc)
        if code is None:
            raise
        raise StoreError(_write_message(root, code)) from None


def _write_errno(exc: OSError) -> int | None:
    """The errno of a write failure (pyarrow's errors carry it only in their text)."""
    if exc.errno in (*_FULL, errno.EROFS, errno.EACCES, errno.EPERM):
        return exc.errno
    text = str(exc)
    return next((code for words, code in _WRITE_ERRORS.items() if words in text), None)


def _write_message(root: Path, code: int) -> str:
    if code in _FULL:
        what = "has no free inodes" if _no_inodes(root) else "is full" if code == errno.ENOSPC else "is over quota"
        return (
            f"{root}: the store's file system {what}; nothing was ingested (the store is unchanged); free space "
            "there (df -h / df -i) or pick another --store"
        )
    if code == errno.EROFS:
        return (
            f"{root}: the store is on a read-only file system; nothing was ingested; remount it read-write "
            "or pick another --store"
        )
    return (
        f"{root}: no permission to write into the store; nothing was ingested; fix its permissions or pick "
        "another --store"
    )


def _no_inodes(root: Path) -> bool:
    probe = root if root.exists() else root.parent
    try:
        info = os.statvfs(probe)
    except OSError:
        return False
    return info.f_files > 0 and info.f_favail == 0


def open_store(path: str | os.PathLike | None = None, *, create: bool = False) -> Store:
    """Open (or with create=True, make) the store at `path` (default: $DUMPSTORE_STORE or ./dumpstore_store)."""
    root = Path(path) if path is not None else default_store_path()
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root}: exists and is not a folder; pick another --store")
    if not root.exists():
        if not create:
            raise StoreError(
                f"{root}: no store here; ingest a dump first (dumpstore ingest PATH --run NAME), "
                f"or point --store / ${ENV_STORE} at an existing store"
            )
        root.mkdir(parents=True, exist_ok=True)
    return Store(root)

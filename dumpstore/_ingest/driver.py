"""Ingest a dump tree into the store: its units run by a local process pool or on Ray, published atomically
per run (the upgrade of a store written by an older schema, which re-ingests, is dumpstore/upgrade.py)."""

from __future__ import annotations

import os
import re
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from .. import summary
from ..errors import DumpFormatError, DumpstoreWarning, StoreError
from ..layout import Unit, find_units
from ..store import Store, open_store, store_errors
from ..workers import worker_init
from .catalog import _catalog_row, _combine
from .model import IngestOptions, IngestResult, UnitResult, one_line
from .pool import _maybe_pool
from .unit import _ingest_unit

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def ingest(
    path: str | os.PathLike,
    run: str,
    *,
    store: str | os.PathLike | None = None,
    options: IngestOptions | None = None,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    engine: str = "local",
    engine_options: dict[str, Any] | None = None,
    staged: Callable[[dict[str, Any]], None] | None = None,
) -> IngestResult:
    """Ingest every dump under `path` as run `run`; replaces an earlier run of that name atomically.

    `engine`: 'local' (a process pool on this machine) or 'ray' (tasks on a Ray cluster writing into a store
    every node reaches; `engine_options` go to `engine_ray.run_units`: address, batch, retries).
    `staged`: the ingest is only staged, not published: its catalog row goes to `staged` (dumpstore.upgrade
    publishes several at once, holding the runs' locks itself)."""
    opts = options or IngestOptions()
    summary.check_sketch_m(opts.sketch_m)
    if engine not in ("local", "ray"):
        raise StoreError(f"engine {engine!r} is not known; use 'local' or 'ray'")
    if not _RUN_NAME.match(run):
        raise StoreError(f"run name {run!r} is not allowed; use letters, digits, '.', '_' or '-' (max 128)")
    try:
        units = find_units(path)
        with store_errors(store):
            st = open_store(store, create=True)
            ingest_id = uuid.uuid4().hex[:12]
            # errors are worded inside: a full file system is told from one without inodes before the cleanup
            lock = st.run_lock(run) if staged is None else nullcontext()
            with lock, _discarded_on_failure(st, run, ingest_id), store_errors(st.root):
                if engine == "ray":
                    from ..engine_ray import run_units as ray_units

                    results = ray_units(
                        st, run, ingest_id, units, opts, work=_ingest_unit, progress=progress, **(engine_options or {})
                    )
                else:
                    results = _run_units(st, run, ingest_id, units, opts, jobs, progress)
                total = _combine(run, ingest_id, results)
                _warn(results)
                row = _catalog_row(run, ingest_id, path, units, results, total, opts)
                st.publish_run(row) if staged is None else staged(row)
    except DumpFormatError as exc:
        if one_line(str(exc)) == str(exc):
            raise
        raise DumpFormatError(one_line(str(exc))) from None  # a folder or file name with a line break
    return total


@contextmanager
def _discarded_on_failure(st: Store, run: str, ingest_id: str) -> Iterator[None]:
    """Remove what the ingest wrote when it fails (an error, Ctrl-C): the store stays as it was."""
    try:
        yield
    except BaseException:
        st.discard(run, ingest_id)
        raise


def _run_units(
    st: Store,
    run: str,
    ingest_id: str,
    units: list[Unit],
    opts: IngestOptions,
    jobs: int | None,
    progress: Callable[[int, int], None] | None,
) -> list[UnitResult]:
    tasks = [(u, str(st.root), run, ingest_id, opts) for u in units]
    n_jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    results: list[UnitResult] = []
    if progress:
        progress(0, len(tasks))
    if n_jobs == 1:
        cores = (jobs or os.cpu_count() or 1) if len(tasks) == 1 else 1
        spare = cores if opts.load_tensors else 1
        with _maybe_pool(spare) as files_pool:  # one dump file: its tensor files are read in parallel
            for t in tasks:
                results.append(_ingest_unit(*t, files_pool=files_pool, cores=cores))
                if progress:
                    progress(len(results), len(tasks))
        return results
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=n_jobs, initializer=worker_init, initargs=(os.getpid(),)) as pool:
        for res in pool.map(_ingest_unit_star, tasks):
            results.append(res)
            if progress:
                progress(len(results), len(tasks))
    return results


def _ingest_unit_star(args: tuple) -> UnitResult:
    return _ingest_unit(*args)


def _warn(results: list[UnitResult]) -> None:
    """The units' warnings (gathered where each unit was ingested, maybe another process) as DumpstoreWarnings."""
    for res in results:
        for message in res.meta.get("warnings", []):
            warnings.warn(message, DumpstoreWarning, stacklevel=3)

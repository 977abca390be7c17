"""The process pool that reads tensor files, started by its first task."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .. import summary
from ..workers import worker_init
from .tensors import _pt_max_bytes

if TYPE_CHECKING:  # imported where a pool is made: concurrent.futures and multiprocessing cost a statistics
    from concurrent.futures import Future, ProcessPoolExecutor  # ingest ~25 ms of start-up for nothing


@contextmanager
def _maybe_pool(workers: int) -> Iterator[_LazyPool | None]:
    if workers < 2:
        yield None
        return
    pool = _LazyPool(workers)
    try:
        yield pool
    finally:
        pool.shutdown()


class _LazyPool:
    """A process pool for tensor files, started by its first task: a statistics dump has no files to read, and
    concurrent.futures with multiprocessing costs ~25 ms to import."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None

    def submit(self, fn: Callable, *args: Any) -> Future:
        if self.pool is None:
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(
                max_workers=self.workers, initializer=_files_worker_init, initargs=(os.getpid(),)
            )
        return self.pool.submit(fn, *args)

    def start(self) -> None:
        """Start the workers now: they get ready for tensor files while this process reads the dump."""
        if self.pool is None:
            self.submit(_ready)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _files_worker_init(owner: int) -> None:
    """A tensor-file worker: ends with its parent (worker_init); loads what every task needs before the first."""
    worker_init(owner)
    _pt_max_bytes()  # the .pt reader
    import xxhash  # noqa: F401  (the content hash)

    summary._sign_tables()


def _ready() -> None:
    """The task that starts a pool's workers."""

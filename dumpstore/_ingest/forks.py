"""Forked children that each build a part of a dump's rows and hand it back through a pipe (Arrow IPC)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from ..errors import StoreError
from ..workers import worker_init
from .model import UnitResult


def _in_parts(
    first: Callable[[], tuple[pa.Table | None, Any]], others: Sequence[Callable[[], tuple[pa.Table | None, Any]]]
) -> list:
    """[first(), *(o() for o in others)], each of `others` run in a forked child at once while this process runs
    `first` (a child hands its part back through a pipe and leaves at once: no interpreter shutdown over its copy
    of the parent's objects).  Run before the Parquet file is opened, so no child holds it; the children are reaped
    whatever happens."""
    children = deque(_forked(build) for build in others)
    try:
        parts = [first()]
        while children:
            parts.append(_part_of(*children.popleft()))  # waits for the child whatever happens
    except BaseException:
        for pid, fd in children:  # a child blocked on a full pipe would wait for ever
            _reap(pid, fd)
        raise
    return parts


def _forked(build: Callable[[], tuple[pa.Table | None, Any]]) -> tuple[int, int]:
    """Fork a child that runs `build` and writes its result to a pipe (see _send): (pid, read end)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    code = 1  # the child: never returns
    try:
        os.close(read)
        worker_init(os.getppid())
        with os.fdopen(write, "wb") as fh:
            _send(fh, build)
        code = 0
    finally:
        os._exit(code)


def _send(fh: Any, build: Callable[[], tuple[pa.Table | None, Any]]) -> None:
    """A part as: 8-byte length of a pickled (ok, value or exception), that pickle, then the rows as an Arrow IPC
    stream (half the bytes of a pickled table, and read without a copy)."""
    import pickle

    import pyarrow.ipc as ipc

    try:
        table, value = build()
        header = pickle.dumps((True, value))
    except BaseException as exc:  # handed to the parent, which raises it
        table, header = None, pickle.dumps((False, exc if _picklable(exc) else RuntimeError(f"{exc!r}")))
    fh.write(len(header).to_bytes(8, "little") + header)
    if table is not None:
        with ipc.new_stream(fh, table.schema) as out:
            out.write_table(table)


def _picklable(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True


def _reap(pid: int, fd: int) -> None:
    import signal

    for step in (lambda: os.close(fd), lambda: os.kill(pid, signal.SIGKILL), lambda: os.waitpid(pid, 0)):
        try:
            step()
        except OSError:  # already closed, or already reaped by _part_of
            pass


def _part_of(pid: int, fd: int) -> tuple[pa.Table | None, UnitResult]:
    """What the child `pid` built (its exception raised here)."""
    import pickle

    import pyarrow.ipc as ipc

    try:
        with os.fdopen(fd, "rb") as fh:
            payload = fh.read()
    finally:  # (a child whose pipe is closed unread gets EPIPE and leaves)
        _, status = os.waitpid(pid, 0)
    n = int.from_bytes(payload[:8], "little")
    if status or len(payload) < 8 + n:
        raise StoreError(f"an ingest worker ended without its rows (wait status {status}); run the ingest again")
    ok, value = pickle.loads(payload[8 : 8 + n])
    if not ok:
        raise value
    rows = memoryview(payload)[8 + n :]
    return (ipc.open_stream(pa.py_buffer(rows)).read_all() if len(rows) else None), value

"""Store locks: an flock on a file that records its owner, never inherited by forked workers, taken over when stale.

A lock is held by the process that took it, not by its worker processes: after a fork the child's copy of every
held lock descriptor is pointed at /dev/null (so the lock is released the moment its owner dies, whatever its
workers do). The lock file names the owner (pid, host, process start time) while held and is emptied on release;
finding it non-empty when taking the lock means the previous owner died holding it (a stale lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import DumpstoreWarning

_HELD: set[int] = set()  # descriptors of the locks this process holds
_POLL = 0.2  # seconds between tries while another process holds the lock
_QUIET = 2.0  # seconds of waiting before the wait is announced


def _forget_inherited_locks() -> None:
    """In a forked child: stop sharing the parent's lock descriptors (dup /dev/null over them)."""
    if not _HELD:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    for fd in list(_HELD):
        try:
            os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_locks)


def notice(message: str) -> None:
    """Tell the user something the library did on their behalf (the CLI prints it as one `warning:` line)."""
    warnings.warn(message, DumpstoreWarning, stacklevel=3)


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot; Linux), to tell it from a later process of that pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_ticks(os.getpid())}


def owner_gone(owner: dict[str, Any]) -> bool:
    """Whether the process an owner record names has ended (False when it cannot be told: another host)."""
    pid = owner.get("pid")
    if type(pid) is not int or pid <= 0 or owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    start = owner.get("start")
    return start is not None and _start_ticks(pid) not in (None, start)  # the pid now names another process


def _read_owner(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        owner = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return {"pid": None}  # unreadable leftovers: a previous owner did not clean up
    return owner if owner is None or isinstance(owner, dict) else {"pid": None}


def _write_owner(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_me()).encode(), 0)


def _try_lock(path: Path) -> int | None:
    """The descriptor of `path` locked by this process, or None while another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def _describe(owner: dict[str, Any] | None) -> str:
    if not owner or type(owner.get("pid")) is not int:
        return "a process that left no record"
    return f"process {owner['pid']} on {str(owner.get('host'))[:64]}"


@contextmanager
def hold(path: Path, what: str) -> Iterator[dict[str, Any] | None]:
    """Hold the lock at `path` (waiting while a live process holds it); yields the record of a previous owner
    that died holding it (a stale lock, taken over with a notice), else None. `what` names the lock in notices."""
    told, since = False, time.monotonic()
    while (fd := _try_lock(path)) is None:
        if not told and time.monotonic() - since >= _QUIET:  # a short wait is ordinary (side-by-side ingests
            told = True  # publishing at once, an owner that has not written its record yet): said only if long
            notice(_wait_message(path, what))
        time.sleep(_POLL)
    _HELD.add(fd)
    try:
        stale = _read_owner(fd)
        if stale is not None:
            notice(
                f"{what}: taking over the lock of {_describe(stale)}, which ended without releasing it; "
                "cleaning up what it left"
            )
        _write_owner(fd)
        yield stale
    finally:
        _HELD.discard(fd)
        try:
            os.ftruncate(fd, 0)  # released cleanly: the next owner finds no record
        finally:
            os.close(fd)  # closing releases the flock


def _wait_message(path: Path, what: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        owner = _read_owner(fd)
        for _ in range(10):  # a new owner writes its record just after taking the lock: give it a moment
            if owner:
                break
            time.sleep(0.05)
            owner = _read_owner(fd)
    finally:
        os.close(fd)
    if owner is None:  # locked, yet no record: the owner is between taking the lock and writing it
        return f"waiting: {what}: held by another process"
    if owner and owner_gone(owner):
        return (
            f"waiting: {what}: the lock is held by processes left behind by {_describe(owner)}, which has "
            f"ended (workers of an older dumpstore?); end them to continue (fuser {path})"
        )
    return f"waiting: {what}: held by {_describe(owner)}"


@contextmanager
def try_hold(path: Path) -> Iterator[bool]:
    """Hold the lock at `path` if no one holds it now (yields True), else yield False at once; a stale record is
    overwritten silently (the caller only tidies up)."""
    fd = _try_lock(path)
    if fd is None:
        yield False
        return
    _HELD.add(fd)
    try:
        _write_owner(fd)
        yield True
    finally:
        _HELD.discard(fd)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)

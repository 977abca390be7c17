"""Worker processes that end with the process that started them (a killed ingest leaves no workers behind)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_WATCH_SECONDS = 0.5


def worker_init(owner: int) -> None:
    """Pool initializer: ask the kernel to kill this worker when its parent ends (Linux), and watch the parent and
    `owner` (the process that made the pool; the parent too, unless a fork server started the worker) as a
    fallback (other systems, or an owner that ended before the request took effect)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    parent = os.getppid()
    if not _alive(owner) or (parent != owner and parent == 1):
        os._exit(1)
    threading.Thread(target=_watch, args=(parent, owner), name="dumpstore-parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int, owner: int) -> None:
    while os.getppid() == parent and (owner == parent or _alive(owner)):
        time.sleep(_WATCH_SECONDS)
    os._exit(1)

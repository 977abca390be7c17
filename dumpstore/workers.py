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


def worker_init(parent: int) -> None:
    """Pool initializer: ask the kernel to kill this worker when its parent ends (Linux), and watch the parent's
    pid as a fallback (other systems, or a parent that ended before the request)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="dumpstore-parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_SECONDS)
    os._exit(1)

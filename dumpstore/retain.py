"""What a command leaves to the end of its process instead of freeing it.

Freeing a parsed dump.json (millions of small objects) takes ~70 ms per 10 MB of JSON.  The `dumpstore` console
script ends its process without that teardown (it flushes its output and calls os._exit), so it asks the library to
keep such an object until then; a library user (RETAINED is None) frees them as usual.  Only the latest object is
kept (an ingest of many units frees each dump before it parses the next): memory stays bounded by one."""

from __future__ import annotations

from typing import Any

RETAINED: list[Any] | None = None


def retain(obj: Any) -> None:
    """Keep `obj` alive until the process ends or the next retain (only when the console script asked for it)."""
    if RETAINED is not None:
        RETAINED[:] = [obj]

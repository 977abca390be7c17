"""dumpstore: ingest msprobe tensor dumps into a Parquet store and query them.

    import dumpstore
    dumpstore.ingest("dumps/ref", "ref", store="store")
    st = dumpstore.open_store("store")
    from dumpstore.analysis import compare_runs, divergence
    verdict = divergence(compare_runs(st, "target", "ref"))

The exports are imported on first use (PEP 562 module `__getattr__`): `import dumpstore` loads neither pyarrow
nor DuckDB.  Modules named like the function they export are private (`dumpstore._ingest`), so
`dumpstore.ingest` is always the function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._exports import lazy_exports
from .errors import DumpFormatError, DumpstoreError, QueryError, StoreError

__version__ = "0.1.0"

_EXPORTS = {
    "IngestOptions": "_ingest",
    "IngestResult": "_ingest",
    "ingest": "_ingest",
    "run_query": "query",
    "Store": "store",
    "open_store": "store",
}

if TYPE_CHECKING:
    from ._ingest import IngestOptions, IngestResult, ingest
    from .query import run_query
    from .store import Store, open_store

__all__ = [
    "DumpFormatError",
    "DumpstoreError",
    "IngestOptions",
    "IngestResult",
    "QueryError",
    "Store",
    "StoreError",
    "__version__",
    "ingest",
    "open_store",
    "run_query",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

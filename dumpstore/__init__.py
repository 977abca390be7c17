"""dumpstore: ingest msprobe tensor dumps into a Parquet store and query them.

    import dumpstore
    dumpstore.ingest("dumps/ref", "ref", store="store")
    st = dumpstore.open_store("store")
    from dumpstore.analysis import compare_runs, divergence
    verdict = divergence(compare_runs(st, "target", "ref"))

Exports are imported on first use (dumpstore/_lazy.py): `import dumpstore` does not load pyarrow or DuckDB.
"""

__version__ = "0.1.0"

from ._lazy import lazy_exports  # noqa: E402
from .errors import DumpFormatError, DumpstoreError, QueryError, StoreError  # noqa: E402

lazy_exports(__name__, {"IngestOptions": "ingest", "IngestResult": "ingest", "ingest": "ingest",
                        "run_query": "query", "Store": "store", "open_store": "store"})

__all__ = ["DumpFormatError", "DumpstoreError", "IngestOptions", "IngestResult", "QueryError", "Store",
           "StoreError", "__version__", "ingest", "open_store", "run_query"]

"""dumpstore: ingest msprobe tensor dumps into a Parquet store and query them.

    import dumpstore
    dumpstore.ingest("dumps/ref", "ref", store="store")
    st = dumpstore.open_store("store")
    from dumpstore.analysis import compare_runs, divergence
    verdict = divergence(compare_runs(st, "target", "ref"))
"""

__version__ = "0.1.0"

from .errors import DumpFormatError, DumpstoreError, QueryError, StoreError  # noqa: E402
from .ingest import IngestOptions, IngestResult, ingest  # noqa: E402
from .query import run_query  # noqa: E402
from .store import Store, open_store  # noqa: E402

__all__ = ["DumpFormatError", "DumpstoreError", "IngestOptions", "IngestResult", "QueryError", "Store",
           "StoreError", "__version__", "ingest", "open_store", "run_query"]

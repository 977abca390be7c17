"""dumpstore: ingest msprobe tensor dumps into a Parquet store and query them."""

__version__ = "0.1.0"

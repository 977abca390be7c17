"""The one exception root of dumpstore; the CLI turns it into `Error: ...` and exit 1.

DumpstoreError
 ├── DumpFormatError   a dump file is malformed (names file, record, fix)
 ├── StoreError        the store is missing, locked, or of another schema version
 └── QueryError        a query was refused or failed
      └── SelectionError  a step, rank or run selector matches nothing
DumpstoreWarning       (a UserWarning) something done on the user's behalf, e.g. a stale lock taken over
"""

from __future__ import annotations


class DumpstoreError(Exception):
    """Base class of every error dumpstore raises on purpose (bad input, not bugs)."""


class DumpFormatError(DumpstoreError):
    """A dump file or tensor file is malformed or unsafe."""


class StoreError(DumpstoreError):
    """The store cannot be opened or written."""


class QueryError(DumpstoreError):
    """A query was refused (not read-only) or failed."""


class SelectionError(QueryError):
    """A step, rank or run selector matches nothing in the store."""


class DumpstoreWarning(UserWarning):
    """Something the library did on the user's behalf (a stale lock taken over); the CLI prints it in one line."""

"""What an ingest is told and tells: its options, each unit's counts and the run's, and the row columns every
reader fills."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import summary
from ..records import LEAF_COLUMNS

_INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class IngestOptions:
    sample_k: int = summary.DEFAULT_SAMPLE_K
    sketch_m: int = summary.DEFAULT_SKETCH_M
    load_tensors: bool = True


@dataclass
class UnitResult:
    step: int
    rank: int
    files: int = 0
    records: int = 0
    rows: int = 0
    tensors: int = 0
    tensor_files: int = 0
    errors: int = 0
    first_error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class IngestResult:
    run: str
    ingest_id: str
    units: int
    records: int
    rows: int
    tensors: int
    tensor_files: int
    errors: int
    first_error: str | None
    steps: list[int]
    ranks: list[int]


def one_line(text: str) -> str:
    """`text` with its line breaks escaped: errors are one line even when a file name holds a newline."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


# A row's columns: the record's, the leaf's place in it, then what describes the leaf.
_RECORD_COLUMNS = (
    "seq",
    "record",
    "prefix",
    "api",
    "op_type",
    "call",
    "direction",
    "module",
    "is_recompute",
    "stack_id",
)


ROW_COLUMNS = _RECORD_COLUMNS + ("io", "index_path", "name", "leaf") + LEAF_COLUMNS
Batch = dict[str, Any]  # column -> a list of Python values (None = null), or an Arrow array


def utf8(value: Any) -> Any:
    """`value` with its strings storable as UTF-8: bytes of a non-UTF-8 file name become \\xNN, other lone
    surrogates \\uXXXX (lists are converted element-wise; other values are returned as they are)."""
    if isinstance(value, list):
        return [utf8(v) for v in value]
    if not isinstance(value, str):
        return value
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _merge(res: UnitResult, part: UnitResult) -> None:
    """Add a part's counts to the unit's (its first error only if the unit has none yet)."""
    res.records += part.records
    res.rows += part.rows
    res.tensors += part.tensors
    res.errors += part.errors
    res.first_error = res.first_error or part.first_error
    res.meta.update({k: v for k, v in part.meta.items() if k in ("checksum", "generation")})


def _int32(value: int | None) -> int | None:
    """A call counter for the int32 column; None when it does not fit (the record key keeps the digits)."""
    return value if value is not None and value <= _INT32_MAX else None


def _count(columns: Batch, res: UnitResult) -> None:
    """Count a batch's rows, tensors and errors into `res` (and make its errors one line)."""
    kinds, errors = columns["kind"], columns["error"]
    res.rows += len(kinds)
    res.tensors += kinds.count("tensor")
    if any(columns["checksum_kind"]):
        res.meta["checksum"] = next(k for k in reversed(columns["checksum_kind"]) if k)
    if any(errors):
        errors = columns["error"] = [one_line(e) if e else e for e in errors]
        res.errors += sum(1 for e in errors if e)
        if res.first_error is None:
            first = next(i for i, e in enumerate(errors) if e)
            res.first_error = f"{columns['name'][first]}: {errors[first]}"

"""TensorBoard event files, every scalar point: the TFRecord framing and the Event protobuf read here.

A TFRecord is `uint64 length | uint32 masked crc(length) | data | uint32 masked crc(data)` (little endian);
the data is an `Event` (wall_time=1 double, step=2 int64, summary=5) whose `Summary` holds repeated
`Value`s (tag=1, simple_value=2 float, tensor=8 TensorProto: dtype=1, tensor_content=4, float_val=5,
double_val=6, int_val=7, int64_val=10). TensorBoard's own accumulator keeps 10,000 points per tag by default;
this reader keeps all of them. A truncated last record (a job still writing) ends the file with a warning.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import pyarrow as pa

from ..errors import DumpstoreError, DumpstoreWarning
from .logs import Rows, canonical_tag, last_wins
from .walk import Listing, sorted_paths, walk


class EventFileError(DumpstoreError):
    """An event file that is not TFRecord/Event data."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message; value is int for varints and fixed, bytes for
    length-delimited."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, pos = _varint(buf, pos)
            yield num, wt, val
        elif wt == 1:
            yield num, wt, buf[pos : pos + 8]
            pos += 8
        elif wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise ValueError("length past the message")
            yield num, wt, buf[pos : pos + n]
            pos += n
        elif wt == 5:
            yield num, wt, buf[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"wire type {wt}")


_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64, _DT_HALF, _DT_BFLOAT16 = 1, 2, 3, 9, 19, 14


def _tensor_scalar(buf: bytes) -> float | None:
    dtype = 0
    vals: list[float] = []
    content = b""
    for num, wt, val in _fields(buf):
        if num == 1 and wt == 0:
            dtype = val
        elif num == 4 and wt == 2:
            content = val
        elif num == 5:  # float_val, packed or not
            vals.extend(struct.unpack(f"<{len(val) // 4}f", val) if wt == 2 else struct.unpack("<f", val))
        elif num == 6:
            vals.extend(struct.unpack(f"<{len(val) // 8}d", val) if wt == 2 else struct.unpack("<d", val))
        elif num in (7, 10) and wt == 0:
            vals.append(float(val if val < 2**63 else val - 2**64))
    if content:
        fmt = {_DT_FLOAT: "<f", _DT_DOUBLE: "<d", _DT_INT32: "<i", _DT_INT64: "<q"}.get(dtype)
        if fmt is not None and len(content) == struct.calcsize(fmt):
            return float(struct.unpack(fmt, content)[0])
        return None
    return vals[0] if len(vals) == 1 else None


def read_events(path: Path, rank: int = 0) -> pa.Table:
    """Every scalar of one event file as scalars rows (tags canonical: `lm loss` -> loss, `grad-norm` ->
    grad_norm, ...)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EventFileError(f"{path}: cannot read the event file ({exc.strerror})") from None
    rows = Rows()
    pos, end, n = 0, len(data), 0
    while pos < end:
        if pos + 12 > end:
            _truncated(path, n)
            break
        (length,) = struct.unpack_from("<Q", data, pos)
        start = pos + 12
        if start + length + 4 > end:
            _truncated(path, n)
            break
        try:
            _event(data[start : start + length], rows)
        except (ValueError, IndexError, struct.error) as exc:
            raise EventFileError(
                f"{path}: record {n} at byte {pos} is not a TensorBoard Event ({exc}); is this an event file?"
            ) from None
        pos = start + length + 4
        n += 1
    return samples_from_vs_tags(last_wins(rows.table(rank)))


def samples_from_vs_tags(table: pa.Table) -> pa.Table:
    """Megatron writes each scalar twice, `X` at the iteration and `X vs samples` at the consumed samples: the
    n-th points of the pair give iteration -> consumed samples, filled into every row of that iteration; the
    `vs samples` rows are then dropped (the same values again)."""
    import polars as pl

    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    tags = set(df.get_column("tag").unique().to_list())
    for vs in sorted(t for t in tags if t.endswith("_vs_samples")):
        base = canonical_tag(vs[: -len("_vs_samples")].replace("_", " "))
        base = base if base in tags else vs[: -len("_vs_samples")]
        if base not in tags:
            continue
        a = df.filter(pl.col("tag") == base).sort("step").get_column("step")
        b = df.filter(pl.col("tag") == vs).sort("step").get_column("step")
        if len(a) != len(b) or len(a) == 0:
            continue
        mapping = pl.DataFrame({"step": a, "_samples": b})
        df = df.join(mapping, on="step", how="left").with_columns(
            pl.coalesce("consumed_samples", "_samples").alias("consumed_samples")
        )
        df = df.drop("_samples")
        break
    if any(t.endswith("_vs_samples") for t in tags):  # the twins said what they had to say
        df = df.filter(~pl.col("tag").str.ends_with("_vs_samples"))
    return df.to_arrow().cast(table.schema)


def _truncated(path: Path, n: int) -> None:
    warnings.warn(
        f"{path}: the last record is cut short (a job still writing?); read the {n} whole records before it",
        DumpstoreWarning,
        stacklevel=3,
    )


def _event(buf: bytes, rows: Rows) -> None:
    step = 0
    summaries = []
    for num, wt, val in _fields(buf):
        if num == 2 and wt == 0:
            step = val if val < 2**63 else val - 2**64
        elif num == 5 and wt == 2:
            summaries.append(val)
    for summary in summaries:
        for num, wt, val in _fields(summary):
            if num != 1 or wt != 2:
                continue
            tag, value = None, None
            for vnum, vwt, vval in _fields(val):
                if vnum == 1 and vwt == 2:
                    tag = vval.decode("utf-8", "replace")
                elif vnum == 2 and vwt == 5:
                    value = struct.unpack("<f", vval)[0]
                elif vnum == 8 and vwt == 2 and value is None:
                    value = _tensor_scalar(vval)
            if tag is not None and value is not None:
                rows.add(step, None, [(canonical_tag(tag), float(value))])


def event_files(folder: Path, listing: Listing | None = None) -> list[Path]:
    """Event files under `folder` (or the file itself; `listing`: its walk.walk when made), by name."""
    if folder.is_file():
        return [folder]
    return sorted_paths([f for f in (walk(folder) if listing is None else listing) if "tfevents" in f[1]])

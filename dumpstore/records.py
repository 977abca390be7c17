"""Flatten one msprobe dump.json / debug.json into leaf rows (one dict per tensor or non-tensor leaf)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from .dtypes import FINFO_MAX, canonical, is_float
from .names import parse_record

MAX_DEPTH = 400
_SECTIONS_FORWARD = (("input_args", "input"), ("input_kwargs", "input"), ("output", "output"),
                     ("parameters", "parameters"))
_SECTIONS_BACKWARD = (("input", "input"), ("output", "output"))
_TENSOR_MARKERS = ("dtype", "shape")

Leaf = tuple[str, str, str, Any]  # io, index_path, name, leaf value
_INT64_LIMIT = 1 << 63  # shape and numel are int64 columns
# |Max| or |Min| at finfo(dtype).max (to the dumper's print precision) means saturated values
_SAT_LIMIT = {d: v * (1 - 1e-7) for d, v in FINFO_MAX.items() if is_float(d)}


def iter_leaves(key: str, record: Any) -> Iterator[Leaf]:
    """Yield (io, index_path, name, leaf) for every leaf of one record, in msprobe's row order."""
    if not isinstance(record, dict):
        yield "error", "", key, _Malformed(f"record is {type(record).__name__}, expected an object")
        return
    direction = parse_record(key).direction
    if direction == "parameters_grad":
        for pname, value in record.items():
            inner = value[0] if isinstance(value, list) and len(value) == 1 else value
            yield from _walk(inner, key, "parameters_grad", [str(pname)], 0, named_io=False)
        return
    if direction == "debug":
        yield from _walk(record, key, "debug", [], 0, named_io=False)
        return
    sections = _SECTIONS_BACKWARD if direction == "backward" else _SECTIONS_FORWARD
    # msprobe puts parameters rows before output rows in a module record
    order = [s for s in sections if s[0] != "output"] + [s for s in sections if s[0] == "output"]
    known = {s for s, _ in sections} | {"is_recompute"}
    for section, io in order:
        if section in record:
            yield from _walk_section(record[section], key, io)
    for extra in record:
        if extra not in known:
            yield from _walk(record[extra], key, str(extra), [], 0)


def _walk_section(value: Any, key: str, io: str) -> Iterator[Leaf]:
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, key, io, [str(i)], 0)
    elif isinstance(value, dict) and not _is_leaf(value):
        for k, item in value.items():
            yield from _walk(item, key, io, [str(k)], 0)
    else:
        yield from _walk(value, key, io, ["0"], 0)


def _is_leaf(value: dict) -> bool:
    return "type" in value and not isinstance(value.get("type"), (dict, list))


def _walk(value: Any, key: str, io: str, path: list[str], depth: int, *, named_io: bool = True) -> Iterator[Leaf]:
    """Leaves below `value`; the row name is record.io.index_path (record.index_path for grads and debug)."""
    index = ".".join(path)
    name = ".".join(p for p in (key, io if named_io else "", index) if p)
    if depth > MAX_DEPTH:
        yield io, index, name, _Malformed(f"nesting deeper than {MAX_DEPTH} levels")
    elif value is None or (isinstance(value, dict) and _is_leaf(value)):
        yield io, index, name, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, key, io, path + [str(i)], depth + 1, named_io=named_io)
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _walk(item, key, io, path + [str(k)], depth + 1, named_io=named_io)
    else:
        yield io, index, name, {"type": type(value).__name__, "value": value}


class _Malformed:
    def __init__(self, why: str):
        self.why = why


def leaf_row(leaf: Any) -> dict[str, Any]:
    """Columns describing one leaf from its JSON alone (tensor data is added by the ingest)."""
    if leaf is None:
        return {"kind": "null", "stats_source": "none", "file_status": "none"}
    if isinstance(leaf, _Malformed):
        return {"kind": "error", "error": leaf.why, "stats_source": "none", "file_status": "none"}
    if all(m in leaf for m in _TENSOR_MARKERS):
        return _tensor_leaf(leaf)
    return _scalar_leaf(leaf)


def _scalar_leaf(leaf: dict) -> dict[str, Any]:
    vtype = str(leaf.get("type", leaf.get("class_type", "")))
    value = leaf["value"] if "value" in leaf else {k: v for k, v in leaf.items() if k != "type"}
    row: dict[str, Any] = {"kind": "scalar", "value_type": vtype, "value": _json(value),
                           "stats_source": "none", "file_status": "none"}
    number = _num(value)
    if number is not None:
        row["scalar_value"] = number
    return row


def _json(value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=True, sort_keys=False)
    except (TypeError, ValueError):
        return json.dumps(str(value))


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:  # a JSON int past float64's range
            return math.inf if v > 0 else -math.inf
    return None


def _tensor_leaf(leaf: dict) -> dict[str, Any]:
    get = leaf.get
    dtype_raw = get("dtype")
    dtype = canonical(dtype_raw)
    shape, err = _shape(get("shape"))
    rg, dn = get("requires_grad"), get("data_name")
    mx, mn, mean, norm = _num(get("Max")), _num(get("Min")), _num(get("Mean")), _num(get("Norm"))
    row: dict[str, Any] = {
        "kind": "tensor", "value_type": str(get("type", "")), "dtype": dtype,
        "dtype_raw": None if dtype_raw is None else str(dtype_raw), "shape": shape,
        "numel": math.prod(shape) if shape is not None else None,
        "requires_grad": rg if rg is True or rg is False else None,
        "dump_max": mx, "dump_min": mn, "dump_mean": mean, "dump_norm": norm,
        "min": mn, "max": mx, "mean": mean, "norm": norm,
        "stats_source": "none" if mx is None and mn is None and mean is None and norm is None else "dump",
        "data_name": dn if isinstance(dn, str) else None, "file_status": "none", "error": err,
    }
    md5 = get("md5")
    if isinstance(md5, str):
        row["checksum"] = md5
        row["checksum_kind"] = "xor" if md5.startswith("0x") else "crc32"
    if mx is not None and mn is not None:
        _flags(row, mx, mn, dtype)
    return row


def _shape(value: Any) -> tuple[list[int] | None, str | None]:
    if type(value) is list and all(type(d) is int and d >= 0 for d in value):
        if math.prod(value) >= _INT64_LIMIT or any(d >= _INT64_LIMIT for d in value):
            return None, f"invalid shape {value!r:.200}: a dimension or the element count does not fit in int64"
        return list(value), None
    return None, f"invalid shape {value!r:.200}: expected a list of non-negative integers"


def stats_from_dump(row: dict[str, Any]) -> None:
    """Fill min/max/mean/norm and the has_* flags from the dumper's statistics (dump_* columns)."""
    mx, mn, mean, norm = row.get("dump_max"), row.get("dump_min"), row.get("dump_mean"), row.get("dump_norm")
    row.update(min=mn, max=mx, mean=mean, norm=norm)
    row["stats_source"] = "none" if mx is None and mn is None and mean is None and norm is None else "dump"
    if mx is not None and mn is not None:
        _flags(row, mx, mn, row.get("dtype") or "")


def _flags(row: dict[str, Any], mx: float, mn: float, dtype: str) -> None:
    """has_* flags from Max and Min only: the dumper's Mean and Norm overflow (to inf or NaN) on large finite
    values, while Max/Min are NaN exactly when a NaN is present (torch semantics) and +-inf when an Inf is."""
    row["has_nan"] = mx != mx or mn != mn
    row["has_posinf"] = mx == math.inf
    row["has_neginf"] = mn == -math.inf
    fmax = _SAT_LIMIT.get(dtype)
    row["has_sat"] = fmax is not None and ((abs(mx) >= fmax and mx != math.inf and mx != -math.inf)
                                           or (abs(mn) >= fmax and mn != math.inf and mn != -math.inf))

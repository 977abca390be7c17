"""Flatten one msprobe dump.json / debug.json record into its leaves, and describe each leaf as a tuple of columns."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from .dtypes import FINFO_MAX, canonical, is_float

MAX_DEPTH = 400
# (section, io) in msprobe's row order: a module record's parameters rows come before its output rows
_ORDER_FORWARD = (
    ("input_args", "input"),
    ("input_kwargs", "input"),
    ("parameters", "parameters"),
    ("output", "output"),
)
_ORDER_BACKWARD = (("input", "input"), ("output", "output"))
_KNOWN_FORWARD = frozenset(s for s, _ in _ORDER_FORWARD) | {"is_recompute"}
_KNOWN_BACKWARD = frozenset(s for s, _ in _ORDER_BACKWARD) | {"is_recompute"}

Leaf = tuple[str, str, str, Any]  # io, index_path, name, leaf value
_INT64_LIMIT = 1 << 63  # shape and numel are int64 columns
# |Max| or |Min| at finfo(dtype).max (to the dumper's print precision) means saturated values
_SAT_LIMIT = {d: v * (1 - 1e-7) for d, v in FINFO_MAX.items() if is_float(d)}
_INF = math.inf

# What leaf_columns returns, in this order; the other columns of a row describe its record and place.
LEAF_COLUMNS = (
    "kind",
    "value_type",
    "value",
    "scalar_value",
    "dtype",
    "dtype_raw",
    "shape",
    "numel",
    "requires_grad",
    "min",
    "max",
    "mean",
    "norm",
    "stats_source",
    "nan_count",
    "posinf_count",
    "neginf_count",
    "zero_count",
    "sat_count",
    "has_nan",
    "has_posinf",
    "has_neginf",
    "has_sat",
    "dump_max",
    "dump_min",
    "dump_mean",
    "dump_norm",
    "checksum",
    "checksum_kind",
    "data_name",
    "file_status",
    "sample",
    "sketch",
    "error",
)


def record_leaves(key: str, record: Any, direction: str) -> list[Leaf]:
    """(io, index_path, name, leaf) for every leaf of one record, in msprobe's row order; `direction` is
    parse_record(key).direction."""
    out: list[Leaf] = []
    if direction == "debug":  # PrecisionDebugger.save(var, name): any value, a list or a bare leaf included
        _walk(record, key, "debug", "", [], 0, out)
    elif not isinstance(record, dict):
        out.append(("error", "", key, _Malformed(f"record is {type(record).__name__}, expected an object")))
    elif direction == "parameters_grad":
        for pname, value in record.items():
            inner = value[0] if isinstance(value, list) and len(value) == 1 else value
            _walk(inner, key, "parameters_grad", "", [str(pname)], 0, out)
    else:
        backward = direction == "backward"
        for section, io in _ORDER_BACKWARD if backward else _ORDER_FORWARD:
            if section in record:
                _walk_section(record[section], key, io, out)
        known = _KNOWN_BACKWARD if backward else _KNOWN_FORWARD
        for extra in record:
            if extra not in known:
                _walk(record[extra], key, str(extra), str(extra), [], 0, out)
    return out


def _walk_section(value: Any, key: str, io: str, out: list[Leaf]) -> None:
    """A known section: its positions (args) or names (kwargs) are the first level of the index path."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            index = str(i)
            if item is None or (type(item) is dict and _is_leaf(item)):  # the common case, without the walk
                out.append((io, index, f"{key}.{io}.{index}" if key else f"{io}.{index}", item))
            else:
                _walk(item, key, io, io, [index], 0, out)
    elif isinstance(value, dict) and not _is_leaf(value):
        for k, item in value.items():
            _walk(item, key, io, io, [str(k)], 0, out)
    else:
        _walk(value, key, io, io, ["0"], 0, out)


def _is_leaf(value: dict) -> bool:
    return "type" in value and not isinstance(value["type"], (dict, list))


def _walk(value: Any, key: str, io: str, label: str, path: list[str], depth: int, out: list[Leaf]) -> None:
    """Append the leaves below `value`; the row name is record.label.index_path (label '' for grads and debug)."""
    if depth > MAX_DEPTH:
        out.append(_leaf(key, io, label, path, _Malformed(f"nesting deeper than {MAX_DEPTH} levels")))
    elif value is None or (isinstance(value, dict) and _is_leaf(value)):
        out.append(_leaf(key, io, label, path, value))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, key, io, label, path + [str(i)], depth + 1, out)
    elif isinstance(value, dict):
        for k, item in value.items():
            _walk(item, key, io, label, path + [str(k)], depth + 1, out)
    else:
        out.append(_leaf(key, io, label, path, {"type": type(value).__name__, "value": value}))


def _leaf(key: str, io: str, label: str, path: list[str], value: Any) -> Leaf:
    index = ".".join(path)
    if key and label and index:
        return io, index, f"{key}.{label}.{index}", value
    return io, index, ".".join(p for p in (key, label, index) if p), value


class _Malformed:
    def __init__(self, why: str):
        self.why = why


def _template(**values: Any) -> tuple:
    return tuple({"stats_source": "none", "file_status": "none", **values}.get(c) for c in LEAF_COLUMNS)


_NULL, _SCALAR, _ERROR = _template(kind="null"), _template(kind="scalar"), _template(kind="error")


def leaf_columns(leaf: Any, tensor_task: bool = True) -> tuple:
    """The LEAF_COLUMNS of one leaf from its JSON alone (tensor data is added by the ingest).  `tensor_task`: the
    dump is a tensor-mode dump, where every tensor names its file (msprobe's statistics dumps may write an
    empty `data_name`: no file)."""
    if leaf is None:
        return _NULL
    if isinstance(leaf, _Malformed):
        return _ERROR[:-1] + (leaf.why,)
    if "dtype" in leaf and "shape" in leaf:
        return _tensor_leaf(leaf, tensor_task)
    vtype = str(leaf.get("type", leaf.get("class_type", "")))
    value = leaf["value"] if "value" in leaf else {k: v for k, v in leaf.items() if k != "type"}
    return _SCALAR[:1] + (vtype, _json(value), _num(value)) + _SCALAR[4:]


def _json(value: Any) -> str:
    if type(value) is float:
        return repr(value) if -_INF < value < _INF else json.dumps(value)
    try:
        return json.dumps(value, allow_nan=True, sort_keys=False)
    except (TypeError, ValueError):
        return json.dumps(str(value))


def _num(v: Any) -> float | None:
    """A statistic as a float: JSON numbers and bools, and the strings msprobe writes for numbers ('inf', '-inf',
    'nan', in any case, and numbers as text); None for anything else."""
    if type(v) is float or v is None:
        return v
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:  # a JSON int past float64's range
            return math.inf if v > 0 else -math.inf
    if isinstance(v, str) and len(v) <= 64 and "_" not in v:
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _tensor_leaf(leaf: dict, tensor_task: bool = True) -> tuple:
    get = leaf.get
    dtype_raw = get("dtype")
    dtype = canonical(dtype_raw)
    shape, numel, err = _shape(get("shape"))
    rg, dn, md5 = get("requires_grad"), get("data_name"), get("md5")
    mx, mn, mean, norm = get("Max"), get("Min"), get("Mean"), get("Norm")
    if not (type(mx) is float and type(mn) is float and type(mean) is float and type(norm) is float):
        mx, mn, mean, norm = _num(mx), _num(mn), _num(mean), _num(norm)
    no_stats = mx is None and mn is None and mean is None and norm is None
    if mx is None or mn is None:
        has_nan = has_posinf = has_neginf = has_sat = None
    else:  # from Max and Min only: the dumper's Mean and Norm overflow (to inf or NaN) on large finite values,
        # while Max/Min are NaN exactly when a NaN is present (torch semantics) and +-inf when an Inf is
        has_nan, has_posinf, has_neginf = mx != mx or mn != mn, mx == _INF, mn == -_INF
        fmax = _SAT_LIMIT.get(dtype)
        has_sat = fmax is not None and (
            (abs(mx) >= fmax and mx != _INF and mx != -_INF) or (abs(mn) >= fmax and mn != _INF and mn != -_INF)
        )
    checksum = _checksum(md5)
    bad_name = "data_name" in leaf and (type(dn) is not str or (not dn and tensor_task))
    if bad_name and err is None:
        err = f"data_name {_brief(dn)} is not a file name; expected the name of the leaf's tensor file"
    return (
        "tensor",
        str(get("type", "")),
        None,
        None,  # kind, value_type, value, scalar_value
        dtype,
        None if dtype_raw is None else str(dtype_raw),
        shape,
        numel,
        rg if rg is True or rg is False else None,
        mn,
        mx,
        mean,
        norm,
        "none" if no_stats else "dump",
        None,
        None,
        None,
        None,
        None,  # nan_count .. sat_count: known only from a tensor file
        has_nan,
        has_posinf,
        has_neginf,
        has_sat,
        mx,
        mn,
        mean,
        norm,
        checksum,
        None if checksum is None else "xor" if checksum.startswith("0x") else "crc32",
        None if bad_name or dn is None else dn,
        "error" if bad_name else "none",  # data_name, file_status
        None,
        None,
        err,
    )  # sample, sketch, error


def _brief(value: Any) -> str:
    """A short rendering of a malformed JSON value: its text up to 60 characters, a container by size."""
    if isinstance(value, (list, dict)):
        return f"<{'list' if isinstance(value, list) else 'object'} of {len(value)} items>"
    if type(value) is int and value.bit_length() > 64:
        return f"<integer of {value.bit_length()} bits>"
    return json.dumps(value)[:60] if not isinstance(value, float) or math.isfinite(value) else repr(value)


def _checksum(md5: Any) -> str | None:
    """The md5 field as msprobe prints it: a string as is, an integer in decimal; '' and other types are none."""
    if isinstance(md5, str):
        return md5 or None
    if type(md5) is int:
        return str(md5)
    return None


def _shape(value: Any) -> tuple[list[int] | None, int | None, str | None]:
    """shape, numel and the error for a dumped shape."""
    if type(value) is list:
        numel = 1
        for d in value:
            if type(d) is not int or d < 0:
                break
            numel *= d
        else:
            if numel < _INT64_LIMIT and (numel or max(value) < _INT64_LIMIT):
                return value, numel, None
            return None, None, (f"invalid shape {value!r:.200}: a dimension or the element count does not fit in int64")
    return None, None, f"invalid shape {value!r:.200}: expected a list of non-negative integers"


_MISSING = object()  # a field the leaf does not have (data_name: absent is not the same as null)
# the fields of a tensor leaf, read in one pass: a dump's leaves are tens of thousands of dicts spread over memory,
# and one pass per field (ten) took three times as long
_FIELDS = ("Max", "Min", "Mean", "Norm", "dtype", "shape", "type", "requires_grad", "md5", "data_name")
_NOT_TENSOR = (None,) * (len(_FIELDS) - 1) + (_MISSING,)  # a leaf patched in from leaf_columns


def leaf_column_lists(leaves: list[Any], tensor_task: bool = True) -> dict[str, list]:
    """LEAF_COLUMNS of many leaves as one list per column: item i of each list is leaf_columns(leaves[i]).

    Tensor leaves (the bulk of a dump) go through one list comprehension per column instead of a tuple per leaf;
    the other leaves (scalars, nulls, malformed values) are patched in from leaf_columns."""
    n = len(leaves)
    if not n:
        return {c: [] for c in LEAF_COLUMNS}
    fields = [
        (
            v.get("Max"),
            v.get("Min"),
            v.get("Mean"),
            v.get("Norm"),
            v.get("dtype"),
            v.get("shape"),
            v.get("type", ""),
            v.get("requires_grad"),
            v.get("md5"),
            v.get("data_name", _MISSING),
        )
        if type(v) is dict and "dtype" in v and "shape" in v
        else _NOT_TENSOR
        for v in leaves
    ]
    others = [i for i, f in enumerate(fields) if f is _NOT_TENSOR]
    raw_mx, raw_mn, raw_mean, raw_norm, dtype_raw, raw_shape, raw_type, raw_rg, md5, raw_dn = zip(*fields)
    mx, mn, mean, norm = (_floats(list(v)) for v in (raw_mx, raw_mn, raw_mean, raw_norm))
    dtype = _canonical_list(dtype_raw)
    shape, numel, error = _shape_lists(raw_shape)
    data_name, file_status = _data_names(raw_dn, error, tensor_task)
    checksum = [None] * n if md5.count(None) == n else [None if m is None else _checksum(m) for m in md5]
    cols: dict[str, list] = {
        "kind": ["tensor"] * n,
        "value_type": [v if type(v) is str else str(v) for v in raw_type],
        "dtype": dtype,
        "dtype_raw": [v if v is None or type(v) is str else str(v) for v in dtype_raw],
        "shape": shape,
        "numel": numel,
        "requires_grad": [v if v is True or v is False else None for v in raw_rg],
        "min": mn,
        "max": mx,
        "mean": mean,
        "norm": norm,
        "stats_source": [
            "none" if a is None and b is None and c is None and e is None else "dump"
            for a, b, c, e in zip(mx, mn, mean, norm)
        ],
        **_flag_lists(mx, mn, dtype),
        "dump_max": list(mx),
        "dump_min": list(mn),
        "dump_mean": list(mean),
        "dump_norm": list(norm),
        "checksum": checksum,
        "checksum_kind": [None if c is None else "xor" if c.startswith("0x") else "crc32" for c in checksum],
        "data_name": data_name,
        "file_status": file_status,
        "error": error,
    }
    for c in LEAF_COLUMNS:  # value, scalar_value, the counts, sample, sketch: known only for other leaves
        if c not in cols:
            cols[c] = [None] * n
    _patch_others(cols, leaves, others, tensor_task)
    return cols


def _floats(values: list[Any]) -> list[float | None]:
    """The statistics as floats (see _num); a list of floats and nulls is taken as it is."""
    if set(map(type, values)) <= _FLOAT_OR_NONE:
        return values
    return [v if type(v) is float or v is None else _num(v) for v in values]


_FLOAT_OR_NONE = frozenset((float, type(None)))
_STR_OR_NONE = frozenset((str, type(None)))


def _canonical_list(raw: Sequence[Any]) -> list[str]:
    if set(map(type, raw)) <= _STR_OR_NONE:  # one canonical() per distinct name
        names = {v: canonical(v) for v in set(raw)}
        return [names[v] for v in raw]
    seen: dict[str, str] = {}
    out = []
    for v in raw:
        if type(v) is str:
            c = seen.get(v)
            if c is None:
                c = seen[v] = canonical(v)
            out.append(c)
        else:
            out.append(canonical(v))
    return out


def _shape_lists(raw: Sequence[Any]) -> tuple[list, list, list]:
    """shape, numel and error lists (see _shape)."""
    if not raw:
        return [], [], []
    shape, numel, error = zip(*[_shape(v) for v in raw])
    return list(shape), list(numel), list(error)


def _data_names(raw: Sequence[Any], error: list[str | None], tensor_task: bool) -> tuple[list, list]:
    """data_name and file_status lists from the data_name fields (_MISSING where absent); a data_name that is not
    a file name sets `error` (when it has none)."""
    status = ["none"] * len(raw)
    if raw.count(_MISSING) == len(raw):
        return [None] * len(raw), status  # no leaf names a file (statistics dumps)
    data_name = [None if v is _MISSING else v for v in raw]
    for i, dn in enumerate(data_name):
        if dn is not None and type(dn) is str and (dn or not tensor_task):
            continue
        if raw[i] is _MISSING:
            continue
        status[i], data_name[i] = "error", None  # present but not a usable file name
        if error[i] is None:
            error[i] = f"data_name {_brief(dn)} is not a file name; expected the name of the leaf's tensor file"
    return data_name, status


def _flag_lists(mx: list, mn: list, dtype: list[str]) -> dict[str, list]:
    """has_nan / has_posinf / has_neginf / has_sat from Max and Min (see _tensor_leaf)."""
    both = [a is not None and b is not None for a, b in zip(mx, mn)]
    return {
        "has_nan": [(a != a or b != b) if k else None for a, b, k in zip(mx, mn, both)],
        "has_posinf": [a == _INF if k else None for a, k in zip(mx, both)],
        "has_neginf": [b == -_INF if k else None for b, k in zip(mn, both)],
        "has_sat": [_saturated(a, b, _SAT_LIMIT.get(d)) if k else None for a, b, d, k in zip(mx, mn, dtype, both)],
    }


def _saturated(mx: float, mn: float, fmax: float | None) -> bool:
    return fmax is not None and (
        (abs(mx) >= fmax and mx != _INF and mx != -_INF) or (abs(mn) >= fmax and mn != _INF and mn != -_INF)
    )


def _patch_others(cols: dict[str, list], leaves: list[Any], others: list[int], tensor_task: bool) -> None:
    lists = [cols[c] for c in LEAF_COLUMNS]
    for i in others:
        for col, v in zip(lists, leaf_columns(leaves[i], tensor_task)):
            col[i] = v

"""msprobe's CSV cells as `msprobe compare` 26.2.0 writes them, per dump mode, and its Result / Err_message.

Summary cells (`NPU max` ... `Bench l2norm`): the dumped statistic as msprobe holds it: `None` for null, `True` /
`False` for bool, an argument's own value, `N/A` for a side without a leaf, ` inf` / ` -inf` for float infinities.
Statistics mode: `Max diff` ... `L2norm diff` and the four relative errors are msprobe's `CalcStatsDiff` cells.
Tensor mode: the six metrics of a row msprobe cannot compare (non-tensor or null leaf, no file, unmatched) are
`unsupported`; with `--exact` every cell is msprobe's own (`shape unmatched`, `N/A`, `Nan` included).
`Result` and `Err_message` follow msprobe's verdict rules (`core/compare/indicator_analysis/`), run per NPU op
(`verdicts`): tensor mode InfNan, OneThousandth, RequiresGrad, Parameters, DType, Shape, CosineWarn; statistics
mode InfNan, RelativeErr, RequiresGrad, Parameters, DType, Shape, RelativeWarn; md5 mode CRC32.

Statistics mode: msprobe 26.x `CalcStatsDiff` (metrics.stats_diff) on the two dumped values as msprobe holds
them (JSON numbers, `None` for null, `True`/`False` for bool tensors, an argument's own value): `0` where equal
as text, `N/A` on unmatched rows, else `inf`, `-inf`, `Nan`, `Diff` or |(npu - bench) / bench * 100| with `%`.
md5 mode: `NPU MD5` / `BENCH MD5` are the dumped checksums (an argument's: CRC-32 of its printed value; a
tensor whose md5 is empty: CRC-32 of ''), `N/A` for a side without a leaf.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from typing import Any

from .metrics import stats_diff

PASS, WARNING, ERROR = "pass", "warning", "error"
_LEVEL = {PASS: 0, WARNING: 1, ERROR: 2}
SUMMARY_COLUMNS = ("max", "min", "mean", "l2norm")
DIFF_COLUMNS = ("Max diff", "Min diff", "Mean diff", "L2norm diff")
TENSOR_METRIC_COLUMNS = (
    "Cosine",
    "EucDist",
    "MaxAbsErr",
    "MaxRelativeErr",
    "One Thousandth Err Ratio",
    "Five Thousandths Err Ratio",
)
UNSUPPORTED = "unsupported"

N_A = "N/A"
STAT_REL_COLUMNS = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")
MD5_COLUMNS = ("NPU MD5", "BENCH MD5")
_STATS = (("Max", "max"), ("Min", "min"), ("Mean", "mean"), ("Norm", "norm"))  # stats_diff key, column
# msprobe's verdict rules skip these APIs (all rows), or their input rows
_IGNORED_APIS = frozenset(
    (
        "empty",
        "empty_like",
        "numpy",
        "to",
        "__setitem__",
        "empty_with_format",
        "new_empty_strided",
        "new_empty",
        "empty_strided",
    )
)
_INPUT_IGNORED_APIS = frozenset(("_reduce_scatter_base", "_all_gather_base", "all_to_all_single", "batch_isend_irecv"))
_NO_MD5 = (N_A, "Nan", "")


def dump_mode(cmp, store) -> str | None:
    """msprobe's compare mode for the pair ('statistics', 'md5', 'tensor', ...), None when the runs differ."""
    if store is None:
        return None
    modes = {store.run_info(run).get("dump_mode") or None for run in (cmp.target, cmp.ref)}
    return modes.pop() if len(modes) == 1 else None


def columns(base: tuple[str, ...], mode: str | None) -> tuple[str, ...]:
    """The CSV columns for `mode`: the other three relative errors after MaxRelativeErr (statistics), the md5
    pair before `Requires_grad Consistent` (md5)."""
    cols = list(base)
    if mode == "statistics":
        at = cols.index("MaxRelativeErr") + 1
        cols[at:at] = [c for c in STAT_REL_COLUMNS[1:] if c not in cols]
    elif mode == "md5":
        at = cols.index("Requires_grad Consistent")
        cols[at:at] = [c for c in MD5_COLUMNS if c not in cols]
    return tuple(cols)


def held_summary(r: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """{(side, stat key): the value msprobe holds} of the leaf pair `r` before pandas sees it (N/A: no leaf)."""
    here = (r.get("name") is not None, r.get("ref_name") is not None)
    return {
        (side, key): _held_stat(r, pre, stat) if present else N_A
        for side, pre, present in (("NPU", "", here[0]), ("Bench", "ref_", here[1]))
        for key, stat in _STATS
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not _isnan(value)


def _isnan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def float_columns(helds: Iterator[dict[tuple[str, str], Any]]) -> frozenset[tuple[str, str]]:
    """The summary columns ((side, stat key)) pandas makes float64 in msprobe's table: those whose every value
    over msprobe's rows (`helds`, one per row with an NPU leaf) is an int or a float (no None, bool, text, NaN:
    msprobe writes NaN as the text 'Nan').  msprobe then prints their integers as floats (`3.0`) and compares
    them as such (`0.0%` where the other side holds `3`)."""
    cols = {(side, key) for side in ("NPU", "Bench") for key, _ in _STATS}
    for held in helds:
        cols = {c for c in cols if _is_number(held[c])}
        if not cols:
            break
    return frozenset(cols)


def fill(
    d: dict[str, Any], r: dict[str, Any], mode: str | None, floats: frozenset[tuple[str, str]] = frozenset()
) -> None:
    """Set msprobe's cells of CSV row `d` from the aligned leaf pair `r` (target columns, `ref_` columns):
    the summary cells as msprobe holds them and the mode's own cells (see the module docstring); `floats`: the
    summary columns msprobe's table holds as floats (float_columns)."""
    here = (r.get("name") is not None, r.get("ref_name") is not None)
    held = held_summary(r)
    for c in floats:
        if here[0] and _is_number(held[c]):  # a row of msprobe's table (it has no reference-only rows)
            held[c] = float(held[c])
    for side, pre in (("NPU", ""), ("Bench", "ref_")):
        for (key, _), col in zip(_STATS, SUMMARY_COLUMNS):
            value = held[side, key]
            if r.get(f"{pre}kind") == "tensor" and value is None and not _has_dump_stats(r, pre):
                value = d.get(f"{side} {col}")  # no dumper statistics (a folder of tensor files): the store's
            d[f"{side} {col}"] = _summary_cell(value)
    if mode == "statistics":
        if not all(here):
            d.update(dict.fromkeys(STAT_REL_COLUMNS + DIFF_COLUMNS, N_A))
            return
        cells = stats_diff({k: held["NPU", k] for k, _ in _STATS}, {k: held["Bench", k] for k, _ in _STATS})
        for col, (key, _) in zip(DIFF_COLUMNS, _STATS):
            rel = str(cells[f"{key}RelativeErr" if key != "Norm" else "NormRelativeErr"])
            diff = cells[col]
            d[col] = 0 if rel == "0" and diff == 0 else diff
        d.update({col: str(cells[col]) for col in STAT_REL_COLUMNS})
    elif mode == "tensor":
        comparable = all(here) and r.get("kind") == "tensor" and r.get("ref_kind") == "tensor"
        comparable = comparable and bool(r.get("data_name")) and bool(r.get("ref_data_name"))
        for col in TENSOR_METRIC_COLUMNS:
            if not comparable:
                d[col] = UNSUPPORTED
            elif isinstance(r.get(_EXACT[col]), str):
                d[col] = _exact_cell(r[_EXACT[col]])
    elif mode == "md5":
        d["NPU MD5"] = _md5(r, "") if here[0] else N_A
        d["BENCH MD5"] = _md5(r, "ref_") if here[1] else N_A


_EXACT = dict(
    zip(
        TENSOR_METRIC_COLUMNS,
        (
            "msprobe_cosine",
            "msprobe_euc_dist",
            "msprobe_max_abs_err",
            "msprobe_max_rel_err",
            "msprobe_one_thousandth",
            "msprobe_five_thousandth",
        ),
    )
)


def _exact_cell(text: str) -> Any:
    """An exact-mode cell: a number as a float (written like msprobe's), text ('unsupported', 'Nan') as is."""
    try:
        return _summary_cell(float(text))
    except ValueError:
        return text


def _has_dump_stats(r: dict[str, Any], pre: str) -> bool:
    return any(r.get(f"{pre}dump_{stat}") is not None for _, stat in _STATS)


def _summary_cell(value: Any) -> Any:
    """A value as msprobe's CSV prints it: None -> 'None', NaN -> 'Nan', float infinities with a leading space."""
    if value is None:
        return "None"
    if isinstance(value, float) and math.isnan(value):
        return "Nan"
    if isinstance(value, float) and math.isinf(value):
        return " inf" if value > 0 else " -inf"
    return value


def verdicts(rows: list[dict[str, Any]], mode: str | None) -> None:
    """Set `Result` and `Err_message` of one NPU op's CSV rows by msprobe 26.2.0's rules for `mode`
    (`ApiIndicatorCalculator`); rows only in the bench get `pass`, `[]` (msprobe has no such row)."""
    for d in rows:
        d["Result"], d["Err_message"] = PASS, []
    npu_rows = [d for d in rows if d["NPU Name"] != N_A]
    inputs = [d for d in npu_rows if ".output." not in d["NPU Name"]]
    outputs = [d for d in npu_rows if ".output." in d["NPU Name"]]
    ignore = _ignore_info(inputs)
    checked = [] if ignore == "all" else outputs if ignore == "input" else inputs + outputs
    checkers = _CHECKERS.get(mode or "", ())
    for checker in checkers:
        checker(inputs, outputs, checked, ignore in ("all", "input"))
    for d in rows:
        d["Err_message"] = json.dumps(d["Err_message"])


def _set(d: dict[str, Any], level: str, message: str) -> None:
    if _LEVEL[level] > _LEVEL[d["Result"]]:
        d["Result"] = level
    d["Err_message"].append(f"{level}: {message}")


def _ignore_info(inputs: list[dict[str, Any]]) -> str:
    if not inputs:
        return "none"
    parts = inputs[0]["NPU Name"].split(".")
    if len(parts) < 2:
        return "none"
    return "all" if parts[1] in _IGNORED_APIS else "input" if parts[1] in _INPUT_IGNORED_APIS else "none"


def _is_inf_or_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value) or math.isinf(value)
    return isinstance(value, str) and value.strip().lower() in ("inf", "-inf", "nan")


def _percent(value: Any) -> float:
    """msprobe's str2float: '12.5%' -> 0.125, 'inf' -> inf, anything else 0."""
    try:
        return float(str(value).strip("%")) / 100
    except ValueError:
        return 0.0


def _extreme(rows: list[dict[str, Any]], col: str, is_min: bool) -> float:
    """ApiData.get_min_or_max_value: over numbers and '%' cells, defaults 1.0 (min) / 0.0 (max)."""
    best = 1.0 if is_min else 0.0
    for d in rows:
        value = d[col]
        if value is None or value in ("Nan", N_A):
            continue
        if isinstance(value, str) and value.endswith("%"):
            value = _percent(value)
        if isinstance(value, str):
            continue
        if isinstance(value, float) and math.isnan(value):
            best = value if is_min else max(best, value)  # Python's min/max with NaN, as msprobe's loop does
            continue
        best = min(best, value) if is_min else max(best, value)
    return best


def _matched(d: dict[str, Any]) -> bool:
    return bool(d["Bench Name"]) and d["Bench Name"] != N_A


def _inf_nan(inputs, outputs, checked, skip_inputs) -> None:
    for d in checked:
        if _is_inf_or_nan(d["Bench max"]) or _is_inf_or_nan(d["Bench min"]):
            continue
        if _is_inf_or_nan(d["NPU max"]) or _is_inf_or_nan(d["NPU min"]):
            _set(d, ERROR, "There is nan/inf/-inf in the maximum or minimum value of NPU.")


def _relative_err(inputs, outputs, checked, skip_inputs) -> None:
    if skip_inputs:
        return
    if abs(_extreme(inputs, "NormRelativeErr", is_min=False)) < 0.1:
        for d in outputs:
            if abs(_percent(d["NormRelativeErr"])) > 0.5:
                _set(d, ERROR, "The NormRelativeErr of output is greater than 0.5.")


def _one_thousandth(inputs, outputs, checked, skip_inputs) -> None:
    if skip_inputs or not outputs:
        return
    col = "One Thousandth Err Ratio"
    if _extreme(inputs, col, True) > 0.9 and _extreme(outputs, col, True) < 0.1:
        _set(outputs[0], ERROR, "The input/parameters of One Thousandth Err Ratio > 0.9 while the output < 0.6.")


def _requires_grad(inputs, outputs, checked, skip_inputs) -> None:
    for d in checked:
        npu, bench = str(d["NPU Requires_grad"]), str(d["Bench Requires_grad"])
        if _matched(d) and npu and bench and npu != bench:
            _set(d, ERROR, "The Required_Grad of NPU and Bench are inconsistent")


def _parameters(inputs, outputs, checked, skip_inputs) -> None:
    if skip_inputs:
        return
    for d in inputs:
        if not _matched(d) or "class" not in d["NPU Dtype"] or "class" not in d["Bench Dtype"]:
            continue
        if d["NPU Tensor Shape"] == "[]" and d["NPU max"] != d["Bench max"]:
            _set(d, ERROR, "The scalar parameters of NPU and Bench are inconsistent.")


def _dtype(inputs, outputs, checked, skip_inputs) -> None:
    for d in checked:
        bench = d["Bench Name"]
        if not _matched(d) or "qkv" in bench or "gate_up" in bench:
            continue
        if d["NPU Dtype"] and d["Bench Dtype"] and d["NPU Dtype"] != d["Bench Dtype"]:
            _set(d, ERROR, "The dtype of NPU and Bench are inconsistent.")


def _shape(inputs, outputs, checked, skip_inputs) -> None:
    for d in checked:
        if _matched(d) and d["NPU Tensor Shape"] != d["Bench Tensor Shape"]:
            _set(d, ERROR, "The shape of NPU and Bench are inconsistent.")


def _relative_warn(inputs, outputs, checked, skip_inputs) -> None:
    if skip_inputs or not outputs:
        return
    rel_in = abs(_extreme(inputs, "NormRelativeErr", is_min=False))
    rel_out = abs(_extreme(outputs, "NormRelativeErr", is_min=False))
    if (rel_in == 0 and rel_out > 0.1) or (rel_in != 0 and rel_out / rel_in > 10):
        _set(outputs[0], WARNING, "The norm relative error of output is 10 times that of input.")


def _cosine_warn(inputs, outputs, checked, skip_inputs) -> None:
    if skip_inputs or not outputs:
        return
    cos_in, cos_out = _extreme(inputs, "Cosine", True), _extreme(outputs, "Cosine", True)
    if cos_in > 0.9 and cos_in - cos_out > 0.1:
        _set(outputs[0], WARNING, "The input/parameters of Cosine > 0.9, and input/parameters - output > 0.1")


def _crc32(inputs, outputs, checked, skip_inputs) -> None:
    for d in checked:
        npu, bench = d["NPU MD5"], d["BENCH MD5"]
        if npu != bench:
            if npu in _NO_MD5 or bench in _NO_MD5:
                _set(d, WARNING, "The parameter of NPU does not match the bench.")
            else:
                _set(d, ERROR, "The CRC-32 value of NPU differs from that of the bench.")


_CHECKERS = {
    "tensor": (_inf_nan, _one_thousandth, _requires_grad, _parameters, _dtype, _shape, _cosine_warn),
    "statistics": (_inf_nan, _relative_err, _requires_grad, _parameters, _dtype, _shape, _relative_warn),
    "md5": (_crc32,),
}


def stat_relative_error(npu: Any, bench: Any) -> str:
    """One statistics-mode relative-error cell, from the two values as msprobe holds them (metrics.stats_diff)."""
    return str(stats_diff({"Max": npu}, {"Max": bench})["MaxRelativeErr"])


def _held_stat(r: dict[str, Any], pre: str, stat: str) -> Any:
    """A leaf's Max/Min/Mean/Norm as msprobe holds it: the dumped number (bool for bool tensors), None for a
    null leaf or a missing statistic, an argument's own value."""
    kind = r.get(f"{pre}kind")
    if kind == "tensor":
        v = r.get(f"{pre}dump_{stat}")
        dtype = r.get(f"{pre}dtype") or ""
        if v is not None and dtype == "bool":
            return bool(v)
        if isinstance(v, float) and dtype.startswith(("int", "uint")) and v.is_integer():
            return int(v)  # dump.json holds an integer tensor's Max/Min as JSON integers
        return v
    if kind == "scalar":
        vtype = r.get(f"{pre}value_type")
        if vtype in ("torch.Size", "slice"):
            return None
        value = _json_value(r.get(f"{pre}value"))
        if vtype == "torch.ProcessGroup" and isinstance(value, dict):
            return str(value.get("group_ranks"))
        if _peer(r, pre):
            return str(value)
        return value
    return None


_PEERS = ("src", "dst", "group_src", "group_dst")  # msprobe keeps these arguments' own type names


def _peer(r: dict[str, Any], pre: str) -> bool:
    return (r.get(f"{pre}index_path") or "").rsplit(".", 1)[-1] in _PEERS


def argument_cells(r: dict[str, Any], pre: str) -> tuple[str, str]:
    """(Dtype, Tensor Shape) msprobe prints for a non-tensor argument (utils.gen_op_item): its type for
    torch.Size, slice, ellipsis, ProcessGroup and src/dst peers, else `str(type(value))` (`<class 'int'>`,
    `<class 'str'>` for a dtype given as text); the shape `[]`, a torch.Size's value, a slice's numpy shape."""
    vtype = r.get(f"{pre}value_type") or ""
    value = _json_value(r.get(f"{pre}value"))
    if vtype == "torch.Size":
        return vtype, str(value)
    if vtype == "slice":
        return vtype, str(tuple([len(value)] if isinstance(value, list) else []))
    if vtype in ("ellipsis", "torch.ProcessGroup") or _peer(r, pre):
        return vtype, "[]"
    return str(type(value)), "[]"


def _json_value(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _md5(r: dict[str, Any], pre: str) -> str:
    """The md5 cell msprobe prints for one side: the dumped checksum, else CRC-32 of the printed value."""
    if r.get(f"{pre}kind") == "null":
        return N_A
    if r.get(f"{pre}checksum"):
        return r[f"{pre}checksum"]
    value = _json_value(r.get(f"{pre}value")) if r.get(f"{pre}kind") == "scalar" else ""
    if r.get(f"{pre}value_type") == "torch.ProcessGroup" and isinstance(value, dict):
        return str(value.get("group_ranks"))
    return f"{zlib.crc32(str(value).encode()):08x}"

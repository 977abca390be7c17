"""msprobe's CSV cells that depend on the dump mode: the statistics relative errors and the md5 columns.

Statistics mode: msprobe 26.x `CalcStatsDiff` (metrics.stats_diff) on the two dumped values as msprobe holds
them (JSON numbers, `None` for null, `True`/`False` for bool tensors, an argument's own value): `0` where equal
as text, `N/A` on unmatched rows, else `inf`, `-inf`, `Nan`, `Diff` or |(npu - bench) / bench * 100| with `%`.
md5 mode: `NPU MD5` / `BENCH MD5` are the dumped checksums (an argument's: CRC-32 of its printed value; a
tensor whose md5 is empty: CRC-32 of ''), `N/A` for a side without a leaf; `Result` is msprobe's: `error`
where they differ, `warning` where one side has none, else (and on unmatched rows, as 26.2.0 writes) `pass`.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from .metrics import stats_diff

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


def fill(d: dict[str, Any], r: dict[str, Any], mode: str | None) -> None:
    """Set the mode's cells of CSV row `d` from the aligned leaf pair `r` (target columns, `ref_` columns)."""
    here = (r.get("name") is not None, r.get("ref_name") is not None)
    if mode == "statistics":
        if not all(here):
            d.update(dict.fromkeys(STAT_REL_COLUMNS, N_A))
            return
        cells = stats_diff(
            {key: _held_stat(r, "", stat) for key, stat in _STATS},
            {key: _held_stat(r, "ref_", stat) for key, stat in _STATS},
        )
        d.update({col: str(cells[col]) for col in STAT_REL_COLUMNS})
    elif mode == "md5":
        d["NPU MD5"] = _md5(r, "") if here[0] else N_A
        d["BENCH MD5"] = _md5(r, "ref_") if here[1] else N_A
        d["Result"] = md5_result(d["NPU MD5"], d["BENCH MD5"], r.get("record") or "", r.get("io"), all(here))


def md5_result(npu: str, bench: str, record: str, io: str | None, matched: bool) -> str:
    """msprobe 26.x's md5-mode Result of one row (its CRC32 rule; unmatched rows and ignored APIs pass)."""
    api = record.split(".")[1] if "." in record else ""
    if not matched or api in _IGNORED_APIS or (api in _INPUT_IGNORED_APIS and io != "output") or npu == bench:
        return "pass"
    return "warning" if npu in _NO_MD5 or bench in _NO_MD5 else "error"


def stat_relative_error(npu: Any, bench: Any) -> str:
    """One statistics-mode relative-error cell, from the two values as msprobe holds them (metrics.stats_diff)."""
    return str(stats_diff({"Max": npu}, {"Max": bench})["MaxRelativeErr"])


def _held_stat(r: dict[str, Any], pre: str, stat: str) -> Any:
    """A leaf's Max/Min/Mean/Norm as msprobe holds it: the dumped number (bool for bool tensors), None for a
    null leaf or a missing statistic, an argument's own value."""
    kind = r.get(f"{pre}kind")
    if kind == "tensor":
        v = r.get(f"{pre}dump_{stat}")
        if v is not None and r.get(f"{pre}dtype") == "bool":
            return bool(v)
        return v
    if kind == "scalar":
        vtype = r.get(f"{pre}value_type")
        if vtype in ("torch.Size", "slice"):
            return None
        value = _json_value(r.get(f"{pre}value"))
        if vtype == "torch.ProcessGroup" and isinstance(value, dict):
            return str(value.get("group_ranks"))
        return value
    return None


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

"""Keyword defaults per API and framework: a keyword one run passes and the other leaves out is no difference when
its value is the API's default in the run that leaves it out (MindSpore records `approximate="none"` for
`gelu` where PyTorch records nothing; the same holds within one framework for a default passed explicitly).

The table (`_defaults_table.py`) is written by tests/tools/gen_defaults.py from the signatures of the APIs msprobe
hooks (torch and mindspore are never imported here).  A run's framework is read from its tensor leaves' types
(`torch.*` / `mindspore.*`).  An API is looked up by its record prefix and name (`Functional.gelu`), else by its
name under any prefix of that framework where they agree (a MindSpore `Mint.x` paired with a PyTorch `Torch.x`).
"""

from __future__ import annotations

import json
import math
from functools import cache
from typing import Any

import polars as pl

from ._defaults_table import DEFAULTS

_NONE = object()


def framework_of(value_types: pl.Series) -> str | None:
    """'pytorch' or 'mindspore' from a run's leaf types (`torch.Tensor`, `mindspore.Tensor`), None if unknown."""
    kinds = {t.split(".", 1)[0] for t in value_types.drop_nulls().unique().to_list() if "." in t}
    if "mindspore" in kinds and "torch" not in kinds:
        return "mindspore"
    if "torch" in kinds and "mindspore" not in kinds:
        return "pytorch"
    return None


@cache
def _by_name(framework: str) -> dict[tuple[str, str], Any]:
    """(api name, keyword) -> the default all prefixes of the framework agree on (_NONE where they disagree)."""
    out: dict[tuple[str, str], Any] = {}
    for key, kws in DEFAULTS.get(framework, {}).items():
        name = key.split(".", 1)[1]
        for kw, value in kws.items():
            prev = out.get((name, kw), value)
            out[(name, kw)] = value if _same(prev, value) else _NONE
    return out


def default_of(framework: str, prefix: str | None, api: str | None, keyword: str) -> Any:
    """The default of `keyword` of the API in `framework`, or _NONE when the table has none."""
    if not api:
        return _NONE
    kws = DEFAULTS.get(framework, {}).get(f"{prefix}.{api}")
    if kws is not None and keyword in kws:
        return kws[keyword]
    return _by_name(framework).get((api.rsplit(".", 1)[-1], keyword), _NONE)


def is_default(framework: str | None, prefix: str | None, api: str | None, keyword: str, value_json: str) -> bool:
    """Whether the JSON value of `keyword` is the API's default in `framework`."""
    if framework is None or not keyword or keyword.isdigit():
        return False
    default = default_of(framework, prefix, api, keyword)
    if default is _NONE:
        return False
    try:
        value = json.loads(value_json) if value_json is not None else None
    except ValueError:
        return False
    return _same(value, default)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a in (0, 1) and b in (0, 1) and bool(a) == bool(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=1e-9)
    return a == b


def frameworks(rows: pl.DataFrame) -> dict[str, str | None]:
    """The framework of each side of aligned rows ('target', 'ref'), from their leaf types."""
    return {
        "target": framework_of(rows["value_type"]) if "value_type" in rows.columns else None,
        "ref": framework_of(rows["ref_value_type"]) if "ref_value_type" in rows.columns else None,
    }


def default_keywords(rows: pl.DataFrame, fw: dict[str, str | None] | None = None) -> pl.Series:
    """For each row: a non-tensor keyword argument present in one run only whose value is the API's default in
    the run that lacks it (bool Series, False elsewhere).  `fw`: the sides' frameworks (default: from `rows`)."""
    n = rows.height
    needed = ["match", "kind", "ref_kind", "index_path", "value", "prefix", "api"]
    needed += ["ref_index_path", "ref_value", "ref_prefix", "ref_api"]
    if not n or any(c not in rows.columns for c in needed):
        return pl.Series("_kw_default", [False] * n, dtype=pl.Boolean)
    fw = fw or frameworks(rows)
    one = rows.select(
        pl.arg_where(
            pl.col("match").is_in(["target_only", "ref_only"])
            & (pl.coalesce(pl.col("kind"), pl.col("ref_kind")).fill_null("") != "tensor")
        )
    ).to_series()
    out = [False] * n
    if not len(one):
        return pl.Series("_kw_default", out, dtype=pl.Boolean)
    sub = rows[one.to_list()].select(needed)
    for i, r in zip(one.to_list(), sub.iter_rows(named=True)):
        if r["match"] == "target_only":  # the reference lacks it: its framework's default
            out[i] = is_default(fw["ref"], r["prefix"], r["api"], r["index_path"] or "", r["value"])
        else:
            out[i] = is_default(fw["target"], r["ref_prefix"], r["ref_api"], r["ref_index_path"] or "", r["ref_value"])
    return pl.Series("_kw_default", out, dtype=pl.Boolean)

"""Every compared row for the page's table: column-major, text columns dictionary-encoded, numbers rounded.

The page filters, sorts and pages these in the browser (assets/main.js), so no row is left out.  Numbers keep
4 significant digits (the CSV has them in full); inf, -inf and nan travel as the strings "inf", "-inf", "nan",
and a reference statistic equal to the target's (after rounding) as "=".
Rows come in `compare`'s order (analysis/rank.py): the verdict's culprit first, then by significance (a leaf's
error over the noise the pair showed where it stands), ties in execution order.
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

__all__ = ["STATUS_ORDER", "TEXT_COLUMNS", "NUMBER_COLUMNS", "table_data"]

STATUS_ORDER = {"error": 0, "diverged": 1, "unmatched": 2, "unknown": 3, "pass": 4}
# page column -> the expression over the prepared rows (see figures.prepared)
TEXT_COLUMNS: dict[str, pl.Expr] = {
    "op": pl.col("_op"),
    "leaf": pl.col("_name"),
    "io": pl.col("_io"),
    "type": pl.coalesce("op_type", "ref_op_type"),
    "dtype": pl.coalesce("dtype", "ref_dtype"),
    "shape": pl.coalesce("shape", "ref_shape").cast(pl.List(pl.String)).list.join(", "),
    "status": pl.col("status"),
    "src": pl.col("err_source"),
    "detail": pl.col("detail"),
}
NUMBER_COLUMNS: dict[str, str] = {
    "err": "err",
    "tol": "tol",
    "sev": "severity",
    "bound": "err_bound",
    "cos": "cosine",
    "mae": "max_abs_err",
    "t_max": "max",
    "t_min": "min",
    "t_mean": "mean",
    "t_norm": "norm",
    "r_max": "ref_max",
    "r_min": "ref_min",
    "r_mean": "ref_mean",
    "r_norm": "ref_norm",
}


def table_data(rows: pl.DataFrame, culprit: Any = None) -> dict[str, Any]:
    """{"n": rows, "cols": {name: values}, "dicts": {text column: [strings]}} over `prepared` rows (with their
    `significance`: analysis/rank.py); `culprit`: the verdict's, whose row comes first."""
    from ..rank import culprit_first

    by = "significance" if "significance" in rows.columns else "severity"
    df = (
        rows.filter(pl.col("status").is_not_null() & (pl.col("kind").is_null() | (pl.col("kind") != "null")))
        .with_columns(pl.col(by).fill_nan(None).alias("_sev"))
        .sort(["_sev", "step", "rank", "_seq"], descending=[True, False, False, False], nulls_last=True)
    )
    if culprit is not None:
        df = df.with_columns(pl.coalesce("name", "ref_name").alias("name"))
        df = culprit_first(df, culprit)
    df = df.select(
        pl.col("step"),
        pl.col("rank"),
        *[e.alias(k) for k, e in TEXT_COLUMNS.items()],
        *[
            (pl.col(c) if c in df.columns else pl.lit(None, pl.Float64)).cast(pl.Float64).alias(k)
            for k, c in NUMBER_COLUMNS.items()
        ],
    )
    df = df.with_columns(pl.col("leaf").str.strip_prefix(pl.col("op") + "."))
    cols: dict[str, list] = {"step": df["step"].to_list(), "rank": df["rank"].to_list()}
    dicts: dict[str, list[str]] = {}
    for k in TEXT_COLUMNS:
        codes, values = _encode(df[k])
        cols[k], dicts[k] = codes, values
    for k in NUMBER_COLUMNS:
        cols[k] = _numbers(df[k])
    cols["tol"], dicts["tol"] = _encode(df["tol"].round_sig_figs(4))  # a handful of tolerances, one per dtype
    for k in ("max", "min", "mean", "norm"):  # a reference value equal to the target's travels as "="
        cols[f"r_{k}"] = ["=" if r is not None and r == t else r for t, r in zip(cols[f"t_{k}"], cols[f"r_{k}"])]
    cols = {k: v for k, v in cols.items() if any(x is not None for x in v)}  # the page reads a missing column as empty
    return {"n": df.height, "cols": cols, "dicts": dicts}


def _encode(s: pl.Series) -> tuple[list[int | None], list[str]]:
    """A text column as indices into its distinct values (None stays None)."""
    values = s.drop_nulls().unique(maintain_order=True)
    codes = s.replace_strict(values, pl.Series(range(values.len()), dtype=pl.Int64), default=None)
    return codes.to_list(), values.to_list()


def _numbers(s: pl.Series) -> list[float | str | None]:
    """4 significant digits; inf, -inf and nan as strings (JSON has no such numbers)."""
    s = s.round_sig_figs(4)
    values = s.to_list()
    if s.is_finite().fill_null(True).all():
        return values
    return [
        v if v is None or math.isfinite(v) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf") for v in values
    ]

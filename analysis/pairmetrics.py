"""Per-pair metrics of aligned rows (Polars, no Python loop over rows), by the rules of analysis/rules.py.

Adds to every aligned leaf pair: err and how it was obtained (err_source, err_bound), cosine, max_abs_err, the
statistics differences, the threshold (tol, tol_dtype), severity, status and a detail text.
"""

from __future__ import annotations

import polars as pl

from . import rules as R
from .tolerance import Tolerances

c, lit, when = pl.col, pl.lit, pl.when


def pair_metrics(pairs: pl.DataFrame, tol: Tolerances, floor: str) -> pl.DataFrame:
    """Add err, err_source, err_bound, cosine, max_abs_err, stat diffs, tol, severity, status, detail."""
    for col in ("sketch", "ref_sketch", "sample", "ref_sample"):
        if col not in pairs.columns:
            pairs = pairs.with_columns(pl.lit(None, pl.List(pl.Float64)).alias(col))
    df = pairs.with_columns(R.dtype_eps(c("dtype")).alias("_eps"), R.dtype_eps(c("ref_dtype")).alias("_ref_eps"))
    df = df.with_columns(
        R.nonfinite_mismatch(),
        R.tol_dtype(floor, c("_eps"), c("_ref_eps")),
        R.shape_differs().alias("_shape_differs"),
        when(c("ref_norm") != 0).then(c("norm") / c("ref_norm")).alias("norm_ratio"),
    )
    df = df.with_columns(R.dtype_tol(tol), *R.stats_columns(df).values())
    sk_err, sk_bound, sk_cos = R.sketch_err()
    df = df.with_columns(
        R.checksum_equal().alias("checksum_equal"),
        sk_err.alias("_sk_err"),
        sk_bound.alias("_sk_bound"),
        sk_cos.alias("_sk_cos"),
        R.sample_max_abs().alias("_sample_abs"),
        R.scalar_err().alias("_sc_err"),
    )
    df = R.nonfinite_sketch(df)
    df = df.with_columns(*_choose(R.both_tensors(), R.both_scalars()))
    df = df.with_columns(*_verdict(df))
    drop = [x for x in df.columns if x.startswith("_")] + ["sketch", "ref_sketch", "sample", "ref_sample"]
    return df.with_columns(*_weight_sketches(df)).drop(drop)


WEIGHT_SKETCH = ("w_sketch", "ref_w_sketch")  # the target's and the reference's sketch of a weight leaf


def _weight_sketches(df: pl.DataFrame) -> list[pl.Expr]:
    """Both sketches of the leaves that can be weights (a `parameters` leaf, an input that requires grad), null
    elsewhere: analysis/steps.py measures a parameter's gap and update from them across steps (a permutation of
    a weight's elements keeps every statistic)."""
    io = pl.coalesce(c("io"), c("ref_io")) if "ref_io" in df.columns else c("io")
    weight = (
        (io == "parameters") | c("requires_grad").fill_null(False)
        if "requires_grad" in df.columns
        else io == "parameters"
    )
    return [when(weight).then(c(src)).alias(dst) for src, dst in zip(("sketch", "ref_sketch"), WEIGHT_SKETCH)]


def _choose(is_tensors: pl.Expr, is_scalars: pl.Expr) -> list[pl.Expr]:
    unmatched = c("match").is_in(["target_only", "ref_only"])
    differ = R.kinds_differ()
    shape = is_tensors & c("_shape_differs")
    err = R.pair_err(unmatched, differ, is_tensors, is_scalars, R.null_pair(), R.tensor_err(shape))
    tensor_src = (
        when(shape)
        .then(lit("value"))
        .when(c("_sk_err").is_not_null() | c("_nf_err").is_not_null())
        .then(lit("sketch"))
        .when(c("nonfinite_mismatch"))
        .then(lit("stats"))
        .when(c("checksum_equal").is_not_null())
        .then(lit("checksum"))
        .when(c("_st_err").is_not_null())
        .then(lit("stats"))
    )
    src = (
        when(unmatched)
        .then(lit("none"))
        .when(differ)
        .then(lit("value"))
        .when(is_tensors)
        .then(tensor_src)
        .when(is_scalars | R.null_pair())
        .then(lit("value"))
        .otherwise(lit("none"))
    )
    numeric = R.numeric_scalars(is_scalars)
    tol = R.pair_tol(is_scalars, numeric)
    max_abs = (
        when(is_tensors & c("_sk_err").is_not_null())
        .then(c("_sample_abs"))
        .when(is_tensors & c("_st_err").is_not_null() & c("norm").is_not_null() & c("ref_norm").is_not_null())
        .then(pl.max_horizontal(c("max_diff").abs().fill_null(0.0), c("min_diff").abs().fill_null(0.0)))
        .when(is_tensors & c("_st_err").is_not_null())
        .then(pl.max_horizontal(c("max_diff").abs(), c("min_diff").abs()))
        .when(numeric & (c("_sc_err") > 0))
        .then((c("scalar_value") - c("ref_scalar_value")).abs())
    )
    return [
        err.alias("err"),
        src.alias("err_source"),
        when(c("_sk_err").is_not_null())
        .then(c("_sk_bound"))
        .when(c("_nf_err").is_not_null())
        .then(c("_nf_bound"))
        .alias("err_bound"),
        when(c("_sk_err").is_not_null()).then(c("_sk_cos")).alias("cosine"),
        max_abs.alias("max_abs_err"),
        lit(None, pl.Float64).alias("max_rel_err"),
        when(unmatched).then(None).otherwise(tol).alias("tol"),
        when(unmatched).then(None).otherwise(c("tol_dtype")).alias("tol_dtype"),
        _detail(unmatched, differ, shape, is_scalars).alias("detail"),
    ]


def _detail(unmatched: pl.Expr, kinds_differ: pl.Expr, shape: pl.Expr, is_scalars: pl.Expr) -> pl.Expr:
    err_text = pl.coalesce(c("error"), c("ref_error"))
    return (
        when(unmatched)
        .then(when(c("match") == "target_only").then(lit("only in target")).otherwise(lit("only in reference")))
        .when(err_text.is_not_null())
        .then(err_text)
        .when(kinds_differ)
        .then(pl.format("kind {} vs {}", c("kind"), c("ref_kind")))
        .when(shape)
        .then(pl.format("shape {} vs {}", _shape_text("shape"), _shape_text("ref_shape")))
        .when(c("nonfinite_mismatch"))
        .then(R.nonfinite_detail())
        .when(is_scalars & (c("_sc_err") > 0))
        .then(pl.format("value {} vs {}", c("value"), c("ref_value")))
    )


def _shape_text(col: str) -> pl.Expr:
    return pl.concat_str([lit("["), c(col).cast(pl.List(pl.String)).list.join(", "), lit("]")])


def _verdict(df: pl.DataFrame) -> list[pl.Expr | pl.Series]:
    unmatched = c("match").is_in(["target_only", "ref_only"])
    status = R.pair_status(unmatched, R.unreadable_kind(), R.has_error_text())
    sev = R.severity(df["err"].cast(pl.Float64).to_numpy(), df["tol"].cast(pl.Float64).to_numpy())
    hidden = R.nonfinite_hidden() & ~unmatched & c("detail").is_null()
    return [
        R.nullable("severity", sev),
        status.alias("status"),
        when(hidden).then(lit(R.NOT_JUDGED_NONFINITE)).otherwise(c("detail")).alias("detail"),
    ]

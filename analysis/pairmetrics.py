"""Vectorised per-pair metrics (Polars expressions, no Python loop over rows); see analysis/compare.py.

err, relative L2 of target x against reference y, best available first: sketch (exact when the sketch holds
every element, else error bar sqrt(2/M)), statistics lower bound max(|dNorm|, |dMax|, |dMin|, |dMean|*sqrt(n))
/ ||y|| (or, without norms, max(|dMax|, |dMin|) over the reference's range), checksum equality, scalar value.
"""

from __future__ import annotations

import polars as pl

from dumpstore.dtypes import EPS, INT_DTYPES

from .tolerance import Tolerances

INF = float("inf")
VALUE_RTOL = 1e-6
_COUNTS = ("nan_count", "posinf_count", "neginf_count", "sat_count")
_FLAGS = ("has_nan", "has_posinf", "has_neginf", "has_sat")
_LABELS = ("NaN", "+Inf", "-Inf", "±max")

c, lit, when = pl.col, pl.lit, pl.when


def _finite(e: pl.Expr) -> pl.Expr:
    return e.is_not_null() & e.is_finite()


def _diff(stat: str) -> pl.Expr:
    return when(_finite(c(stat)) & _finite(c(f"ref_{stat}"))).then(c(stat) - c(f"ref_{stat}")).alias(f"{stat}_diff")


def _eps(col: pl.Expr) -> pl.Expr:
    return col.replace_strict(EPS, default=None, return_dtype=pl.Float64)


def _tol_dtype(floor: str) -> pl.Expr:
    et, er, ef = _eps(c("dtype")), _eps(c("ref_dtype")), lit(EPS.get(floor, EPS["float32"]))
    any_float = et.is_not_null() | er.is_not_null()
    best = (when(et.is_not_null() & (et >= er.fill_null(0)) & (et >= ef)).then(c("dtype"))
            .when(er.is_not_null() & (er >= ef)).then(c("ref_dtype")).otherwise(lit(floor)))
    return when(any_float).then(best).otherwise(pl.coalesce(c("dtype"), c("ref_dtype"), lit(floor))).alias("tol_dtype")


def _tol(tol: Tolerances) -> pl.Expr:
    if tol.all_dtypes is not None:
        return lit(tol.all_dtypes).alias("tol")
    table = dict(tol.rel_l2) | {d: 0.0 for d in INT_DTYPES + ("bool",)}
    return c("tol_dtype").replace_strict(table, default=tol.rel_l2["float32"], return_dtype=pl.Float64).alias("tol")


def _nonfinite() -> pl.Expr:
    counts_known = pl.all_horizontal([c(k).is_not_null() & c(f"ref_{k}").is_not_null() for k in _COUNTS])
    by_count = pl.any_horizontal([c(k) != c(f"ref_{k}") for k in _COUNTS])
    by_flag = pl.any_horizontal([(c(f).fill_null(False) != c(f"ref_{f}").fill_null(False))
                                 & c(f).is_not_null() & c(f"ref_{f}").is_not_null() for f in _FLAGS])
    tensors = (c("kind") == "tensor") & (c("ref_kind") == "tensor")
    return (tensors & when(counts_known).then(by_count).otherwise(by_flag)).fill_null(False).alias(
        "nonfinite_mismatch")


def _nonfinite_detail() -> pl.Expr:
    parts = []
    for f, k, label in zip(_FLAGS, _COUNTS, _LABELS):
        a = when(c(k).is_not_null() & c(f"ref_{k}").is_not_null()).then(c(k).cast(pl.String)).otherwise(
            c(f).cast(pl.String).str.to_titlecase())
        b = when(c(k).is_not_null() & c(f"ref_{k}").is_not_null()).then(c(f"ref_{k}").cast(pl.String)).otherwise(
            c(f"ref_{f}").cast(pl.String).str.to_titlecase())
        parts.append(when(a != b).then(pl.format(f"{label} {{}} vs {{}}", a, b)))
    return pl.concat_str([lit("non-finite values differ: "), pl.concat_list(parts).list.drop_nulls().list.join(", ")])


def _stats_err() -> pl.Expr:
    n = pl.coalesce(c("numel"), c("ref_numel"), lit(1)).cast(pl.Float64)
    num = pl.max_horizontal(c("norm_diff").abs(), c("max_diff").abs(), c("min_diff").abs(),
                            c("mean_diff").abs() * n.sqrt(),
                            when(~_finite(c("norm")) & ~c("nonfinite_mismatch")).then(lit(INF)))
    rn = c("ref_norm")
    by_norm = when(rn > 0).then(num / rn).when(num == 0).then(0.0).otherwise(INF)
    same = pl.all_horizontal([(c(s) == c(f"ref_{s}")) | (c(s).is_nan() & c(f"ref_{s}").is_nan())
                              for s in ("max", "min", "mean", "norm")]).fill_null(False)
    scale = pl.max_horizontal(c("ref_max").abs(), c("ref_min").abs())
    ext = pl.max_horizontal(c("max_diff").abs(), c("min_diff").abs())
    by_ext = when(scale > 0).then(ext / scale).when(ext == 0).then(0.0).otherwise(INF)
    has_norms = c("norm").is_not_null() & rn.is_not_null()
    return (when(has_norms & _finite(rn) & num.is_not_null()).then(by_norm)
            .when(has_norms & ~_finite(rn) & same).then(0.0)
            .when(~has_norms & c("max_diff").is_not_null() & c("min_diff").is_not_null()).then(by_ext))


def _sketch_err() -> tuple[pl.Expr, pl.Expr, pl.Expr]:
    ok = ((c("sketch").list.len() == c("ref_sketch").list.len()) & (c("sketch").list.len() > 0)
          & _finite(c("norm")) & _finite(c("ref_norm")) & ~c("nonfinite_mismatch"))
    sk = when(ok).then(c("sketch"))
    rsk = when(ok).then(c("ref_sketch"))
    d = (sk - rsk).list.eval(pl.element() * pl.element()).list.sum().sqrt()
    rn, tn = c("ref_norm"), c("norm")
    err = when(ok & (rn > 0)).then(d / rn).when(ok & (d == 0) & (tn == 0)).then(0.0).when(ok).then(INF)
    n = pl.coalesce(c("numel"), c("sketch").list.len()).cast(pl.Float64)
    bound = when(ok).then(when(c("sketch").list.len() >= n).then(0.0)
                          .otherwise((2.0 / c("sketch").list.len().cast(pl.Float64)).sqrt()))
    r = tn / rn
    cos = (when(ok & (rn > 0) & (tn > 0)).then(((1 + r * r - err * err) / (2 * r)).clip(-1.0, 1.0))
           .when(ok & (rn == 0) & (tn == 0)).then(1.0))
    return err, bound, cos


def _sample_max_abs() -> pl.Expr:
    ok = (c("sample").list.len() == c("ref_sample").list.len()) & (c("sample").list.len() > 0)
    d = (when(ok).then(c("sample")) - when(ok).then(c("ref_sample"))).list.eval(pl.element().abs())
    return d.list.eval(pl.element().filter(pl.element().is_finite())).list.max()


def _shape_differs() -> pl.Expr:
    drop1 = pl.element().filter(pl.element() != 1)
    return (c("shape").is_not_null() & c("ref_shape").is_not_null()
            & (c("shape").list.eval(drop1) != c("ref_shape").list.eval(drop1))).fill_null(False)


def pair_metrics(pairs: pl.DataFrame, tol: Tolerances, floor: str) -> pl.DataFrame:
    """Add err, err_source, err_bound, cosine, max_abs_err, stat diffs, tol, severity, status, detail."""
    for col in ("sketch", "ref_sketch", "sample", "ref_sample"):
        if col not in pairs.columns:
            pairs = pairs.with_columns(pl.lit(None, pl.List(pl.Float64)).alias(col))
    df = pairs.with_columns(_diff("max"), _diff("min"), _diff("mean"), _diff("norm"), _nonfinite(),
                            _tol_dtype(floor), _shape_differs().alias("_shape_differs"),
                            when(c("ref_norm") != 0).then(c("norm") / c("ref_norm")).alias("norm_ratio"))
    df = df.with_columns(_tol(tol))
    sk_err, sk_bound, sk_cos = _sketch_err()
    st_err = _stats_err()
    is_tensors = (c("kind") == "tensor") & (c("ref_kind") == "tensor")
    is_scalars = (c("kind") == "scalar") & (c("ref_kind") == "scalar")
    both_ck = c("checksum").is_not_null() & c("ref_checksum").is_not_null()
    df = df.with_columns(
        when(both_ck).then(c("checksum") == c("ref_checksum")).alias("checksum_equal"),
        sk_err.alias("_sk_err"), sk_bound.alias("_sk_bound"), sk_cos.alias("_sk_cos"), st_err.alias("_st_err"),
        _sample_max_abs().alias("_sample_abs"), _scalar_err().alias("_sc_err"))
    df = df.with_columns(*_choose(is_tensors, is_scalars))
    df = df.with_columns(*_verdict())
    drop = [x for x in df.columns if x.startswith("_")] + ["sketch", "ref_sketch", "sample", "ref_sample"]
    return df.drop(drop)


def _scalar_err() -> pl.Expr:
    a, b = c("scalar_value"), c("ref_scalar_value")
    numeric = a.is_not_null() & b.is_not_null()
    num_err = (when((a == b) | (a.is_nan() & b.is_nan())).then(0.0)
               .when(b != 0).then((a - b).abs() / b.abs()).otherwise(INF))
    same_text = (c("value") == c("ref_value")).fill_null(c("value").is_null() & c("ref_value").is_null())
    return when(numeric).then(num_err).otherwise(when(same_text).then(0.0).otherwise(INF))


def tensor_err(shape: pl.Expr) -> pl.Expr:
    """err of a tensor pair: inf on a shape or non-finite mismatch, else sketch, statistics, checksum (best first)."""
    ck = when(c("checksum_equal")).then(0.0).when(~c("checksum_equal")).then(INF)
    return (when(shape).then(INF).when(c("nonfinite_mismatch")).then(INF)
            .otherwise(pl.coalesce(c("_sk_err"), c("_st_err"), ck)))


def pair_err(unmatched: pl.Expr, kinds_differ: pl.Expr, is_tensors: pl.Expr, is_scalars: pl.Expr,
             nulls: pl.Expr, tensor: pl.Expr) -> pl.Expr:
    """err of any pair from its parts (shared with analysis/screen.py, which precomputes the parts)."""
    return (when(unmatched).then(None).when(kinds_differ).then(INF).when(is_tensors).then(tensor)
            .when(is_scalars).then(c("_sc_err")).when(nulls).then(0.0))


def pair_tol(is_scalars: pl.Expr, numeric_scalars: pl.Expr) -> pl.Expr:
    """Threshold of a pair: the dtype's (column `tol`), relative 1e-6 for numbers, equality for other values."""
    return when(numeric_scalars).then(VALUE_RTOL).when(is_scalars).then(0.0).otherwise(c("tol"))


def kinds_differ() -> pl.Expr:
    return (c("kind") != c("ref_kind")) & ~c("kind").is_in(["error"]) & ~c("ref_kind").is_in(["error"])


def null_pair() -> pl.Expr:
    return (c("kind") == "null") & (c("ref_kind") == "null")


def numeric_scalars(is_scalars: pl.Expr) -> pl.Expr:
    return is_scalars & c("scalar_value").is_not_null() & c("ref_scalar_value").is_not_null()


def _choose(is_tensors: pl.Expr, is_scalars: pl.Expr) -> list[pl.Expr]:
    unmatched = c("match").is_in(["target_only", "ref_only"])
    differ = kinds_differ()
    shape = is_tensors & c("_shape_differs")
    err = pair_err(unmatched, differ, is_tensors, is_scalars, null_pair(), tensor_err(shape))
    tensor_src = (when(shape).then(lit("value")).when(c("_sk_err").is_not_null()).then(lit("sketch"))
                  .when(c("_st_err").is_not_null() | c("nonfinite_mismatch")).then(lit("stats"))
                  .when(c("checksum_equal").is_not_null()).then(lit("checksum")))
    src = (when(unmatched).then(lit("none")).when(differ).then(lit("value")).when(is_tensors).then(tensor_src)
           .when(is_scalars | null_pair()).then(lit("value"))
           .otherwise(lit("none")))
    numeric = numeric_scalars(is_scalars)
    tol = pair_tol(is_scalars, numeric)
    max_abs = (when(is_tensors & c("_sk_err").is_not_null()).then(c("_sample_abs"))
               .when(is_tensors & c("_st_err").is_not_null() & c("norm").is_not_null() & c("ref_norm").is_not_null())
               .then(pl.max_horizontal(c("max_diff").abs().fill_null(0.0), c("min_diff").abs().fill_null(0.0)))
               .when(is_tensors & c("_st_err").is_not_null())
               .then(pl.max_horizontal(c("max_diff").abs(), c("min_diff").abs()))
               .when(numeric & (c("_sc_err") > 0)).then((c("scalar_value") - c("ref_scalar_value")).abs()))
    return [err.alias("err"), src.alias("err_source"), when(c("_sk_err").is_not_null()).then(c("_sk_bound"))
            .alias("err_bound"), when(c("_sk_err").is_not_null()).then(c("_sk_cos")).alias("cosine"),
            max_abs.alias("max_abs_err"), lit(None, pl.Float64).alias("max_rel_err"),
            when(unmatched).then(None).otherwise(tol).alias("tol"),
            when(unmatched).then(None).otherwise(c("tol_dtype")).alias("tol_dtype"),
            _detail(unmatched, differ, shape, is_scalars).alias("detail")]


def _detail(unmatched: pl.Expr, kinds_differ: pl.Expr, shape: pl.Expr, is_scalars: pl.Expr) -> pl.Expr:
    err_text = pl.coalesce(c("error"), c("ref_error"))
    return (when(unmatched).then(when(c("match") == "target_only").then(lit("only in target"))
                                 .otherwise(lit("only in reference")))
            .when(err_text.is_not_null()).then(err_text)
            .when(kinds_differ).then(pl.format("kind {} vs {}", c("kind"), c("ref_kind")))
            .when(shape).then(pl.format("shape {} vs {}", _shape_text("shape"), _shape_text("ref_shape")))
            .when(c("nonfinite_mismatch")).then(_nonfinite_detail())
            .when(is_scalars & (c("_sc_err") > 0)).then(pl.format("value {} vs {}", c("value"), c("ref_value"))))


def _shape_text(col: str) -> pl.Expr:
    return pl.concat_str([lit("["), c(col).cast(pl.List(pl.String)).list.join(", "), lit("]")])


def unreadable_kind() -> pl.Expr:
    return (c("kind") == "error") | (c("ref_kind") == "error")


def has_error_text() -> pl.Expr:
    return c("error").is_not_null() | c("ref_error").is_not_null()


def pair_status(unmatched: pl.Expr, bad_kind: pl.Expr, error_text: pl.Expr) -> pl.Expr:
    """unmatched / error / unknown / diverged / pass from `err`, `tol`, `nonfinite_mismatch` and the parts."""
    unreadable = bad_kind | (error_text & c("err").is_null())
    return (when(unmatched).then(lit("unmatched")).when(unreadable).then(lit("error"))
            .when(c("err").is_null()).then(lit("unknown"))
            .when((c("err") > c("tol")) | c("nonfinite_mismatch")).then(lit("diverged")).otherwise(lit("pass")))


def _verdict() -> list[pl.Expr]:
    unmatched = c("match").is_in(["target_only", "ref_only"])
    sev = when(c("tol") > 0).then(c("err") / c("tol")).when(c("err") == 0).then(0.0).otherwise(INF)
    status = pair_status(unmatched, unreadable_kind(), has_error_text())
    return [when(c("err").is_not_null() & ~unmatched).then(sev).alias("severity"), status.alias("status")]

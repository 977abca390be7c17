"""The judging rules, each defined once: tolerance, statistics bound, sketch and scalar error, status, severity.

Every comparison path judges a leaf pair with these rules: the detailed comparison (analysis/pairmetrics.py,
after alignment), the fast screen (analysis/screen.py, units paired by position) and the exact metrics
(analysis/exact.py, from tensor files).  A rule that works on whole columns is written once, either as a
Polars expression (when it only reads columns of the pair frame) or over numpy arrays (the statistics bound and
the severity, which the screen evaluates on raw Arrow buffers); operators shared by Polars expressions, numpy
arrays and Python floats (`exceeds`, `diverges`) serve every engine as they are.

err, relative L2 of target x against reference y, best available first:
  sketch   from the linear sketches: ||sk(x) - sk(y)|| / ||y|| (exact when the sketch holds every element, else
           relative error bar sqrt(2/M));
  stats    a lower bound from the statistics: max(|dNorm|, |dMax|, |dMin|, |dMean| * sqrt(n)) / ||y|| (without
           norms: max(|dMax|, |dMin|, |dMean|) over the reference's range);
  checksum equality (0 or inf);  value  non-tensor arguments, relative difference (text: equality).

Size: every judging rule has this one home (the tolerance, the bounds, small values and sums of K terms), so that
the three comparison paths cannot judge a leaf pair differently; split, each path would import several modules
that must change together.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from dumpstore.arrays import to_polars
from dumpstore.dtypes import EPS, INT_DTYPES, eps

from .tolerance import EXACT_DTYPES_TOL, Tolerances

INF = float("inf")
VALUE_RTOL = 1e-6  # numeric non-tensor arguments: relative difference allowed
STATS = ("min", "max", "mean", "norm")
COUNTS = ("nan_count", "posinf_count", "neginf_count", "sat_count")
FLAGS = ("has_nan", "has_posinf", "has_neginf", "has_sat")
COUNT_LABELS = ("NaN", "+Inf", "-Inf", "±max")
STATUSES = ("pass", "diverged", "unmatched", "error", "unknown")
STATUS_CODES = {name: i for i, name in enumerate(STATUSES)}

c, lit, when = pl.col, pl.lit, pl.when


# ------------------------------------------------------------------------------------------------ precision
def compute_dtype_from_counts(counts: dict[str, int]) -> str:
    """A run's compute precision: the lowest-precision float dtype holding >= 10% of its forward float outputs
    (`counts`: those outputs counted by dtype)."""
    total = sum(counts.values())
    if total == 0:
        return "float32"
    common = [d for d, n in counts.items() if n >= 0.1 * total]
    return max(common, key=eps) if common else "float32"


def floor_of(a: str, b: str) -> str:
    """The less precise of two compute precisions (ties: the target's): every pair is judged at least at it."""
    return a if eps(a) >= eps(b) else b


# ------------------------------------------------------------------------------------------------ tolerance
EPS_FLOAT32 = EPS["float32"]


# the smallest normal number of a dtype (finfo.tiny): below it values are subnormal, spaced by eps x it
SUBNORMAL_BELOW = {
    "float16": 2.0**-14,
    "bfloat16": 2.0**-126,
    "float32": 2.0**-126,
    "tf32": 2.0**-126,  # float32's exponent range
    "float64": 2.0**-1022,
    "float8_e4m3fn": 2.0**-6,
    "float8_e5m2": 2.0**-14,
}


def dtype_tiny(col: pl.Expr) -> pl.Expr:
    """The smallest normal number of a dtype column (SUBNORMAL_BELOW; null for exact and unknown dtypes)."""
    return col.replace_strict(SUBNORMAL_BELOW, default=None, return_dtype=pl.Float64)


def dtype_eps(col: pl.Expr) -> pl.Expr:
    """Machine epsilon of a dtype column (null for exact and unknown dtypes)."""
    return col.replace_strict(EPS, default=None, return_dtype=pl.Float64)


def tol_dtype(floor: str, et: pl.Expr | None = None, er: pl.Expr | None = None) -> pl.Expr:
    """The dtype a pair is judged at: the less precise of its two dtypes and the runs' compute precision.
    `et`, `er`: the two dtypes' eps where they are columns already (each is used three times: a lookup per row)."""
    et = dtype_eps(c("dtype")) if et is None else et
    er = dtype_eps(c("ref_dtype")) if er is None else er
    ef = lit(EPS.get(floor, EPS["float32"]))
    any_float = et.is_not_null() | er.is_not_null()
    best = (
        when(et.is_not_null() & (et >= er.fill_null(0)) & (et >= ef))
        .then(c("dtype"))
        .when(er.is_not_null() & (er >= ef))
        .then(c("ref_dtype"))
        .otherwise(lit(floor))
    )
    return when(any_float).then(best).otherwise(pl.coalesce(c("dtype"), c("ref_dtype"), lit(floor))).alias("tol_dtype")


def dtype_tol(tol: Tolerances) -> pl.Expr:
    """The relative-L2 threshold of column `tol_dtype` (ints and bools exact; an override for all dtypes)."""
    if tol.all_dtypes is not None:
        return lit(tol.all_dtypes).alias("tol")
    table = dict(tol.rel_l2) | {d: EXACT_DTYPES_TOL for d in INT_DTYPES + ("bool",)}
    return c("tol_dtype").replace_strict(table, default=tol.rel_l2["float32"], return_dtype=pl.Float64).alias("tol")


def pair_tol(is_scalars: pl.Expr, numeric_scalars: pl.Expr) -> pl.Expr:
    """Threshold of a pair: the dtype's (column `tol`), relative 1e-6 for numbers, equality for other values."""
    return when(numeric_scalars).then(VALUE_RTOL).when(is_scalars).then(0.0).otherwise(c("tol"))


# ------------------------------------------------------------------------------------------------ pair kinds
def both_tensors() -> pl.Expr:
    return (c("kind") == "tensor") & (c("ref_kind") == "tensor")


def both_scalars() -> pl.Expr:
    return (c("kind") == "scalar") & (c("ref_kind") == "scalar")


def kinds_differ() -> pl.Expr:
    return (c("kind") != c("ref_kind")) & ~c("kind").is_in(["error"]) & ~c("ref_kind").is_in(["error"])


def null_pair() -> pl.Expr:
    return (c("kind") == "null") & (c("ref_kind") == "null")


def numeric_scalars(is_scalars: pl.Expr) -> pl.Expr:
    return is_scalars & c("scalar_value").is_not_null() & c("ref_scalar_value").is_not_null()


def unreadable_kind() -> pl.Expr:
    return (c("kind") == "error") | (c("ref_kind") == "error")


def has_error_text() -> pl.Expr:
    return c("error").is_not_null() | c("ref_error").is_not_null()


def shape_differs() -> pl.Expr:
    """Shapes differ beyond size-1 axes (msprobe compares [4, 1] with [4])."""
    drop1 = pl.element().filter(pl.element() != 1)
    return (
        c("shape").is_not_null()
        & c("ref_shape").is_not_null()
        & (c("shape").list.eval(drop1) != c("ref_shape").list.eval(drop1))
    ).fill_null(False)


def checksum_equal() -> pl.Expr:
    both = c("checksum").is_not_null() & c("ref_checksum").is_not_null()
    return when(both).then(c("checksum") == c("ref_checksum"))


# ------------------------------------------------------------------------------------------------ non-finite
def nonfinite_mismatch() -> pl.Expr:
    """Two tensors whose NaN / +Inf / -Inf / saturation counts (or, without counts, flags) differ."""
    counts_known = pl.all_horizontal([c(k).is_not_null() & c(f"ref_{k}").is_not_null() for k in COUNTS])
    by_count = pl.any_horizontal([c(k) != c(f"ref_{k}") for k in COUNTS])
    by_flag = pl.any_horizontal(
        [
            (c(f).fill_null(False) != c(f"ref_{f}").fill_null(False)) & c(f).is_not_null() & c(f"ref_{f}").is_not_null()
            for f in FLAGS
        ]
    )
    return (
        (both_tensors() & when(counts_known).then(by_count).otherwise(by_flag))
        .fill_null(False)
        .alias("nonfinite_mismatch")
    )


def nonfinite_detail() -> pl.Expr:
    """Which NaN/Inf counts differ; where they agree, the positions (seen in the sketches) do."""
    parts = []
    for f, k, label in zip(FLAGS, COUNTS, COUNT_LABELS):
        known = c(k).is_not_null() & c(f"ref_{k}").is_not_null()
        a = when(known).then(c(k).cast(pl.String)).otherwise(c(f).cast(pl.String).str.to_titlecase())
        b = when(known).then(c(f"ref_{k}").cast(pl.String)).otherwise(c(f"ref_{f}").cast(pl.String).str.to_titlecase())
        parts.append(when(a != b).then(pl.format(f"{label} {{}} vs {{}}", a, b)))
    listed = pl.concat_list(parts).list.drop_nulls().list.join(", ")
    return (
        when(listed == "")
        .then(lit("NaN/Inf positions differ (sketch)"))
        .otherwise(pl.concat_str([lit("non-finite values differ: "), listed]))
    )


NOT_JUDGED_NONFINITE = (
    "NaN/Inf in both runs hide the finite values (equal counts and statistics say nothing about them): not judged; "
    "--exact compares the tensor files"
)


def nonfinite_hidden() -> pl.Expr:
    """Two tensors whose norms are not finite (NaN/Inf in both, counts agreeing) and whose err is unknown."""
    return (both_tensors() & (~_finite(c("norm")) | ~_finite(c("ref_norm"))) & c("err").is_null()).fill_null(False)


# ------------------------------------------------------------------------------------------------ statistics bound
def stat_diff(t: np.ndarray, r: np.ndarray) -> np.ndarray:
    """target - reference of one statistic where both are finite, else NaN (no difference known)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(np.isfinite(t) & np.isfinite(r), t - r, np.nan)


def stats_bound(
    t: dict[str, np.ndarray],
    r: dict[str, np.ndarray],
    t_null: dict[str, np.ndarray],
    r_null: dict[str, np.ndarray],
    sqrt_n: np.ndarray,
    nonfinite: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(err, known): the statistics lower bound of relative L2 error of every pair, from the four statistics of
    both sides (`t`, `r`: float64 arrays by name, NaN where null; `t_null`/`r_null`: where null) and sqrt(numel).

      both norms present, ||y|| finite:   max(|dNorm|, |dMax|, |dMin|, |dMean| sqrt(n)) / ||y||  (inf when the
                                          target's norm is not finite but the non-finite counts agree; 0/0 = 0);
      both norms present, ||y|| not finite: 0 when all four statistics are equal and say nothing is finite
                                          (max = min = +-Inf); else unknown (the finite part is hidden);
      a norm missing (integer tensors):   max(|dMax|, |dMin|, |dMean|) / max(|yMax|, |yMin|)  (0/0 = 0).
    Differences are taken only where both sides are finite; `known` is False where no rule applies."""
    d = {s: np.abs(stat_diff(t[s], r[s])) for s in STATS}
    with np.errstate(all="ignore"):
        parts = [
            d["norm"],
            d["max"],
            d["min"],
            d["mean"] * sqrt_n,
            np.where(~np.isfinite(t["norm"]) & ~nonfinite, np.inf, np.nan),
        ]
        num = np.fmax.reduce(parts)  # ignores NaN (a missing difference), NaN only when all are
        rn = r["norm"]
        by_norm = np.where(rn > 0, num / rn, np.where(num == 0, 0.0, np.inf))
        has_norms = ~t_null["norm"] & ~r_null["norm"]
        same = np.ones(len(rn), dtype=bool)
        for s in STATS:
            same &= ~t_null[s] & ~r_null[s] & ((t[s] == r[s]) | (np.isnan(t[s]) & np.isnan(r[s])))
        scale = np.fmax(np.abs(r["max"]), np.abs(r["min"]))
        # (msprobe's statistics of an integer tensor: max/min, some versions the mean: a mean that differs, even by
        # 1/n, is a differing value, not rounding)
        ext = np.fmax(np.fmax(d["max"], d["min"]), d["mean"])
        by_ext = np.where(scale > 0, ext / scale, np.where(ext == 0, 0.0, np.inf))
    use_norm = has_norms & np.isfinite(rn) & ~np.isnan(num)
    # non-finite norms hide the finite values: equal statistics say nothing about them, unless nothing is finite
    # (max = min = +-Inf: every element that value; a NaN makes every statistic NaN, finite values or not)
    nothing_finite = np.isinf(t["max"]) & (t["max"] == t["min"])
    use_same = has_norms & ~np.isfinite(rn) & same & nothing_finite
    use_ext = ~has_norms & ~np.isnan(d["max"]) & ~np.isnan(d["min"])
    err = np.where(use_norm, by_norm, np.where(use_same, 0.0, np.where(use_ext, by_ext, np.nan)))
    return err, use_norm | use_same | use_ext


def sqrt_numel() -> pl.Expr:
    """sqrt(n) of a pair (the target's numel, else the reference's), the weight of the mean difference."""
    return pl.coalesce(c("numel"), c("ref_numel"), lit(1)).cast(pl.Float64).sqrt().alias("sqrt_n")


def stats_columns(df: pl.DataFrame) -> dict[str, pl.Series]:
    """The statistics differences (`max_diff`, ...) and bound (`_st_err`) of a pair frame, by `stats_bound`."""
    t = {s: df[s].cast(pl.Float64).to_numpy() for s in STATS}
    r = {s: df[f"ref_{s}"].cast(pl.Float64).to_numpy() for s in STATS}
    t_null = {s: df[s].is_null().to_numpy() for s in STATS}
    r_null = {s: df[f"ref_{s}"].is_null().to_numpy() for s in STATS}
    n = df.select(sqrt_numel()).to_series().to_numpy()
    err, known = stats_bound(t, r, t_null, r_null, n, df["nonfinite_mismatch"].to_numpy())
    out = {f"{s}_diff": nullable(f"{s}_diff", stat_diff(t[s], r[s])) for s in STATS}
    out["_st_err"] = nullable("_st_err", np.where(known, err, np.nan))
    return out


def nullable(name: str, values: np.ndarray) -> pl.Series:
    """NaN as null (no rule here yields NaN for a known value)."""
    values = np.asarray(values, np.float64)
    return to_polars(name, values, nulls=np.isnan(values))


# ------------------------------------------------------------------------------------------------ sketch, scalar
def _finite(e: pl.Expr) -> pl.Expr:
    return e.is_not_null() & e.is_finite()


def sketch_err() -> tuple[pl.Expr, pl.Expr, pl.Expr]:
    """(err, error bar, cosine) from both sketches and the exact norms."""
    ok = (
        (c("sketch").list.len() == c("ref_sketch").list.len())
        & (c("sketch").list.len() > 0)
        & _finite(c("norm"))
        & _finite(c("ref_norm"))
        & ~c("nonfinite_mismatch")
    )
    sk, rsk = when(ok).then(c("sketch")), when(ok).then(c("ref_sketch"))
    d = (sk - rsk).list.eval(pl.element() * pl.element()).list.sum().sqrt()
    rn, tn = c("ref_norm"), c("norm")
    err = when(ok & (rn > 0)).then(d / rn).when(ok & (d == 0) & (tn == 0)).then(0.0).when(ok).then(INF)
    n = pl.coalesce(c("numel"), c("sketch").list.len()).cast(pl.Float64)
    # a complex tensor's sketch folds both parts (summary.summarize): it holds every value at 2 x numel buckets
    n = n * when(c("dtype").cast(pl.String).str.starts_with("complex").fill_null(False)).then(2.0).otherwise(1.0)
    bound = when(ok).then(
        when(c("sketch").list.len() >= n).then(0.0).otherwise((2.0 / c("sketch").list.len().cast(pl.Float64)).sqrt())
    )
    ratio = tn / rn
    cos = (
        when(ok & (rn > 0) & (tn > 0))
        .then(((1 + ratio * ratio - err * err) / (2 * ratio)).clip(-1.0, 1.0))
        .when(ok & (rn == 0) & (tn == 0))
        .then(1.0)
    )
    return err, bound, cos


def nonfinite_sketch(df: pl.DataFrame) -> pl.DataFrame:
    """`df` with `_nf_err`, `_nf_bound` (the sketch error of the finite part of two tensors that both hold NaN/Inf,
    null where it cannot be told) and `nonfinite_mismatch` set where their NaN/Inf positions differ.

    Equal NaN/Inf counts do not make two tensors equal: `[1, 2, inf]` and `[1, 3, inf]` differ in their finite part,
    `[nan, 2, 3]` and `[2, nan, 3]` in where the NaN is. A sketch bucket holds NaN/+Inf/-Inf exactly when one of its
    elements does (an +Inf and a -Inf give NaN), so the buckets' classes are compared (a bucket non-finite in one run
    only, or of another class: positions differ), and the buckets finite in both estimate the finite part's relative
    L2 error (exact, element by element, when the sketch holds every element). Without a finite bucket in both runs
    (or without sketches: statistics mode) the pair stays unknown, unless both are wholly one non-finite value."""
    n = df.height
    err, bound = np.full(n, np.nan), np.full(n, np.nan)
    moved = np.zeros(n, dtype=bool)
    need = {"sketch", "ref_sketch", "norm", "ref_norm", "nonfinite_mismatch"}
    if n and need <= set(df.columns):
        tensors = c("_is_tensors") if "_is_tensors" in df.columns else both_tensors()  # the screen's frames
        pick = df.select(
            (
                tensors
                & ~c("nonfinite_mismatch")
                & (~_finite(c("norm")) | ~_finite(c("ref_norm")))
                & c("norm").is_not_null()
                & c("ref_norm").is_not_null()
                & (c("sketch").list.len() == c("ref_sketch").list.len())
                & (c("sketch").list.len() > 0)
            ).fill_null(False)
        ).to_series()
        if pick.any():
            at = np.flatnonzero(pick.to_numpy())
            sub = df.filter(pick)
            numel = sub["numel"].to_list() if "numel" in sub.columns else [None] * len(at)
            dtypes = sub["dtype"].to_list() if "dtype" in sub.columns else [None] * len(at)
            for i, a, b, k, dt in zip(at, sub["sketch"].to_list(), sub["ref_sketch"].to_list(), numel, dtypes):
                got = _finite_part(np.asarray(a, np.float64), np.asarray(b, np.float64), k, dt)
                if got is None:
                    continue
                if got[0] == "moved":
                    moved[i] = True
                else:
                    err[i], bound[i] = got[1], got[2]
    return df.with_columns(
        nullable("_nf_err", err),
        nullable("_nf_bound", bound),
        (c("nonfinite_mismatch") | to_polars("_nf_moved", moved)).alias("nonfinite_mismatch")
        if "nonfinite_mismatch" in df.columns
        else lit(False).alias("nonfinite_mismatch"),
    )


def _finite_part(a: np.ndarray, b: np.ndarray, numel: Any, dtype: Any) -> tuple[str, float, float] | None:
    """('moved', ...) when the non-finite buckets of sketches `a`, `b` differ in class, else ('err', rel_l2 of the
    buckets finite in both, its error bar), None when no bucket is finite in both and not all are equal."""
    cls_a = np.where(np.isnan(a), 3, np.where(a == np.inf, 1, np.where(a == -np.inf, 2, 0)))
    cls_b = np.where(np.isnan(b), 3, np.where(b == np.inf, 1, np.where(b == -np.inf, 2, 0)))
    if (cls_a != cls_b).any():
        return ("moved", math.inf, 0.0)
    fin = cls_a == 0
    elements = int(numel) * (2 if str(dtype or "").startswith("complex") else 1) if numel is not None else None
    exact = elements is not None and a.size >= elements
    if not fin.any():
        # nothing finite in a bucket of either: equal only when the sketch holds each element (every one non-finite,
        # of the same class at the same place)
        return ("err", 0.0, 0.0) if exact else None
    with np.errstate(all="ignore"):
        d = float(np.sqrt(np.sum((a[fin] - b[fin]) ** 2)))
        rn = float(np.sqrt(np.sum(b[fin] ** 2)))
    if not (math.isfinite(d) and math.isfinite(rn)):
        return None
    rel = d / rn if rn > 0 else (0.0 if d == 0 else math.inf)
    return ("err", rel, 0.0 if exact else math.sqrt(2.0 / int(fin.sum())))


def sample_max_abs() -> pl.Expr:
    """Largest finite |x - y| over the shared sample positions (a lower bound of the max abs error)."""
    ok = (c("sample").list.len() == c("ref_sample").list.len()) & (c("sample").list.len() > 0)
    d = (when(ok).then(c("sample")) - when(ok).then(c("ref_sample"))).list.eval(pl.element().abs())
    return d.list.eval(pl.element().filter(pl.element().is_finite())).list.max()


def scalar_err() -> pl.Expr:
    """Non-tensor arguments: relative difference of numbers, 0 or inf for other values by text."""
    a, b = c("scalar_value"), c("ref_scalar_value")
    numeric = a.is_not_null() & b.is_not_null()
    num_err = (
        when((a == b) | (a.is_nan() & b.is_nan())).then(0.0).when(b != 0).then((a - b).abs() / b.abs()).otherwise(INF)
    )
    same_text = (c("value") == c("ref_value")).fill_null(c("value").is_null() & c("ref_value").is_null())
    return when(numeric).then(num_err).otherwise(when(same_text).then(0.0).otherwise(INF))


# ------------------------------------------------------------------------------------------------ err and status
def tensor_err(shape: pl.Expr) -> pl.Expr:
    """err of a tensor pair: inf on a shape or non-finite mismatch, else sketch (of the finite part where both hold
    NaN/Inf: `nonfinite_sketch`), checksum, statistics (best first: a checksum that differs is a difference the
    statistics bound, a lower bound, may not see)."""
    ck = when(c("checksum_equal")).then(0.0).when(~c("checksum_equal")).then(INF)
    return (
        when(shape)
        .then(INF)
        .when(c("nonfinite_mismatch"))
        .then(INF)
        .otherwise(pl.coalesce(c("_sk_err"), c("_nf_err"), ck, c("_st_err")))
    )


def pair_err(
    unmatched: pl.Expr, kinds_differ: pl.Expr, is_tensors: pl.Expr, is_scalars: pl.Expr, nulls: pl.Expr, tensor: pl.Expr
) -> pl.Expr:
    """err of any pair from its parts: none when unmatched, inf when the kinds differ, else by kind."""
    return (
        when(unmatched)
        .then(None)
        .when(kinds_differ)
        .then(INF)
        .when(is_tensors)
        .then(tensor)
        .when(is_scalars)
        .then(c("_sc_err"))
        .when(nulls)
        .then(0.0)
    )


def within_estimates(err: float, bound: float, bar: float | None) -> bool:
    """Whether an error `err` is within `bound` where both are estimates within the relative error bar `bar` of
    the true values (a sketch's `err_bound`, sqrt(2/M) beyond M elements; 0 or None for exact errors): the true
    err <= the true bound means err <= bound x (1 + bar) / (1 - bar) for the estimates."""
    s = min(max(float(bar or 0.0), 0.0), 0.5)
    return err <= bound * (1.0 + s) / (1.0 - s)


def exceeds(err: Any, tol: Any) -> Any:
    """The threshold rule: an error above its tolerance (Polars expressions, numpy arrays or floats alike)."""
    return err > tol


def diverges(err: Any, tol: Any, nonfinite: Any) -> Any:
    """A pair diverges when its error exceeds the tolerance or its non-finite values differ."""
    return exceeds(err, tol) | nonfinite


def pair_status(unmatched: pl.Expr, bad_kind: pl.Expr, error_text: pl.Expr) -> pl.Expr:
    """unmatched / error / unknown / diverged / pass from `err`, `tol`, `nonfinite_mismatch` and the parts."""
    unreadable = bad_kind | (error_text & c("err").is_null())
    return (
        when(unmatched)
        .then(lit("unmatched"))
        .when(unreadable)
        .then(lit("error"))
        .when(c("err").is_null())
        .then(lit("unknown"))
        .when(diverges(c("err"), c("tol"), c("nonfinite_mismatch")))
        .then(lit("diverged"))
        .otherwise(lit("pass"))
    )


def severity(err: np.ndarray | float, tol: np.ndarray | float) -> np.ndarray:
    """err / tol: how far beyond (> 1) or within (<= 1) its threshold a pair is; a zero threshold gives 0 for
    equal values and inf otherwise; NaN where err or tol is unknown."""
    err, tol = np.asarray(err, dtype=np.float64), np.asarray(tol, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tol > 0, err / tol, np.where(err == 0, 0.0, np.where(np.isnan(err), np.nan, np.inf)))


# ------------------------------------------------------------------------------------------------ small values
def small_value_err(
    err: np.ndarray,
    t_norm: np.ndarray,
    r_norm: np.ndarray,
    numel: np.ndarray,
    tensor: np.ndarray,
    group: np.ndarray,
    eps_judged: np.ndarray,
    tiny_judged: np.ndarray | None = None,
    sums: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(err, context rms, judged on a scale, small) after the small-value rule: `small` the residue and subnormal
    values, the scale-judged rows without the sums' (below).

    A tensor whose reference is tiny against its context holds rounding residue, and its relative error means
    nothing (the gradient of an attention key bias is zero in exact arithmetic: 1e-10 in one run, 1e-5 in the
    other).  Its context is the other tensors of the same record (`group`: one id per record pair), whose
    scale is the largest reference RMS among them.  A tensor is in the small-value domain when its reference RMS
    is below eps(judged dtype) x the context RMS; it is then judged by absolute error on the context scale:
    err = ||x - y|| / (sqrt(n) * context rms), compared with the same tolerance.  ||x - y|| is err * ||y||
    (exact, sketch and statistics errors are all relative to ||y||), or ||x|| when y is all zero.

    Subnormal values: below the judged dtype's smallest normal number (`tiny_judged`, SUBNORMAL_BELOW: float16's
    2^-14) its values are spaced by eps x that number, not relative to their size: float16 holds a gradient of
    rms 1e-7 to about 40 % (the spacing 2^-24 = 6e-8), and two devices that round it once differ by that much.
    A tensor whose RMS is below it in both runs is judged by absolute error on that scale too,
    ||x - y|| / (sqrt(n) * tiny): within the tolerance when it differs by about one spacing per element.  The
    context rms returned for a small value is the scale it was judged on (the larger of the scales where
    several apply).

    Sums of K terms (`sums`: per row the row of its source and K, `broadcast_sums`): the gradient of an operand
    broadcast along the incoming gradient g (a bias, a norm's weight) is g summed over the K = numel(g) / numel(t)
    positions it was broadcast to.  K terms of g's RMS r that differ between the runs by a relative e (rounding,
    the device's noise) move the sum by about e x r x sqrt(K) in root of squares, whatever the sum's own size: where
    the terms cancel (an attention key bias's gradient is zero in exact arithmetic, its value the residue of the
    rounded terms) its relative error is e x r sqrt(K) / rms, the input's e times the cancellation.  A reference
    RMS below r x sqrt(K) (the size of K uncorrelated terms' sum) is judged by absolute error on that scale,
    ||x - y|| / (sqrt(n) x r sqrt(K)): the error the sum adds to its terms', never more than its relative
    error."""
    with np.errstate(all="ignore"):
        sqrt_n = np.sqrt(np.where(numel > 0, numel, np.nan))
        rms = np.where(tensor, r_norm / sqrt_n, np.nan)
        ctx = np.full(int(group.max()) + 1 if group.size else 0, -np.inf)
        ok = np.isfinite(rms)
        np.maximum.at(ctx, group[ok], rms[ok])
        ctx_row = ctx[group] if group.size else np.zeros(0)
        small = ok & (ctx_row > 0) & (rms < eps_judged * ctx_row)
        scale = np.where(small, ctx_row, 0.0)
        if tiny_judged is not None:
            # both runs below it (two zero tensors: nothing to judge; a target far above a zero or subnormal
            # reference is no rounding of it, and keeps its relative error)
            sub = ok & (rms < tiny_judged) & (t_norm / sqrt_n < tiny_judged) & ((r_norm > 0) | (t_norm > 0))
            scale = np.where(sub, np.maximum(scale, tiny_judged), scale)
            small |= sub
        residue = small.copy()
        if sums is not None:
            src, terms = sums
            has = ok & (src >= 0)
            at = np.where(has, src, 0)
            s_rms = np.where(has & ok[at] & tensor[at], rms[at], np.nan) * np.sqrt(terms)
            summed = has & np.isfinite(s_rms) & (s_rms > 0) & (rms < s_rms) & ((r_norm > 0) | (t_norm > 0))
            scale = np.where(summed, np.maximum(scale, np.where(summed, s_rms, 0.0)), scale)
            small |= summed
        delta = np.where(r_norm > 0, err * r_norm, t_norm)
        small &= ~np.isnan(err) & np.isfinite(delta)
        out = np.where(small, delta / (sqrt_n * scale), err)
        ctx_out = np.where(small, scale, ctx_row)
    return out, np.where(np.isfinite(ctx_out) & (ctx_out > 0), ctx_out, np.nan), small, residue & small


def broadcast_sums(
    group: np.ndarray,
    grad_in: np.ndarray,
    grad_out: np.ndarray,
    shapes: pl.Series,
    search: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(source row, K) per row for `small_value_err`'s sums: a gradient output of a backward record (`grad_out`)
    whose shape broadcasts to a larger gradient input of the same record (`grad_in`, the gradient it was given;
    the largest such, the first of equals) is that operand's gradient, autograd's sum of the input over the K =
    numel(input) / numel(output) positions the operand was broadcast to (a bias, a norm's weight: `sum_to_size`);
    other rows get -1 and 1.  `search`: per row the record (group) whose inputs to search where not its own (a
    module's `parameters_grad` leaves: its backward record's), -1 for none.  Shapes (`shapes`, a list column)
    decide, not names: t broadcasts to g when it has no more axes and each of its trailing axes equals g's or is
    1 (numpy's rule), so a weight [out, in] does not broadcast to [tokens, out]."""
    n = len(shapes)
    src = np.full(n, -1, dtype=np.int64)
    terms = np.ones(n)
    if n == 0 or not (grad_in.any() and grad_out.any()):
        return src, terms
    where = group if search is None else np.where(search >= 0, search, group)
    ndim = shapes.list.len().fill_null(-1).to_numpy()
    depth = max(int(ndim.max()), 0)
    dims = np.ones((n, depth), dtype=np.int64)  # right-aligned: column k is the (k + 1)-th axis from the last
    for k in range(depth):
        dims[:, k] = shapes.list.get(-(k + 1), null_on_oob=True).fill_null(1).to_numpy()
    numel = dims.prod(axis=1)
    ins, outs = np.flatnonzero(grad_in & (ndim >= 0)), np.flatnonzero(grad_out & (ndim >= 0))
    pairs = pl.DataFrame([to_polars("i", outs), to_polars("k", where[outs])]).join(
        pl.DataFrame([to_polars("j", ins), to_polars("k", group[ins])]), on="k", how="inner"
    )
    i, j = pairs["i"].to_numpy(), pairs["j"].to_numpy()
    fits = ((dims[i] == dims[j]) | (dims[i] == 1)).all(axis=1)
    ok = fits & (ndim[i] <= ndim[j]) & (numel[j] > numel[i]) & (numel[i] > 0)
    i, j = i[ok], j[ok]
    order = np.lexsort((j, -numel[j], i))
    i, j = i[order], j[order]
    first = np.r_[True, i[1:] != i[:-1]] if i.size else np.zeros(0, dtype=bool)
    src[i[first]] = j[first]
    terms[i[first]] = numel[j[first]] / numel[i[first]]
    return src, terms


def module_grad_search(
    group: np.ndarray, direction: Any, api: Any, unit: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(grad_out rows, search) of a module's `parameters_grad` leaves for `broadcast_sums`: its parameters'
    gradients are sums of the gradient its backward record was given (a Linear's bias: the output gradient over
    the tokens).  Linked where the module (`api`, within one `unit`: step, rank, source) has exactly one backward
    record: with several calls (micro-batches, a shared layer) the gradient accumulates over calls whose inputs
    no one record holds."""
    n = len(group)
    df = pl.DataFrame(  # numpy columns through Arrow: pl.Series(ndarray) imports numpy.ma
        [
            to_polars("row", np.arange(n, dtype=np.int64)),
            to_polars("g", np.asarray(group)),
            pl.Series("d", direction, dtype=pl.String),
            pl.Series("a", api, dtype=pl.String),
            to_polars("u", np.zeros(n, dtype=np.int64) if unit is None else np.asarray(unit)),
        ]
    )
    backward = (
        df.filter(c("d") == "backward").group_by("u", "a").agg(c("g").n_unique().alias("n"), c("g").first().alias("s"))
    )
    linked = df.filter(c("d") == "parameters_grad").join(backward, on=["u", "a"], how="inner").filter(c("n") == 1)
    search = np.full(n, -1, dtype=np.int64)
    search[linked["row"].to_numpy()] = linked["s"].to_numpy()
    return search >= 0, search


def small_value_scale() -> pl.Expr:
    """Tensors that take part in the small-value rule (as candidates and as their record's scale): not those
    whose non-finite counts differ, nor a reference holding +-finfo.max, a mask's fill (`torch.where(mask,
    finfo.min, x)`): its RMS is no scale of the record, and would make every other tensor of it look like
    residue."""
    return (~c("nonfinite_mismatch") & ~c("ref_has_sat").fill_null(False)).fill_null(False)


def apply_small_values(rows: pl.DataFrame) -> pl.DataFrame:
    """`small_value_err` over compared rows (after any exact metrics): err, severity and status of the small
    values change; `context_rms` and `small_value` say which and on what scale.  `judged_norm`, for a sum judged
    on its terms' scale (`broadcast_sums`), is the norm its error is relative to, sqrt(n) x that scale (the
    incoming gradient's norm): its record's conditioning reads it in place of the sum's own norm, whose
    cancellation the scale already took out."""
    rows = rows.drop("context_rms", "small_value", "judged_norm", strict=False)  # judged again (after exact metrics)
    keys = [pl.coalesce(c("ref_record"), c("record")), c("step"), c("rank"), c("source")]
    group = rows.select(pl.struct(keys).rank("dense").cast(pl.Int64) - 1).to_series().to_numpy()
    tensor = rows.select(both_tensors().fill_null(False) & small_value_scale()).to_series().to_numpy()
    judged = rows.select(dtype_eps(c("tol_dtype")).fill_null(0.0)).to_series().to_numpy()
    tiny = rows.select(dtype_tiny(c("tol_dtype")).fill_null(0.0)).to_series().to_numpy()
    sums = _sums(rows, group)
    err, ctx, judged_on, small = small_value_err(
        _f64(rows, "err"),
        _f64(rows, "norm"),
        _f64(rows, "ref_norm"),
        _f64(rows, "ref_numel"),
        tensor,
        group,
        judged,
        tiny,
        sums,
    )
    src, terms = sums
    with np.errstate(all="ignore"):
        ref_rms = _f64(rows, "ref_norm") / np.sqrt(_f64(rows, "ref_numel"))
        on_sum = judged_on & (src >= 0) & (ctx == ref_rms[np.where(src >= 0, src, 0)] * np.sqrt(terms))
        judged_norm = np.where(on_sum, np.sqrt(_f64(rows, "ref_numel")) * ctx, np.nan)
    out = rows.with_columns(
        nullable("err", err),
        nullable("context_rms", ctx),
        to_polars("small_value", small),
        nullable("judged_norm", judged_norm),
        to_polars("_judged_on", judged_on),
        to_polars("_on_sum", on_sum),
        nullable("_terms", terms),
    )
    if not judged_on.any():
        return out.drop("_judged_on", "_on_sum", "_terms")
    unmatched = c("match").is_in(["target_only", "ref_only"])
    rms = c("ref_norm") / c("ref_numel").cast(pl.Float64).sqrt()
    note = (
        when(c("_on_sum"))
        .then(
            pl.format(
                "sum of {} terms: reference rms {} below the terms' rms x sqrt({}) = {} (a broadcast operand's "
                "gradient, its terms cancel); judged by absolute error on that scale",
                c("_terms").round(0).cast(pl.Int64),
                rms.round_sig_figs(3),
                c("_terms").round(0).cast(pl.Int64),
                c("context_rms").round_sig_figs(3),
            )
        )
        .when(c("context_rms") == dtype_tiny(c("tol_dtype")))
        .then(
            pl.format(
                "subnormal: reference rms {} below {}'s smallest normal {}; judged by absolute error on that scale",
                rms.round_sig_figs(3),
                c("tol_dtype"),
                c("context_rms").round_sig_figs(3),
            )
        )
        .otherwise(
            pl.format(
                "small value: reference rms {} < eps x {} (the largest rms among its record's tensors); "
                "judged by absolute error on that scale",
                rms.round_sig_figs(3),
                c("context_rms").round_sig_figs(3),
            )
        )
    )
    return out.with_columns(
        nullable("severity", severity(err, _f64(rows, "tol"))),
        when(c("_judged_on"))
        .then(pair_status(unmatched, unreadable_kind(), has_error_text()))
        .otherwise(c("status"))
        .alias("status"),
        when(c("_judged_on"))
        .then(pl.concat_str([c("detail"), note], separator="; ", ignore_nulls=True))
        .otherwise(c("detail"))
        .alias("detail"),
    ).drop("_judged_on", "_on_sum", "_terms")


def _sums(rows: pl.DataFrame, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`broadcast_sums` of compared rows (the reference's shapes; a record in one run only has its own)."""

    def either(name: str) -> pl.Expr:
        return pl.coalesce(c(f"ref_{name}"), c(name)) if f"ref_{name}" in rows.columns else c(name)

    cols = rows.select(
        either("direction").fill_null("").alias("direction"),
        either("io").fill_null("").alias("io"),
        either("api").fill_null("").alias("api"),
        either("shape").alias("shape"),
        pl.struct("step", "rank", "source").rank("dense").alias("unit"),
    )
    return record_sums(group, cols["direction"], cols["io"], cols["api"], cols["shape"], cols["unit"].to_numpy())


def record_sums(
    group: np.ndarray,
    direction: pl.Series,
    io: pl.Series,
    api: pl.Series,
    shapes: pl.Series,
    unit: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`broadcast_sums` of rows grouped by record (`group`), from their direction, io, module api (no nulls) and
    shapes: the gradients a backward record was given and returned, and a module's `parameters_grad` leaves linked
    to its one backward record (`module_grad_search`, within each `unit`).  The detailed comparison's rows
    (`_sums`) and the screen's units (analysis/screen.py) both go through it."""
    d, i = direction.to_numpy(), io.to_numpy()
    pgrad, search = module_grad_search(group, direction, api, unit)
    grad_in = (d == "backward") & (i == "input")
    grad_out = ((d == "backward") & (i == "output")) | pgrad
    return broadcast_sums(group, grad_in, grad_out, shapes, search)


def _f64(df: pl.DataFrame, col: str) -> np.ndarray:
    return df[col].cast(pl.Float64).to_numpy()

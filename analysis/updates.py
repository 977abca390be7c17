"""The floor of the update-differs rule (analysis/steps.py `update_differs`): how far apart, in units of an update,
the runs' updates must be (median over the parameters) before "every parameter moved otherwise than its gradient
explains" names the optimizer (see docs/how-it-decides.md, section 5).

  the first update of the pair (no earlier step in the rows)
                   X_MIN, a quarter of an update: Adam's first update is lr sign(g) per element (m/sqrt(v) with
                   one gradient), so device noise flips whole elements whose gradient is near 0, in every
                   parameter alike, by a part of an update its gradients' norm-wise error does not explain
  a later update   UPDATE_X_MIN (a sixteenth of an update) and STAND_OUT x the median x of the update before it:
                   the pair's own measured optimizer noise is the baseline.  Clipping at another norm under an
                   adaptive optimizer (Adam, Adamax) from the second update on rescales the new gradient inside
                   m and u/v, which also hold the earlier gradients, so each element moves by its own factor:
                   the update sizes keep their ratio (the update-ratio rule sees nothing) while every element
                   moves by a tenth to a half of an update.  The first update under Adam or Adamax is the same
                   in both runs whatever the clipping (sign(g) is scale-free), so nothing is lost there.
                   Under that floor, a later update still differs where its parameters' median x over their
                   explanation (`steps.over_explanation`) is at least UNEXPLAINED and STAND_OUT x the update
                   before's: an eps of RMSprop moves every update by a few thousandths, far beyond fp32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from dumpstore.dtypes import eps
from dumpstore.names import without_module_call_expr

from . import rules as R
from . import steps as ST
from .noise import OPT_FLOOR, OPT_MIN_PARAMS, OPT_SHARE, OPT_Z, STAND_OUT, median, update_evidence
from .param_gaps import stats_gap

# a later update whose parameters moved (median) this many times what explains them (their gradients' error, the
# gap carried in, one rounding), and STAND_OUT x the update before's: the update rule changed, however small the
# gap in updates.  Every later update of the clean pairs of dev 1, sets 1-8 and the clean combinations: at most
# 4.14 (set 3 `bert_clean`, Adam's per-element normalisation of near-zero gradients); set 8 `fnet_eps_step2`
# (RMSprop eps 1e-5 for 1e-8): 138 (docs/how-it-decides.md, section 5, *Parameters after the first step*)
UNEXPLAINED = 16.0
# a measured update-size ratio is known to within this half-width in log (ratio_shift): the factors sought, 1 % to
# 20 %, are finer than a ratio known to +-2/3 shows, and those ratios widen the spread without moving the median
MEASURED_HALF = 0.25


def _update_before(rows: pl.DataFrame, before: int, params: pl.DataFrame) -> pl.DataFrame | None:
    """`steps.table` of the update into `before` (from the compared step before it) for `params`, where at least
    MIN_MEASURED of its parameters are measured; None at the pair's first update or with fewer measured."""
    start = _previous(rows, before)
    t = ST.table(rows, start, before, params) if start is not None else None
    x = t["x"].fill_null(np.nan).to_numpy() if t is not None else np.zeros(0)
    return t if int(np.isfinite(x).sum()) >= ST.MIN_MEASURED else None


def update_floor(rows: pl.DataFrame, before: int, params: pl.DataFrame) -> tuple[float, float | None]:
    """(floor, the median x of the update before) for the update between step `before` and the next compared
    step; `params`: that later step's parameter candidates (the rows `steps.table` takes), looked up at `before`
    and the step before it by (rank, source, record, io, index path).  The median is None at the first update
    (no earlier step in `rows`, or none of the parameters measured there)."""
    return _floor(_update_before(rows, before, params))


def _floor(earlier: pl.DataFrame | None) -> tuple[float, float | None]:
    """`update_floor` from the update before's table (`_update_before`; None: the pair's first update)."""
    if earlier is None:
        return ST.X_MIN, None
    x = earlier["x"].fill_null(np.nan).to_numpy()
    prev = float(median(x[np.isfinite(x)]))
    return max(ST.UPDATE_X_MIN, STAND_OUT * prev), prev


def updates_differ(
    rows: pl.DataFrame, before: int, params: pl.DataFrame, table: pl.DataFrame | None
) -> dict[str, Any] | None:
    """`steps.update_differs` of `table` (the update between `before` and the next step) at its floor
    (`update_floor`, measured only where the rest of the rule holds), with the floor and the median x of the
    update before in the evidence; or, at a later update under that floor, its parameters' median x over their
    explanation at least UNEXPLAINED and STAND_OUT x the update before's (`ST.over_explanation`: an update
    that moved every parameter far beyond what its gradients, the gap carried in and rounding explain, where
    the update before moved them within it); None when the updates do not differ."""
    found = ST.update_differs(table, 0.0)
    if found is None:
        return None
    earlier = _update_before(rows, before, params)  # (the table of the update before: once for both tests)
    floor, prev = _floor(earlier)
    if found["median_update_units"] >= floor:
        return found | {"floor": floor, "previous_update_units": prev}
    if earlier is None or table is None:
        return None
    over, over_before = ST.over_explanation(table), ST.over_explanation(earlier)
    bar = max(UNEXPLAINED, STAND_OUT * over_before)
    if not over >= bar:
        return None
    return found | {
        "floor": floor,
        "previous_update_units": prev,
        "over_explanation": over,
        "previous_over_explanation": over_before,
        "explanation_bar": bar,
    }


# ------------------------------------------------------------------------------------------------------------------
# The update rule changed from a later update on: each update judged against the pair's update before it
# ------------------------------------------------------------------------------------------------------------------
def _previous(rows: pl.DataFrame, before: int) -> int | None:
    """The compared step before `before` (the update into `before` starts there); None at the pair's first update."""
    earlier = [s for s in rows["step"].unique().to_list() if s is not None and s < before]
    return max(earlier) if earlier else None


def one_per_tensor(params: pl.DataFrame) -> pl.DataFrame:
    """One row per parameter tensor: a module called several times in a step (micro-batches, a shared layer) dumps
    its parameters once per call record (`...forward.0`, `...forward.1`), one tensor; counting the copies as
    independent parameters shrinks a median's standard error without adding evidence."""
    return (
        params.with_columns(without_module_call_expr(pl.col("_record")).alias("_one"))
        .unique(subset=["rank", "source", "_one", "index_path"], keep="first", maintain_order=True)
        .drop("_one")
    )


def _pair_of_steps(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> pl.DataFrame:
    """The statistics of `params`' tensors (looked up by their keys) at `after` and (suffix `_b`) at `before`."""
    stats = [*R.STATS, *(f"ref_{s}" for s in R.STATS)]
    cols = rows.select("step", *ST._KEYS, *stats, "numel", "dtype", "ref_dtype")
    now = (
        cols.filter(pl.col("step") == after)
        .join(params.select(ST._KEYS), on=ST._KEYS, how="semi")
        .unique(subset=ST._KEYS, keep="first", maintain_order=True)
    )
    then = cols.filter(pl.col("step") == before).select(*ST._KEYS, *stats).unique(subset=ST._KEYS, keep="first")
    return now.drop("step").join(then, on=ST._KEYS, how="inner", suffix="_b", maintain_order="left")


def measured_ratios(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(log ratio, its half-width) of the update sizes target/reference between steps `before` and `after`, one per
    parameter of `params` whose update a statistic measures; the others are left out.

    A statistic s (norm, max, min, mean) moved by |s(after) - s(before)| in each run, and each s is rounded in the
    tensor's dtype (msprobe computes a bf16 tensor's statistics in bf16), so that change is known to within
    q = eps(dtype) x max(|s(after)|, |s(before)|).  A change moves with the update that made it (every statistic
    of a parameter moves by lr x its update direction's share, so a learning rate x f moves each by f): the ratio
    of the two runs' changes of one statistic is the update-size ratio, with the half-width q_t/|ds_t| +
    q_r/|ds_r| in log.  The parameter's ratio is that of its statistic with the smallest half-width, where that
    half-width is at most MEASURED_HALF (each run's change 8 roundings or more: else no statistic measures its
    update to a few %: a bf16 weight of 0.5 moved by lr 1e-3 moves its statistics by whole bf16 steps of 2e-3, or
    not at all, and a ratio of 3 steps to 4 says nothing of 5 %)."""
    both = _pair_of_steps(rows, before, after, params)
    if not both.height:
        return np.zeros(0), np.zeros(0)
    best_l = np.full(both.height, np.nan)
    best_h = np.full(both.height, np.inf)
    e = {pre: np.array([eps(d or "") for d in both[f"{pre}dtype"].to_list()]) for pre in ("", "ref_")}
    for s in R.STATS:
        change, rounding = {}, {}
        for pre in ("", "ref_"):
            a = both[f"{pre}{s}"].cast(pl.Float64).fill_null(np.nan).to_numpy()
            b = both[f"{pre}{s}_b"].cast(pl.Float64).fill_null(np.nan).to_numpy()
            change[pre], rounding[pre] = np.abs(a - b), e[pre] * np.fmax(np.abs(a), np.abs(b))
        with np.errstate(all="ignore"):
            ok = (change[""] > 0) & (change["ref_"] > 0)
            half = rounding[""] / change[""] + rounding["ref_"] / change["ref_"]
            log = np.log(change[""] / change["ref_"])
        better = ok & np.isfinite(log) & (half <= MEASURED_HALF) & (half < best_h)
        best_l, best_h = np.where(better, log, best_l), np.where(better, half, best_h)
    keep = np.isfinite(best_l)
    return best_l[keep], best_h[keep]


def _location(values: np.ndarray, half: np.ndarray | None = None) -> tuple[float, float, float]:
    """(median, spread, standard error of the median) of `values`; the spread is the robust sigma (1.4826 MAD) and
    at least the standard deviation that rounding alone gives a value known to within +-`half` (half / sqrt(3),
    uniform): a set of ratios tied by rounding has no spread of its own, but is not exact."""
    med = float(median(values))
    spread = 1.4826 * float(median(np.abs(values - med)))
    if half is not None and half.size:
        spread = max(spread, float(median(half)) / np.sqrt(3.0))
    return med, spread, 1.2533 * spread / np.sqrt(values.size)


def ratio_shift(
    rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame, gradient_error: float = 0.0
) -> dict[str, Any] | None:
    """Evidence that the update sizes between `before` and `after` moved, target against reference, by another
    factor than in the pair's update before (from the step before `before`); None when they did not, at the
    pair's first update, or with fewer than OPT_MIN_PARAMS measured ratios in either update (`ratio_shift_measures`
    has the measures whether or not they differ)."""
    m = ratio_shift_measures(rows, before, after, params, gradient_error)
    if m is None or not m.pop("differs"):
        return None
    m.pop("margin")
    return m


def ratio_shift_measures(
    rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame, gradient_error: float = 0.0
) -> dict[str, Any] | None:
    """`ratio_shift`'s measures, with `margin` (|shift| / bar) and `differs`; None where it has none.

    The ratios are `measured_ratios` (one per tensor); the update before reads the same pair's device noise and
    any systematic difference of its update sizes (a device that stores parameters by stochastic rounding moves
    them otherwise than round-to-nearest, at every update alike), so the shift is judged against both updates'
    standard errors: it differs when the median log ratio moved by more than OPT_Z x their combined standard
    error, by more than OPT_FLOOR and by more than the gradients' error, with at least OPT_SHARE of the
    ratios measured past the update before's median on the same side (those equal to it, ties of bf16
    statistics, are counted apart)."""
    prev = _previous(rows, before)
    if prev is None:
        return None
    params = one_per_tensor(params)
    now, half = measured_ratios(rows, before, after, params)
    then, half_then = measured_ratios(rows, prev, before, params)
    if now.size < OPT_MIN_PARAMS or then.size < OPT_MIN_PARAMS:
        return None
    med, spread, se = _location(now, half)
    med_then, _, se_then = _location(then, half_then)
    shift = med - med_then
    bar = float(max(OPT_Z * np.hypot(se, se_then), OPT_FLOOR, gradient_error))
    tied = int((now == med_then).sum())
    moved = now[now != med_then]
    same_way = int((np.sign(moved - med_then) == np.sign(shift)).sum())
    out = {
        "parameters": int(now.size),
        "gradient_error": gradient_error,
        "median_ratio": float(np.exp(med)),
        "previous_ratio": float(np.exp(med_then)),
        "previous_parameters": int(then.size),
        "same_way": same_way,
        "spread": float(spread),
        "bar": bar,
        "margin": abs(shift) / bar,
        "differs": bool(abs(shift) > bar and moved.size >= OPT_MIN_PARAMS and same_way >= OPT_SHARE * moved.size),
    }
    return out | {"tied": tied} if tied else out


def norm_gaps(
    rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame, size_noise: float = 0.0
) -> tuple[np.ndarray, float]:
    """(d, the largest eps among their dtypes): `steps.decay_differs`'s d = relative norm gap at `after` less the
    one carried in from `before`, for the parameters whose d a weight-decay change could show and noise could
    not: |d| over STAND_OUT x 2 eps (its four norms rounded by eps / 2 each) and |d| ||p_r(after)|| over STAND_OUT
    x what the update's own disagreement explains (`steps.table`'s max(x_prev, g_prev, x_round), in updates, x
    the reference's update): a norm gap can move by no more than the gap of the updates, so a parameter whose
    gradient is mostly rounding (a key projection's bias under softmax, a norm of 1e-7) moves its norm by noise
    alone and says nothing.  Nor by less than STAND_OUT x `size_noise` x the reference's update: an update whose
    size is off by the step's typical relative disagreement of update sizes (`size_noise`, the robust spread of
    the log update-size ratios across the parameters) moves a norm along the parameter by up to that much, and
    a parameter whose norm is a few of its updates (a bias from 0, the sum of its updates) has its relative norm
    moved by the noise of its update's size, more than a decay moves it."""
    t = ST.table(rows, before, after, params)
    if t is None:
        return np.zeros(0), 0.0
    both = t.select(*ST._KEYS, "x_prev", "g_prev", "x_round").join(
        _pair_of_steps(rows, before, after, params), on=ST._KEYS, how="inner"
    )
    if not both.height:
        return np.zeros(0), 0.0
    numel = both["numel"].cast(pl.Float64).fill_null(1.0).to_numpy()

    def side(suffix: str) -> dict[str, np.ndarray]:
        return {s: both[f"ref_{s}{suffix}"].cast(pl.Float64).fill_null(np.nan).to_numpy() for s in R.STATS}

    upd = stats_gap(side(""), side("_b"), numel)  # the reference's update (statistics lower bound)
    t_a, r_a, t_b, r_b = (
        both[c].cast(pl.Float64).fill_null(np.nan).to_numpy() for c in ("norm", "ref_norm", "norm_b", "ref_norm_b")
    )
    e = np.array([eps(d or "") for d in both["dtype"].to_list()])
    explained = np.fmax(np.nan_to_num(ST._explained(both), nan=0.0), size_noise) * np.nan_to_num(upd, nan=np.inf)
    with np.errstate(all="ignore"):
        d = (t_a - r_a) / r_a - (t_b - r_b) / r_b
        ok = np.isfinite(d) & (r_a > 0) & (r_b > 0) & (np.abs(d) > STAND_OUT * 2 * e)
        ok &= np.abs(d) * r_a > STAND_OUT * explained
    return d[ok], float(e[ok].max()) if ok.any() else 0.0


def _size_noise(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> float:
    """The robust spread of the log update-size ratios (target over reference) across the parameters between
    `before` and `after` (analysis/noise.py `update_evidence`): how far apart the runs' update sizes typically
    are, relative; 0 where it is not measured."""
    distinct = ST.parameters_of(params)
    ev = update_evidence(rows, before, after, distinct, ST.gradient_error(rows, before)) if distinct.height else None
    return float(ev["spread"]) if ev is not None and np.isfinite(ev["spread"]) else 0.0


def decay_shift(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> dict[str, Any] | None:
    """Evidence that the parameters' norms moved apart by one common relative amount between `before` and `after`,
    beyond the update before (`steps.decay_differs` for a later update, over the parameters `norm_gaps` measures);
    None when they did not, at the pair's first update, or with fewer than OPT_MIN_PARAMS measured
    (`decay_shift_measures` has the measures whether or not they differ)."""
    m = decay_shift_measures(rows, before, after, params)
    if m is None or not m.pop("differs"):
        return None
    m.pop("margin")
    return m


def decay_shift_measures(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> dict[str, Any] | None:
    """`decay_shift`'s measures, with `margin` (|shift| / bar) and `differs`; None where it has none.

    `decay_differs` takes the median over every parameter, so where a weight decay enters only some of them
    (biases and norms near 0 move by -lr dwd p ~ 0; LAMB, whose trust ratio ||p|| / ||u|| scales each update,
    moves a weight's norm by lr ||p|| x the decay's share of its update direction; parameter groups without
    decay) the others hold the median at 0.  Here only the parameters whose d a change could show count, and a
    weight decay moves them one way by a common relative amount: their median is off the update before's by
    more than OPT_Z x the combined standard error, by more than STAND_OUT x their own spread (device noise moves
    norms by amounts as scattered as themselves: a systematic one, the same way for every parameter, still
    varies by more than a third of its median) and by more than STAND_OUT x eps, with at least OPT_SHARE of
    them past the update before's median on that side."""
    prev = _previous(rows, before)
    if prev is None:
        return None
    params = one_per_tensor(params)
    now, e = norm_gaps(rows, before, after, params, _size_noise(rows, before, after, params))
    if now.size < OPT_MIN_PARAMS:
        return None
    then, _ = norm_gaps(rows, prev, before, params, _size_noise(rows, prev, before, params))
    med, spread, se = _location(now)
    med_then, se_then = (0.0, 0.0) if then.size < OPT_MIN_PARAMS else _location(then)[::2]
    shift = med - med_then
    bar = float(max(OPT_Z * np.hypot(se, se_then), STAND_OUT * spread, STAND_OUT * e))
    same_way = int((np.sign(now - med_then) == np.sign(shift)).sum())
    return {
        "parameters": int(now.size),
        "median_norm_gap": med,
        "previous_norm_gap": med_then,
        "same_way": same_way,
        "spread": float(spread),
        "bar": bar,
        "margin": abs(shift) / bar,
        "differs": bool(abs(shift) > bar and same_way >= OPT_SHARE * now.size),
    }


# ------------------------------------------------------------------------------------------------------------------
# An update that differs where everything it was fed agrees (a replay of the update before)
# ------------------------------------------------------------------------------------------------------------------
# the chance, under the update before's rate, of as many parameters differing: at most the normal tail beyond
# STAND_OUT (one-sided), the noise model's own margin
REPLAY_P = 0.5 * math.erfc(STAND_OUT / math.sqrt(2.0))


def _equal(both: pl.DataFrame, a: str, b: str) -> np.ndarray:
    """Per row: columns `a` and `b` hold the same value, missing in both counting as equal."""
    x, y = (both[c].cast(pl.Float64).fill_null(np.nan).to_numpy() for c in (a, b))
    return (x == y) | (np.isnan(x) & np.isnan(y))


def _same(both: pl.DataFrame, suffix: str = "") -> np.ndarray:
    """Per row: every statistic (with `suffix`) equal in both runs, missing in both counting as equal."""
    out = np.ones(both.height, dtype=bool)
    for s in R.STATS:
        out &= _equal(both, f"{s}{suffix}", f"ref_{s}{suffix}")
    return out


def _moved(both: pl.DataFrame, a: str, b: str) -> np.ndarray:
    """Per row: a statistic changed between the columns with suffix `a` and `b`, in either run."""
    out = np.zeros(both.height, dtype=bool)
    for pre in ("", "ref_"):
        for s in R.STATS:
            out |= ~_equal(both, f"{pre}{s}{a}", f"{pre}{s}{b}")
    return out


def replay_measures(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> dict[str, Any] | None:
    """`replayed_update`'s measures, with `p` and `differs`; None where the rule does not apply: at the pair's
    first update, where a parameter or its gradient (`parameters_grad` leaf) disagrees at `before` in any
    statistic or has none, or where a parameter disagreed at the step before `before`.

    An optimizer is a deterministic function of the parameters, their gradients and its state.  Where every
    parameter and every gradient agree at `before` in all four statistics, and the pair's update before turned
    agreeing parameters into parameters that agree again (`previous_updated` of them moved, none apart: the two
    devices' optimizer arithmetic is the same, and what the gradients hid from their statistics did not reach
    the parameters), the update from `before` is a replay of it: a parameter that differs after it was moved
    by another rule.  A gradient's mean is a sum that cancels (far below its elements), so one element changed
    by one rounding of itself moves it: statistics that agree say the gradients agree but for their smallest
    elements.  The count is judged against the update before's: the chance that k of the n parameters moved now
    differ where 0 of the n0 moved before did, at the same rate (Fisher's exact test, one-sided: C(n, k) /
    C(n + n0, k)), must be under REPLAY_P, with at least OPT_MIN_PARAMS differing.  A tensor whose statistics are
    another rank's copy of the same parameter at both steps in both runs (a data-parallel replica) is counted
    once."""
    prev = _previous(rows, before)
    if prev is None:
        return None
    params = one_per_tensor(params)
    now = _pair_of_steps(rows, before, after, params)
    then = _pair_of_steps(rows, prev, before, params)
    if now.height < OPT_MIN_PARAMS:
        return None
    earlier = then.select(*ST._KEYS, *(pl.col(c).alias(f"{c[:-2]}_p") for c in then.columns if c.endswith("_b")))
    both = now.join(earlier, on=ST._KEYS, how="left", maintain_order="left")
    grads = rows.filter(
        (pl.col("step") == before) & (pl.col("_io") == "parameters_grad") & (pl.col("kind") == "tensor")
    ).select("rank", "source", ST._module("_record"), "index_path", *(pl.col(s).alias(f"{s}_g") for s in R.STATS),
             *(pl.col(f"ref_{s}").alias(f"ref_{s}_g") for s in R.STATS))  # fmt: skip
    on = ["rank", "source", "_module", "index_path"]
    both = both.with_columns(ST._module("_record")).join(
        grads.unique(subset=on, keep="first"), on=on, how="left", nulls_equal=True, maintain_order="left"
    )
    has_grad = both["norm_g"].is_not_null().to_numpy() | both["ref_norm_g"].is_not_null().to_numpy()
    has_prev = both["norm_p"].is_not_null().to_numpy() | both["ref_norm_p"].is_not_null().to_numpy()
    if not (has_grad.all() and has_prev.all() and _same(both, "_b").all() and _same(both, "_g").all()):
        return None
    if not _same(both, "_p").all():
        return None  # the update before started from parameters apart: no replay to compare with
    cols = [c for c in both.columns if any(c.startswith(s) or c.startswith(f"ref_{s}") for s in R.STATS)]
    both = both.unique(subset=["source", "_module", "index_path", *cols], keep="first", maintain_order=True)
    moved, moved_before = _moved(both, "", "_b"), _moved(both, "_b", "_p")
    n, n0, k = int(moved.sum()), int(moved_before.sum()), int((~_same(both)).sum())
    p = math.comb(n, k) / math.comb(n + n0, k) if k <= n else 0.0
    return {
        "parameters": int(both.height),
        "updated": n,
        "differing": k,
        "previous_updated": n0,
        "p": p,
        "differs": bool(k >= OPT_MIN_PARAMS and p < REPLAY_P),
    }


def replayed_update(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> dict[str, Any] | None:
    """Evidence that the update between `before` and `after` differs although everything it was fed agrees
    (`replay_measures`); None when it does not, or the rule does not apply."""
    m = replay_measures(rows, before, after, params)
    if m is None or not m.pop("differs"):
        return None
    return m

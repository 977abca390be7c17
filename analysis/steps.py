"""Parameters across steps: how far the runs' parameters are apart at a later step, measured in units of the
reference's own update of each parameter, and the two rules built on it (see docs/how-it-decides.md).

For every parameter p (a module record's `parameters` leaf; without module records, a tensor input that requires
grad and that no recorded op produced; with them, also such an input of one element that no module lists: a
model's own scalar, `_table_parameters`) between steps b and a = the next compared step:

  gap(s)   ||p_t(s) - p_r(s)||, target against reference at step s
  upd      ||p_r(a) - p_r(b)||, the reference's update of p
  x        gap(a) / upd: how much of one update the runs disagree by after it
  x_chg    the same with gap(a)'s extremes (its max and min differences: one element each) counted only beyond
           UPDATES_APART x the reference update's own max/min move: what a change of the tensor shows, not two
           runs' updates of one element (the changed-parameter rule's measure)
  x_prev   gap(b) / upd: the disagreement the runs carried into the update
  g_prev   the relative error of p's gradient at step b (its `parameters_grad` leaf): what the update was fed
  x_round  eps(p's dtype) x ||p_r(b)|| / upd: one rounding of the parameter, in the same units
  x_exact  for a one-element p (its statistics are its value): the target's own update off the reference's and
           off its sign flip, in the reference's update (`_exact_update_gap`)

All norms are the statistics lower bound of analysis/rules.py (`stats_bound`), so that `x` is a ratio of two
quantities measured the same way, except in the changed-parameter rule's x_chg, xc_prev, xc_round where both runs
sketched the parameter at both steps (tensor mode): there they are the tensor's own norms from its sketches
(`_sketch_gaps`: the sketch is linear and one map in every run and step; exact up to its M elements, else within
sqrt(2/M)), every element's gap in every element's update: a permutation of a weight's elements (a router's rows
in another expert order) keeps every statistic. A statistics bound is no upper bound (statistics bound ||a - b||
from above only by ||a|| + ||b||, a hundred updates), so that x is not a bound either way: the norm and the mean
are projections of a difference on fixed directions, which shrink a gap and an update alike, and their ratio reads
the ratio of the norms; a max or min difference is one element's, which does not shrink, and is compared with one
element's update (x_chg). Device noise moves an update by about the error of the gradient it was computed from
(Adam's normalisation can flip the sign of updates of near-zero gradients, but those carry little of the update's
norm), and carries the earlier disagreement on: x stays of the order of its explanation max(x_prev, g_prev,
x_round). Hence:

  corrupted parameter  x (here x_chg throughout) > STAND_OUT x its explanation (not what the update was fed, carried
                       in, or rounding), x > STAND_OUT x the largest x of its siblings (same module class or API,
                       parameter name and shape, other modules or ranks: the same optimizer's noise on the same kind
                       of tensor; another call of the same module reads the same tensor and is none; a parameter
                       without siblings: the largest x of every other parameter), and either the parameter is over
                       its tolerance or x > STAND_OUT x (UPDATES_APART + x_prev) (more than the two runs' updates can
                       put between them) or x >= X_MIN where every other parameter of the step (at least
                       MIN_MEASURED) is within STAND_OUT x (x_prev + x_round): the runs computed the same updates: a
                       parameter changed between steps (written to, loaded wrongly).  Or two parameters of one shape
                       and dtype, each at least X_MIN off and each target STAND_OUT x nearer the other's reference
                       than its own (analysis/param_gaps.py `held_values`; with statistics, in an element and a sum):
                       a swap, named on that evidence, each judged against its siblings without the other.  A
                       parameter is its pair of fingerprints (target, reference: analysis/param_change.py).  Named at
                       its first consumer at step a, outright where x >= X_MIN (a sizeable part of an update), else
                       only where that consumer confirms it (`needs_consumer`: its activations agree and its own
                       error stands out; analysis/culprit.py `_consumer_confirms`).  A one-element parameter instead:
                       x_exact >= X_MIN, beyond STAND_OUT x its explanation and x the x_exact of its siblings (else
                       of the other one-element parameters; none: on its own measure).  Not judged: a parameter whose
                       gradient at b is rounding residue (`small_value`: its relative error unbounded, its update no
                       unit the runs share).
  update differs       most (over UPDATE_SHARE) of the measured parameters have x > STAND_OUT x their explanation,
                       and the median x is at least its floor (analysis/updates.py: X_MIN at the pair's first
                       update, else UPDATE_X_MIN and STAND_OUT x the update before's; or, at a later update,
                       its median x over the explanation at least updates.UNEXPLAINED): every parameter moved
                       otherwise than its gradient explains (clipping at another norm, another optimizer): the
                       optimizer culprit.  A
                       learning-rate change moves every update by the same factor and is found by the
                       update-ratio rule of analysis/noise.py (`update_evidence`), which runs first.
  decay differs        the parameters' norms moved apart by one common factor between the steps: the median of
                       d = (||p_t(a)|| - ||p_r(a)||) / ||p_r(a)|| - (||p_t(b)|| - ||p_r(b)||) / ||p_r(b)|| (the
                       relative norm gap of step a less the one carried in from b) is off 0 by more than OPT_Z
                       standard errors of that median and by more than STAND_OUT x eps of the parameters' dtype (one
                       rounding of a norm), with at least OPT_SHARE of them the same way.  A weight decay changed
                       by dwd moves every parameter by -lr dwd p, in proportion to the parameter itself (decoupled,
                       AdamW; coupled, plain SGD), so every norm by the same relative -lr dwd, whatever its update;
                       device noise moves a parameter in directions unrelated to it, its norm both ways.  The
                       optimizer culprit, tried after the update-ratio rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from dumpstore.dtypes import eps
from dumpstore.names import parse_record, without_module_call

from . import param_change as PC
from . import rules as R
from .noise import OPT_MIN_PARAMS, OPT_SHARE, OPT_Z, STAND_OUT, median
from .pairmetrics import WEIGHT_SKETCH
from .param_gaps import held_values, sketch_distance, stats_gap

X_MIN = 0.25  # a gap of a quarter of the reference's own update: far beyond rounding of an update
# the update-differs rule's floor: the runs' updates a sixteenth of an update apart (median over the parameters).
# Device noise moves an update by about its gradients' error; where most parameters are beyond that explanation,
# the clean pairs' median stays 2x under this (docs/how-it-decides.md, section 5)
UPDATE_X_MIN = 2.0**-4
# two runs' updates of a parameter put at most both of them between the runs (each one update, in opposite
# directions: ||u_t - u_r|| <= ||u_t|| + ||u_r||), on top of what they carried in: a parameter within its
# tolerance is named only beyond STAND_OUT x that
UPDATES_APART = 2.0
MIN_MEASURED = 3  # fewer measured parameters: no update-differs rule, no step agreement (corrupted)
# the update-differs rule: more than this share of the measured parameters beyond their explanation (a majority:
# a hyperparameter that acts on some tensors only, Lion's betas on those whose gradient changed sign, a weight
# decay on those with a norm, leaves the others explained; the floor on the median x is the evidence, the share
# only says the median is of moved parameters: docs/how-it-decides.md, section 5)
UPDATE_SHARE = 0.5

_KEYS = ["rank", "source", "_record", "_io", "index_path"]


def _changed_gap(
    t: dict[str, np.ndarray],
    r: dict[str, np.ndarray],
    a: dict[str, np.ndarray],
    b: dict[str, np.ndarray],
    n: np.ndarray,
) -> np.ndarray:
    """The part of the statistics lower bound of ||t - r|| that a change of the tensor shows, not the two runs'
    updates of one element: the bulk (|d norm|, |d mean| sqrt(n): the whole tensor) in full, the extremes (|d max|,
    |d min|: one element each) only beyond UPDATES_APART x what the reference's update moved its own extremes
    (`a` against `b`, the reference at both steps).  NaN where no statistic is known."""
    with np.errstate(invalid="ignore"):
        bulk = np.fmax(np.abs(t["norm"] - r["norm"]), np.abs(t["mean"] - r["mean"]) * np.sqrt(n))
        extreme = np.fmax(np.abs(t["max"] - r["max"]), np.abs(t["min"] - r["min"]))
        element = np.fmax(np.abs(a["max"] - b["max"]), np.abs(a["min"] - b["min"]))
        beyond = np.where(np.isnan(element), extreme, extreme - UPDATES_APART * element)
        out = np.fmax(bulk, np.where(beyond > 0, beyond, np.where(np.isnan(beyond), np.nan, 0.0)))  # (not -0)
    return np.where(r["norm"] == 0, np.abs(t["norm"]), out)  # ||x - 0|| = ||x||: a bias that starts at zero


def parameters_of(params: pl.DataFrame) -> pl.DataFrame:
    """The parameter leaves among `params` (candidate weight leaves of one step): module records' `parameters`
    leaves where the dump has them, else the candidates, one per tensor (parameter key: analysis/param_change.py)."""
    named = params.filter(pl.col("_io") == "parameters")
    if named.height:
        return named
    return _one_per_tensor(params)


def _one_per_tensor(params: pl.DataFrame) -> pl.DataFrame:
    """`params`, one row per parameter key (the first)."""
    if "_fp_t" not in params.columns:
        return params
    return (
        params.with_columns(PC.key_expr(params.columns).alias("_one"))
        .unique(subset=["_one"], keep="first", maintain_order=True)
        .drop("_one")
    )


def _table_parameters(params: pl.DataFrame) -> pl.DataFrame:
    """The parameters the table measures: `parameters_of`, and where module records list parameters, the
    one-element tensors among the other candidates whose tensor no module lists (a model's own scalar read
    directly by an op: CLIP's `logit_scale` through `Tensor.exp`, a temperature, a gate).  A module lists only
    its own parameters, and the top model's forward is not a record, so such a scalar is in no `parameters`
    leaf; the other unlisted inputs that require grad are activations reached through ops msprobe does not
    record (`k.transpose()`, a softmax before dropout), whose step-to-step change is no update.  A one-element
    input that requires grad and that no recorded op made is a parameter or the loss-like scalar of an
    unrecorded op, which changes with the data, a whole update of itself or more (`x_exact` small)."""
    named = parameters_of(params)
    if not named.height or named.height == params.height or "_fp_t" not in params.columns:
        return named
    listed = set(named["_fp_t"].drop_nulls().to_list())
    scalars = params.filter(
        (pl.col("_io") != "parameters")
        & (pl.col("numel") == 1)
        & pl.col("_fp_t").is_not_null()
        & ~pl.col("_fp_t").is_in(list(listed))
    )
    if not scalars.height:
        return named
    return pl.concat([named, _one_per_tensor(scalars)], how="diagonal_relaxed")


def table(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> pl.DataFrame | None:
    """One row per parameter of step `after` (see the module's docstring): its keys, `_fp_t`, `_pkey` (which
    parameter: analysis/param_change.py), shape, status, `x`, `x_prev`, `x_round`, `g_prev`, `klass` (module
    class or API, parameter name, shape).  None: nothing measurable."""
    stats = [*R.STATS, *(f"ref_{s}" for s in R.STATS)]
    sketches = [s for s in WEIGHT_SKETCH if s in rows.columns]  # tensor mode (analysis/pairmetrics.py)
    cols = rows.select("step", *_KEYS, *stats, "numel", *sketches)
    params = _table_parameters(params)
    params = params.with_columns(PC.key_expr(params.columns))  # which parameter (analysis/param_change.py)
    now = params.select(*_KEYS, "_fp_t", "_pkey", "shape", "status", "dtype").join(
        cols.filter(pl.col("step") == after).drop("step").unique(subset=_KEYS, keep="first"), on=_KEYS, how="inner"
    )
    then = cols.filter(pl.col("step") == before).drop("step", "numel").unique(subset=_KEYS, keep="first")
    both = now.join(then, on=_KEYS, how="inner", suffix="_b")
    if not both.height:
        return None
    numel = both["numel"].cast(pl.Float64).fill_null(1.0).to_numpy()

    def side(prefix: str, suffix: str = "") -> dict[str, np.ndarray]:
        return {s: both[f"{prefix}{s}{suffix}"].cast(pl.Float64).fill_null(np.nan).to_numpy() for s in R.STATS}

    gap = stats_gap(side(""), side("ref_"), numel)
    gap_b = stats_gap(side("", "_b"), side("ref_", "_b"), numel)
    upd = stats_gap(side("ref_"), side("ref_", "_b"), numel)
    rounding = np.array([eps(d or "") for d in both["dtype"].to_list()]) * np.abs(side("ref_", "_b")["norm"])
    changed = _changed_gap(side(""), side("ref_"), side("ref_"), side("ref_", "_b"), numel)
    exact = _exact_update_gap(side(""), side("ref_"), side("", "_b"), side("ref_", "_b"), numel)
    with np.errstate(all="ignore"):
        x = np.where(upd > 0, gap / upd, np.nan)
        x_changed = np.where((upd > 0) & np.isfinite(gap), changed / upd, np.nan)
        x_prev = np.where(upd > 0, gap_b / upd, np.nan)
        x_round = np.where(upd > 0, rounding / upd, np.nan)
    # the changed-parameter rule's units (`corrupted`): the tensor's own norms where both runs sketched it at both
    # steps (every element's gap in every element's update: like with like), else the statistics bounds above
    c_prev, c_round = x_prev, x_round
    sketched = None  # (the reference's update from the sketches, where known) for `held_values`
    if len(sketches) == len(WEIGHT_SKETCH):
        sk_gap, sk_gap_b, sk_upd = _sketch_gaps(both)
        with np.errstate(all="ignore"):
            known = np.isfinite(sk_gap) & np.isfinite(sk_gap_b) & (sk_upd > 0)
            sketched = np.where(known, sk_upd, np.nan)
            x_changed = np.where(known, sk_gap / sk_upd, x_changed)
            c_prev = np.where(known, sk_gap_b / sk_upd, x_prev)
            c_round = np.where(known, rounding / sk_upd, x_round)
    held, held_gap, held_by = held_values(both, side(""), side("ref_"), numel, x_changed, upd, sketched, X_MIN)
    out = both.select(*_KEYS, "_fp_t", "_pkey", "shape", "status").with_columns(
        pl.Series("x", x),
        pl.Series("x_changed", x_changed),
        pl.Series("x_prev", x_prev),
        pl.Series("x_round", x_round),
        pl.Series("xc_prev", c_prev),
        pl.Series("xc_round", c_round),
        pl.Series("x_exact", exact),
        pl.Series("x_held", held),
        pl.Series("held_gap", held_gap),
        pl.Series("_held_by", held_by, dtype=pl.String),
        pl.Series("_numel", numel),
        _module("_record"),
    )
    residue = pl.col("small_value").fill_null(False) if "small_value" in rows.columns else pl.lit(False)
    grads = rows.filter(
        (pl.col("step") == before) & (pl.col("_io") == "parameters_grad") & (pl.col("kind") == "tensor")
    ).select("rank", "source", "_record", "index_path", _own_err(rows).alias("g_prev"), residue.alias("g_residue"))
    grads = grads.with_columns(_module("_record")).drop("_record")
    keys = ["rank", "source", "_module", "index_path"]
    out = out.join(grads.unique(subset=keys, keep="first"), on=keys, how="left", nulls_equal=True)
    api = _input_gradients(rows, before)  # an input no module lists: its consumer's backward output
    if api.height:
        on = ["rank", "source", "_record", "index_path"]
        out = (
            out.join(api, on=on, how="left", nulls_equal=True)
            .with_columns(pl.coalesce("g_prev", "_g_in").alias("g_prev"))
            .drop("_g_in")
        )
    klass = pl.concat_str(
        [
            pl.col("_record").map_elements(lambda r: parse_record(r).op_type, return_dtype=pl.String),
            pl.col("index_path"),
            pl.col("shape").cast(pl.List(pl.String)).list.join("x"),
        ],
        separator="|",
        ignore_nulls=True,
    )
    return out.with_columns(klass.alias("klass"))


def _sketch_gaps(both: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gap at the later step, gap at the earlier, the reference's update) of each row of `table`'s joined
    frame from the weight's sketches (analysis/pairmetrics.py `WEIGHT_SKETCH`; `_b`: the earlier step): the
    sketch is linear and one map for a tensor's shape in every run and step, so the distance of two sketches
    is the tensor's own (exact up to the sketch's M elements, else within sqrt(2/M) relative).  NaN where a
    sketch is missing, of another length or not finite."""
    t, r = WEIGHT_SKETCH
    lists = [both[c].to_list() for c in (t, r, f"{t}_b", f"{r}_b")]
    out = np.full((3, both.height), np.nan)
    for i, (ta, ra, tb, rb) in enumerate(zip(*lists)):
        out[:, i] = (sketch_distance(ta, ra), sketch_distance(tb, rb), sketch_distance(ra, rb))
    return out[0], out[1], out[2]


def _exact_update_gap(
    t: dict[str, np.ndarray],
    r: dict[str, np.ndarray],
    tb: dict[str, np.ndarray],
    rb: dict[str, np.ndarray],
    n: np.ndarray,
) -> np.ndarray:
    """For a tensor of one element, whose statistics are its value (exactly, in either dump mode): how far the
    target's own update (`t` less `tb`: the target at both steps) is from the reference's (`r` less `rb`) or
    from its sign flip, in units of the reference's update.  An optimizer fed gradients that agree computes
    the same update, and one that normalises per element (Adam's first step, Lion, Adafactor's clipped step)
    turns a gradient noise cannot sign into an update of either sign, the same size; nothing else noise does
    moves a scalar's update by a part of itself beyond what its gradient's error explains.  NaN for larger
    tensors and where the reference's update is 0 (nothing to measure in)."""

    def value(s: dict[str, np.ndarray]) -> np.ndarray:
        return np.where(np.isnan(s["mean"]), s["max"], s["mean"])

    with np.errstate(invalid="ignore", divide="ignore"):
        u_t, u_r = value(t) - value(tb), value(r) - value(rb)
        gap = np.fmin(np.abs(u_t - u_r), np.abs(u_t + u_r)) / np.abs(u_r)
    return np.where((n == 1) & (u_r != 0) & np.isfinite(gap), gap, np.nan)


def _own_err(rows: pl.DataFrame) -> pl.Expr:
    """A gradient's relative error in its own norm, what an update fed it carries: where the small-value rule judged
    a sum of K terms on its terms' scale (`judged_norm`: rules.py `small_value_err`, a bias's gradient whose terms
    cancel), err x judged_norm / ref_norm undoes that scale.  The op that summed is judged on the terms' scale (it
    added no more than their rounding), but the update moves by the gradient's own relative error (SGD: lr x its
    difference; Adam and its kin divide each element by its own size), so the parameter's gap is explained in
    those units."""
    err = pl.col("err").cast(pl.Float64)
    if "judged_norm" not in rows.columns:
        return err
    judged = pl.col("judged_norm").cast(pl.Float64)
    return pl.when(judged.is_not_null()).then(err * judged / pl.col("ref_norm").cast(pl.Float64)).otherwise(err)


def _input_gradients(rows: pl.DataFrame, step: int) -> pl.DataFrame:
    """The relative error of the gradient of each one-element tensor input of an API record at `step` (rank,
    source, forward `_record`, `index_path`, `_g_in`): the k-th output of the record's backward is the gradient
    of its k-th tensor input (msprobe's order; non-tensor arguments have none), taken where its shape is the
    input's.  For a parameter no module lists (no `parameters_grad` leaf); read by several ops, each backward
    holds one part of its gradient, and the first consumer's part is taken."""
    at = rows.filter(pl.col("step") == step)
    ins = at.filter(
        (pl.col("_io") == "input") & (pl.col("kind") == "tensor") & ~pl.col("index_path").str.contains(r"\.")
    ).select("rank", "source", "_record", "index_path", "numel", pl.col("shape").cast(pl.List(pl.String)))
    if not ins.height:
        return pl.DataFrame()
    ins = ins.with_columns(pl.col("index_path").cast(pl.Int64, strict=False).alias("_i")).drop_nulls("_i")
    ins = ins.sort("_i").with_columns(pl.col("_i").rank("ordinal").over("rank", "source", "_record").alias("_k"))
    ins = ins.filter(pl.col("numel") == 1)
    outs = at.filter((pl.col("_io") == "output") & (pl.col("kind") == "tensor")).select(
        "rank",
        "source",
        pl.col("_record").str.replace(r"\.backward$", ".forward").alias("_record"),
        (pl.col("index_path").cast(pl.Int64, strict=False) + 1).cast(pl.UInt32).alias("_k"),
        pl.col("shape").cast(pl.List(pl.String)).alias("_shape_g"),
        pl.col("err").alias("_g_in"),
        pl.col("_record").str.ends_with(".backward").alias("_bwd"),
    )
    outs = outs.filter(pl.col("_bwd")).drop("_bwd")
    got = ins.join(outs, on=["rank", "source", "_record", "_k"], how="inner", nulls_equal=True)
    got = got.filter(pl.col("shape") == pl.col("_shape_g"))
    return got.select("rank", "source", "_record", "index_path", "_g_in").unique(
        subset=["rank", "source", "_record", "index_path"], keep="first"
    )


def _module(col: str) -> pl.Expr:
    """The module (or API) a record belongs to: its prefix and api (a module's forward and parameters_grad
    records share them)."""
    return pl.col(col).map_elements(lambda r: ".".join(parse_record(r)[:2]), return_dtype=pl.String).alias("_module")


def _explained(t: pl.DataFrame, units: str = "x") -> np.ndarray:
    """max(x_prev, g_prev, x_round) per parameter (NaN where none is known); `units` "xc": x_prev and x_round in
    the changed-parameter rule's units (`xc_prev`, `xc_round`: the sketches' where `table` had them)."""
    cols = [_column(t, c, units) for c in ("x_prev", "g_prev", "x_round")]
    return np.fmax(np.fmax(cols[0], cols[1]), cols[2])


def _column(t: pl.DataFrame, name: str, units: str = "x") -> np.ndarray:
    """Column `name` of a parameter table as floats (NaN for null); x_prev and x_round in the changed-parameter
    rule's units where `units` is "xc" and the table has them."""
    if units == "xc" and name in ("x_prev", "x_round") and f"xc_{name[2:]}" in t.columns:
        name = f"xc_{name[2:]}"
    return t[name].cast(pl.Float64).fill_null(np.nan).to_numpy()


def _beyond(t: pl.DataFrame, col: str = "x") -> np.ndarray:
    """x (or `col`) > STAND_OUT x what the update was fed, carried in, or one rounding of the parameter explains
    (for `x_changed`, in the changed-parameter rule's units)."""
    x = t[col].fill_null(np.nan).to_numpy()
    expl = _explained(t, "xc" if col == "x_changed" else "x")
    with np.errstate(invalid="ignore"):
        return np.isfinite(x) & (x > STAND_OUT * np.nan_to_num(expl, nan=0.0))


def corrupted(t: pl.DataFrame | None) -> dict[int, dict[str, Any]]:
    """The parameters changed between the steps (see the module's docstring), by parameter key (its target and
    reference fingerprints, analysis/param_change.py; the target's alone in a table without `_pkey`), each with
    its evidence."""
    if t is None or not t.height:
        return {}
    x = t["x_changed"].fill_null(np.nan).to_numpy()  # the gap a change shows, in updates
    klass = t["klass"].to_list()
    pkeys = PC.table_keys(t)
    owner = _owners(t)  # another layer, or the same on another rank; not another call of the same module
    expl = _explained(t, "xc")
    over = (t["status"] == "diverged").to_numpy()
    x_prev = np.nan_to_num(_column(t, "x_prev", "xc"), nan=0.0)
    # a parameter whose gradient at `before` is rounding residue (judged on its record's scale: rules.py
    # `small_value_err`) was fed a gradient whose relative error nothing bounds (1e-9 in one run, 1e-6 in the
    # other): its update is no unit the two runs share, and its x says nothing
    residue = t["g_residue"].fill_null(False).to_numpy() if "g_residue" in t.columns else np.zeros(t.height, bool)
    # two parameters holding each other's values (analysis/param_gaps.py): noise moves a tensor about its own
    # reference value, not onto another tensor's, so neither its explanation nor its tolerance is the unit, and its
    # partner is no sibling showing the optimizer's noise
    held = _column(t, "x_held") if "x_held" in t.columns else np.full(t.height, np.nan)
    held_by = t["_held_by"].to_list() if "_held_by" in t.columns else [None] * t.height
    with np.errstate(invalid="ignore"):
        swapped = held > STAND_OUT  # (NaN: no partner)
    beyond = (_beyond(t, "x_changed") | swapped) & ~residue
    # every other parameter of the step within STAND_OUT x (what it carried in + one rounding of itself): the runs
    # computed the same updates, none moved by noise that a per-element normalisation could flip
    x_round = np.nan_to_num(_column(t, "x_round", "xc"), nan=0.0)
    n_el = (
        t["_numel"].cast(pl.Float64).fill_null(np.inf).to_numpy() if "_numel" in t.columns else np.full(len(x), np.inf)
    )
    with np.errstate(invalid="ignore"):
        moved = np.isfinite(x) & (x > STAND_OUT * (x_prev + x_round))
        # only a parameter whose bar is under X_MIN can show that the updates agreed: where one rounding of it is a
        # third of an update or more (a bf16 weight whose update is under its ulp), "within rounding" says nothing
        # (one that moved beyond its bar shows the opposite whatever its bar)
        shows = np.isfinite(x) & ((STAND_OUT * (x_prev + x_round) < X_MIN) | moved)
    off = PC.others_count(moved, shows, owner, MIN_MEASURED)
    # a one-element tensor: its own update measured exactly, against the reference's and its sign flip
    x_exact = (
        t["x_exact"].cast(pl.Float64).fill_null(np.nan).to_numpy()
        if "x_exact" in t.columns
        else np.full(len(x), np.nan)
    )
    with np.errstate(invalid="ignore"):
        apart = x > STAND_OUT * (UPDATES_APART + x_prev)  # beyond what any two updates can put between the runs
        # and beyond one element's update reversed: an optimizer that normalises per element (Adam's first step,
        # Lion) moves every element by the same size, ||u|| / sqrt(n), and turns an element whose gradient is
        # noise-level into an update of either sign, UPDATES_APART / sqrt(n) of an update apart; the other
        # parameters' agreement cannot rule that out (gradient statistics rounded to bf16 that agree do not say
        # every element does)
        agree = (x >= X_MIN) & (off == 0) & (x > STAND_OUT * UPDATES_APART / np.sqrt(np.fmax(n_el, 1.0)))
        exact = (x_exact >= X_MIN) & (x_exact > STAND_OUT * np.nan_to_num(expl, nan=0.0))
    # a one-element parameter's own update is known: that, not its tolerance or the two-update bound, decides
    flagged = np.where(np.isfinite(x_exact), exact, over | apart | agree | swapped)
    out: dict[int, dict[str, Any]] = {}
    for i in np.flatnonzero(beyond & flagged):
        if np.isfinite(x_exact[i]):  # judged on its own update: against other scalars' (siblings first), if any
            kin, sx = _exact_peers(int(i), x_exact, klass, owner)
            if sx.size and not x_exact[i] > STAND_OUT * float(sx.max()):
                continue
        else:
            partner = held_by[i] if swapped[i] else None  # (its swap's other half: not its noise)
            sib = [
                j
                for j in range(t.height)
                if klass[j] == klass[i] and owner[j] != owner[i] and (partner is None or f"{pkeys[j]}" != partner)
            ]
            sx = x[sib][np.isfinite(x[sib])] if sib else np.zeros(0)
            kin = "siblings"
            if not sx.size:  # no tensor of its kind: every other parameter of the step
                kin, sx = "parameters", x[[j for j in range(t.height) if owner[j] != owner[i] and np.isfinite(x[j])]]
            if not sx.size or not x[i] > STAND_OUT * float(sx.max()):
                continue  # within the optimizer's noise on its kind of tensor (or, without any, on any)
        fp = pkeys[int(i)]
        if fp is None:
            continue
        out[int(fp)] = {
            "update_units": float(x[i]),
            "carried_in": None if not np.isfinite(expl[i]) else float(expl[i]),
            "judged_against": kin,
            "siblings": len(sx),
            "siblings_max": float(sx.max()) if sx.size else 0.0,
        }
        if np.isfinite(x_exact[i]):
            out[int(fp)]["own_update_off"] = float(x_exact[i])
        elif swapped[i]:  # holds another parameter's values, and that one its
            out[int(fp)]["holds"] = _held_name(t, held_by[i])
            out[int(fp)]["holds_gap"] = float(_column(t, "held_gap")[i])
        elif not (over[i] or apart[i]):  # within its tolerance and two updates: the step's updates agree
            out[int(fp)]["step_agrees"] = True
        if not x[i] >= X_MIN:  # under a quarter of an update: named only where its consumer confirms it
            out[int(fp)]["needs_consumer"] = True
    return out


def _held_name(t: pl.DataFrame, key: str | None) -> str:
    """The parameter whose key (as a string) is `key`: its record and name (`Module.l1.up.Linear.forward.0
    weight`), the module's call counter kept."""
    for rec, name, k in t.select("_record", "index_path", "_pkey").iter_rows():
        if f"{k}" == key:
            return f"{rec} {name}"
    return "another parameter"


def _exact_peers(i: int, x_exact: np.ndarray, klass: list, owner: list) -> tuple[str, np.ndarray]:
    """The `x_exact` of the other one-element parameters to judge row `i` against: its siblings (same class,
    name and shape, another tensor) where measured, else every other one-element parameter; none: judged on its
    own measure (its update against its gradient's error: `corrupted`)."""
    others = [j for j in range(len(x_exact)) if owner[j] != owner[i] and np.isfinite(x_exact[j])]
    sib = [j for j in others if klass[j] == klass[i]]
    if sib:
        return "siblings", x_exact[sib]
    return "parameters", x_exact[others]


def _owners(t: pl.DataFrame) -> list[tuple]:
    """Which tensor each row is, for the sibling test: the same parameter read by several calls of its module
    (micro-batches: `fc1.Linear.forward.0` and `.forward.1`) is one tensor, not its own sibling.  A module
    record names its module without the call counter; an API record (no module records: the parameter is a
    tensor input that requires grad) is its own; the rank and the parameter key (its target and reference
    fingerprints: two layers equal in the target are two tensors) join them."""
    recs = [without_module_call(r) for r in t["_record"].to_list()]
    fps = PC.table_keys(t)
    ranks = t["rank"].to_list()
    first: dict[tuple, tuple] = {}
    out = []
    for rec, fp, rank in zip(recs, fps, ranks):
        key = (rec, rank)
        if fp is not None:  # one parameter key on one rank: one tensor, whatever record reads it
            key = first.setdefault((fp, rank), key)
        out.append(key)
    return out


def gradient_error(rows: pl.DataFrame, step: int) -> float:
    """The median relative error of the parameters' gradients (`parameters_grad` tensor leaves) at `step`; 0
    where the dump has none."""
    err = rows.filter((pl.col("step") == step) & (pl.col("_io") == "parameters_grad") & (pl.col("kind") == "tensor"))[
        "err"
    ]
    g = err.cast(pl.Float64).drop_nulls().drop_nans().to_numpy()
    g = g[np.isfinite(g)]
    return median(g) if g.size else 0.0


def decay_differs(rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame) -> dict[str, Any] | None:
    """Evidence that the parameters' norms moved apart by one common relative amount between steps `before` and
    `after` (see the module's docstring); None when they did not.  `params`: the parameter leaves of step
    `after` (`parameters_of`)."""
    a = rows.filter(pl.col("step") == after).join(params.select(_KEYS), on=_KEYS, how="semi")
    b = rows.filter(pl.col("step") == before).select(*_KEYS, "norm", "ref_norm").unique(subset=_KEYS, keep="first")
    both = (
        a.select(*_KEYS, "norm", "ref_norm", "dtype").unique(subset=_KEYS, keep="first").join(b, on=_KEYS, suffix="_b")
    )
    if both.height < OPT_MIN_PARAMS:
        return None
    t, r, tb, rb = (
        both[c].cast(pl.Float64).fill_null(np.nan).to_numpy() for c in ("norm", "ref_norm", "norm_b", "ref_norm_b")
    )
    with np.errstate(all="ignore"):
        d = (t - r) / r - (tb - rb) / rb
    ok = np.isfinite(d) & (r > 0) & (rb > 0)
    if ok.sum() < OPT_MIN_PARAMS:
        return None
    d = d[ok]
    med = median(d)
    spread = 1.4826 * median(np.abs(d - med))  # robust sigma across the parameters
    se = 1.2533 * spread / np.sqrt(d.size)  # standard error of their median
    floor = STAND_OUT * max(eps(x or "") for x in np.array(both["dtype"].to_list(), dtype=object)[ok])
    bar = float(max(OPT_Z * se, floor))
    same_way = int((np.sign(d) == np.sign(med)).sum()) if med else 0
    if not abs(med) > bar or same_way < OPT_SHARE * d.size:
        return None
    return {"parameters": int(d.size), "median_norm_gap": med, "same_way": same_way, "spread": spread, "bar": bar}


def update_differs(t: pl.DataFrame | None, floor: float = UPDATE_X_MIN) -> dict[str, Any] | None:
    """Evidence that every parameter moved otherwise than its gradient explains, by a median x of at least `floor`
    (analysis/updates.py `update_floor`); None when it did not."""
    if t is None:
        return None
    x = t["x"].fill_null(np.nan).to_numpy()
    measured = np.isfinite(x)
    if measured.sum() < MIN_MEASURED:
        return None
    beyond = _beyond(t)
    if not float(beyond[measured].mean()) > UPDATE_SHARE or not median(x[measured]) >= floor:
        return None
    return {
        "parameters": int(measured.sum()),
        "unexplained": int(beyond[measured].sum()),
        "median_update_units": float(median(x[measured])),
        "median_carried_in": float(median(np.nan_to_num(_explained(t)[measured], nan=0.0))),
    }


def over_explanation(t: pl.DataFrame) -> float:
    """The median over the measured parameters of `t` of x / its explanation max(x_prev, g_prev, x_round) (inf
    where nothing explains a gap: a parameter that agreed, was fed agreeing gradients and has no rounding of its
    own); NaN with none measured."""
    x = t["x"].fill_null(np.nan).to_numpy()
    expl = np.nan_to_num(_explained(t), nan=0.0)
    measured = np.isfinite(x)
    if not measured.any():
        return float("nan")
    with np.errstate(all="ignore"):
        ratio = np.where(expl > 0, x / expl, np.where(x > 0, np.inf, 0.0))
    return float(median(ratio[measured]))

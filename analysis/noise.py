"""The noise model of a pair, measured from the pair itself, and the optimizer-update evidence between steps.

Two correct runs on different devices differ by rounding noise on every op, and from step 1 on also by the
noise the optimizer carried into the weights.  A verdict names an op only when it stands out of that noise:

  fresh ops      (inputs agree: input error <= QUIET x tolerance) create error of their own; the noise is the
                 spread of the output errors of the pair's fresh ops of the same step and direction;
  carrying ops   (inputs already differ) pass error on; the noise is the spread of their amplification, output
                 error / max(input error, eps of the judged dtype).
An op stands out when its measure exceeds STAND_OUT x the high quantile (QUANTILE) of the same measure over the
ops of its direction that ran before it (earlier steps included): the noise the pair showed before, which the
op's own downstream cannot inflate; and the fixed floors: the tolerance for fresh ops,
`Tolerances.amplification` for carrying ops.

The optimizer: when the parameters differ at step s+1, the update between s and s+1 is the culprit when the
runs moved their parameters by different amounts consistently (`update_evidence`), judged against the update
ratios' own spread across parameters, not a dtype tolerance: the median log ratio of update sizes (target /
reference) is off 0 by more than OPT_Z standard errors of that median (1.2533 x the robust sigma 1.4826 x MAD
/ sqrt(n)) and by more than OPT_FLOOR, and at least OPT_SHARE of the parameters moved the same way.  A learning
rate or clipping change moves every parameter by the same factor (spread ~0); device noise moves them by
scattered factors around 1.  The rule runs at the start of each later step, before that step's other rules.
Update sizes come from the statistics of both steps (a lower bound of ||p(s+1) - p(s)|| by `rules.stats_bound`),
so the rule holds in statistics and tensor mode alike.
A change that does not scale every update alike (clipping under Adam), and a parameter changed between steps,
are judged in units of each parameter's own update by analysis/steps.py.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from . import rules as R
from .conditioning import RESULT_GAIN, result_gain

QUIET = 0.1  # inputs "agree" when their error is below this share of the tolerance
QUANTILE = 0.99  # the high quantile of the pair's own spread
STAND_OUT = 3.0  # a culprit's measure exceeds this multiple of that quantile
MIN_GROUP = 4  # fewer ops than this in a group: only the fixed floors apply
SIBLING_Q = 0.75  # siblings: the quantile of their own error a candidate must stand STAND_OUT x above ...
MIN_SIBLINGS = 3  # ... of at least this many (2 layers x 3 steps give a record 3 siblings)
OPT_Z = 4.0  # optimizer: the median log update ratio off 0 by more than this many standard errors ...
OPT_FLOOR = 2.0**-10  # ... and by more than this (0.1 %: far below a fault of 1 %, above float32 rounding) ...
OPT_SHARE = 0.75  # ... with at least this share of the parameters moved the same way
OPT_MIN_PARAMS = 3
HIDDEN = 2.0  # a statistics bound b can hide a difference of relative size sqrt(HIDDEN x b) (statistics_hidden)
KINK = 2.0  # a kinked op's backward passes on up to sqrt(KINK x e) from an input error e (record_measures)
# elementwise ops whose derivative jumps (at 0, or at their clamp bounds): rounding of the forward input flips
# which side of the kink a few elements fall on, and each such element passes its full gradient or none
KINKED = frozenset(
    {
        "relu",
        "relu6",
        "leaky_relu",
        "prelu",
        "rrelu",
        "hardtanh",
        "threshold",
        "clamp",
        "clip",
        "clamp_min",
        "clamp_max",
        "abs",
        "hardswish",
        "hardsigmoid",
        "hardshrink",
        "softshrink",
        "maximum",
        "minimum",
        "fmax",
        "fmin",
    }
)


@dataclass
class NoiseModel:
    """Per direction, the fresh ops' output errors and the carrying ops' amplifications, in execution order
    (step, phase, rank, source, seq): the baseline of an op is what the pair showed before it."""

    fresh: dict[str, tuple[list[tuple], np.ndarray]]
    carry: dict[str, tuple[list[tuple], np.ndarray]]
    outputs: tuple[list[tuple], np.ndarray] = ([], np.zeros(0))  # every record's output error, all directions
    output_norms: np.ndarray = field(default_factory=lambda: np.zeros(0))  # ... and its reference norm (or NaN)
    flips: list[dict[str, Any]] = field(default_factory=list)  # discrete outputs flipped on near ties (noise)
    # inputs whose dtype differs as the recorded op's output they carry (analysis/carried_dtype.py): notes
    carried_dtypes: list[dict[str, Any]] = field(default_factory=list)
    flip_marks: list[tuple[tuple, frozenset]] = field(default_factory=list)  # their order keys, enclosing modules
    possible_flips: Any = None  # flips the statistics cannot show (analysis/flipflow.py PossibleFlips)
    flip_explained: set[tuple] = field(default_factory=set)  # order keys of the flips and of what they explained
    _explained: dict[tuple[bool, str], np.ndarray] = field(default_factory=dict)  # ... as masks of fresh / carry
    _output_ranks: np.ndarray | None = None  # the rank of each of `outputs` (analysis/flipflow.py), on first use

    def output_ranks(self) -> np.ndarray:
        if self._output_ranks is None:
            self._output_ranks = np.array([k[2] for k in self.outputs[0]], dtype=np.int64)
        return self._output_ranks

    siblings: dict[tuple[str, str], tuple[list[str], np.ndarray]] = field(default_factory=dict)  # per class

    @classmethod
    def fit(cls, recs: pl.DataFrame) -> NoiseModel:
        """From the record table (one row per record pair, in execution order: out_err, amp, fresh)."""
        norm = pl.col("out_norm").cast(pl.Float64) if "out_norm" in recs.columns else pl.lit(None, pl.Float64)
        ok = recs.filter(pl.col("out_err").is_not_null() & pl.col("out_err").is_finite()).select(
            "step",
            "_phase",
            "rank",
            pl.col("source").fill_null(""),
            "_seq",
            "_direction",
            "out_err",
            "amp",
            pl.col("fresh").fill_null(False),
            norm.fill_null(float("nan")).alias("out_norm"),
        )
        carrying = ~pl.col("fresh") & pl.col("amp").is_not_null() & pl.col("amp").is_finite()
        every = _by_direction(ok.with_columns(pl.lit("all").alias("_direction")), "out_err").get("all")
        norms = _by_direction(ok.with_columns(pl.lit("all").alias("_direction")), "out_norm").get("all")
        siblings: dict[tuple[str, str], tuple[list[str], np.ndarray]] = {}
        if {"local", "op_class", "_record"} <= set(recs.columns):  # (a record table of record_measures)
            sib = recs.filter(pl.col("local").is_finite() & pl.col("op_class").is_not_null())
            for (op_class, direction), part in sib.partition_by(["op_class", "_direction"], as_dict=True).items():
                siblings[(str(op_class), str(direction))] = (part["_record"].to_list(), part["local"].to_numpy())
        return cls(
            _by_direction(ok.filter(pl.col("fresh")), "out_err"),
            _by_direction(ok.filter(carrying), "amp"),
            every or ([], np.zeros(0)),
            output_norms=norms[1] if norms else np.zeros(0),
            siblings=siblings,
        )

    def sibling_bar(self, rec: dict[str, Any]) -> float | None:
        """STAND_OUT x the SIBLING_Q quantile of the error the same op class made in the same direction at other
        positions (records of another name: other layers; its own name at other steps is not a sibling, a fault
        there repeats every step).  None: fewer than MIN_SIBLINGS siblings.  A fault in one layer stands out of
        its siblings; a device's rounding of the class does not."""
        names, local = self.siblings.get((str(rec.get("op_class")), str(rec.get("_direction"))), ([], np.zeros(0)))
        if not names:
            return None
        other = local[np.array([n != rec["_record"] for n in names], dtype=bool)]
        if other.size < MIN_SIBLINGS:
            return None
        return STAND_OUT * float(quantile(other, SIBLING_Q))

    def carried(self, before: tuple) -> float | None:
        """STAND_OUT x the QUANTILE of the output errors of every record before `before` (any direction): the
        error the pair carries at that point, against which a tensor no recorded op produced is judged (a
        gradient reaching an op through ops msprobe does not record), near-tie flips and what they explained
        left out.  None: fewer than MIN_GROUP records."""
        keys, values = self.outputs
        n = bisect.bisect_left(keys, before)
        seen = values[:n]
        if self.flip_explained:  # a near-tie flip and what it explained are the flip's, not the pair's noise
            seen = seen[np.array([k not in self.flip_explained for k in keys[:n]], dtype=bool)]
        if seen.size < MIN_GROUP:
            return None
        return STAND_OUT * float(quantile(seen, QUANTILE))

    def bar(self, direction: str, fresh: bool, before: tuple) -> float | None:
        """STAND_OUT x the QUANTILE of the measure over the ops of `direction` before `before` in execution
        order (None: fewer than MIN_GROUP of them)."""
        keys, values = (self.fresh if fresh else self.carry).get(direction, ([], np.zeros(0)))
        n = bisect.bisect_left(keys, before)
        mask = self._explained.get((fresh, direction))
        seen = values[:n] if mask is None else values[:n][~mask[:n]]
        if seen.size < MIN_GROUP:
            return None
        return STAND_OUT * float(quantile(seen, QUANTILE))

    def explain(self, key: tuple) -> None:
        """Leave the record at `key` out of the baselines of the ops after it: a near-tie flip, or what it made
        (analysis/flipflow.py), is the flip's own, not the pair's noise."""
        self.flip_explained.add(key)
        for fresh, groups in ((True, self.fresh), (False, self.carry)):
            for direction, (keys, _) in groups.items():
                at = bisect.bisect_left(keys, key)
                if at < len(keys) and keys[at] == key:
                    mask = self._explained.setdefault((fresh, direction), np.zeros(len(keys), dtype=bool))
                    mask[at] = True

    def summary(self, recs: pl.DataFrame) -> dict[str, Any]:
        """The largest amplification among the pair's ops and where, with the quantile of the ops of its step and
        rank (what a verdict computed a step at a time sees too)."""
        ok = recs.filter(pl.col("amp").is_not_null() & pl.col("amp").is_finite() & ~pl.col("fresh"))
        out: dict[str, Any] = {"quantile": QUANTILE, "stand_out": STAND_OUT}
        if self.flips:
            out["discrete_flips"] = list(self.flips)
        if self.carried_dtypes:
            out["carried_dtypes"] = list(self.carried_dtypes)
        if ok.height:
            top = ok.sort("amp", descending=True).row(0, named=True)
            out |= {
                "largest_amplification": float(top["amp"]),
                "step": top["step"],
                "rank": top["rank"],
                "op": top["_record"],
                "amplification_quantile": float(
                    ok.filter((pl.col("step") == top["step"]) & (pl.col("rank") == top["rank"]))["amp"].quantile(
                        QUANTILE
                    )
                    or 0.0
                ),
            }
        return out


def quantile(values: np.ndarray, q: float) -> float:
    """numpy's default (linear) quantile of a non-empty array, by a sort (np.quantile and np.median import
    numpy.ma, which the command line's light answers must not load)."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    pos = q * (v.size - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, v.size - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def median(values: np.ndarray) -> float:
    return quantile(values, 0.5)


def order_key(row: dict[str, Any]) -> tuple:
    """A record's place in execution order: step, phase, rank, source, seq."""
    return (row["step"], row["_phase"], row["rank"], row["source"] or "", row["_seq"])


_ORDER = ["step", "_phase", "rank", "source", "_seq"]  # order_key's columns


def _by_direction(rows: pl.DataFrame, measure: str) -> dict[str, tuple[list[tuple], np.ndarray]]:
    """Per direction, the rows' order keys sorted (stably, as `sorted` orders the tuples) and their `measure` in
    that order."""
    out = {}
    ordered = rows.sort(_ORDER, maintain_order=True)
    for (direction,), part in ordered.partition_by("_direction", maintain_order=True, as_dict=True).items():
        keys = list(zip(*(part[c].to_list() for c in _ORDER)))  # a third of the time of part.rows()
        out[direction] = (keys, part[measure].cast(pl.Float64).to_numpy())
    return out


# ops whose backward computes from their forward's result (PyTorch's derivative formulas use `result`): exp's
# gradient is grad x exp(x), rsqrt's -grad x result^3 / 2, softmax's from the probabilities, relu's mask from the
# result; their backward reads the forward's output, so its input error is at least that output's error
SAVES_RESULT = frozenset(
    {"exp", "exp2", "expm1", "sigmoid", "tanh", "rsqrt", "sqrt", "reciprocal", "softmax", "log_softmax", "relu"}
)


def saves_result(op_class: pl.Expr) -> pl.Expr:
    """Whether a record's op class computes its backward from its forward's result (SAVES_RESULT)."""
    return op_class.str.split(".").list.last().str.strip_chars("_").is_in(list(SAVES_RESULT)).fill_null(False)


def is_kinked(op_class: pl.Expr) -> pl.Expr:
    """Whether a record's op class (`prefix.op_type`) is a kinked elementwise op (KINKED; in-place `relu_` too)."""
    return op_class.str.split(".").list.last().str.strip_chars("_").is_in(list(KINKED)).fill_null(False)


def statistics_hidden(rec: dict[str, Any], conditioned: bool = True) -> float | None:
    """What a record's inputs compared by their statistics can hide, carried to its output: sqrt(HIDDEN x b) x
    the conditioning max(1, |x| / |y|), for an input bound b.  Noise uncorrelated with the values moves a
    tensor's norm only at second order (|y + d| = |y| sqrt(1 + delta^2) ~ |y| (1 + delta^2 / 2)), and its mean,
    max and min barely, so a bound b can stand for a relative difference up to sqrt(2 b) (as in
    analysis/hidden_index.py).  `conditioned=False`: without the conditioning (a fresh op's, culprit._fresh).
    None: the inputs are not statistics bounds."""
    b = rec.get("in_err")
    if not rec.get("in_bound") or b is None or not np.isfinite(b) or b <= 0:
        return None
    kappa = 1.0
    x, y = rec.get("in_norm"), rec.get("out_norm")
    if conditioned and x is not None and y is not None and np.isfinite(x) and np.isfinite(y) and y > 0:
        kappa = max(1.0, x / y)
    return float(np.sqrt(HIDDEN * b) * kappa)


def parameter_error(tensor: pl.Expr) -> pl.Expr:
    """Record-table aggregation (analysis/_divergence.py): `param_err`, the largest error of the parameters a
    record lists (msprobe's mix level lists them in a leaf module's forward record: a Linear's weight and bias)."""
    return pl.col("err").filter((pl.col("_io") == "parameters") & tensor).max().alias("param_err")


def gain_columns(is_in: pl.Expr, is_out: pl.Expr, tensor: pl.Expr, columns: list[str]) -> list[pl.Expr]:
    """Record-table aggregations (analysis/_divergence.py `_record_table`) for `with_result_gain`: `in_abs`, the
    absolute error ||x - y|| of the worst tensor input (err x its reference norm; for a small value, judged on its
    record's scale by rules.apply_small_values, err x sqrt(n) x that scale), and `res_lo`, `res_hi`, the reference
    min and max of the first tensor output."""
    scale = pl.col("ref_norm").cast(pl.Float64)
    if {"small_value", "context_rms", "ref_numel"} <= set(columns):
        on_context = pl.col("ref_numel").cast(pl.Float64).sqrt() * pl.col("context_rms").cast(pl.Float64)
        scale = pl.when(pl.col("small_value").fill_null(False)).then(on_context).otherwise(scale)
    where = is_in & tensor
    return [
        (pl.col("err") * scale).filter(where).sort_by(pl.col("err").filter(where)).last().alias("in_abs"),
        pl.col("ref_min").cast(pl.Float64).filter(is_out & tensor).first().alias("res_lo"),
        pl.col("ref_max").cast(pl.Float64).filter(is_out & tensor).first().alias("res_hi"),
    ]


def with_result_gain(recs: pl.DataFrame) -> pl.DataFrame:
    """Add `gain` to the backward records of elementwise ops whose derivative is a function of their result
    (prior.RESULT_GAIN: rsqrt, reciprocal, exp, sqrt, sigmoid, tanh): max |f'| over the range of their forward
    record's result (`res_lo`, `res_hi`); null elsewhere."""
    if not {"res_lo", "res_hi", "op_class"} <= set(recs.columns):
        return recs.with_columns(pl.lit(None, pl.Float64).alias("gain"))
    keys = ["step", "rank", "source"]
    op = pl.col("op_class").str.split(".").list.last().str.strip_chars("_").str.to_lowercase()
    fwd = recs.filter(pl.col("_record").str.ends_with(".forward") & op.is_in(list(RESULT_GAIN))).select(
        *keys,
        pl.col("_record").str.replace(r"\.forward$", ".backward"),
        "op_class",
        "res_lo",
        "res_hi",
    )
    gains = [result_gain(*r) for r in fwd.select("op_class", "res_lo", "res_hi").iter_rows()]
    fwd = fwd.select(*keys, "_record", pl.Series("gain", gains, dtype=pl.Float64))
    return recs.join(fwd, on=[*keys, "_record"], how="left", nulls_equal=True, maintain_order="left")


def record_measures(recs: pl.DataFrame) -> pl.DataFrame:
    """Add `fresh` (inputs agree) and `amp` (output error / max(input error, eps)) to a record table."""
    recs = with_result_gain(recs)
    floor = R.dtype_eps(pl.col("tol_dtype")).fill_null(R.EPS_FLOAT32)
    in_err = pl.col("in_err").fill_null(0.0)
    # a gradient record without inputs (msprobe's parameters_grad) carries its backward op's error: not fresh
    no_inputs = pl.col("in_err").is_null() & (pl.col("_direction") != "forward")
    # conditioning: an input error e on a tensor of norm |x| is an output error of about e |x| / |y| when the op
    # passes it on unchanged in absolute size (a sum with cancellation: the bias gradient of a logit layer)
    kappa = pl.max_horizontal(pl.col("in_norm") / pl.col("out_norm"), pl.lit(1.0)).fill_nan(1.0).fill_null(1.0)
    kappa = pl.when(kappa.is_finite()).then(kappa).otherwise(1.0)
    kinked = pl.lit(False)
    if "op_class" in recs.columns:
        # a kinked op's backward (relu: the gradient passes where the forward input was > 0): an input error e
        # moves a share ~e of the elements across the kink, each passing its full gradient or none, a relative
        # difference ~sqrt(e) of the output (docs/how-it-decides.md, section 2)
        kinked = is_kinked(pl.col("op_class")) & (pl.col("_direction") == "backward")
    carried = _carried(in_err, kappa, kinked)
    if "in_abs" in recs.columns:
        # the backward of an op whose gain f'(r) varies over the tensor (prior.RESULT_GAIN): an absolute input error
        # ||d|| reaches the output as up to max|f'| x ||d||, relative to the output's norm
        gained = pl.col("gain") * pl.col("in_abs").fill_null(0.0) / pl.col("out_norm")
        gained = pl.when(gained.is_finite() & (pl.col("_direction") == "backward")).then(gained).otherwise(0.0)
        carried = pl.max_horizontal(carried, gained.fill_null(0.0))
    if {"saved_err", "_module"} <= set(recs.columns):
        # a module's backward reads, through the records inside it, what they saved in the forward (a ReLU's
        # input, a norm's statistics), and its forward the parameters of the modules inside it (a decoder layer's
        # linears' weights, which differ by the updates' noise from step 1 on), neither of which its own record
        # lists: it carries what they carry from them
        read = pl.col("saved_err").fill_null(0.0)
        if "param_err" in recs.columns:
            read = pl.max_horizontal(read, pl.col("param_err").fill_null(0.0))
        recs = recs.with_columns(_carried(read, kappa, kinked).alias("_saved"))
        recs = recs.with_columns(pl.Series("_inner", module_inner_saved(recs), dtype=pl.Float64)).drop("_saved")
        carried = pl.max_horizontal(carried, pl.col("_inner"))
    fresh = (carried <= QUIET * pl.col("tol").fill_null(0.0)) & ~no_inputs
    return recs.with_columns(
        fresh.alias("fresh"),
        pl.when(no_inputs).then(None).otherwise(pl.col("out_err") / pl.max_horizontal(carried, floor)).alias("amp"),
        # the error the op made itself: its output error beyond what its inputs carried in
        pl.when(no_inputs)
        .then(None)
        .when(fresh)
        .then(pl.col("out_err"))
        .otherwise(pl.max_horizontal(pl.col("out_err") - carried, pl.lit(0.0)))
        .alias("local"),
    ).drop("_inner", "gain", strict=False)


def _carried(err: pl.Expr, kappa: pl.Expr, kinked: pl.Expr) -> pl.Expr:
    """The output error an input error `err` explains: err x the conditioning kappa, and for a kinked op's backward
    at least sqrt(KINK x err) (the elements the error moves across the kink)."""
    return pl.when(kinked).then(pl.max_horizontal(err * kappa, (KINK * err).sqrt())).otherwise(err * kappa)


def module_inner_saved(recs: pl.DataFrame) -> list[float]:
    """Per record: the most that a record inside it (a module record's own ops and nested modules, by msprobe's
    `module` of each record: `_module`) carries from what it saved in the forward (`_saved`); 0 for a record with
    nothing inside.  A backward record's module is the module's backward record, so this stays in its direction."""
    # the columns as lists: iterating a Series yields its values one by one (a few times slower)
    keys = list(zip(*(recs[c].to_list() for c in ("step", "rank", "source", "_record"))))
    parent = dict(zip(keys, recs["_module"].to_list()))
    best: dict[tuple, float] = {}
    for key, value in zip(keys, recs["_saved"].to_list()):
        if value is None or not value > 0:
            continue
        seen: set[str] = set()
        m = parent.get(key)
        while m is not None and m not in seen:
            seen.add(m)
            up = (key[0], key[1], key[2], m)
            best[up] = max(best.get(up, 0.0), float(value))
            m = parent.get(up)
    return [best.get(k, 0.0) for k in keys]


def update_evidence(
    rows: pl.DataFrame, before: int, after: int, params: pl.DataFrame, gradient_error: float = 0.0
) -> dict[str, Any] | None:
    """Update sizes of the parameters between steps `before` and `after`, target against reference.

    `params`: the parameter leaves (step, rank, source, _record, _io, index_path) of step `after`; the same
    leaves of step `before` are looked up by (rank, source, record, io, index path).  `gradient_error`: the
    median relative error of the gradients the updates were computed from; a common shift of the update sizes
    within it is what those gradients can explain, and the bar is at least that.  None when fewer than
    OPT_MIN_PARAMS parameters can be measured."""
    keys = ["rank", "source", "_record", "_io", "index_path"]
    stats = [*R.STATS, *(f"ref_{s}" for s in R.STATS)]
    cols = rows.select("step", *keys, *stats, "numel", "tol")  # the columns used only: the frame is wide
    now = cols.filter(pl.col("step") == after).join(params.select(keys), on=keys, how="semi")
    then = cols.filter(pl.col("step") == before).select(keys + stats)
    both = now.select(keys + stats + ["numel", "tol"]).join(then, on=keys, how="inner", suffix="_b")
    if both.height < OPT_MIN_PARAMS:
        return None
    sizes = {}
    for side, pre in (("target", ""), ("ref", "ref_")):
        t = {s: both[f"{pre}{s}"].cast(pl.Float64).to_numpy() for s in R.STATS}
        b = {s: both[f"{pre}{s}_b"].cast(pl.Float64).to_numpy() for s in R.STATS}
        nulls = {s: np.isnan(t[s]) for s in R.STATS}
        nulls_b = {s: np.isnan(b[s]) for s in R.STATS}
        sqrt_n = np.sqrt(both["numel"].cast(pl.Float64).fill_null(1.0).to_numpy())
        err, known = R.stats_bound(t, b, nulls, nulls_b, sqrt_n, np.zeros(both.height, dtype=bool))
        with np.errstate(invalid="ignore"):
            sizes[side] = np.where(known, err * b["norm"], np.nan)  # ||p(after) - p(before)|| (lower bound)
    with np.errstate(all="ignore"):
        ratio = sizes["target"] / sizes["ref"]
    ok = np.isfinite(ratio) & (sizes["ref"] > 0)
    if ok.sum() < OPT_MIN_PARAMS:
        return None
    r = ratio[ok]
    med = float(median(r))
    same_way = int((r > 1).sum()) if med > 1 else int((r < 1).sum())
    # a tie (both sizes the same value: bf16 statistics rounded to the same step) says neither run moved further:
    # the share is counted among the others; the median keeps the ties (they pull it to 1)
    tied = int((r == 1).sum())
    logs = np.log(np.maximum(r, 1e-12))  # a parameter the target did not move at all: a ratio of ~0
    spread = 1.4826 * float(median(np.abs(logs - median(logs))))  # robust sigma of the log ratios
    se = 1.2533 * spread / np.sqrt(r.size)  # standard error of their median
    bar = float(max(OPT_Z * se, OPT_FLOOR, gradient_error))
    moved = r.size - tied
    out = {
        "parameters": int(ok.sum()),
        "gradient_error": gradient_error,
        "median_ratio": med,
        "same_way": same_way,
        "spread": spread,
        "bar": bar,
        "differs": bool(abs(float(median(logs))) > bar and moved >= OPT_MIN_PARAMS and same_way >= OPT_SHARE * moved),
    }
    return out | {"tied": tied} if tied else out

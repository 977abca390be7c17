"""Integer inputs that differ where msprobe's statistics cannot show it (analysis/culprit.py).

In statistics mode msprobe keeps only the maximum and minimum of an integer tensor (token ids, labels,
indices): one token id changed inside the batch's range leaves both equal, and the ids compare as equal.  The
op that reads them still shows it, when it does no arithmetic on its float inputs that could explain its output
error: an embedding or a gather copies rows of its table, so its output differs by no more than the rows it
copies, whatever the device.

The rule, for a gather-class op (embedding, gather, index_select, take, indexing: `GATHERS`; never a module
record, which holds other ops) with an integer (or boolean) input that no recorded op produced (data: ids,
labels, positions) and whose statistics agree, and a float output that differs:
  carried   what the float inputs can explain: their error, and where it is a statistics lower bound b, up to
            sqrt(2 b) (the norm of a tensor changed by a difference orthogonal to it moves only at second order,
            so a bound b can hide a difference of relative size sqrt(2 b)), times the conditioning
            max(1, |x| / |y|) (the rows copied can carry more of the table's error than the table does);
  stands    the output error exceeds STAND_OUT x carried and the tolerance of the output's own dtype (no
            arithmetic: a bf16 autocast does not lower a gather's precision, so the run's compute floor does
            not apply).
Then the integer input differs: the culprit is that input (`input`: data), at the op reading it.

Other ops reading such data (the loss: cross_entropy(logits, labels)), and losses whose target the dump does
not list at all (`LOSSES`: labels read through a `view` msprobe does not record), have no such bound: a bound b
of their float inputs can hide sqrt(2 b) of a tensor far larger than their output.  Their own history orders
explanations instead (`data_suspects`): the output error per error of the float inputs, h = out_err /
max(in_float_err, eps(float inputs' dtype), eps(output dtype)) (statistics of a bf16 tensor are rounded to
bf16: equal ones leave eps(bf16) unseen), standing STAND_OUT x above the same record's h at every earlier step
(and the output error above STAND_OUT x eps) makes the record a suspect, named ahead of any later finding of
its step (analysis/culprit.py `_data_first`) and never on its own.
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES, EPS, FLOAT_DTYPES
from dumpstore.names import MODULE_RECORD_PREFIXES

from .noise import STAND_OUT
from .order import INPUT_IO, OUTPUT_IO

# a statistic of a float tensor moved by more than this many roundings of itself (eps of the tensor's dtype x its
# magnitude) moved by more than rounding: the noise model's own margin (noise.py STAND_OUT)
ROUNDINGS = STAND_OUT

# ops that copy values chosen by integer indices and do no arithmetic on them (msprobe's op type, last token)
GATHERS = frozenset(
    {"embedding", "gather", "index_select", "take", "take_along_dim", "__getitem__", "index", "embedding_bag"}
)


# losses: their targets are data (labels), which a dump may not record at all (read through a `view` msprobe does
# not record, or not passed as a tensor the loss record lists) (msprobe's op type, last token)
LOSSES = frozenset(
    {
        "cross_entropy",
        "nll_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "kl_div",
        "ctc_loss",
        "multi_margin_loss",
        "multilabel_soft_margin_loss",
        "poisson_nll_loss",
        "gaussian_nll_loss",
    }
)


def is_loss(op_class: str | None) -> bool:
    """Whether a record's op class (`Functional.cross_entropy`) is a loss, whose target is data (never a module
    record)."""
    if not op_class or op_class.startswith(MODULE_RECORD_PREFIXES):
        return False
    return op_class.rsplit(".", 1)[-1].lower() in LOSSES


def is_gather(op_class: str | None) -> bool:
    """Whether a record's op class (`Functional.embedding`, `Tensor.__getitem__`, `Torch.gather`, ...) copies
    values chosen by indices without arithmetic (a module record never counts: it holds other ops)."""
    if not op_class or op_class.startswith(MODULE_RECORD_PREFIXES):
        return False
    return op_class.rsplit(".", 1)[-1].lower() in GATHERS


def hidden_index_columns(is_in: pl.Expr, is_out: pl.Expr, tensor: pl.Expr) -> list[pl.Expr]:
    """Record-table aggregations (analysis/_divergence.py `_record_table`): `idx_hidden`, an integer or boolean
    input compared by its statistics only that agrees; `out_dtype`, the dtype of the first float output;
    `in_float_err`, the largest error of the float tensor inputs."""
    discrete = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
    stats = pl.col("err_source") == "stats"
    hidden = is_in & tensor & discrete & stats & (pl.col("status") != "diverged")
    float_eps = pl.col("dtype").replace_strict(EPS, default=None, return_dtype=pl.Float64)
    return [
        hidden.any().alias("idx_hidden"),
        pl.col("dtype").filter(is_out & tensor & ~discrete).first().alias("out_dtype"),
        pl.col("err").filter(is_in & tensor & ~discrete).max().alias("in_float_err"),
        float_eps.filter(is_in & tensor & ~discrete & stats).max().alias("in_float_eps"),
        # the norms of the largest float input and output (the reference's): a loss's logits, and in its backward
        # record the gradient it was given and the one it returns (`loss_gradient`)
        pl.col("ref_norm").cast(pl.Float64).filter(is_in & tensor & ~discrete).max().alias("in_float_norm"),
        pl.col("ref_norm").cast(pl.Float64).filter(is_out & tensor & ~discrete).max().alias("out_float_norm"),
        # the element count of those two (a backward record's gradient is the logits' only with their count) and
        # the float inputs' largest magnitude (the reference's max/min: what one rounding of an element can move)
        _numel_of_largest(is_in & tensor & ~discrete).alias("in_float_numel"),
        _numel_of_largest(is_out & tensor & ~discrete).alias("out_float_numel"),
        pl.max_horizontal(pl.col("ref_max").abs(), pl.col("ref_min").abs())
        .cast(pl.Float64)
        .filter(is_in & tensor & ~discrete)
        .max()
        .alias("in_float_amax"),
    ]


def _numel_of_largest(where: pl.Expr) -> pl.Expr:
    """The reference's element count of the leaf with the largest reference norm among `where` (in a group_by)."""
    return pl.col("ref_numel").cast(pl.Float64).filter(where).sort_by(pl.col("ref_norm").filter(where)).last()


def carried_by_floats(rec: dict[str, Any]) -> float:
    """What the record's float inputs can explain of its output error (see the module doc)."""
    b = float(rec.get("in_float_err") or 0.0)
    if rec.get("in_bound"):
        b = max(b, math.sqrt(2.0 * b))
    in_norm, out_norm = rec.get("in_norm"), rec.get("out_norm")
    kappa = 1.0
    if in_norm and out_norm and math.isfinite(in_norm / out_norm):
        kappa = max(1.0, in_norm / out_norm)
    return b * kappa


def beyond_rounding(leaf: dict[str, Any], reads: float | None = None) -> float | None:
    """The statistics bound of a float leaf's relative error (analysis/rules.py `stats_bound`: max(|dNorm|,
    |dMax|, |dMin|, |dMean| sqrt(n)) / ||y||) with each statistic's difference less ROUNDINGS roundings of that
    statistic in the leaf's dtype (eps x its magnitude, the mean's at least eps x the elements' RMS: a sum
    rounds in proportion to its terms; msprobe keeps a bfloat16 tensor's statistics in bfloat16): the part of
    the difference no rounding of the statistics makes.  `reads`: the number of indices a gather's output copies
    (the mean's allowance of a coarse dtype's output then counts how the copied rows add up).  None: statistics
    missing."""
    e = EPS.get(str(leaf.get("dtype")), EPS["float32"])
    ref_norm = leaf.get("ref_norm")
    if ref_norm is None or not math.isfinite(ref_norm) or ref_norm <= 0:
        return None
    n = float(leaf.get("numel") or leaf.get("ref_numel") or 1)
    rms = ref_norm / math.sqrt(n)  # a mean is a sum: its rounding is eps x the elements' size, not the mean's
    if reads and 0 < reads < n and e > EPS["float32"]:
        # a gather's output of `reads` indices, in a dtype coarser than the float32 msprobe sums its mean in (the
        # summation's own rounding, eps(float32) x RMS, is then far below): a table off by roundings of its
        # elements, in signs that owe nothing to which rows the indices read, moves the copied sum as a root of
        # squares, eps ||y|| sqrt(c) with c the most reads of one row (unknown: at most `reads`), so the mean by
        # eps RMS sqrt(reads / n) (one row of n / reads elements read every time: eps RMS at reads = n)
        rms *= math.sqrt(reads / n)
    terms = []
    for s, weight in (("norm", 1.0), ("max", 1.0), ("min", 1.0), ("mean", math.sqrt(n))):
        t, r = leaf.get(s), leaf.get("ref_" + s)
        if t is None or r is None or not (math.isfinite(t) and math.isfinite(r)):
            continue
        size = max(abs(t), abs(r), rms if s == "mean" else 0.0)
        terms.append(max(abs(t - r) - ROUNDINGS * e * size, 0.0) * weight)
    return max(terms) / ref_norm if terms else None


# float32 integers are exact up to 2^24: a sum whose every partial sum stays below it is exact in any order
EXACT_INT32 = 2.0**24


def _ulp32(x: float) -> float:
    """The spacing of float32 numbers at |x| (the smallest subnormal at 0)."""
    return float(2.0 ** (max(math.frexp(abs(x))[1], -125) - 24)) if x else 2.0**-149


def integer_sum_differs(leaf: dict[str, Any]) -> bool:
    """Whether an integer leaf's statistics show its values differ although its max and min agree, from the mean
    and norm some msprobe versions keep for integer tensors (8.x: computed in float32, `Norm` 10.816654205322266 =
    float32(sqrt(117)) for the labels [6, 7, 4, 4]).  While n max(|x|) < 2^24 every partial sum of the values is
    an exact float32 integer in whatever order a device adds them, so the mean is the exact sum divided once:
    equal values give means at most a division's rounding apart (an ulp each side; a device may divide
    otherwise), and a mean differing by more than 2 ulp has another sum (one id +1 moves it by 1/n).  The same for
    the norm, the square root of the exact sum of squares, while n max(|x|)^2 < 2^24.  Beyond that the sums round
    and nothing is claimed: the difference of one id is below what the summation order can make."""
    n = float(leaf.get("numel") or leaf.get("ref_numel") or 0)
    ext = [leaf.get(s) for s in ("max", "min", "ref_max", "ref_min")]
    if n <= 0 or any(v is None or not math.isfinite(v) for v in ext):
        return False
    m = max(abs(float(v)) for v in ext)  # type: ignore[arg-type]
    for s, exact in (("mean", n * m < EXACT_INT32), ("norm", n * m * m < EXACT_INT32)):
        t, r = leaf.get(s), leaf.get("ref_" + s)
        if not exact or t is None or r is None or not (math.isfinite(t) and math.isfinite(r)):
            continue
        if abs(t - r) > 2.0 * _ulp32(max(abs(t), abs(r))):
            return True
    return False


def hidden_index_stands(
    rec: dict[str, Any], own_tol: float, out: dict[str, Any] | None = None, reads: float | None = None
) -> dict[str, Any] | None:
    """The evidence that an integer input hidden by its statistics differs, or None (see the module doc).
    `out`: the output leaf judged (its statistics), for float inputs whose statistics agree exactly; `reads`: the
    number of indices the output copies (`beyond_rounding`)."""
    if not rec.get("idx_hidden") or rec.get("out_dtype") is None or not is_gather(rec.get("op_class")):
        return None
    if rec.get("_direction") != "forward":
        return None  # (an embedding's backward sums the gradients of repeated ids: arithmetic)
    out_err = rec.get("out_err")
    if out_err is None or not math.isfinite(out_err):
        return None
    if rec.get("in_bound") and rec.get("in_float_err") == 0.0 and out is not None and out.get("err_source") == "stats":
        # the float inputs' statistics agree exactly: no measured difference of the table to carry, and what
        # their rounding hides moves a copied element by a rounding or two of its own, not more
        value = beyond_rounding(out, reads)
        if value is None or not value > 0.0:
            return None
        return {"carried": 0.0, "bar": out_err - value, "own_tol": own_tol, "beyond_rounding": value}
    carried = carried_by_floats(rec)
    bar = max(STAND_OUT * carried, own_tol)
    if not out_err > bar:
        return None
    return {"carried": carried, "bar": bar, "own_tol": own_tol}


def unseen_ids_reader(recs: pl.DataFrame, step: int, rank: int, source: Any, before_seq: int) -> dict[str, Any] | None:
    """The first gather-class forward record of one step, rank and source, before record `before_seq`, with an
    integer input compared by its statistics only that agrees (`idx_hidden`: max/min in statistics mode) and a
    float output that differs (out_err > 0): where ids that differ unseen enter the step (analysis/culprit.py
    `_ids_first`).  None where there is none."""
    need = {"op_class", "idx_hidden", "out_err", "_direction", "_seq"}
    if not need <= set(recs.columns):
        return None
    classes = [c for c in recs["op_class"].drop_nulls().unique().to_list() if is_gather(c)]
    hit = recs.filter(
        (pl.col("step") == step)
        & (pl.col("rank") == rank)
        & pl.col("source").eq_missing(source)
        & (pl.col("_direction") == "forward")
        & (pl.col("_seq") < before_seq)
        & pl.col("op_class").is_in(classes)
        & pl.col("idx_hidden").fill_null(False)
        & (pl.col("out_err") > 0)
    ).sort("_seq")
    return hit.row(0, named=True) if hit.height else None


def loss_gradients(recs: pl.DataFrame, rows: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per forward record with a backward record (keys, step): `_grad`, the norm of the gradient its backward
    returns for its largest float input per unit of the gradient it was given (the reference's norms: out_float_norm
    / in_float_norm of the backward record), what one unit of change of that input can move its output, to first
    order (Cauchy-Schwarz: |dy| <= ||grad|| ||dx||).  A loss's backward is given the loss scale (or 1) and returns
    the gradient of its logits.  A backward record whose float output has another element count than the forward's
    float input returns no gradient of it (msprobe can file a backward hook's tensors under the next backward
    record: a cross-entropy's "gradient" of shape []): then, given the comparison's `rows`, the gradient its
    logits' producer was given (`producer_gradients`)."""
    need = {"_record", "_direction", "in_float_norm", "out_float_norm"}
    keys = ["step", "rank", "source", "_record"]
    schema: dict[str, Any] = {**{k: recs.schema[k] for k in keys if k in recs.schema}, "_grad": pl.Float64}
    if not need <= set(recs.columns):
        return pl.DataFrame(schema=schema)
    grad = pl.col("out_float_norm") / pl.col("in_float_norm")
    own = recs.filter((pl.col("_direction") == "backward") & grad.is_finite() & (grad > 0)).select(
        *keys[:3], pl.col("_record").str.replace(r"\.backward$", ".forward"), grad.alias("_grad"), *_numel(recs, "out")
    )
    fwd = recs.filter(pl.col("_direction") == "forward").select(*keys, *_numel(recs, "in"))
    own = own.join(fwd, on=keys, how="left", nulls_equal=True)
    own = own.filter(
        pl.col("_n_out").is_null() | pl.col("_n_in").is_null() | (pl.col("_n_out") == pl.col("_n_in"))
    ).select(*keys, "_grad")
    if rows is None:
        return own
    other = producer_gradients(recs, rows).join(own, on=keys, how="anti", nulls_equal=True)
    return pl.concat([own, other.select(own.columns).cast(own.schema)])


def _numel(recs: pl.DataFrame, side: str) -> list[pl.Expr]:
    col = f"{side}_float_numel"
    return [(pl.col(col) if col in recs.columns else pl.lit(None, pl.Float64)).alias(f"_n_{side}")]


_FORWARD_NAME = r"\.forward(\.\d+)?$"  # Functional.linear.17.forward, Module.x.Linear.forward.0


def producer_gradients(recs: pl.DataFrame, rows: pl.DataFrame) -> pl.DataFrame:
    """Per loss forward record (keys, step): `_grad`, the norm of the gradient the producer of its float input
    (the logits) was given in the reference: the float input of the producer's backward record with the logits'
    element count (analysis/producers.py's view rule, all four statistics of the reference: the first forward
    record before the loss with an output of the logits' dtype, element count and statistics), divided by the
    gradient the loss's backward record was given where it lists one of one element (the loss scale), else 1 (an
    unknown scale can only make the gradient larger and the loss's move in its units smaller)."""
    keys = ["step", "rank", "source", "_record"]
    out_schema: dict[str, Any] = {k: recs.schema[k] for k in keys if k in recs.schema}
    out_schema["_grad"] = pl.Float64
    need = {"_record", "_io", "_seq", "_direction", "kind", "ref_dtype", "ref_numel", "ref_norm", "ref_max"}
    if not need <= set(rows.columns) or "op_class" not in recs.columns:
        return pl.DataFrame(schema=out_schema)
    classes = [c for c in recs["op_class"].drop_nulls().unique().to_list() if is_loss(c)]
    losses = recs.filter((pl.col("_direction") == "forward") & pl.col("op_class").is_in(classes)).select(keys)
    if not losses.height:
        return pl.DataFrame(schema=out_schema)
    stat = ["ref_min", "ref_max", "ref_mean", "ref_norm"]
    view = ["step", "rank", "source", "ref_dtype", "ref_numel", *stat]
    tensor = (pl.col("kind") == "tensor") & pl.col("ref_dtype").is_in(list(FLOAT_DTYPES))
    known = pl.all_horizontal([pl.col(c).is_not_null() for c in stat])
    logits = (
        rows.join(losses, on=keys, how="semi", nulls_equal=True)
        .filter(pl.col("_io").is_in(INPUT_IO) & tensor & known)
        .sort("ref_norm", descending=True)
        .unique(subset=keys, keep="first", maintain_order=True)
        .select(*keys, pl.col("_seq").alias("_loss_seq"), *view[3:])
    )
    made = rows.filter(pl.col("_io").is_in(OUTPUT_IO) & tensor & known & (pl.col("_direction") == "forward")).select(
        *view, pl.col("_record").alias("_producer"), pl.col("_seq").alias("_p_seq")
    )
    found = (
        logits.join(made, on=view, how="inner", nulls_equal=True)
        .filter(pl.col("_p_seq") < pl.col("_loss_seq"))
        .sort("_p_seq")
        .unique(subset=keys, keep="first", maintain_order=True)
        .with_columns(pl.col("_producer").str.replace(_FORWARD_NAME, ".backward$1").alias("_p_bwd"))
    )
    given = rows.filter(pl.col("_io").is_in(INPUT_IO) & tensor & (pl.col("_direction") == "backward")).select(
        "step", "rank", "source", pl.col("_record").alias("_p_bwd"), "ref_numel", pl.col("ref_norm").alias("_given")
    )
    found = found.join(given, on=["step", "rank", "source", "_p_bwd", "ref_numel"], how="inner", nulls_equal=True)
    found = found.group_by(keys, maintain_order=True).agg(pl.col("_given").cast(pl.Float64).max())
    scale = rows.filter(pl.col("_io").is_in(INPUT_IO) & tensor & (pl.col("ref_numel") == 1)).select(
        "step",
        "rank",
        "source",
        pl.col("_record").str.replace(r"\.backward$", ".forward"),
        pl.col("ref_norm").cast(pl.Float64).alias("_scale"),
        pl.col("_direction"),
    )
    scale = scale.filter(pl.col("_direction") == "backward").drop("_direction").unique(subset=keys, keep="first")
    found = found.join(scale, on=keys, how="left", nulls_equal=True)
    grad = pl.col("_given") / pl.when(pl.col("_scale") > 0).then(pl.col("_scale")).otherwise(1.0)
    return found.filter(grad.is_finite() & (grad > 0)).select(*keys, grad.alias("_grad")).cast(pl.Schema(out_schema))


def data_suspects(
    recs: pl.DataFrame, rows: pl.DataFrame | None = None
) -> dict[tuple[int, int], tuple[tuple, dict[str, Any]]]:
    """Per (step, rank), the first forward record reading integer data the statistics cannot verify whose output
    moved, relative to its float inputs, STAND_OUT x more than the same record did at every earlier step
    (see `first_data_suspect`): its order key and evidence.  Only a precedence: analysis/culprit.py names it
    instead of a later finding of the same step, never on its own."""
    need = {"op_class", "idx_hidden", "out_dtype", "in_float_err", "out_err", "_direction", "_phase", "_seq"}
    if not need <= set(recs.columns):
        return {}
    from .noise import order_key

    classes = recs["op_class"].drop_nulls().unique().to_list()
    gathers = [c for c in classes if is_gather(c) or c.startswith(MODULE_RECORD_PREFIXES)]
    losses = [c for c in classes if is_loss(c)]
    cand = recs.filter(
        (pl.col("idx_hidden").fill_null(False) | pl.col("op_class").is_in(losses).fill_null(False))
        & ~pl.col("op_class").is_in(gathers).fill_null(True)
        & (pl.col("_direction") == "forward")
        & pl.col("out_dtype").is_not_null()
        & pl.col("out_err").is_not_null()
        & pl.col("out_err").is_finite()
    )
    if not cand.height or cand["step"].n_unique() < 2:
        return {}
    eps = pl.col("out_dtype").replace_strict(EPS, default=EPS["float32"], return_dtype=pl.Float64)
    # float inputs compared by statistics agree only to their dtype's rounding: msprobe rounds a bfloat16
    # tensor's statistics to bfloat16, so equal statistics of bf16 logits leave up to eps(bf16) unseen
    seen = pl.max_horizontal(pl.col("in_float_err").fill_null(0.0), pl.col("in_float_eps").fill_null(0.0), eps)
    ratio = pl.col("out_err") / seen
    keys = ["rank", "source", "_record"]
    cand = (
        cand.with_columns(ratio.alias("_h"), eps.alias("_eps"))
        .sort("step")
        .with_columns(pl.col("_h").cum_max().shift(1).over(keys).alias("_h_before"))
    )
    grads = loss_gradients(recs, rows)
    cand = cand.join(grads, on=keys + ["step"], how="left", nulls_equal=True, maintain_order="left")
    # the output's move in units of the most its float inputs' seen error moves it through its measured gradient
    moved = pl.col("out_err") * pl.col("out_norm") / (pl.col("_grad") * seen * pl.col("in_float_norm"))
    if not {"out_norm", "in_float_norm"} <= set(cand.columns):
        moved = pl.lit(None, pl.Float64)
    # float inputs stored coarser than the output is computed (bf16/fp16 logits of an fp32 loss under autocast)
    # whose statistics agree exactly: what differs is at most a rounding of each element to that dtype (finer
    # compute differences round to the same or the adjacent value), eps |x_i| <= eps max|x|, in signs that owe
    # nothing to the gradient: their move sums as a root of squares, eps max|x| ||grad||, not Cauchy-Schwarz's
    # aligned eps ||x|| ||grad|| (a factor up to the root of the element count)
    rounded = (
        (pl.col("in_float_err") == 0.0)
        & (pl.col("in_float_eps") > pl.col("_eps"))
        & pl.col("in_float_amax").is_finite()
        & (pl.col("in_float_amax") > 0)
    )
    if {"out_norm", "in_float_amax"} <= set(cand.columns):
        by_rounding = pl.col("out_err") * pl.col("out_norm") / (pl.col("_grad") * seen * pl.col("in_float_amax"))
        moved = pl.when(rounded.fill_null(False)).then(by_rounding).otherwise(moved)
    cand = cand.with_columns(pl.when(moved.is_finite()).then(moved).alias("_g"))
    gradient = pl.col("_g") > STAND_OUT
    stands = (pl.col("out_err") > STAND_OUT * pl.col("_eps")) & (
        (
            (pl.col("_h_before") > 0).fill_null(False)  # a ratio measured before
            & (pl.col("_h") > STAND_OUT * pl.col("_h_before"))
            & (pl.col("_g").is_null() | gradient)  # (no gradient recorded: the history alone)
        )
        # the output equal in both runs at every earlier step: no ratio to compare with, the gradient alone
        | ((pl.col("_h_before") == 0) & gradient).fill_null(False)
    )
    out: dict[tuple[int, int], tuple[tuple, dict[str, Any]]] = {}
    for rec in cand.filter(stands).iter_rows(named=True):
        key = order_key(rec)
        at = (rec["step"], rec["rank"])
        if at not in out or key < out[at][0]:
            out[at] = (key, rec)
    return out

"""Float data that change after an earlier step where they agreed (analysis/culprit.py `_Judge._float_data`).

Data no recorded op made (images, features, a regression target) are prepared the same way in both runs: where a
float input of a forward record agreed within rounding at every earlier compared step, a change of its
statistics beyond rounding at a later step is a change of the data, however small against the tolerance of the
op that reads it (one image of a batch replaced by the previous step's moves the pixels' statistics 1.4 % where
a bfloat16 autocast allows 1.6 %).  The pair's other differences after the first step (every weight off by an
update's noise, which puts an output error of that size on most ops) cannot reach data no op of the step made,
so they do not hide it; but they do reach a tensor the model carries from step to step outside the recorded ops
(a batch norm's running statistics, a recurrent state), which is why the rule is narrow:

  a data leaf   a float tensor input of a forward record, `requires_grad` false in both runs (a weight and
                anything computed from one require grad), its dtype and element count the same in both runs;
  moved         a statistic differs beyond what rounding makes of identical data (`data_moved`): the maximum
                or minimum by more than ROUNDINGS roundings of itself in the leaf's dtype (no reduction rounds
                them: only an element prepared otherwise on another device, and msprobe's storage of the
                statistic); the mean by more than (ROUNDINGS + 2 ceil(log2 n)) roundings of the elements' RMS
                (a pairwise or tree sum of n terms rounds ceil(log2 n) times along each path, each time by at
                most a rounding of the sum of |x|, which is at most n RMS; two runs); the norm by more than
                (ROUNDINGS + ceil(log2 n)) roundings of itself (a sum of squares: nonnegative terms, the square
                root halves the relative error; two runs);
  starts        the first compared step at which the leaf (same rank, source, record, name) moved, with the leaf
                present and not moved at an earlier compared step (`float_data_starts`);
  not carried   no output of a recorded op of an earlier step of the same run has its dtype, element count and
                statistics (a recurrent state handed from one step to the next is no data).

The judge adds what needs one step's producers and noise: no recorded op of the step made the leaf in either run
(analysis/producers.py); it is no weight: a `parameters` leaf, one a module record lists, or an argument the op's
signature names a weight or buffer (`STATE_ARGUMENTS`: a teacher's weights, a moving average of the student's,
require no grad, are read first in a step and carry the student's noise from step 1 on); and the step's noise
cannot have reached it.  Where records of its step and rank before it show output errors (a second tower read
after the first, a second micro-batch), float noise reaches a tensor no recorded op made, and that is not an
earlier step's output, only through a choice made on it (an accuracy computed from a flipped argmax:
`decision_before`) or a copy by ops msprobe does not record (a detached half of an output, a metric's input),
which carries at most the largest output error before it (`flipflow.step_level`, in absolute terms over the
leaf's norm).  So the leaf is judged there only with no flip noted, no possible flip and no differing discrete
input before it in its step and rank, and an error beyond that level.  Then the leaf is the culprit (`input`), at
the record reading it, whether or not that record's output leaves its tolerance.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES, EPS, FLOAT_DTYPES
from dumpstore.names import MODULE_RECORD_PREFIXES

from .arguments import argument_name
from .flipflow import PossibleFlips
from .hidden_index import GATHERS, ROUNDINGS
from .noise import NoiseModel
from .order import INPUT_IO, OUTPUT_IO
from .producers import Producers, fingerprint_column

_KEYS = ["rank", "source", "_record", "name"]

# arguments torch's signatures (analysis/arguments.py) give a module's weights and buffers: never data, even where
# they require no grad (a frozen or momentum-updated teacher's weights, a batch norm's running statistics)
STATE_ARGUMENTS = frozenset({"weight", "bias", "running_mean", "running_var", "gamma", "beta"})
_STATS = ("min", "max", "mean", "norm")

# ops that copy their input's values into their output (a pad adds constants, a view reorders, a gather picks):
# data read through one of them is still data no arithmetic touched (msprobe's op type)
COPIES = frozenset({"pad", "contiguous", "clone", "reshape", "view", "flatten", "permute", "transpose"}) | GATHERS


def float_data_input() -> pl.Expr:
    """Row-level (a comparison's ordered rows): a float tensor input of a forward record that requires no grad in
    either run (`requires_grad` false, not unknown), of the same dtype and element count in both."""
    return (
        pl.col("_io").is_in(INPUT_IO)
        & (pl.col("_direction") == "forward")
        & (pl.col("kind") == "tensor")
        & ~pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
        & pl.col("dtype").is_in(list(FLOAT_DTYPES))
        & (pl.col("dtype") == pl.col("ref_dtype"))
        & (pl.col("numel") == pl.col("ref_numel"))
        & (pl.col("numel") > 0)
        & (pl.col("requires_grad") == False)  # noqa: E712 (a null is unknown: not data)
        & (pl.col("ref_requires_grad") == False)  # noqa: E712
    )


def data_moved() -> pl.Expr:
    """Row-level: some statistic of the leaf differs beyond what rounding makes of identical data (see the
    module's doc); false where no statistic of both runs is finite."""
    e = pl.col("dtype").replace_strict(EPS, default=EPS["float32"], return_dtype=pl.Float64)
    n = pl.col("numel").cast(pl.Float64)
    levels = n.log(2).ceil().clip(lower_bound=1.0)
    rms = pl.max_horizontal(pl.col("norm").abs(), pl.col("ref_norm").abs()) / n.sqrt()

    def diff(s: str) -> pl.Expr:
        return (pl.col(s) - pl.col("ref_" + s)).abs()

    def size(s: str) -> pl.Expr:
        return pl.max_horizontal(pl.col(s).abs(), pl.col("ref_" + s).abs())

    allowed = {
        "max": ROUNDINGS * e * size("max"),
        "min": ROUNDINGS * e * size("min"),
        "mean": (ROUNDINGS + 2.0 * levels) * e * rms,
        "norm": (ROUNDINGS + levels) * e * size("norm"),
    }
    moved = [(diff(s) > allowed[s]) & diff(s).is_finite() & allowed[s].is_finite() for s in _STATS]
    return pl.any_horizontal([m.fill_null(False) for m in moved])


def float_data_starts(rows: pl.DataFrame) -> pl.DataFrame:
    """The data leaves of `rows` (a comparison's ordered rows) that start to differ after an earlier compared step
    where they agreed, and that no recorded op of an earlier step of either run output: `step`, `rank`, `source`,
    `_record`, `name` (the step at which they start; see the module's doc)."""
    schema = {"step": rows.schema["step"], **{k: rows.schema[k] for k in _KEYS}}
    need = {"requires_grad", "ref_requires_grad", "_direction", "numel", "ref_numel", *_STATS}
    if not need <= set(rows.columns):
        return pl.DataFrame(schema=schema)
    data = rows.lazy().filter(float_data_input()).with_columns(data_moved().alias("_moved"))
    seen = data.group_by(_KEYS).agg(pl.col("step").min().alias("_seen"))
    first = data.filter(pl.col("_moved")).group_by(_KEYS).agg(pl.col("step").min().alias("_first"))
    starts = (
        data.join(first, on=_KEYS, how="inner", nulls_equal=True)
        .filter(pl.col("step") == pl.col("_first"))
        .join(seen, on=_KEYS, how="inner", nulls_equal=True)
        .filter(pl.col("_seen") < pl.col("step"))
        .collect()
    )
    if not starts.height:
        return pl.DataFrame(schema=schema)
    for prefix in ("", "ref_"):  # the same values as an earlier step's recorded output of that run: carried state
        cols = ["rank", "source", f"{prefix}dtype", f"{prefix}numel", *(f"{prefix}{s}" for s in _STATS)]
        made = (
            rows.lazy()
            .filter(pl.col(f"{prefix}io").is_in(OUTPUT_IO) & (pl.col(f"{prefix}kind") == "tensor"))
            .filter(pl.all_horizontal([pl.col(c).is_not_null() for c in cols[2:]]))
            .group_by(cols)
            .agg(pl.col("step").min().alias("_made"))
            .collect()
        )
        starts = starts.join(made, on=cols, how="left", nulls_equal=True)
        starts = starts.filter(pl.col("_made").is_null() | (pl.col("_made") >= pl.col("step"))).drop("_made")
    return starts.select(list(schema))


def state_argument(leaf: dict) -> bool:
    """Whether the op's signature names this tensor input a weight or buffer (`STATE_ARGUMENTS`)."""
    name, how = argument_name(leaf)
    return how != "position" and name.split("[", 1)[0] in STATE_ARGUMENTS


def starts_at(starts: pl.DataFrame) -> set[tuple]:
    """(step, rank, source, record, leaf name) of each start (`float_data_starts`), for the judge's look-up."""
    return set(starts.iter_rows())


def decision_before(noise: NoiseModel, key: tuple) -> bool:
    """Whether a record before `key` in its step and rank made a choice the pair's float noise can turn: a near-tie
    flip the judge noted, a possible flip (a discrete output of float inputs that may differ), a differing discrete
    input.  Float noise reaches a tensor no recorded op made only through such a choice (an accuracy computed from
    a flipped argmax) or state carried from an earlier step (the other guards)."""
    keys = [fk for fk, _ in noise.flip_marks]
    marks = noise.possible_flips
    if isinstance(marks, PossibleFlips):
        keys += [s["key"] for s in marks.sources] + list(marks.discrete_differs)
    return any(k[0] == key[0] and k[2] == key[2] and k < key for k in keys)


def _no_grad(leaf: dict[str, Any]) -> bool:
    return leaf.get("requires_grad") is False and leaf.get("ref_requires_grad") is False


def _weight(leaf: dict[str, Any], t_prod: Producers, r_prod: Producers) -> bool:
    return (
        t_prod.is_weight(leaf)
        or r_prod.is_weight(leaf)
        or state_argument(leaf)
        or (leaf.get(fingerprint_column("")) in t_prod.params)
    )


def _data(leaf: dict[str, Any], t_prod: Producers, r_prod: Producers, copies: bool) -> bool:
    """A tensor input that is data: no recorded op of its step made it in either run and it requires no grad
    (an integer: no op made it), or (`copies`) a recorded copy op (`COPIES`) made it in both runs from data only."""
    tp, rp = t_prod.producer(leaf), r_prod.producer(leaf)
    if tp is None and rp is None:
        discrete = leaf.get("tol_dtype") in DISCRETE_DTYPES
        return (discrete or _no_grad(leaf)) and not _weight(leaf, t_prod, r_prod)
    if not copies or tp is None or rp is None or tp != rp:
        return False
    made = t_prod.rows.filter(pl.col("_record") == tp)
    if not made.height or str(made["op_type"][0]).lower() not in COPIES:
        return False
    ins = made.filter(pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor"))
    return ins.height > 0 and all(_data(r, t_prod, r_prod, False) for r in ins.iter_rows(named=True))


def data_read(leaves: pl.DataFrame, t_prod: Producers, r_prod: Producers) -> list[str] | None:
    """The data a forward op record reads where every tensor input of it is data (no recorded op of its step made
    it in either run, requiring no grad; or a copy of such data by a recorded copy op: the pixels a pad
    surrounds with zeros) or a weight: the names of the data leaves, else None.  Earlier steps reach such an op
    only through its weights, whose own statistics bound what they can hide (rule 5, `noise.statistics_hidden`),
    and its own step only through unrecorded copies of outputs before it (their error at most): the error the
    pair carries over every earlier record (`NoiseModel.carried`, which after the first step holds the
    backward's near-cancelling gradients, off tens of percent of a norm of 1e-8) is no measure of its inputs
    (analysis/culprit.py `_fresh`).  Module records are not ops (None)."""
    first = leaves.row(0, named=True) if leaves.height else None
    if (
        first is None
        or first.get("_direction") != "forward"
        or str(first.get("_record")).startswith(MODULE_RECORD_PREFIXES)
    ):
        return None
    ins = leaves.filter(pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor"))
    data: list[str] = []
    for leaf in ins.iter_rows(named=True):
        if _data(leaf, t_prod, r_prod, True):
            data.append(str(leaf["name"]))
        elif not _weight(leaf, t_prod, r_prod):
            return None
    return data or None

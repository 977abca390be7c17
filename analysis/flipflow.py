"""What a discrete choice flipped by noise explains downstream, in the same step (analysis/culprit.py).

A near-tie flip (a top-k routing choice, an argmax) noted by the judge changes which computation a few rows
take: one token goes to another expert.  Everything the flipped choice feeds then differs by far more than
rounding, and legitimately so: masks, counts and indices derived from the choice (one_hot, the tokens an
expert gets, often through indexing and permutes msprobe does not record), the combine of the expert outputs,
the residual stream after it, and in the backward every gradient (they all descend from the loss, which the
flipped rows feed).

A record is **fed by the flip** (data-flow downstream of the flipped record, in its step and rank) when
  - it comes after the flip in the forward and one of its inputs differs (an input made downstream of it), or
    is an integer compared by its statistics only (msprobe keeps max/min: the flip can hide in it), or is a
    float input that differs by a statistics bound only (one re-routed row of many moves a tensor's mean and
    norm at second order: the next layer's router reads the re-routed stream as barely differing), or
  - it encloses the flipped record (a module whose forward contains it: its output is made through the flip,
    while its own inputs agree), or
  - it is a backward record after a forward flip (every gradient descends from the loss).
A forward record after the flip whose inputs all agree is not fed by it, and is judged as any other.

A record fed by the flip is **explained** by it when its errors are within what the flip's own consequences
already showed: at most STAND_OUT x the flip's level, the largest finite output error of the records between
the flip and it (in its rank; discrete outputs of data-dependent shape excluded, their error is infinite).
The level is measured from the pair, not assumed: the first records the flip feeds (the expert that got or
lost the token, the combine of the expert outputs) show how much one re-routed row moves a tensor of that
model.  Its discrete inputs (integer or boolean, or of data-dependent shape) are explained outright: no ratio
of errors means anything there.  Beyond STAND_OUT x the level a record is judged by the other rules as before
(a fault far beyond what the flip explains).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES, EPS

from .noise import STAND_OUT, NoiseModel, order_key
from .order import INPUT_IO, OUTPUT_IO


def enclosing_modules(record: str, parents: dict[str, str]) -> frozenset:
    """The module records enclosing `record` (its module, that module's module, ...)."""
    out: set[str] = set()
    cur = parents.get(record)
    while cur is not None and cur not in out:
        out.add(cur)
        cur = parents.get(cur)
    return frozenset(out)


def flip_before(noise: NoiseModel, key: tuple) -> tuple[tuple, frozenset] | None:
    """The first near-tie flip noted before `key` in its step and rank: its order key and enclosing modules."""
    for fk, scope in noise.flip_marks:
        if fk[0] == key[0] and fk[2] == key[2] and fk < key:
            return fk, scope
    return None


def flip_level(noise: NoiseModel, since: tuple, key: tuple) -> float | None:
    """The largest finite output error of the records from the flip (`since`) up to `key`, in its rank: what
    the flip's consequences have shown so far."""
    keys, values = noise.outputs
    lo, hi = bisect.bisect_left(keys, since), bisect.bisect_left(keys, key)
    part = values[lo:hi]
    part = part[(noise.output_ranks()[lo:hi] == key[2]) & np.isfinite(part)]
    return float(part.max()) if part.size else None


def step_level(noise: NoiseModel, key: tuple, norm: float | None = None) -> float | None:
    """The largest finite output error of the records before `key` in its step and rank: the error some
    recorded op of this step already showed, which an input reached through ops msprobe does not record (a
    rotate_half of the query states, a gradient through a transpose) can carry on.

    With `norm` (the reference norm of that input), also in absolute terms: a slice or view of a recorded
    output (the key of a fused q/k/v projection, cut by `split` and a transpose msprobe does not record) has
    at most that output's absolute error, which is a larger relative error of the smaller slice: the largest
    output error x output norm before it, over `norm`."""
    level = flip_level(noise, (key[0],), key)
    if norm is None or not np.isfinite(norm) or norm <= 0 or noise.output_norms.size != len(noise.outputs[0]):
        return level
    keys, values = noise.outputs
    lo, hi = bisect.bisect_left(keys, (key[0],)), bisect.bisect_left(keys, key)
    absolute = values[lo:hi] * noise.output_norms[lo:hi]
    absolute = absolute[(noise.output_ranks()[lo:hi] == key[2]) & np.isfinite(absolute)]
    if not absolute.size:
        return level
    return max(level or 0.0, float(absolute.max()) / norm)


def _whole(v: Any, n: float) -> bool:
    """Whether a sum (or sum of squares) of float32 statistics is a whole number, where that can be told."""
    tol = 1e-5 * max(1.0, abs(v)) + 1e-9 * n
    return bool(np.isfinite(v) and tol < 0.1 and abs(v - round(v)) <= tol)


def integer_valued(leaf: dict[str, Any]) -> bool:
    """Whether a float tensor holds whole numbers in both runs, as far as its statistics show: max and min whole,
    the sum (mean x count) and the sum of squares (norm^2) whole.  An indicator or a count made from discrete
    values by an op msprobe does not record (the `.float()` of `pred == labels`)."""
    n = leaf.get("numel")
    if not n:
        return False
    for pre in ("", "ref_"):
        lo, hi, mean, norm = (leaf.get(pre + s) for s in ("min", "max", "mean", "norm"))
        if lo is None or hi is None or mean is None or norm is None:
            return False
        if not (_whole(lo, 1) and _whole(hi, 1) and _whole(mean * n, n) and _whole(norm * norm, n)):
            return False
    return True


def fed_by_flip(
    noise: NoiseModel, key: tuple, rec: dict[str, Any], leaves: pl.DataFrame | None = None
) -> dict[str, Any] | None:
    """Whether a record's diverged output is explained by a near-tie flip upstream of it (see the module doc):
    the evidence (flip, level, how it is fed), or None.  With its `leaves`, also whole numbers made from
    discrete inputs after a possible flip (`fed_by_possible_flip`)."""
    flip = flip_before(noise, key)
    if flip is None:
        return None if leaves is None else fed_by_possible_flip(noise, key, leaves)
    fk, scope = flip
    if rec.get("_record") in scope:
        how = "encloses the flipped record"
    elif rec.get("_direction") not in (None, "forward"):
        how = "a gradient after the flip"
    elif rec.get("in_div"):
        how = "an input differs after the flip"
    elif rec.get("idx_hidden"):
        how = "an integer input after the flip that its statistics (max/min) cannot show"
    elif rec.get("in_bound") and rec.get("in_err"):
        how = "a float input after the flip compared by its statistics, which a few re-routed rows barely move"
    else:
        return None
    level = flip_level(noise, fk, key)
    err = rec.get("out_err")
    if level is None or err is None or not err <= STAND_OUT * level:
        return None
    return {"after_flip": fk, "fed": how, "flip_level": level}


def explained_by_flip(noise: NoiseModel, key: tuple, leaf: dict[str, Any]) -> dict[str, Any] | None:
    """Whether a differing input no recorded op produced is explained by a near-tie flip upstream of it in its
    step and rank: discrete (integer, boolean, data-dependent shape) or within STAND_OUT x the flip's level;
    or, where no flip was seen, whole numbers a possible flip the statistics cannot show makes
    (`explained_by_possible_flip`)."""
    flip = flip_before(noise, key)
    found = None if flip is None else _explained_by_noted(noise, key, leaf, flip[0])
    return found or explained_by_possible_flip(noise, key, leaf)


def _explained_by_noted(noise: NoiseModel, key: tuple, leaf: dict[str, Any], fk: tuple) -> dict[str, Any] | None:
    if leaf.get("tol_dtype") in DISCRETE_DTYPES:
        return {"after_flip": fk, "why": "discrete, derived from the flipped choice"}
    if integer_valued(leaf):
        return {"after_flip": fk, "why": "whole numbers in both runs (a count or indicator of the flipped choice)"}
    if str(leaf.get("detail") or "").startswith("shape"):
        return {"after_flip": fk, "why": "data-dependent shape"}
    level = flip_level(noise, fk, key)
    err = leaf.get("err")
    if level is None or err is None or not err <= STAND_OUT * level:
        return None
    return {"after_flip": fk, "why": "within the flip's consequences", "flip_level": level}


# A possible flip (statistics mode): at most this many near ties per step and rank.  A near tie is rare on a
# clean pair (a choice flips only where its top two values are within the rounding noise of each other: for
# float32 logits a few ulps apart); two at once are the square of a rare event.
TIES = 1


@dataclass
class PossibleFlips:
    """The records of a pair whose discrete output may have flipped unseen (`mark_possible_flips`: each with its
    order key and `until`, the start of the next micro-batch of its step and rank, or None), and those reading
    a differing discrete input (data, labels, or a flip the statistics show)."""

    sources: list[dict[str, Any]] = field(default_factory=list)
    discrete_differs: list[tuple] = field(default_factory=list)


def mark_possible_flips(noise: NoiseModel, rows: pl.DataFrame, recs: pl.DataFrame) -> None:
    """Note the records whose discrete output (indices, a mask: argmax, top-k, sort, eq/gt/lt, max-pool indices)
    is computed from float inputs that may differ and is compared by its statistics only (msprobe keeps max/min
    of an integer tensor: a flipped choice keeps them): a flip there is possible, and the statistics cannot
    tell.  The float inputs may differ when their statistics differ within tolerance, or when they agree but
    are rounded to a 16-bit float's precision (msprobe's statistics of a bf16 or fp16 tensor are: a difference
    can hide in them) while the pair already differs before it in its step and rank.  A record whose arguments
    or inputs differ beyond tolerance is no such source (a changed argument, a wrong kernel before it, data:
    judged by their own rules).  Also the records reading a differing discrete input (`noise.possible_flips`)."""
    need = {"_io", "kind", "tol_dtype", "err_source", "status", "_record", "name"}
    have = {"in_float_err", "in_float_eps", "in_div", "arg_diff", "out_div", "_direction", "_phase"}
    if not need <= set(rows.columns) or not have <= set(recs.columns):
        return
    keys = ["step", "rank", "source", "_record"]
    discrete = (pl.col("kind") == "tensor") & pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
    outs = rows.filter(
        pl.col("_io").is_in(OUTPUT_IO) & discrete & (pl.col("err_source") == "stats") & (pl.col("status") != "diverged")
    )
    named = outs.group_by(keys, maintain_order=True).agg(pl.col("name").alias("_outputs"))
    rounded = (pl.col("in_float_err") == 0) & (pl.col("in_float_eps") > EPS["float32"])  # 16-bit statistics
    src = recs.join(named, on=keys, how="inner", nulls_equal=True).filter(
        ((pl.col("in_float_err") > 0) | rounded) & ~pl.col("in_div") & ~pl.col("arg_diff") & ~pl.col("out_div")
    )
    differs = rows.filter(pl.col("_io").is_in(INPUT_IO) & discrete & (pl.col("status") == "diverged"))
    differs = recs.join(differs.select(keys).unique(), on=keys, how="semi", nulls_equal=True)
    starts = _micro_batch_starts(recs)
    sources = []
    for r in src.iter_rows(named=True):
        key = order_key(r)
        if not r["in_float_err"] and not (flip_level(noise, (key[0],), key) or 0.0) > 0:
            continue  # 16-bit statistics that agree where nothing before differs: the inputs are the same
        later = [k for k in starts if k[0] == key[0] and k[2] == key[2] and k[3] == key[3] and k > key]
        sources.append(
            {
                "key": key,
                "until": min(later) if later else None,
                "op": r["_record"],
                "outputs": r["_outputs"],
                "float_err": float(r["in_float_err"]),
            }
        )
    noise.possible_flips = PossibleFlips(sources, [order_key(r) for r in differs.iter_rows(named=True)])


def _micro_batch_starts(recs: pl.DataFrame) -> list[tuple]:
    """The order keys of the forward records that follow a backward record in their step, rank and source (the
    first record of a micro-batch after the first): a flip in one micro-batch makes nothing of the next."""
    ordered = recs.filter(pl.col("_phase") == 0).select("step", "_phase", "rank", "source", "_seq", "_direction")
    prev = pl.col("_direction").shift(1).over(["step", "rank", "source"])
    starts = ordered.filter((pl.col("_direction") == "forward") & (prev == "backward"))
    return [order_key(r) for r in starts.iter_rows(named=True)]


def possible_before(noise: NoiseModel, key: tuple) -> dict[str, Any] | None:
    """The first possible flip (`mark_possible_flips`) before `key` in its step, rank and micro-batch; None also
    where a discrete input differs before `key` in its step and rank (data or labels changed: whole numbers
    after it are not a flip's to explain)."""
    marks = noise.possible_flips
    if not isinstance(marks, PossibleFlips):
        return None
    if any(k[0] == key[0] and k[2] == key[2] and k < key for k in marks.discrete_differs):
        return None
    for s in marks.sources:
        k, until = s["key"], s["until"]
        if k[0] == key[0] and k[2] == key[2] and k < key and (until is None or key < until):
            return s
    return None


def units_moved(leaf: dict[str, Any]) -> int | None:
    """How many units (a count of 1, an indicator's 0/1) a whole-valued float tensor moved between the runs, as
    its statistics show, when that is what TIES flipped choices can make; None otherwise (not whole-valued in
    both runs, another shape, or more moved).  One flipped choice adds or removes one unit (an accuracy
    indicator 1 -> 0: the sum moves by 1) or moves one between cells (a token count from one expert to
    another: the sum stays): the sum moves by at most one unit per tie, each extreme by at most one, and the
    sum of squares by at most 2 x span + 2 per tie ((c+1)^2 - c^2 + (d-1)^2 - d^2 = 2(c - d) + 2, or 2|v| + 1
    for one element)."""
    n = leaf.get("numel")
    ref_n = leaf.get("ref_numel", n)
    if not n or n != ref_n or not integer_valued(leaf):
        return None
    st = {pre: [float(leaf[pre + s]) for s in ("min", "max", "mean", "norm")] for pre in ("", "ref_")}
    (lo, hi, mean, norm), (rlo, rhi, rmean, rnorm) = st[""], st["ref_"]
    moved = abs(round(mean * n) - round(rmean * n))
    span = max(hi, rhi) - min(lo, rlo)
    reach = max(abs(hi), abs(lo), abs(rhi), abs(rlo))
    per_tie_sq = max(2.0 * span + 2.0, 2.0 * reach + 1.0)
    if moved > TIES or abs(hi - rhi) > TIES or abs(lo - rlo) > TIES:
        return None
    if abs(round(norm * norm) - round(rnorm * rnorm)) > TIES * per_tie_sq:
        return None
    return moved


def explained_by_possible_flip(noise: NoiseModel, key: tuple, leaf: dict[str, Any]) -> dict[str, Any] | None:
    """Whether a differing float input no recorded op produced is whole numbers in both runs (an indicator or
    a count: `(pred == labels).float()`, made by a cast msprobe does not record) that moved by no more than
    TIES flipped choices make (`units_moved`), after a possible flip (`mark_possible_flips`) in its step and
    rank: noise the statistics cannot tell from a flip, noted in the verdict, not a culprit.  An integer input
    no op produced (data, labels) is never explained this way: it is no float op's product."""
    if leaf.get("tol_dtype") in DISCRETE_DTYPES:
        return None
    src = possible_before(noise, key)
    if src is None:
        return None
    moved = units_moved(leaf)
    if moved is None:
        return None
    name = leaf.get("name") or leaf.get("ref_name")
    _note_possible(noise, src, name, moved, leaf.get("numel"))
    return {"after_possible_flip": src["key"], "why": "whole numbers, within what one flipped choice makes"}


def fed_by_possible_flip(noise: NoiseModel, key: tuple, leaves: pl.DataFrame) -> dict[str, Any] | None:
    """Whether a recorded op that reads only discrete tensors compared by their statistics (which agree: a
    flip hides in them) and makes whole-valued float outputs (a recorded cast of the flipped mask) differs by
    no more than TIES flipped choices make, after a possible flip in its step and rank."""
    src = possible_before(noise, key)
    if src is None:
        return None
    tensors = leaves.filter(pl.col("kind") == "tensor")
    ins = tensors.filter(pl.col("_io").is_in(INPUT_IO))
    discrete = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
    hidden = discrete & (pl.col("err_source") == "stats") & (pl.col("status") != "diverged")
    if not ins.height or ins.filter(~hidden).height:
        return None
    bad = tensors.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("status") == "diverged"))
    if not bad.height or bad.filter(discrete).height:
        return None
    moved = [units_moved(r) for r in bad.iter_rows(named=True)]
    if any(m is None for m in moved):
        return None
    for r, m in zip(bad.iter_rows(named=True), moved):
        _note_possible(noise, src, r["name"] or r["ref_name"], m, r.get("numel"))
    return {"after_possible_flip": src["key"], "fed": "whole numbers from discrete inputs the statistics hide"}


def _note_possible(noise: NoiseModel, src: dict[str, Any], name: str | None, moved: int | None, n: Any) -> None:
    """The verdict's note of a possible flip and what it explained (once per source and tensor)."""
    if any(f.get("possible") and f["op"] == src["op"] and f.get("explains") == name for f in noise.flips):
        return
    noise.flips.append(
        {
            "step": src["key"][0],
            "rank": src["key"][2],
            "op": src["op"],
            "outputs": list(src["outputs"]),
            "float_err": src["float_err"],
            "noise_bar": None,
            "possible": True,
            "explains": name,
            "detail": (
                f"possibly a near-tie flip in {src['op']}; statistics cannot tell: {name} (whole numbers) "
                f"moved {moved} unit(s) of {n}"
            ),
        }
    )

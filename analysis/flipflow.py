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
from typing import Any

import numpy as np

from dumpstore.dtypes import DISCRETE_DTYPES

from .noise import STAND_OUT, NoiseModel


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


def fed_by_flip(noise: NoiseModel, key: tuple, rec: dict[str, Any]) -> dict[str, Any] | None:
    """Whether a record's diverged output is explained by a near-tie flip upstream of it (see the module doc):
    the evidence (flip, level, how it is fed), or None."""
    flip = flip_before(noise, key)
    if flip is None:
        return None
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
    step and rank: discrete (integer, boolean, data-dependent shape) or within STAND_OUT x the flip's level."""
    flip = flip_before(noise, key)
    if flip is None:
        return None
    fk = flip[0]
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

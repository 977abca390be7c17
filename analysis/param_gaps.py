"""Distances between parameters from what the dumps keep, for the changed-parameter rule of analysis/steps.py
(docs/how-it-decides.md, section 5, *Parameters after the first step*): the statistics lower bound of ||a - b||
(`stats_gap`), the distance of two sketches of one shape (`sketch_distance`), and two parameters that hold each
other's values in the target, a swap (`held_values`)."""

from __future__ import annotations

import numpy as np
import polars as pl

from dumpstore.names import without_module_call

from . import rules as R
from .noise import STAND_OUT
from .pairmetrics import WEIGHT_SKETCH


def stats_gap(t: dict[str, np.ndarray], r: dict[str, np.ndarray], numel: np.ndarray) -> np.ndarray:
    """||x - y|| (absolute) lower bound from the statistics of x (`t`) and y (`r`); NaN where unknown."""
    nulls_t = {s: np.isnan(t[s]) for s in R.STATS}
    nulls_r = {s: np.isnan(r[s]) for s in R.STATS}
    err, known = R.stats_bound(t, r, nulls_t, nulls_r, np.sqrt(numel), np.zeros(numel.size, dtype=bool))
    with np.errstate(invalid="ignore"):
        gap = np.where(known & np.isfinite(err), err * np.abs(r["norm"]), np.nan)
    return np.where(r["norm"] == 0, np.abs(t["norm"]), gap)  # ||x - 0|| = ||x||: a bias that starts at zero


def held_values(
    both: pl.DataFrame,
    t: dict[str, np.ndarray],
    r: dict[str, np.ndarray],
    n: np.ndarray,
    x: np.ndarray,
    upd: np.ndarray,
    sk_upd: np.ndarray | None,
    least: float,
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """Two parameters that hold each other's values in the target (a swap: a conversion that reads a fused
    matrix's halves in the wrong order, two checkpoint keys exchanged).  For rows i and j of analysis/steps.py
    `table`'s joined frame of one rank, shape and dtype, both at least `least` of an update (`X_MIN`) from their
    own reference (`x`, the changed-parameter rule's measure), y_ij is the gap from i's target to j's reference
    in i's update (the sketches' where i's measure is theirs, else the statistics bound), and i holds j's values
    as far as x_i / y_ij says: how many times nearer its target is to j's reference than to its own.  Per row:
    the larger of the two directions' lesser ratio over its partners (`x_held`: both must hold), the gap to that
    partner (`held_gap`, in i's update) and the partner's parameter key (`_held_by`, as a string:
    analysis/param_change.py).  NaN / None where no partner of its kind is `least` off too."""
    rows = both.height
    held, gap = np.full(rows, np.nan), np.full(rows, np.nan)
    by: list[str | None] = [None] * rows
    recs = [without_module_call(rec) for rec in both["_record"].to_list()]
    keys = [f"{k}" for k in both["_pkey"].to_list()]
    kinds: dict[tuple, list[int]] = {}
    for i, (rank, shape, dtype) in enumerate(both.select("rank", "shape", "dtype").iter_rows()):
        if np.isfinite(x[i]) and x[i] >= least and n[i] > 1:
            kinds.setdefault((rank, tuple(shape or ()), dtype), []).append(i)
    if sk_upd is not None:
        s_t, s_r = (both[c].to_list() for c in WEIGHT_SKETCH)
    for group in kinds.values():
        pairs = [(i, j) for i in group for j in group if recs[i] != recs[j] and keys[i] != keys[j]]
        if not pairs:
            continue
        a, b = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
        with np.errstate(all="ignore"):
            y = stats_gap({s: t[s][a] for s in R.STATS}, {s: r[s][b] for s in R.STATS}, n[a]) / upd[a]
            # in statistics, an element (max or min) and a sum (mean or norm) must both be nearer: where the update
            # rule fixes every element's value (Adam's or RMSprop's first step from a constant: 1 +- lr), every
            # such tensor has the same extremes and its mean and norm read one number, its count of signs
            near = {s: STAND_OUT * np.abs(t[s][a] - r[s][b]) < np.abs(t[s][a] - r[s][a]) for s in R.STATS}
            y = np.where((near["max"] | near["min"]) & (near["mean"] | near["norm"]), y, np.nan)
        if sk_upd is not None:  # i measured by its sketches: y in the same units, or unknown
            for k, (i, j) in enumerate(pairs):
                if np.isfinite(sk_upd[i]):
                    y[k] = sketch_distance(s_t[i], s_r[j]) / sk_upd[i]
        with np.errstate(all="ignore"):
            ratio = dict(zip(pairs, np.where(y > 0, x[a] / y, np.where(y == 0, np.inf, np.nan))))
        for k, (i, j) in enumerate(pairs):
            both_ways = float(np.minimum(ratio[(i, j)], ratio[(j, i)]))  # (NaN where either is unknown)
            if not np.isnan(both_ways) and not both_ways <= held[i]:  # (held NaN: none yet)
                held[i], gap[i], by[i] = both_ways, y[k], keys[j]
    return held, gap, by


def sketch_distance(a: list | None, b: list | None) -> float:
    """||a - b|| of two sketches of one shape (one map: the tensors' own distance); NaN where either is missing,
    of another length or not finite."""
    if a is None or b is None or not len(a) == len(b) or not len(a):
        return np.nan
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(d)) if np.isfinite(d).all() else np.nan

"""Where an extra (or missing) call sits among repeated calls of the same API, by their values.

The sequence alignment (analysis/align.py) matches records by counter-free name and output shape.  When a run
has k extra calls next to a repeat of the same calls (the target normalises twice: `sub, div, sub, div` where
the reference runs `sub, div`), names alone cannot say which of the repeated calls are the extra ones: every
placement of the k unmatched calls within the repeat matches the same names.  difflib keeps the longest block
of equal names, which puts the extras first.  Here every placement is scored by how many of the tensors of the
record pairs it makes agree within their tolerance (statistics bound of relative L2 error, at the less precise
of the two dtypes and the runs' compute precision); the placement with strictly the most agreeing tensors wins,
else the names' choice stays (a repeat of equal values, relu of relu: any placement is as good).  The extras
are then the calls whose inputs have no counterpart in the other run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dumpstore.dtypes import eps

from .rules import STATS, stats_bound

# (io, index_path) -> (dtype, numel, min, max, mean, norm) of a record's tensor leaves (the statistics in
# analysis/rules.py `STATS` order)
Values = dict[tuple[str, str], tuple]


def agreeing(a: Values, b: Values, tol: Callable[[str | None, str | None], float]) -> int:
    """How many tensor leaves of two records (same io and position) agree within their tolerance: the statistics
    lower bound of relative L2 error of target leaf against reference leaf (analysis/rules.py `stats_bound`), on
    the leaves with all four statistics finite on both sides (its norm case: an integer leaf's max and min, or a
    non-finite norm, say too little to place a call by)."""
    pairs = [(x, y) for where, x in a.items() if (y := b.get(where)) is not None and _finite(x) and _finite(y)]
    if not pairs:
        return 0
    t = {s: np.array([x[2 + k] for x, _ in pairs], dtype=np.float64) for k, s in enumerate(STATS)}
    r = {s: np.array([y[2 + k] for _, y in pairs], dtype=np.float64) for k, s in enumerate(STATS)}
    null = {s: np.zeros(len(pairs), dtype=bool) for s in STATS}  # (none: all four finite)
    sqrt_n = np.sqrt(np.array([x[1] or 1 for x, _ in pairs], dtype=np.float64))
    err, _ = stats_bound(t, r, null, null, sqrt_n, np.zeros(len(pairs), dtype=bool))
    return sum(1 for e, (x, y) in zip(err.tolist(), pairs) if e <= tol(x[0], y[0]))


def _finite(leaf: tuple) -> bool:
    return all(v is not None and math.isfinite(v) for v in leaf[2:])


def tolerance_of(floor: str, for_dtype: Callable[[str | None], float]) -> Callable[[str | None, str | None], float]:
    """The tolerance of a leaf pair: its less precise dtype's, at least the runs' compute precision's (floats)."""

    def tol(a: str | None, b: str | None) -> float:
        floats = [d for d in (a, b) if d is not None and eps(d) is not None]
        if not floats:
            return for_dtype(a or b)
        worst = max(floats + [floor], key=lambda d: eps(d) or 0.0)
        return for_dtype(worst)

    return tol


def place_by_values(
    matched: list[tuple[int, int]],
    keys: tuple[Sequence[str], Sequence[str]],
    score: Callable[[int, int], int],
) -> list[tuple[int, int]]:
    """The matched index pairs (i into the first sequence, j into the second, in order), with the unmatched run
    of each pure insertion (calls in the first sequence only, between two matched pairs) moved to the place
    among the repeat around it where the pairs it leaves agree best by `score(i, j)`; a deletion is the same with
    the sequences swapped (`keys` and `score` are given for the first sequence first)."""
    out = _slide(matched, keys[0], keys[1], score)
    swapped = _slide([(j, i) for i, j in out], keys[1], keys[0], lambda j, i: score(i, j))
    return sorted((i, j) for j, i in swapped)


def _slide(
    matched: list[tuple[int, int]], a: Sequence[str], b: Sequence[str], score: Callable[[int, int], int]
) -> list[tuple[int, int]]:
    """`place_by_values` for the insertions of `a` (runs of `a` unmatched where nothing of `b` is)."""
    partner = dict(matched)
    for p, g in _insertions(partner, len(a), len(b)):
        if (p - 1 if p > 0 else p + g) not in partner:
            continue  # an earlier slide moved its neighbour (not seen in 100,000 random sequences: a guard)
        j0 = partner[p - 1] if p > 0 else partner[p + g] - 1  # the partner of a[p - 1] (before the run)
        left = 0  # a slide left by s: a[p-s .. p-s+g) are the extra calls, a[p+g-s .. p+g) take their partners
        while p - left - 1 >= 0 and partner.get(p - left - 1) == j0 - left and a[p - left - 1] == a[p + g - left - 1]:
            left += 1
        right = 0  # a slide right by s: a[p+s .. p+s+g) are the extra calls, a[p .. p+s) take the partners
        while (
            p + g + right < len(a) and partner.get(p + g + right) == j0 + 1 + right and a[p + right] == a[p + g + right]
        ):
            right += 1
        if not left and not right:
            continue
        lo, hi = p - left, p + g + right
        js = list(range(j0 - left + 1, j0 + right + 1))
        # placement q (the extra calls a[q .. q+g)): js[k] pairs with a[lo+k] for k < q-lo, with a[lo+k+g] after;
        # its score is a prefix of the first sums plus a suffix of the second (2 scores per call, not per pair)
        before, after = [0], [0]
        for k, j in enumerate(js):
            before.append(before[-1] + score(lo + k, j))
        for k in range(len(js) - 1, -1, -1):
            after.append(after[-1] + score(lo + k + g, js[k]))
        scores = {q: before[q - lo] + after[len(js) - (q - lo)] for q in range(lo, p + right + 1)}
        best = max(scores, key=lambda q: (scores[q], q == p))  # the names' placement on a tie
        if best == p:
            continue
        ii = [i for i in range(lo, hi) if not best <= i < best + g]
        for i in range(lo, hi):
            partner.pop(i, None)
        partner.update(zip(ii, js))
    return sorted(partner.items())


def _insertions(partner: dict[int, int], n_a: int, n_b: int) -> list[tuple[int, int]]:
    """(start, length) of each run of unmatched indices of `a` with no unmatched index of `b` beside it (the
    partners of its neighbours are adjacent; at an end, nothing of `b` is left before or after): a pure
    insertion.  None when nothing is matched (no neighbour to slide along)."""
    if not partner:
        return []
    pairs = sorted(partner.items())
    out = []
    bounds = [(-1, -1)] + pairs + [(n_a, n_b)]
    for (i1, j1), (i2, j2) in zip(bounds, bounds[1:]):
        if i2 - i1 > 1 and j2 == j1 + 1:
            out.append((i1 + 1, i2 - i1 - 1))
    return out

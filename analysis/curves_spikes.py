"""Spikes of one training curve: Megatron's spiky-loss factor and an EMA z-score, each judged on the loss's own
scale over the run (curves.py's module doc, spikes; docs/longrun.md, Spikes)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .curves_kernels import ema_outliers

if TYPE_CHECKING:
    from .curves import Series

SPIKE_FACTOR, SPIKE_WINDOW = 10.0, 100
# a spike's jump must be at least SPIKE_LEVEL x the loss's level over the run so far (the largest median of
# LEVEL_WINDOW consecutive steps before it): a loss trained down to 1e-4 that reads 2e-3 is 20 x its median and
# nothing on its own scale (docs/longrun.md, Spikes, says why 0.1)
SPIKE_LEVEL, LEVEL_WINDOW = 0.1, 10
EMA_SPAN, EMA_Z = 100, 6.0


@dataclass
class Spike:
    run: str
    step: int
    value: float
    baseline: float
    rule: str  # factor10 / ema_z
    score: float


def find_spikes(s: Series, run: str) -> list[Spike]:
    """Spikes of one curve: Megatron's factor-10 rule and an EMA z-score, each a jump of at least SPIKE_LEVEL x the
    loss's level over the run; consecutive steps merged."""
    v = s.v
    n = len(v)
    hits: dict[int, Spike] = {}
    if n > 10:
        fin = np.isfinite(v)
        filled = _ffill(v)  # a non-finite value replaced by the one before
        # factor 10 x the median of the previous SPIKE_WINDOW values
        base = _previous_median(filled, SPIKE_WINDOW)
        floor = SPIKE_LEVEL * spike_level(filled)
        with np.errstate(invalid="ignore"):
            hit = np.flatnonzero(fin & (base > 0) & (v > SPIKE_FACTOR * base) & (v - base >= floor))
        for i in hit[hit >= 10]:
            med = float(base[i])
            hits[int(i)] = Spike(run, int(s.x[i]), float(v[i]), med, "factor10", float(v[i] / med))
        for i, x, mean, z in ema_outliers(v, EMA_SPAN, EMA_Z, min_jump=floor):
            if i not in hits:
                hits[i] = Spike(run, int(s.x[i]), x, mean, "ema_z", z)
    merged: list[Spike] = []
    last = -2
    for i in sorted(hits):
        if i == last + 1 and merged:
            if hits[i].value > merged[-1].value:
                merged[-1] = hits[i]
        else:
            merged.append(hits[i])
        last = i
    return merged


def spike_level(v: np.ndarray) -> np.ndarray:
    """Per index i: the loss's level over the run before i, the largest median of a block of LEVEL_WINDOW values
    before it (blocks start at multiples of LEVEL_WINDOW; in the first block the median of the values before i;
    NaN at 0). A median of 10 steps: one spike cannot set it; the start of training usually does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN prefix
        return np.fmax.accumulate(_previous_median(v, LEVEL_WINDOW))


def _ffill(v: np.ndarray) -> np.ndarray:
    ok = np.isfinite(v)
    if ok.all() or not ok.any():
        return v
    idx = np.where(ok, np.arange(len(v)), 0)
    np.maximum.accumulate(idx, out=idx)
    out = v[idx]
    first = int(np.flatnonzero(ok)[0])
    out[:first] = v[first]
    return out


def _previous_median(v: np.ndarray, w: int) -> np.ndarray:
    """Per index i: the median of the previous block of w values (blocks start at multiples of w; the first block
    uses the values before i); NaN at 0."""
    n = len(v)
    out = np.full(n, np.nan)
    for i in range(1, min(w, n)):
        out[i] = np.median(v[:i])
    nb = n // w
    if nb >= 1 and n > w:
        meds = np.median(v[: nb * w].reshape(nb, w), axis=1)
        out[w:] = np.repeat(meds, w)[: n - w]
    return out

"""Per-tensor summaries computed from full data: exact statistics, the deterministic sample, the linear sketch.

All reductions run in float64 over blocks, so memory stays bounded by a block, not by the tensor.

Sample: ``k`` values at positions that depend only on ``numel`` (one per stratum), identical in every run.
Sketch: a linear random-sign fold of the flattened tensor into ``m`` buckets (``m`` a power of two that
divides ``PERIOD``).  Element ``i`` goes to bucket ``i % m`` with sign ``A[i // PERIOD] * H[i % PERIOD]``;
signs do not depend on ``m``, so a sketch with a larger ``m`` folds exactly into one with a smaller ``m``.
Being linear, ``sketch(a) - sketch(b) == sketch(a - b)``: ``|sketch(a) - sketch(b)| / |b|`` estimates the
relative L2 error of the whole tensor with relative standard error about ``sqrt(2 / m)``; tensors with
``numel <= m`` are sketched exactly (their sketch is the signed tensor itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import finfo_max

DEFAULT_SAMPLE_K = 64
DEFAULT_SKETCH_M = 512
PERIOD = 1 << 16
_SEED = 0x5EED_D0_5702E
_BLOCK = 1 << 20  # elements per float64 block (8 MB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 hash of uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _signs(index: np.ndarray, salt: int) -> np.ndarray:
    bits = _splitmix64(index.astype(np.uint64) ^ np.uint64(_SEED ^ salt)) >> np.uint64(63)
    return 1.0 - 2.0 * bits.astype(np.float64)


_H = _signs(np.arange(PERIOD, dtype=np.uint64), 1)
_H0 = _signs(np.zeros(1, dtype=np.uint64), 2)[0] * _H  # signs of the first PERIOD elements


def check_sketch_m(m: int) -> int:
    if m < 1 or m > PERIOD or (m & (m - 1)) != 0:
        raise ValueError(f"sketch size must be a power of two between 1 and {PERIOD}, got {m}")
    return m


@dataclass
class Stats:
    min: float | None
    max: float | None
    mean: float | None
    norm: float | None
    nan_count: int
    posinf_count: int
    neginf_count: int
    zero_count: int
    sat_count: int


def _blocks(flat: np.ndarray):
    for start in range(0, flat.size, _BLOCK):
        yield flat[start:start + _BLOCK]


def tensor_stats(arr: np.ndarray, dtype: str) -> Stats:
    """Exact min, max, mean, L2 norm (float64; NaN propagates as in torch) and value counts."""
    flat = _real_view(arr)
    n = flat.size
    if n == 0:
        return Stats(None, None, None, None, 0, 0, 0, 0, 0)
    total = 0.0
    sumsq = 0.0
    lo, hi = np.inf, -np.inf
    nonzero = 0
    with np.errstate(all="ignore"):
        for blk in _blocks(flat):
            total, sumsq, lo, hi, nonzero = _fold_block(blk, total, sumsq, lo, hi, nonzero)
    nan = posinf = neginf = sat = 0
    if not np.isfinite(total) or np.isnan(lo) or np.isnan(hi):
        nan, posinf, neginf = _nonfinite_counts(flat)
    fmax = finfo_max(dtype)
    if fmax is not None and (nan or abs(lo) >= fmax or abs(hi) >= fmax):
        sat = sum(int(np.count_nonzero(np.abs(b.astype(np.float64)) == fmax)) for b in _blocks(flat))
    if nan:
        lo = hi = float("nan")
    return Stats(lo, hi, total / n, float(np.sqrt(sumsq)), nan, posinf, neginf, n - nonzero, sat)


def _fold_block(blk: np.ndarray, total: float, sumsq: float, lo: float, hi: float, nonzero: int):
    b64 = blk.astype(np.float64, copy=False)
    return (total + float(b64.sum()), sumsq + float(np.einsum("i,i->", b64, b64)), min(lo, float(b64.min())),
            max(hi, float(b64.max())), nonzero + int(np.count_nonzero(blk)))


def _nonfinite_counts(flat: np.ndarray) -> tuple[int, int, int]:
    nan = posinf = neginf = 0
    for blk in _blocks(flat):
        nan += int(np.count_nonzero(np.isnan(blk)))
        posinf += int(np.count_nonzero(blk == np.inf))
        neginf += int(np.count_nonzero(blk == -np.inf))
    return nan, posinf, neginf


def _real_view(arr: np.ndarray) -> np.ndarray:
    """Flattened values as a real array: bool -> uint8, complex -> |x|."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.dtype == np.bool_:
        return flat.view(np.uint8)
    if np.iscomplexobj(flat):
        return np.abs(flat)
    return flat


def sample_positions(numel: int, k: int = DEFAULT_SAMPLE_K) -> np.ndarray:
    """`min(k, numel)` positions, one per stratum, depending only on `numel` and the fixed seed."""
    if numel <= k:
        return np.arange(numel, dtype=np.int64)
    starts = (np.arange(k, dtype=np.int64) * numel) // k
    ends = (np.arange(1, k + 1, dtype=np.int64) * numel) // k
    h = _splitmix64(np.arange(k, dtype=np.uint64) ^ np.uint64(numel * 0x2545F4914F6CDD1D % (1 << 63)))
    return starts + (h % (ends - starts).astype(np.uint64)).astype(np.int64)


def sample(arr: np.ndarray, k: int = DEFAULT_SAMPLE_K) -> np.ndarray:
    flat = _real_view(arr)
    return flat[sample_positions(flat.size, k)].astype(np.float64)


def sketch(arr: np.ndarray, m: int = DEFAULT_SKETCH_M) -> np.ndarray:
    """Linear signed fold of the flattened tensor into `min(m, numel)` float64 buckets."""
    check_sketch_m(m)
    flat = _real_view(arr)
    n = flat.size
    with np.errstate(all="ignore"):  # +inf and -inf in one bucket give NaN; compare skips non-finite tensors
        return _fold(flat, n, m)


def _fold(flat: np.ndarray, n: int, m: int) -> np.ndarray:
    if n < PERIOD:  # one partial row: sign A[0] * H[i], buckets i mod m
        signed = flat.astype(np.float64) * _H0[:n]
        if n <= m:
            return signed
        pad = (-n) % m
        return np.concatenate([signed, np.zeros(pad)]).reshape(-1, m).sum(axis=0)
    out = np.zeros(PERIOD, dtype=np.float64)
    full = n // PERIOD
    rows_per_block = max(1, _BLOCK // PERIOD)
    for r0 in range(0, full, rows_per_block):
        r1 = min(full, r0 + rows_per_block)
        block = flat[r0 * PERIOD:r1 * PERIOD].astype(np.float64).reshape(r1 - r0, PERIOD)
        # einsum, not BLAS: single-threaded and the same sum order whatever the thread settings (a BLAS gemv
        # spawns threads that oversubscribe the cores when ingest workers run side by side)
        out += np.einsum("r,rp->p", _signs(np.arange(r0, r1, dtype=np.uint64), 2), block)
    tail = flat[full * PERIOD:]
    if tail.size:
        out[:tail.size] += _signs(np.array([full], dtype=np.uint64), 2)[0] * tail.astype(np.float64)
    out *= _H
    folded = out.reshape(PERIOD // m, m).sum(axis=0)
    return folded[:min(m, n)]


def fold_sketch(sk: np.ndarray, m: int) -> np.ndarray:
    """Fold a sketch made with a larger bucket count into `m` buckets (signs do not depend on m)."""
    check_sketch_m(m)
    if sk.size <= m:
        return sk
    pad = (-sk.size) % m
    with np.errstate(all="ignore"):  # +inf and -inf in one bucket give NaN, as in sketch()
        return np.concatenate([sk, np.zeros(pad)]).reshape(-1, m).sum(axis=0)

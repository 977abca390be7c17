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

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np

from .dtypes import finfo_max

DEFAULT_SAMPLE_K = 64
DEFAULT_SKETCH_M = 512
PERIOD = 1 << 16
_SEED = 0x5EED_D0_5702E
_BLOCK = 1 << 20  # elements per summation block: sums are numpy's pairwise sums of these blocks, added in order
_FUSED_MIN = 1 << 16  # tensors with more elements are summarised leaf by leaf (_Fused); smaller ones whole
_LEAF = PERIOD  # elements per leaf of _Fused (512 KB as float64): one sketch row
_DOT = 1 << 13  # elements per BLAS dot: OpenBLAS spawns threads for dots over 10000 elements (oversubscription)


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


@functools.cache
def _sign_tables() -> tuple[np.ndarray, np.ndarray]:
    """The PERIOD signs of a position within its sketch row, and the signs of the first PERIOD elements; made on
    first use (7 ms: a statistics ingest summarises no tensor)."""
    h = _signs(np.arange(PERIOD, dtype=np.uint64), 1)
    return h, _signs(np.zeros(1, dtype=np.uint64), 2)[0] * h


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
        yield flat[start : start + _BLOCK]


def tensor_stats(arr: np.ndarray, dtype: str) -> Stats:
    """Exact min, max, mean, L2 norm (float64; NaN propagates as in torch) and value counts."""
    return summarize(arr, dtype, 0, 1)[0]


def summarize(
    arr: np.ndarray, dtype: str, k: int = DEFAULT_SAMPLE_K, m: int = DEFAULT_SKETCH_M
) -> tuple[Stats, np.ndarray, np.ndarray]:
    """(statistics, sample, sketch) of a tensor in one pass: as `tensor_stats`, `sample` and `sketch`.

    Each element is widened to float64 once. Tensors up to `_FUSED_MIN` elements are widened whole; larger ones
    in cache-sized leaves of at most `_LEAF` elements, each used for every reduction and the sketch while in
    cache. Sums follow numpy's pairwise order over blocks of `_BLOCK` elements and the sketch the row order of
    `sketch`, so both equal the whole-array computation bit for bit; the sum of squares may differ from it
    in the last bits (float64 summation order).
    """
    check_sketch_m(m)
    flat = _real_view(arr)
    n = flat.size
    smp = flat[sample_positions(n, k)].astype(np.float64)
    if n == 0:
        return Stats(None, None, None, None, 0, 0, 0, 0, 0), smp, np.zeros(0)
    total, sumsq, lo, hi, zeros, sk = _reduce(flat, m)
    if arr.dtype.kind == "c":  # statistics of |x|, but the sketch of both parts: x and conj(x) must not look equal
        sk = _complex_sketch(arr, m)
    return _finish(flat, dtype, total, sumsq, lo, hi, zeros), smp, sk


def _complex_sketch(arr: np.ndarray, m: int) -> np.ndarray:
    """The sketch of a complex tensor: the linear fold of its real and imaginary parts, interleaved (2 numel values
    into min(m, 2 numel) buckets): ||sketch(x) - sketch(y)|| estimates ||x - y|| over both parts."""
    parts = np.ascontiguousarray(arr).reshape(-1).view(arr.real.dtype)
    return _reduce(parts, m)[5]


class _Scratch(threading.local):
    """Work buffers of one thread, allocated once (fresh large arrays cost a page fault per 4 KB)."""

    def __init__(self) -> None:
        self.buf = np.empty(_LEAF, np.float64)
        self.eq = np.empty(_LEAF, np.bool_)
        self.out = np.empty(PERIOD, np.float64)
        self.part = np.empty(PERIOD, np.float64)
        # the sum of squares of a full leaf: one matmul of _LEAF // _DOT stacked dots of _DOT elements each
        self.rows = self.buf.reshape(-1, 1, _DOT)
        self.cols = self.buf.reshape(-1, _DOT, 1)


_SCRATCH = _Scratch()


def _reduce(flat: np.ndarray, m: int) -> tuple[float, float, float, float, int, np.ndarray]:
    """(sum, sum of squares, min, max, zero count, sketch) of a non-empty flat real array."""
    n = flat.size
    with np.errstate(all="ignore"):  # +inf and -inf in one bucket give NaN; compare skips non-finite tensors
        if n > _FUSED_MIN:
            return _Fused(flat, m, _SCRATCH).run()
        b64 = _SCRATCH.buf[:n]
        np.copyto(b64, flat, casting="unsafe")
        total = float(np.add.reduce(b64))
        if n <= _DOT:  # one BLAS dot below OpenBLAS's threading threshold
            sumsq = float(np.dot(b64, b64))
        else:
            sumsq = 0.0
            for i in range(0, n, _DOT):
                c = b64[i : i + _DOT]
                sumsq += float(np.dot(c, c))
        lo, hi = float(np.minimum.reduce(b64)), float(np.maximum.reduce(b64))
        zeros = n - int(np.count_nonzero(b64))  # NaN counts as non-zero, -0.0 as zero (as b64 == 0)
        return total, sumsq, lo, hi, zeros, _fold64(b64, n, m)


def _finish(flat: np.ndarray, dtype: str, total: float, sumsq: float, lo: float, hi: float, zeros: int) -> Stats:
    n = flat.size
    total = 0.0 + total  # -0.0 sums to +0.0, as a running total started at 0.0
    nan = posinf = neginf = sat = 0
    if not math.isfinite(total) or math.isnan(lo) or math.isnan(hi):
        nan, posinf, neginf = _nonfinite_counts(flat)
    fmax = finfo_max(dtype)
    if fmax is not None and (nan or abs(lo) >= fmax or abs(hi) >= fmax):
        sat = sum(int(np.count_nonzero(np.abs(b.astype(np.float64)) == fmax)) for b in _blocks(flat))
    if nan:
        lo = hi = float("nan")
    return Stats(lo, hi, total / n, math.sqrt(sumsq), nan, posinf, neginf, zeros, sat)


class _Fused:
    """One cache-blocked pass over a large tensor: sum, sum of squares, min, max, zero count and sketch.

    Leaves are visited in index order by numpy's pairwise recursion within each `_BLOCK`, so the leaf sums
    combine into exactly numpy's `sum` of the block; a leaf of a full block is one sketch row. The sketch adds
    each full row (`PERIOD` elements, sign ``A[row]``) into a group partial that is flushed into the total
    every `_BLOCK` elements (16 rows), then adds the tail row, then applies ``H`` and folds: the operations of
    `_fold64`, in its order.
    """

    def __init__(self, flat: np.ndarray, m: int, scratch: _Scratch) -> None:
        self.flat, self.m = flat, m
        n = flat.size
        self.full = n // PERIOD
        self.row_sign = _signs(np.arange(self.full + 1, dtype=np.uint64), 2) > 0
        self.buf, self.eq, self.rows, self.cols = scratch.buf, scratch.eq, scratch.rows, scratch.cols
        # the full leaves' matmuls write into `dots` (a slot per dot of the full blocks), added up at the end
        self.dots = np.zeros(((n // _BLOCK) * (_BLOCK // _DOT), 1, 1), np.float64)
        self.out, self.part = scratch.out, scratch.part
        self.out.fill(0.0)
        self.part.fill(0.0)
        # min, max and zero test on the stored values where numpy has fast loops for them (same results:
        # widening to float64 is exact and monotonic), else on the widened leaf
        self.native = flat.dtype.kind in "iu" or flat.dtype in (np.float32, np.float64)
        self.sumsq = 0.0
        self.lo, self.hi = np.inf, -np.inf
        self.zeros = 0

    def run(self) -> tuple[float, float, float, float, int, np.ndarray]:
        n = self.flat.size
        total = 0.0
        for start in range(0, n - _BLOCK + 1, _BLOCK):  # full blocks: 16 rows, a leaf each
            total += float(self._walk(start, _BLOCK))
            self._flush()
        start = n - n % _BLOCK
        if start < n:  # the last partial block: leaves at numpy's split points, which may span rows
            total += float(self._walk(start, n - start))
            self._flush()  # its full rows, when it has no tail
        sumsq = float(np.add.reduce(self.dots, axis=None)) + self.sumsq
        lo, hi = _zero_extremes(self.flat, float(self.lo), float(self.hi), self.zeros)
        out = self.out
        out *= _sign_tables()[0]
        folded = out.reshape(PERIOD // self.m, self.m).sum(axis=0)  # a new array: `out` is scratch
        return total, sumsq, lo, hi, self.zeros, folded[: min(self.m, n)]

    def _walk(self, off: int, n: int) -> float:
        """numpy's pairwise_sum split: halves rounded down to a multiple of 8, down to leaves of <= _LEAF."""
        if n <= _LEAF:
            return self._leaf(off, n)
        half = n // 2
        half -= half % 8
        return self._walk(off, half) + self._walk(off + half, n - half)

    def _leaf(self, off: int, n: int) -> float:
        src = self.flat[off : off + n]
        whole = n == _LEAF and off % _LEAF == 0 and off // _LEAF < self.full  # one full sketch row
        b = self.buf if n == _LEAF else self.buf[:n]
        np.copyto(b, src, casting="unsafe")
        s = float(np.add.reduce(b))
        if whole and off < self.dots.shape[0] * _DOT:
            i = off // _DOT
            np.matmul(self.rows, self.cols, out=self.dots[i : i + _LEAF // _DOT])
        else:
            for i in range(0, n, _DOT):  # dots below OpenBLAS's threading threshold
                c = b[i : i + _DOT]
                self.sumsq += float(np.dot(c, c))
        v = src if self.native else b
        lo, hi = np.minimum.reduce(v), np.maximum.reduce(v)
        if lo < self.lo:  # as min()/max() of the block results (NaN is settled by _finish)
            self.lo = lo
        if hi > self.hi:
            self.hi = hi
        z = self.eq if n == _LEAF else self.eq[:n]
        np.equal(v, 0, out=z)
        self.zeros += int(np.count_nonzero(z))
        if whole:
            (np.add if self.row_sign[off // PERIOD] else np.subtract)(self.part, b, out=self.part)
        else:
            self._sketch(off, b)
        return s

    def _sketch(self, base: int, b: np.ndarray) -> None:
        """Add a leaf that is not one full row: pieces of rows, or of the tail."""
        off, end = base, base + b.size
        while off < end:
            row = off // PERIOD
            stop = min(end, (row + 1) * PERIOD)
            piece = b[off - base : stop - base]
            col = off - row * PERIOD
            if row < self.full:
                seg = self.part[col : col + piece.size]
                (np.add if self.row_sign[row] else np.subtract)(seg, piece, out=seg)
            else:  # the tail: added to the total after all rows, with its row's sign
                self._flush()
                seg = self.out[col : col + piece.size]
                seg += (1.0 if self.row_sign[row] else -1.0) * piece
            off = stop

    def _flush(self) -> None:
        self.out += self.part
        self.part.fill(0.0)


def _zero_extremes(flat: np.ndarray, lo: float, hi: float, zeros: int) -> tuple[float, float]:
    """The sign of a zero min or max when a float tensor holds both +0.0 and -0.0.

    Which zero numpy's min/max returns depends on its reduction order; the leaves of `_Fused` reduce in another
    order than whole blocks do, so in that one case the zero extreme is taken again block by block (as the
    whole-tensor reductions do). Detected with one integer compare on the stored bits, only for tensors whose
    min or max is zero.
    """
    if not zeros or (lo != 0 and hi != 0) or flat.dtype.kind != "f":
        return lo, hi
    bits = np.dtype(f"u{flat.dtype.itemsize}")
    negzero = bits.type(1 << (8 * flat.dtype.itemsize - 1))
    negzeros = sum(int(np.count_nonzero(b.view(bits) == negzero)) for b in _blocks(flat))
    if negzeros in (0, zeros):
        return lo, hi
    if lo == 0:
        lo = min([np.inf] + [float(np.minimum.reduce(b.astype(np.float64))) for b in _blocks(flat)])
    if hi == 0:
        hi = max([-np.inf] + [float(np.maximum.reduce(b.astype(np.float64))) for b in _blocks(flat)])
    return lo, hi


def _nonfinite_counts(flat: np.ndarray) -> tuple[int, int, int]:
    nan = posinf = neginf = 0
    for blk in _blocks(flat):
        nan += int(np.count_nonzero(np.isnan(blk)))
        posinf += int(np.count_nonzero(blk == np.inf))
        neginf += int(np.count_nonzero(blk == -np.inf))
    return nan, posinf, neginf


def _real_view(arr: np.ndarray) -> np.ndarray:
    """Flattened values as a real array: bool -> uint8, complex -> |x|."""
    if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    flat = arr.reshape(-1)
    kind = flat.dtype.kind
    if kind == "b":
        return flat.view(np.uint8)
    if kind == "c":
        return np.abs(flat)
    return flat


@functools.lru_cache(maxsize=4096)
def sample_positions(numel: int, k: int = DEFAULT_SAMPLE_K) -> np.ndarray:
    """`min(k, numel)` positions, one per stratum, depending only on `numel` and the fixed seed (read-only)."""
    pos = _sample_positions(numel, k)
    pos.flags.writeable = False
    return pos


def _sample_positions(numel: int, k: int) -> np.ndarray:
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
    if flat.size and arr.dtype.kind == "c":
        return _complex_sketch(arr, m)
    return _reduce(flat, m)[5] if flat.size else np.zeros(0)


def _fold64(b64: np.ndarray, n: int, m: int) -> np.ndarray:
    """The sketch of a tensor already widened to float64 (a scratch buffer: overwritten), as a new array."""
    if n < PERIOD:  # one partial row: sign A[0] * H[i], buckets i mod m, rows of m added in order
        if n <= m:
            return np.multiply(b64, _sign_tables()[1][:n])
        signed = np.multiply(b64, _sign_tables()[1][:n], out=b64)
        rows = n // m
        folded = signed[: rows * m].reshape(rows, m).sum(axis=0)
        folded[: n - rows * m] += signed[rows * m :]  # the last, partial row (zero padded, as it were)
        return folded
    out = np.zeros(PERIOD, dtype=np.float64)
    full = n // PERIOD
    rows_per_block = max(1, _BLOCK // PERIOD)
    for r0 in range(0, full, rows_per_block):
        r1 = min(full, r0 + rows_per_block)
        block = b64[r0 * PERIOD : r1 * PERIOD].reshape(r1 - r0, PERIOD)
        # einsum, not BLAS: single-threaded and the same sum order whatever the thread settings (a BLAS gemv
        # spawns threads that oversubscribe the cores when ingest workers run side by side)
        out += np.einsum("r,rp->p", _signs(np.arange(r0, r1, dtype=np.uint64), 2), block)
    tail = b64[full * PERIOD :]
    if tail.size:
        out[: tail.size] += _signs(np.array([full], dtype=np.uint64), 2)[0] * tail
    out *= _sign_tables()[0]
    folded = out.reshape(PERIOD // m, m).sum(axis=0)
    return folded[: min(m, n)]


def fold_sketch(sk: np.ndarray, m: int) -> np.ndarray:
    """Fold a sketch made with a larger bucket count into `m` buckets (signs do not depend on m)."""
    check_sketch_m(m)
    if sk.size <= m:
        return sk
    pad = (-sk.size) % m
    with np.errstate(all="ignore"):  # +inf and -inf in one bucket give NaN, as in sketch()
        return np.concatenate([sk, np.zeros(pad)]).reshape(-1, m).sum(axis=0)

"""The one-pass summaries (dumpstore.summary.summarize) against plain definitions, on both of its paths.

Tensors above `_FUSED_MIN` elements go through the cache-blocked pass; its sum, min, max, counts and sketch must
equal, bit for bit, what whole-array numpy computes over the same blocks, and its norm within float64 rounding.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dumpstore import summary
from dumpstore.summary import PERIOD

BLOCK = summary._BLOCK
SIZES = [
    1,
    100,
    512,
    513,
    4097,
    PERIOD - 1,
    PERIOD,
    PERIOD + 1,
    3 * PERIOD + 5,
    200_003,
    BLOCK,
    BLOCK + 1,
    BLOCK + 3 * PERIOD + 17,
    3 * BLOCK - 3,
]


def _bits(x: float | None) -> int | None:
    return None if x is None else int(np.float64(x).view(np.uint64))


def _reference(a: np.ndarray, dtype: str, m: int):
    """Statistics from their definitions: float64 sums of _BLOCK blocks added in order, Python min/max of the
    block results, counts, and the sketch as a scatter-add of signed elements into buckets i mod m."""
    flat = np.abs(a.ravel()) if a.dtype.kind == "c" else a.ravel().astype(np.float64)
    flat = flat.astype(np.float64)
    blocks = [flat[i : i + BLOCK] for i in range(0, flat.size, BLOCK)]
    total = 0.0
    for b in blocks:
        total += float(b.sum())
    lo = min([np.inf] + [float(b.min()) for b in blocks])
    hi = max([-np.inf] + [float(b.max()) for b in blocks])
    # a complex tensor's sketch folds its real and imaginary parts, interleaved (x and conj(x) differ: issue 24)
    parts = a.ravel().view(a.real.dtype).astype(np.float64) if a.dtype.kind == "c" else flat
    return (total, lo, hi, int(np.count_nonzero(flat == 0)), float(np.sqrt(np.sum(flat * flat))), _fold(parts, m))


def _fold(flat: np.ndarray, m: int) -> np.ndarray:
    idx = np.arange(flat.size, dtype=np.uint64)
    sign = (
        summary._signs(idx // np.uint64(PERIOD), 2)
        * summary._sign_tables()[0][(idx % np.uint64(PERIOD)).astype(np.int64)]
    )
    with np.errstate(all="ignore"):
        sk = np.bincount((idx % np.uint64(m)).astype(np.int64), weights=sign * flat, minlength=min(m, flat.size))
    return sk[: min(m, flat.size)]


def _cases(n: int, rng: np.random.Generator):
    x = rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 3)
    f32 = x.astype(np.float32)
    yield "float32", f32
    yield "float64", x
    yield "float16", np.clip(x, -6e4, 6e4).astype(np.float16)
    yield "int64", (x * 1e6).astype(np.int64)
    yield "bool", x > 0
    yield "complex64", (x + 1j * x[::-1]).astype(np.complex64)
    if n > 10:
        y = f32.copy()
        y[: n // 3] = 0.0
        y[n // 2] = np.finfo(np.float32).max
        yield "float32", y
        y = np.abs(f32)
        y[::3] = -0.0
        y[n // 2 :] = 0.0  # min is a zero, both signs present
        yield "float32", y
        y = -np.abs(f32)
        y[1::3] = 0.0
        y[: n // 2] = -0.0  # max is a zero, both signs present
        yield "float32", y


@pytest.mark.parametrize("n", SIZES)
def test_summarize_matches_definitions(n: int) -> None:
    rng = np.random.default_rng(n)
    for dtype, a in _cases(n, rng):
        s, smp, sk = summary.summarize(a, dtype, 64, 512)
        total, lo, hi, zeros, norm, ref_sk = _reference(a, dtype, 512)
        assert _bits(s.mean) == _bits(total / n), (dtype, n)
        assert (_bits(s.min), _bits(s.max)) == (_bits(lo), _bits(hi)), (dtype, n)
        assert s.zero_count == zeros
        assert s.norm == pytest.approx(norm, rel=1e-12)
        assert sk.shape == ref_sk.shape
        assert np.max(np.abs(sk - ref_sk), initial=0.0) <= 1e-12 * max(np.linalg.norm(ref_sk), 1e-300)
        flat = np.abs(a.ravel()) if a.dtype.kind == "c" else a.ravel()
        assert np.array_equal(smp, flat[summary.sample_positions(n, 64)].astype(np.float64))
        assert np.array_equal(sk, summary.sketch(a, 512))
        st = summary.tensor_stats(a, dtype)
        assert (_bits(st.min), _bits(st.max), _bits(st.mean), st.zero_count) == (
            _bits(s.min),
            _bits(s.max),
            _bits(s.mean),
            s.zero_count,
        )


@pytest.mark.parametrize("n", [PERIOD + 1, BLOCK + 3 * PERIOD + 17])
def test_nonfinite_and_saturation_counts(n: int) -> None:
    a = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    a[[5, n // 2, n - 1]] = [np.nan, np.inf, -np.inf]
    a[7] = np.finfo(np.float32).max
    s, _smp, _sk = summary.summarize(a, "float32")
    assert (s.nan_count, s.posinf_count, s.neginf_count, s.sat_count) == (1, 1, 1, 1)
    assert np.isnan(s.min) and np.isnan(s.max) and np.isnan(s.mean)
    a[5] = 0.0
    s, _smp, _sk = summary.summarize(a, "float32")
    assert (s.nan_count, s.min, s.max) == (0, -np.inf, np.inf)


@pytest.mark.parametrize("m", [1, 64, 512, PERIOD])
def test_sketch_sizes_fold(m: int) -> None:
    a = np.random.default_rng(2).standard_normal(BLOCK + 12345).astype(np.float32)
    big = summary.sketch(a, PERIOD)
    assert np.allclose(summary.fold_sketch(big, m), summary.sketch(a, m), rtol=1e-12, atol=1e-9)


def test_results_do_not_alias_scratch_buffers() -> None:
    rng = np.random.default_rng(3)
    small, large = rng.standard_normal(300), rng.standard_normal(3 * PERIOD)
    first = [summary.summarize(small, "float64"), summary.summarize(large, "float64")]
    keep = [(smp.copy(), sk.copy()) for _s, smp, sk in first]
    summary.summarize(rng.standard_normal(PERIOD), "float64")
    summary.summarize(rng.standard_normal(5 * PERIOD), "float64")
    for (_s, smp, sk), (smp0, sk0) in zip(first, keep):
        assert np.array_equal(smp, smp0) and np.array_equal(sk, sk0)


def test_threads_use_their_own_buffers() -> None:
    arrays = [np.random.default_rng(i).standard_normal(2 * PERIOD + i) for i in range(4)]
    want = [summary.summarize(a, "float64")[2] for a in arrays]
    got: dict[int, list[np.ndarray]] = {}

    def work(i: int) -> None:
        got[i] = [summary.summarize(arrays[i], "float64")[2] for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(sk, want[i]) for i in range(4) for sk in got[i])


def test_empty_and_scalar() -> None:
    s, smp, sk = summary.summarize(np.zeros((0, 3), np.float32), "float32")
    assert s.min is None and s.zero_count == 0 and smp.size == 0 and sk.size == 0
    s, smp, sk = summary.summarize(np.array(-0.0, np.float32), "float32")
    assert s.zero_count == 1 and smp.tolist() == [-0.0] and sk.size == 1

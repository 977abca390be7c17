"""metrics.tensor_metrics_many: the values of tensor_metrics, pair by pair, for pairs computed together."""

from __future__ import annotations

import numpy as np
import pytest

from dumpstore.analysis import metrics


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (as the .pt reader widens them)."""
    bits = np.asarray(a, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def _pairs() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(17)
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for size in (2, 3, 7, 64, 1000, 5000, 20000):
        for dtype in (np.float32, np.float16, np.float64):
            x = rng.standard_normal(size).astype(dtype)
            out += [
                (x, x),  # one content on both sides
                (x, (x * (1 + 1e-3 * rng.standard_normal(size))).astype(dtype)),
                (x.reshape(1, -1), x[::-1].copy()),  # squeezed to one shape
                (np.zeros(size, dtype), x),
                (x, np.zeros(size, dtype)),
                (np.zeros(size, dtype), np.zeros(size, dtype)),
                (-x, x),
            ]
        x = rng.standard_normal(size).astype(np.float32)
        tiny, huge = x.astype(np.float64) * 1e-200, x.astype(np.float64) * 1e300
        out += [
            (_bf16(x), x),
            (_bf16(x), _bf16(x * 1.01)),
            (tiny, tiny * 1.5),  # squares underflow
            (huge, huge * 0.5),  # squares overflow
            (np.where(x > 0, x, 0).astype(np.float32), x),  # zeros in the bench only here and there
            (np.full(size, np.finfo(np.float32).max, np.float32), -np.full(size, np.finfo(np.float32).max, np.float32)),
            (x.astype(np.float16), x),  # dtypes differ
            ((x * 10).astype(np.int64), (x * 10).astype(np.int64) + 1),
            (x > 0, x > 0.1),
        ]
        with_nan = x.copy()
        with_nan[::3] = np.nan
        with_inf = x.copy()
        with_inf[1::4] = np.inf
        with_inf[2::4] = -np.inf
        out += [(with_nan, with_nan), (with_nan, x), (with_inf, with_inf), (x, with_inf), (with_inf, -with_inf)]
    scalar = np.array(2.5, np.float32)
    out += [
        (scalar, scalar),
        (scalar, np.array(0.0, np.float32)),
        (np.array([3.0], np.float32), np.array([3.5], np.float32)),  # one element: 0-d once squeezed
        (np.array(np.nan, np.float32), np.array(np.nan, np.float32)),
        (np.ones((0, 3), np.float32), np.ones((0, 3), np.float32)),
        (np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)),
        (np.ones(3, np.float32), np.ones(4, np.float32)),
    ]
    order = rng.permutation(len(out))  # dtypes and sizes interleaved, as in a dump
    return [out[i] for i in order]


@pytest.mark.parametrize("together", [metrics._TOGETHER, 1 << 10, 7])
def test_many_gives_what_one_by_one_gives(monkeypatch, together):
    monkeypatch.setattr(metrics, "_TOGETHER", together)
    pairs = _pairs()
    with np.errstate(all="ignore"):
        expected = [repr(metrics.tensor_metrics(a, b)) for a, b in pairs]
        got = metrics.tensor_metrics_many(pairs)
    computed = [i for i, tm in enumerate(got) if tm is not None]
    assert len(computed) >= 40  # pairs of several sizes and dtypes took the common path
    for i in computed:
        assert repr(got[i]) == expected[i], (pairs[i][0].dtype, pairs[i][0].shape)


def test_many_leaves_the_uncommon_paths_to_tensor_metrics():
    x = np.arange(4, dtype=np.float32)
    nan = x.copy()
    nan[0] = np.nan
    pairs = [
        (x, x + 1),
        (np.array(1.0, np.float32), np.array(2.0, np.float32)),  # 0-d
        (nan, x),  # not finite
        (x, x.astype(np.float64)),  # dtypes differ
        (x.astype(np.int32), x.astype(np.int32)),  # not float
        (x, x[:3]),  # shapes differ
        (np.ones(metrics._TOGETHER + 1, np.float32), np.ones(metrics._TOGETHER + 1, np.float32)),  # large
    ]
    assert [tm is not None for tm in metrics.tensor_metrics_many(pairs)] == [True] + [False] * 6


def test_many_does_not_change_its_inputs():
    rng = np.random.default_rng(3)
    pairs = [(rng.standard_normal(50).astype(np.float32), np.zeros(50, np.float32)) for _ in range(3)]
    before = [(a.copy(), b.copy()) for a, b in pairs]
    metrics.tensor_metrics_many(pairs)
    for (a, b), (a0, b0) in zip(pairs, before):
        assert np.array_equal(a, a0) and np.array_equal(b, b0)


def test_sums_are_numpys_own():
    """Cosine, EucDist and rel_l2 come from np.linalg.norm's and np.dot's sums (their rounding depends on the
    order of the sum: the values msprobe computes with them)."""
    rng = np.random.default_rng(5)
    pairs = [
        (rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32))
        for n in (7, 999, 4096, 12345)
        for _ in range(5)
    ]
    for tm, (a, b) in zip(metrics.tensor_metrics_many(pairs), pairs):
        x, y = a.astype(float), b.astype(float)
        assert tm is not None
        assert tm.cosine == float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y)))
        assert tm.euc_dist == float(np.linalg.norm(x - y, ord=2))
        assert tm.rel_l2 == float(np.linalg.norm(x - y, ord=2)) / float(np.linalg.norm(y))

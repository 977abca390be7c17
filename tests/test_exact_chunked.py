"""`--exact` on large tensors compares them in chunks (bounded memory, issue 24): the same cells and values as the
whole-array computation, on random pairs with NaN/Inf, mixed dtypes and extreme magnitudes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dumpstore.analysis import exact, metrics


def _pairs(seed: int):
    rng = np.random.default_rng(seed)
    for i in range(40):
        size = int(rng.integers(2, 5000))
        dtype = rng.choice([np.float32, np.float16, np.float64])
        y = (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
        x = (y + rng.standard_normal(size).astype(dtype) * dtype(10.0 ** rng.integers(-6, 0))).astype(dtype)
        if i % 3 == 0:  # NaN/Inf at the same positions
            where = rng.choice(size, max(1, size // 50), replace=False)
            x[where] = y[where] = rng.choice([np.inf, -np.inf, np.nan])
        if i % 5 == 0:  # a NaN/Inf that moves
            x[0], x[-1] = np.nan, x[0]
        if i % 7 == 0:
            y = y.astype(np.float64)  # dtypes differ
        if i % 11 == 0:
            x, y = np.zeros_like(x), np.zeros_like(y)  # all zero
        if i % 13 == 0:
            x = x.astype(np.float64) * 1e160
            y = y.astype(np.float64) * 1e160  # squares overflow float64
        yield x.reshape(-1, 2) if size % 2 == 0 else x, y.reshape(-1, 2) if size % 2 == 0 else y


def _same(a, b) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == pytest.approx(b, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chunked_metrics_equal_whole_array(seed, monkeypatch):
    pairs = list(_pairs(seed))
    whole = [metrics.tensor_metrics(x, y) for x, y in pairs]
    monkeypatch.setattr(metrics, "LARGE", 1)
    monkeypatch.setattr(metrics, "CHUNK", 97)
    chunked = [metrics.tensor_metrics(x, y) for x, y in pairs]
    for (x, _y), a, b in zip(pairs, whole, chunked):
        for f in ("cosine", "euc_dist", "max_abs_err", "max_rel_err", "one_thousandth", "five_thousandth", "rel_l2"):
            assert _same(getattr(a, f), getattr(b, f)), (f, x.size, getattr(a, f), getattr(b, f))
        assert a.nonfinite_mismatch == b.nonfinite_mismatch and a.message == b.message
        for col in metrics.TENSOR_COLUMNS:
            assert _same(a.msprobe[col], b.msprobe[col]) or abs(float(a.msprobe[col]) - float(b.msprobe[col])) <= 2e-12
    for x, y in pairs:
        cos, max_abs = metrics.large_finite_cosine_and_max_abs(x, y)
        assert _same(cos, metrics.cosine(x, y))
        assert _same(max_abs, exact._finite_max_abs(x, y))

"""Small tensors (the whole-array path, up to one fused leaf): zero counts and sums of squares by definition."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dumpstore import summary


@pytest.mark.parametrize("n", [1, 2, 511, 512, 513, 8191, 8192, 8193, 20_000, 65_536])
def test_small_tensor_counts_and_norm(n):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float32)
    a[rng.integers(0, n, max(1, n // 7))] = 0.0
    a[rng.integers(0, n, max(1, n // 11))] = -0.0
    if n > 3:
        a[:3] = [np.nan, np.inf, -np.inf]
    s, _sample, _sketch = summary.summarize(a, "float32")
    a64 = a.astype(np.float64)
    assert s.zero_count == int(np.count_nonzero(a64 == 0))  # -0.0 is zero, NaN is not
    assert (s.nan_count, s.posinf_count, s.neginf_count) == ((1, 1, 1) if n > 3 else (0, 0, 0))
    clean = np.nan_to_num(a64, nan=0.0, posinf=0.0, neginf=0.0)
    norm = summary.summarize(clean.astype(np.float32), "float32")[0].norm
    # the sum of squares: one BLAS dot per 8192 elements, added in order
    assert norm == math.sqrt(sum(float(np.dot(c, c)) for c in np.split(clean, range(8192, n, 8192))))

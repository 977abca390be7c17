"""The judging rules (analysis/rules.py) on hand-computed cases: each rule has one definition, used by the
detailed comparison, the screen and the exact metrics alike."""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from dumpstore.analysis import rules as R


def _bound(t: list[float | None], r: list[float | None], n: int = 4, nonfinite: bool = False) -> float | None:
    df = pl.DataFrame(
        {
            **{s: [v] for s, v in zip(R.STATS, t)},
            **{f"ref_{s}": [v] for s, v in zip(R.STATS, r)},
            "numel": [n],
            "ref_numel": [n],
            "nonfinite_mismatch": [nonfinite],
        },
        schema_overrides={s: pl.Float64 for s in R.STATS} | {f"ref_{s}": pl.Float64 for s in R.STATS},
    )
    return R.stats_columns(df)["_st_err"][0]


def test_statistics_bound_by_norm_takes_the_largest_difference():
    # min, max, mean, norm: |dMean| * sqrt(4) = 0.2 is the largest of 0.1, 0.05, 0.2, 0.0; ||y|| = 2
    assert _bound([0.0, 1.1, 0.6, 2.0], [0.1, 1.05, 0.5, 2.0]) == (0.6 - 0.5) * 2 / 2.0


def test_statistics_bound_edge_cases():
    assert _bound([0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]) == 0.0  # 0/0: equal
    assert _bound([0.0, 1.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0]) == math.inf  # reference all zero
    assert _bound([1.0, 3.0, None, None], [1.0, 2.0, None, None]) == 0.5  # no norms: range of the reference
    assert _bound([None] * 4, [None] * 4) is None  # nothing known
    nan = float("nan")
    # equal non-finite statistics hide the finite values: unknown, never 0 (issue 24) ...
    assert _bound([nan, nan, nan, nan], [nan, nan, nan, nan]) is None
    assert _bound([1.0, math.inf, math.inf, math.inf], [1.0, math.inf, math.inf, math.inf]) is None
    # ... unless nothing is finite: every element +Inf in both
    assert _bound([math.inf] * 4, [math.inf] * 4) == 0.0
    assert _bound([0.0, 1.0, 0.5, math.inf], [0.0, 1.0, 0.5, 1.0]) == math.inf


def test_status_and_severity_rules_serve_numpy_polars_and_floats():
    assert R.diverges(0.2, 0.1, False) and not R.diverges(0.1, 0.1, False) and R.diverges(0.0, 0.1, True)
    np.testing.assert_array_equal(R.exceeds(np.array([0.1, 0.3]), np.array([0.2, 0.2])), [False, True])
    df = pl.DataFrame({"err": [0.3], "tol": [0.2], "nonfinite_mismatch": [False]})
    assert df.select(R.diverges(pl.col("err"), pl.col("tol"), pl.col("nonfinite_mismatch"))).item()
    np.testing.assert_array_equal(
        R.severity(np.array([0.4, 0.0, 1.0]), np.array([0.2, 0.0, 0.0])), [2.0, 0.0, math.inf]
    )


def test_compute_precision_is_the_least_precise_common_dtype():
    assert R.compute_dtype_from_counts({"float32": 80, "bfloat16": 20}) == "bfloat16"
    assert R.compute_dtype_from_counts({"float32": 95, "bfloat16": 5}) == "float32"
    assert R.compute_dtype_from_counts({}) == "float32"
    assert R.floor_of("float32", "bfloat16") == "bfloat16"

"""Tests for dumpstore.analysis.metrics: msprobe 26.2.0 tensor / statistics compare cells, rel_l2, cosine.

Three layers: the hand-written edge-case tables of MSPROBE_FORMAT.md §5.4 and §5.5; a live cross-check
against msprobe's own functions (skipped without mindstudio-probe); and a check against
tests/data/metrics_expected.json, generated from msprobe by
`DUMPSTORE_REGEN=1 pytest tests/test_metrics.py -k regenerate`, which runs anywhere.
"""

from __future__ import annotations

import ast
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dumpstore.analysis import metrics
from dumpstore.analysis.metrics import (
    TENSOR_COLUMNS,
    TensorMetrics,
    cosine,
    rel_l2,
    stats_diff,
    tensor_metrics,
)

EXPECTED = Path(__file__).parent / "data" / "metrics_expected.json"
STAT_KEYS = ("Max", "Min", "Mean", "Norm")
DIFF_COLS = ("Max diff", "Min diff", "Mean diff", "L2norm diff")
REL_COLS = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")
PLAIN = (("max_diff", "max_rel"), ("min_diff", "min_rel"), ("mean_diff", "mean_rel"), ("norm_diff", "norm_rel"))
F32, F16 = np.float32, np.float16
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- cases


def _tensor_cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, npu, bench) pairs: the §5.4 table plus seeded random pairs of every kind the brief lists."""
    rng = np.random.default_rng(20260202)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(F32)

    x, y = normal(64), normal(3, 17)
    with_zeros = normal(50)
    with_zeros[::5] = 0.0
    nan_b = normal(40)
    nan_b[[3, 7, 30]] = np.nan
    nan_n = (nan_b * (1 + 1e-3 * rng.standard_normal(40))).astype(F32)
    inf_b = normal(40)
    inf_b[[1, 2]] = [np.inf, -np.inf]
    inf_n = inf_b.copy()
    inf_n[1] = -np.inf
    small = (normal(1000) * 1e-10).astype(F32)
    near = normal(200)
    return [
        ("identical", x, x.copy()),
        ("both_zero", np.zeros(8, F32), np.zeros(8, F32)),
        ("nan_same", np.array([np.nan, 1, 2], F32), np.array([np.nan, 1, 2], F32)),
        ("inf_sign", np.array([np.inf, 1, 2], F32), np.array([-np.inf, 1, 2], F32)),
        ("tiny_vs_zero", np.array([1e-3, 0, 1], F32), np.array([0, 0, 1], F32)),
        ("zeros_vs_ones", np.zeros(10, F32), np.ones(10, F32)),
        ("ones_vs_zeros", np.ones(10, F32), np.zeros(10, F32)),
        ("scalar_0d", np.array(1.5, F32), np.array(1.4, F32)),
        ("scalar_1", np.array([1.5], F32), np.array([1.4], F32)),
        ("scalar_nan", np.array(np.nan, F32), np.array(1.0, F32)),
        ("scalar_zero_bench", np.array(0.5, F32), np.array(0.0, F32)),
        ("nan_vs_zero", np.array([np.nan, 1, 2], F32), np.array([0, 1, 2], F32)),
        ("linspace_fp16_fp32", np.linspace(-3, 3, 100).astype(F16), np.linspace(-3, 3, 100).astype(F32)),
        ("shape_unmatched", np.ones((2, 3), F32), np.ones((3, 2), F32)),
        ("empty", np.ones((0, 4), F32), np.ones((0, 4), F32)),
        ("bench_empty", np.ones(4, F32), np.ones(0, F32)),
        ("fp32_random", x, normal(64)),
        ("fp32_2d", y, (y + 0.01 * normal(3, 17)).astype(F32)),
        ("fp16_rounded", y.astype(F16), y),
        ("fp16_both", x.astype(F16), (x * 1.001).astype(F16)),
        ("with_zeros", with_zeros, (with_zeros * (1 + 1e-4 * rng.standard_normal(50))).astype(F32)),
        ("zeros_bench_only", (with_zeros + 1e-6).astype(F32), with_zeros),
        ("nan_same_positions", nan_n, nan_b),
        ("inf_same_positions", inf_n, inf_b),
        ("perturbed_1pct", (near * (1 + 0.01 * rng.standard_normal(200))).astype(F32), near),
        ("perturbed_0.03pct", (near * (1 + 3e-4 * rng.standard_normal(200))).astype(F32), near),
        ("cosine_above_0.9999", (near + 0.005 * normal(200)).astype(F32), near),
        ("anti_correlated", -x, x),
        ("row_vs_flat", x.reshape(1, 64), (x + 1e-3).astype(F32)),
        ("small_values", small, (small * 1.01).astype(F32)),
        ("large_values", (normal(30) * 1e30).astype(F32), (normal(30) * 1e30).astype(F32)),
        ("float64", x.astype(np.float64) + 1e-9, x.astype(np.float64)),
        ("int64", np.array([1, 2, 3, 0], np.int64), np.array([1, 2, 4, 0], np.int64)),
        ("bool", np.array([True, False, True]), np.array([True, True, False])),
        ("int8_scalar_wrap", np.array(100, np.int8), np.array(-100, np.int8)),
        ("nan_position_mismatch", nan_n, np.where(np.isnan(nan_b), 0, nan_b).astype(F32)),
        ("scalar_inf_inf", np.array(np.inf, F32), np.array(np.inf, F32)),
        ("scalar_int", np.array(7, np.int32), np.array(0, np.int32)),
        ("float64_overflow", np.array([1e300, 2e300, 0.0]), np.array([-1e300, 2e300, 0.0])),
    ]


def _stat_pairs() -> list[tuple[Any, Any]]:
    """(npu, bench) statistic values covering every case of §5.5 and the quirks found in CalcStatsDiff."""
    return [
        (1.5, 1.5),
        (NAN, NAN),
        (INF, INF),
        (-INF, -INF),
        (None, None),
        ("N/A", "N/A"),  # equal -> 0, 0
        (1.0, 0.99),
        (-2.5, 3.25),
        (0.0, 1.0),
        (3.0, 0.0),
        (0.0, -0.0),  # numbers; bench 0 -> inf
        (NAN, 1.0),
        (1.0, NAN),
        (NAN, INF),
        (-INF, NAN),  # NaN either side -> Nan
        (INF, 1.0),
        (INF, -INF),
        (-INF, 1.0),
        (-INF, INF),
        (1.0, INF),
        (1.0, -INF),  # infinities
        ("N/A", 1.0),
        (1.0, "N/A"),
        ("N/A", NAN),
        ("N/A", "npu:0"),
        ("N/A", None),  # N/A either side
        ("npu:0", 1.0),
        (1.0, "cuda:0"),
        ("npu:0", "cpu"),
        ("abc", 1.0),
        ("abc", "abd"),
        (None, 1.0),
        (True, True),
        (True, False),
        (True, 1.0),
        (False, 0),  # booleans are text, not numbers
        (3, 2),
        (3, 3.0),
        (7, 0),
        ("2.5", 1.0),
        ("1.5", 1.5),
        ("inf", INF),
        ("nan", NAN),
        ("-inf", 1.0),
        (1e308, -1e308),
        (0.30000000000000004, 0.1),
        (-1e-30, 1e-30),
    ]


def _stat_rows() -> list[tuple[dict, dict]]:
    """The pairs packed four to a row (Max, Min, Mean, Norm)."""
    pairs = _stat_pairs()
    pairs += [(1.0, 2.0)] * (-len(pairs) % len(STAT_KEYS))
    rows = []
    for start in range(0, len(pairs), len(STAT_KEYS)):
        chunk = pairs[start : start + len(STAT_KEYS)]
        npu = {k: p[0] for k, p in zip(STAT_KEYS, chunk)}
        rows.append((npu, {k: p[1] for k, p in zip(STAT_KEYS, chunk)}))
    return rows


# ---------------------------------------------------------------- msprobe reference


def _msprobe_tensor(npu: np.ndarray, bench: np.ndarray) -> tuple[list[str | float], str]:
    """msprobe's own path after loading: np.squeeze (as read_pt_data / read_npy_data), then
    ValidateTensor.check_tensor and compare_ops_apply (as compare_by_op / build_result)."""
    from msprobe.core.compare.npy_compare import CompareResult, ValidateTensor, compare_ops_apply

    n, b = np.squeeze(np.array(npu, copy=True)), np.squeeze(np.array(bench, copy=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checked = ValidateTensor().check_tensor(CompareResult(n, b))
        cells, message = compare_ops_apply(checked.n_value, checked.b_value, checked.error_flag, checked.err_msg)
    return [c if isinstance(c, str) else float(c) for c in cells], message


def _msprobe_stats(npu: dict, bench: dict) -> dict[str, str]:
    """CalcStatsDiff.calc_summary_diff on a one-row table built as msprobe builds it: ParseData turns None
    into 'None', CreateTable.set_summary turns NaN into 'Nan'."""
    import pandas as pd
    from msprobe.core.compare.acc_compare import CalcStatsDiff, CreateTable

    table = CreateTable(None)
    columns: dict[str, pd.Series] = {}
    for side, stats in (("NPU", npu), ("Bench", bench)):
        raw = [str(stats.get(k)) if stats.get(k) is None else stats.get(k) for k in STAT_KEYS]
        for name, value in zip(("max", "min", "mean", "l2norm"), table.set_summary(raw)):
            columns[f"{side} {name}"] = pd.Series([value], dtype=object)
    frame = pd.DataFrame(columns)
    calc = CalcStatsDiff(None)
    for name in ("max", "min", "mean", "l2norm"):
        calc.calc_summary_diff(frame, name)
    return {col: frame.loc[0, col] for col in DIFF_COLS + REL_COLS}


# ---------------------------------------------------------------- comparison helpers


def _same_cell(ours: object, theirs: object, rel: float = 1e-12) -> bool:
    if isinstance(theirs, str) or isinstance(ours, str):
        return ours == theirs
    if math.isnan(theirs) or math.isnan(ours):
        return math.isnan(theirs) and math.isnan(ours)
    return ours == pytest.approx(theirs, rel=rel, abs=0.0)


def _assert_tensor_cells(name: str, got: TensorMetrics, cells: list, message: str) -> None:
    ours = [got.msprobe[c] for c in TENSOR_COLUMNS]
    assert all(_same_cell(o, t) for o, t in zip(ours, cells)), f"{name}: {ours} != {cells}"
    assert all(type(o) in (str, float) for o in ours), f"{name}: {ours}"
    assert got.message == message, name


def _assert_typed_fields(name: str, got: TensorMetrics, cells: list) -> None:
    """Typed fields: None exactly where msprobe writes text, else within msprobe's rounding of the cell."""
    typed = [got.cosine, got.euc_dist, got.max_abs_err, got.max_rel_err]
    typed += [got.one_thousandth, got.five_thousandth]
    for column, value, cell in zip(TENSOR_COLUMNS, typed, cells):
        if isinstance(cell, str):
            assert value is None, f"{name} {column}"
        else:
            assert value == pytest.approx(cell, rel=1e-6, abs=6e-13), f"{name} {column}: {value} vs {cell}"


def _assert_stat_cells(got: dict, theirs: dict) -> None:
    for col in DIFF_COLS:
        ours = got[col]
        if isinstance(ours, float):
            assert _same_cell(ours, float(theirs[col]), rel=0.0), f"{col}: {ours!r} vs {theirs[col]!r}"
        else:
            assert ours == theirs[col], col
    for col in REL_COLS:
        assert got[col] == theirs[col], f"{col}: {got[col]!r} vs {theirs[col]!r}"


def _assert_stat_plain(got: dict) -> None:
    """Plain floats agree with the cells: diffs as numbers, relative errors as fractions."""
    for diff_col, rel_col, (diff_key, rel_key) in zip(DIFF_COLS, REL_COLS, PLAIN):
        cell, diff = got[diff_col], got[diff_key]
        if isinstance(cell, float) and not math.isnan(cell):
            assert diff == cell
        else:
            assert diff is None
        rel_cell, rel = got[rel_col], got[rel_key]
        if rel_cell.endswith("%") and rel_cell != "nan%":
            assert rel == pytest.approx(float(rel_cell[:-1]) / 100, rel=1e-12)
        elif rel_cell in ("0", "inf", "-inf"):
            assert rel == float(rel_cell)
        else:
            assert rel is None


# ---------------------------------------------------------------- §5.4 edge-case table


def _cells(a: np.ndarray, b: np.ndarray) -> list:
    return [tensor_metrics(a, b).msprobe[c] for c in TENSOR_COLUMNS]


@pytest.mark.parametrize(
    ("npu", "bench"),
    [
        (np.arange(6, dtype=F32), np.arange(6, dtype=F32)),
        (np.zeros(5, F32), np.zeros(5, F32)),
        (np.array([np.nan, 1, 2], F32), np.array([np.nan, 1, 2], F32)),
        (np.array([np.inf, 1, 2], F32), np.array([-np.inf, 1, 2], F32)),
    ],
    ids=["identical", "both_zero", "nan_nan", "inf_minus_inf"],
)
def test_table_equal_cases(npu: np.ndarray, bench: np.ndarray) -> None:
    assert _cells(npu, bench) == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_table_tiny_vs_zero() -> None:
    got = tensor_metrics(np.array([1e-3, 0, 1], F32), np.array([0, 0, 1], F32))
    cos, euc, max_abs, max_rel, one, five = (got.msprobe[c] for c in TENSOR_COLUMNS)
    assert cos == 1.0 and one == five == 0.666666666667
    assert euc == pytest.approx(1e-3, rel=1e-6) and max_abs == 0.001000000047
    assert max_rel == got.max_rel_err == 8388.6083984375  # (1e-3 + eps32 - eps32) / eps32 in float32
    assert got.message == ""


def test_table_zeros_vs_ones() -> None:
    got = tensor_metrics(np.zeros(10, F32), np.ones(10, F32))
    expected = ["Nan", pytest.approx(math.sqrt(10)), 1.0, 1.0, 0.0, 0.0]
    assert [got.msprobe[c] for c in TENSOR_COLUMNS] == expected
    assert got.cosine is None and got.message == metrics.MSG_COS_NPU_ZERO
    assert got.rel_l2 == 1.0


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_table_scalar(shape: tuple[int, ...]) -> None:
    got = tensor_metrics(np.full(shape, 1.5, F32), np.full(shape, 1.4, F32))
    cells = [got.msprobe[c] for c in TENSOR_COLUMNS]
    assert cells[:2] == cells[4:] == ["unsupported", "unsupported"]
    assert cells[2] == pytest.approx(0.1, rel=1e-6) and cells[3] == pytest.approx(0.1 / 1.4, rel=1e-6)
    assert got.message.startswith(metrics.MSG_SCALAR_CHAIN)


def test_table_scalar_nan() -> None:
    got = tensor_metrics(np.array(np.nan, F32), np.array(1.0, F32))
    assert [got.msprobe[c] for c in TENSOR_COLUMNS] == ["unsupported", "unsupported", "Nan", "Nan"] + [
        "unsupported"
    ] * 2
    assert got.nonfinite_mismatch == 1 and got.max_abs_err is None


def test_table_nan_position_mismatch() -> None:
    got = tensor_metrics(np.array([np.nan, 1, 2], F32), np.array([0, 1, 2], F32))
    assert list(got.msprobe.values()) == ["N/A"] * 6
    assert got.message == metrics.MSG_NONFINITE and got.nonfinite_mismatch == 1
    assert got.rel_l2 == 0.0  # over the finite positions 1, 2


def test_table_linspace_fp16_vs_fp32() -> None:
    grid = np.linspace(-3, 3, 100)
    got = tensor_metrics(grid.astype(F16), grid.astype(F32))
    cos, euc, max_abs, max_rel, one, five = (got.msprobe[c] for c in TENSOR_COLUMNS)
    assert (cos, one, five) == (1.0, 1.0, 1.0)
    assert euc == pytest.approx(0.0037, abs=5e-5) and max_abs == pytest.approx(9.5e-4, abs=5e-6)
    assert max_rel == pytest.approx(4.7e-4, abs=5e-6)
    assert got.message == metrics.MSG_DTYPE


def test_table_shape_unmatched_and_empty() -> None:
    got = tensor_metrics(np.ones((2, 3), F32), np.ones((3, 2), F32))
    assert list(got.msprobe.values()) == ["shape unmatched"] * 6 and got.rel_l2 is None
    got = tensor_metrics(np.ones((0, 3), F32), np.ones((0, 3), F32))
    assert list(got.msprobe.values()) == ["unsupported"] * 6 and got.message == metrics.MSG_EMPTY
    assert list(tensor_metrics(np.ones(3, F32), np.ones(0, F32)).msprobe.values()) == ["shape unmatched"] * 6


def test_row_vector_squeezed() -> None:
    x = np.arange(1, 9, dtype=F32)
    assert tensor_metrics(x.reshape(1, 8), x).msprobe == tensor_metrics(x, x).msprobe


def test_cosine_rounding_rules() -> None:
    x = np.linspace(1, 2, 50)
    got = tensor_metrics(x + 1e-3 * np.sin(7 * x), x)
    assert got.cosine > 0.9999 and got.msprobe["Cosine"] == round(got.cosine, 6)
    got = tensor_metrics(x, x[::-1].copy())
    assert got.cosine < 0.9999 and got.msprobe["Cosine"] == float(f"{got.cosine:.12f}")


def test_inputs_not_mutated() -> None:
    n, b = np.array([np.nan, 1, np.inf], F32), np.array([np.nan, 2, np.inf], F32)
    tensor_metrics(n, b)
    assert np.isnan(n[0]) and np.isinf(b[2])


def test_nonfinite_mismatch_is_signed() -> None:
    n = np.array([np.inf, -np.inf, np.nan, 1.0, np.inf], F32)
    b = np.array([-np.inf, -np.inf, np.nan, np.nan, 2.0], F32)
    assert tensor_metrics(n, b).nonfinite_mismatch == 3
    assert metrics.nonfinite_mismatch(np.arange(3), np.arange(3)) == 0


# ---------------------------------------------------------------- §5.5 statistics table


@pytest.mark.parametrize(
    ("npu", "bench", "diff", "rel"),
    [
        (1.5, 1.5, 0.0, "0"),
        (NAN, NAN, 0.0, "0"),
        (INF, INF, 0.0, "0"),
        ("N/A", "N/A", 0.0, "0"),
        (1.0, 0.0, 1.0, "inf"),
        (NAN, 1.0, "Nan", "Nan"),
        (1.0, NAN, "Nan", "Nan"),
        (INF, 1.0, INF, "inf"),
        (INF, -INF, INF, "inf"),
        (-INF, 1.0, -INF, "-inf"),
        (-INF, INF, -INF, "-inf"),
        (1.0, INF, -INF, "-inf"),
        (1.0, -INF, INF, "inf"),
        ("N/A", 1.0, "N/A", "N/A"),
        (1.0, "N/A", "N/A", "N/A"),
        ("npu:0", 1.0, "Diff", "Diff"),
        ("abc", 1.0, "Diff", "Diff"),
        ("npu:0", "cpu", "N/A", "N/A"),
        (True, False, "Diff", "Diff"),
        (None, None, 0.0, "0"),
        (None, 1.0, "Diff", "Diff"),
    ],
)
def test_stats_table(npu: Any, bench: Any, diff: Any, rel: str) -> None:
    got = stats_diff({"Max": npu}, {"Max": bench})
    assert got["Max diff"] == diff and got["MaxRelativeErr"] == rel


def test_stats_percent_string() -> None:
    npu = {"Max": 2.0, "Min": -1.0, "Mean": 0.5, "Norm": 10.0}
    got = stats_diff(npu, {"Max": 1.5, "Min": -0.5, "Mean": 1, "Norm": 4})
    assert got["Max diff"] == 0.5 and got["MaxRelativeErr"] == "33.33333333333333%"
    assert got["Min diff"] == -0.5 and got["MinRelativeErr"] == "100.0%" and got["min_rel"] == 1.0
    assert got["L2norm diff"] == 6.0 and got["NormRelativeErr"] == "150.0%" and got["norm_rel"] == 1.5
    assert got["max_rel"] == pytest.approx(1 / 3)
    _assert_stat_plain(got)


# ---------------------------------------------------------------- dumpstore's own metrics


def test_rel_l2_and_cosine_edges() -> None:
    zero, one = np.zeros(4), np.ones(4)
    assert rel_l2(zero, zero) == 0.0 and cosine(zero, zero) == 1.0
    assert rel_l2(one, zero) == math.inf and cosine(one, zero) is None and cosine(zero, one) is None
    assert rel_l2(zero, one) == 1.0
    x, y = np.array([1.0, np.nan, 3.0, np.inf]), np.array([1.0, 5.0, 4.0, 2.0])
    assert rel_l2(x, y) == pytest.approx(1 / math.sqrt(17))
    assert cosine(x, y) == pytest.approx(13 / math.sqrt(170))
    big = np.array([1e300, -2e300, 3e300])
    assert rel_l2(big * 1.5, big) == pytest.approx(0.5) and cosine(big, -big) == -1.0


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.float64, st.integers(2, 40), elements=st.floats(-1e6, 1e6)),
    st.floats(0.0, 2.0),
    st.floats(-1.0, 1.0),
)
def test_rel_l2_cosine_identity(y: np.ndarray, scale: float, noise: float) -> None:
    """relL2^2 = 1 + r^2 - 2 r cos with r = ||x|| / ||y||."""
    x = scale * y + noise * np.sign(y[::-1])
    y_norm = np.linalg.norm(y)
    if y_norm < 1e-3 or np.linalg.norm(x) < 1e-3:
        return
    r, cos = np.linalg.norm(x) / y_norm, cosine(x, y)
    assert rel_l2(x, y) ** 2 == pytest.approx(1 + r * r - 2 * r * cos, rel=1e-6, abs=1e-9)


def test_ten_million_elements() -> None:
    """Correct at size (its speed is measured by `make bench`, not asserted here: a timed test fails on a busy
    machine)."""
    rng = np.random.default_rng(1)
    bench = rng.standard_normal(10_000_000, dtype=F32)
    npu = bench * (1 + F32(1e-3) * rng.standard_normal(bench.size, dtype=F32))
    npu[::1000] = bench[::1000] = np.nan
    got = tensor_metrics(npu, bench)
    assert got.rel_l2 == pytest.approx(1e-3, rel=0.01)


def test_library_imports_numpy_only() -> None:
    tree = ast.parse(Path(metrics.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import)]
    names = {alias.name.split(".")[0] for node in imports for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names <= {"__future__", "math", "dataclasses", "numpy"}


# ---------------------------------------------------------------- live cross-check against msprobe


@pytest.mark.msprobe
@pytest.mark.parametrize("case", _tensor_cases(), ids=lambda c: c[0])
def test_tensor_matches_msprobe(case: tuple[str, np.ndarray, np.ndarray]) -> None:
    pytest.importorskip("msprobe")
    name, npu, bench = case
    cells, message = _msprobe_tensor(npu, bench)
    got = tensor_metrics(npu, bench)
    _assert_tensor_cells(name, got, cells, message)
    _assert_typed_fields(name, got, cells)


_finite_or_special = st.one_of(
    st.floats(-100, 100, width=32), st.just(0.0), st.just(float("nan")), st.just(float("inf"))
)


@pytest.mark.msprobe
@settings(max_examples=80, deadline=None)
@given(
    hnp.arrays(F32, hnp.array_shapes(min_dims=0, max_dims=2, max_side=6), elements=_finite_or_special),
    st.floats(-0.01, 0.01),
    st.booleans(),
)
def test_tensor_matches_msprobe_property(bench: np.ndarray, noise: float, to_fp16: bool) -> None:
    pytest.importorskip("msprobe")
    npu = (bench * F32(1 + noise)).astype(F16 if to_fp16 else F32)
    cells, message = _msprobe_tensor(npu, bench)
    got = tensor_metrics(npu, bench)
    _assert_tensor_cells("property", got, cells, message)
    _assert_typed_fields("property", got, cells)


@pytest.mark.msprobe
@pytest.mark.parametrize("row", _stat_rows(), ids=lambda r: repr(r)[:60])
def test_stats_match_msprobe(row: tuple[dict, dict]) -> None:
    pytest.importorskip("msprobe")
    pytest.importorskip("pandas")
    npu, bench = row
    got = stats_diff(npu, bench)
    _assert_stat_cells(got, _msprobe_stats(npu, bench))
    _assert_stat_plain(got)


# ---------------------------------------------------------------- checked-in expected values


def _encode_array(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.reshape(-1).tolist()}


def _decode_array(spec: dict) -> np.ndarray:
    dtype = np.dtype(spec["dtype"])
    if dtype.kind == "f":
        return np.array(spec["data"], np.float64).astype(dtype).reshape(spec["shape"])
    return np.array(spec["data"], dtype).reshape(spec["shape"])


def _regenerate() -> dict:
    tensors = []
    for name, npu, bench in _tensor_cases():
        cells, message = _msprobe_tensor(npu, bench)
        tensors.append(
            {
                "name": name,
                "npu": _encode_array(npu),
                "bench": _encode_array(bench),
                "cells": cells,
                "message": message,
            }
        )
    stats = [{"npu": n, "bench": b, "cells": _msprobe_stats(n, b)} for n, b in _stat_rows()]
    from importlib.metadata import version

    import msprobe  # noqa: F401  (version recorded below)

    return {"generator": f"mindstudio-probe {version('mindstudio-probe')}", "tensor": tensors, "stats": stats}


@pytest.mark.skipif(os.environ.get("DUMPSTORE_REGEN") != "1", reason="set DUMPSTORE_REGEN=1 to regenerate")
def test_regenerate_expected() -> None:
    pytest.importorskip("msprobe")
    EXPECTED.parent.mkdir(parents=True, exist_ok=True)
    data = _regenerate()
    lines = [f'{{"generator": {json.dumps(data["generator"])},']
    for key, end in (("tensor", ","), ("stats", "")):
        cases = ",\n  ".join(json.dumps(case) for case in data[key])
        lines.append(f' "{key}": [\n  {cases}\n ]{end}')
    EXPECTED.write_text("\n".join(lines) + "\n}\n")


def _expected() -> dict:
    if not EXPECTED.exists():
        pytest.skip(f"{EXPECTED} missing; run with DUMPSTORE_REGEN=1")
    return json.loads(EXPECTED.read_text())


def test_tensor_matches_expected_json() -> None:
    data = _expected()
    assert data["generator"] == "mindstudio-probe 26.2.0"
    assert len(data["tensor"]) >= 30
    for case in data["tensor"]:
        npu, bench = _decode_array(case["npu"]), _decode_array(case["bench"])
        got = tensor_metrics(npu, bench)
        _assert_tensor_cells(case["name"], got, case["cells"], case["message"])
        _assert_typed_fields(case["name"], got, case["cells"])


def test_stats_match_expected_json() -> None:
    for case in _expected()["stats"]:
        got = stats_diff(case["npu"], case["bench"])
        _assert_stat_cells(got, case["cells"])
        _assert_stat_plain(got)

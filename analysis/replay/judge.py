"""Judge one recorded output against its float64 replay, beside the CPU same-dtype replay (numpy, float64).

The metrics are msprobe acc_check's benchmark metrics (`compare/algorithm.py`, `precision_standard/
benchmark_compare.py`), computed for the run's output and for the CPU's output against the same golden; the
verdict compares their ratios with the standard's thresholds (standards.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import standards as S


def benchmark_metrics(out: np.ndarray, golden: np.ndarray, dtype: str) -> dict[str, float]:
    """msprobe's benchmark metrics of `out` (the device) against `golden` (float64), both float64 arrays."""
    both_finite = np.isfinite(out) & np.isfinite(golden)
    inf_nan = ~both_finite
    abs_err = np.abs(np.where(both_finite, out - golden, 0.0))
    abs_bench = np.abs(np.where(both_finite, golden, 0.0))
    small = (abs_bench <= S.SMALL_VALUE[dtype]) & both_finite
    n_small = int(small.sum())
    small_err = float(np.sum(small & (abs_err > S.SMALL_VALUE_ATOL[dtype])) / n_small) if n_small else 0.0
    masked = inf_nan | small
    n = abs_err.size
    mse = float(np.mean(np.square(np.where(masked, 0.0, abs_err)))) if n else 0.0
    mse *= n / (n - int(inf_nan.sum()) + 0.0001) + 0.0001  # algorithm.get_rmse, as written
    rel = abs_err / (abs_bench + S.REL_EPS[dtype])
    rel_ok = rel[~masked]
    diff = out[both_finite] - golden[both_finite]
    return {
        S.SMALL_VALUE_ERR: small_err,
        S.RMSE: math.sqrt(mse),
        S.MAX_REL_ERR: float(rel_ok.max()) if rel_ok.size else 0.0,
        S.MEAN_REL_ERR: float(rel_ok.mean()) if rel_ok.size else 0.0,
        "eb": float(abs(int(np.sum(diff > 0)) - int(np.sum(diff < 0))) / n) if n else 0.0,
    }


def closeness(out: np.ndarray, golden: np.ndarray) -> dict[str, float | None]:
    """rel_l2, max_abs_err and cosine of `out` against `golden` over positions finite in both."""
    ok = np.isfinite(out) & np.isfinite(golden)
    a, b = out[ok], golden[ok]
    if not a.size:
        return {"rel_l2": None, "max_abs_err": None, "cosine": None}
    nb, na = float(np.linalg.norm(b)), float(np.linalg.norm(a))
    d = float(np.linalg.norm(a - b))
    return {
        "rel_l2": d / nb if nb else (0.0 if d == 0 else math.inf),
        "max_abs_err": float(np.max(np.abs(a - b))),
        "cosine": float(np.dot(a, b) / (na * nb)) if na and nb else None,
    }


def _nonfinite_pattern(x: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +Inf, 3 -Inf per element."""
    return np.select([np.isnan(x), np.isposinf(x), np.isneginf(x)], [1, 2, 3], 0)


def judge(
    api: str, dtype: str, run: np.ndarray, cpu: np.ndarray, golden: np.ndarray, *, low: np.ndarray | None = None
) -> dict[str, Any]:
    """Columns of the replay table for one output (status, standard, metrics), all arrays float64 and same shape;
    `low`: the CPU's output of the op run at the run's autocast dtype, whose error the benchmark may also take."""
    std = S.standard_for(api, dtype)
    row: dict[str, Any] = {"standard": None if std is None else std.name}
    if std is None:
        return {**row, "status": "no_standard", "reason": f"no precision standard stated for dtype {dtype}"}
    if std.name == S.BINARY:
        differ = ~((run == cpu) | (np.isnan(run) & np.isnan(cpu)))
        rate = float(differ.mean()) if differ.size else 0.0
        row.update(error_rate=rate, metric="error_rate", err=rate, cpu_err=0.0, threshold=0.0)
        row.update(closeness(run, golden))
        if rate > 0:
            return {
                **row,
                "status": "fail",
                "reason": f"{int(differ.sum())} of {differ.size} elements differ from the CPU's",
            }
        return {**row, "status": "pass", "reason": None}
    return _benchmark(row, std, dtype, run, cpu, golden, low)


def _benchmark(
    row: dict[str, Any],
    std: S.Standard,
    dtype: str,
    run: np.ndarray,
    cpu: np.ndarray,
    golden: np.ndarray,
    low: np.ndarray | None,
) -> dict[str, Any]:
    mr, mc = benchmark_metrics(run, golden, dtype), benchmark_metrics(cpu, golden, dtype)
    c_run, c_cpu = closeness(run, golden), closeness(cpu, golden)
    row.update(api_level=std.level, rel_l2=c_run["rel_l2"], cpu_rel_l2=c_cpu["rel_l2"])
    row.update(max_abs_err=c_run["max_abs_err"], cosine=c_run["cosine"], eb=mr["eb"], cpu_eb=mc["eb"])
    for m in S.JUDGED:
        row[m], row["cpu_" + m] = mr[m], mc[m]
    row["msprobe_status"], row["msprobe_reason"] = _msprobe_verdict(std, dtype, mr, mc)
    err, cpu_err = c_run["rel_l2"], c_cpu["rel_l2"]
    if low is not None and cpu_err is not None:  # under autocast: the op at the autocast dtype is a benchmark too
        low_err = closeness(low, golden)["rel_l2"]
        cpu_err = max(cpu_err, low_err) if low_err is not None else cpu_err
    threshold = S.REPLAY_THRESHOLD
    ratio = None if err is None or cpu_err is None else err / max(cpu_err, S.rel_l2_floor(dtype, run.size))
    row.update(metric=S.REL_L2, err=err, cpu_err=cpu_err, ratio=ratio, threshold=threshold)
    pattern_run, pattern_cpu = _nonfinite_pattern(run), _nonfinite_pattern(cpu)
    if not np.array_equal(pattern_run, pattern_cpu):
        bad = int(np.sum(pattern_run != pattern_cpu))
        row.update(metric="inf_nan", ratio=math.inf)
        return {**row, "status": "fail", "reason": f"NaN/Inf differ from the CPU {dtype} output at {bad} positions"}
    if ratio is not None and ratio > threshold:
        reason = f"rel_l2 {err:.3g} vs CPU {dtype} {cpu_err:.3g}: ratio {ratio:.3g} > {threshold:g}"
        return {**row, "status": "fail", "reason": reason}
    return {**row, "status": "pass", "reason": None}


def _msprobe_verdict(std: S.Standard, dtype: str, mr: dict[str, float], mc: dict[str, float]) -> tuple[str, str | None]:
    """msprobe's own benchmark verdict (api_precision_compare: calc_ratio with its floors, its level thresholds)."""
    floor = S.RATIO_FLOOR[dtype]
    over = []
    for m in S.JUDGED:
        ratio = abs(mr[m]) / max(abs(mc[m]), floor)
        if ratio > std.thresholds[m]:
            over.append(f"{m} ratio {ratio:.3g} > {std.thresholds[m]:g}")
    return ("error", "; ".join(over)) if over else ("pass", None)

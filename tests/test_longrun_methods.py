"""The vectorised parts of `curves` give the answers of their plain definitions: the EMA z-score spikes against
the step-by-step recursion, the change points against ruptures. public KernelCPD, the per-tag series against
a row-by-row filter; and `curves` loads neither scipy nor pandas (ruptures' C solver is loaded on its own)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from dumpstore.analysis.curves import EMA_SPAN, EMA_Z, series
from dumpstore.analysis.curves_kernels import ema_outliers, kernel_cpd_l2


def _ema_loop(v: np.ndarray, floor: np.ndarray | None = None) -> list[tuple]:
    """The definition, one value at a time (with `floor`: an outlier also exceeds its mean by floor[i])."""
    alpha = 2.0 / (EMA_SPAN + 1)
    mean, var, seen, out = 0.0, 0.0, 0, []
    for i, x in enumerate(v.tolist()):
        if not math.isfinite(x):
            continue
        if seen >= 20 and var > 0:
            z = (x - mean) / math.sqrt(var)
            if z > EMA_Z and (floor is None or x - mean > floor[i]):
                out.append((i, x, mean, z))
                continue
        if seen == 0:
            mean = x
        else:
            d = x - mean
            mean += alpha * d
            var = (1 - alpha) * (var + alpha * d * d)
        seen += 1
    return out


def _curves(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for trial in range(60):
        n = int(rng.integers(1, 4000))
        v = 2 + np.exp(-np.arange(n) / 500) + 0.05 * rng.standard_normal(n)
        k = int(rng.integers(0, 30))
        v[rng.integers(0, n, k)] *= rng.uniform(1, 20, k)  # spikes, some in runs
        v[rng.integers(0, n, int(rng.integers(0, 5)))] = np.nan
        if trial % 5 == 0:
            v[: n // 2] = 3.0  # a constant stretch: zero variance, no z-score
        if trial % 7 == 0:
            v = np.round(v, 1)  # printed with few digits: ties
        out.append(v)
    out.append(np.full(1000, 2.5))
    out.append(np.array([np.inf, np.nan, 1.0]))
    out.append(np.zeros(0))
    return out


def test_ema_outliers_equal_the_recursion():
    hits = 0
    for v in _curves(1):
        fast, slow = ema_outliers(v, EMA_SPAN, EMA_Z), _ema_loop(v)
        assert [h[0] for h in fast] == [h[0] for h in slow]
        for a, b in zip(fast, slow):
            assert a[1] == b[1]
            assert a[2] == pytest.approx(b[2], rel=1e-9, abs=1e-12)
            assert a[3] == pytest.approx(b[3], rel=1e-7)
        hits += len(slow)
    assert hits > 100  # the series do have outliers


def test_ema_outliers_with_a_floor_equal_the_recursion():
    """With a minimum jump per value (curves' spike floor) an outlier below it is an ordinary value: it updates
    the mean and variance, in the chunked kernel as in the loop."""
    rng = np.random.default_rng(5)
    hits = dropped = 0
    for v in _curves(2):
        floor = rng.uniform(0, 30, len(v))
        fast, slow = ema_outliers(v, EMA_SPAN, EMA_Z, min_jump=floor), _ema_loop(v, floor)
        assert [h[0] for h in fast] == [h[0] for h in slow]
        for a, b in zip(fast, slow):
            assert a[2] == pytest.approx(b[2], rel=1e-9, abs=1e-12)
        hits += len(slow)
        dropped += len(_ema_loop(v)) - len(slow)
    assert hits > 50 and dropped > 50  # the floor keeps some outliers and drops others


def test_kernel_cpd_equals_ruptures():
    rpt = pytest.importorskip("ruptures")
    rng = np.random.default_rng(3)
    for n, shifts in ((2000, [700, 1500]), (50, [25]), (400, []), (5, []), (4, [])):
        sig = rng.standard_normal(n)
        for s in shifts:
            sig[s:] += 3.0
        sig = sig.reshape(-1, 1)
        for pen in (1.0, 3.0 * math.log(max(n, 2)) * 2):
            want = rpt.KernelCPD(kernel="linear", min_size=2, jump=1).fit(sig).predict(pen=pen)
            assert kernel_cpd_l2(sig, pen) == [int(b) for b in want]
    assert kernel_cpd_l2(np.zeros((3, 1)), 1.0) == [3]  # too short for a change (ruptures raises)


def test_kernel_cpd_without_the_compiled_module(monkeypatch):
    """Where ruptures' C module is not where it is looked for, the public API gives the answer."""
    pytest.importorskip("ruptures")
    from dumpstore.analysis import curves_kernels

    sig = np.concatenate([np.zeros(50), np.ones(50) * 3.0]).reshape(-1, 1)
    direct = kernel_cpd_l2(sig, 5.0)
    monkeypatch.setattr(curves_kernels, "_EKCPD", [None])
    assert kernel_cpd_l2(sig, 5.0) == direct == [50, 100]


def test_series_by_tag_equals_a_row_filter():
    rows = []
    rng = np.random.default_rng(5)
    for rank in (1, 0):
        for step in rng.permutation(300).tolist():
            for tag in ("loss", "lr", "grad_norm"):
                samples = None if step % 7 == 0 else 64 * (step + 1)
                value = None if (tag == "lr" and step % 11 == 0) else float(rng.random())
                rows.append({"rank": rank, "step": step, "consumed_samples": samples, "tag": tag, "value": value})
    table = pa.Table.from_pylist(rows)
    table = pa.concat_tables([table.slice(0, 500), table.slice(500)])  # two chunks
    for tag in ("loss", "lr", "grad_norm"):
        for rank in (None, 0, 1):
            s = series(table, tag, rank)
            assert s is not None and s.samples is not None
            want = sorted((r for r in rows if r["tag"] == tag and r["rank"] == (rank or 0)), key=lambda r: r["step"])
            assert s.x.tolist() == [r["step"] for r in want]
            assert np.array_equal(s.v, np.array([np.nan if r["value"] is None else r["value"] for r in want]), True)
            assert np.array_equal(
                s.samples, np.array([np.nan if r["consumed_samples"] is None else r["consumed_samples"] for r in want]),
                True,
            )  # fmt: skip
    assert series(table, "nope") is None and series(table, "loss", 7) is None


def test_curves_loads_neither_scipy_nor_pandas():
    code = (
        "import sys, numpy as np, pyarrow as pa\n"
        "from dumpstore.analysis.curves import compare_curves\n"
        "n = 3000; t = np.arange(1, n + 1); rng = np.random.default_rng(0)\n"
        "def run(shift):\n"
        "    v = 2 + np.exp(-t / 300) + 0.01 * rng.standard_normal(n) + np.where(t > 2000, shift, 0)\n"
        "    return pa.table({'rank': np.zeros(n, np.int64), 'step': t, 'consumed_samples': t * 8,\n"
        "                     'tag': ['loss'] * n, 'value': v})\n"
        "a, b = run(0.05), run(0.0)\n"
        "before = set(sys.modules)  # (building a table from Python lists imports pandas)\n"
        "rep = compare_curves(a, b)\n"
        "new = [m for m in ('scipy', 'pandas', 'ruptures', 'polars') if m in sys.modules and m not in before]\n"
        "print(rep.divergence.step, sorted(new))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert 1995 <= int(out[0]) <= 2010  # the shift at 2001, found by the change points
    assert out[1:] == ["[]"]


def test_runs_of_is_the_first_full_window():
    from dumpstore.analysis.longrun_health import _runs_of

    def loop(mask, length):
        run = 0
        for i, m in enumerate(mask):
            run = run + 1 if m else 0
            if run >= length:
                return i - length + 1
        return None

    rng = np.random.default_rng(7)
    for _ in range(500):
        mask = rng.random(int(rng.integers(0, 80))) < rng.random()
        length = int(rng.integers(1, 12))
        assert _runs_of(mask, length) == loop(mask, length)


def _diverge(d: np.ndarray, sigma: float = 1e-6, w: int = 5):
    from dumpstore.analysis.curves import leave_band

    x = np.arange(1, len(d) + 1)
    return leave_band(x, d, np.full(len(d), sigma), w)[0]


def test_identical_start_then_noise_around_zero_is_a_divergence():
    """Curves printed identically for 150 points, then a difference of mean zero on every later point (a change
    that averages out, invisible to the smoothed difference): they part at the first differing point, 151."""
    rng = np.random.default_rng(0)
    d = np.zeros(300)
    d[150:] = rng.choice([-1.0, 1.0], 150) * 5e-5
    div = _diverge(d)
    assert (div.step, div.crossed, div.kind) == (151, 151, "noise")
    d[150:][::5] = 0.0  # 80 % of the later points differ: not lasting enough
    assert _diverge(d).step is None


def test_onset_not_before_the_curves_differ():
    """An offset from index 150 on (point 151) after equal curves: the smoothed window reaches ahead of it and
    the change points are cut fine where the band is the print floor; the onset is where the curves part."""
    d = np.zeros(300)
    d[150:] = 1e-3 + 1e-4 * np.sin(np.arange(150))
    assert _diverge(d).step == 151

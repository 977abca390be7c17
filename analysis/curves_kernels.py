"""The array work of `curves` (analysis/curves.py), made fast and kept equal to its plain definition
(tests/test_longrun_methods.py): a scalars table split by tag without per-row Python, ruptures' kernel
change-point solver called without importing ruptures' scipy-bound package, and the EMA z-score outliers
evaluated a chunk at a time."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa

from dumpstore.longrun.arrow import codes, to_numpy


class _Tags:
    """A scalars table's rows by tag: the tag column's dictionary codes (as stored, or encoded once), each tag's
    rows (rank, step, consumed_samples, value as numpy arrays, in table order) taken when first asked for; no
    per-row Python."""

    def __init__(self, scalars: pa.Table):
        self.table = scalars
        self.cols: dict[str, np.ndarray] = {}
        self.codes = np.zeros(0, np.int64)
        self.index: dict[str, int] = {}
        self.parts: dict[str, dict[str, np.ndarray] | None] = {}
        if scalars.num_rows == 0:
            return
        tag = scalars.column("tag")
        if pa.types.is_dictionary(tag.type):  # read so from Parquet (store.read): no hashing
            tag = pa.Table.from_arrays([tag], ["tag"]).unify_dictionaries().column("tag")
        else:
            import pyarrow.compute as pc

            tag = pc.dictionary_encode(tag)
        self.codes = np.concatenate([codes(c) for c in tag.chunks])
        self.index = {t: k for k, t in enumerate(tag.chunk(0).dictionary.to_pylist())}

    def get(self, tag: str) -> dict[str, np.ndarray] | None:
        if tag not in self.parts:
            k = self.index.get(tag)
            if k is None:
                self.parts[tag] = None
            else:
                if not self.cols:
                    t = self.table
                    self.cols = {
                        "rank": to_numpy(t.column("rank"), np.int64, 0),
                        "step": to_numpy(t.column("step"), np.int64, 0),
                        "consumed_samples": to_numpy(t.column("consumed_samples"), np.float64, np.nan),
                        "value": to_numpy(t.column("value"), np.float64, np.nan),
                    }
                rows = np.flatnonzero(self.codes == k)
                self.parts[tag] = {c: a[rows] for c, a in self.cols.items()}
        return self.parts[tag]


_SPLIT: list[_Tags] = []  # the last few scalars tables, by tag (series is asked ~10 times per table)


def _by_tag(scalars: pa.Table) -> _Tags:
    for tags in _SPLIT:
        if tags.table is scalars:
            return tags
    tags = _Tags(scalars)
    _SPLIT.append(tags)
    del _SPLIT[:-4]
    return tags


def ema_outliers(
    v: np.ndarray, span: int, zmax: float, chunk: int = 512, min_jump: np.ndarray | None = None
) -> list[tuple]:
    """(index, value, EMA mean, z) of each value of `v` above its exponential mean by more than `zmax` exponential
    standard deviations (span `span`; from the 21st finite value on, while the variance is positive) and, with
    `min_jump` (one per value of `v`), by more than min_jump. An outlier does not update the mean and variance;
    non-finite values are skipped.

    The recursion, for each accepted value x (the first sets the mean): delta = x - mean, mean += a delta,
    var = (1 - a)(var + a delta^2), a = 2 / (span + 1). It is linear in the accepted values, so it is evaluated
    `chunk` values at a time with cumulative sums (weights b^-k, b = 1 - a, stay below e^(a chunk)); at the first
    outlier of a chunk the state is taken from just before it and the next chunk starts after it. Exact for a
    constant stretch (its deviations from the mean are zero); otherwise equal to the step-by-step loop to
    rounding."""
    idx = np.flatnonzero(np.isfinite(v))
    y = v[idx].astype(np.float64)
    floor = np.nan_to_num(min_jump[idx], nan=0.0) if min_jump is not None else None
    n = len(y)
    out: list[tuple] = []
    if n == 0:
        return out
    a = 2.0 / (span + 1)
    b = 1.0 - a
    powers = b ** np.arange(chunk + 1)  # b^k
    mean, var, seen, p = float(y[0]), 0.0, 1, 1
    while p < n:
        seg = y[p : p + chunk]
        m = len(seg)
        dev = seg - mean
        # mean before the k-th value of the chunk: mean + a sum_{i<k} b^(k-1-i) dev_i
        acc = np.concatenate([[0.0], np.cumsum(dev / powers[1 : m + 1])])
        means = mean + a * powers[: m + 1] * acc
        delta = seg - means[:m]
        accv = np.concatenate([[0.0], np.cumsum(delta * delta / powers[:m])])
        vars_ = powers[: m + 1] * (var + a * accv)  # var before the k-th value: b^k var + a sum_{i<k} b^(k-i) d_i^2
        checked = (seen + np.arange(m) >= 20) & (vars_[:m] > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(checked, delta / np.sqrt(np.where(checked, vars_[:m], 1.0)), -np.inf)
        hit = np.flatnonzero((z > zmax) & (delta > floor[p : p + m]) if floor is not None else z > zmax)
        if len(hit) == 0:
            mean, var, seen, p = float(means[m]), float(vars_[m]), seen + m, p + m
            continue
        j = int(hit[0])
        out.append((int(idx[p + j]), float(seg[j]), float(means[j]), float(z[j])))
        mean, var, seen, p = float(means[j]), float(vars_[j]), seen + j, p + j + 1
    return out


def kernel_cpd_l2(signal: np.ndarray, pen: float, min_size: int = 2) -> list[int]:
    """`ruptures.KernelCPD(kernel="linear", min_size=min_size).fit(signal).predict(pen=pen)`: the breakpoints
    (segment ends, the last one len(signal)) of ruptures' C Pelt solver for the linear kernel.

    The solver (`ruptures.detection._detection.ekcpd`, a C extension needing only numpy) is loaded on its own:
    `import ruptures` imports all of ruptures' cost functions and with them scipy.stats, scipy.signal and
    scipy.spatial (about 1 s of CPU, more than the rest of `curves`). Where that extension is not found (another
    ruptures layout) the public API is used."""
    sig = np.ascontiguousarray(signal, dtype=np.float64).reshape(len(signal), -1)
    if len(sig) < 2 * min_size:  # ruptures' sanity check for one change: no segmentation possible
        return [len(sig)]
    ek = _ekcpd()
    try:
        path = ek.ekcpd_pelt_L2(sig, float(pen), int(min_size)) if ek is not None else None
    except TypeError:  # another signature: the public API
        path = None
    if path is None:  # ImportError without ruptures
        import ruptures as rpt

        return [int(b) for b in rpt.KernelCPD(kernel="linear", min_size=min_size, jump=1).fit(sig).predict(pen=pen)]
    out, i = [], len(sig)
    while i > 0:
        out.append(int(i))
        i = int(path[i])
    return out[::-1]


_EKCPD: list[Any] = []


def _ekcpd() -> Any:
    """ruptures' compiled kernel change-point module, loaded without importing the ruptures package; None where
    ruptures is not installed in the expected layout."""
    if _EKCPD:
        return _EKCPD[0]
    import importlib.machinery
    import importlib.util
    import sys

    name = "ruptures.detection._detection.ekcpd"
    mod = sys.modules.get(name)
    if mod is None:
        try:
            spec = importlib.util.find_spec("ruptures")
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for loc in locations:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = os.path.join(loc, "detection", "_detection", "ekcpd" + suffix)
                if not os.path.isfile(path):
                    continue
                try:
                    ext = importlib.util.spec_from_file_location(name, path)
                    assert ext is not None and ext.loader is not None
                    mod = importlib.util.module_from_spec(ext)
                    ext.loader.exec_module(mod)
                except Exception:  # noqa: BLE001 - a broken build: the public API decides
                    mod = None
                break
            if mod is not None:
                break
    if mod is not None and not hasattr(mod, "ekcpd_pelt_L2"):
        mod = None
    _EKCPD.append(mod)
    return mod

"""Comparison metrics between a target tensor and a reference tensor, reproducing msprobe 26.2.0 `compare`.

Tensor mode (`tensor_metrics`) follows `msprobe/core/compare/npy_compare.py` (`ValidateTensor.check_tensor`,
`compare_ops_apply`) and `algorithm/builtin_algorithm/alg_*.py` cell by cell, including the order of the
validation chain, the dtype in which each metric is computed and the rounding of the written values.
Statistics mode (`stats_diff`) follows `acc_compare.py::CalcStatsDiff` for one row. `rel_l2`, `cosine` and
`nonfinite_mismatch` are dumpstore's own metrics over the positions finite on both sides.
numpy only: no torch, pandas or msprobe here.

Size: msprobe's tensor and statistics metrics reproduced cell by cell in one place, so that their shared
validation chain and rounding read in msprobe's order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

COSINE = "Cosine"
EUC_DIST = "EucDist"
MAX_ABS_ERR = "MaxAbsErr"
MAX_RELATIVE_ERR = "MaxRelativeErr"
ONE_THOUSANDTH = "One Thousandth Err Ratio"
FIVE_THOUSANDTHS = "Five Thousandths Err Ratio"
TENSOR_COLUMNS: tuple[str, ...] = (COSINE, EUC_DIST, MAX_ABS_ERR, MAX_RELATIVE_ERR, ONE_THOUSANDTH, FIVE_THOUSANDTHS)

UNSUPPORTED = "unsupported"
SHAPE_UNMATCHED = "shape unmatched"
NAN = "Nan"
N_A = "N/A"
DIFF = "Diff"
INF = "inf"
NEG_INF = "-inf"

MSG_EMPTY = "This is empty data, can not compare."
MSG_SHAPE = "Shape of NPU and bench tensor do not match. Skipped."
MSG_NONFINITE = "The position of inf or nan in NPU and bench Tensor do not match."
MSG_DTYPE = "Dtype of NPU and bench tensor do not match."
MSG_SCALAR = "This is type of 0-d tensor, can not calculate"
MSG_SCALAR_CHAIN = f"{MSG_SCALAR} '{COSINE}', '{EUC_DIST}', '{ONE_THOUSANDTH}' and '{FIVE_THOUSANDTHS}'. "
MSG_COS_NPU_ZERO = "Cannot compare by Cosine Similarity, All the data is Zero in npu dump data."
MSG_COS_BENCH_ZERO = "Cannot compare by Cosine Similarity, All the data is Zero in Bench dump data."
MSG_COS_NAN = "Cannot compare by Cosine Similarity, the dump data has NaN."
MSG_MAX_ABS_NAN = "Cannot compare by MaxAbsError, the data contains nan/inf/-inf in dump data."
MSG_MAX_REL_NAN = "Cannot compare by MaxRelativeError, the data contains nan/inf/-inf in dump data."

_FLOAT_EPSILON = float(np.finfo(float).eps)  # msprobe Const.FLOAT_EPSILON: cosine zero-norm threshold
_COSINE_THRESHOLD = 0.9999  # cosines above this are rounded to 6 decimals
_THOUSAND = 0.001
_FIVE_THOUSAND = 0.005
_FLOAT_TYPES = (np.half, np.single, float, np.double, np.float64, np.longdouble)  # CompareConst.FLOAT_TYPE


@dataclass(frozen=True)
class TensorMetrics:
    """One tensor pair: msprobe's six cells, their unrounded values, dumpstore's own metrics."""

    cosine: float | None
    euc_dist: float | None
    max_abs_err: float | None
    max_rel_err: float | None
    one_thousandth: float | None
    five_thousandth: float | None
    rel_l2: float | None
    msprobe: dict[str, str | float]
    message: str
    nonfinite_mismatch: int


@dataclass(frozen=True)
class _Metric:
    """One metric: msprobe's cell, the value before rounding (None if the cell is text), its message."""

    cell: str | float
    raw: float | None = None
    message: str = ""


def format_value(value: object) -> float:
    """msprobe `format_value`: round through '{:.12f}'."""
    return float(f"{value:.12f}")


# ---------------------------------------------------------------- dumpstore's own metrics


def _finite_pair(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened float64 copies of x and y restricted to positions finite on both sides."""
    xf = np.asarray(x, dtype=np.float64).reshape(-1)
    yf = np.asarray(y, dtype=np.float64).reshape(-1)
    if xf.shape != yf.shape:
        raise ValueError(f"size mismatch: {xf.size} vs {yf.size}")
    keep = np.isfinite(xf) & np.isfinite(yf)
    if keep.all():
        return xf, yf
    return xf[keep], yf[keep]


_SAFE_LOW, _SAFE_HIGH = 1e-100, 1e100  # magnitudes whose squares neither underflow nor overflow in float64


def _max_abs_of(*arrays: np.ndarray) -> float:
    return max(float(np.max(np.abs(a), initial=0.0)) for a in arrays)


def _norm_ratio(x: np.ndarray, y: np.ndarray) -> float:
    """||x - y|| / ||y|| for finite float64 vectors; 0 if both are zero, inf if only y is."""
    scale = _max_abs_of(x, y)
    if scale == 0.0:
        return 0.0
    if not _SAFE_LOW < scale < _SAFE_HIGH:
        x, y = x / scale, y / scale
    err, ref = float(np.linalg.norm(x - y)), float(np.linalg.norm(y))
    if ref == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / ref


def rel_l2(x: np.ndarray, y: np.ndarray) -> float:
    """Relative L2 error ||x - y|| / ||y|| in float64 over positions finite on both sides.

    0 if both are zero there (or no such position), inf if ||y|| == 0 < ||x||.
    """
    return _norm_ratio(*_finite_pair(x, y))


def _unit_scaled(a: np.ndarray) -> np.ndarray:
    scale = _max_abs_of(a)
    return a if scale == 0.0 or _SAFE_LOW < scale < _SAFE_HIGH else a / scale


def cosine(x: np.ndarray, y: np.ndarray) -> float | None:
    """Plain float64 cosine over positions finite on both sides, clipped to [-1, 1].

    1.0 if both norms are 0, None if exactly one is.
    """
    xf, yf = (_unit_scaled(a) for a in _finite_pair(x, y))
    xn, yn = float(np.linalg.norm(xf)), float(np.linalg.norm(yf))
    if xn == 0.0 or yn == 0.0:
        return 1.0 if xn == yn else None
    return min(1.0, max(-1.0, float(np.dot(xf, yf)) / (xn * yn)))


def _is_float_kind(a: np.ndarray) -> bool:
    return a.dtype.kind in "fc"


def _all_finite(a: np.ndarray) -> bool:
    return not _is_float_kind(a) or bool(np.isfinite(a).all())


def _nonfinite_masks(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """isnan and isinf of a (as msprobe sees them after astype(float))."""
    if a.dtype.kind != "f":
        a = a.astype(float)
    return np.isnan(a), np.isinf(a)


def _status_mismatch(x: np.ndarray, y: np.ndarray, masks: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> int:
    """Positions whose NaN / +Inf / -Inf status differs, given the isnan / isinf masks of x and y."""
    x_nan, x_inf, y_nan, y_inf = masks
    differs = (x_nan != y_nan) | (x_inf != y_inf)
    both_inf = x_inf & y_inf
    if both_inf.any():
        differs |= both_inf & (np.signbit(x) != np.signbit(y))
    return int(np.count_nonzero(differs))


def nonfinite_mismatch(x: np.ndarray, y: np.ndarray) -> int:
    """Number of positions whose NaN / +Inf / -Inf status differs between x and y (same size)."""
    x, y = np.asarray(x), np.asarray(y)
    if _all_finite(x) and _all_finite(y):
        return 0
    return _status_mismatch(x, y, (*_nonfinite_masks(x), *_nonfinite_masks(y)))


# ---------------------------------------------------------------- msprobe tensor mode


def _relative_err(n: np.ndarray, b: np.ndarray) -> np.ndarray:
    """msprobe `get_relative_err`: |(N - B) / B| in R = result_type(N, B, float32), eps(R) added where B == 0.

    Ints and bools become float64 first, so their eps is 2.2e-16.
    """
    if n.dtype not in _FLOAT_TYPES:
        n = n.astype(float)
    if b.dtype not in _FLOAT_TYPES:
        b = b.astype(float)
    zero_mask = b == 0
    result_type = np.result_type(n, b, np.float32)
    with np.errstate(all="ignore"):
        n = n.astype(result_type)  # always a copy
        b = b.astype(result_type)
        eps = np.finfo(result_type).eps
        n[zero_mask] += eps
        b[zero_mask] += eps
        return np.abs(np.divide(n - b, b))


def _max_abs(value: np.floating) -> _Metric:
    """MaxAbsErr from max(|diff|)."""
    if math.isnan(value):
        return _Metric(NAN, None, MSG_MAX_ABS_NAN)
    return _Metric(format_value(value), float(value))


def _max_rel(value: np.floating) -> _Metric:
    """MaxRelativeErr from max(|RE|)."""
    if math.isnan(value):
        return _Metric(NAN, None, MSG_MAX_REL_NAN)
    return _Metric(format_value(value), float(value))


def _ratio_below(below: np.integer, size: int) -> _Metric:
    """msprobe `calc_relative_err_ratio`: share of RE below the threshold (`below` of `size` values)."""
    if not size:
        return _Metric(NAN)
    ratio = below / size
    return _Metric(format_value(ratio), float(ratio))


def _cosine_cell(
    nf: np.ndarray | None,
    bf: np.ndarray | None,
    a_norm: np.floating,
    b_norm: np.floating,
    dot: np.floating | None = None,
) -> _Metric:
    """msprobe alg_cosine_similarity on flattened float64 arrays and their L2 norms (size >= 2), or their `dot`
    product where already summed (`_large_metrics`); numpy's floating-point warnings off (`_array_metrics`)."""
    if a_norm <= _FLOAT_EPSILON and b_norm <= _FLOAT_EPSILON:
        return _Metric(1.0, 1.0)
    if a_norm <= _FLOAT_EPSILON:
        return _Metric(NAN, None, MSG_COS_NPU_ZERO)
    if b_norm <= _FLOAT_EPSILON:
        return _Metric(NAN, None, MSG_COS_BENCH_ZERO)
    if dot is None:
        assert nf is not None and bf is not None
        dot = np.dot(nf, bf)
    cos = dot / (a_norm * b_norm)  # under the caller's np.errstate(all="ignore")
    if math.isnan(cos):
        return _Metric(NAN, None, MSG_COS_NAN)
    cell = format_value(cos)
    if cell > _COSINE_THRESHOLD:
        cell = round(cell, 6)
    return _Metric(cell, float(cos))


def _scalar_metrics(n: np.ndarray, b: np.ndarray) -> list[_Metric]:
    """0-d pair: MaxAbsErr in the arrays' own dtype (bool as float), MaxRelativeErr, the rest unsupported."""
    if n.dtype == bool:
        n, b = n.astype(float), b.astype(float)
    unsupported = _Metric(UNSUPPORTED, None, MSG_SCALAR)
    with np.errstate(all="ignore"):
        diff = n - b
    rel = _relative_err(n, b)
    return [unsupported, unsupported, _max_abs(np.max(np.abs(diff))), _max_rel(np.max(rel)), unsupported, unsupported]


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays' values one after the other (no copy for one contiguous array)."""
    return arrays[0].reshape(-1) if len(arrays) == 1 else np.concatenate([a.reshape(-1) for a in arrays])


def _per_pair(ufunc: np.ufunc, values: np.ndarray, starts: list[int], dtype: type | None = None) -> list:
    """ufunc's reduction of each pair's part of `values` (pairs starting at `starts`; every part non-empty)."""
    if len(starts) == 1:
        return [ufunc.reduce(values, dtype=dtype)]
    return list(ufunc.reduceat(values, starts, dtype=dtype))


def _array_metrics(ns: list[np.ndarray], bs: list[np.ndarray]) -> list[tuple[list[_Metric], float]]:
    """The six metrics and rel_l2 of each same-shape pair (ns[i], bs[i]) of size >= 2 (non-finites already
    zeroed); all of `ns` of one dtype, all of `bs` of one.

    Element-wise steps run once over the pairs' values put one after the other (on small tensors numpy's
    per-call overhead is most of the cost); maxima and counts are reduced per pair with reduceat (exact in any
    order); sums of floats, whose rounding depends on their order, are each pair's own dot products (as
    np.linalg.norm takes them).
    """
    n, b = _flat(ns), _flat(bs)
    nf, bf = n.astype(float), b.astype(float)  # msprobe flatten_numpy
    with np.errstate(all="ignore"):
        diff = nf - bf
    rel = _relative_err(n, b)
    sizes = [x.size for x in ns]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    max_abs = _per_pair(np.maximum, np.abs(diff), starts)
    max_rel = _per_pair(np.maximum, rel, starts)
    below = [_per_pair(np.add, rel < limit, starts, np.int_) for limit in (_THOUSAND, _FIVE_THOUSAND)]
    out = []
    with np.errstate(all="ignore"):
        for i, (start, size) in enumerate(zip(starts, sizes)):
            x, y, d = nf[start : start + size], bf[start : start + size], diff[start : start + size]
            a_norm, b_norm = np.sqrt(x.dot(x)), np.sqrt(y.dot(y))  # np.linalg.norm of a float64 vector
            euc = float(np.sqrt(d.dot(d)))
            metrics = [
                _cosine_cell(x, y, a_norm, b_norm),
                _Metric(euc, euc),
                _max_abs(max_abs[i]),
                _max_rel(max_rel[i]),
                _ratio_below(below[0][i], size),
                _ratio_below(below[1][i], size),
            ]
            out.append((metrics, _rel_l2_of(euc, b_norm, x, y)))
    return out


def _rel_l2_of(euc: float, b_norm: np.floating, nf: np.ndarray, bf: np.ndarray) -> float:
    """rel_l2 of a finite pair from its EucDist and the bench's norm (`_norm_ratio` where they lose precision)."""
    ref = float(b_norm)
    if ref == 0.0 and euc == 0.0:
        return 0.0
    if math.isfinite(euc) and _SAFE_LOW < ref < math.inf:
        return euc / ref
    return _norm_ratio(nf, bf)


def _zero_nonfinite(
    n: np.ndarray, b: np.ndarray, masks: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray] | None:
    """msprobe `handle_inf_nan`: None if the isnan or isinf masks differ, else copies with those set to 0."""
    n_nan, n_inf, b_nan, b_inf = masks
    if not (np.array_equal(n_inf, b_inf) and np.array_equal(n_nan, b_nan)):
        return None
    n, b = n.copy(), b.copy()
    bad = n_inf | n_nan
    n[bad] = 0
    b[bad] = 0
    return n, b


def _result(metrics: list[_Metric], chain_msg: str, rl2: float | None, mismatch: int) -> TensorMetrics:
    raw = [m.raw for m in metrics]
    return TensorMetrics(
        cosine=raw[0],
        euc_dist=raw[1],
        max_abs_err=raw[2],
        max_rel_err=raw[3],
        one_thousandth=raw[4],
        five_thousandth=raw[5],
        rel_l2=rl2,
        msprobe={col: m.cell for col, m in zip(TENSOR_COLUMNS, metrics)},
        message=chain_msg + "".join(m.message for m in metrics),
        nonfinite_mismatch=mismatch,
    )


def _uniform(cell: str, chain_msg: str, rl2: float | None, mismatch: int) -> TensorMetrics:
    return _result([_Metric(cell)] * len(TENSOR_COLUMNS), chain_msg, rl2, mismatch)


def tensor_metrics(npu: np.ndarray, bench: np.ndarray) -> TensorMetrics:
    """msprobe 26.2.0 tensor-mode compare of two full tensors (arrays already loaded; bf16 given as float32).

    Squeeze, then the validation chain (NPU empty -> all 'unsupported'; shapes differ -> all 'shape
    unmatched'; 0-d -> only MaxAbsErr / MaxRelativeErr; NaN/Inf masks differ -> all 'N/A', else those
    positions zeroed; dtype differs -> message only), then Cosine, EucDist, MaxAbsErr, MaxRelativeErr and
    the One / Five Thousandth ratios with msprobe's rounding (float('{:.12f}'), cosine > 0.9999 rounded to
    6 decimals), plus rel_l2. The typed fields hold the values before msprobe's rounding, None where msprobe
    writes text; the input arrays are never modified.
    """
    n, b = np.squeeze(np.asarray(npu)), np.squeeze(np.asarray(bench))
    if n.size == 0:
        return _uniform(UNSUPPORTED, MSG_EMPTY, None, 0)
    if n.shape != b.shape:
        return _uniform(SHAPE_UNMATCHED, MSG_SHAPE, None, 0)
    if n.size > LARGE and n.ndim > 0:
        return _large_metrics(n, b)
    finite = _all_finite(n) and _all_finite(b)
    masks = None if finite else (*_nonfinite_masks(n), *_nonfinite_masks(b))
    mismatch = 0 if masks is None else _status_mismatch(n, b, masks)
    if n.ndim == 0:
        return _result(_scalar_metrics(n, b), MSG_SCALAR_CHAIN, rel_l2(n, b), mismatch)
    if masks is not None:
        zeroed = _zero_nonfinite(n, b, masks)
        if zeroed is None:
            return _uniform(N_A, MSG_NONFINITE, rel_l2(n, b), mismatch)
        n, b = zeroed
    [(metrics, rl2)] = _array_metrics([n], [b])
    return _result(metrics, MSG_DTYPE if n.dtype != b.dtype else "", rl2, mismatch)


# ---------------------------------------------------------------- large tensors, in chunks

LARGE = 1 << 22  # tensors of more elements are compared CHUNK elements at a time: memory stays the two arrays
CHUNK = 1 << 20  # plus a few chunk-sized float64 temporaries (8 MB each), not ~10 full-size copies


def _large_metrics(n: np.ndarray, b: np.ndarray) -> TensorMetrics:
    """`tensor_metrics` of a same-shape pair of more than LARGE elements, CHUNK elements at a time: the same
    validation chain and cells (sums taken chunk by chunk: the last bits of the float sums may differ from one
    whole-array pass), with the working memory of a chunk."""
    nf, bf = n.reshape(-1), b.reshape(-1)
    size = nf.size
    acc = _Sums()
    for start in range(0, size, CHUNK):
        acc.add(nf[start : start + CHUNK], bf[start : start + CHUNK])
    rl2 = acc.rel_l2(nf, bf)
    if not acc.masks_equal:
        return _uniform(N_A, MSG_NONFINITE, rl2, acc.mismatch)
    with np.errstate(all="ignore"):
        a_norm, b_norm = np.sqrt(np.float64(acc.xx)), np.sqrt(np.float64(acc.yy))
        euc = float(np.sqrt(acc.dd))
        metrics = [
            _cosine_cell(None, None, a_norm, b_norm, dot=np.float64(acc.xy)),
            _Metric(euc, euc),
            _max_abs(np.max(np.array(acc.max_abs))),
            _max_rel(np.max(np.array(acc.max_rel))),
            _ratio_below(np.int64(acc.below[0]), size),
            _ratio_below(np.int64(acc.below[1]), size),
        ]
    return _result(metrics, MSG_DTYPE if n.dtype != b.dtype else "", rl2, acc.mismatch)


class _Sums:
    """What `_large_metrics` gathers chunk by chunk: the NaN/Inf masks' agreement and mismatch count, the sums of the
    pair with NaN/Inf positions zeroed (msprobe's handle_inf_nan: equal to the positions finite on both sides when
    the masks agree), the maxima and the counts below the thousandth thresholds."""

    def __init__(self) -> None:
        self.masks_equal = True
        self.mismatch = 0
        self.xx = self.yy = self.xy = self.dd = 0.0
        self.max_abs: list[float] = []
        self.max_rel: list[float] = []
        self.below = [0, 0]
        self.scale = 0.0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        if not (_all_finite(x) and _all_finite(y)):
            masks = (*_nonfinite_masks(x), *_nonfinite_masks(y))
            self.mismatch += _status_mismatch(x, y, masks)
            self.masks_equal &= bool(np.array_equal(masks[0], masks[2]) and np.array_equal(masks[1], masks[3]))
            keep = np.isfinite(x) & np.isfinite(y)
            x, y = np.where(keep, x, 0).astype(x.dtype), np.where(keep, y, 0).astype(y.dtype)
        xf, yf = x.astype(float), y.astype(float)
        with np.errstate(all="ignore"):
            d = xf - yf
            self.xx += float(xf.dot(xf))
            self.yy += float(yf.dot(yf))
            self.xy += float(xf.dot(yf))
            self.dd += float(d.dot(d))
            self.scale = max(self.scale, float(np.max(np.abs(xf))), float(np.max(np.abs(yf))))
            self.max_abs.append(float(np.max(np.abs(d))))
            rel = _relative_err(x, y)
            self.max_rel.append(float(np.max(rel)))
            self.below[0] += int(np.count_nonzero(rel < _THOUSAND))
            self.below[1] += int(np.count_nonzero(rel < _FIVE_THOUSAND))

    def rel_l2(self, nf: np.ndarray, bf: np.ndarray) -> float:
        """||x - y|| / ||y|| over positions finite on both sides (as `rel_l2`), from the sums, or chunk by chunk on
        the unit scale where they over- or underflow."""
        if self.scale == 0.0:
            return 0.0
        dd, yy = self.dd, self.yy
        if not (_SAFE_LOW < self.scale < _SAFE_HIGH and math.isfinite(dd) and math.isfinite(yy)):
            dd = yy = 0.0
            for start in range(0, nf.size, CHUNK):
                x, y = _finite_pair(nf[start : start + CHUNK], bf[start : start + CHUNK])
                x, y = x / self.scale, y / self.scale
                dd += float((x - y).dot(x - y))
                yy += float(y.dot(y))
        if yy == 0.0:
            return 0.0 if dd == 0.0 else math.inf
        return math.sqrt(dd) / math.sqrt(yy)


def large_finite_cosine_and_max_abs(x: np.ndarray, y: np.ndarray) -> tuple[float | None, float | None]:
    """`cosine(x, y)` and the largest |x - y| over positions finite on both sides, CHUNK elements at a time (for
    pairs of more than LARGE elements)."""
    xf, yf = x.reshape(-1), y.reshape(-1)
    xx = yy = xy = 0.0
    best: float | None = None
    scale = 0.0
    for start in range(0, xf.size, CHUNK):
        a, b = _finite_pair(xf[start : start + CHUNK], yf[start : start + CHUNK])
        if a.size:
            scale = max(scale, _max_abs_of(a, b))
            m = float(np.max(np.abs(a - b)))
            best = m if best is None else max(best, m)
    unit = 1.0 if scale == 0.0 or _SAFE_LOW < scale < _SAFE_HIGH else scale
    for start in range(0, xf.size, CHUNK):
        a, b = _finite_pair(xf[start : start + CHUNK], yf[start : start + CHUNK])
        a, b = a / unit, b / unit
        xx += float(a.dot(a))
        yy += float(b.dot(b))
        xy += float(a.dot(b))
    xn, yn = math.sqrt(xx), math.sqrt(yy)
    if xn == 0.0 or yn == 0.0:
        return (1.0 if xn == yn else None), best
    return min(1.0, max(-1.0, xy / (xn * yn))), best


_TOGETHER = 1 << 14  # elements computed together by tensor_metrics_many: the working arrays stay in the CPU cache
# (measured on the bench pair: 1 << 14 took 0.18 s, 1 << 13 0.22 s, 1 << 16 0.3-0.4 s, one pair at a time 0.4-0.5 s)


def tensor_metrics_many(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[TensorMetrics | None]:
    """`tensor_metrics` of each pair that takes its common path (one shape of 2 to _TOGETHER elements, one float
    dtype, all finite), the same values, computed together with pairs of the same dtype, up to _TOGETHER elements
    at a time (see `_array_metrics`); None for the other pairs, which `tensor_metrics` answers one by one."""
    out: list[TensorMetrics | None] = [None] * len(pairs)
    waiting: dict[np.dtype, tuple[list[int], list[np.ndarray], list[np.ndarray]]] = {}
    held: dict[np.dtype, int] = {}

    def flush(dtype: np.dtype) -> None:
        where, ns, bs = waiting.pop(dtype)
        held.pop(dtype)
        for i, (metrics, rl2) in zip(where, _array_metrics(ns, bs)):
            out[i] = _result(metrics, "", rl2, 0)

    for i, (npu, bench) in enumerate(pairs):
        n, b = np.squeeze(np.asarray(npu)), np.squeeze(np.asarray(bench))
        if not (
            n.dtype == b.dtype
            and n.dtype.kind == "f"
            and n.shape == b.shape
            and 2 <= n.size <= _TOGETHER
            and _all_finite(n)
            and (bench is npu or _all_finite(b))
        ):
            continue
        if held.get(n.dtype, 0) + n.size > _TOGETHER:
            flush(n.dtype)
        where, ns, bs = waiting.setdefault(n.dtype, ([], [], []))
        where.append(i)
        ns.append(n)
        bs.append(b)
        held[n.dtype] = held.get(n.dtype, 0) + n.size
    for dtype in list(waiting):
        flush(dtype)
    return out


# ---------------------------------------------------------------- msprobe statistics mode

_NUM, _NAN, _INF, _NEG_INF, _DEVICE, _NA, _OTHER = "num", "nan", "inf", "-inf", "device", "na", "other"
_DEVICE_WORDS = ("npu", "cpu", "cuda")
_STATS: tuple[tuple[str, str, str, str, str], ...] = (
    ("Max", "Max diff", "MaxRelativeErr", "max_diff", "max_rel"),
    ("Min", "Min diff", "MinRelativeErr", "min_diff", "min_rel"),
    ("Mean", "Mean diff", "MeanRelativeErr", "mean_diff", "mean_rel"),
    ("Norm", "L2norm diff", "NormRelativeErr", "norm_diff", "norm_rel"),
)


def _build_stat_rules() -> dict[tuple[str, str], str]:
    """CalcStatsDiff.build_rules for unequal pairs (num x num is computed); missing pairs give 'N/A'."""
    rules: dict[tuple[str, str], str] = {}
    for t in (_NUM, _NAN, _INF, _NEG_INF):
        rules[(_NAN, t)] = rules[(t, _NAN)] = NAN
    for t in (_NUM, _NEG_INF):
        rules[(_INF, t)] = INF
    for t in (_NUM, _INF):
        rules[(_NEG_INF, t)] = NEG_INF
    rules[(_NUM, _INF)] = NEG_INF
    rules[(_NUM, _NEG_INF)] = INF
    for t in (_NUM, _NAN, _INF, _NEG_INF, _DEVICE, _NA, _OTHER):
        rules[(_NA, t)] = rules[(t, _NA)] = N_A
    for t in (_NUM, _NAN, _INF, _NEG_INF, _DEVICE, _OTHER):
        rules[(_DEVICE, t)] = rules[(t, _DEVICE)] = DIFF
        rules[(_OTHER, t)] = rules[(t, _OTHER)] = DIFF
    rules[(_DEVICE, _DEVICE)] = N_A
    return rules


_STAT_RULES = _build_stat_rules()


def _summary_value(value: object) -> object:
    """A dump.json statistic as msprobe's table holds it: None -> 'None', NaN -> 'Nan'."""
    if value is None:
        return "None"
    if str(value).lower() == "nan":
        return NAN
    return value


def _parse_number(value: object) -> int | float | None:
    """pandas.to_numeric(errors='coerce') for one value; None where that gives NaN."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    text = str(value)
    stripped = text.strip()
    if "_" in text or not text.isascii() or not stripped:
        return None
    if stripped.lstrip("+-").lower() in ("inf", "infinity") and stripped != text:
        return None
    try:
        return int(stripped)
    except ValueError:
        pass
    try:
        number = float(stripped)
    except ValueError:
        return None
    return None if math.isnan(number) else number


def _classify(value: object) -> str:
    """CalcStatsDiff.classify: first match of nan, inf, -inf, number, device, N/A, else other."""
    text = str(value)
    low = text.lower()
    if low == "nan" or (isinstance(value, (float, np.floating)) and math.isnan(value)):
        return _NAN
    is_real = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
    if low == "inf" or (is_real and value == math.inf):
        return _INF
    if low == "-inf" or (is_real and value == -math.inf):
        return _NEG_INF
    if _parse_number(value) is not None and low not in ("true", "false"):
        return _NUM
    if any(word in low for word in _DEVICE_WORDS):
        return _DEVICE
    if text == N_A:
        return _NA
    return _OTHER


def _num_num(npu: object, bench: object) -> tuple[float, str, float | None]:
    """rule_num_num: (diff, relative-error cell, relative error as a fraction)."""
    a, b = _parse_number(str(npu)), _parse_number(str(bench))
    assert a is not None and b is not None  # called for two numbers only
    diff = a - b
    if b == 0:
        return float(diff), INF, math.inf
    fraction = abs(float(diff) / float(b))
    cell = str(abs(float(diff) / float(b) * 100)) + "%"
    return float(diff), cell, None if math.isnan(fraction) else fraction


def _cell_number(cell: str) -> float | None:
    """'0', 'inf', '-inf' as numbers; None for 'Nan', 'N/A', 'Diff'."""
    return {"0": 0.0, INF: math.inf, NEG_INF: -math.inf}.get(cell)


def _stat_pair(npu: object, bench: object) -> tuple[str | float, str, float | None, float | None]:
    """One statistic: (diff cell, relative-error cell, diff as float, relative error as fraction)."""
    npu, bench = _summary_value(npu), _summary_value(bench)
    if str(npu) == str(bench):
        return 0.0, "0", 0.0, 0.0
    kinds = (_classify(npu), _classify(bench))
    if kinds == (_NUM, _NUM):
        diff, cell, fraction = _num_num(npu, bench)
        return diff, cell, None if math.isnan(diff) else diff, fraction
    static = _STAT_RULES.get(kinds, N_A)
    number = _cell_number(static)
    return (static if number is None else number), static, number, number


def stats_diff(npu: dict, bench: dict) -> dict[str, object]:
    """msprobe 26.2.0 statistics mode (CalcStatsDiff) for one row.

    Inputs: dicts with keys Max, Min, Mean, Norm (float/int/bool/None/'N/A' as in dump.json; missing = None).
    Returns msprobe's cells under 'Max diff', 'Min diff', 'Mean diff', 'L2norm diff' (a float; 'Nan', 'N/A' or
    'Diff' as text) and 'MaxRelativeErr', 'MinRelativeErr', 'MeanRelativeErr', 'NormRelativeErr' (text such as
    '0.9186025255386479%', '0', 'inf', '-inf', 'Nan', 'N/A', 'Diff'), and the same as plain floats under
    'max_diff' ... 'norm_diff' and 'max_rel' ... 'norm_rel' (fraction, not percent; None where not a number).
    """
    out: dict[str, object] = {}
    for key, diff_col, rel_col, diff_key, rel_key in _STATS:
        diff_cell, rel_cell, diff, rel = _stat_pair(npu.get(key), bench.get(key))
        out[diff_col], out[rel_col], out[diff_key], out[rel_key] = diff_cell, rel_cell, diff, rel
    return out

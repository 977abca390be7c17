"""The conditioning prior of an op class: how much of an error reaching an op its output can show.

The backward of an elementwise op whose derivative is a function of its result r (PyTorch's derivative formulas
use `result`) computes grad_in = grad_out x f'(r), a gain that varies over the tensor.  An absolute error d on
grad_out reaches grad_in as at most max|f'(r)| x ||d||; relative to ||grad_in|| that is max|f'| x ||d|| /
||grad_in||, which the elements of largest gain dominate: an RMS norm's rsqrt has f' = -r^3 / 2, so the rows of
least variance, whose r is largest, carry its gradient, and an error of their small incoming gradient (a value
that may be judged on its record's scale as a small value, rules.apply_small_values) shows in full in the output.
max|f'| over the tensor follows from the range [min, max] of r, which the forward record's statistics give in both
dump modes (noise.with_result_gain, noise.record_measures).  No constant is chosen: the gains are the derivatives.
"""

from __future__ import annotations

import math


def _sigmoid_gain(lo: float, hi: float) -> float:
    return 0.25 if lo <= 0.5 <= hi else max(lo * (1 - lo), hi * (1 - hi))


def _tanh_gain(lo: float, hi: float) -> float:
    return 1.0 if lo <= 0.0 <= hi else 1.0 - min(lo * lo, hi * hi)


def _sqrt_gain(lo: float, hi: float) -> float:
    low = 0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi))
    return 0.5 / low if low > 0 else float("inf")


RESULT_GAIN = {  # op -> max |f'(x)| over results in [lo, hi], f' written in the result r = f(x)
    "rsqrt": lambda lo, hi: 0.5 * max(abs(lo), abs(hi)) ** 3,  # d/dx x^-1/2 = -r^3 / 2
    "reciprocal": lambda lo, hi: max(abs(lo), abs(hi)) ** 2,  # d/dx 1/x = -r^2
    "exp": lambda lo, hi: max(abs(lo), abs(hi)),  # d/dx e^x = r
    "sqrt": _sqrt_gain,  # d/dx x^1/2 = 1 / (2 r)
    "sigmoid": _sigmoid_gain,  # r (1 - r)
    "tanh": _tanh_gain,  # 1 - r^2
}


def result_gain(op_class: str | None, lo: float | None, hi: float | None) -> float | None:
    """max |f'| of an elementwise op class (`Torch.rsqrt`, `Tensor.exp_`, ...) over its forward results in [lo, hi]
    (RESULT_GAIN); None for other classes, an unknown or non-finite range, or an unbounded gain (sqrt at 0)."""
    if not op_class or lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    fn = RESULT_GAIN.get(op_class.rsplit(".", 1)[-1].lower().strip("_"))
    if fn is None:
        return None
    g = float(fn(min(lo, hi), max(lo, hi)))
    return g if math.isfinite(g) else None

"""The conditioning prior of an elementwise backward whose derivative is a function of its result
(analysis/conditioning.py): the gain max|f'(r)| over the forward's result range, and how it carries an input
error through the op (noise.record_measures), on exact values and on a hand-made RMS-norm rsqrt pair."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from test_stats_blind import _pair

from dumpstore.analysis.conditioning import result_gain
from dumpstore.analysis.noise import record_measures


@pytest.mark.parametrize(
    ("op_class", "lo", "hi", "gain"),
    [
        ("Torch.rsqrt", 6.0, 100.0, 0.5 * 100.0**3),
        ("Tensor.rsqrt_", 6.0, 100.0, 0.5 * 100.0**3),
        ("Torch.reciprocal", -4.0, 2.0, 16.0),
        ("Torch.exp", 0.5, 3.0, 3.0),
        ("Torch.sqrt", 0.25, 4.0, 2.0),
        ("Torch.sigmoid", 0.1, 0.9, 0.25),
        ("Torch.sigmoid", 0.8, 0.9, 0.8 * 0.2),
        ("Torch.tanh", -0.5, 0.5, 1.0),
        ("Torch.tanh", 0.5, 0.9, 0.75),
    ],
)
def test_the_gain_is_the_largest_derivative_over_the_result_range(op_class, lo, hi, gain):
    assert result_gain(op_class, lo, hi) == pytest.approx(gain, rel=1e-12)


def test_no_gain_for_other_classes_an_unknown_range_or_an_unbounded_derivative():
    assert result_gain("Functional.gelu", 0.0, 1.0) is None
    assert result_gain("Torch.rsqrt", None, 1.0) is None
    assert result_gain("Torch.rsqrt", float("nan"), 1.0) is None
    assert result_gain("Torch.sqrt", 0.0, 4.0) is None  # 1 / (2 r) at r = 0


def _records(direction: str = "backward") -> pl.DataFrame:
    """An rsqrt forward (results in [6, 100]) and its backward: the incoming gradient 5e-5 off relative to its
    norm 1e-3 (an absolute error of 5e-8), the outgoing gradient (norm 5) 2 % off."""
    return pl.DataFrame(
        {
            "step": [0, 0],
            "rank": [0, 0],
            "source": ["", ""],
            "_record": ["Torch.rsqrt.0.forward", f"Torch.rsqrt.0.{direction}"],
            "op_class": ["Torch.rsqrt", "Torch.rsqrt"],
            "_direction": ["forward", direction],
            "in_err": [0.0, 5e-5],
            "in_abs": [0.0, 5e-8],
            "res_lo": [6.0, None],
            "res_hi": [100.0, None],
            "out_err": [0.0, 0.02],
            "in_norm": [1.0, 1e-3],
            "out_norm": [50.0, 5.0],
            "tol": [2.0**-13, 2.0**-13],
            "tol_dtype": ["float32", "float32"],
        }
    )


def test_a_gain_carries_the_absolute_input_error_relative_to_the_output():
    """5e-8 x 0.5 x 100^3 / 5 = 0.005 carried: the 2 % output is 4x that, not the 400x of 0.02 / 5e-5."""
    got = record_measures(_records()).row(1, named=True)
    assert got["amp"] == pytest.approx(0.02 / 0.005, rel=1e-12)
    assert got["fresh"] is False and "gain" not in record_measures(_records()).columns


def _rsqrt_steps(target: bool, fault: float) -> list[dict]:
    """An RMS norm's rsqrt over 16 rows, one of tiny variance (r = 100, the others 6 to 10); its backward's
    incoming gradient is 2 % off on that row in the target (what the gradients reaching a norm of a clean pair do),
    which its gain r^3 / 2 carries in full to the outgoing gradient; `fault`: the outgoing gradient off by that."""
    f32 = np.float32
    v = np.linspace(0.01, 0.03, 16).astype(f32).reshape(16, 1)
    v[0] = 1e-4
    r = (1 / np.sqrt(v)).astype(f32)
    g = np.full((16, 1), 2e-3, dtype=f32)
    g[0] = 1e-5
    if target:
        g[0] *= f32(1.02)
    y = (-0.5 * g * r**3 * (1 + fault)).astype(f32)
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(f32)
    recs = {f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [x * f32(i + 1)]} for i in range(4)}
    recs["Torch.rsqrt.0.forward"] = {"input_args": [v], "output": [r]}
    recs["Torch.rsqrt.0.backward"] = {"input": [g], "output": [y]}
    return [recs]


def test_an_rsqrt_backward_carrying_its_dominant_rows_gradient_error_is_quiet(dump_writer, store_dir):
    v = _pair(dump_writer, store_dir, "tensor", _rsqrt_steps(False, 0.0), _rsqrt_steps(True, 0.0))
    assert v.culprit is None


def test_an_rsqrt_backward_beyond_its_gain_is_named(dump_writer, store_dir):
    v = _pair(dump_writer, store_dir, "tensor", _rsqrt_steps(False, 0.0), _rsqrt_steps(True, 0.5))
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Torch.rsqrt.0.backward", "op")

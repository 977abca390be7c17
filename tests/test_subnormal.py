"""Subnormal values (rules.small_value_err, `tiny_judged`): below a dtype's smallest normal number its values are
spaced by eps x that number, so a float16 tensor of rms 1e-5 holds about 3 significant bits less than the
tolerance assumes; it is judged by absolute error on that scale.  On exact arrays and a small real dump pair."""

from __future__ import annotations

import numpy as np
import pytest
from test_noise import _ingest_pair

from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.rules import SUBNORMAL_BELOW, small_value_err

TINY16 = 2.0**-14


def test_a_tensor_below_the_smallest_normal_is_judged_on_that_scale():
    """Two record groups of one tensor each (no context): rms 1e-5 in float16 (subnormal) and 1e-2 (normal),
    both 3e-3 off relative to their norm."""
    n = np.array([64.0, 64.0])
    r_norm = np.array([1e-5, 1e-2]) * 8.0
    err = np.array([3e-3, 3e-3])
    out, scale, _, small = small_value_err(
        err, r_norm, r_norm, n, np.array([True, True]), np.array([0, 1]), np.full(2, 2.0**-10), np.full(2, TINY16)
    )
    assert small.tolist() == [True, False]
    assert out[0] == pytest.approx(3e-3 * 1e-5 / TINY16, rel=1e-12) and out[1] == 3e-3
    assert scale[0] == TINY16 and scale[1] == pytest.approx(1e-2, rel=1e-12)
    # without the dtype's smallest normal (the screened path's callers before it), as before
    out, _, _, small = small_value_err(
        err, r_norm, r_norm, n, np.array([True, True]), np.array([0, 1]), np.full(2, 2.0**-10)
    )
    assert not small.any() and out.tolist() == err.tolist()


def test_a_target_far_above_a_zero_or_subnormal_reference_keeps_its_relative_error():
    """A reference of zeros (an accuracy's mean over no correct token) against a target of rms 0.25, and a
    subnormal reference (rms 1e-6) against a target of rms 1e-3: neither is one spacing of rounding; the
    subnormal scale would make them 1e4 to 1e38 tolerances (compare's first row on a clean pair)."""
    n = np.array([64.0, 64.0])
    r_norm = np.array([0.0, 1e-6 * 8.0])
    t_norm = np.array([0.25 * 8.0, 1e-3 * 8.0])
    err = np.array([np.inf, 999.0])
    out, _, _, small = small_value_err(
        err, t_norm, r_norm, n, np.array([True, True]), np.array([0, 1]), np.full(2, 2.0**-7), np.full(2, TINY16)
    )
    assert small.tolist() == [False, False]
    assert out.tolist() == err.tolist()


def test_float16s_smallest_normal():
    assert SUBNORMAL_BELOW["float16"] == float(np.finfo(np.float16).tiny)
    assert SUBNORMAL_BELOW["float32"] == float(np.finfo(np.float32).tiny)


def _pair(scale: float, target: bool) -> dict:
    """A float16 multiply by `scale` whose target output differs by one float16 spacing at `scale` on half of
    its elements (a device rounding once otherwise)."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=256) * 2.0**-10).astype(np.float16)  # rms 1e-3: no small value beside y
    y = (x.astype(np.float32) * scale).astype(np.float16)
    if target:
        step = np.spacing(np.abs(y)).astype(np.float16)
        y = (y + step * (np.arange(256) % 2)).astype(np.float16)
    return {"Tensor.mul.0.forward": {"input_args": [x, {"type": "float", "value": scale}], "output": [y]}}


def test_a_float16_output_off_by_one_subnormal_spacing_is_quiet(dump_writer, store_dir):
    st = _ingest_pair(dump_writer, store_dir, "tensor", _pair(2.0**-8, False), _pair(2.0**-8, True))
    cmp = compare_runs(st, "target", "ref")
    out = cmp.rows.filter(cmp.rows["io"] == "output").row(0, named=True)
    assert out["small_value"] and out["status"] == "pass" and "subnormal" in out["detail"]
    assert divergence(cmp).culprit is None


def test_a_float16_output_off_by_as_much_relative_error_at_a_normal_scale_is_named(dump_writer, store_dir):
    """The same multiply with the outputs at rms 4e-3, off on half the elements by a relative error as large as
    the subnormal one's (spacing 2^-24 on values ~4e-6: 4e-3): named."""
    ref, tgt = _pair(4.0, False), _pair(4.0, True)
    y = tgt["Tensor.mul.0.forward"]["output"][0].astype(np.float32)
    y0 = ref["Tensor.mul.0.forward"]["output"][0].astype(np.float32)
    y = (y0 + (y0 * 4e-3) * (np.arange(256) % 2)).astype(np.float16)
    tgt["Tensor.mul.0.forward"]["output"] = [y]
    v = divergence(compare_runs(_ingest_pair(dump_writer, store_dir, "tensor", ref, tgt), "target", "ref"))
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mul.0.forward", "op")

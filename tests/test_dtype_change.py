"""A tensor computed in another float dtype than the reference's (analysis/dtype_change.py), on small hand-made
dump pairs in both dump modes."""

from __future__ import annotations

import numpy as np
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence

T, D = 16, 8


def _pair(dump_writer, store_dir, mode: str, ref: dict, target: dict):
    for name, recs in (("ref", ref), ("target", target)):
        w = dump_writer(name, mode)
        w.write(recs)
        ingest(w.root, name, store=store_dir, jobs=1)
    return divergence(compare_runs(open_store(store_dir), "target", "ref"))


def _model(model_dtype: str, norm_dtype: str) -> dict:
    """Four GELUs in `model_dtype`, then an RMSNorm's square and mean computed in `norm_dtype` (the reference's
    code upcasts to float32; msprobe records no `Tensor.float`), then a GELU of its result in `model_dtype`."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(T, D)).astype(model_dtype)
    recs: dict = {
        f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [(x * 0.5 * (i + 1)).astype(model_dtype)]}
        for i in range(4)
    }
    h = x.astype(norm_dtype)
    sq = (h * h).astype(norm_dtype)
    recs["Tensor.pow.0.forward"] = {"input_args": [h, {"type": "int", "value": 2}], "output": [sq]}
    m = sq.mean(-1, keepdims=True, dtype=np.float32).astype(norm_dtype)
    recs["Tensor.mean.0.forward"] = {"input_args": [sq], "output": [m]}
    y = (h / np.sqrt(m + 1e-6)).astype(model_dtype)
    recs["Functional.gelu.4.forward"] = {"input_args": [y], "output": [(y * 0.5).astype(model_dtype)]}
    return recs


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_an_op_computed_in_another_dtype_is_named(dump_writer, store_dir, mode):
    """Both runs compute in float16; the target's norm squares in float16 where the reference's code casts its
    input to float32 first (msprobe records no cast): its error stays within the float16 tolerance, the dtype of
    its input, which no recorded op made in the reference, names it."""
    v = _pair(dump_writer, store_dir, mode, _model("float16", "float32"), _model("float16", "float16"))
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind, c.metric) == (0, "Tensor.pow.0.forward", "op", "dtype")
    assert (c.name, c.evidence["dtype"], c.evidence["ref_dtype"]) == (
        "Tensor.pow.0.forward.input.0",
        "float16",
        "float32",
    )


def test_runs_at_other_precisions_are_not_judged_by_dtype(dump_writer, store_dir):
    """A float32 reference against a float16 target differs in the dtype of every tensor by design: no
    dtype finding (the float16 rounding stays within the float16 tolerance: quiet)."""
    v = _pair(dump_writer, store_dir, "tensor", _model("float32", "float32"), _model("float16", "float16"))
    assert v.culprit is None


def _policy(softmax_dtype: str) -> dict:
    """A softmax whose output dtype is the device's (an autocast policy: float32 on one backend, float16 on the
    other) on float16 inputs, and the op reading it."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(T, D)).astype("float16")
    recs: dict = {
        f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [(x * 0.5 * (i + 1)).astype("float16")]}
        for i in range(4)
    }
    e = np.exp(x.astype(np.float64))
    p = (e / e.sum(-1, keepdims=True)).astype(softmax_dtype)
    recs["Functional.softmax.0.forward"] = {"input_args": [x], "output": [p]}
    recs["Tensor.__mul__.0.forward"] = {"input_args": [p, {"type": "float", "value": 2.0}], "output": [p * 2]}
    return recs


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_a_dtype_a_recorded_op_chose_is_not_evidence(dump_writer, store_dir, mode):
    """The softmax's output is float32 in the reference, float16 in the target, on equal inputs: a backend's
    autocast policy, made by a recorded op in both runs: no dtype finding (its float16 rounding: quiet)."""
    v = _pair(dump_writer, store_dir, mode, _policy("float32"), _policy("float16"))
    assert v.culprit is None

"""What siblings may excuse (analysis/sibling_prior.py): a fault in every layer stands out of the prior, a device's
rounding of a class does not; on small hand-made dump pairs."""

from __future__ import annotations

import numpy as np
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.prior import is_reduction, reduction_length
from dumpstore.analysis.sibling_prior import prior_reach

MODES = ("tensor", "statistics")


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _layers(off: float, rng_seed: int = 5) -> list[dict]:
    """Two steps of three layers, each a linear and a gelu on agreeing inputs; the target's gelus are off by
    `off` (relative, random sign per element) in every layer and step."""
    rng = np.random.default_rng(rng_seed)
    steps = []
    for _ in range(2):
        recs = {}
        for i in range(3):
            x, w = _f32(rng.normal(size=(16, 32))), _f32(rng.normal(size=(32, 32)) / 6)
            h = _f32(x @ w.T)
            g = _f32(h / (1 + np.exp(-1.702 * h)))
            recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, w], "output": [h]}
            sign = rng.choice([-1.0, 1.0], size=g.shape)
            recs[f"Functional.gelu.{i}.forward"] = {"input_args": [h], "output": [g, _f32(g * (1 + off * sign))]}
        steps.append(recs)
    return steps


def _pair(dump_writer, store_dir, mode: str, off: float):
    for name, pick in (("ref", 0), ("target", 1)):
        w = dump_writer(name, mode)
        for s, recs in enumerate(_layers(off)):
            one = {k: dict(v, output=[v["output"][pick]]) if "gelu" in k else v for k, v in recs.items()}
            w.write(one, step=s)
        ingest(w.root, name, store=store_dir, jobs=1)
    return divergence(compare_runs(open_store(store_dir), "target", "ref"))


@pytest.mark.parametrize("mode", MODES)
def test_a_fault_in_every_layer_is_named_at_its_first_instance(dump_writer, store_dir, mode):
    """Every gelu 1 % off (80 float32 tolerances): its siblings make as much, the prior allows 4 tolerances."""
    v = _pair(dump_writer, store_dir, mode, 0.01)
    assert v.culprit is not None and (v.culprit.step, v.culprit.op, v.culprit.kind) == (
        0,
        "Functional.gelu.0.forward",
        "op",
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_class_rounded_differently_everywhere_within_the_prior_is_noise(dump_writer, store_dir, mode):
    """Every gelu 1.5 float32 tolerances off (as fp16 inside an fp32 op): its siblings excuse it."""
    v = _pair(dump_writer, store_dir, mode, 1.5 * 2.0**-13)
    assert v.culprit is None


def test_prior_reach():
    rec = {"tol": 2.0**-13, "tol_dtype": "float32", "op_class": "Functional.gelu", "red_len": 4096}
    assert prior_reach(rec) == 4 * 2.0**-13  # elementwise: no reduction length
    bf16 = {"tol": 2.0**-6, "tol_dtype": "bfloat16", "op_class": "Functional.softmax", "k_last": 4096, "red_len": 8192}
    assert prior_reach(bf16) == 3 * 2.0**-7 * 64  # a 4096-term sum (its last axis) accumulated in bf16
    assert is_reduction("Tensor.sum") and is_reduction("Module.LlamaMLP") and is_reduction("Torch.bmm")
    assert not is_reduction("Functional.gelu") and not is_reduction("Tensor.__add__") and not is_reduction(None)


def test_reduction_length_per_op_class():
    """K, one definition for the prior and the siblings' reach: the contraction axis of a matrix product (the
    last axis of its first input, not the vocabulary of a logit layer's weight), the normalised axis of a norm or
    softmax, an upper bound (the largest input axis) where the record does not say which axes are reduced."""
    assert reduction_length("Functional.linear", 512, 32000) == 512
    assert reduction_length("Torch.bmm", 64, 1024) == 64
    assert reduction_length("Functional.rms_norm", 896, 4096) == 896
    assert reduction_length("Functional.conv2d", 7, 256) == 256
    assert reduction_length("Tensor.sum", 8, 4096) == 4096
    assert reduction_length("Functional.scaled_dot_product_attention", 64, 1024) == 1024
    assert reduction_length("Module.model.layers.0.mlp.LlamaMLP", 64, 4096) == 4096
    assert reduction_length("Functional.gelu", 4096, 4096) == 1
    assert reduction_length("Functional.linear", None, None) == 1

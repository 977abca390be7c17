"""An op that reads another tensor in the target than in the reference (analysis/culprit.py `_Judge._rewired`): its
input is another recorded op's output in the target, or a tensor no recorded op made, while its values need not
differ beyond their tolerance.  Hand-made dump pairs in both dump modes (a hand-written SwiGLU backward that reads
sigmoid(g) where it should read 1 - sigmoid(g); a causal mask built without a recorded op in the target, filled
with float32's lowest value), a result computed twice (equal in one run, a rounding apart in the other: no
rewiring), and set 8's StableLM pairs made by its generator with msprobe (marker `validation`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_stats_blind import _pair  # a pair written, ingested and judged

from helpers import ROOT, leaf

T, D = 16, 8
LOW = float(np.finfo(np.float32).min)


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return _f32(1.0 / (1.0 + np.exp(-x.astype(np.float64))))


def _swiglu_backward(target: bool) -> dict:
    """A linear, then a SwiGLU backward written out with recorded ops: s = sigmoid(g), rest = 1 - s, term = g * rest
    (the target: g * s, a sign slip), then 1 + term.  Every other op equal in both runs."""
    rng = np.random.default_rng(3)
    x, w = _f32(rng.normal(size=(T, D))), _f32(rng.normal(size=(D, D)) / 3)
    g = _f32(x @ w.T)
    s = _sigmoid(g)
    rest = _f32(1 - s)
    read = s if target else rest
    term = _f32(g * read)
    return {
        "Functional.linear.0.forward": {"input_args": [x, w], "output": [g]},
        "Torch.sigmoid.0.forward": {"input_args": [g], "output": [s]},
        "Tensor.__rsub__.0.forward": {"input_args": [s, {"type": "int", "value": 1}], "output": [rest]},
        "Tensor.__mul__.0.forward": {"input_args": [g, read], "output": [term]},
        "Tensor.__radd__.0.forward": {"input_args": [term, {"type": "int", "value": 1}], "output": [_f32(1 + term)]},
    }


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_an_op_reading_another_recorded_output_is_named(dump_writer, store_dir, mode):
    """The multiply reads the sigmoid's output in the target and the subtraction's in the reference: named `op` at
    the multiply, with both producers."""
    v = _pair(dump_writer, store_dir, mode, [_swiglu_backward(False)], [_swiglu_backward(True)])
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (0, "Tensor.__mul__.0.forward", "op")
    assert c.evidence["reason"] == "reads another tensor"
    assert c.evidence["reads"] == {"target": "Torch.sigmoid.0.forward", "reference": "Tensor.__rsub__.0.forward"}
    assert c.evidence["differing"] == "Tensor.__mul__.0.forward.input.1"
    assert c.detail == (
        "Tensor.__mul__.0.forward.input.1 is Torch.sigmoid.0.forward's output in the target and "
        "Tensor.__rsub__.0.forward's output in the reference: the op reads another tensor"
    )


def _computed_twice(target: bool) -> dict:
    """A SiLU computed twice (a recomputation) and a multiply reading the second; in the reference the second call
    rounds one element one float32 ulp apart from the first (a non-deterministic kernel), in the target both calls
    agree bit for bit; the multiply's output is 1e-3 off in the target (8 float32 tolerances)."""
    rng = np.random.default_rng(4)
    x, u = _f32(rng.normal(size=(T, D))), _f32(rng.normal(size=(T, D)))
    y1 = _f32(x * _sigmoid(x))
    y2 = y1.copy()
    if not target:
        y2[3, 5] = np.nextafter(y2[3, 5], np.float32(np.inf))
    return {
        "Functional.silu.0.forward": {"input_args": [x], "output": [y1]},
        "Functional.silu.1.forward": {"input_args": [x], "output": [y2]},
        "Tensor.__mul__.0.forward": {"input_args": [y2, u], "output": [_f32(y2 * u * (1 + 1e-3 if target else 1))]},
    }


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_a_result_computed_twice_is_no_rewiring(dump_writer, store_dir, mode):
    """The multiply's input is the first SiLU's output in the target (the same values: the first producer) and the
    second's in the reference; the target's input is the second SiLU's output too, so the op reads the same tensor
    in both runs: not named as a rewiring (it is named by the fresh-op rule, inputs agreeing)."""
    v = _pair(dump_writer, store_dir, mode, [_computed_twice(False)], [_computed_twice(True)])
    c = v.culprit
    assert c is not None and (c.op, c.kind) == ("Tensor.__mul__.0.forward", "op")
    assert c.evidence["reason"] == "inputs agree, output diverges" and "reads" not in c.evidence


def _summed_unrecorded(target: bool) -> dict:
    """A multiply reading a SiLU's output plus a second, tiny term summed in by an op msprobe does not record (as
    autograd sums two gradients): in the target the term rounds away (the input is the SiLU's output, bit for
    bit), in the reference it moves one element one float32 ulp (no recorded op made it); the multiply's output is
    1e-3 off in the target."""
    d = _computed_twice(target)
    y, u = d["Functional.silu.0.forward"]["output"][0], d["Tensor.__mul__.0.forward"]["input_args"][1]
    read = y.copy()
    if not target:
        read[3, 5] = np.nextafter(read[3, 5], np.float32(np.inf))
    del d["Functional.silu.1.forward"]
    d["Tensor.__mul__.0.forward"] = {"input_args": [read, u], "output": [_f32(read * u * (1 + 1e-3 if target else 1))]}
    return d


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_a_recorded_output_in_one_run_only_within_tolerance_is_no_rewiring(dump_writer, store_dir, mode):
    """The multiply's input is the SiLU's output in the target and no recorded op's in the reference, its values
    within their tolerance (one ulp): not named as a rewiring (set 5's Granite on device E, the clean combination
    `granite_E` statistics: a gradient equal to a linear's input gradient in one run, a bf16 rounding apart in the
    other, was named so at step 2)."""
    v = _pair(dump_writer, store_dir, mode, [_summed_unrecorded(False)], [_summed_unrecorded(True)])
    c = v.culprit
    assert c is not None and (c.op, c.kind) == ("Tensor.__mul__.0.forward", "op")
    assert c.evidence["reason"] == "inputs agree, output diverges" and "reads" not in c.evidence


def _mask_leaf(mask: np.ndarray, mode: str) -> np.ndarray | dict:
    """The mask as its reader's input leaf.  Statistics mode: msprobe's Mean and Norm of a tensor filled with the
    dtype's lowest value overflow (-Infinity and Infinity, as set 8's StableLM dumps hold them)."""
    if mode == "tensor":
        return mask
    out = leaf(mask)
    out["Mean"], out["Norm"] = -float("inf"), float("inf")
    return out


def _masked_attention(target: bool, mode: str) -> dict:
    """A causal mask made by a recorded `where` (float32's lowest value above the diagonal), added to the scores,
    then a softmax.  The target adds a mask off by one (each token also sees the next), built by ops msprobe does
    not record; it still makes the reference's mask with the `where`."""
    rng = np.random.default_rng(6)
    scores = _f32(rng.normal(size=(T, T)) / 4)
    above = np.triu(np.ones((T, T), dtype=bool), 1)
    mask = _f32(np.where(above, LOW, 0.0))
    read = _f32(np.where(np.triu(np.ones((T, T), dtype=bool), 2), LOW, 0.0)) if target else mask
    added = _f32(scores + read)
    e = np.exp(added.astype(np.float64) - added.max(axis=-1, keepdims=True))
    probs = _f32(e / e.sum(axis=-1, keepdims=True))
    return {
        "Torch.where.0.forward": {
            "input_args": [above, {"type": "float", "value": LOW}, {"type": "float", "value": 0.0}],
            "output": [_mask_leaf(mask, mode)],
        },
        "Tensor.__add__.0.forward": {
            "input_args": [scores, _mask_leaf(read, mode)],
            "output": [_mask_leaf(added, mode)],
        },
        "Functional.softmax.0.forward": {"input_args": [_mask_leaf(added, mode)], "output": [probs]},
    }


def test_a_mask_no_recorded_op_made_is_named_at_its_reader(dump_writer, store_dir):
    """Tensor mode: the add's mask is the `where`'s output in the reference and no recorded op's in the target, and
    its lowest-value fill sits at other places (counted from the files): named `input` at the add."""
    v = _pair(
        dump_writer, store_dir, "tensor", [_masked_attention(False, "tensor")], [_masked_attention(True, "tensor")]
    )
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (0, "Tensor.__add__.0.forward", "input")
    assert c.evidence["reads"] == {"target": None, "reference": "Torch.where.0.forward"}
    assert c.detail.startswith("Tensor.__add__.0.forward.input.1 is a tensor no recorded op made in the target and ")


def test_a_mask_whose_statistics_overflow_is_not_seen_at_its_reader(dump_writer, store_dir):
    """Statistics mode (the limit in docs/limits.md): both masks have Max 0, Min the lowest value, Mean -Inf and Norm
    Inf, so the target's mask is the same tensor as the `where`'s output as far as statistics show; the add's output
    is not judged (NaN/Inf in both runs) and the first op whose output differs on inputs that agree as far as they
    are judged is the softmax."""
    v = _pair(
        dump_writer, store_dir, "statistics", [_masked_attention(False, "stats")], [_masked_attention(True, "stats")]
    )
    c = v.culprit
    assert c is not None and (c.op, c.kind) == ("Functional.softmax.0.forward", "op")


V8 = Path(os.environ.get("VALIDATION_V8_DATA", ROOT / "validation" / "v8" / ".data"))
V8_CASES = ["stablelm_mask_L0", "stablelm_swiglu_backward_L1", "stablelm_clean"]


@pytest.mark.validation
def test_set8_stablelm_pairs(tmp_path):
    """Set 8's StableLM pairs (msprobe dumps of a bf16 model with fp32 master weights on device AM), made by its
    generator where absent: the SwiGLU backward's sign slip named at step 0 (statistics mode), the off-by-one mask
    named at its add in tensor mode and, its statistics overflowing, at the softmax after it in statistics mode;
    the clean pairs quiet."""
    if not (V8 / "key.json").exists():
        make = ROOT / "validation" / "v8" / "make_pairs.py"
        subprocess.run([sys.executable, str(make), "--out", str(V8), "--only", *V8_CASES], check=True)
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "validation" / "score.py"), "--data", str(V8), "--json", str(out), "--only"]
    subprocess.run(cmd + V8_CASES, check=True, capture_output=True)
    got = {r["name"]: r["got"] for r in json.loads(out.read_text())}
    assert got == {
        "stablelm_mask_L0_stats": "op step 0 Functional.softmax.0.forward",
        "stablelm_mask_L0_tensor": "input step 0 Tensor.__add__.5.forward",
        "stablelm_swiglu_backward_L1_stats": "op step 0 Tensor.__mul__.15.forward",
        "stablelm_clean_stats": "none",
        "stablelm_clean_tensor": "none",
    }


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_a_gradient_whose_producer_changed_after_a_near_tie_flip_is_the_flips(dump_writer, store_dir, mode):
    """test_flipflow's MoE pair (a top-2 router tied on token 0, the target picking the other expert), with a linear's
    backward before the SiLU's: after the flip the SiLU's backward reads that linear's input gradient alone in the
    target (the other branch's gradient gone with the re-routed token) and that plus a second gradient in the
    reference (no recorded op made it; a tenth of it, far beyond its tolerance within the reference).  The routing
    changed which tensors flow: the flip's, no rewiring (dev 1's `dx_router`, both modes)."""
    from test_flipflow import _moe

    def with_branch(flipped: bool) -> dict:
        recs = _moe(mode, flipped)
        grad = recs["Functional.silu.0.backward"]["input"][0]
        other = _f32(np.random.default_rng(12).normal(size=grad.shape) * 0.1 * np.sqrt((grad**2).mean()))
        part = _f32(grad - other)
        read = part if flipped else grad
        out: dict = {k: v for k, v in recs.items() if k != "Functional.silu.0.backward"}
        out["Functional.linear.0.backward"] = {"input": [_f32(part * 2)], "output": [part]}
        out["Functional.silu.0.backward"] = {"input": [read], "output": [_f32(read * 0.5)]}
        return out

    v = _pair(dump_writer, store_dir, mode, [with_branch(False)], [with_branch(True)])
    assert v.culprit is None

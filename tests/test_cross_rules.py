"""Rules made on the clean combinations (validation/cross, docs/how-it-decides.md): whole-number inputs after a
near-tie flip, a slice of a recorded output judged by its absolute error, a kinked op's backward, and what a
statistics bound can hide, on small hand-made pairs and record tables (exact values)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from test_flipflow import MODES, _f32, _moe, _pair

from dumpstore.analysis.flipflow import integer_valued
from dumpstore.analysis.noise import KINK, record_measures, statistics_hidden
from helpers import leaf


def _with_indicator(recs: dict, indicator: np.ndarray) -> dict:
    """The records with `Tensor.mean.0.forward` of a float indicator after the top-k and the expert counts (the
    batch's share of tokens routed to expert 2: `(idx == 2).float().mean()`, the cast not recorded: no producer)."""
    out = {}
    for k, v in recs.items():
        out[k] = v
        if k == "Tensor.sum.0.forward":
            out["Tensor.mean.0.forward"] = {"input_args": [indicator], "output": [_f32(indicator.mean())]}
    return out


def _indicator(flipped: bool) -> np.ndarray:
    ind = np.zeros(16, dtype=np.float32)
    ind[0] = 1.0 if flipped else 0.0  # token 0 goes to expert 2 in the flipped run only
    return ind


@pytest.mark.parametrize("mode", MODES)
def test_a_whole_number_input_after_a_near_tie_flip_is_explained(dump_writer, store_dir, mode):
    """The share of tokens routed to an expert, a float made from the flipped choice: 0 in the reference, 1/16
    in the target (an infinite relative error); whole numbers in both runs: the flip's, noise."""
    ref = _with_indicator(_moe(mode, False), _indicator(False))
    tgt = _with_indicator(_moe(mode, True), _indicator(True))
    v = _pair(dump_writer, store_dir, mode, [ref], [tgt])
    assert v.culprit is None and v.noise["discrete_flips"]


def test_a_whole_number_input_without_a_flip_is_a_culprit(dump_writer, store_dir):
    """The same differing indicator with no flip before it: an input no op produced, named."""
    ref = _with_indicator(_moe("statistics", False), _indicator(False))
    tgt = _with_indicator(_moe("statistics", False), _indicator(True))
    v = _pair(dump_writer, store_dir, "statistics", [ref], [tgt])
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mean.0.forward", "input")


def test_integer_valued_reads_max_min_sum_and_sum_of_squares():
    base = {"numel": 4, "ref_min": 0.0, "ref_max": 1.0, "ref_mean": 0.5, "ref_norm": math.sqrt(2.0)}
    assert integer_valued({**base, "min": 0.0, "max": 1.0, "mean": 0.25, "norm": 1.0})
    assert integer_valued({**base, "min": 0.0, "max": 3.0, "mean": 1.0, "norm": 3.0})  # [0, 0, 1, 3]
    assert not integer_valued({**base, "min": 0.0, "max": 1.0, "mean": 0.3, "norm": 1.0})  # sum 1.2
    assert not integer_valued({**base, "min": 0.0, "max": 1.0, "mean": 0.25, "norm": 1.1})  # sum of squares 1.21
    assert not integer_valued({**base, "min": 0.5, "max": 1.0, "mean": 0.75, "norm": 1.5})
    assert not integer_valued({**base, "min": 0.0, "max": 1.0, "mean": None, "norm": 1.0})  # integer: max/min only
    assert not integer_valued({**base, "numel": 10**6, "min": 0.0, "max": 1.0, "mean": 0.5, "norm": 707.1})


def _fused_steps(w_ref: np.ndarray, w_tgt: np.ndarray, extra: float) -> tuple[list[dict], list[dict]]:
    """Two steps of a fused q/k/v linear and a matmul on its key third (cut by split and a transpose msprobe does
    not record: no producer); at step 1 the target's weights differ (the optimizer's noise) and its key is
    `extra` x larger on top."""
    rng = np.random.default_rng(5)
    x = _f32(rng.normal(size=(16, 24)))
    runs: tuple[list[dict], list[dict]] = ([], [])
    for run, w1 in zip(runs, (w_ref, w_tgt)):
        for s, w in enumerate((w_ref, w1)):
            y = _f32(x @ w.T)
            q, k = y[:, :24], _f32(y[:, 24:48] * (extra if (s == 1 and w1 is w_tgt) else 1.0))
            run.append(
                {
                    "Functional.linear.0.forward": {"input_args": [x, leaf(w, requires_grad=True)], "output": [y]},
                    "Torch.matmul.0.forward": {"input_args": [q, _f32(k.T)], "output": [_f32(q @ k.T)]},
                }
            )
    return runs


def _fused_weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(6)
    w = _f32(rng.normal(size=(72, 24)) / 5)
    w_t = w.copy()
    w_t[:24] *= 1 + 0.004 * rng.normal(size=(24, 24))  # q rows: 0.4 % noise
    w_t[24:48] *= 1 + 0.01 * rng.normal(size=(24, 24))  # k rows: 1 % noise, the rest of the output as is
    return w, _f32(w_t)


def test_a_slice_of_a_recorded_output_carries_its_absolute_error(dump_writer, store_dir):
    """Step 1: the key third of the fused output carries all its error, a larger relative error (of a smaller
    tensor) than the whole output's: within the whole's absolute error, no culprit (tensor mode)."""
    w, w_t = _fused_weights()
    ref, tgt = _fused_steps(w, w_t, 1.0)
    v = _pair(dump_writer, store_dir, "tensor", ref, tgt)
    assert v.culprit is None


def test_a_slice_beyond_its_sources_absolute_error_is_an_input(dump_writer, store_dir):
    """The same key 5 % off on top: beyond any recorded output's absolute error, `input` at the matmul."""
    w, w_t = _fused_weights()
    ref, tgt = _fused_steps(w, w_t, 1.05)
    v = _pair(dump_writer, store_dir, "tensor", ref, tgt)
    assert v.culprit is not None and (v.culprit.step, v.culprit.op, v.culprit.kind) == (
        1,
        "Torch.matmul.0.forward",
        "input",
    )


def _records(op_class: str, direction: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "op_class": [op_class],
            "_direction": [direction],
            "in_err": [1e-3],
            "out_err": [0.03],
            "in_norm": [1.0],
            "out_norm": [1.0],
            "tol": [2.0**-13],
            "tol_dtype": ["float32"],
        }
    )


@pytest.mark.parametrize(
    ("op_class", "direction", "amp"),
    [
        ("Functional.relu", "backward", 0.03 / math.sqrt(KINK * 1e-3)),
        ("Tensor.relu_", "backward", 0.03 / math.sqrt(KINK * 1e-3)),
        ("Torch.clamp", "backward", 0.03 / math.sqrt(KINK * 1e-3)),
        ("Functional.relu", "forward", 30.0),  # continuous: its forward passes the error on as it is
        ("Functional.gelu", "backward", 30.0),  # smooth
    ],
)
def test_a_kinked_backward_carries_the_square_root_of_its_input_error(op_class, direction, amp):
    got = record_measures(_records(op_class, direction)).row(0, named=True)
    assert got["amp"] == pytest.approx(amp, rel=1e-12)
    assert got["fresh"] is False


def test_statistics_hidden_is_the_square_root_of_twice_the_bound_times_the_conditioning():
    rec = {"in_bound": True, "in_err": 4.5e-4, "in_norm": 2.0, "out_norm": 1.0}
    assert statistics_hidden(rec) == pytest.approx(math.sqrt(9e-4) * 2.0, rel=1e-12)
    assert statistics_hidden({**rec, "in_norm": 0.5}) == pytest.approx(0.03, rel=1e-12)
    assert statistics_hidden({**rec, "in_bound": False}) is None  # tensor mode: the input error is exact
    assert statistics_hidden({**rec, "in_err": 0.0}) is None


def test_a_backward_from_its_forwards_result_reads_that_results_error():
    """rsqrt's backward is -grad x result^3 / 2: its input error is at least its forward's output error; a
    linear's backward reads the forward's inputs only."""
    from dumpstore.analysis._divergence import _with_saved_inputs

    recs = pl.DataFrame(
        {
            "step": [1] * 4,
            "rank": [0] * 4,
            "source": [""] * 4,
            "_record": [
                "Torch.rsqrt.2.forward",
                "Functional.linear.0.forward",
                "Functional.linear.0.backward",
                "Torch.rsqrt.2.backward",
            ],
            "op_class": ["Torch.rsqrt", "Functional.linear", "Functional.linear", "Torch.rsqrt"],
            "in_err": [5e-7, 1e-4, 2e-7, 2e-7],
            "out_err": [0.0015, 0.003, 0.002, 0.042],
        }
    )
    got = dict(zip(*_with_saved_inputs(recs).select("_record", "in_err").to_dict(as_series=False).values()))
    assert got == {
        "Torch.rsqrt.2.forward": 5e-7,
        "Functional.linear.0.forward": 1e-4,
        "Functional.linear.0.backward": 1e-4,
        "Torch.rsqrt.2.backward": 0.0015,
    }
    saved = dict(zip(*_with_saved_inputs(recs).select("_record", "saved_err").to_dict(as_series=False).values()))
    assert saved == {  # what each backward read from its forward alone (its gradient input aside)
        "Torch.rsqrt.2.forward": None,
        "Functional.linear.0.forward": None,
        "Functional.linear.0.backward": 1e-4,
        "Torch.rsqrt.2.backward": 0.0015,
    }


# the clean combination resnet_fp16_D (tensor mode, step 1): a basic block's backward (ResNetBasicLayer), its
# gradient input off 4.9e-4, its output 0.0547; inside it, the block's last ReLU read its forward input, off
# 1.15e-3, and passed on sqrt(2 x 1.15e-3) = 0.048 (its mask flips); its stage encloses it
_BLOCK = "Module.stages.1.layers.0.ResNetBasicLayer.backward.0"
_STAGE = "Module.stages.1.ResNetStage.backward.0"


def _block(inner_op: str) -> pl.DataFrame:
    records = [
        ("Functional.%s.4.backward" % inner_op, "Module.stages.1.layers.0.activation.ReLU.backward.0", 1.15e-3),
        ("Module.stages.1.layers.0.activation.ReLU.backward.0", _BLOCK, None),
        ("Functional.conv2d.3.backward", "Module.stages.1.layers.0.layer.0.Conv2d.backward.0", 5e-4),
        ("Module.stages.1.layers.0.layer.0.Conv2d.backward.0", _BLOCK, None),
        (_BLOCK, _STAGE, None),
        (_STAGE, None, None),
        ("Functional.relu.2.backward", "Module.stages.0.layers.0.activation.ReLU.backward.0", 2e-3),
    ]
    n = len(records)
    return pl.DataFrame(
        {
            "step": [1] * n,
            "rank": [0] * n,
            "source": [""] * n,
            "_record": [r for r, _, _ in records],
            "_module": [m for _, m, _ in records],
            "saved_err": [e for *_, e in records],
            "op_class": ["Functional." + inner_op, "Module.ReLU", "Functional.conv2d", "Module.Conv2d"]
            + ["Module.ResNetBasicLayer", "Module.ResNetStage", "Functional.relu"],
            "_direction": ["backward"] * n,
            "in_err": [1.15e-3, 4.9e-4, 0.0635, 0.0635, 4.9e-4, 4.9e-4, 0.0547],
            "out_err": [0.0511, 0.0511, 0.0781, 0.0665, 0.0547, 0.0547, 0.0562],
            "in_norm": [1.0] * n,
            "out_norm": [1.0] * n,
            "tol": [2.0**-10] * n,
            "tol_dtype": ["float16"] * n,
        },
        schema_overrides={"_module": pl.String, "saved_err": pl.Float64},
    )


def test_a_modules_backward_carries_what_the_records_inside_it_saved():
    """The block and its stage read the ReLU's saved input through the ReLU's backward: they carry
    sqrt(2 x 1.15e-3), not their gradient input's 4.9e-4 (which made them 'amplify' 112x); a record outside the
    block (stage 0's ReLU) passes nothing to it, and the conv's saved 5e-4 is less."""
    got = {r["_record"]: r for r in record_measures(_block("relu")).iter_rows(named=True)}
    carried = math.sqrt(KINK * 1.15e-3)
    for module in (_BLOCK, _STAGE):
        assert got[module]["amp"] == pytest.approx(0.0547 / carried, rel=1e-12)
        assert got[module]["local"] == pytest.approx(0.0547 - carried, rel=1e-12)
        assert got[module]["fresh"] is False
    assert got["Module.stages.1.layers.0.activation.ReLU.backward.0"]["amp"] == pytest.approx(0.0511 / carried)
    assert got["Module.stages.1.layers.0.layer.0.Conv2d.backward.0"]["amp"] == pytest.approx(0.0665 / 0.0635)
    # the API records' own measures are as before: their inputs' errors, the ReLU's kinked
    assert got["Functional.relu.4.backward"]["amp"] == pytest.approx(0.0511 / carried, rel=1e-12)
    assert got["Functional.relu.2.backward"]["amp"] == pytest.approx(0.0562 / math.sqrt(KINK * 0.0547))
    assert "_inner" not in got[_BLOCK] and "_saved" not in got[_BLOCK]


def test_a_module_whose_inner_records_are_smooth_carries_their_saved_errors_as_they_are():
    """A smooth op inside (GELU) passes its saved 1.15e-3 on as it is: the block still 'amplifies' 0.0547 /
    1.15e-3, as a fault inside a module whose records each stay in the noise does."""
    got = {r["_record"]: r for r in record_measures(_block("gelu")).iter_rows(named=True)}
    assert got[_BLOCK]["amp"] == pytest.approx(0.0547 / 1.15e-3, rel=1e-12)
    assert got[_STAGE]["amp"] == pytest.approx(0.0547 / 1.15e-3, rel=1e-12)


# the clean combination opt_D (tensor mode, draw 6, step 1): a decoder layer's forward, its input off 4.68e-6, its
# output 0.003745 (3.8 float16 tolerances, over the fresh ops' p99 before it x 3 = 0.00303); inside it, the key
# projection's weight, listed by its Linear module only, off 0.0067 by the first update's noise
_LAYER = "Module.model.decoder.layers.0.OPTDecoderLayer.forward.0"
_ATTN = "Module.model.decoder.layers.0.self_attn.OPTAttention.forward.0"
_KPROJ = "Module.model.decoder.layers.0.self_attn.k_proj.Linear.forward.0"


def _layer(weight_err: float | None) -> pl.DataFrame:
    records = [  # record, its module, input error, output error, the error of the parameters it lists
        ("Functional.linear.1.forward", _KPROJ, max(4.31e-6, weight_err or 0.0), 0.00916, None),
        (_KPROJ, _ATTN, max(4.31e-6, weight_err or 0.0), 0.00916, weight_err),
        (_ATTN, _LAYER, 4.31e-6, 0.0031, None),
        (_LAYER, None, 4.68e-6, 0.003745, None),
    ]
    n = len(records)
    return pl.DataFrame(
        {
            "step": [1] * n,
            "rank": [0] * n,
            "source": [""] * n,
            "_record": [r[0] for r in records],
            "_module": [r[1] for r in records],
            "saved_err": [None] * n,
            "param_err": [r[4] for r in records],
            "op_class": ["Functional.linear", "Module.Linear", "Module.OPTAttention", "Module.OPTDecoderLayer"],
            "_direction": ["forward"] * n,
            "in_err": [r[2] for r in records],
            "out_err": [r[3] for r in records],
            "in_norm": [1.0] * n,
            "out_norm": [1.0] * n,
            "tol": [2.0**-10] * n,
            "tol_dtype": ["float16"] * n,
        },
        schema_overrides={"_module": pl.String, "saved_err": pl.Float64, "param_err": pl.Float64},
    )


def test_a_modules_forward_carries_the_parameters_of_the_modules_inside_it():
    """The decoder layer and its attention read the key projection's weight, off 0.0067, through the Linear
    module inside them, which lists it: they carry it (not fresh, amplification 0.003745 / 0.0067), where their
    own records (activations only) made them fresh ops creating 0.003745 out of inputs off 4.68e-6."""
    got = {r["_record"]: r for r in record_measures(_layer(0.0067)).iter_rows(named=True)}
    for module, out in ((_LAYER, 0.003745), (_ATTN, 0.0031)):
        assert got[module]["fresh"] is False
        assert got[module]["amp"] == pytest.approx(out / 0.0067, rel=1e-12)
        assert got[module]["local"] == 0.0
    assert got[_KPROJ]["amp"] == pytest.approx(0.00916 / 0.0067, rel=1e-12)  # its own listed weight, as before
    # at step 0 (the weights equal) the layer is a fresh op, as before
    same = {r["_record"]: r for r in record_measures(_layer(None)).iter_rows(named=True)}
    assert same[_LAYER]["fresh"] is True and same[_LAYER]["local"] == 0.003745


def _losses_noisy_backward(labels_at: int | None, fault: float, target: bool) -> list[dict]:
    """test_stats_blind's loss steps with the logit-layer backward's gradient 1e-4 off in the target (carried,
    not fresh: over a tenth of the float32 tolerance) and its output off by that and `fault` at step 1."""
    from test_stats_blind import _loss_step

    steps = []
    for s in range(2):
        recs = _loss_step(s, s == labels_at, 0.0, target)
        if target:
            ref = _loss_step(s, False, 0.0, False)["Functional.linear.0.backward"]
            f = (1 + 1e-4) * (1 + (fault if s == 1 else 0.0))
            recs["Functional.linear.0.backward"] = {
                "input": [_f32(ref["input"][0] * (1 + 1e-4))],
                "output": [_f32(ref["output"][0] * f)],
            }
        steps.append(recs)
    return steps


def test_an_amplification_within_what_statistics_hide_is_no_finding_alone(dump_writer, store_dir):
    """Step 1's logit-layer backward off 5e-3 on a gradient whose statistics differ by 1e-4: 50x "amplified",
    but within sqrt(2 x 1e-4) = 0.014, what those statistics can hide: quiet."""
    ref, tgt = _losses_noisy_backward(None, 0.0, False), _losses_noisy_backward(None, 5e-3, True)
    assert _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit is None


def test_an_amplification_within_what_statistics_hide_orders_a_data_suspect(dump_writer, store_dir):
    """The same with the labels of step 1 changed (max/min equal, the loss 20x its usual ratio): the suspect
    labels are named at the loss, ahead of the backward."""
    ref, tgt = _losses_noisy_backward(None, 0.0, False), _losses_noisy_backward(1, 5e-3, True)
    c = _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["ahead_of"] == "Functional.linear.0.backward"


def test_an_amplification_beyond_what_statistics_hide_is_named(dump_writer, store_dir):
    """The backward off 5 % instead: beyond 0.014, `op` at the backward."""
    ref, tgt = _losses_noisy_backward(None, 0.0, False), _losses_noisy_backward(None, 0.05, True)
    c = _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.linear.0.backward", "op")


def test_a_bound_between_sketch_estimates_allows_their_error_bars():
    """draw 5 of the clean combinations, gpt2_Q (tensor): GPT-2's key, cut from the fused c_attn output, 0.003013
    off by its sketch against that output's absolute error over the key's norm, 0.00171 x 9.67 / 5.60 = 0.00296;
    both are sketch estimates of 4,608 and 1,536 elements, each within sqrt(2/512) = 0.0625 of the true error."""
    from dumpstore.analysis.rules import within_estimates

    bound = 0.00171 * 9.67 / 5.60
    assert within_estimates(0.003013, bound, 0.0625)
    assert not within_estimates(0.003013, bound, 0.0)  # exact errors: the slice is beyond its source
    assert not within_estimates(0.003013, bound, None)  # statistics bounds have no error bar
    assert within_estimates(bound * 1.0625 / 0.9375, bound, 0.0625)
    assert not within_estimates(bound * 1.0625 / 0.9375 * (1 + 1e-9), bound, 0.0625)

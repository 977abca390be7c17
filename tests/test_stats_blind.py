"""What msprobe's statistics cannot show, in the per-op judge (issue 23, analysis/culprit.py): an op whose inputs
agree by their statistics only, inputs after a near-tie flip, and integer data (labels) whose max/min agree, on
small hand-made dump pairs in both dump modes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.hidden_index import data_suspects
from helpers import leaf

T, D, V = 16, 8, 32  # tokens, hidden size, vocabulary


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _pair(dump_writer, store_dir, mode: str, ref: list[dict], target: list[dict]):
    for name, steps in (("ref", ref), ("target", target)):
        w = dump_writer(name, mode)
        for i, recs in enumerate(steps):
            w.write(recs, step=i)
        ingest(w.root, name, store=store_dir, jobs=1)
    return divergence(compare_runs(open_store(store_dir), "target", "ref"))


def _chain(target: bool, fault: float) -> dict:
    """Four fresh float32 ops off by 2e-5 (under the 1.2e-4 tolerance), four ops carrying that error up to 1e-4,
    then an op on agreeing inputs off by `fault` in the target."""
    rng = np.random.default_rng(5)
    x = _f32(rng.normal(size=(T, D)))
    recs: dict = {}
    for i in range(4):
        g = _f32(x * (i + 1) * (1 + 2e-5 if target else 1.0))
        recs[f"Functional.gelu.{i}.forward"] = {"input_args": [x], "output": [g]}
        recs[f"Functional.relu.{i}.forward"] = {"input_args": [g], "output": [_f32(g * (1 + 8e-5 if target else 1.0))]}
    y = _f32(rng.normal(size=(T, D)))
    recs["Tensor.mul.0.forward"] = {
        "input_args": [y, {"type": "float", "value": 0.5}],
        "output": [_f32(y * 0.5 * (1 + fault if target else 1.0))],
    }
    return recs


def test_a_fresh_op_is_named_where_the_tensors_show_its_inputs_agree(dump_writer, store_dir):
    """Tensor mode: the inputs agree, the output is 2e-4 off (over the tolerance and 3x over the fresh ops'
    2e-5): named."""
    v = _pair(dump_writer, store_dir, "tensor", [_chain(False, 0.0)], [_chain(True, 2e-4)])
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mul.0.forward", "op")


def test_a_fresh_op_on_statistics_is_judged_against_what_the_pair_carries(dump_writer, store_dir):
    """Statistics mode, the same pair: that the inputs agree rests on their statistics, which can hide what the
    pair carries (a softmax's rows sum to one); 2e-4 is within the 3 x 1e-4 the records before it carry: quiet.
    Beyond it (1e-3) the op is named."""
    v = _pair(dump_writer, store_dir, "statistics", [_chain(False, 0.0)], [_chain(True, 2e-4)])
    assert v.culprit is None
    v = _pair(dump_writer, store_dir / "beyond", "statistics", [_chain(False, 0.0)], [_chain(True, 1e-3)])
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mul.0.forward", "op")


def _routed(mode: str, flipped: bool, after: float) -> dict:
    """A top-2 router with token 0 tied between experts 1 and 2 (the target picks the other one when
    `flipped`), the combine of the expert outputs (row 0 differs after a flip), then an op whose input differs
    by 5e-6 in the target (what a statistics bound of the re-routed stream may show) and whose output by
    `after`."""
    rng = np.random.default_rng(3)
    scores = _f32(np.abs(rng.normal(size=(T, 4))))
    scores[0] = [5.0, 1.0, 1.0, 0.1]
    idx = np.argsort(-scores, axis=1, kind="stable")[:, :2]
    if flipped:
        idx[0, 1] = 2
    ints = idx.astype(np.int64)
    x = _f32(rng.normal(size=(T, D)))
    recs: dict = {  # noisy ops before the router: the pair carries some error there
        f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [_f32(x * (1 + 1e-6 * (i + 1) * flipped))]}
        for i in range(4)
    }
    recs |= {
        "Torch.topk.0.forward": {
            "input_args": [scores, {"type": "int", "value": 2}],
            "output": [
                _f32(np.take_along_axis(scores, idx, 1)),
                ints if mode == "tensor" else leaf(ints, stats=("Max", "Min")),
            ],
        }
    }
    mask = np.zeros((4, 2, T), dtype=np.int64)  # one_hot(idx).permute(2, 1, 0), made by ops msprobe does not record
    for t in range(T):
        for k in range(2):
            mask[idx[t, k], k, t] = 1
    counts = mask.sum(axis=(1, 2))
    recs["Tensor.sum.0.forward"] = {
        "input_args": [mask if mode == "tensor" else leaf(mask, stats=("Max", "Min")), {"type": "int", "value": -1}],
        "output": [counts if mode == "tensor" else leaf(counts, stats=("Max", "Min"))],
    }
    experts = _f32(rng.normal(size=(4, T, D)))
    combined = _f32(sum(experts[idx[:, k], np.arange(T)] for k in range(2)))
    recs["Functional.silu.0.forward"] = {"input_args": [combined], "output": [_f32(combined / (1 + np.exp(-combined)))]}
    h = _f32(rng.normal(size=(T, D)))
    w = _f32(rng.normal(size=(4, D)))
    off = flipped and after > 0
    recs["Functional.linear.0.forward"] = {
        "input_args": [_f32(h * (1 + 5e-6)) if off else h, w],
        "output": [_f32(h @ w.T * (1 + after)) if off else _f32(h @ w.T)],
    }
    return recs


def test_an_op_after_a_flip_on_inputs_agreeing_by_statistics_is_fed_by_it(dump_writer, store_dir):
    """Statistics mode: the router of the next layer after a near-tie flip, its input off by a bound of 5e-6
    and its output by 2e-3 (within 3x what the flip's combine showed): the flip's re-routed row can hide in
    its input's statistics: explained, quiet.  In tensor mode the input is known to agree: named."""
    ref, tgt = [_routed("statistics", False, 0.0)], [_routed("statistics", True, 2e-3)]
    v = _pair(dump_writer, store_dir, "statistics", ref, tgt)
    assert v.culprit is None and v.noise["discrete_flips"]
    ref, tgt = [_routed("tensor", False, 0.0)], [_routed("tensor", True, 2e-3)]
    v = _pair(dump_writer, store_dir / "tensor", "tensor", ref, tgt)
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Functional.linear.0.forward", "op")


def _loss_step(
    step: int,
    labels_changed: bool,
    backward_fault: float,
    target: bool,
    noisy: bool = True,
    visible: bool = False,
    logit_err: float = 1e-6,
    recorded: bool = True,
) -> dict:
    """Logits off by 1e-6 in the target, the cross-entropy of them with integer labels (statistics: max/min
    only), and the backward of the logit layer (its output off by `backward_fault` in the target).  With
    `labels_changed`, the target's label of token 0 moves to a class whose logit is 1e-3 lower: the loss moves
    ~2e-5, under the float32 tolerance, and the labels' max/min stay."""
    rng = np.random.default_rng(100 + step)
    x = _f32(rng.normal(size=(T, D)))
    w = _f32(rng.normal(size=(V, D)) * 0.3)
    z = _f32(x @ w.T)
    labels = rng.integers(1, V - 1, size=T).astype(np.int64)
    labels[0], labels[1] = 0, V - 1  # the batch's range, unchanged
    a = int(labels[2])
    b = (a + 1) % V
    z[2, b] = z[2, a] - 1e-3
    z[1, V - 2] = z[1, V - 1] - 1e-3
    ref_labels = labels.copy()
    zt = _f32(z * (1 + logit_err)) if target and noisy else z
    if target and labels_changed:
        labels[2] = b
        if visible:  # token 1's label moves off the batch's maximum: the labels' max changes
            labels[1] = V - 2

    def ce(zz: np.ndarray) -> float:
        zz = zz.astype(np.float64)
        lse = np.log(np.exp(zz - zz.max(1, keepdims=True)).sum(1)) + zz.max(1)
        return float((lse - zz[np.arange(T), labels]).mean())

    # the gradient the logit layer is given: the cross-entropy's of the reference's logits and labels (softmax
    # less one-hot, over T), what a real backward hands it (analysis/hidden_index.py producer_gradients reads it)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(T), ref_labels] -= 1.0
    grad = _f32(p / T)
    gx = _f32(grad @ w)
    return {
        "Functional.linear.0.forward": {"input_args": [x, w], "output": [zt]},
        "Functional.cross_entropy.0.forward": {
            "input_args": [zt, leaf(labels, stats=("Max", "Min"))] if recorded else [zt],
            "output": [_f32(np.array(ce(zt)))],
        },
        "Functional.linear.0.backward": {
            "input": [_f32(grad * (1 + 1e-6)) if target else grad],
            "output": [_f32(gx * (1 + backward_fault)) if target else gx],
        },
    }


def _losses(labels_at: int | None, backward_fault: float, target: bool) -> list[dict]:
    return [_loss_step(s, s == labels_at, backward_fault if s == 1 else 0.0, target) for s in range(2)]


def test_labels_hidden_by_statistics_are_named_at_the_loss_before_the_backward(dump_writer, store_dir):
    """Statistics mode: at step 1 the loss moved 20x its logits' error where it moved 0.3x at step 0, the labels'
    max/min agree, and the backward of the step stands out: the labels (data) are named at the loss."""
    v = _pair(dump_writer, store_dir, "statistics", _losses(None, 0.0, False), _losses(1, 0.05, True))
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["differing"] == "Functional.cross_entropy.0.forward.input.1"
    assert c.evidence["ahead_of"] == "Functional.linear.0.backward"


def test_a_backward_fault_with_the_labels_unchanged_is_named_at_itself(dump_writer, store_dir):
    """The same backward fault with the labels unchanged: the loss moved as at step 0, no precedence."""
    v = _pair(dump_writer, store_dir, "statistics", _losses(None, 0.0, False), _losses(None, 0.05, True))
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.linear.0.backward", "op")


def test_changed_labels_alone_never_name_a_culprit(dump_writer, store_dir):
    """The precedence names data only ahead of another finding of its step: the loss under its tolerance and
    nothing else standing out stays quiet (statistics cannot tell that loss from noise on their own)."""
    v = _pair(dump_writer, store_dir, "statistics", _losses(None, 0.0, False), _losses(1, 0.0, True))
    assert v.culprit is None


@pytest.mark.parametrize("mode", ["statistics"])
def test_labels_precedence_needs_an_earlier_step(dump_writer, store_dir, mode):
    """At the first step there is no earlier ratio of the loss to its logits' error to stand out of: the
    backward finding is named."""
    v = _pair(dump_writer, store_dir, mode, [_loss_step(0, False, 0.0, False)], [_loss_step(0, True, 0.05, True)])
    c = v.culprit
    assert c is not None and (c.step, c.op) == (0, "Functional.linear.0.backward")


def test_labels_precedence_without_a_ratio_before_rests_on_the_gradient(dump_writer, store_dir):
    """Logits and loss equal in both runs at step 0: no ratio was measured there (0 over the eps floor).  At step
    1 the loss moved 12.9x what its logits' measured error moves it through the gradient the logit layer was
    given (its backward's input: the cross-entropy's gradient, the loss has no backward record): the labels are
    named ahead of the backward."""
    ref = [_loss_step(s, False, 0.0, False) for s in range(2)]
    tgt = [_loss_step(0, False, 0.0, True, noisy=False), _loss_step(1, True, 0.05, True)]
    c = _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["earlier_steps_max"] == 0.0
    assert c.evidence["gradient_units"] == pytest.approx(12.89, rel=1e-3)


def test_labels_precedence_without_a_ratio_before_needs_the_gradient_to_stand(dump_writer, store_dir):
    """The same pair with the target's logits off by 1e-3 at step 1: the loss's move is 0.0129 of what that
    error moves it through the gradient: no suspect, the backward finding is named."""
    ref = [_loss_step(s, False, 0.0, False) for s in range(2)]
    tgt = [_loss_step(0, False, 0.0, True, noisy=False), _loss_step(1, True, 0.05, True, logit_err=1e-3)]
    c = _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op) == (1, "Functional.linear.0.backward")


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_changed_labels_the_dump_shows_are_named_at_the_loss_within_its_tolerance(dump_writer, store_dir, mode):
    """Labels that differ where the dump shows it (the batch's maximum moved: 31 vs 30) are integer data no op
    produced; the loss reading them moved 4e-5, within its float32 tolerance, while its logits agree: named at
    the loss (`input`), with no other finding needed."""
    ref = [_loss_step(s, False, 0.0, False) for s in range(2)]
    tgt = [_loss_step(0, False, 0.0, True), _loss_step(1, True, 0.0, True, visible=True)]
    c = _pair(dump_writer, store_dir, mode, ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["differing"] == "Functional.cross_entropy.0.forward.input.1"
    assert c.value is not None and c.value < c.threshold  # the loss within its tolerance
    if mode == "statistics":
        assert "differs (max 30 vs 31) while this op's float inputs agree" in c.detail


def test_changed_labels_are_named_whatever_the_noise_of_the_loss_float_inputs(dump_writer, store_dir):
    """The same labels with logits off by 5e-5 (over a tenth of the float32 tolerance): labels are data no recorded
    op produced, so no float difference upstream made them; they agreed at step 0: named at the loss."""
    ref = [_loss_step(s, False, 0.0, False) for s in range(2)]
    tgt = [_loss_step(0, False, 0.0, True), _loss_step(1, True, 0.0, True, visible=True, logit_err=5e-5)]
    c = _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.cross_entropy.0.forward", "input")
    assert "differs (max 30 vs 31) while this op's float inputs differ by their noise (4.99e-05)" in c.detail


def test_labels_changed_at_every_step_are_named_where_the_change_starts(dump_writer, store_dir):
    """Labels that differ at step 0 and again at step 1, the loss within its tolerance on noisy logits: named at
    step 0, the first step they differ (at step 1 they differed before: no data change starts there)."""
    ref = [_loss_step(s, False, 0.0, False) for s in range(2)]
    tgt = [_loss_step(s, True, 0.0, True, visible=True, logit_err=5e-5) for s in range(2)]
    c = _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (0, "Functional.cross_entropy.0.forward", "input")


def test_statistics_of_bfloat16_inputs_agree_only_to_their_rounding():
    """msprobe rounds a bfloat16 tensor's statistics to bfloat16: equal statistics of bf16 logits leave up to
    eps(bf16) unseen, and a loss moving 2e-5 over them (step 0) is no ratio of 164 (2e-5 over eps(float32))
    that a label change moving it 8.3e-3 (step 1) would have to beat: over eps(bf16) the ratios are 0.0025 and
    1.07, and step 1's loss is the suspect."""
    recs = pl.DataFrame(
        {
            "step": [0, 1],
            "rank": [0, 0],
            "source": [None, None],
            "_record": ["Functional.cross_entropy.0.forward"] * 2,
            "op_class": ["Functional.cross_entropy"] * 2,
            "idx_hidden": [True, True],
            "_direction": ["forward"] * 2,
            "_phase": [0, 0],
            "_seq": [10, 10],
            "out_dtype": ["float32"] * 2,
            "out_err": [1.96e-5, 8.34e-3],
            "in_float_err": [0.0, 1.09e-4],
            "in_float_eps": [2.0**-7, 2.0**-7],
        },
        schema_overrides={"source": pl.String},
    )
    hits = data_suspects(recs)
    assert list(hits) == [(1, 0)]
    assert hits[(1, 0)][1]["_h"] == pytest.approx(8.34e-3 / 2.0**-7)
    assert data_suspects(recs.with_columns(pl.lit(None, pl.Float64).alias("in_float_eps"))) == {}


def test_a_loss_whose_labels_the_dump_does_not_list_is_named_before_the_backward(dump_writer, store_dir):
    """The labels reach the loss through ops msprobe does not record: its record lists the logits only.  Its
    output moved 20x its logits' error at step 1 where it moved 0.3x at step 0 (a loss: its target is data),
    and the backward of the step stands out: named at the loss, ahead of it."""
    ref = [_loss_step(s, False, 0.0, False, recorded=False) for s in range(2)]
    tgt = [_loss_step(0, False, 0.0, True, recorded=False), _loss_step(1, True, 0.05, True, recorded=False)]
    c = _pair(dump_writer, store_dir, "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["ahead_of"] == "Functional.linear.0.backward" and "differing" not in c.evidence
    assert c.detail.startswith("a loss whose target (data) the dump does not list")
    tgt = [_loss_step(0, False, 0.0, True, recorded=False), _loss_step(1, False, 0.05, True, recorded=False)]
    c = _pair(dump_writer, store_dir / "unchanged", "statistics", ref, tgt).culprit
    assert c is not None and (c.step, c.op) == (1, "Functional.linear.0.backward")  # the labels unchanged

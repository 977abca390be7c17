"""Labels changed after step 0 where the statistics hide them (analysis/hidden_index.py `data_suspects`): bf16
logits of an fp32 cross-entropy (bf16 autocast) whose statistics agree exactly at every step, labels with
ignore_index (-100) entries kept by max/min only, a loss equal in both runs before the changed step, and the
cross-entropy's backward filed by msprobe with tensors of shape [] (its gradient shows up under the logit layer's
backward record), as in set 6's deberta_labels_step2."""

from __future__ import annotations

import numpy as np
import pytest
from test_data_faults import _bf16, _ids_v8, _leaf16, _verdict

from helpers import leaf

N, C, H = 32, 96, 16  # label positions, classes, hidden size


def _step(
    step: int,
    target: bool,
    labels_at: int | None,
    rounded: bool = False,
    backward: float = 0.0,
    scale: float = 0.3,
    v8: bool = False,
) -> dict:
    """One step: a logit layer (bf16 output), the cross-entropy of its logits with labels (-100 at unmasked
    positions; at step `labels_at` the target's two first masked labels +1, under the batch's largest), its
    backward filed with scalars, and the logit layer's backward given the cross-entropy's gradient (its output
    off by `backward` in the target).  `rounded`: the target's logits differ by one bf16 rounding in three
    elements, their statistics equal (the precondition is asserted).  `scale`: the logit layer's weights' (the
    logits' size, and so how far a changed label moves the loss).  `v8`: the labels as msprobe 8.x keeps them
    (a float32 mean and norm too)."""
    rng = np.random.default_rng(400 + step)
    x = _bf16(rng.normal(size=(N, H)).astype(np.float32))
    w = (rng.normal(size=(C, H)) * scale).astype(np.float32)
    z = _bf16(x @ w.T)
    labels = np.full(N, -100, dtype=np.int64)
    masked = np.arange(0, N, 3)
    labels[masked] = rng.integers(0, C, size=masked.size)
    if target and step == labels_at:
        top = labels.max()
        for i in [i for i in masked if labels[i] < top][:2]:
            labels[i] += 1
    if target and rounded:
        zr = z.copy()
        for (i, j), way in (((3, 5), 1), ((10, 40), -1), ((20, 70), 1)):
            zr[i, j] = _bf16(zr[i, j] + way * 2.0 ** (np.floor(np.log2(abs(zr[i, j]))) - 7))
        assert _leaf16(zr) == _leaf16(z)
        z = zr
    valid = labels >= 0
    zz = z.astype(np.float64)
    p = np.exp(zz - zz.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = float(-np.log(p[valid, labels[valid]]).mean())
    dz = p.copy()
    dz[valid, labels[valid]] -= 1.0
    dz[~valid] = 0.0
    dz = _bf16((dz / valid.sum()).astype(np.float32))
    gx = _bf16((dz @ w) * (1.0 + backward if target else 1.0))
    one = np.array(1.0, dtype=np.float32)
    return {
        "Functional.linear.0.forward": {"input_args": [_leaf16(x), w], "output": [_leaf16(z)]},
        "Functional.cross_entropy.0.forward": {
            "input_args": [_leaf16(z), _ids_v8(labels) if v8 else leaf(labels, stats=("Max", "Min"))],
            "output": [np.array(loss, dtype=np.float32)],
        },
        # msprobe files the tensors of a neighbouring backward hook here: scalars, not the logits' gradient
        "Functional.cross_entropy.0.backward": {"input": [one], "output": [one, one]},
        "Functional.linear.0.backward": {"input": [_leaf16(dz)], "output": [_leaf16(gx)]},
    }


@pytest.mark.parametrize(("scale", "ahead_of"), [(0.1, "Functional.linear.0.backward"), (0.3, "loss")])
def test_labels_changed_under_equal_bf16_logits_are_named_at_the_loss(dump_writer, store_dir, scale, ahead_of):
    """The loss equal in both runs at steps 0 and 1 (no ratio before), the logits' statistics equal at step 2,
    the labels' max/min equal: the loss's move is many times what one rounding of each logit moves it through
    the gradient the logit layer was given (the cross-entropy's own record holds scalars): the labels are named
    at the loss (`input`), ahead of the backward they change; where the loss moved beyond its own tolerance
    (logits 3x larger), instead of the loss as an op."""
    ref = [_step(s, False, None, scale=scale) for s in range(3)]
    tgt = [_step(s, True, 2, scale=scale) for s in range(3)]
    v = _verdict(dump_writer, store_dir, ref, tgt)
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (2, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["differing"] == "Functional.cross_entropy.0.forward.input.1"
    assert c.evidence["earlier_steps_max"] == 0.0
    assert c.evidence["ahead_of"] == (c.op if ahead_of == "loss" else ahead_of)
    assert c.evidence["gradient_units"] > 3
    assert (c.value > 0.015625) == (ahead_of == "loss")  # over the bf16 tolerance or not


def test_equal_bf16_logits_off_by_roundings_leave_the_loss_no_suspect(dump_writer, store_dir):
    """The labels unchanged; at step 2 the target's logits differ by one bf16 rounding in three elements (their
    statistics equal) and the logit layer's backward is 5 % off: the loss's move is within what those roundings
    move it: no data suspect, the backward is named."""
    ref = [_step(s, False, None) for s in range(3)]
    tgt = [_step(0, True, None), _step(1, True, None), _step(2, True, None, rounded=True, backward=0.05)]
    v = _verdict(dump_writer, store_dir, ref, tgt)
    c = v.culprit
    assert c is not None and (c.step, c.op) == (2, "Functional.linear.0.backward")


def test_the_clean_pair_is_quiet(dump_writer, store_dir):
    """Both runs alike at every step: nothing named."""
    ref = [_step(s, False, None) for s in range(3)]
    tgt = [_step(s, True, None) for s in range(3)]
    assert _verdict(dump_writer, store_dir, ref, tgt).culprit is None


def test_labels_kept_with_their_mean_differ_at_any_step(dump_writer, store_dir):
    """msprobe 8.x keeps a float32 mean and norm of the labels: the ignore_index entries (-100) included, the
    sum of 32 labels stays an exact float32 integer (32 x 100 < 2^24), so two labels +1 move the mean by 2/32
    beyond any rounding of a division: the labels differ, named at the loss with no gradient or history
    needed (analysis/hidden_index.py integer_sum_differs)."""
    ref = [_step(s, False, None, scale=0.1, v8=True) for s in range(3)]
    tgt = [_step(s, True, 2, scale=0.1, v8=True) for s in range(3)]
    c = _verdict(dump_writer, store_dir, ref, tgt).culprit
    assert c is not None and (c.step, c.op, c.kind) == (2, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["differing"] == "Functional.cross_entropy.0.forward.input.1"
    assert "gradient_units" not in c.evidence

"""An op reading data and weights only (analysis/float_data.py `data_read`, analysis/culprit.py `_fresh` and
`_unseen_data`): after the first step the error the pair carries (`NoiseModel.carried`) holds the backward's
near-cancelling gradients, far off relative to their tiny norms; it is no measure of what reaches the first op of a
step, whose inputs are data no op made and weights.  Images whose channels are reversed at step 1 (statistics
unchanged: a permutation) are named at the op reading them, `op` with the data named as possibly changed unseen,
where the runs agreed at step 0; a kernel fault at step 0 stays a plain `op`; the clean twin stays quiet.  On small
hand-made float32 dump pairs in msprobe's statistics format."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import leaf
from helpers import stats_verdict as _verdict

B, C, P, D = 4, 3, 4, 8  # images, channels, pixels per channel, features
F32 = np.float32


def _image(step: int, bgr: bool) -> np.ndarray:
    x = np.random.default_rng(200 + step).uniform(0.0, 1.0, size=(B, C, P)).astype(F32)
    return x[:, ::-1, :].copy() if bgr else x  # channels in reverse order: every statistic kept


def _weight(noisy: bool, step: int) -> np.ndarray:
    """The stem's weight; the target's off by 1e-6 of its size from step 1 on (an update's noise)."""
    w = np.random.default_rng(5).normal(size=(D, C * (P + 2))).astype(F32)
    if noisy and step >= 1:
        w = (w * (1 + 1e-6 * np.random.default_rng(40 + step).normal(size=w.shape))).astype(F32)
    return w


def _step(x: np.ndarray, w: np.ndarray, noisy: bool, kernel: float = 0.0) -> dict:
    """pad (zeros around each channel) -> linear over the padded channels; and a batch norm's backward whose weight
    gradient nearly cancels (norm 1e-6 of its input's): the target's off by its own sign (relative error 2), which
    its conditioning explains (a carried error of its input's 1e-7 x 1e6)."""
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1))).astype(F32)
    flat = padded.reshape(B, -1)
    y = (flat @ w.T).astype(F32)
    if kernel:
        y = (y * (1 + kernel)).astype(F32)
    grad = np.random.default_rng(9).normal(size=(B, D)).astype(F32)
    tiny = (1e-6 * np.random.default_rng(11).normal(size=D)).astype(F32)
    g_in = grad
    if noisy:
        g_in = (grad * (1 + 1e-7)).astype(F32)
        tiny = -tiny
    return {
        "Functional.pad.0.forward": {
            "input_args": [leaf(x), {"type": "list", "value": [1, 1]}],
            "output": [leaf(padded)],
        },
        "Functional.linear.0.forward": {
            "input_args": [leaf(flat), leaf(w, requires_grad=True)],
            "output": [leaf(y, requires_grad=True)],
        },
        "Functional.batch_norm.0.backward": {
            "input": [leaf(g_in)],
            "output": [leaf(g_in), leaf(tiny)],
        },
    }


def _pair(bgr_step: int | None, kernel: float = 0.0) -> tuple[list[dict], list[dict]]:
    ref, target = [], []
    for step in range(3):
        ref.append(_step(_image(step, False), _weight(False, step), False))
        x = _image(step, step == bgr_step)
        target.append(_step(x, _weight(True, step), True, kernel if step == 0 else 0.0))
    return ref, target


def test_channels_reversed_at_step_1_are_named_at_the_op_reading_them(dump_writer, store_dir):
    """The image's statistics agree (a permutation), the linear's output differs far beyond float32's tolerance, and
    the pair carries 6x (3 x the step-0 gradient's relative error 2) by its near-cancelling gradient: the linear reads
    data through a pad and a weight only, so that is not what reaches it.  `op` at step 1, its data named."""
    c = _verdict(dump_writer, store_dir, *_pair(1)).culprit
    assert c is not None
    assert (c.step, c.op, c.kind) == (1, "Functional.linear.0.forward", "op")
    assert c.evidence["reason"] == "data may differ unseen"
    assert c.evidence["unseen_data_inputs"] == ["Functional.linear.0.forward.input.0"]
    assert c.evidence["agreed_before"] == 0.0
    assert "permutation" in c.detail


def test_the_same_images_under_noisy_weights_stay_quiet(dump_writer, store_dir):
    assert _verdict(dump_writer, store_dir, *_pair(None)).culprit is None


def test_a_kernel_fault_at_step_0_stays_a_plain_op(dump_writer, store_dir):
    """The same op off 1e-3 at step 0 (8 float32 tolerances): no earlier step where it agreed, so nothing tells data
    from the op: `op`, without the data wording."""
    c = _verdict(dump_writer, store_dir, *_pair(None, kernel=1e-3)).culprit
    assert c is not None
    assert (c.step, c.op, c.kind) == (0, "Functional.linear.0.forward", "op")
    assert "unseen_data_inputs" not in c.evidence


# ------------------------------------------------------------------------------------------------------------
# ids that differ unseen, shown by an activation no recorded op made (analysis/culprit.py `_ids_first`)
# ------------------------------------------------------------------------------------------------------------
T, V, H = 16, 48, 8  # tokens, vocabulary, hidden size


def _lm_step(step: int, noisy: bool, changed: bool, slice_grad: bool = True) -> dict:
    """An embedding of ids (max/min kept only), a linear, and a multiply reading half of the linear's output through
    a slice msprobe does not record (a partial rotary embedding's q).  The target's table off 1e-6 from step 1 (an
    update's noise); with `changed`, its step-2 ids differ inside their range, which the statistics after the
    embedding show only as bounds: the embedding's output off 1e-3, the linear's 1.5e-3 (a normalisation between
    them pins the rest), while the slice is off 3 %."""
    rng = np.random.default_rng(3)
    table = rng.normal(size=(V, H)).astype(F32)
    w = rng.normal(size=(H, H)).astype(F32)
    ids = (np.arange(2 * T, dtype=np.int64).reshape(2, T) * (5 + step)) % (V - 2) + 1
    ids[0, 0], ids[1, 0] = 0, V - 1  # the batch's max and min
    if noisy and step:
        table = (table * (1 + 1e-6)).astype(F32)
    emb = table[ids]
    q = (emb @ w.T).astype(F32)
    half = q[..., : H // 2].copy()
    cos = np.cos(np.arange(T * H // 2, dtype=F32).reshape(T, H // 2) / 7).astype(F32)
    if changed and step == 2:
        emb, q, half = (emb * (1 + 1e-3)).astype(F32), (q * (1 + 1.5e-3)).astype(F32), (half * 1.03).astype(F32)
    return {
        "Functional.embedding.0.forward": {
            "input_args": [leaf(ids, stats=("Max", "Min")), leaf(table, requires_grad=True)],
            "output": [leaf(emb, requires_grad=True)],
        },
        "Module.embed.Embedding.forward.0": {  # (mix level: module records list their parameters)
            "input_args": [leaf(ids, stats=("Max", "Min"))],
            "output": [leaf(emb, requires_grad=True)],
            "parameters": [leaf(table, requires_grad=True)],
        },
        "Functional.linear.0.forward": {
            "input_args": [leaf(emb, requires_grad=True), leaf(w, requires_grad=True)],
            "output": [leaf(q, requires_grad=True)],
        },
        "Module.q_proj.Linear.forward.0": {
            "input_args": [leaf(emb, requires_grad=True)],
            "output": [leaf(q, requires_grad=True)],
            "parameters": [leaf(w, requires_grad=True)],
        },
        "Tensor.__mul__.0.forward": {
            "input_args": [leaf(half, requires_grad=slice_grad), leaf(cos)],
            "output": [leaf((half * cos).astype(F32), requires_grad=True)],
        },
    }


def _lm_pair(changed: bool, slice_grad: bool = True) -> tuple[list[dict], list[dict]]:
    ref = [_lm_step(s, False, False, slice_grad) for s in range(3)]
    return ref, [_lm_step(s, True, changed, slice_grad) for s in range(3)]


def test_ids_that_differ_unseen_are_named_at_the_embedding_not_at_the_activation(dump_writer, store_dir):
    """The slice (requires grad: an activation) differs beyond anything recorded before it in its step, whose errors
    are statistics bounds; the embedding reads ids compared by max/min only and its output differs: `input` there,
    the activation kept as what showed it."""
    c = _verdict(dump_writer, store_dir, *_lm_pair(True)).culprit
    assert c is not None
    assert (c.step, c.op, c.kind) == (2, "Functional.embedding.0.forward", "input")
    assert c.evidence["differing"] == "Functional.embedding.0.forward.input.0"
    assert c.evidence["ahead_of"] == "Tensor.__mul__.0.forward"
    assert c.evidence["activation"] == "Tensor.__mul__.0.forward.input.0"
    assert c.evidence["activation_err"] == pytest.approx(0.03, rel=1e-3)


def test_the_same_ids_stay_quiet(dump_writer, store_dir):
    assert _verdict(dump_writer, store_dir, *_lm_pair(False)).culprit is None


def test_float_data_requiring_no_grad_stay_where_they_are_read(dump_writer, store_dir):
    """The same tensor requiring no grad is data (float_data.py): named at the multiply reading it."""
    c = _verdict(dump_writer, store_dir, *_lm_pair(True, slice_grad=False)).culprit
    assert c is not None
    assert (c.step, c.op, c.kind) == (2, "Tensor.__mul__.0.forward", "input")

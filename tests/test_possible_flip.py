"""A near-tie flip the statistics cannot show (analysis/flipflow.py `mark_possible_flips`): an argmax over logits
that differ by rounding, its int64 output compared by max/min only, and the float accuracy indicator
`(pred == labels).float()` (a cast msprobe does not record) moved by one unit; on small hand-made dump pairs in
statistics mode, exact values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_flipflow import _f32, _pair

from dumpstore.analysis.flipflow import TIES, units_moved
from helpers import leaf

LABELS = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int64)
REF_PRED = np.array([3, 1, 7, 7, 5, 9, 2, 0], dtype=np.int64)  # 5 of 8 right
FLIPPED = np.array([3, 2, 7, 7, 5, 9, 2, 0], dtype=np.int64)  # image 1's near tie 1 vs 2 flipped: 4 of 8, same max/min


def _ints(a: np.ndarray, dtype: str | None = None) -> dict:
    """An integer or boolean tensor as msprobe's statistics mode dumps it: max and min only."""
    return leaf(a, stats=("Max", "Min"), dtype=dtype)


def _classifier(
    pred: np.ndarray,
    *,
    noise: float = 0.0,
    labels: np.ndarray = LABELS,
    cast: bool = False,
    logits_noise: float | None = None,
    logits_dtype: str | None = None,
    next_micro_batch: bool = False,
    dim: int = -1,
) -> dict:
    """Float ops (the pair's baseline) and the logits, off by `noise` (relative: the target's rounding; the
    logits off by `logits_noise` where given, dumped as `logits_dtype`), their argmax, `pred == labels` and
    the mean of the float indicator (`cast`: the `.float()` recorded as `Tensor.float.0.forward`, else made by
    no recorded op; `next_micro_batch`: in the next micro-batch, after a backward record)."""
    rng = np.random.default_rng(3)
    x = _f32(rng.normal(size=(8, 16)))
    recs: dict = {
        f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [_f32(x * (1 + noise * (i + 1)))]}
        for i in range(4)
    }
    w = _f32(rng.normal(size=(10, 16)) / 4)
    logits = _f32((x @ w.T) * (1 + (noise if logits_noise is None else logits_noise)))
    recs["Functional.linear.0.forward"] = {"input_args": [x, leaf(w, requires_grad=True)], "output": [logits]}
    recs["Torch.argmax.0.forward"] = {
        "input_args": [leaf(logits, dtype=logits_dtype), {"type": "int", "value": dim}],
        "output": [_ints(pred)],
    }
    right = pred == labels
    recs["Tensor.__eq__.0.forward"] = {
        "input_args": [_ints(pred), _ints(labels)],
        "output": [_ints(right.astype(np.int8), dtype="bool")],
    }
    indicator = _f32(right)
    if cast:
        recs["Tensor.float.0.forward"] = {
            "input_args": [_ints(right.astype(np.int8), dtype="bool")],
            "output": [indicator],
        }
    if next_micro_batch:
        recs["Functional.gelu.0.backward"] = {"input": [x], "output": [x]}
    recs["Tensor.mean.0.forward"] = {"input_args": [indicator], "output": [_f32(indicator.mean())]}
    return recs


def _target(pred: np.ndarray, **kw) -> dict:
    return _classifier(pred, noise=1e-6, **kw)


def _verdict(dump_writer, store_dir, target: dict, ref: dict | None = None):
    return _pair(dump_writer, store_dir, "statistics", [ref or _classifier(REF_PRED)], [target])


@pytest.mark.parametrize("cast", [False, True])
def test_an_unseen_flip_explains_one_unit_of_the_accuracy_indicator(dump_writer, store_dir, cast):
    """The indicator's mean 5/8 -> 4/8, its norm sqrt(5) -> 2: one unit after an argmax whose float input
    differs by rounding: no culprit, the possible flip said in the verdict's notes."""
    v = _verdict(dump_writer, store_dir, _target(FLIPPED, cast=cast), _classifier(REF_PRED, cast=cast))
    assert v.culprit is None and v.first_divergence is None
    name = "Tensor.float.0.forward.output.0" if cast else "Tensor.mean.0.forward.input.0"
    [note] = v.noise["discrete_flips"]
    assert (note["step"], note["rank"], note["op"], note["possible"], note["explains"]) == (
        0,
        0,
        "Torch.argmax.0.forward",
        True,
        name,
    )
    assert note["outputs"] == ["Torch.argmax.0.forward.output.0"]
    assert note["detail"] == (
        "possibly a near-tie flip in Torch.argmax.0.forward; statistics cannot tell: "
        f"{name} (whole numbers) moved 1 unit(s) of 8"
    )


def test_without_a_differing_float_input_no_flip_is_possible(dump_writer, store_dir):
    """The same indicator change where the logits agree exactly: nothing could flip, an input no op produced."""
    v = _verdict(dump_writer, store_dir, _classifier(FLIPPED))
    assert v.culprit is not None
    assert (v.culprit.step, v.culprit.op, v.culprit.kind) == (0, "Tensor.mean.0.forward", "input")


def test_two_units_are_beyond_one_near_tie(dump_writer, store_dir):
    """Two images' indicators changed (5/8 -> 3/8): beyond what one near tie makes, a culprit."""
    pred = FLIPPED.copy()
    pred[4] = 6  # 5 -> 6: image 4 wrong too (max and min kept)
    v = _verdict(dump_writer, store_dir, _target(pred))
    assert v.culprit is not None
    assert (v.culprit.op, v.culprit.kind, v.culprit.evidence["differing"]) == (
        "Tensor.mean.0.forward",
        "input",
        "Tensor.mean.0.forward.input.0",
    )


def test_changed_labels_are_not_explained_by_a_possible_flip(dump_writer, store_dir):
    """Labels (integer data no op produced) differ at the comparison (max 9 -> 8): the indicator's change is the
    data's, not a flip's: named."""
    labels = LABELS.copy()
    labels[5] = 8  # image 5's label: now wrong, and the labels' max moves
    v = _verdict(dump_writer, store_dir, _target(REF_PRED, labels=labels))
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mean.0.forward", "input")


def test_units_moved_reads_sum_extremes_and_sum_of_squares():
    base = {"numel": 8, "ref_numel": 8, "ref_min": 0.0, "ref_max": 1.0, "ref_mean": 0.625, "ref_norm": math.sqrt(5)}
    assert TIES == 1
    assert units_moved({**base, "min": 0.0, "max": 1.0, "mean": 0.5, "norm": 2.0}) == 1  # one indicator 1 -> 0
    assert units_moved({**base, "min": 0.0, "max": 1.0, "mean": 0.375, "norm": math.sqrt(3)}) is None  # two
    assert units_moved({**base, "min": 0.0, "max": 1.0, "mean": 0.5, "norm": 2.1}) is None  # not whole
    assert units_moved({**base, "numel": 9, "min": 0.0, "max": 1.0, "mean": 0.5, "norm": 2.0}) is None  # shape
    counts = {"numel": 4, "ref_numel": 4, "ref_min": 3.0, "ref_max": 6.0, "ref_mean": 4.5, "ref_norm": math.sqrt(86)}
    # token counts [3, 4, 5, 6] -> [3, 4, 4, 7]: one token moved between experts, the sum kept, the max up by one
    assert units_moved({**counts, "min": 3.0, "max": 7.0, "mean": 4.5, "norm": math.sqrt(90)}) == 0
    # [3, 4, 5, 6] -> [3, 4, 5, 8]: the max up by two: beyond one tie
    assert units_moved({**counts, "min": 3.0, "max": 8.0, "mean": 5.0, "norm": math.sqrt(114)}) is None


def test_a_flip_in_one_micro_batch_explains_nothing_in_the_next(dump_writer, store_dir):
    """The indicator read in the next micro-batch (after a backward record): no flip of the first makes it."""
    v = _verdict(
        dump_writer,
        store_dir,
        _target(FLIPPED, next_micro_batch=True),
        _classifier(REF_PRED, next_micro_batch=True),
    )
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mean.0.forward", "input")


@pytest.mark.parametrize(("dtype", "quiet"), [("bfloat16", True), (None, False)])
def test_logits_whose_statistics_agree_can_flip_in_16_bits_only(dump_writer, store_dir, dtype, quiet):
    """The argmax's logits dumped with the same statistics in both runs while the ops before them differ: in
    bf16 (statistics rounded to 8 bits) a difference can hide there, a flip is possible; in float32 the same
    statistics mean the same logits, nothing could flip."""
    ref = _classifier(REF_PRED, logits_dtype=dtype)
    v = _verdict(dump_writer, store_dir, _target(FLIPPED, logits_noise=0.0, logits_dtype=dtype), ref)
    if quiet:
        assert v.culprit is None and v.noise["discrete_flips"][0]["op"] == "Torch.argmax.0.forward"
    else:
        assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mean.0.forward", "input")


def test_a_changed_argument_of_the_discrete_op_is_found(dump_writer, store_dir):
    """The argmax taken over another dimension in the target (same outputs' statistics): the argument, not a
    possible flip."""
    v = _verdict(dump_writer, store_dir, _target(FLIPPED, dim=1))
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Torch.argmax.0.forward", "scalar")


def test_a_wrong_kernel_before_the_discrete_op_is_found(dump_writer, store_dir):
    """The logits 1 % off on agreeing inputs: the linear that made them, before any possible flip."""
    v = _verdict(dump_writer, store_dir, _target(FLIPPED, logits_noise=0.01))
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Functional.linear.0.forward", "op")

"""Float data changed after an earlier step where they agreed (analysis/float_data.py, analysis/culprit.py
`_float_data`): a stale or altered image is named at its first reader however small against the tolerance, while
the noise the weights carry after the first step stays quiet, and neither a buffer read after a differing op nor a
state handed on from the previous step counts as data; on small hand-made float32 dump pairs."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from dumpstore.analysis.float_data import data_moved
from helpers import leaf
from helpers import stats_verdict as _verdict

B, D = 4, 8  # rows of data, features
F32 = np.float32


def _data(step: int) -> np.ndarray:
    return np.random.default_rng(100 + step).normal(size=(B, D)).astype(F32)


def _weights(noisy: bool, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Two weight matrices; the target's off by 1e-6 of their size from step 1 on (an update's noise)."""
    rng = np.random.default_rng(7)
    w1, w2 = rng.normal(size=(D, D)).astype(F32), rng.normal(size=(D, D)).astype(F32)
    if noisy and step >= 1:
        jitter = np.random.default_rng(50 + step)
        w1 = (w1 * (1 + 1e-6 * jitter.normal(size=w1.shape))).astype(F32)
        w2 = (w2 * (1 + 1e-6 * jitter.normal(size=w2.shape))).astype(F32)
    return w1, w2


def _net(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, first: dict | None = None) -> tuple[dict, np.ndarray]:
    """linear(x, w1) -> x 2 -> linear(., w2), in statistics mode; `first`: records before them."""
    y = (x @ w1.T).astype(F32)
    y2 = (2 * y).astype(F32)
    z = (y2 @ w2.T).astype(F32)
    recs = dict(first or {})
    recs["Functional.linear.0.forward"] = {
        "input_args": [leaf(x), leaf(w1, requires_grad=True)],
        "output": [leaf(y, requires_grad=True)],
    }
    recs["Tensor.__mul__.0.forward"] = {
        "input_args": [leaf(y, requires_grad=True), {"type": "float", "value": 2.0}],
        "output": [leaf(y2, requires_grad=True)],
    }
    recs["Functional.linear.1.forward"] = {
        "input_args": [leaf(y2, requires_grad=True), leaf(w2, requires_grad=True)],
        "output": [leaf(z, requires_grad=True)],
    }
    return recs, z


def _pair(change: float) -> tuple[list[dict], list[dict]]:
    """Three steps; the target's weights noisy from step 1, one row of its step-2 data moved by `change` (relative
    to the row)."""
    ref, target = [], []
    for step in range(3):
        x = _data(step)
        ref.append(_net(x, *_weights(False, step))[0])
        if step == 2 and change:
            x = x.copy()
            x[1] = (x[1] * (1 + change)).astype(F32)
        target.append(_net(x, *_weights(True, step))[0])
    return ref, target


def test_data_changed_under_the_tolerance_after_step_0_is_named_at_its_reader(dump_writer, store_dir):
    """One row of step 2's data scaled by 1 + 1e-4: the data's relative error 4.6e-5 is under float32's 2^-13
    (1.2e-4), and so is every output's; the data agreed exactly at steps 0 and 1: `input` at step 2, at the linear
    reading it."""
    ref, target = _pair(1e-4)
    c = _verdict(dump_writer, store_dir, ref, target).culprit
    assert c is not None
    assert (c.step, c.op, c.kind) == (2, "Functional.linear.0.forward", "input")
    assert c.evidence["differing"] == "Functional.linear.0.forward.input.0"
    assert c.evidence["data_changed"] is True
    assert 0 < c.evidence["input_err"] < 2.0**-13


def test_the_same_data_under_noisy_weights_stay_quiet(dump_writer, store_dir):
    """The clean pair of the test above: the weights' noise after step 0 moves every output, not the data."""
    ref, target = _pair(0.0)
    assert _verdict(dump_writer, store_dir, ref, target).culprit is None


def _two_towers(change: float) -> tuple[list[dict], list[dict]]:
    """`_pair`'s data read after another tower: a linear of other data (the same in both runs: captions' features)
    with a weight the target carries noisy from step 1 (off 1e-6 of its size), recorded before the first tower's
    records, so each step's data are read after an output that differs by the pair's noise."""
    ref, target = [], []
    for step in range(3):
        text = np.random.default_rng(300 + step).normal(size=(B, D)).astype(F32)
        for side, out in (("ref", ref), ("target", target)):
            noisy = side == "target"
            w = np.random.default_rng(9).normal(size=(D, D)).astype(F32)
            if noisy and step:
                w = (w * (1 + 1e-6 * np.random.default_rng(60 + step).normal(size=w.shape))).astype(F32)
            first = {
                "Functional.linear.5.forward": {
                    "input_args": [leaf(text), leaf(w, requires_grad=True)],
                    "output": [leaf((text @ w.T).astype(F32), requires_grad=True)],
                }
            }
            x = _data(step)
            if noisy and step == 2 and change:
                x = x.copy()
                x[1] = (x[1] * (1 + change)).astype(F32)
            out.append(_net(x, *_weights(noisy, step), first=first)[0])
    return ref, target


def test_data_read_after_the_other_tower_differs_by_noise_are_named(dump_writer, store_dir):
    """The second tower's data (one row x (1 + 1e-4) at step 2: off 3.0e-5, under float32's 2^-13) read after the
    first tower's output, off 1.5e-6 by its weight's noise: no choice before it (no flip) carries that noise into
    data no op made, and the data moved beyond it: `input` at step 2, at the linear reading it."""
    ref, target = _two_towers(1e-4)
    c = _verdict(dump_writer, store_dir, ref, target).culprit
    assert c is not None
    assert (c.step, c.op, c.kind) == (2, "Functional.linear.0.forward", "input")
    assert c.evidence["differing"] == "Functional.linear.0.forward.input.0"
    assert c.evidence["step_noise_before"] == pytest.approx(1.471e-6, rel=1e-3)
    assert c.evidence["input_err"] == pytest.approx(3.043e-5, rel=1e-3)


def test_the_same_two_towers_stay_quiet(dump_writer, store_dir):
    """The clean pair of the test above: the first tower's noise moves outputs, not the second tower's data."""
    ref, target = _two_towers(0.0)
    assert _verdict(dump_writer, store_dir, ref, target).culprit is None


def test_an_unrecorded_copy_of_a_differing_output_is_not_data(dump_writer, store_dir):
    """Half the first linear's output, made by an op msprobe does not record and read without grad by a mean (a
    metric): equal at step 0, it carries the weights' noise from step 1 on, no more than the outputs before it
    show, so it is no data change."""
    ref, target = [], []
    for step in range(3):
        x = _data(step)
        for side, out in (("ref", ref), ("target", target)):
            recs, z = _net(x, *_weights(side == "target", step))
            y = (x @ _weights(side == "target", step)[0].T).astype(F32)
            half = (0.5 * y).astype(F32)
            recs["Tensor.mean.0.forward"] = {"input_args": [leaf(half)], "output": [leaf(half.mean(dtype=F32))]}
            out.append(recs)
    assert _verdict(dump_writer, store_dir, ref, target).culprit is None


def test_a_buffer_read_after_a_differing_op_is_not_data(dump_writer, store_dir):
    """A running mean (float32, no grad, no recorded producer: updated in place by the previous step) equal at step 0
    and off by the previous step's noise from step 1 on (1e-5, beyond the outputs before it), read by a batch norm
    after the linear whose output the weights' noise already moved: the signature names it `running_mean`, a
    buffer, so it is no data change."""
    ref, target = [], []
    for step in range(3):
        x = _data(step)
        for side, out in (("ref", ref), ("target", target)):
            noisy = side == "target"
            recs, z = _net(x, *_weights(noisy, step))
            mean = np.full(D, 0.1 * step, dtype=F32)
            if noisy and step:
                mean = (mean * (1 + 1e-5)).astype(F32)
            recs["Functional.batch_norm.0.forward"] = {
                "input_args": [leaf(z, requires_grad=True), leaf(mean)],
                "output": [leaf((z - mean).astype(F32), requires_grad=True)],
            }
            out.append(recs)
    assert _verdict(dump_writer, store_dir, ref, target).culprit is None


def test_a_state_handed_on_from_the_previous_step_is_not_data(dump_writer, store_dir):
    """A recurrent state read first in each step (no grad: detached) that is the previous step's last output of
    the same run: it agreed at step 1 (step 0's outputs agree) and carries step 1's noise at step 2."""
    ref, target = [], []
    for side, out in (("ref", ref), ("target", target)):
        state = np.zeros((B, D), dtype=F32)
        for step in range(3):
            first = {
                "Tensor.__add__.0.forward": {
                    "input_args": [leaf(state), leaf(_data(step))],
                    "output": [leaf((state + _data(step)).astype(F32))],
                }
            }
            x = (state + _data(step)).astype(F32)
            recs, z = _net(x, *_weights(side == "target", step), first=first)
            out.append(recs)
            state = (1e-3 * z).astype(F32)
            recs["Tensor.__mul__.1.forward"] = {
                "input_args": [leaf(z, requires_grad=True), {"type": "float", "value": 1e-3}],
                "output": [leaf(state)],
            }
    assert _verdict(dump_writer, store_dir, ref, target).culprit is None


def test_a_teachers_weight_requiring_no_grad_is_not_data(dump_writer, store_dir):
    """A teacher read first in each step (an API-level dump: no module record lists its parameters), its weight a
    moving average of the student's that requires no grad: equal at step 0, off by the student's noise from step 1
    on (2e-5 of its elements' size).  The linear's signature names it `weight`: no data."""
    ref, target = [], []
    for step in range(3):
        x = _data(step)
        for side, out in (("ref", ref), ("target", target)):
            w1, w2 = _weights(side == "target", step)
            teacher = _weights(False, 0)[0]
            if side == "target" and step:  # the student's noise, averaged in
                teacher = (teacher * (1 + 2e-5 * np.random.default_rng(step).normal(size=teacher.shape))).astype(F32)
            t = (x @ teacher.T).astype(F32)
            first = {"Functional.linear.9.forward": {"input_args": [leaf(x), leaf(teacher)], "output": [leaf(t)]}}
            out.append(_net(x, w1, w2, first=first)[0])
    assert _verdict(dump_writer, store_dir, ref, target).culprit is None


def _moved(t: dict, r: dict, dtype: str = "float32", n: int = 1024) -> bool:
    row = {"dtype": dtype, "numel": n}
    row |= {s: t[s] for s in ("min", "max", "mean", "norm")}
    row |= {"ref_" + s: r[s] for s in ("min", "max", "mean", "norm")}
    return pl.DataFrame([row]).select(data_moved()).item()


def test_data_moved_allows_the_rounding_of_identical_data():
    """n = 1024 (ceil log2 = 10), float32 (eps 2^-23), RMS = norm / 32 = 1: the mean may differ by (3 + 20) eps,
    the norm by (3 + 10) eps of itself, the max and min by 3 eps of themselves."""
    e = 2.0**-23
    r = {"min": -2.0, "max": 3.0, "mean": 0.01, "norm": 32.0}
    assert not _moved(r, r)
    assert not _moved(r | {"mean": 0.01 + 22 * e}, r)
    assert _moved(r | {"mean": 0.01 + 24 * e}, r)
    assert not _moved(r | {"norm": 32.0 * (1 + 12 * e)}, r)
    assert _moved(r | {"norm": 32.0 * (1 + 14 * e)}, r)
    assert not _moved(r | {"max": 3.0 * (1 + 2 * e)}, r)
    assert _moved(r | {"max": 3.0 * (1 + 4 * e)}, r)
    assert _moved(r | {"min": -2.0 * (1 + 4 * e)}, r)
    assert not _moved(r | {"mean": float("nan")}, r)  # a statistic that is not finite says nothing

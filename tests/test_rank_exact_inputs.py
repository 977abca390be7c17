"""compare's significance of an op whose tensor inputs agree exactly (analysis/rank.py): its error is all its own,
measured at its output dtype's tolerance, not at the run's bfloat16 compute floor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from analysis.rank import rank_rows
from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs

BF16 = ml_dtypes.bfloat16


def _run(noise: float, loss_scale: float, loss_dtype=np.float32) -> dict:
    """Twelve bfloat16 linears in a chain (the run's compute floor: bfloat16; `noise`: their relative rounding
    difference, carried and grown along the chain), then a float32 cross-entropy (an autocast run's float32
    list) on float32 logits that agree exactly, whose loss is scaled by `loss_scale` (labels changed where the
    statistics cannot show it)."""
    rng = np.random.default_rng(5)
    x = logits = rng.normal(size=(8, 16)).astype(np.float32)
    recs: dict = {}
    for i in range(12):
        w = (rng.normal(size=(16, 16)) / 4).astype(np.float32)
        y = x @ w.T
        y = y * (1 + noise * rng.standard_normal(y.shape))
        recs[f"Functional.linear.{i}.forward"] = {"input_args": [x.astype(BF16), w], "output": [y.astype(BF16)]}
        x = np.tanh(y).astype(np.float32)
    labels = np.arange(8, dtype=np.int64) % 16
    loss = np.array(2.5 * loss_scale, dtype=np.float32).astype(loss_dtype)
    recs["Functional.cross_entropy.0.forward"] = {
        "input_args": [logits, labels],
        "output": [loss],
    }
    return recs


def _compare(dump_writer, store_dir, ref: dict, target: dict):
    for name, recs in (("ref", ref), ("target", target)):
        w = dump_writer(name, "statistics")
        w.write(recs)
        ingest(w.root, name, store=store_dir, jobs=1)
    return compare_runs(open_store(store_dir), "target", "ref")


def test_an_op_on_exactly_agreeing_inputs_is_measured_at_its_own_dtype(dump_writer, store_dir):
    """The loss differs by 0.4 % where the logits agree exactly: 0.26 of the bfloat16 tolerance (under the
    linears' noise over what they got), but 32.8 of float32's, the loss's own dtype: first by significance."""
    cmp = _compare(dump_writer, store_dir, _run(0.0, 1.0), _run(0.01, 1.004))
    top = rank_rows(cmp, top=1, culprit=None).row(0, named=True)
    assert top["name"] == "Functional.cross_entropy.0.forward.output.0"
    assert top["significance"] == pytest.approx(top["rel_l2"] / 2.0**-13)
    assert top["rel_l2"] == pytest.approx(0.004, rel=1e-3)


def test_the_coarser_dtype_of_the_two_runs_is_kept(dump_writer, store_dir):
    """The loss is float32 in the target, bfloat16 in the reference (a backend that keeps the op in float32): the
    pair differs by bfloat16's rounding of the reference, measured at bfloat16's tolerance."""
    cmp = _compare(dump_writer, store_dir, _run(0.0, 1.0, BF16), _run(0.01, 1.004))
    rows = rank_rows(cmp, top=0, culprit=None)
    loss = rows.filter(rows["name"] == "Functional.cross_entropy.0.forward.output.0").row(0, named=True)
    assert loss["significance"] == pytest.approx(loss["rel_l2"] / 2.0**-6)


def test_statistics_of_a_bfloat16_input_agree_only_to_its_rounding(dump_writer, store_dir):
    """The same loss on bfloat16 logits: their statistics agree only to bfloat16's rounding (msprobe keeps them
    in bfloat16), so the loss is measured at bfloat16's tolerance, as the run's floor has it."""
    ref, target = _run(0.0, 1.0), _run(0.01, 1.004)
    for recs in (ref, target):
        args = recs["Functional.cross_entropy.0.forward"]["input_args"]
        args[0] = args[0].astype(BF16)
    rows = rank_rows(_compare(dump_writer, store_dir, ref, target), top=0, culprit=None)
    loss = rows.filter(rows["name"] == "Functional.cross_entropy.0.forward.output.0").row(0, named=True)
    assert loss["significance"] == pytest.approx(loss["rel_l2"] / 2.0**-6)

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


def _run(noise: float, loss_scale: float) -> dict:
    """Twelve bfloat16 linears in a chain (the run's compute floor: bfloat16; `noise`: their relative rounding
    difference, carried and grown along the chain), then a float32 cross-entropy (an autocast run's float32
    list) on logits that agree exactly, whose loss is scaled by `loss_scale` (labels changed where the
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
    loss = np.array(2.5 * loss_scale, dtype=np.float32)
    recs["Functional.cross_entropy.0.forward"] = {
        "input_args": [logits.astype(BF16), labels],
        "output": [loss],
    }
    return recs


@pytest.mark.parametrize("mode", ["statistics"])
def test_an_op_on_exactly_agreeing_inputs_is_measured_at_its_own_dtype(dump_writer, store_dir, mode):
    """The loss differs by 0.4 % where the logits agree exactly: 0.26 of the bfloat16 tolerance (under the
    linears' noise over what they got), but 32.8 of float32's, the loss's own dtype: first by significance."""
    for name, recs in (("ref", _run(0.0, 1.0)), ("target", _run(0.01, 1.004))):
        w = dump_writer(name, mode)
        w.write(recs)
        ingest(w.root, name, store=store_dir, jobs=1)
    cmp = compare_runs(open_store(store_dir), "target", "ref")
    top = rank_rows(cmp, top=1, culprit=None).row(0, named=True)
    assert top["name"] == "Functional.cross_entropy.0.forward.output.0"
    assert top["significance"] == pytest.approx(top["rel_l2"] / 2.0**-13)
    assert top["rel_l2"] == pytest.approx(0.004, rel=1e-3)

"""Which parameter changed between steps (analysis/param_change.py, analysis/steps.py `corrupted`): a parameter
is its pair of fingerprints (target, reference), so one layer given another layer's values is named at its own
consumer, and the layer it was copied from is its sibling, not its copy; on small real dump pairs in both dump
modes and on hand-made tables."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from test_noise import MODES, _ingest_pair, _mark_parameters, _t, _verdict
from test_steps import N_PARAMS, _noise, _runs, _table

from dumpstore import open_store
from dumpstore.analysis import param_change, steps


def _copied(x, params, grads, steps_: int, source: int | None, dest: int, at: int, noise=None) -> list[dict]:
    """Steps of N_PARAMS linear records (parameter i at step s is p_i - s * 0.01 * g_i, moved by `noise`); from
    step `at` on, parameter `dest` holds parameter `source`'s value (None: no copy)."""
    out = []
    for step in range(steps_):
        qs = [_t(p - step * 0.01 * g) for p, g in zip(params, grads)]
        if noise is not None:
            qs = [_t(noise(step, i, q, g)) for i, (q, g) in enumerate(zip(qs, grads))]
        if source is not None and step >= at:
            qs[dest] = qs[source].copy()
        out.append(
            {f"Functional.linear.{i}.forward": {"input_args": [x, q], "output": [x @ q.T]} for i, q in enumerate(qs)}
        )
    return out


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_given_another_layers_values_is_named_at_its_own_consumer(dump_writer, store_dir, mode):
    """Parameter 4 given parameter 3's values before step 1: both read one target tensor (one target
    fingerprint), but not one reference tensor.  The change is named at parameter 4's consumer, not at
    parameter 3's (the first reader of that target fingerprint), and parameter 3 is one of its siblings."""
    x, params, grads = _runs(np.random.default_rng(30))
    ref = _copied(x, params, grads, 2, None, 4, 1)
    target = _copied(x, params, grads, 2, 3, 4, 1, noise=_noise(31))
    st = _ingest_pair(dump_writer, store_dir, mode, ref, target, steps=2)
    _mark_parameters(st, store_dir)
    c = _verdict(open_store(store_dir)).culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.4.forward")
    assert c.evidence["judged_against"] == "siblings" and c.evidence["siblings"] == N_PARAMS - 1
    assert c.evidence["update_units"] > 100 * c.evidence["siblings_max"]


def test_the_parameter_key_is_the_pair_of_fingerprints():
    frame = pl.DataFrame(
        {"_fp_t": [7, 7, 8, None], "_fp_ref_": [1, 2, 1, 1]}, schema={"_fp_t": pl.UInt64, "_fp_ref_": pl.UInt64}
    )
    k = param_change.keys(frame)
    assert k[0] != k[1] and k[0] != k[2] and k[1] != k[2] and k[3] is None
    assert k == param_change.keys(frame)  # the same rows, the same keys (steps.py and culprit.py agree)
    assert param_change.keys(frame.drop("_fp_ref_")) == [7, 7, 8, None]  # no reference side: the target's


def test_two_parameters_equal_in_the_target_are_siblings_not_one_tensor():
    """Layer 1's weight given layer 0's values: one target fingerprint (100), two parameter keys.  Judged by the
    target fingerprint alone, layer 0 was layer 1's own copy (no sibling: judged against every other parameter)
    and the change was keyed by the fingerprint layer 0's consumer reads too."""
    records = [f"Module.layers.{i}.down.Linear.forward.0" for i in range(3)]
    t = _table([0.0, 0.46, 0.002], records=records, fps=[100, 100, 102], x_round=[0.14] * 3)
    t = t.with_columns(pl.Series("_pkey", [500, 501, 502]))
    assert steps.corrupted(t) == {
        501: {
            "update_units": 0.46,
            "carried_in": 0.14,
            "judged_against": "siblings",
            "siblings": 2,
            "siblings_max": 0.002,
        }
    }

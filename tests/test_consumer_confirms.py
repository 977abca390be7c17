"""A parameter changed by under a quarter of its update after step 0 (analysis/steps.py `needs_consumer`), named
where its first consumer confirms it (analysis/culprit.py `_consumer_confirms`): the consumer's output error beyond
what its inputs' noise explains, in both dump modes, on small real dump pairs."""

from __future__ import annotations

import numpy as np
import pytest
from test_noise import MODES, _ingest_pair, _mark_parameters, _t, _verdict

from dumpstore import open_store
from dumpstore.analysis.culprit import noise_share

N_PARAMS = 6


def _steps(change, steps: int = 2) -> list[dict]:
    """Steps of N_PARAMS linear records whose weights move by +-0.01 per element each update (an Adam-like sign
    update, mostly one way: it moves their means), the target's updates off by 1e-4 of themselves (its
    device's rounding), then `change(step, i, q)` of the target."""
    rng = np.random.default_rng(10)
    x = _t(rng.normal(size=(4, 8)))
    params = [_t(rng.normal(size=(8, 8)) * 0.1) for _ in range(N_PARAMS)]
    noise = np.random.default_rng(11)
    out = []
    for step in range(steps):
        recs = {}
        for i, p in enumerate(params):
            g = np.random.default_rng(step * 10 + i).choice([-1.0, 1.0], size=p.shape, p=[0.2, 0.8])
            q = p - step * 0.01 * g
            if change is not None:
                q = change(step, i, q + step * 0.01 * g * 1e-4 * noise.normal(size=q.shape))
            q = _t(q)
            recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, q], "output": [x @ q.T]}
        out.append(recs)
    return out


def _scaled(step, i, q):
    """Parameter 3 times 1.01 before step 1."""
    return q * 1.01 if step == 1 and i == 3 else q


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_scaled_by_one_percent_after_step_0_is_named_at_its_consumer(dump_writer, store_dir, mode):
    """Both modes: the weight x1.01 moves it by 0.155 of its update (under X_MIN), 3900 times its siblings; its
    consumer's output moves 1 %, all of it the weight's, whose noise (its siblings' x over its own) explains a
    negligible share: confirmed, named at step 1.  (Before, the weight's whole error was taken as carried in,
    and the consumer's output error beyond it, 0, confirmed nothing.)"""
    st = _ingest_pair(dump_writer, store_dir, mode, _steps(None), _steps(_scaled), steps=2)
    _mark_parameters(st, store_dir)
    c = _verdict(open_store(store_dir)).culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    assert c.evidence["update_units"] == pytest.approx(0.1552, abs=1e-4)
    assert c.evidence["noise_share"] == pytest.approx(2.58e-4, rel=1e-2)  # siblings 4e-5 of an update
    assert c.evidence["consumer_err"] == pytest.approx(0.009997, abs=1e-5)
    assert "confirmed by this op's output" in c.detail


def _flipped(step, i, q):
    """One element of parameter 3 (the one nearest 0.03) sign-flipped before step 1: its norm, max and min stay."""
    if step == 1 and i == 3:
        q = q.copy()
        at = np.unravel_index(np.argmin(np.abs(q - 0.03)), q.shape)
        q[at] = -q[at]
    return q


@pytest.mark.parametrize("mode", MODES)
def test_a_sign_flip_after_step_0_is_confirmed_in_both_modes(dump_writer, store_dir, mode):
    """One element's sign flipped: under a quarter of an update by the statistics bounds (x's units in both
    modes), its consumer's output off by the flip.  In tensor mode the parameter's exact error explains the
    consumer's output, which confirmed nothing before; its noise explains a negligible share of it: named."""
    st = _ingest_pair(dump_writer, store_dir, mode, _steps(None), _steps(_flipped), steps=2)
    _mark_parameters(st, store_dir)
    c = _verdict(open_store(store_dir)).culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    assert c.evidence["update_units"] < 0.25
    assert "confirmed by this op's output" in c.detail


@pytest.mark.parametrize("mode", MODES)
def test_update_noise_alone_confirms_nothing(dump_writer, store_dir, mode):
    """The same runs without the change: nothing named."""
    st = _ingest_pair(dump_writer, store_dir, mode, _steps(None), _steps(lambda s, i, q: q), steps=2)
    _mark_parameters(st, store_dir)
    assert _verdict(open_store(store_dir)).culprit is None


def test_the_noise_share_of_a_changed_parameter():
    """Its siblings' largest x (or what its update was fed, the larger) over its own x, at most 1; all of it
    where fewer than three siblings measure its kind's noise (or none: judged against every other parameter)."""
    sib = {"judged_against": "siblings", "siblings": 3}
    assert noise_share({**sib, "update_units": 0.1, "siblings_max": 0.002, "carried_in": 0.001}) == pytest.approx(0.02)
    assert noise_share({**sib, "update_units": 0.1, "siblings_max": 0.0, "carried_in": 0.005}) == pytest.approx(0.05)
    assert noise_share({**sib, "update_units": 0.1, "siblings_max": 0.5, "carried_in": None}) == 1.0
    assert noise_share({**sib, "update_units": 0.0, "siblings_max": 0.0, "carried_in": 0.0}) == 1.0
    one = {"judged_against": "siblings", "siblings": 1, "update_units": 0.0073, "siblings_max": 3e-7}
    assert noise_share(one) == 1.0  # set 2's qmoe_flip (tensor): a router and its one sibling
    assert noise_share({**one, "judged_against": "parameters", "siblings": 20}) == 1.0

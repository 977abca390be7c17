"""The update-differs rule (analysis/steps.py `update_differs`): updates that differ from the reference's by a
sixteenth of themselves or more, per element, while their gradients agree and the update sizes do not move (an
adaptive optimizer's update after gradient clipping at another norm: Adamax's lr m/u, Adam's m/sqrt(v), mix the
rescaled gradient with the earlier ones, so each element moves by its own factor), on small real dump pairs in
both dump modes."""

from __future__ import annotations

import numpy as np
import pytest
from test_noise import MODES
from test_steps import N_PARAMS, _pair, _run, _runs, _table

from dumpstore.analysis import steps

# half of each parameter's elements moved (1 + UP) as far, half (1 - DOWN): the update's norm kept (UP and DOWN
# solve (1 + UP)^2 + (1 - DOWN)^2 = 2), its elements moved by sqrt((UP^2 + DOWN^2) / 2) = 0.164 of the update
UP = 0.15
DOWN = 1 - float(np.sqrt(2 - (1 + UP) ** 2))


def _rescaled(masks, at: int = 2):
    def change(step, i, q, g):
        if step < at:
            return q
        return q - 0.01 * g * np.where(masks[i], UP, -DOWN)  # on top of the update after step at - 1 (-0.01 g)

    return change


def _masks():
    return [np.random.default_rng(22 + i).permutation(64).reshape(8, 8) < 32 for i in range(N_PARAMS)]


@pytest.mark.parametrize("mode", MODES)
def test_updates_rescaled_per_element_with_their_norms_kept_are_the_optimizer(dump_writer, store_dir, mode):
    x, params, grads = _runs(np.random.default_rng(21))
    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 3), _run(x, params, grads, 3, _rescaled(_masks())))
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.metric) == ("optimizer", 2, "update_units")
    assert c.evidence["unexplained"] == c.evidence["parameters"] == N_PARAMS
    # the statistics lower bound of the gap (its mean and extremes: the update's norm did not move), the same in
    # both dump modes: over UPDATE_X_MIN, under the quarter of an update the rule asked before
    assert c.evidence["median_update_units"] == pytest.approx(0.12926, abs=1e-5)
    assert steps.UPDATE_X_MIN < c.evidence["median_update_units"] < steps.X_MIN
    assert c.evidence["median_carried_in"] == pytest.approx(5.275e-6, rel=1e-3)  # fp32 rounding of the parameter
    assert "6 of 6 parameters differ from the reference by 0.129 of their own update (median)" in c.detail
    # the update before (steps 0 to 1) agreed: the floor is UPDATE_X_MIN
    assert (c.evidence["floor"], c.evidence["previous_update_units"]) == (steps.UPDATE_X_MIN, 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_the_same_rescaling_at_the_pairs_first_update_is_judged_at_a_quarter_update(dump_writer, store_dir, mode):
    """At the first update no earlier update measures the pair's optimizer noise, and Adam's first update (lr
    sign(g) per element) is where device noise flips whole elements: the floor is X_MIN, over the 0.129 here."""
    x, params, grads = _runs(np.random.default_rng(21))
    tgt = _run(x, params, grads, 2, _rescaled(_masks(), at=1))
    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 2), tgt)
    assert v.culprit is None


def test_updates_differ_from_a_sixteenth_of_an_update_on():
    assert steps.UPDATE_X_MIN == 0.0625
    found = steps.update_differs(_table([0.07, 0.1, 0.2, 0.16]))
    assert found == {"parameters": 4, "unexplained": 4, "median_update_units": 0.13, "median_carried_in": 1e-3}
    assert steps.update_differs(_table([0.06, 0.06, 0.06, 0.06])) is None  # a median under UPDATE_X_MIN


def test_updates_differ_where_most_parameters_moved_beyond_their_explanation():
    """A hyperparameter that acts on some tensors only (Lion's betas on those whose gradient changed sign, a
    weight decay on those with a norm) leaves the others explained: more than half beyond is enough, the floor on
    the median x is the evidence."""
    assert steps.UPDATE_SHARE == 0.5
    explained = [0.0, 0.0, 0.0, 1.0, 1.0]  # x_prev: the last two carried in more than they moved
    found = steps.update_differs(_table([0.1, 0.15, 0.2, 0.12, 0.3], x_prev=explained))
    assert found is not None and (found["parameters"], found["unexplained"]) == (5, 3)
    assert found["median_update_units"] == 0.15
    # half of them beyond: no majority
    assert steps.update_differs(_table([0.1, 0.15, 0.2, 0.3], x_prev=[0.0, 0.0, 1.0, 1.0])) is None


@pytest.mark.parametrize("mode", MODES)
def test_the_floor_of_a_later_update_is_the_pairs_own_update_noise_before_it(dump_writer, store_dir, mode):
    """Device noise that flipped 5 % of the first update's elements (Adam's lr sign(g)): the update before step 2
    reads that noise, and the floor of the update between steps 1 and 2 is STAND_OUT x its median x."""
    from dumpstore import open_store
    from dumpstore.analysis import compare_runs
    from dumpstore.analysis._divergence import _ordered
    from dumpstore.analysis.culprit import _StepView
    from dumpstore.analysis.noise import STAND_OUT
    from dumpstore.analysis.updates import update_floor

    x, params, grads = _runs(np.random.default_rng(23))
    flips = [np.random.default_rng(24 + i).random(size=(8, 8)) < 0.05 for i in range(N_PARAMS)]

    def flipped(step, i, q, g):  # the first update moved the flipped elements the other way
        return q + 2 * 0.01 * g * flips[i] if step >= 1 else q

    _pair(dump_writer, store_dir, mode, _run(x, params, grads, 3), _run(x, params, grads, 3, flipped))
    cmp = compare_runs(open_store(store_dir), "target", "ref")
    rows = _ordered(cmp.rows, cmp.records)
    step_rows = _StepView(rows, 2).rows
    weights = step_rows.filter(step_rows["index_path"] == "1")
    t = steps.table(rows, 0, 1, weights)
    prev = float(np.median(t["x"].to_numpy()))
    # the statistics bound of the flips' gap (its mean: the update's norm did not move), both dump modes alike
    assert prev == pytest.approx(0.375, abs=1e-5)
    assert STAND_OUT * prev > steps.UPDATE_X_MIN  # the noise sets the floor, not UPDATE_X_MIN
    assert update_floor(rows, 1, weights) == (STAND_OUT * prev, prev)
    assert update_floor(rows, 0, weights) == (steps.X_MIN, None)  # the first update: nothing before it


@pytest.mark.parametrize("mode", MODES)
def test_the_screened_path_judges_a_later_update_against_the_update_before_it(dump_writer, store_dir, mode):
    """A run too large for one batch is screened, and each step with a finding is compared with its context: the
    step before (the update into it) and the one before that (the update before, which sets the floor of a later
    update, analysis/updates.py): the rescaling at step 2 is found there as in one batch, at UPDATE_X_MIN, not at
    the first update's X_MIN (0.129 < 0.25)."""
    from dumpstore import open_store
    from dumpstore.analysis._divergence import divergence_by_steps

    x, params, grads = _runs(np.random.default_rng(21))
    _pair(dump_writer, store_dir, mode, _run(x, params, grads, 3), _run(x, params, grads, 3, _rescaled(_masks())))
    st = open_store(store_dir)
    whole = divergence_by_steps(st, "target", "ref").culprit
    screened = divergence_by_steps(st, "target", "ref", max_rows=1).culprit
    assert whole is not None and (whole.kind, whole.step, whole.metric) == ("optimizer", 2, "update_units")
    assert screened == whole
    assert screened.evidence["floor"] == steps.UPDATE_X_MIN


def _nudged(masks, up: float, first: int = 2):
    """From the update after step `first` - 1 on: half of each parameter's elements moved (1 + up) as far, half
    less, each update's norm kept (as UP and DOWN above), every later update alike (an eps, a momentum: the same
    rule at every update from there)."""
    down = 1 - float(np.sqrt(2 - (1 + up) ** 2))

    def change(step, i, q, g):
        return q - 0.01 * g * np.where(masks[i], up, -down) * max(0, step - first + 1)

    return change


@pytest.mark.parametrize("mode", MODES)
def test_a_later_update_far_beyond_its_explanation_differs_under_a_sixteenth(dump_writer, store_dir, mode):
    """Every element's update moved by 2 % from the second update on: the gap reads a fraction of UPDATE_X_MIN,
    but fp32 rounding of the parameters explains a millionth of an update and the update before agreed: every
    parameter is some 2600 times beyond its explanation (UNEXPLAINED and STAND_OUT x the update before's).
    (Here the update sizes' statistics move too, and the ratio rule, which runs first, names it as well.)"""
    from dumpstore import open_store
    from dumpstore.analysis import compare_runs
    from dumpstore.analysis._divergence import _ordered
    from dumpstore.analysis.culprit import _StepView
    from dumpstore.analysis.updates import UNEXPLAINED, updates_differ

    x, params, grads = _runs(np.random.default_rng(21))
    v = _pair(
        dump_writer, store_dir, mode, _run(x, params, grads, 3), _run(x, params, grads, 3, _nudged(_masks(), 0.02))
    )
    assert v.culprit is not None and (v.culprit.kind, v.culprit.step) == ("optimizer", 2)
    cmp = compare_runs(open_store(store_dir), "target", "ref")
    rows = _ordered(cmp.rows, cmp.records)
    step_rows = _StepView(rows, 2).rows
    weights = step_rows.filter(step_rows["index_path"] == "1")
    ev = updates_differ(rows, 1, weights, steps.table(rows, 1, 2, weights))
    assert ev is not None and ev["unexplained"] == ev["parameters"] == N_PARAMS
    assert ev["median_update_units"] < steps.UPDATE_X_MIN == ev["floor"]
    # the same in both dump modes: the statistics bounds of gap and explanation (fp32 rounding of the weights)
    assert ev["over_explanation"] == pytest.approx(2644.15, rel=1e-5) and ev["previous_over_explanation"] == 0.0
    assert ev["explanation_bar"] == UNEXPLAINED == 16


@pytest.mark.parametrize("mode", MODES)
def test_the_same_change_at_every_update_is_explained_by_the_gap_it_carried_in(dump_writer, store_dir, mode):
    """The same 2 % from the first update on: at the pair's first update the floor is X_MIN, and the later update
    carries the first one's gap in: within a few times its explanation (and under STAND_OUT x the update
    before's median x, the later floor), quiet."""
    x, params, grads = _runs(np.random.default_rng(21))
    tgt = _run(x, params, grads, 3, _nudged(_masks(), 0.02, first=1))
    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 3), tgt)
    assert v.culprit is None

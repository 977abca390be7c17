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
from dumpstore.analysis import compare_runs, divergence, param_change, param_gaps, steps
from dumpstore.analysis.tolerance import Tolerances


def _steps(x, params, grads, steps_: int, lr: float = 0.01, noise=None, edit=None) -> list[dict]:
    """Steps of N_PARAMS linear records: parameter i at step s is p_i - s * lr * g_i, moved by `noise`, then
    `edit(step, qs)` changes the list of parameters in place."""
    out = []
    for step in range(steps_):
        qs = [_t(p - step * lr * g) for p, g in zip(params, grads)]
        if noise is not None:
            qs = [_t(noise(step, i, q, g)) for i, (q, g) in enumerate(zip(qs, grads))]
        if edit is not None:
            edit(step, qs)
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

    def copy(step, qs):
        if step == 1:
            qs[4] = qs[3].copy()

    ref = _steps(x, params, grads, 2)
    target = _steps(x, params, grads, 2, noise=_noise(31), edit=copy)
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


def test_within_its_tolerance_a_parameter_is_changed_where_every_other_update_is_reproduced():
    """Within its tolerance and two updates, a parameter is named (x >= X_MIN, beyond its explanation and its
    siblings) where every other parameter of the step, at least MIN_MEASURED, is within STAND_OUT x (what it
    carried in + one rounding of itself): the runs computed the same updates, so no noise reached an update
    that an optimizer's per-element normalisation could flip."""
    within = ["pass"] * 5
    kinds = ["conv|1|32x48", "linear|1|8x8", "linear|1|8x8", "linear|1|8x8", "linear|1|8x8"]
    quiet = [2e-6, 1e-6, 2.9e-5, 1.2e-6]  # each within 3 x one rounding of itself, 1e-5 (x_round)
    c = steps.corrupted(_table([0.963, *quiet], status=within, klass=kinds, g_prev=[0.0] * 5, x_round=[1e-5] * 5))
    assert c == {
        100: {
            "update_units": 0.963,
            "carried_in": 1e-5,
            "judged_against": "parameters",
            "siblings": 4,
            "siblings_max": 2.9e-5,
            "step_agrees": True,
        }
    }
    # one other parameter 3.1e-5 apart: beyond 3 roundings, the runs' updates differ (the two-update bar applies)
    assert steps.corrupted(_table([0.963, 2e-6, 1e-6, 3.1e-5, 1.2e-6], status=within, klass=kinds)) == {}
    # ... unless it carried that in (x_prev 1e-5: 3 x (1e-5 + 1e-5) = 6e-5)
    carried = [0.0, 0.0, 0.0, 1e-5, 0.0]
    t = _table([0.963, 2e-6, 1e-6, 3.1e-5, 1.2e-6], status=within, klass=kinds, x_prev=carried)
    assert list(steps.corrupted(t)) == [100]
    # a parameter whose own rounding is 0 (a bias that started at zero) agrees only where it did not move
    t = _table([0.963, 2e-6, 1e-6, 0.0, 1.2e-6], status=within, klass=kinds, x_round=[1e-5, 1e-5, 1e-5, 0.0, 1e-5])
    assert list(steps.corrupted(t)) == [100]
    t = _table([0.963, 2e-6, 1e-6, 1e-9, 1.2e-6], status=within, klass=kinds, x_round=[1e-5, 1e-5, 1e-5, 0.0, 1e-5])
    assert steps.corrupted(t) == {}
    # under X_MIN: not named (qmoe_clean's router, Adam noise at x = 0.0073)
    assert steps.corrupted(_table([0.0073, 2e-6, 1e-6, 1e-6, 1e-6], status=within, klass=kinds)) == {}
    # fewer than MIN_MEASURED other parameters: no measure of the step
    assert steps.corrupted(_table([0.963, 2e-6, 1e-6], status=within[:3], klass=kinds[:3])) == {}


def test_another_call_of_a_parameter_without_siblings_is_not_one_of_the_other_parameters():
    """A tensor of its own kind read by two calls of its module (micro-batches) is judged against the other
    tensors, not against its own second call."""
    records = ["Module.embed.Embedding.forward.0", "Module.embed.Embedding.forward.1"]
    records += [f"Module.layers.{i}.fc.Linear.forward.0" for i in range(2)]
    kinds = ["embedding|1|96x8", "embedding|1|96x8", "linear|1|8x8", "linear|1|8x8"]
    t = _table([1.2, 1.2, 0.01, 0.02], records=records, fps=[100, 100, 101, 102], klass=kinds)
    assert steps.corrupted(t)[100]["judged_against"] == "parameters"
    assert steps.corrupted(t)[100]["siblings"] == 2 and steps.corrupted(t)[100]["siblings_max"] == 0.02


def test_a_sign_flip_within_two_updates_is_named_where_the_steps_updates_agree(dump_writer, store_dir):
    """Statistics mode, a loose tolerance (a bfloat16 autocast floor over float32 master weights): the two runs'
    updates agree exactly (step 0 the same in both); one small element's sign flipped in parameter 3 before
    step 1 moves it within its tolerance and by under two updates, where no other parameter moved at all."""
    rng = np.random.default_rng(40)
    x, params, grads = _runs(rng)
    at = np.unravel_index(np.argmin(np.abs(np.abs(params[3]) - 2e-3)), params[3].shape)

    def flip(step, qs):
        if step == 1:
            qs[3][at] = -qs[3][at]

    ref, target = _steps(x, params, grads, 2, lr=1e-3), _steps(x, params, grads, 2, lr=1e-3, edit=flip)
    st = _ingest_pair(dump_writer, store_dir, "statistics", ref, target, steps=2)
    _mark_parameters(st, store_dir)
    cmp = compare_runs(open_store(store_dir), "target", "ref", tolerances=Tolerances.parse(["float32=2e-2"]))
    c = divergence(cmp).culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    assert c.evidence["update_units"] == pytest.approx(0.9715, abs=1e-4)  # under STAND_OUT x UPDATES_APART = 6
    assert c.evidence["step_agrees"] is True
    assert "within its tolerance" in c.detail


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_whose_rows_were_permuted_is_named_from_its_sketches(dump_writer, store_dir, mode):
    """Parameter 4's rows 1 and 2 swapped before step 1 (a checkpoint ordering a router's experts otherwise):
    every statistic of the weight, and of its linear's output, is what it was.  With tensors, the weight's
    sketches at both steps in both runs measure its gap and the reference's update as the tensor's own
    norms: named at its consumer, thousands of updates off.  With statistics nothing shows it (docs/how-it-decides.md,
    section 10)."""
    x, params, grads = _runs(np.random.default_rng(30))

    def swap(step, qs):
        if step == 1:
            qs[4] = qs[4][[0, 2, 1, 3, 4, 5, 6, 7]].copy()

    ref = _steps(x, params, grads, 2)
    target = _steps(x, params, grads, 2, noise=_noise(31), edit=swap)
    st = _ingest_pair(dump_writer, store_dir, mode, ref, target, steps=2)
    _mark_parameters(st, store_dir)
    c = _verdict(open_store(store_dir)).culprit
    if mode == "statistics":
        assert c is None
        return
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.4.forward")
    assert c.evidence["judged_against"] == "siblings" and c.evidence["siblings"] == N_PARAMS - 1
    # the rows' distance in the reference's update (8 elements of 0.01 each row): exact, from the sketches
    p = params[4] - 0.01 * grads[4]
    gap = np.sqrt(2) * np.linalg.norm(p[1] - p[2])
    assert c.evidence["update_units"] == pytest.approx(gap / np.linalg.norm(0.01 * grads[4]), rel=1e-3)
    assert c.evidence["siblings_max"] < 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_two_parameters_that_swapped_values_are_named_at_the_first_ones_consumer(dump_writer, store_dir, mode):
    """Parameters 3 and 4 (one kind: each the other's sibling) exchanged before step 1 (a conversion reading a
    fused matrix's halves in the wrong order).  Each is thousands of updates off, and each one's x excused the
    other's as the optimizer's noise on that kind of tensor: nothing was named.  Each target holds the other's
    reference values, so neither is the other's noise: named at parameter 3's consumer, against its other
    siblings.  The same pair without the swap is quiet."""
    x, params, grads = _runs(np.random.default_rng(32))

    def swap(step, qs):
        if step == 1:
            qs[3], qs[4] = qs[4].copy(), qs[3].copy()

    ref = _steps(x, params, grads, 2)
    st = _ingest_pair(dump_writer, store_dir, mode, ref, _steps(x, params, grads, 2, noise=_noise(33)), steps=2)
    _mark_parameters(st, store_dir)
    assert _verdict(open_store(store_dir)).culprit is None
    target = _steps(x, params, grads, 2, noise=_noise(33), edit=swap)
    st = _ingest_pair(dump_writer, store_dir, mode, ref, target, steps=2)
    _mark_parameters(st, store_dir)
    c = _verdict(open_store(store_dir)).culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    assert c.evidence["holds"] == "Functional.linear.4.forward 1"  # its input 1, the weight
    assert c.evidence["holds_gap"] < 1e-3 and c.evidence["update_units"] > 10
    if mode == "tensor":  # the two weights' distance in the reference's update, exact from the sketches
        p3, p4 = params[3] - 0.01 * grads[3], params[4] - 0.01 * grads[4]
        assert c.evidence["update_units"] == pytest.approx(np.linalg.norm(p4 - p3) / 0.08, rel=1e-3)
    assert c.evidence["siblings"] == N_PARAMS - 2 and c.evidence["siblings_max"] < 1e-3  # parameter 4 left out
    assert "it holds the reference's Functional.linear.4.forward 1" in c.detail and "swapped" in c.detail


def _held(t: list[list[float]], r: list[list[float]], update: float) -> np.ndarray:
    """`param_gaps.held_values` of parameters of one kind whose (max, min, mean, norm) are `t` in the target and
    `r` in the reference at the later step, x their statistics' changed gap in units of `update`."""
    k = len(t)
    both = pl.DataFrame(
        {
            "_record": [f"Module.l{i}.Linear.forward.0" for i in range(k)],
            "_pkey": list(range(k)),
            "rank": [0] * k,
            "shape": [[16]] * k,
            "dtype": ["bfloat16"] * k,
        }
    )

    def side(v: list[list[float]]) -> dict[str, np.ndarray]:
        return {s: np.array([row[j] for row in v]) for j, s in enumerate(("max", "min", "mean", "norm"))}

    ts, rs, n, upd = side(t), side(r), np.full(k, 16.0), np.full(k, update)
    x = steps._changed_gap(ts, rs, rs, rs, n) / upd
    return param_gaps.held_values(both, ts, rs, n, x, upd, None, steps.X_MIN)[0]


def test_a_swap_in_statistics_needs_an_element_and_a_sum_to_match():
    """Two tensors whose statistics are exchanged in the target hold each other's values (inf: an exact match;
    a third of the same kind untouched holds none).  After a first Adam step from ones every such tensor has
    the same max and min (1 +- lr per element), and its mean and norm read one number, its count of signs: two
    such counts exchanged are a coincidence of that number, not a swap (set 8's `fnet_transposed_proj_step0` at
    step 1: two LayerNorm weights 351x nearer each other's statistics than their own)."""
    a, b, c = [0.07, -0.07, 2e-5, 0.92], [0.064, -0.071, 2.8e-4, 0.93], [0.06, -0.05, 1e-4, 0.9]
    held = _held([b, a, c], [a, b, c], 0.01)  # x = 1 (their norms 0.01 apart)
    assert held[0] == held[1] == np.inf and np.isnan(held[2])
    assert np.isnan(_held([b, a, c], [a, b, c], 0.1)).all()  # x = 0.1: under a quarter of an update
    # the extremes alike (an element each), or the sums alike: no match of both kinds
    assert np.isnan(_held([[*a[:2], *b[2:]], [*b[:2], *a[2:]], c], [a, b, c], 0.01)[:2]).all()
    lr = 1e-3

    def counted(m: int) -> list[float]:  # 16 elements 1 +- lr, m more up than down
        return [1 + lr, 1 - lr, 1 + m * lr / 16, float(np.sqrt(16 * (1 + lr * lr) + 2 * lr * m))]

    ones = [counted(m) for m in (2, 4, 6)]
    assert np.isnan(_held([ones[1], ones[0], ones[2]], ones, lr)).all()  # x = 0.5 from the means alone

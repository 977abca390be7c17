"""Parameters after the first step (analysis/steps.py): a parameter changed between steps is named at its first
consumer, an update that differs from what the gradients explain is the optimizer, and the noise an update
carries is neither; on small real dump pairs in both dump modes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from test_noise import MODES, _ingest_pair, _mark_parameters, _t, _verdict
from test_noise_model import _optimizer_rows

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence, steps
from dumpstore.analysis.explain import explain_findings
from dumpstore.analysis.noise import update_evidence
from dumpstore.analysis.tolerance import Tolerances

N_PARAMS = 6


def _runs(rng: np.random.Generator, steps: int = 2):
    x = _t(rng.normal(size=(4, 8)))
    params = [_t(rng.normal(size=(8, 8)) * 0.1) for _ in range(N_PARAMS)]
    grads = [_t(np.sign(rng.normal(size=(8, 8)))) for _ in range(N_PARAMS)]  # Adam-like: updates of +-lr
    return x, params, grads


def _run(x, params, grads, steps: int, change=None) -> list[dict]:
    """Steps of N_PARAMS linear records; parameter i at step s is p_i - s * 0.01 * g_i, then `change(step, i, q)`."""
    out = []
    for step in range(steps):
        recs = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            q = _t(p - step * 0.01 * g)
            if change is not None:
                q = _t(change(step, i, q, g))
            recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, q], "output": [x @ q.T]}
        out.append(recs)
    return out


def _pair(dump_writer, store_dir, mode, ref, target):
    st = _ingest_pair(dump_writer, store_dir, mode, ref, target, steps=len(ref))
    _mark_parameters(st, store_dir)
    return _verdict(open_store(store_dir))


def _noise(seed: int):
    """The target device's update noise: each update moved by 1e-4 of itself (rounding of the gradient)."""
    r = np.random.default_rng(seed)

    def change(step, i, q, g):
        return q + step * 0.01 * g * 1e-4 * r.normal(size=q.shape)

    return change


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_changed_between_steps_is_named_at_its_first_consumer(dump_writer, store_dir, mode):
    x, params, grads = _runs(np.random.default_rng(10))
    noise = _noise(11)
    flip = np.random.default_rng(12).random(size=(8, 8)) < 0.2

    def corrupt(step, i, q, g):
        q = noise(step, i, q, g)
        return np.where(flip, -q, q) if (step == 1 and i == 3) else q  # signs flipped in parameter 3 at step 1

    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 2), _run(x, params, grads, 2, corrupt))
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    assert c.evidence["judged_against"] == "siblings" and c.evidence["siblings"] == N_PARAMS - 1
    assert c.evidence["update_units"] > 100 * c.evidence["siblings_max"]
    assert "of its own update at this step (its siblings at most" in c.detail
    advice = explain_findings(open_store(store_dir), v)["culprit"].advice
    assert advice.startswith("Functional.linear.3.forward.input.1 agrees before this step and differs after it")


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_without_siblings_is_judged_against_every_other_parameter(dump_writer, store_dir, mode):
    """Siblings are the same op's parameter of the same shape; a tensor of its own shape has none and is judged
    against the largest difference of every other parameter of the step."""
    rng = np.random.default_rng(13)
    x, params, grads = _runs(rng)
    params[3], grads[3] = _t(rng.normal(size=(5, 8)) * 0.1), _t(np.sign(rng.normal(size=(5, 8))))
    noise = _noise(14)

    def corrupt(step, i, q, g):
        q = noise(step, i, q, g)
        return -q if (step == 1 and i == 3) else q

    ref = _run(x, params, grads, 2)
    v = _pair(dump_writer, store_dir, mode, ref, _run(x, params, grads, 2, corrupt))
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    assert c.evidence["judged_against"] == "parameters" and c.evidence["siblings"] == N_PARAMS - 1
    assert "(its other parameters at most" in c.detail


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_changed_on_one_rank_is_judged_against_its_copies_on_the_others(dump_writer, store_dir, mode):
    """Data parallel: each rank holds the same parameters; one rank's copy written to between the steps stands
    out of its copies (its siblings on the other ranks), with no other layer of its kind."""
    rng = np.random.default_rng(19)
    x, params, grads = _runs(rng)
    params, grads = params[:1], grads[:1]  # one parameter of its kind per rank
    flip = np.random.default_rng(20).random(size=(8, 8)) < 0.2
    for name in ("ref", "target"):
        w = dump_writer(name, mode)
        for rank in range(3):
            noise = _noise(21 + rank) if name == "target" else None
            hit = name == "target" and rank == 2  # this rank's copy is written to before step 1

            def change(step, i, q, g, noise=noise, hit=hit):
                q = noise(step, i, q, g) if noise else q
                return np.where(flip, -q, q) if (hit and step == 1) else q

            for step, recs in enumerate(_run(x, params, grads, 2, change)):
                w.write(recs, step=step, rank=rank)
        ingest(w.root, name, store=store_dir, jobs=1)
    _mark_parameters(open_store(store_dir), store_dir)
    c = _verdict(open_store(store_dir)).culprit
    assert c is not None and (c.kind, c.step, c.rank, c.op) == ("parameter", 1, 2, "Functional.linear.0.forward")
    assert c.evidence["judged_against"] == "siblings" and c.evidence["siblings"] == 2


def test_a_parameter_changed_within_its_tolerance_is_named_at_its_first_consumer(dump_writer, store_dir):
    """Statistics mode, a loose tolerance (as a bfloat16 autocast floor makes it): one element's sign flipped in
    parameter 3 before step 1 moves its statistics by 1.06 % of its norm, within the 2 % tolerance, but by 81 of
    its own update (updates of 1e-4 per element; their statistics bound), where no two updates can put more than
    2 between the runs."""
    x, params, grads = _runs(np.random.default_rng(10))
    at = np.unravel_index(np.argmin(np.abs(np.abs(params[3]) - 0.03)), params[3].shape)
    noise = _noise(11)

    def run(corrupt: bool) -> list[dict]:
        out = []
        for step in range(2):
            recs = {}
            for i, (p, g) in enumerate(zip(params, grads)):
                q = _t(p - step * 1e-4 * g)
                if corrupt:
                    q = _t(noise(step, i, q, g * 1e-2))
                    if step == 1 and i == 3:
                        q[at] = -q[at]
                recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, q], "output": [x @ q.T]}
            out.append(recs)
        return out

    st = _ingest_pair(dump_writer, store_dir, "statistics", run(False), run(True), steps=2)
    _mark_parameters(st, store_dir)
    cmp = compare_runs(open_store(store_dir), "target", "ref", tolerances=Tolerances.parse(["float32=2e-2"]))
    c = divergence(cmp).culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    weight = cmp.rows.filter((pl.col("step") == 1) & (pl.col("name") == "Functional.linear.3.forward.input.1"))
    assert weight["status"].to_list() == ["pass"]  # within its tolerance
    assert weight["err"].to_list() == [pytest.approx(0.01064, abs=1e-5)]
    assert c.evidence["update_units"] == pytest.approx(80.56, abs=0.01)
    assert c.evidence["siblings_max"] < 1e-3
    assert "of its own update at this step, within its tolerance" in c.detail


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_changed_by_under_a_quarter_update_is_named_where_its_consumer_confirms_it(
    dump_writer, store_dir, mode
):
    """Statistics mode: every update moves its parameter's mean (an update of +-0.01 per element, mostly one
    way); one element's sign flipped in parameter 3 before step 1 keeps its norm, max and min and moves its mean
    by 0.135 of an update, under X_MIN, 4800x its siblings.  Its consumer's output is off 0.011 beyond what its
    inputs' measured errors carry, on agreeing activations, where the pair's fresh ops reach 6e-6: named.  With
    tensors the weight's sketches measure the flip itself: 1.08 updates (an element of about 0.043 negated:
    0.086 apart, against an update of norm 0.01 x 8 = 0.08), named outright."""
    rng = np.random.default_rng(10)
    x = _t(rng.normal(size=(4, 8)))
    params = [_t(rng.normal(size=(8, 8)) * 0.1) for _ in range(N_PARAMS)]
    grads = [_t(np.ones((8, 8))) for _ in range(N_PARAMS)]
    noise = _noise(11)
    at = np.unravel_index(np.argmin(np.abs(params[3] - 0.05)), params[3].shape)

    def corrupt(step, i, q, g):
        q = noise(step, i, q, g * np.random.default_rng(step * 10 + i).choice([-1, 1], size=g.shape))
        if step == 1 and i == 3:
            q = q.copy()
            q[at] = -q[at]
        return q

    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 2), _run(x, params, grads, 2, corrupt))
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Functional.linear.3.forward")
    if mode == "tensor":
        assert c.evidence["update_units"] == pytest.approx(1.0795, abs=1e-4)
        assert "needs_consumer" not in c.evidence and "consumer_err" not in c.evidence
        return
    assert c.evidence["update_units"] == pytest.approx(0.1349, abs=1e-4)
    assert c.evidence["consumer_err"] == pytest.approx(0.01102, abs=1e-5)
    assert "needs_consumer" not in c.evidence
    assert "under a quarter of an update, confirmed by this op's output" in c.detail


@pytest.mark.parametrize("mode", MODES)
def test_updates_that_differ_from_what_their_gradients_explain_are_the_optimizer(dump_writer, store_dir, mode):
    """Clipping at another norm under Adam rescales each element's update differently: every parameter differs
    from the reference by a sizeable part of its update, with update sizes alike (no common ratio)."""
    x, params, grads = _runs(np.random.default_rng(15))
    flips = [np.random.default_rng(16 + i).random(size=(8, 8)) < 0.5 for i in range(N_PARAMS)]

    def clipped(step, i, q, g):  # half of the elements moved the other way at the update after step 1
        return q + 2 * 0.01 * g * flips[i] if step == 2 else q

    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 3), _run(x, params, grads, 3, clipped))
    c = v.culprit
    assert c is not None and (c.kind, c.step) == ("optimizer", 2)
    assert c.evidence["unexplained"] == c.evidence["parameters"] == N_PARAMS
    assert c.evidence["median_update_units"] > 0.25 and c.evidence["median_carried_in"] < 1e-4  # fp32 rounding
    assert "of their own update (median) between steps 1 and 2" in c.detail


@pytest.mark.parametrize("mode", MODES)
def test_update_noise_is_neither_a_changed_parameter_nor_the_optimizer(dump_writer, store_dir, mode):
    x, params, grads = _runs(np.random.default_rng(17))
    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 3), _run(x, params, grads, 3, _noise(18)))
    assert v.culprit is None


def _table(x, status=None, klass=None, x_prev=None, g_prev=None, x_round=None, records=None, fps=None) -> pl.DataFrame:
    n = len(x)
    return pl.DataFrame(
        {
            "_record": records or [f"Functional.linear.{i}.forward" for i in range(n)],
            "rank": [0] * n,
            "_fp_t": fps or list(range(100, 100 + n)),
            "status": status or ["diverged"] * n,
            "klass": klass or ["linear|1|8x8"] * n,
            "x": x,
            "x_changed": x,
            "x_prev": x_prev or [0.0] * n,
            "g_prev": g_prev or [1e-3] * n,
            "x_round": x_round or [1e-5] * n,
        },
        schema_overrides={"g_prev": pl.Float64},
    )


def test_a_changed_parameter_needs_its_tolerance_a_quarter_update_and_three_times_its_siblings():
    noise = [0.01, 0.02, 0.015, 0.012]
    assert list(steps.corrupted(_table([0.3, *noise]))) == [100]
    assert steps.corrupted(_table([0.3, *noise]))[100] == {
        "update_units": 0.3,
        "carried_in": 1e-3,
        "judged_against": "siblings",
        "siblings": 4,
        "siblings_max": 0.02,
    }
    assert steps.corrupted(_table([0.3, *noise], status=["pass"] * 5)) == {}  # within its tolerance: rounding
    # under X_MIN: named only where its consumer confirms it (analysis/culprit.py `_consumer_confirms`)
    assert steps.corrupted(_table([0.2, *noise]))[100]["needs_consumer"] is True
    assert "needs_consumer" not in steps.corrupted(_table([0.3, *noise]))[100]
    assert steps.corrupted(_table([0.3, 0.11, 0.02, 0.015, 0.012])) == {}  # a sibling at 0.11: 0.3 < 3 x 0.11
    assert steps.corrupted(_table([0.3, *noise], x_prev=[0.2, *noise])) == {}  # carried in from step b
    # its siblings are of its own kind; another kind's larger noise does not hide it
    other = ["linear|1|8x8", "linear|1|8x8", "linear|1|8x8", "embedding|1|96x8", "embedding|1|96x8"]
    assert list(steps.corrupted(_table([0.3, 0.02, 0.01, 0.5, 0.4], klass=other))) == [100]


def test_a_parameter_fed_a_gradient_of_rounding_residue_is_not_judged_in_its_update():
    """Dev 1 `dx_clean_tensor` (a TF32 device, SGD, no fault): layer 1's attention key bias has a gradient of
    rounding residue, norm 2e-6 in the target against 1.4e-9 in the reference (judged on its record's scale:
    1.7e-4), so the target's update is some 1400 of the reference's.  Measured from its sketches the bias is
    10701 of the reference's update apart at step 2 (3086 carried in, one rounding 2580): beyond its
    explanation, its siblings and two updates.  Its update is no unit the runs share: not judged."""
    sizes = dict(status=["pass"] * 3, x_prev=[3086.0, 8e-4, 5e-4], x_round=[2580.0, 1e-4, 1e-4])
    t = _table([10701.0, 0.0015, 0.001], g_prev=[1.66e-4, 7e-4, 7e-4], **sizes)
    assert list(steps.corrupted(t)) == [100]
    assert steps.corrupted(t.with_columns(pl.Series("g_residue", [True, False, False]))) == {}
    assert list(steps.corrupted(t.with_columns(pl.Series("g_residue", [False, True, False])))) == [100]


def test_a_parameter_within_its_tolerance_is_changed_beyond_what_two_updates_can_put_between_the_runs():
    """Two runs' updates put at most both of them between the runs (UPDATES_APART = 2), on top of what they
    carried in: within its tolerance, a parameter is named beyond STAND_OUT x that (6 updates here).  (Another
    kind of parameter moved by 1.5 updates: the step's noise reaches whole updates, so the step's own measure,
    tests/test_param_change.py, gives no lower bar.)"""
    noise = [0.01, 0.02, 0.015, 1.5]
    kinds = ["linear|1|8x8"] * 4 + ["embedding|1|96x8"]
    within = ["pass"] * 5
    assert steps.corrupted(_table([6.1, *noise], status=within, klass=kinds))[100]["update_units"] == 6.1
    assert steps.corrupted(_table([5.9, *noise], status=within, klass=kinds)) == {}  # two updates, with the margin
    x_prev = [0.1, 0.01, 0.02, 0.015, 0.012]
    assert steps.corrupted(_table([6.1, *noise], status=within, klass=kinds, x_prev=x_prev)) == {}  # 6.1 < 3 x 2.1
    assert steps.corrupted(_table([6.1, 2.1, 0.02, 0.015, 0.012], status=within)) == {}  # 6.1 < 3 x its sibling


def test_another_call_of_the_same_module_is_not_its_own_sibling():
    """Micro-batches: one parameter read by two calls of its module (`fc1.Linear.forward.0` and `.forward.1`) is
    one tensor; its second call is not a sibling that makes it look like noise."""
    records = [
        "Module.layers.0.fc1.Linear.forward.0",
        "Module.layers.0.fc1.Linear.forward.1",
        "Module.layers.1.fc1.Linear.forward.0",
        "Module.layers.1.fc1.Linear.forward.1",
    ]
    t = _table([1.04, 1.04, 0.007, 0.007], records=records, fps=[100, 100, 101, 101])
    assert steps.corrupted(t) == {
        100: {
            "update_units": 1.04,
            "carried_in": 1e-3,
            "judged_against": "siblings",
            "siblings": 2,
            "siblings_max": 0.007,
        }
    }


def test_updates_differ_when_most_parameters_are_beyond_their_explanation_by_a_quarter_update():
    assert steps.update_differs(_table([0.3, 0.4, 0.35, 0.5])) == {
        "parameters": 4,
        "unexplained": 4,
        "median_update_units": 0.375,
        "median_carried_in": 1e-3,
    }
    assert steps.update_differs(_table([0.2, 0.2, 0.2, 0.2]), steps.X_MIN) is None  # a median under the floor
    explained = steps.update_differs(_table([0.3, 0.4, 0.35, 0.5], g_prev=[0.2, 0.2, 1e-3, 1e-3]))
    assert explained is None  # 2 of 4 explained by their gradients: under OPT_SHARE
    assert steps.update_differs(_table([0.3, 0.4])) is None  # fewer than MIN_MEASURED parameters


def _decayed(rate: float, noise):
    """The target's parameters after each update pulled toward zero by `rate` more than the reference's: a weight
    decay changed by rate / lr (decoupled, AdamW: p -= lr wd p; coupled, SGD: the same term through the
    gradient), on top of the device's update noise."""

    def change(step, i, q, g):
        q = noise(step, i, q, g)
        return q * (1 - rate) ** max(step - 1, 0)  # from the second update (after step 1) on

    return change


@pytest.mark.parametrize("mode", MODES)
def test_every_parameter_moved_in_proportion_to_itself_is_a_weight_decay_change(dump_writer, store_dir, mode):
    """Weight decay 0.035 instead of 0.01 at lr 2e-3: every norm 5e-5 smaller, within the float32 tolerance (no
    parameter over it: the update-ratio rule does not run), far beyond the norm gaps' own spread."""
    x, params, grads = _runs(np.random.default_rng(30))
    change = _decayed(5e-5, _noise(31))
    v = _pair(dump_writer, store_dir, mode, _run(x, params, grads, 3), _run(x, params, grads, 3, change))
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.metric) == ("optimizer", 2, "norm_gap")
    assert c.evidence["parameters"] == c.evidence["same_way"] == N_PARAMS
    assert c.evidence["median_norm_gap"] == pytest.approx(-5e-5, rel=0.02)
    assert c.evidence["bar"] < 1e-5
    assert (
        "6 of 6 parameters' norms moved -4.98e-05 (relative, median) from the reference's between steps 1 and 2"
        in c.detail
    )


def _norm_rows(gaps_b: list[float], gaps_a: list[float], dtype: str = "float32") -> tuple[pl.DataFrame, ...]:
    """Parameter leaves of steps 0 and 1 whose target norms are off the reference's (1.0) by the given relative
    gaps, and the parameters of step 1."""
    n = len(gaps_a)
    keys = {"rank": [0] * n, "source": [""] * n, "_record": [f"r{i}" for i in range(n)], "_io": ["parameters"] * n}
    keys["index_path"] = ["weight"] * n
    rows = pl.concat(
        [
            pl.DataFrame({"step": [s] * n, **keys, "norm": [1.0 + g for g in gaps], "ref_norm": [1.0] * n})
            for s, gaps in ((0, gaps_b), (1, gaps_a))
        ]
    ).with_columns(pl.lit(dtype).alias("dtype"))
    return rows, rows.filter(pl.col("step") == 1)


def test_decay_differs_is_a_common_relative_norm_gap_beyond_its_own_spread():
    carried = [1e-5, -2e-5, 0.0, 3e-5, -1e-5, 2e-5]
    shifted = [c - 1.8e-4 + e for c, e in zip(carried, [1e-6, -2e-6, 3e-6, 0.0, -1e-6, 2e-6])]
    rows, params = _norm_rows(carried, shifted)
    ev = steps.decay_differs(rows, 0, 1, params)
    assert ev is not None and (ev["parameters"], ev["same_way"]) == (6, 6)
    assert ev["median_norm_gap"] == pytest.approx(-1.8e-4 + 0.5e-6, abs=1e-12)
    assert ev["spread"] == pytest.approx(1.4826 * 1.5e-6, rel=1e-6)
    # noise: the gaps scatter both ways around 0
    rows, params = _norm_rows(carried, [c + e for c, e in zip(carried, [1e-5, -2e-5, 3e-5, -1e-5, 2e-5, 5e-6])])
    assert steps.decay_differs(rows, 0, 1, params) is None
    # a common gap of one rounding of a bf16 norm: under STAND_OUT x eps(bfloat16)
    rows, params = _norm_rows([0.0] * 6, [-(2.0**-8)] * 6, dtype="bfloat16")
    assert steps.decay_differs(rows, 0, 1, params) is None
    # one parameter changed alone moves no median
    rows, params = _norm_rows([0.0] * 6, [-0.1, 1e-6, -1e-6, 2e-6, 0.0, -2e-6])
    assert steps.decay_differs(rows, 0, 1, params) is None
    # fewer than OPT_MIN_PARAMS parameters
    rows, params = _norm_rows([0.0] * 2, [-1.8e-4] * 2)
    assert steps.decay_differs(rows, 0, 1, params) is None


@pytest.mark.parametrize("mode", MODES)
def test_the_screened_path_judges_the_previous_step_as_context_only(dump_writer, store_dir, mode):
    """The screened path (runs too large for one piece) compares a step with the step before it, for the
    optimizer's earlier step; that context step is not judged again: its weights, over their tolerance by the
    optimizer's noise, are not 'parameters at the first compared step'."""
    from dumpstore.analysis import divergence_by_steps

    x, params, grads = _runs(np.random.default_rng(17))
    r = np.random.default_rng(18)

    def noisy(step, i, q, g):  # weights moved by 1e-4 after each update: over the float32 tolerance, x ~ 0.01
        return q + (1e-4 * r.normal(size=q.shape) if step else 0.0)

    ref, target = _run(x, params, grads, 3), _run(x, params, grads, 3, noisy)
    st = _ingest_pair(dump_writer, store_dir, mode, ref, target, steps=3)
    _mark_parameters(st, store_dir)
    st = open_store(store_dir)
    whole = divergence_by_steps(st, "target", "ref")
    assert whole.culprit is None
    assert whole.counts.get("diverged", 0) > 0  # the weights and outputs of steps 1 and 2 are over their tolerance
    screened = divergence_by_steps(st, "target", "ref", max_rows=1)
    assert screened.culprit is None


@pytest.mark.parametrize("mode", MODES)
def test_a_learning_rate_change_within_every_tolerance_is_the_optimizer(dump_writer, store_dir, mode):
    """Updates proportional to the gradient (SGD; RAdam's first steps, before its variance rectification starts)
    move parameters by far less than Adam's +-lr per element: a learning rate x1.1 from the second update on
    leaves every parameter within its tolerance (5e-5 of its norm under float32's 1.2e-4) and is found by the
    update-size ratio all the same, not after a parameter over its tolerance."""
    rng = np.random.default_rng(21)
    x = _t(rng.normal(size=(4, 8)))
    params = [_t(rng.normal(size=(8, 8)) * 0.1) for _ in range(N_PARAMS)]
    grads = [[_t(rng.normal(size=(8, 8)) * 0.1) for _ in range(N_PARAMS)] for _ in range(2)]

    def run(factor: float) -> list[dict]:
        lrs = [5e-4, 5e-4 * factor]  # the updates after steps 0 and 1
        out = []
        for step in range(3):
            recs = {}
            for i, p in enumerate(params):
                q = _t(p - sum(lrs[s] * grads[s][i] for s in range(step)))
                recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, q], "output": [x @ q.T]}
            out.append(recs)
        return out

    v = _pair(dump_writer, store_dir, mode, run(1.0), run(1.1))
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.metric) == ("optimizer", 2, "update_ratio")
    assert c.value == pytest.approx(1.1, rel=1e-3)
    assert c.evidence["parameters"] == c.evidence["same_way"] == N_PARAMS
    assert (
        f"{N_PARAMS} of {N_PARAMS} parameters moved 1.1x (median) as far as in the reference between steps 1 and 2"
        in c.detail
    )
    rows = compare_runs(open_store(store_dir), "target", "ref").rows
    weights = rows.filter((pl.col("step") == 2) & (pl.col("io") == "input") & (pl.col("index_path") == "1"))
    assert weights.height == N_PARAMS and (weights["status"] != "diverged").all()  # every one within tolerance


@pytest.mark.parametrize("mode", MODES)
def test_one_element_of_adam_noise_at_a_maximum_is_not_a_changed_parameter(dump_writer, store_dir, mode):
    """Adam-like updates (+-lr per element) whose sign the target's noise flipped on 1 % of the elements: every
    parameter differs by 2 sqrt(0.01) = 0.2 of its update.  In parameter 3 the flipped elements include its
    largest, so its max moves by two element updates (0.02): as a share of the update's norm-wise lower bound
    that read 1.39 updates, 9.5x its siblings' 0.146 (a changed parameter); the extremes count only beyond two
    updates of one element (UPDATES_APART x the reference's own max/min move), and the bulk of the tensor
    (norm, mean) reads what every sibling reads."""
    rng = np.random.default_rng(40)
    x = _t(rng.normal(size=(4, 32)))
    params = [_t(rng.normal(size=(32, 32)) * 0.1) for _ in range(N_PARAMS)]
    signs = [_t(np.sign(rng.normal(size=(32, 32)))) for _ in range(N_PARAMS)]
    flips = [rng.random(size=(32, 32)) < 0.01 for _ in range(N_PARAMS)]
    top = np.unravel_index(np.argmax(params[3] - 0.01 * signs[3]), (32, 32))
    flips[3][top] = True  # parameter 3's largest element after the update is among the flipped
    signs[3][top] = 1.0  # moved down by the reference's update (0.01 x sign), up by the target's

    def run(target: bool) -> list[dict]:
        out = []
        for step in range(2):
            recs = {}
            for i, (p, g) in enumerate(zip(params, signs)):
                u = 0.01 * np.where(flips[i], -g, g) if target else 0.01 * g
                q = _t(p - step * u)
                recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, q], "output": [x @ q.T]}
            out.append(recs)
        return out

    v = _pair(dump_writer, store_dir, mode, run(False), run(True))
    assert v.culprit is None
    rows = compare_runs(open_store(store_dir), "target", "ref").rows
    w = rows.filter((pl.col("step") == 1) & (pl.col("record") == "Functional.linear.3.forward"))
    w = w.filter((pl.col("io") == "input") & (pl.col("index_path") == "1")).row(0, named=True)
    assert w["max"] - w["ref_max"] == pytest.approx(0.02, rel=1e-5)  # the largest element, two updates apart


def test_the_gap_a_change_shows_counts_extremes_beyond_two_element_updates():
    """`_changed_gap`: the norm and mean differences in full; the max/min difference only beyond UPDATES_APART x
    the reference update's own max/min move; a reference of norm 0 (a bias starting at zero) by the target's norm."""

    def stats(norm, mean, mx, mn):
        return {k: np.array(v, dtype=float) for k, v in (("norm", norm), ("mean", mean), ("max", mx), ("min", mn))}

    t = stats([1.0, 1.0, 1.0, 0.5], [0.0, 0.0, 0.01, 0.0], [0.5, 0.53, 0.48, 0.1], [-0.5, -0.5, -0.5, -0.1])
    r = stats([1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.48, 0.48, 0.48, 0.0], [-0.5, -0.5, -0.5, 0.0])
    b = stats([1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.49, 0.49, 0.49, 0.0], [-0.5, -0.5, -0.5, 0.0])
    gap = steps._changed_gap(t, r, r, b, np.array([100.0, 100.0, 100.0, 100.0]))
    # 0.02 of max within two moves of 0.01; 0.05 is 0.03 beyond them; a mean 0.01 apart is 0.1 of the norm
    assert gap == pytest.approx([0.0, 0.03, 0.1, 0.5], abs=1e-12)


def test_tied_update_sizes_say_neither_run_moved_further():
    """bf16 statistics round a norm or a max to the same step in both runs: a parameter's two update sizes are then
    equal, a ratio of exactly 1 that says nothing of which run moved further.  Set 3 `bloom_lr_step2` (lr x1.05,
    pure bf16, statistics): 22 of 30 parameters 1.05-1.08x, 8 tied; the share of parameters moved the same way
    (OPT_SHARE) is counted among the 22, the median keeps the ties."""
    ratios = np.array([1.06] * 22 + [1.0] * 8)
    rows, params = _optimizer_rows(ratios)
    ev = update_evidence(rows, 0, 1, params)
    assert ev is not None and ev["differs"]
    assert (ev["parameters"], ev["same_way"], ev["tied"]) == (30, 22, 8)
    assert ev["median_ratio"] == pytest.approx(1.06, rel=1e-3)
    # ties pull the median to 1: a majority of them leaves nothing to find
    rows, params = _optimizer_rows(np.array([1.06] * 12 + [1.0] * 18))
    ev = update_evidence(rows, 0, 1, params)
    assert ev is not None and not ev["differs"] and ev["median_ratio"] == 1.0
    # no ties: no key, and the share over every parameter as before
    rows, params = _optimizer_rows(np.full(30, 1.06))
    ev = update_evidence(rows, 0, 1, params)
    assert ev is not None and ev["differs"] and "tied" not in ev

"""A one-element parameter changed between steps (analysis/steps.py `_table_parameters`, `_exact_update_gap`):
a model's own scalar that no module lists (msprobe's mix level lists a module's own parameters, and the top
model is no record), read directly by an op (CLIP's `logit_scale` through `Tensor.exp`), is measured like a
module's parameter; its statistics are its value, so its own update is known exactly and is judged against
the reference's and that update's sign flip.  Written as real mix-level dump folders, both dump modes."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence, steps
from helpers import leaf

N = 4  # modules with a listed weight each
LR = 1e-3


def _steps(
    rng: np.random.Generator, scalar: list[float], noise: float, dtype: str | None = None
) -> list[dict[str, dict]]:
    """Three steps of N Linear modules (weight listed as the module's parameter, read by its functional linear)
    and a scalar parameter scaling the last output through `Tensor.__mul__` (no module lists it), with its
    backward (output 1: the scalar's gradient, equal in both runs); `noise`: the target device's relative noise
    on every update of the weights; `dtype`: the scalar's declared dtype (statistics mode)."""
    x = rng.normal(size=(3, 8)).astype(np.float32)
    w0 = [rng.normal(size=(8, 8)).astype(np.float32) * 0.1 for _ in range(N)]
    g = [np.sign(rng.normal(size=(8, 8))).astype(np.float32) for _ in range(N)]
    out = []
    for step, s in enumerate(scalar):
        recs: dict[str, dict] = {}
        for i in range(N):
            w = (w0[i] - step * LR * g[i] * (1 + noise * rng.normal(size=(8, 8)))).astype(np.float32)
            y = (x @ w.T).astype(np.float32)
            recs[f"Functional.linear.{i}.forward"] = {
                "input_args": [leaf(x), leaf(w, requires_grad=True)],
                "input_kwargs": {},
                "output": [leaf(y, requires_grad=True)],
            }
            recs[f"Module.l{i}.Linear.forward.0"] = {
                "input_args": [leaf(x)],
                "input_kwargs": {},
                "output": [leaf(y, requires_grad=True)],
                "parameters": {"weight": leaf(w, requires_grad=True)},
            }
            recs[f"Module.l{i}.Linear.parameters_grad.0"] = {"weight": [leaf(g[i])]}
        v = np.array(s, dtype=np.float32)
        z = y  # the last linear's output, scaled by the scalar
        recs["Tensor.__mul__.0.forward"] = {
            "input_args": [leaf(z, requires_grad=True), leaf(v, requires_grad=True, dtype=dtype)],
            "input_kwargs": {},
            "output": [leaf((z * v).astype(np.float32), requires_grad=True)],
        }
        dy = np.full_like(z, 0.01)
        recs["Tensor.__mul__.0.backward"] = {
            "input": [leaf(dy)],
            "output": [leaf((dy * v).astype(np.float32)), leaf(np.array((dy * z).sum(), dtype=np.float32))],
        }
        out.append(recs)
    return out


def _verdict(tmp_path, mode: str, ref: list[dict], target: list[dict]):
    store = tmp_path / "store"
    for name, run in (("ref", ref), ("target", target)):
        for step, data in enumerate(run):
            d = tmp_path / name / f"step{step}" / "rank0"
            d.mkdir(parents=True)
            doc = {"task": mode, "level": "mix", "framework": "pytorch", "dump_data_dir": None, "data": data}
            (d / "dump.json").write_text(json.dumps(doc))
            parents = {f"Functional.linear.{i}.forward": f"Module.l{i}.Linear.forward.0" for i in range(N)}
            (d / "construct.json").write_text(json.dumps(parents))
        ingest(tmp_path / name, name, store=store, jobs=1)
    return divergence(compare_runs(open_store(store), "target", "ref"))


# the reference's scalar: -lr per step (Adam's first steps, Lion: sign); large enough that a flipped update (2 lr
# apart) stays within the float32 tolerance 2^-13, as CLIP's logit_scale reset stayed within its float16 one
INIT = 26.592
REF = [INIT, INIT - LR, INIT - 2 * LR]


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_a_scalar_parameter_no_module_lists_reset_before_step_1_is_named_at_its_consumer(tmp_path, mode):
    ref = _steps(np.random.default_rng(7), REF, noise=0.0)
    target = _steps(np.random.default_rng(7), [INIT, INIT, INIT - LR], noise=0.0)  # reset: step 0's value again
    v = _verdict(tmp_path, mode, ref, target)
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.op) == ("parameter", 1, "Tensor.__mul__.0.forward")
    assert c.evidence["differing"] == "Tensor.__mul__.0.forward.input.1"
    # the target did not move (0) where the reference moved by -lr: off the reference's update and its sign
    # flip (+lr) by one whole update
    assert c.evidence["own_update_off"] == pytest.approx(1.0, rel=1e-3)
    assert c.evidence["update_units"] == pytest.approx(1.0, rel=1e-3)
    assert c.evidence["judged_against"] == "parameters" and c.evidence["siblings"] == 0
    assert "its own update off the reference's and its sign flip by 1 of it" in c.detail


@pytest.mark.parametrize("mode", ["statistics", "tensor"])
def test_a_scalar_whose_update_the_noise_flipped_is_not_a_changed_parameter(tmp_path, mode):
    """Adam's first update is lr * sign(g): noise on a gradient near 0 flips a whole element's update.  The
    scalar then sits two updates from the reference's, as far as the target's reset above is one, and is not a
    change: its own update is the reference's sign flip (`own_update_off` 0)."""
    ref = _steps(np.random.default_rng(7), REF, noise=0.0)
    target = _steps(np.random.default_rng(7), [INIT, INIT + LR, INIT], noise=1e-3)
    v = _verdict(tmp_path, mode, ref, target)
    assert v.culprit is None


def test_the_exact_update_gap_is_measured_only_for_one_element_tensors():
    from dumpstore.analysis.steps import _exact_update_gap

    def side(*vals):
        a = np.array(vals, dtype=float)
        return {"mean": a, "max": a, "min": a, "norm": np.abs(a)}

    t, tb = side(1.0, 1.0, 1.0, 1.0), side(1.0, 1.0, 1.0, 1.0)
    r, rb = side(0.999, 1.001, 0.999, 1.0), side(1.0, 1.0, 1.0, 1.0)
    n = np.array([1, 1, 4, 1])
    got = _exact_update_gap(t, r, tb, rb, n)
    # target not moved: 1 update off both -0.001 and its flip; a larger tensor and a reference that did not move
    # (nothing to measure in) are not measured
    assert got[0] == pytest.approx(1.0) and got[1] == pytest.approx(1.0)
    assert np.isnan(got[2]) and np.isnan(got[3])
    flipped = _exact_update_gap(side(1.001), side(0.999), side(1.0), side(1.0), np.array([1]))
    assert flipped[0] == pytest.approx(0.0, abs=1e-9)


# bfloat16 around 2: one ulp is 2^-7 below 2 (2^-6 above); every value here is exact in bfloat16
BF16_REF = [2.0, 1.875, 1.75]  # the reference's bfloat16 scalar: -0.125 (16 ulps) per step


def test_a_bfloat16_scalar_reset_is_named_and_one_rounding_of_its_update_is_not(tmp_path):
    """A bfloat16 scalar reset before step 1 is 16 of its ulps away, one update: named.  A device that rounds
    the stored parameter otherwise (stochastic rounding) moves it by one ulp: where the reference's update is
    one ulp (2^-7 at 2) and the target's rounded to 0, its own update is off by a whole update, within one
    rounding of the parameter (x_round = eps(bfloat16) x 2 / 2^-7 = 2): quiet."""
    mode = "statistics"
    found = _verdict_at(tmp_path / "reset", mode, BF16_REF, [2.0, 2.0, 1.875])
    assert found.culprit is not None and (found.culprit.kind, found.culprit.step) == ("parameter", 1)
    assert found.culprit.evidence["own_update_off"] == pytest.approx(1.0)
    quiet = _verdict_at(tmp_path / "rounding", mode, [2.0, 2.0 - 2.0**-7, 2.0 - 2.0**-6], [2.0, 2.0, 2.0 - 2.0**-6])
    assert quiet.culprit is None


def _verdict_at(root, mode: str, ref: list[float], target: list[float]):
    root.mkdir()
    r = _steps(np.random.default_rng(7), ref, noise=0.0, dtype="bfloat16")
    t = _steps(np.random.default_rng(7), target, noise=1e-3, dtype="bfloat16")
    return _verdict(root, mode, r, t)


def test_the_step_agrees_only_on_parameters_that_can_show_it_and_beyond_one_element_reversed():
    """The within-tolerance rule on a step whose updates agree (analysis/steps.py `corrupted`, `agree`): a
    parameter whose bar (STAND_OUT x (x_prev + x_round)) is X_MIN or more cannot show that the updates agreed
    (a bf16 weight whose update is under its ulp: x_round 22); and a per-element normalising optimizer reverses
    an element whose gradient is noise-level, UPDATES_APART / sqrt(n) of an update (set 6's RWKV under Lion,
    pure bf16: an LN bias of 32 elements 0.278 apart in the clean pair and in a fault pair alike, where the
    other biases happened to agree)."""
    from test_steps import _table

    kinds = ["ln|bias|32", "lin|w|8x8", "lin|w|8x8", "lin|w|8x8", "ln|b|16", "ln|b|16", "ln|b|16"]
    within = ["pass"] * 7
    x = [0.278, 0.05, 0.07, 0.06, 0.0, 0.001, 0.0]  # three bf16 weights "within rounding" (x_round 22)
    x_round = [0.034, 22.0, 22.0, 22.0, 0.012, 0.012, 0.012]
    t = _table(x, status=within, klass=kinds, x_round=x_round, g_prev=[0.0] * 7)
    # with three informative biases agreeing: named as before where the parameter is large enough
    big = t.with_columns(pl.Series("_numel", [4096.0, 64, 64, 64, 16, 16, 16]))
    assert steps.corrupted(big)[100]["step_agrees"] is True
    # 32 elements: one reversed element is 2 / sqrt(32) = 0.354 of an update, x = 0.278 is within 3 x that
    small = t.with_columns(pl.Series("_numel", [32.0, 64, 64, 64, 16, 16, 16]))
    assert steps.corrupted(small) == {}
    # only the three weights besides it (uninformative, within their bar): no evidence the updates agreed
    only_w = big.filter(pl.col("klass") != "ln|b|16")
    assert steps.corrupted(only_w) == {}

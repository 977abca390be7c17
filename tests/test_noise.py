"""Verdict rules under cross-device noise (analysis/noise.py, rules.small_value_err), on small real dump pairs
written by the dump factory in both dump modes: residue is not a culprit, argument differences are, the
optimizer update is judged by update sizes, and a quiet verdict carries the measured noise."""

from __future__ import annotations

import numpy as np
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence

MODES = ("tensor", "statistics")
BF16 = "torch.bfloat16"


def _t(arr: np.ndarray) -> np.ndarray:
    return arr.astype(np.float32)


def _ingest_pair(dump_writer, store_dir, mode: str, ref: dict, target: dict, steps: int = 1):
    for name, recs in (("ref", ref), ("target", target)):
        w = dump_writer(name, mode)
        for step in range(steps):
            w.write(recs[step] if isinstance(recs, list) else recs, step=step)
        ingest(w.root, name, store=store_dir, jobs=1)
    return open_store(store_dir)


def _verdict(st):
    return divergence(compare_runs(st, "target", "ref"))


@pytest.mark.parametrize("mode", MODES)
def test_rounding_residue_is_judged_on_its_records_scale(dump_writer, store_dir, mode):
    rng = np.random.default_rng(0)
    a = _t(rng.normal(size=64))
    # a - a is zero in exact arithmetic: rounding residue of 1e-9 in one run, 1e-5 in the other
    ref = {"Tensor.sub.0.forward": {"input_args": [a, a], "output": [_t(rng.normal(size=64) * 1e-9)]}}
    tgt = {"Tensor.sub.0.forward": {"input_args": [a, a], "output": [_t(rng.normal(size=64) * 1e-5)]}}
    st = _ingest_pair(dump_writer, store_dir, mode, ref, tgt)
    cmp = compare_runs(st, "target", "ref")
    out = cmp.rows.filter(cmp.rows["io"] == "output").row(0, named=True)
    assert out["small_value"] and out["status"] == "pass"
    assert out["err"] < 1e-4 and "small value" in out["detail"]
    v = divergence(cmp)
    assert v.first_divergence is None and v.culprit is None


@pytest.mark.parametrize("mode", MODES)
def test_a_small_tensor_that_is_not_residue_is_still_judged_relatively(dump_writer, store_dir, mode):
    rng = np.random.default_rng(1)
    x = _t(rng.normal(size=64))
    y = _t(rng.normal(size=64) * 0.01)  # 1 % of its input's scale: above eps, an ordinary value
    ref = {"Tensor.mul.0.forward": {"input_args": [x, {"type": "float", "value": 0.01}], "output": [y]}}
    tgt = {"Tensor.mul.0.forward": {"input_args": [x, {"type": "float", "value": 0.01}], "output": [y * 1.05]}}
    v = _verdict(_ingest_pair(dump_writer, store_dir, mode, ref, tgt))
    assert v.culprit is not None and v.culprit.op == "Tensor.mul.0.forward" and v.culprit.kind == "op"


@pytest.mark.parametrize("mode", MODES)
def test_argument_difference_is_a_finding_even_when_outputs_agree(dump_writer, store_dir, mode):
    rng = np.random.default_rng(2)
    x, w, b = _t(rng.normal(size=(4, 8))), _t(np.ones(8)), _t(np.zeros(8))
    y = _t(rng.normal(size=(4, 8)))
    first = {"Functional.relu.0.forward": {"input_args": [x], "output": [np.maximum(x, 0)]}}

    def ln(eps: float) -> dict:
        return {
            "Functional.layer_norm.0.forward": {
                "input_args": [np.maximum(x, 0), {"type": "int", "value": 8}, w, b, {"type": "float", "value": eps}],
                "output": [y],
            }
        }

    v = _verdict(_ingest_pair(dump_writer, store_dir, mode, first | ln(1e-5), first | ln(1e-6)))
    assert v.culprit is not None and v.culprit.kind == "scalar"
    assert v.culprit.op == "Functional.layer_norm.0.forward"
    assert v.culprit.evidence["outputs"] == "within tolerance"
    assert "1e-06" in v.culprit.detail and "1e-05" in v.culprit.detail
    assert v.first_divergence is not None and v.first_divergence.op == "Functional.layer_norm.0.forward"


@pytest.mark.parametrize("side", ["target", "ref"])
@pytest.mark.parametrize("mode", MODES)
def test_a_keyword_in_one_run_only_is_an_argument_difference(dump_writer, store_dir, mode, side):
    x = _t(np.linspace(-2, 2, 32))
    ref = {"Functional.gelu.0.forward": {"input_args": [x], "output": [x]}}
    tgt = {"Functional.gelu.0.forward": {"input_args": [x], "output": [x]}}
    st = _ingest_pair(dump_writer, store_dir, mode, ref, tgt)
    v = _verdict(st)
    assert v.culprit is None  # same calls: nothing to say
    # the factory writes positional arguments only; a keyword goes through input_kwargs
    import json

    for name in (side,):
        path = store_dir.parent / name / "step0" / "rank0" / "dump.json"
        doc = json.loads(path.read_text())
        doc["data"]["Functional.gelu.0.forward"]["input_kwargs"] = {"approximate": {"type": "str", "value": "tanh"}}
        path.write_text(json.dumps(doc))
        ingest(path.parents[2], name, store=store_dir, jobs=1)
    v = _verdict(open_store(store_dir))
    assert v.culprit is not None and v.culprit.kind == "scalar"
    where = "target" if side == "target" else "reference"
    assert "approximate" in v.culprit.detail and f"only in the {where}" in v.culprit.detail


def _param_step(p: np.ndarray, x: np.ndarray) -> dict:
    return {"Functional.linear.0.forward": {"input_args": [x, p], "output": [x @ p.T]}}


@pytest.mark.parametrize("mode", MODES)
def test_learning_rate_is_found_as_the_optimizer_update(dump_writer, store_dir, mode):
    rng = np.random.default_rng(3)
    x = _t(rng.normal(size=(4, 8)))
    params = [_t(rng.normal(size=(8, 8))) for _ in range(6)]
    grads = [_t(rng.normal(size=(8, 8)) * 0.1) for _ in range(6)]

    def run(lr: float) -> list[dict]:
        steps = []
        for step in range(2):
            recs = {}
            for i, (p, g) in enumerate(zip(params, grads)):
                q = p - step * lr * g
                recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, q], "output": [x @ q.T]}
            steps.append(recs)
        return steps

    st = _ingest_pair(dump_writer, store_dir, mode, run(0.1), run(0.11), steps=2)
    _mark_parameters(st, store_dir)
    v = _verdict(open_store(store_dir))
    assert v.culprit is not None and v.culprit.kind == "optimizer" and v.culprit.step == 1
    assert v.culprit.value == pytest.approx(1.1, rel=1e-3)
    # every parameter whose update is measurable (statistics: those over tolerance) moved 1.1x as far
    n = v.culprit.evidence["parameters"]
    assert n >= 5 and f"{n} of {n} parameters moved 1.1x" in v.culprit.detail


def _mark_parameters(st, store_dir) -> None:
    """The factory writes requires_grad false: make input.1 (the weight) a parameter and re-ingest."""
    import json

    for name in ("ref", "target"):
        root = store_dir.parent / name
        for path in root.glob("step*/rank*/dump.json"):
            doc = json.loads(path.read_text())
            for rec in doc["data"].values():
                rec["input_args"][1]["requires_grad"] = True
            path.write_text(json.dumps(doc))
        ingest(root, name, store=store_dir, jobs=1)


@pytest.mark.parametrize("mode", MODES)
def test_parameters_moved_alike_by_noisy_gradients_are_not_a_fault(dump_writer, store_dir, mode):
    rng = np.random.default_rng(4)
    x = _t(rng.normal(size=(4, 8)))
    params = [_t(rng.normal(size=(8, 8))) for _ in range(6)]
    grads = [_t(rng.normal(size=(8, 8)) * 0.1) for _ in range(6)]

    def run(noise: float, seed: int) -> list[dict]:
        r = np.random.default_rng(seed)
        steps = []
        for step in range(2):
            recs = {}
            for i, (p, g) in enumerate(zip(params, grads)):
                gn = g * (1 + noise * r.normal(size=g.shape))  # the other device's rounding of the gradient
                q = _t(p - step * 0.5 * gn)
                recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, q], "output": [x @ q.T]}
            steps.append(recs)
        return steps

    st = _ingest_pair(dump_writer, store_dir, mode, run(0.0, 5), run(0.02, 6), steps=2)
    _mark_parameters(st, store_dir)
    v = _verdict(open_store(store_dir))
    assert v.culprit is None and v.first_divergence is None
    assert v.counts.get("diverged", 0) > 0  # tensors over the fp32 tolerance at step 1 ...
    assert v.noise  # ... and the verdict says how large the noise is


def test_arguments_of_calls_paired_across_apis_are_not_compared(dump_writer, store_dir, tmp_path):
    from dumpstore.analysis import load_mapping

    x = _t(np.linspace(-1, 1, 16))
    two = {"type": "float", "value": 2.0}
    ref = {"Torch.mul.0.forward": {"input_args": [x, two, {"type": "int", "value": 1}], "output": [x * 2]}}
    tgt = {"Tensor.mul.0.forward": {"input_args": [x, two], "output": [x * 2]}}
    st = _ingest_pair(dump_writer, store_dir, "statistics", ref, tgt)
    mapping = tmp_path / "map.yaml"
    mapping.write_text("api:\n  Tensor.mul: Torch.mul\n")
    v = divergence(compare_runs(st, "target", "ref", mapping=load_mapping([str(mapping)])))
    assert v.culprit is None and v.first_divergence is None  # another API's signature: input.2 is not a keyword


def _fit_by_loop(recs) -> tuple[dict, dict]:
    """NoiseModel.fit as a loop over the rows: each row's order key and measure, sorted stably by key."""
    fresh: dict = {}
    carry: dict = {}
    for r in recs.iter_rows(named=True):
        if r["out_err"] is None or not np.isfinite(r["out_err"]):
            continue
        key = (r["step"], r["_phase"], r["rank"], r["source"] or "", r["_seq"])
        if r["fresh"]:
            fresh.setdefault(r["_direction"], []).append((key, r["out_err"]))
        elif r["amp"] is not None and np.isfinite(r["amp"]):
            carry.setdefault(r["_direction"], []).append((key, r["amp"]))
    return tuple(  # type: ignore[return-value]
        {
            d: ([k for k, _ in sorted(v, key=lambda kv: kv[0])], [x for _, x in sorted(v, key=lambda kv: kv[0])])
            for d, v in g.items()
        }
        for g in (fresh, carry)
    )


def test_noise_model_fit_orders_each_direction_by_execution_order():
    import polars as pl

    from dumpstore.analysis.noise import NoiseModel

    rng = np.random.default_rng(7)
    n = 400
    special = [None, float("nan"), float("inf"), 0.0, -0.0]
    recs = pl.DataFrame(
        {
            "step": rng.integers(0, 3, n),
            "_phase": rng.integers(0, 2, n),
            "rank": rng.integers(0, 2, n),
            "source": rng.choice(["", "b", "a"], n).tolist(),
            "_seq": rng.integers(0, 20, n),  # ties: kept in row order
            "_direction": rng.choice(["forward", "backward"], n).tolist(),
            "out_err": [special[i % 5] if i % 7 == 0 else float(x) for i, x in enumerate(rng.random(n))],
            "amp": [special[i % 5] if i % 11 == 0 else float(x) for i, x in enumerate(rng.random(n) * 9)],
            "fresh": [None if i % 13 == 0 else bool(b) for i, b in enumerate(rng.integers(0, 2, n))],
        }
    ).with_columns(pl.when(pl.col("source") == "").then(None).otherwise(pl.col("source")).alias("source"))
    model = NoiseModel.fit(recs)
    fresh, carry = _fit_by_loop(recs)
    for got, want in ((model.fresh, fresh), (model.carry, carry)):
        assert set(got) == set(want)
        for d, (keys, values) in want.items():
            assert got[d][0] == keys
            assert got[d][1].tobytes() == np.array(values, np.float64).tobytes()

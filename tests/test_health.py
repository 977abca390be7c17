"""Single-run watchpoints find what the sample catalog declares (expected.health); each rule fires alone."""

from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np
import pytest
from click.testing import CliRunner

from dumpstore._ingest import ingest
from dumpstore.analysis._health import WATCHPOINTS, Thresholds, health
from dumpstore.cli.main import main
from dumpstore.query import run_query
from dumpstore.store import open_store
from helpers import SAMPLES, leaf, replay_row, replay_table

CATALOG = {c["name"]: c for c in json.loads((SAMPLES / "catalog.json").read_text())["cases"]}
DECLARED = [c for c in CATALOG.values() if c["expected"] and "health" in c["expected"]]


@pytest.fixture
def store(sample_store):
    return sample_store


@pytest.mark.parametrize("case", DECLARED, ids=lambda c: c["name"])
def test_findings_match_catalog(store, case):
    rep = health(store, case["name"])
    exp = case["expected"]["health"]
    assert set(exp["findings"]) == set(WATCHPOINTS)
    for w, e in exp["findings"].items():
        assert rep.counts[w] == e["count"], w
        f = rep.first(w)
        got = None if f is None else {"step": f.step, "rank": f.rank, "op": f.op, "name": f.name}
        assert got == e["first"], w
    assert [s["value"] for s in rep.loss] == pytest.approx(exp["loss"])


def test_gradient_explosion_named(store):
    rep = health(store, "grad_explode_stats")
    scale = CATALOG["grad_explode_stats"]["expected"]["loss_scale"]
    params = [f for f in rep.findings if f.watchpoint == "grad_explosion" and f.param]
    assert params[0].step == scale["step"] and params[0].param == "head.bias"
    assert all(f.value > f.threshold for f in params)
    assert rep.first("weight_change").step == scale["step"] + 1  # the oversized update shows at the next step
    assert "estimated" in rep.first("weight_change").detail


def test_healthy_reference_has_no_findings(store):
    rep = health(store, "ref_stats")
    assert rep.findings == [] and len(rep.loss) == 3


def test_overflow_and_values_near_dtype_max(store):
    case = CATALOG["overflow_stats"]["expected"]
    rep = health(store, "overflow_stats")
    f = rep.first("overflow")
    assert (f.step, f.op, f.value) == (
        case["first_overflow"]["step"],
        case["first_overflow"]["op"],
        case["first_overflow"]["kind"],
    )
    near = rep.first("near_dtype_max")
    assert near.param == case["parameter"] and near.value >= near.threshold
    assert rep.counts["loss_nonfinite"] == 3 and all(math.isnan(s["value"]) for s in rep.loss)


def test_views_expose_the_same_numbers(store):
    loss = run_query(store, "select step, value from loss where run = 'grad_explode_stats' order by step")
    assert loss.column("value").to_pylist() == [s["value"] for s in health(store, "grad_explode_stats").loss]
    wc = (
        run_query(
            store, "select ratio_est from weight_change where run = 'lr_stats' and step = 1 and param = 'head.weight'"
        )
        .column("ratio_est")
        .to_pylist()
    )
    assert len(wc) == 1 and wc[0] > 0.1
    g = run_query(store, "select count(*) as n from grad_norms where run = 'ref_stats' and kind = 'parameter'")
    assert g.column("n").to_pylist() == [29 * 3]
    layers = run_query(store, "select distinct layer from layer_grad_norms where run = 'ref_stats'")
    assert "layers.0.qkv" in layers.column("layer").to_pylist()
    p = run_query(store, "select param from param_stats where run = 'ref_stats' and step = 0 order by seq, leaf")
    assert p.column("param").to_pylist()[0] == "emb.weight"


def test_cli_json_and_text(store):
    runner = CliRunner()
    res = runner.invoke(main, ["health", "--run", "grad_explode_stats", "--store", str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["counts"]["grad_explosion"] > 0 and out["thresholds"]["explode_factor"] == 10.0
    assert all({"step", "rank", "op", "value", "threshold"} <= set(f) for f in out["findings"])
    res = runner.invoke(main, ["health", "--run", "grad_explode_stats", "--store", str(store.root), "--top", "2"])
    assert res.exit_code == 0 and "grad_explosion" in res.output and "loss (rank 0" in res.output


# -- each rule on a synthetic run -----------------------------------------------------------------------


def _write_run(root, steps: list[dict[str, np.ndarray]]) -> None:
    """One rank; per step: act (a forward output), weight (module parameter), grad (its gradient), zero."""
    for s, t in enumerate(steps):
        d = root / f"step{s}" / "rank0"
        d.mkdir(parents=True)
        data = {
            "Functional.linear.0.forward": {
                "input_args": [leaf(t["x"]), leaf(t["weight"], requires_grad=True)],
                "input_kwargs": {},
                "output": [leaf(t["act"], requires_grad=True)],
            },
            "Module.fc.Linear.forward.0": {
                "input_args": [leaf(t["x"])],
                "input_kwargs": {},
                "output": [leaf(t["act"], requires_grad=True)],
                "parameters": {"weight": leaf(t["weight"], requires_grad=True)},
            },
            "Functional.relu.0.forward": {
                "input_args": [leaf(t["act"], requires_grad=True)],
                "input_kwargs": {},
                "output": [leaf(t["zero"], requires_grad=True)],
            },
            "Module.fc.Linear.parameters_grad.0": {"weight": [leaf(t["grad"])]},
        }
        doc = {"task": "statistics", "level": "mix", "framework": "pytorch", "dump_data_dir": None, "data": data}
        (d / "dump.json").write_text(json.dumps(doc))
        parents = {"Functional.linear.0.forward": "Module.fc.Linear.forward.0"}
        (d / "construct.json").write_text(json.dumps(parents))


@pytest.fixture
def synthetic(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    steps = []
    for s in range(5):
        act = (x @ w.T * 1.3**s).astype(np.float32)  # grows 30 % per step
        grad = (w * 1e-3).astype(np.float32)
        if s == 3:
            grad = grad * 1e3  # explodes at step 3
        if s == 4:
            grad = grad * 1e-6  # vanishes at step 4
        act16 = act.astype(np.float16) if s < 4 else np.full((2, 4), 40000, np.float16)  # near fp16 max at 4
        steps.append({"x": x, "weight": w, "act": act16, "grad": grad, "zero": np.zeros((2, 4), np.float32)})
    _write_run(tmp_path / "run", steps)
    ingest(tmp_path / "run", "syn", store=tmp_path / "s", jobs=1)
    return open_store(tmp_path / "s")


def test_each_rule_fires_on_its_own(synthetic):
    rep = health(synthetic, "syn")
    growth = rep.first("activation_growth")
    assert growth.step == 3 and growth.name == "Functional.linear.0.forward.output.0"
    assert growth.value == pytest.approx(1.3**3, rel=1e-2) and growth.threshold == pytest.approx(1.2**3)
    assert rep.first("all_zero").step == 0 and rep.first("all_zero").op == "Functional.relu.0.forward"
    assert rep.counts["all_zero"] == 5
    explode = rep.first("grad_explosion")
    w_norm = run_query(synthetic, "select norm from param_stats where step = 0").column("norm").to_pylist()[0]
    assert (explode.step, explode.param) == (3, "fc.weight")
    assert explode.threshold == pytest.approx(10 * 1e-3 * w_norm, rel=1e-3)  # 10 x median of steps 0-2
    vanish = rep.first("grad_vanishing")
    assert (vanish.step, vanish.param) == (4, "fc.weight") and vanish.value < 1e-7
    near = rep.first("near_dtype_max")
    assert near.step == 4 and near.value == 40000 and near.threshold == pytest.approx(0.5 * 65504)
    frozen = [f for f in rep.findings if f.watchpoint == "weight_frozen"]
    assert [f.step for f in frozen] == [1, 2, 3, 4] and frozen[0].param == "fc.weight"
    assert rep.counts["weight_change"] == 0 and rep.counts["overflow"] == 0 and rep.loss == []


def test_thresholds_are_parameters(synthetic):
    rep = health(synthetic, "syn", thresholds=Thresholds(growth=0.5, explode_factor=1e4, vanish_norm=0.0))
    assert rep.counts["activation_growth"] == 0 and rep.counts["grad_explosion"] == 0
    assert rep.counts["grad_vanishing"] == 0


# -- loss spikes of a negative loss ------------------------------------------------------------------------


def _loss_run(root, losses: list[float]) -> None:
    """One rank; per step one cross_entropy call whose 0-d output is the loss."""
    for s, value in enumerate(losses):
        d = root / f"step{s}" / "rank0"
        d.mkdir(parents=True)
        loss = {
            "type": "torch.Tensor",
            "dtype": "torch.float32",
            "shape": [],
            "Max": value,
            "Min": value,
            "Mean": value,
            "Norm": abs(value),
            "requires_grad": True,
        }
        logits = leaf(np.arange(8, dtype=np.float32).reshape(2, 4))
        data = {"Functional.cross_entropy.0.forward": {"input_args": [logits], "input_kwargs": {}, "output": [loss]}}
        doc = {"task": "statistics", "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data}
        (d / "dump.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("losses", "spikes"),
    [
        ([-10.0, -10.0, -2.0], []),  # closer to zero: the loss improved in size, no spike
        ([-10.0, -10.0, -10.5], []),
        ([-10.0, -10.0, 100.0], [(2, 80.0)]),  # median -10 + 9 x 10 = 80
        ([1.0, 1.0, 9.0], []),
        ([1.0, 1.0, 11.0], [(2, 10.0)]),  # positive losses: 10 x the median, as before
    ],
)
def test_loss_spike_of_negative_losses(tmp_path, losses, spikes):
    _loss_run(tmp_path / "run", losses)
    ingest(tmp_path / "run", "neg", store=tmp_path / "s", jobs=1)
    rep = health(open_store(tmp_path / "s"), "neg")
    assert [s["value"] for s in rep.loss] == pytest.approx(losses)
    found = [(f.step, f.threshold) for f in rep.findings if f.watchpoint == "loss_spike"]
    assert found == [(s, pytest.approx(t)) for s, t in spikes]


def test_progress_is_reported_per_watchpoint_group(store):
    calls: list[tuple[str, int, int]] = []
    health(store, "ref_stats", progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert calls[0] == ("loss", 0, 7) and calls[-1] == ("overflow", 7, 7)
    assert [d for _, d, _ in calls] == list(range(8))


def test_kernel_watchpoint_lists_the_replays_failed_outputs(tmp_path) -> None:
    """`kernel`: every output of the run's replay over its standard, in execution order, with the replay's words;
    none before the run is replayed (the samples never are)."""
    from dumpstore.analysis.replay import kernel_finding
    from dumpstore.cli.health_cmds import health_text
    from dumpstore.replaytable import write_replay

    ingest(SAMPLES / "ref_stats", "r", store=tmp_path / "store", jobs=1)
    st = open_store(tmp_path / "store")
    assert health(st, "r").counts["kernel"] == 0
    rows = [
        replay_row(1, 4, "Functional.linear.0.forward", "fail", 50.0),
        replay_row(0, 9, "Functional.softmax.0.forward", "pass", 1.0),
        replay_row(0, 12, "Functional.linear.1.forward", "fail", 700.0),
    ]
    write_replay(st, "r", replay_table(rows))
    rep = health(st, "r")
    found = [(f.step, f.op, f.value, f.threshold) for f in rep.findings if f.watchpoint == "kernel"]
    assert found == [(0, "Functional.linear.1.forward", 700.0, 2.0), (1, "Functional.linear.0.forward", 50.0, 2.0)]
    first = rep.first("kernel")
    assert first is not None and first.name == "Functional.linear.1.forward.output.0"
    assert first.detail == "rel_l2_ratio: " + kernel_finding(st, "r").detail
    assert first.detail == (
        "rel_l2_ratio: Functional.linear.1.forward.output.0: linear is 700× farther from float64 than the CPU's "
        "float32 linear (rel_l2 7e-05 vs 1e-07; judged ratio 700 > 2; msprobe's benchmark standard: error)"
    )
    assert rep.counts["kernel"] == 2 and set(rep.counts) == set(WATCHPOINTS)
    res = CliRunner().invoke(main, ["health", "--run", "r", "--store", str(tmp_path / "store"), "--json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(body, json.loads((resources.files("dumpstore") / "schemas" / "health.json").read_text()))
    assert body["counts"]["kernel"] == 2 and body["findings"][0]["watchpoint"] in WATCHPOINTS
    out = health_text(rep, 20)
    assert (
        "kernel             2         op output farther from float64 than its replay standard (dumpstore replay)" in out
    )
    assert "\nkernel: 2 findings\n" in out

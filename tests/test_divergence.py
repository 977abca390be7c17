"""Every declared answer of the sample catalog is found: first divergence, culprit, overflow (by method)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dumpstore.analysis._divergence import divergence
from dumpstore.analysis._overflow import overflow
from dumpstore.analysis.compare import compare_runs
from dumpstore.cli.main import main
from dumpstore.query import run_query
from helpers import SAMPLES

CATALOG = json.loads((SAMPLES / "catalog.json").read_text())["cases"]
PAIRS = [c for c in CATALOG if c.get("ref")]
KIND = {"missing_or_extra": {"ref": "missing_op", "target": "extra_op"}}


@pytest.fixture
def store(sample_store):
    return sample_store


def _verdict(store, case):
    return divergence(compare_runs(store, case["name"], case["ref"]))


def _expected_kind(exp: dict) -> str:
    return KIND[exp["kind"]][exp["side"]] if exp["kind"] in KIND else exp["kind"]


@pytest.mark.parametrize("case", [c for c in PAIRS if c["expected"]["culprit"]], ids=lambda c: c["name"])
def test_first_divergence_and_culprit(store, case):
    v = _verdict(store, case)
    exp = case["expected"]
    fd, cu = v.first_divergence, v.culprit
    assert (fd.step, fd.rank, fd.op) == tuple(exp["first_divergence"][k] for k in ("step", "rank", "op"))
    assert (cu.step, cu.rank, cu.op) == tuple(exp["culprit"][k] for k in ("step", "rank", "op"))
    assert cu.kind == _expected_kind(exp["culprit"])


@pytest.mark.parametrize("case", [c for c in PAIRS if "bf16" in c["name"]], ids=lambda c: c["name"])
def test_bf16_autocast_is_not_a_fault(store, case):
    v = _verdict(store, case)
    assert v.culprit is None and v.first_divergence is None
    assert v.precision["floor"] == "bfloat16" and v.precision["ref"] == "float32"


@pytest.mark.parametrize("case", PAIRS, ids=lambda c: c["name"])
def test_first_overflow(store, case):
    rep = overflow(store, case["name"], ref=case["ref"])
    exp = case["expected"]["first_overflow"]
    got = rep.first_overflow
    if exp is None:
        assert got is None
    else:
        assert (got["step"], got["rank"], got["op"], got["kind"]) == (exp["step"], exp["rank"], exp["op"], exp["kind"])


def test_overflow_without_reference_skips_attention_mask(store):
    rep = overflow(store, "ref_stats")
    assert rep.first_overflow is None
    assert rep.producers and all(p["likely_mask"] for p in rep.producers)


def test_scalar_argument_named(store):
    case = next(c for c in PAIRS if c["name"] == "ln_eps_stats")
    v = _verdict(store, case)
    assert v.culprit.evidence["scalar"] == case["expected"]["scalar_argument"]["name"]


def test_rank_that_disagrees_with_peers(store):
    case = next(c for c in PAIRS if c["name"] == "rank1_fault_stats")
    ranks = {r["rank"]: r["disagrees_with_peers"] for r in _verdict(store, case).ranks}
    assert ranks == {0: False, 1: True}


def test_identical_runs_do_not_diverge(store):
    v = divergence(compare_runs(store, "ref_stats", "ref_stats"))
    assert v.first_divergence is None and v.culprit is None and v.unmatched == []
    # the -Inf-masked tensors of statistics mode: equal statistics say nothing of their finite values (issue 24)
    hidden = run_query(
        store, "select count(*) from tensors where run='ref_stats' and kind='tensor' and not isfinite(norm)"
    ).to_pylist()[0]
    assert v.counts == {"pass": v.counts["pass"], "unknown": list(hidden.values())[0]}
    assert divergence(compare_runs(store, "ref_tensor", "ref_tensor")).counts.keys() == {"pass"}  # sketches tell


def test_divergence_cli_json_and_check(store):
    runner = CliRunner()
    args = ["divergence", "--target", "weight_1pct_tensor", "--ref", "ref_tensor", "--store", str(store.root)]
    res = runner.invoke(main, args + ["--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["first_divergence"]["op"] == "Functional.linear.6.forward"
    assert out["first_divergence"]["name"] == "Functional.linear.6.forward.output.0"
    assert out["first_divergence"]["threshold"] == 2.0**-13
    assert {s["step"] for s in out["steps"]} == {0}
    assert runner.invoke(main, args + ["--check"]).exit_code == 3
    same = ["divergence", "--target", "ref_tensor", "--ref", "ref_tensor", "--store", str(store.root), "--check"]
    assert runner.invoke(main, same).exit_code == 0


def _compare_json(store, *args):
    cmd = ["compare", "--target", "gelu_tanh_tensor", "--ref", "ref_tensor", "--store", str(store.root)]
    return json.loads(CliRunner().invoke(main, cmd + ["--top", "3", "--json", *args]).output)["rows"]


def test_compare_cli_ranks_worst_first(store):
    rows = _compare_json(store, "--by", "severity")
    assert len(rows) == 3 and rows[0]["severity"] >= rows[1]["severity"] >= rows[2]["severity"]
    assert all(r["status"] == "diverged" for r in rows)


def test_compare_cli_ranks_by_significance_by_default(store):
    """The default order is significance (analysis/rank.py): the culprit's argument in one run only first."""
    rows = _compare_json(store)
    sig = [float("inf") if r["significance"] in (None, "inf") else r["significance"] for r in rows]  # JSON: no inf
    assert rows[0]["name"] == "Functional.gelu.1.forward.input.approximate" and sig[0] == float("inf")
    assert sig[0] >= sig[1] >= sig[2]


def test_overflow_cli_json(store):
    res = CliRunner().invoke(
        main, ["overflow", "--run", "overflow_stats", "--ref", "ref_stats", "--store", str(store.root), "--json"]
    )
    out = json.loads(res.output)
    assert out["first_overflow"]["op"] == "Functional.linear.7.forward" and out["first_overflow"]["kind"] == "inf"


@pytest.mark.parametrize("name", ["lr_stats", "grad_explode_stats", "rank1_fault_stats", "weight_1pct_stats"])
def test_divergence_in_step_batches_equals_all_at_once(store, name):
    from dumpstore.analysis._divergence import divergence_by_steps

    case = next(c for c in PAIRS if c["name"] == name)
    whole = _verdict(store, case).to_dict()
    batched = divergence_by_steps(store, case["name"], case["ref"], max_rows=1).to_dict()
    assert batched == whole

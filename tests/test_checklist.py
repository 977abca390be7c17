"""The checklist finds what the sample catalog declares (expected.checklist), each check in one place."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dumpstore._ingest import ingest
from dumpstore.analysis._checklist import CHECKS, checklist
from dumpstore.cli.main import main
from dumpstore.store import open_store
from helpers import SAMPLES, leaf

CATALOG = {c["name"]: c for c in json.loads((SAMPLES / "catalog.json").read_text())["cases"]}
DECLARED = [c for c in CATALOG.values() if c["expected"] and "checklist" in c["expected"]]
SCALAR_CASES = [
    c for c in CATALOG.values() if c["expected"] and "scalar_argument" in c["expected"] and c["mode"] == "statistics"
]


@pytest.fixture
def store(sample_store):
    return sample_store


def test_declared_cases_exist():
    assert {c["name"] for c in DECLARED} >= {"data_batch_stats", "init_weight_stats", "lr_stats", "grad_explode_stats"}


@pytest.mark.parametrize("case", DECLARED, ids=lambda c: c["name"])
def test_statuses_match_catalog(store, case):
    got = checklist(store, case["name"], case["ref"])
    exp = case["expected"]["checklist"]
    assert [c.key for c in got.checks] == list(CHECKS)
    assert {k: got[k].status for k in CHECKS} == {k: exp[k]["status"] for k in CHECKS}


@pytest.mark.parametrize("case", DECLARED, ids=lambda c: c["name"])
def test_evidence_names_the_tensor_and_step(store, case):
    got = checklist(store, case["name"], case["ref"])
    exp = case["expected"]["checklist"]
    if exp["data"]["status"] == "differs":
        first = got["data"].first
        assert (first["step"], first["rank"], first["name"]) == (
            exp["data"]["step"],
            exp["data"]["rank"],
            exp["data"]["name"],
        )
        assert first["name"] in got["data"].evidence
    assert [it["param"] for it in got["weights"].items] == exp["weights"]["params"]
    for param in exp["weights"]["params"]:
        assert param in got["weights"].evidence
    s = got["structure"]
    for k in ("target_only_records", "ref_only_records", "shape_differences", "dtype_differences"):
        assert s.counts[k] == exp["structure"][k]
    if exp["structure"]["first"]:
        assert (s.first["step"], s.first["rank"], s.first["op"]) == tuple(
            exp["structure"]["first"][k] for k in ("step", "rank", "op")
        )
    if exp["scalars"]["status"] == "differs":
        g = got["scalars"].items[0]
        assert g["first"]["name"] == exp["scalars"]["first"]["name"]
        e = exp["scalars"]
        assert (g["value"], g["ref_value"], g["count"]) == (e["value"], e["ref_value"], e["count"])


@pytest.mark.parametrize("case", SCALAR_CASES, ids=lambda c: c["name"])
def test_scalar_argument_named(store, case):
    got = checklist(store, case["name"], case["ref"])["scalars"]
    assert got.status == "differs"
    assert got.first["name"] == case["expected"]["scalar_argument"]["name"]


def test_identical_runs_pass_everything(store):
    got = checklist(store, "ref_stats", "ref_stats")
    assert {c.status for c in got.checks} == {"pass"}
    assert "Functional.embedding.0.forward.input.0" in got["data"].evidence


def test_mixed_precision_said_once_not_per_op(store):
    got = checklist(store, "bf16_stats", "ref_stats")
    assert got["precision"].status == "differs"
    assert got["precision"].counts["dtype_differences_by_design"] > 0
    assert "bfloat16" in got["precision"].evidence and "float32" in got["precision"].evidence
    assert got["structure"].status == "pass" and got["structure"].counts["dtype_differences"] == 0


def test_missing_op_in_structure(store):
    case = CATALOG["no_mask_stats"]
    s = checklist(store, case["name"], case["ref"])["structure"]
    assert s.status == "differs" and s.counts["target_only_records"] == 0
    assert s.first["op"] == case["expected"]["missing_in_target"][0] and s.first["only_in"] == "reference"
    assert s.counts["ref_only_records"] == len(case["expected"]["missing_in_target"]) * len(case["steps"])


def test_steps_and_ranks_in_one_run(store):
    got = checklist(store, "ref_2rank_stats", "ref_stats")["coverage"]
    assert got.status == "differs"
    assert {"only_in": "reference", "steps": [2]} in got.items
    assert {"only_in": "target", "ranks": [1]} in got.items


def _write(root, tokens: np.ndarray, weight: np.ndarray) -> None:
    d = root / "step0" / "rank0"
    d.mkdir(parents=True)
    rec = {
        "input_args": [leaf(tokens, stats=("Max", "Min")), leaf(weight, requires_grad=True)],
        "input_kwargs": {},
        "output": [leaf(weight[tokens], requires_grad=True)],
    }
    doc = {
        "task": "statistics",
        "level": "L1",
        "framework": "pytorch",
        "dump_data_dir": None,
        "data": {"Functional.embedding.0.forward": rec},
    }
    (d / "dump.json").write_text(json.dumps(doc))
    (d / "construct.json").write_text("{}")


def test_data_inferred_when_integer_statistics_agree(tmp_path):
    """Token ids with the same max/min (all msprobe keeps for ints) but a different embedding output."""
    weight = np.arange(40, dtype=np.float32).reshape(10, 4)
    a = np.array([[0, 3, 9, 5]], dtype=np.int64)
    b = np.array([[0, 4, 9, 5]], dtype=np.int64)
    _write(tmp_path / "a", a, weight)
    _write(tmp_path / "b", b, weight)
    ingest(tmp_path / "a", "a", store=tmp_path / "s", jobs=1)
    ingest(tmp_path / "b", "b", store=tmp_path / "s", jobs=1)
    got = checklist(open_store(tmp_path / "s"), "a", "b")["data"]
    assert got.status == "differs"
    assert got.first["name"] == "Functional.embedding.0.forward.input.0"
    assert "inferred" in got.evidence and "Functional.embedding.0.forward.output.0" in got.first["why"]
    same = checklist(open_store(tmp_path / "s"), "a", "a")
    assert same["data"].status == "pass" and same["weights"].status == "pass"


def test_cli_json_and_table(store):
    runner = CliRunner()
    args = ["checklist", "--target", "init_weight_stats", "--ref", "ref_stats", "--store", str(store.root)]
    res = runner.invoke(main, args + ["--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert list(out) == ["schema_version", "command", "store", "target", "ref", *CHECKS]
    assert all({"status", "evidence"} <= set(out[k]) for k in CHECKS)
    assert out["weights"]["status"] == "differs" and out["weights"]["first"]["param"] == "layers.0.qkv.weight"
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "initial weights" in res.output and "layers.0.qkv.weight" in res.output
    bad = runner.invoke(main, ["checklist", "--target", "nope", "--ref", "ref_stats", "--store", str(store.root)])
    assert bad.exit_code == 1 and "nope" in bad.output


def test_progress_is_reported_per_check(store):
    calls: list[tuple[str, int, int]] = []
    checklist(store, "weight_1pct_stats", "ref_stats", progress=lambda *a: calls.append(a))
    assert [s for s, _, _ in calls] == [
        "compare",
        "data",
        "weights",
        "structure",
        "scalars",
        "precision",
        "coverage",
        "done",
    ]
    assert calls[-1] == ("done", 7, 7)


def test_unproduced_inputs_by_fingerprint() -> None:
    """An input is kept when it has no statistic, or when it is the first of its fingerprint (step, rank, source,
    dtype, shape, statistics: NaN equal to NaN, -0.0 to 0.0) and no output of that fingerprint comes before it."""
    import polars as pl

    from dumpstore.analysis._checklist import _unproduced_inputs

    nan = float("nan")
    leaves = [  # (seq, io, stats): all float32 [2] tensors of step 0, rank 0, forward
        (1, "input", (0.0, 1.0, 0.5, 1.0)),  # kept: first of its fingerprint
        (2, "output", (nan, 2.0, 0.5, 1.0)),
        (3, "input", (0.0, 1.0, 0.5, 1.0)),  # the same as seq 1: left out
        (4, "input", (nan, 2.0, 0.5, 1.0)),  # seq 2's output (NaN = NaN): left out
        (5, "input", (-0.0, 3.0, 0.5, 1.0)),  # kept
        (6, "input", (0.0, 3.0, 0.5, 1.0)),  # seq 5's (-0.0 = 0.0): left out
        (7, "input", (None, None, None, None)),  # no statistic: kept
        (8, "input", (None, None, None, None)),  # kept
        (9, "output", (5.0, 6.0, 0.5, 1.0)),
        (10, "input", (5.0, 6.0, 0.5, 2.0)),  # another norm: kept
    ]
    side = pl.DataFrame(
        [
            {
                "_i": i,
                "step": 0,
                "rank": 0,
                "source": "forward",
                "seq": seq,
                "leaf": 0,
                "io": io,
                "kind": "tensor",
                "direction": "forward",
                "module": None,
                "dtype": "float32",
                "shape": [2],
                **dict(zip(("min", "max", "mean", "norm"), stats)),
            }
            for i, (seq, io, stats) in enumerate(leaves)
        ],  # fmt: skip
        schema_overrides={"module": pl.String, **{s: pl.Float64 for s in ("min", "max", "mean", "norm")}},
    )
    assert _unproduced_inputs(side)["seq"].to_list() == [1, 5, 7, 8, 10]

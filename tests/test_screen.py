"""The screen (analysis/screen.py) against the exact path: per pair err/tol/status, and whole verdicts."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis._divergence import divergence, divergence_by_steps, divergence_in_batches
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.screen import pair_rows, screen
from dumpstore.analysis.tolerance import Tolerances
from dumpstore.store import open_store
from helpers import SAMPLES, synth

CATALOG = json.loads((SAMPLES / "catalog.json").read_text())["cases"]
PAIRS = [c for c in CATALOG if c.get("ref")]
KEY = ["step", "rank", "source", "record", "io", "index_path"]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _coverage(store, target, ref):
    t, r = store.run_info(target), store.run_info(ref)
    return sorted(set(t["steps"]) & set(r["steps"])), sorted(set(t["ranks"]) & set(r["ranks"]))


@pytest.mark.parametrize("case", PAIRS, ids=lambda c: c["name"])
def test_screen_pairs_equal_pair_metrics(sample_store, case):
    """Every leaf pair the screen judges has the err, tol and status that alignment + pair_metrics give it."""
    tol = Tolerances()
    cmp = compare_runs(sample_store, case["name"], case["ref"], tolerances=tol)
    steps, ranks = _coverage(sample_store, case["name"], case["ref"])
    scr = screen(sample_store, case["name"], case["ref"], steps, ranks, tol)
    assert scr.precision == cmp.precision
    exact = cmp.rows.select(*KEY, "match", "err", "tol", "status")
    checked = 0
    for unit in exact.select("step", "rank", "source").unique().iter_rows():
        got = pair_rows(sample_store, case["name"], case["ref"], *unit, tol, cmp.precision["floor"])
        want = exact.filter(pl.col("step") == unit[0], pl.col("rank") == unit[1], pl.col("source") == unit[2])
        if got is None:  # not positionally paired: must be among the screen's units for the exact path
            assert unit[:2] in scr.complex_units
            continue
        assert (want["match"] == "exact").all() and got.height == want.height
        joined = want.join(
            got.with_columns(
                pl.lit(unit[0], pl.Int64).alias("step"),
                pl.lit(unit[1], pl.Int64).alias("rank"),
                pl.lit(unit[2]).alias("source"),
            ),
            on=KEY,
            how="inner",
            suffix="_screen",
        )
        assert joined.height == want.height
        for row in joined.iter_rows(named=True):
            for col in ("err", "tol", "status"):
                assert _same(row[col], row[f"{col}_screen"]), (
                    row["record"],
                    row["io"],
                    row["index_path"],
                    col,
                    row[col],
                    row[f"{col}_screen"],
                )
        checked += joined.height
    if not scr.complex_units:
        assert checked == exact.height
    assert checked > 0 or scr.complex_units


@pytest.mark.parametrize("case", PAIRS, ids=lambda c: c["name"])
def test_verdict_equals_exact_path(sample_store, case):
    whole = divergence(compare_runs(sample_store, case["name"], case["ref"])).to_dict()
    assert divergence_by_steps(sample_store, case["name"], case["ref"]).to_dict() == whole
    assert divergence_by_steps(sample_store, case["name"], case["ref"], max_rows=1).to_dict() == whole
    assert divergence_in_batches(sample_store, case["name"], case["ref"]).to_dict() == whole


def test_records_in_one_run_only_are_compared_exactly(sample_store):
    """Units whose record sets differ go to the alignment path; the verdict still names the extra op."""
    case = next(c for c in PAIRS if c["name"] == "extra_gelu_stats")
    steps, ranks = _coverage(sample_store, case["name"], case["ref"])
    scr = screen(sample_store, case["name"], case["ref"], steps, ranks, Tolerances())
    assert scr.complex_units
    v = divergence_by_steps(sample_store, case["name"], case["ref"])
    assert v.to_dict() == divergence(compare_runs(sample_store, case["name"], case["ref"])).to_dict()
    assert v.culprit.kind == "extra_op" and v.unmatched


@pytest.fixture(scope="module")
def synth_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    man = synth().generate(
        root / "dumps",
        layers=20,
        steps=4,
        ranks=2,
        fault_step=1,
        fault_rank=1,
        fault_layer=12,
        jobs=1,
        log=lambda *a: None,
    )
    store = root / "store"
    for side in ("ref", "target"):
        ingest(root / "dumps" / side, side, store=store, jobs=1)
    return open_store(store), man


def test_synthetic_multi_step_multi_rank(synth_store):
    store, man = synth_store
    whole = divergence(compare_runs(store, "target", "ref"))
    new = divergence_by_steps(store, "target", "ref")
    assert new.to_dict() == whole.to_dict()
    assert new.to_dict() == divergence_in_batches(store, "target", "ref", max_rows=1).to_dict()
    assert divergence_by_steps(store, "target", "ref", max_rows=1).to_dict() == whole.to_dict()
    # the screen did the work: every unit paired by position, only the fault step's rank compared exactly
    steps, ranks = _coverage(store, "target", "ref")
    scr = screen(store, "target", "ref", steps, ranks, Tolerances())
    assert scr.complex_units == [] and scr.units.height == len(steps) * len(ranks)
    assert (new.first_divergence.step, new.first_divergence.rank) == (1, 1)
    assert new.first_divergence.op == "Functional.linear.12.forward" and new.culprit.kind == "op"
    assert [s["diverged"] > 0 for s in new.steps] == [False, True, True, True]


def test_synthetic_options(synth_store):
    """Steps, ranks and tolerances narrow the screen as they narrow compare_runs."""
    store, _ = synth_store
    for opts in (
        {"steps": [2, 3]},
        {"ranks": [0]},
        {"tolerances": Tolerances.parse(["1e-1"])},
        {"steps": [1], "ranks": [1], "tolerances": Tolerances.parse(["float32=1e-2"])},
    ):
        whole = divergence(compare_runs(store, "target", "ref", **opts)).to_dict()
        assert divergence_by_steps(store, "target", "ref", **opts).to_dict() == whole, opts


def test_repeated_leaf_keys_fall_back(dump_writer, store_dir):
    """A record with two leaves of the same (io, index path) pairs as a cross product in the exact path; the
    screen must not pair it by position."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    for name, scale in (("ref", 1.0), ("target", 1.5)):
        w = dump_writer(name, task="statistics")
        w.write(
            {
                "Functional.relu.0.forward": {"input_args": [x], "input": [y], "output": [np.maximum(x, 0) * scale]},
                "Functional.gelu.0.forward": {"input_args": [x], "output": [x * scale]},
            }
        )
        ingest(w.root, name, store=store_dir, jobs=1)
    store = open_store(store_dir)
    scr = screen(store, "target", "ref", [0], [0], Tolerances())
    assert scr.complex_units == [(0, 0)]
    assert (
        divergence_by_steps(store, "target", "ref").to_dict()
        == divergence(compare_runs(store, "target", "ref")).to_dict()
    )

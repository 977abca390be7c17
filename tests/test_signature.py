"""Argument signatures (analysis/signature.py) and repeated calls placed by their values (analysis/align_repeats.py,
analysis/extra_chain.py), on small hand-made msprobe dumps."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from dumpstore._ingest import ingest
from dumpstore.analysis._divergence import divergence, divergence_by_steps
from dumpstore.analysis.align_repeats import agreeing, place_by_values, tolerance_of
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.signature import one_run_tensor
from dumpstore.cli.main import main
from dumpstore.store import open_store

RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3, 8)).astype(np.float32)
W = (RNG.standard_normal((4, 8)) * 0.3).astype(np.float32)
B = np.zeros(4, np.float32)  # a bias that starts at zero: the outputs agree at the first step
Y = X @ W.T


def _linear_pair(dump_writer, store_dir, target_args: list) -> object:
    ref, tgt = dump_writer("ref"), dump_writer("target")
    for w, args in ((ref, [X, W, B]), (tgt, target_args)):
        w.write(
            {
                "Functional.linear.0.forward": {"input_args": args, "output": [Y]},
                "Functional.gelu.0.forward": {"input_args": [Y], "output": [Y * 0.5]},
            }
        )
    ingest(ref.root, "ref", store=store_dir, jobs=1)
    ingest(tgt.root, "target", store=store_dir, jobs=1)
    return open_store(store_dir)


@pytest.mark.parametrize(
    "target_args, shown",
    [([X, W, None], "None in the target"), ([X, W], "not given in the target")],
    ids=["none", "left_out"],
)
def test_bias_given_in_one_run_only_is_named(dump_writer, store_dir, target_args, shown):
    """Outputs equal, the bias a tensor in the reference only: a signature culprit at that step, not quiet."""
    store = _linear_pair(dump_writer, store_dir, target_args)
    v = divergence(compare_runs(store, "target", "ref"))
    c = v.culprit
    assert (c.step, c.op, c.name, c.kind) == (
        0,
        "Functional.linear.0.forward",
        "Functional.linear.0.forward.input.2",
        "signature",
    )
    assert c.detail == (
        f"bias given in the reference only: {shown}, a float32 tensor [4] in the reference (the call's argument "
        "list differs)"
    )
    assert c.evidence == {
        "argument": "bias",
        "scalar": "Functional.linear.0.forward.input.2",
        "given_in": "reference",
        "outputs": "within tolerance",
    }
    assert (v.first_divergence.op, v.first_divergence.kind) == ("Functional.linear.0.forward", "signature")
    # the screened path (runs over max_rows) details the unit where a tensor meets None (analysis/screen.py `args`)
    screened = divergence_by_steps(store, "target", "ref", max_rows=1)
    assert screened.culprit == c and screened.first_divergence == v.first_divergence


def test_signature_before_the_value_it_changes(dump_writer, store_dir):
    """A bias that is not zero: the outputs differ too; the argument is the culprit, the output the first
    divergence."""
    ref, tgt = dump_writer("ref"), dump_writer("target")
    bias = np.full(4, 0.5, np.float32)
    ref.write({"Functional.linear.0.forward": {"input_args": [X, W, bias], "output": [Y + bias]}})
    tgt.write({"Functional.linear.0.forward": {"input_args": [X, W, None], "output": [Y]}})
    ingest(ref.root, "ref", store=store_dir, jobs=1)
    ingest(tgt.root, "target", store=store_dir, jobs=1)
    v = divergence(compare_runs(open_store(store_dir), "target", "ref"))
    assert (v.culprit.kind, v.culprit.name) == ("signature", "Functional.linear.0.forward.input.2")
    assert "outputs" not in v.culprit.evidence
    fd = v.first_divergence
    assert (fd.kind, fd.op, fd.name) == ("value", "Functional.linear.0.forward", "Functional.linear.0.forward.output.0")


def test_signature_explained_in_the_cli(dump_writer, store_dir):
    _linear_pair(dump_writer, store_dir, [X, W, None])
    out = CliRunner().invoke(main, ["divergence", "--store", str(store_dir), "--target", "target", "--ref", "ref"])
    assert out.exit_code == 0, out.output
    assert "CULPRIT (signature): step 0 rank 0  Functional.linear.0.forward  input.2" in out.output
    assert "argument: bias = not given (the default) (target) vs a tensor (reference)" in out.output


def test_same_arguments_stay_quiet(dump_writer, store_dir):
    store = _linear_pair(dump_writer, store_dir, [X, W, B])
    v = divergence(compare_runs(store, "target", "ref"))
    assert v.culprit is None and v.first_divergence is None


def test_what_counts_as_a_signature_difference():
    """Top-level inputs of forward records only, tensor against None or absent; a list element, a dtype or shape, a
    number against a tensor, an output, a backward record's gradient: not (the data or the compute dtype decide
    them)."""
    rows = pl.DataFrame(
        {
            "index_path": ["2", None, "0.3", "bias", "1", "1", "0", "weight"],
            "ref_index_path": ["2", "2", None, "bias", "1", "1", "0", "weight"],
            "kind": ["null", None, "tensor", "tensor", "scalar", "tensor", "tensor", None],
            "ref_kind": ["tensor", "tensor", None, "null", "tensor", "tensor", None, "tensor"],
            "_io": ["input", "input", "input", "input", "input", "input", "output", "parameters"],
            "_paired": [True] * 8,
            "_direction": ["forward"] * 8,
        }
    )
    got = rows.select(one_run_tensor()).to_series().to_list()
    assert got == [True, True, False, True, False, False, False, True]
    for col, value in (("_paired", False), ("_direction", "backward")):
        other = rows.with_columns(pl.lit(value).alias(col))
        assert not any(other.select(one_run_tensor()).to_series().to_list())


# ------------------------------------------------------------------------------------------------ repeats


def test_insertion_placed_where_the_pairs_agree():
    """a = sub div sub div conv, b = sub div conv: the names alone put the extras first; the values second."""
    a, b = ["sub", "div", "sub", "div", "conv"], ["sub", "div", "conv"]
    names = [(2, 0), (3, 1), (4, 2)]  # difflib's longest block
    agree = {(0, 0): 2, (1, 1): 2, (4, 2): 1}
    got = place_by_values(names, (a, b), lambda i, j: agree.get((i, j), 0))
    assert got == [(0, 0), (1, 1), (4, 2)]
    # a tie (a repeat of equal values) keeps the names' placement
    assert place_by_values(names, (a, b), lambda i, j: 1) == names
    # a deletion is the same with the runs swapped
    swapped = place_by_values([(j, i) for i, j in names], (b, a), lambda j, i: agree.get((i, j), 0))
    assert swapped == [(0, 0), (1, 1), (2, 4)]
    # at the end of a sequence: x y y against x y
    assert place_by_values([(0, 0), (1, 1)], (["x", "y", "y"], ["x", "y"]), lambda i, j: i == 2) == [(0, 0), (2, 1)]
    # no repeat around the insertion: nothing to choose
    assert place_by_values([(0, 0), (2, 1)], (["x", "z", "y"], ["x", "y"]), lambda i, j: 5) == [(0, 0), (2, 1)]


def test_agreeing_counts_leaves_within_their_tolerance():
    tol = tolerance_of("float32", {"float32": 2.0**-13, "bfloat16": 2.0**-6}.__getitem__)
    leaf = ("float32", 4, -1.0, 1.0, 0.0, 2.0)
    near = ("float32", 4, -1.0, 1.0, 0.0, 2.0 + 1e-4)  # 5e-5 of the norm: within float32's 1.2e-4
    far = ("float32", 4, -1.0, 1.0, 0.0, 2.01)  # 5e-3
    a = {("input", "0"): leaf, ("output", "0"): far}
    assert agreeing(a, {("input", "0"): near, ("output", "0"): leaf}, tol) == 1
    assert agreeing(a, {("input", "0"): far}, tol) == 0
    # at a bfloat16 compute precision the same 5e-3 agrees
    assert agreeing(a, {("output", "0"): leaf}, tolerance_of("bfloat16", {"bfloat16": 2.0**-6}.get)) == 1


IMG = RNG.random((2, 3, 4, 4)).astype(np.float32)


def _normalise(w, times: int) -> None:
    recs, x = {}, IMG
    for k in range(times):
        s = x - np.float32(0.5)
        recs[f"Tensor.__sub__.{k}.forward"] = {"input_args": [x, {"type": "float", "value": 0.5}], "output": [s]}
        x = s / np.float32(0.25)
        recs[f"Tensor.__truediv__.{k}.forward"] = {"input_args": [s, {"type": "float", "value": 0.25}], "output": [x]}
    recs["Functional.relu.0.forward"] = {"input_args": [x], "output": [np.maximum(x, 0)]}
    w.write(recs)


@pytest.mark.parametrize("doubled, kind", [("target", "extra_op"), ("ref", "missing_op")])
def test_repeated_calls_aligned_by_values(dump_writer, store_dir, doubled, kind):
    """One run normalises twice: the first sub/div pair makes the same values in both runs, so the second pair is
    the one in one run only, and its sub, the first of the chain, is the culprit."""
    for run in ("target", "ref"):
        _normalise(dump_writer(run), 2 if run == doubled else 1)
        ingest(store_dir.parent / run, run, store=store_dir, jobs=1)
    cmp = compare_runs(open_store(store_dir), "target", "ref")
    pairs = {(r["t_record"], r["r_record"]) for r in cmp.records.iter_rows(named=True)}
    first, second = (
        ("Tensor.__sub__.0.forward", "Tensor.__truediv__.0.forward"),
        (
            "Tensor.__sub__.1.forward",
            "Tensor.__truediv__.1.forward",
        ),
    )
    one_side = [(s, None) if doubled == "target" else (None, s) for s in second]
    assert pairs == {*[(s, s) for s in first], ("Functional.relu.0.forward",) * 2, *one_side}
    v = divergence(cmp)
    c = v.culprit
    assert (c.step, c.op, c.kind) == (0, "Tensor.__sub__.1.forward", kind)
    assert c.evidence["chain"] == list(second)
    side = "target" if doubled == "target" else "reference"
    assert c.detail.startswith(
        f"only in the {side}, the first of 2 calls there that feed each other (Tensor.__sub__.1.forward -> "
        "Tensor.__truediv__.1.forward); Tensor.__truediv__.1.forward's output feeds Functional.relu.0.forward.input.0"
    )

"""A dtype difference carried from a recorded op through a view msprobe does not record (analysis/carried_dtype.py),
on small hand-made dump pairs in both dump modes: the runs' autocast policies differ on a batched `matmul` (float32
output in the target, float16 in the reference, on float16 inputs); its output reaches a `linear` through a
transpose and a reshape msprobe does not record; backward, the gradient of that output reaches the matmul's
backward through the cast autograd makes (not recorded either)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_dtype_change import _pair  # a pair written, ingested and judged

from dumpstore.analysis.carried_dtype import reduction_slack, same_values
from dumpstore.cli.compare_cmds import noise_line
from dumpstore.summary import tensor_stats
from helpers import leaf

H, T, E = 4, 32, 8  # heads, tokens, head size: the linear reads T x (H E)


def _merged(o: np.ndarray) -> np.ndarray:
    """The heads merged: a transpose and a reshape (a contiguous copy), which msprobe does not record."""
    return np.ascontiguousarray(o.transpose(1, 0, 2)).reshape(T, H * E)


def _copy_leaf(arr: np.ndarray, mode: str) -> np.ndarray | dict:
    """The merged tensor as its consumer's input.  In statistics mode a float32 tensor's leaf carries the
    dumper's statistics summed in the copy's order: its norm one float32 ulp off the producer's (tensor mode
    recomputes them from the file, in the file's order: `_model`'s draw moves the float64 statistics)."""
    if mode == "tensor" or arr.dtype != np.float32:
        return arr
    lf = leaf(arr)
    lf["Norm"] = float(np.nextafter(np.float32(lf["Norm"]), np.float32(np.inf)))
    return lf


def _moved(seed: int, matmul_out: str) -> bool:
    """Whether draw `seed`'s merged copy (of a `matmul_out` matmul output) has other float64 statistics than the
    output itself: the sums run in another order, whose rounding depends on the CPU's vector width."""
    rng = np.random.default_rng(seed)
    rng.normal(size=(T, H * E))  # the draw of `_model` up to its matmul: x, a, b
    a = rng.normal(size=(H, T, E)).astype("float16")
    b = (rng.normal(size=(H, E, E)) / 3).astype("float16")
    o = (a.astype(np.float32) @ b.astype(np.float32)).astype(matmul_out)
    so, sm = tensor_stats(o, o.dtype.name), tensor_stats(_merged(o), matmul_out)
    return (so.mean, so.norm) != (sm.mean, sm.norm)


@functools.cache
def _premise_seed() -> int:
    """The first draw whose float32 merged copy moves the float64 statistics and whose float16 one does not (the
    premise, `test_the_merged_copy_moves_the_target_statistics`): which draws do depends on the CPU (numpy sums
    float32 in blocks as wide as its vectors), so it is found here, not fixed."""
    return next(s for s in range(100) if _moved(s, "float32") and not _moved(s, "float16"))


def _model(mode: str, matmul_out: str, consumer_in: str, scale: float = 1.0, gelu_in: str = "float16") -> dict:
    """GELUs (the noise baseline), a batched matmul on float16 inputs whose output is `matmul_out` (scaled by
    `scale`: a kernel error), the heads merged without a record and read by a linear as `consumer_in` (another
    dtype than the matmul's output: a cast msprobe does not record), a GELU reading the linear's output as
    `gelu_in` (float32: a cast the code makes, not recorded); backward, the linear's and the
    matmul's, the gradient reaching the matmul in the dtype of its output."""
    rng = np.random.default_rng(_premise_seed())
    x = rng.normal(size=(T, H * E)).astype("float16")
    a = rng.normal(size=(H, T, E)).astype("float16")
    b = (rng.normal(size=(H, E, E)) / 3).astype("float16")
    w = (rng.normal(size=(H * E, H * E)) / 6).astype("float16")
    recs: dict = {
        f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [(x * 0.5 * (i + 1)).astype("float16")]}
        for i in range(4)
    }
    o = (a.astype(np.float32) @ b.astype(np.float32) * scale).astype(matmul_out)
    recs["Torch.matmul.0.forward"] = {"input_args": [a, b], "output": [o]}
    m = _merged(o).astype(consumer_in)
    y = (m.astype(np.float32) @ w.T.astype(np.float32)).astype("float16")
    recs["Functional.linear.0.forward"] = {"input_args": [_copy_leaf(m, mode), w], "output": [y]}
    g = y.astype(gelu_in)
    recs["Functional.gelu.4.forward"] = {"input_args": [g], "output": [(g * 0.5).astype("float16")]}
    gy = (rng.normal(size=(T, H * E)) / 10).astype("float16")
    gm = (gy.astype(np.float32) @ w.astype(np.float32)).astype("float16")
    gw = (gy.astype(np.float32).T @ m.astype(np.float32)).astype("float16")
    recs["Functional.linear.0.backward"] = {"input": [gy], "output": [gm, gw]}
    go = gm.reshape(T, H, E).transpose(1, 0, 2).astype(matmul_out)  # autograd's cast to the output's dtype
    ga = (go.astype(np.float32) @ b.transpose(0, 2, 1).astype(np.float32)).astype("float16")
    gb = (a.transpose(0, 2, 1).astype(np.float32) @ go.astype(np.float32)).astype("float16")
    recs["Torch.matmul.0.backward"] = {"input": [go], "output": [ga, gb]}
    return recs


def test_the_merged_copy_moves_the_target_statistics():
    """The premise: the target's float32 merged copy does not keep the matmul output's exact statistics (so the
    exact view fingerprint cannot link it in the target) while the float16 copy does (float16 values sum exactly
    in float64)."""
    ref, target = _model("tensor", "float16", "float16"), _model("tensor", "float32", "float32")
    for recs, moved in ((target, True), (ref, False)):
        o = recs["Torch.matmul.0.forward"]["output"][0]
        m = recs["Functional.linear.0.forward"]["input_args"][0]
        so, sm = tensor_stats(o, o.dtype.name), tensor_stats(m, m.dtype.name)
        assert (so.min, so.max) == (sm.min, sm.max)
        assert ((so.mean, so.norm) != (sm.mean, sm.norm)) is moved


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
@pytest.mark.parametrize("wide", ["target", "ref"])
def test_a_dtype_carried_through_an_unrecorded_view_is_noted(dump_writer, store_dir, mode, wide):
    """The matmul's output dtype differs (a policy, on equal inputs; float32 in the `wide` run); the linear reads
    it through an unrecorded transpose and reshape: no producer links it in the float32 run, the float16 run's
    view does, and the float32 run's matmul output holds the linear's input values: carried, not a cast left
    out; its values agree: quiet, the difference listed as a note (the linear, and the matmul's backward by the
    forward output's dtype)."""
    narrow, broad = _model(mode, "float16", "float16"), _model(mode, "float32", "float32")
    target, ref = (broad, narrow) if wide == "target" else (narrow, broad)
    v = _pair(dump_writer, store_dir, mode, ref, target)
    assert v.culprit is None and v.first_divergence is None
    dtypes = ("float32", "float16") if wide == "target" else ("float16", "float32")
    notes = [(n["op"], n["input"], n["dtype"], n["ref_dtype"], n["from"]) for n in v.noise["carried_dtypes"]]
    assert notes == [
        ("Functional.linear.0.forward", "Functional.linear.0.forward.input.0", *dtypes, "Torch.matmul.0.forward"),
        ("Torch.matmul.0.backward", "Torch.matmul.0.backward.input.0", *dtypes, "Torch.matmul.0.forward"),
    ]
    assert "; 2 inputs differ in dtype, carried from a recorded op's output (first: step 0 rank 0 " in noise_line(
        v.to_dict()
    )


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_a_cast_after_the_view_is_still_named(dump_writer, store_dir, mode):
    """The matmul outputs float16 in both runs; the target's code casts the merged heads to float32 before the
    linear (msprobe records no cast): the difference is not the matmul's, the linear computes in another dtype
    (named by its dtype)."""
    v = _pair(dump_writer, store_dir, mode, _model(mode, "float16", "float16"), _model(mode, "float16", "float32"))
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind, c.metric) == (0, "Functional.linear.0.forward", "op", "dtype")
    assert (c.name, c.evidence["dtype"], c.evidence["ref_dtype"]) == (
        "Functional.linear.0.forward.input.0",
        "float32",
        "float16",
    )


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_a_cast_elsewhere_in_a_pair_whose_policies_differ_is_named(dump_writer, store_dir, mode):
    """The policies differ on the matmul (carried to the linear: no finding there) and the target's code casts
    the linear's output to float32 before a GELU: that input's producer, the linear, outputs float16 in both
    runs, so its dtype is no carried difference: the GELU is named by its dtype (a pair-level switch would
    have hidden it)."""
    v = _pair(
        dump_writer,
        store_dir,
        mode,
        _model(mode, "float16", "float16"),
        _model(mode, "float32", "float32", gelu_in="float32"),
    )
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind, c.metric) == (0, "Functional.gelu.4.forward", "op", "dtype")
    assert c.name == "Functional.gelu.4.forward.input.0"


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_a_carried_dtype_beyond_the_noise_names_the_op_that_computed_in_it(dump_writer, store_dir, mode):
    """The matmul's output dtype differs as in the quiet pair, but the target's float32 kernel is 2 % off: the
    linear's input is carried (no dtype finding there), and the values name the matmul, the op that first
    computed in the other dtype."""
    v = _pair(
        dump_writer,
        store_dir,
        mode,
        _model(mode, "float16", "float16"),
        _model(mode, "float32", "float32", scale=1.02),
    )
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind, c.metric) == (0, "Torch.matmul.0.forward", "op", "rel_l2")


def test_same_values_bounds_a_reduction_in_another_order():
    """Exact: the slack of a 1024-element float32 sum (mean in norms: 1023 u / 32; norm relative: 1023 u / 2),
    and what it lets through: the norm one ulp off yes, the max one ulp off or another dtype no."""
    u = 2.0**-24
    assert reduction_slack("float32", 1024) == (1023 * u / 32, 1023 * u / 2)
    a = {"dtype": "float32", "numel": 1024, "min": -1.0, "max": 2.0, "mean": 0.1, "norm": 30.0}
    assert same_values(a, a | {"norm": float(np.nextafter(np.float32(30.0), np.float32(31.0)))}, "")
    assert not same_values(a, a | {"max": float(np.nextafter(np.float32(2.0), np.float32(3.0)))}, "")
    assert not same_values(a, a | {"dtype": "float16"}, "")
    assert not same_values(a, a | {"norm": 30.0 * (1 + 1024 * u)}, "")

"""The gradient of a broadcast operand (rules.broadcast_sums, small_value_err's `sums`): a bias's gradient is the
incoming gradient summed over the K positions the bias was broadcast to, and where those terms cancel (an attention
key bias: zero in exact arithmetic) it holds only their rounding, K terms' worth.  It is judged by absolute error on
the scale of K uncorrelated terms, never finer.  On real dump pairs (both modes) of an attention key projection's
backward whose key gradient comes from a float64 attention, rounded to float16 once per device."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from test_noise import MODES, _ingest_pair

from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.rules import SUBNORMAL_BELOW, broadcast_sums, module_grad_search

ROWS, HID = 48, 32  # 6 series x 8 patches (set 8's PatchTST key projection), hidden 32
KEY = "Functional.linear.0.backward"


def _key_gradient(seed: int = 0) -> np.ndarray:
    """dK = dS^T Q / sqrt(d) of one attention head over 48 tokens, float64, scaled to rms ~1e-4 (a loss-scaled
    float16 gradient).  dS = P * (dP - rowsum(P * dP)): each query's row sums to zero, so the sum of dK over the
    keys, the key bias's gradient, is zero in exact arithmetic."""
    rng = np.random.default_rng(seed)
    q, k, d_out, v = (rng.normal(size=(ROWS, HID)) for _ in range(4))
    s = q @ k.T / np.sqrt(HID)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dp = d_out @ v.T
    ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))
    dk = ds.T @ q / np.sqrt(HID)
    return dk * (1e-4 / np.sqrt((dk**2).mean()))


def _device(dk: np.ndarray, seed: int | None) -> np.ndarray:
    """dK in float16 as a device rounds it: the reference to nearest (seed None), the target one float16 rounding
    apart from it on about half the elements (another accumulation order)."""
    out = dk.astype(np.float16)
    if seed is not None:
        flip = np.random.default_rng(seed).random(out.shape) < 0.5
        towards = np.where(dk > out, np.inf, -np.inf).astype(np.float16)  # the other neighbour of dk
        out = np.where(flip, np.nextafter(out, towards), out)
    return out


def _backward(dk16: np.ndarray, bias_grad: np.ndarray | None = None) -> dict:
    """The key projection's `F.linear` backward record: the gradient it was given (dK, [6, 8, 32]), its input's
    gradient and the bias's, the sum of dK over the tokens in float32 rounded to float16 once."""
    g = dk16.reshape(6, 8, HID)
    w = np.random.default_rng(7).normal(size=(HID, HID)).astype(np.float16) * np.float16(0.2)
    dx = (g.astype(np.float32) @ w.astype(np.float32)).astype(np.float16)
    db = g.astype(np.float32).sum(axis=(0, 1)).astype(np.float16) if bias_grad is None else bias_grad
    return {KEY: {"input": [g], "output": [dx, db]}}


def _bias_row(cmp) -> dict:
    rows = cmp.rows.filter((cmp.rows["record"] == KEY) & (cmp.rows["io"] == "output") & (cmp.rows["index_path"] == "1"))
    return rows.row(0, named=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_key_bias_gradient_is_judged_as_the_sum_of_its_terms(dump_writer, store_dir, mode):
    dk = _key_gradient()
    ref16, tgt16 = _device(dk, None), _device(dk, 1)
    ref, tgt = _backward(ref16), _backward(tgt16)
    db_r = ref[KEY]["output"][1].astype(np.float64)
    db_t = tgt[KEY]["output"][1].astype(np.float64)
    # the premise: both are rounding residue below float16's smallest normal, and on that scale (the subnormal
    # rule alone) they differ by several float16 tolerances: named as an op before this rule
    tiny = SUBNORMAL_BELOW["float16"]
    assert np.sqrt((db_r**2).mean()) < tiny and np.sqrt((db_t**2).mean()) < tiny
    on_tiny = np.linalg.norm(db_t - db_r) / (np.sqrt(HID) * tiny)
    assert on_tiny > 3 * 2.0**-10
    st = _ingest_pair(dump_writer, store_dir, mode, ref, tgt)
    cmp = compare_runs(st, "target", "ref")
    row = _bias_row(cmp)
    assert row["status"] == "pass" and "sum of 48 terms" in row["detail"]
    # judged on the scale of 48 terms of dK's rms: sqrt(48) x rms(dK)
    scale = np.sqrt(48) * np.sqrt((ref16.astype(np.float64) ** 2).mean())
    assert row["context_rms"] == pytest.approx(scale, rel=1e-3)
    if mode == "tensor":  # the exact error on that scale
        assert row["err"] == pytest.approx(np.linalg.norm(db_t - db_r) / (np.sqrt(HID) * scale), rel=1e-3)
    assert divergence(cmp).culprit is None


@pytest.mark.parametrize("mode", MODES)
def test_a_bias_gradient_that_leaves_out_a_token_is_still_named(dump_writer, store_dir, mode):
    """The target's kernel sums 47 of the 48 tokens: the bias gradient moves by one token's dK row, about
    1/sqrt(48) of the sum scale (0.108: 111 float16 tolerances)."""
    dk = _key_gradient()
    ref16, tgt16 = _device(dk, None), _device(dk, 1)
    short = tgt16.astype(np.float32)[:-1].sum(axis=0).astype(np.float16)
    st = _ingest_pair(dump_writer, store_dir, mode, _backward(ref16), _backward(tgt16, short))
    cmp = compare_runs(st, "target", "ref")
    row = _bias_row(cmp)
    assert row["status"] == "diverged" and row["err"] > 100 * 2.0**-10
    if mode == "tensor":
        db_r = ref16.astype(np.float32).sum(axis=0).astype(np.float16).astype(np.float64)
        scale = np.sqrt(48) * np.sqrt((ref16.astype(np.float64) ** 2).mean())
        assert row["err"] == pytest.approx(np.linalg.norm(short - db_r) / (np.sqrt(HID) * scale), rel=1e-3)
    v = divergence(cmp)
    assert v.culprit is not None and v.culprit.op == KEY and v.culprit.kind == "op"


def test_broadcast_sums_by_shape():
    """A bias [32] and a position table [8, 32] broadcast to [6, 8, 32] (K = 48 and 6); a weight [32, 32] and the
    input's own gradient do not; forward records' outputs are no gradients."""
    shapes = [[6, 8, 32], [6, 8, 32], [32], [8, 32], [32, 32], [1, 1, 32], [6, 8, 32], [32]]
    group = np.array([0, 0, 0, 0, 0, 0, 1, 1])
    grad_in = np.array([True, False, False, False, False, False, True, False])
    grad_out = np.array([False, True, True, True, True, True, False, False])  # row 7: a forward output
    src, terms = broadcast_sums(group, grad_in, grad_out, pl.Series(shapes))
    assert src.tolist() == [-1, -1, 0, 0, -1, 0, -1, -1]
    assert terms.tolist() == [1.0, 1.0, 48.0, 6.0, 1.0, 48.0, 1.0, 1.0]


def test_a_modules_parameter_gradients_search_its_one_backward_record():
    """A Linear's parameters_grad leaves are sums of the gradient its backward record was given; a module with two
    backward calls (micro-batches) accumulates over both and is not linked."""
    group = np.array([0, 0, 1, 1, 2, 3, 4, 5])
    direction = np.array(
        ["parameters_grad", "parameters_grad", "backward", "backward", "parameters_grad", "backward", "backward", "x"]
    )
    api = np.array(["m.k.Linear"] * 4 + ["m.q.Linear"] * 3 + ["m.k.Linear"])
    pgrad, search = module_grad_search(group, direction, api)
    assert pgrad.tolist() == [True, True, False, False, False, False, False, False]
    assert search.tolist() == [1, 1, -1, -1, -1, -1, -1, -1]
    shapes = [[32, 32], [32], [6, 8, 32], [6, 8, 32], [32], [6, 8, 32], [6, 8, 32], [32]]
    grad_in = np.array([False, False, True, False, False, True, True, False])
    src, terms = broadcast_sums(group, grad_in, (direction == "backward") & ~grad_in | pgrad, pl.Series(shapes), search)
    assert src.tolist()[:2] == [-1, 2] and terms.tolist()[:2] == [1.0, 48.0]

"""Data flow within a step (issue 23): what a near-tie flip explains downstream (analysis/flipflow.py), and integer
inputs that msprobe's statistics hide (analysis/hidden_index.py), on small hand-made dump pairs."""

from __future__ import annotations

import numpy as np
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence, rank_rows
from dumpstore.analysis.rules import stats_bound
from helpers import leaf

MODES = ("tensor", "statistics")
T, D = 16, 8  # tokens, hidden size


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _int(a: np.ndarray, mode: str):
    """An integer tensor as msprobe dumps it: the array (tensor mode) or its max/min only (statistics mode)."""
    return a if mode == "tensor" else leaf(a, stats=("Max", "Min"))


def _comparison(dump_writer, store_dir, mode: str, ref: list[dict], target: list[dict]):
    for name, steps in (("ref", ref), ("target", target)):
        w = dump_writer(name, mode)
        for i, recs in enumerate(steps):
            w.write(recs, step=i)
        ingest(w.root, name, store=store_dir, jobs=1)
    return compare_runs(open_store(store_dir), "target", "ref")


def _pair(dump_writer, store_dir, mode: str, ref: list[dict], target: list[dict]):
    return divergence(_comparison(dump_writer, store_dir, mode, ref, target))


def _moe(mode: str, flipped: bool, *, fresh_fault: float = 0.0, grad_scale: float = 1.0) -> dict:
    """Noisy float ops, a top-2 router whose token 0 is tied between experts 1 and 2 (the target picks the other
    one when `flipped`), the expert counts (integer, through unrecorded ops), the combine of the expert outputs
    (row 0 differs after a flip), an op after it, an op on agreeing inputs (`fresh_fault`: its output off by
    that share), and a backward record whose gradient arrives through unrecorded ops (`grad_scale`: in the
    target, that gradient's row 0 is off by that factor more)."""
    rng = np.random.default_rng(11)
    x = _f32(rng.normal(size=(T, D)))
    noise = 1e-6 if flipped or fresh_fault or grad_scale != 1.0 else 0.0
    recs: dict = {
        f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [_f32(x * (1 + noise * (i + 1)))]}
        for i in range(4)
    }
    scores = _f32(np.abs(rng.normal(size=(T, 4))))
    scores[0] = [5.0, 1.0, 1.0, 0.1]  # token 0: experts 1 and 2 tied for second place
    idx = np.argsort(-scores, axis=1, kind="stable")[:, :2]
    if flipped:
        idx[0, 1] = 2
    vals = np.take_along_axis(scores, idx, 1)
    recs["Torch.topk.0.forward"] = {
        "input_args": [scores, {"type": "int", "value": 2}],
        "output": [_f32(vals), _int(idx.astype(np.int64), mode)],
    }
    mask = np.zeros((4, 2, T), dtype=np.int64)  # one_hot(idx).permute(2, 1, 0), made by ops msprobe does not record
    for t in range(T):
        for k in range(2):
            mask[idx[t, k], k, t] = 1
    recs["Tensor.sum.0.forward"] = {
        "input_args": [_int(mask, mode), {"type": "int", "value": -1}],
        "output": [_int(mask.sum(axis=(1, 2)), mode)],
    }
    experts = _f32(rng.normal(size=(4, T, D)))
    combined = _f32(sum(experts[idx[:, k], np.arange(T)] for k in range(2)))
    tokens = np.nonzero((idx == 1).any(axis=1))[0].astype(np.int64)  # the tokens expert 1 got (torch.where)
    recs["Tensor.index_add_.0.forward"] = {  # data-dependent shapes: expert 1 lost token 0 after the flip
        "input_args": [_f32(np.zeros((T, D))), {"type": "int", "value": 0}, _int(tokens, mode), experts[1, tokens]],
        "output": [combined],
    }
    recs["Functional.silu.0.forward"] = {"input_args": [combined], "output": [_f32(combined / (1 + np.exp(-combined)))]}
    y = _f32(x * 0.5)
    recs["Tensor.mul.0.forward"] = {
        "input_args": [x, {"type": "float", "value": 0.5}],
        "output": [_f32(y * (1 + fresh_fault))],
    }
    grad = _f32(rng.normal(size=(T, D)))
    if flipped:
        grad[0] = _f32(grad[0] * (1 + 0.5 * grad_scale))
    recs["Functional.silu.0.backward"] = {"input": [grad], "output": [_f32(grad * 0.5)]}
    return recs


@pytest.mark.parametrize("mode", MODES)
def test_what_a_near_tie_flip_feeds_is_explained_by_it(dump_writer, store_dir, mode):
    """The counts, the combine, the op after it and a gradient arriving through unrecorded ops all differ after
    the flip, within what the flip's first consequences show: noise, the flip noted."""
    v = _pair(dump_writer, store_dir, mode, [_moe(mode, False)], [_moe(mode, True)])
    assert v.culprit is None and v.first_divergence is None
    assert v.noise["discrete_flips"][0]["op"] == (
        "Torch.topk.0.forward" if mode == "tensor" else "Tensor.sum.0.forward"
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_fault_on_agreeing_inputs_after_a_flip_is_found(dump_writer, store_dir, mode):
    """An op whose inputs agree is not fed by the flip: judged as any other."""
    v = _pair(dump_writer, store_dir, mode, [_moe(mode, False)], [_moe(mode, True, fresh_fault=0.05)])
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mul.0.forward", "op")


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_far_beyond_what_the_flip_explains_is_found(dump_writer, store_dir, mode):
    """A gradient reaching the backward through unrecorded ops, its error 20x what the flip showed downstream:
    not explained by the flip."""
    v = _pair(dump_writer, store_dir, mode, [_moe(mode, False)], [_moe(mode, True, grad_scale=200.0)])
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Functional.silu.0.backward", "input")


def _table(rng) -> np.ndarray:
    """Rows that differ by 1 %: one id changed moves the embedding's output by ~0.2 %, below a bf16 tolerance."""
    return _f32(1 + 0.01 * rng.normal(size=(96, D)))


def _embedding_step(ids: np.ndarray, table: np.ndarray, mode: str, bf16_ops: int = 6) -> dict:
    """An embedding (fp32 table, integer ids) and `bf16_ops` bfloat16 ops after it (a bf16 autocast run: the run's
    compute floor is bfloat16)."""
    out = _f32(table[ids])
    recs = {"Functional.embedding.0.forward": {"input_args": [_int(ids, mode), table], "output": [out]}}
    h = out.reshape(-1, out.shape[-1])
    for i in range(bf16_ops):
        recs[f"Tensor.__mul__.{i}.forward"] = {
            "input_args": [leaf(h, dtype="bfloat16"), {"type": "float", "value": 2.0}],
            "output": [leaf(h * 2, dtype="bfloat16")],
        }
    return recs


def _ids(changed: bool) -> np.ndarray:
    ids = (np.arange(2 * T, dtype=np.int64).reshape(2, T) * 3) % 95 + 1
    ids[0, 0], ids[1, 0] = 0, 95  # the batch's max and min are fixed
    if changed:
        ids[0, 5] += 1  # one token id +1, inside the range
    return ids


def test_token_ids_hidden_by_max_min_are_data_at_the_embedding(dump_writer, store_dir):
    """Statistics keep only max/min of the ids: one id changed inside the range leaves both equal.  The
    embedding copies rows and does no arithmetic: its output differs far beyond what its table explains (and
    below the run's bf16 floor), so the ids differ: `input`, at step 1 where it happened."""
    table = _table(np.random.default_rng(12))
    ref = [_embedding_step(_ids(False), table, "statistics") for _ in range(2)]
    tgt = [_embedding_step(_ids(False), table, "statistics"), _embedding_step(_ids(True), table, "statistics")]
    v = _pair(dump_writer, store_dir, "statistics", ref, tgt)
    assert v.culprit is not None
    assert (v.culprit.step, v.culprit.op, v.culprit.kind) == (1, "Functional.embedding.0.forward", "input")
    assert v.culprit.evidence["differing"] == "Functional.embedding.0.forward.input.0"
    assert v.culprit.value < 0.015625  # under the bf16 floor: only the gather rule sees it


def test_the_same_ids_and_a_noisy_table_stay_quiet(dump_writer, store_dir):
    """The table differs by optimizer noise at step 1 (1e-6 relative): the copied rows differ as much, no more."""
    rng = np.random.default_rng(12)
    table = _table(rng)
    noisy = _f32(table * (1 + 1e-6 * rng.normal(size=table.shape)))
    ref = [_embedding_step(_ids(False), table, "statistics") for _ in range(2)]
    tgt = [_embedding_step(_ids(False), table, "statistics"), _embedding_step(_ids(False), noisy, "statistics")]
    v = _pair(dump_writer, store_dir, "statistics", ref, tgt)
    assert v.culprit is None


def test_an_integer_mean_that_differs_is_a_differing_value():
    """Some msprobe versions keep the mean of an integer tensor (no norm): a mean that differs by 1/n is a
    differing value, not rounding."""
    nan = np.array([np.nan])
    t = {"max": np.array([95.0]), "min": np.array([0.0]), "mean": np.array([47.03125]), "norm": nan}
    r = {"max": np.array([95.0]), "min": np.array([0.0]), "mean": np.array([47.0]), "norm": nan}
    nulls = {s: np.isnan(t[s]) for s in t}
    err, known = stats_bound(t, r, nulls, nulls, np.array([np.sqrt(32.0)]), np.zeros(1, dtype=bool))
    assert known[0] and err[0] == pytest.approx(0.03125 / 95.0)


def test_indices_and_shapes_changed_downstream_rank_as_carriers(dump_writer, store_dir):
    """compare's significance: after float error, a changed index, mask or data-dependent shape carries it
    (significance 1); the faulty op on agreeing inputs tops the list, not the flip's integer consequences."""
    cmp = _comparison(
        dump_writer, store_dir, "tensor", [_moe("tensor", False)], [_moe("tensor", True, fresh_fault=0.05)]
    )
    top = rank_rows(cmp, top=3)
    assert top["name"][0] == "Tensor.mul.0.forward.output.0"
    sig = dict(zip(*rank_rows(cmp, top=0).select("name", "significance")))
    assert sig["Torch.topk.0.forward.output.1"] == 1.0  # the flipped indices
    assert sig["Tensor.index_add_.0.forward.input.2"] == 1.0  # the tokens expert 1 got: another shape


def test_a_gathers_output_ranks_at_its_own_dtype(dump_writer, store_dir):
    """The embedding's output (fp32, a copy) in a bf16 run ranks at the fp32 tolerance: first in its step."""
    table = _table(np.random.default_rng(12))
    ref = [_embedding_step(_ids(False), table, "statistics") for _ in range(2)]
    tgt = [_embedding_step(_ids(False), table, "statistics"), _embedding_step(_ids(True), table, "statistics")]
    cmp = _comparison(dump_writer, store_dir, "statistics", ref, tgt)
    top = rank_rows(cmp, top=1).row(0, named=True)
    assert (top["step"], top["name"]) == (1, "Functional.embedding.0.forward.output.0")
    assert top["significance"] == pytest.approx(top["rel_l2"] / 2.0**-13)


@pytest.mark.parametrize("mode", MODES)
def test_a_view_msprobe_does_not_record_keeps_its_producer(dump_writer, store_dir, mode):
    """q = linear(x).view(...).transpose(...): the mul's input is the linear's output through ops msprobe does
    not record; same values, another shape.  Its producer is the linear (a float tensor with all four statistics
    equal and as many elements), not 'no op': an integer tensor is never matched so (max/min only)."""
    from dumpstore.analysis._divergence import _ordered
    from dumpstore.analysis.culprit import _StepView

    rng = np.random.default_rng(13)
    x, w = _f32(rng.normal(size=(16, 32))), _f32(rng.normal(size=(32, 32)) / 6)
    y = _f32(x @ w.T)
    q = np.ascontiguousarray(y.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3))
    ids = np.arange(32, dtype=np.int64)
    recs = {
        "Functional.linear.0.forward": {"input_args": [x, w], "output": [y]},
        "Tensor.__mul__.0.forward": {"input_args": [q, {"type": "float", "value": 2.0}], "output": [_f32(q * 2)]},
        "Tensor.__add__.0.forward": {"input_args": [ids.reshape(4, 8), 1], "output": [ids.reshape(4, 8) + 1]},
        "Tensor.__sub__.0.forward": {"input_args": [(ids + 1).reshape(8, 4), 1], "output": [ids.reshape(8, 4)]},
    }
    cmp = _comparison(dump_writer, store_dir, mode, [recs], [recs])
    view = _StepView(_ordered(cmp.rows, cmp.records), 0)
    rows = {r["name"]: r for r in view.rows.iter_rows(named=True)}
    for prefix in ("", "ref_"):
        producers = view.producers(prefix)
        assert producers.producer(rows["Tensor.__mul__.0.forward.input.0"]) == "Functional.linear.0.forward"
        assert producers.producer(rows["Tensor.__sub__.0.forward.input.0"]) is None  # ints: no view match

"""Data changed after step 0 (issue 23, analysis/hidden_index.py and analysis/culprit.py): token ids whose
statistics agree read by a gather whose table's statistics agree exactly (a pure-bfloat16 run: msprobe keeps a
bfloat16 tensor's statistics in bfloat16), on small hand-made dump pairs."""

from __future__ import annotations

import numpy as np
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.hidden_index import beyond_rounding
from helpers import leaf

T, D, V = 16, 8, 96  # tokens, hidden size, vocabulary


def _bf16(a) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), kept as float32."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _leaf16(a: np.ndarray) -> dict:
    """A bfloat16 tensor's leaf as msprobe writes it in statistics mode: every statistic rounded to bfloat16."""
    out = leaf(a, dtype="bfloat16")
    for k in ("Max", "Min", "Mean", "Norm"):
        out[k] = float(_bf16(np.float32(out[k])))
    return out


def _ids(changed: bool, step: int) -> np.ndarray:
    ids = (np.arange(2 * T, dtype=np.int64).reshape(2, T) * (3 + step)) % (V - 2) + 1
    ids[0, 0], ids[1, 0] = 0, V - 1  # the batch's max and min are fixed
    if changed:
        ids[0, 5] += 1  # one token id +1, inside the range
    return ids


def _step(ids: np.ndarray, table: np.ndarray) -> dict:
    """An embedding of a bfloat16 table and three bfloat16 ops after it, in statistics mode."""
    out = table[ids]
    recs = {
        "Functional.embedding.0.forward": {
            "input_args": [leaf(ids, stats=("Max", "Min")), _leaf16(table)],
            "output": [_leaf16(out)],
        }
    }
    h = out.reshape(-1, D)
    for i in range(3):
        recs[f"Tensor.__mul__.{i}.forward"] = {
            "input_args": [_leaf16(h), {"type": "float", "value": 2.0}],
            "output": [_leaf16(_bf16(h * 2))],
        }
    return recs


def _verdict(dump_writer, store_dir, ref: list[dict], target: list[dict]):
    for name, steps in (("ref", ref), ("target", target)):
        w = dump_writer(name, "statistics")
        for i, recs in enumerate(steps):
            w.write(recs, step=i)
        ingest(w.root, name, store=store_dir, jobs=1)
    return divergence(compare_runs(open_store(store_dir), "target", "ref"))


def _table() -> np.ndarray:
    """Rows of a bfloat16 table; row 22 (the changed id's at step 1, which no other token there reads) holds an element
    0.02 over every row read at step 1."""
    t = _bf16(0.05 + 0.1 * np.random.default_rng(4).normal(size=(V, D)))
    t[22, 3] = _bf16(np.float32(t[_ids(False, 1)].max() + 0.02))  # 0.02 over the rows read at step 1
    return t


def test_a_changed_id_under_a_bfloat16_table_is_data_at_the_embedding(dump_writer, store_dir):
    """Pure bfloat16: the table's statistics agree exactly at step 1, the ids' max/min agree; the embedding's
    output moves under the bfloat16 tolerance (2^-6) but a copied element moves beyond three roundings of the
    statistics: `input`, at step 1."""
    table = _table()
    ref = [_step(_ids(False, s), table) for s in range(2)]
    tgt = [_step(_ids(False, 0), table), _step(_ids(True, 1), table)]
    v = _verdict(dump_writer, store_dir, ref, tgt)
    assert v.culprit is not None
    assert (v.culprit.step, v.culprit.op, v.culprit.kind) == (1, "Functional.embedding.0.forward", "input")
    assert v.culprit.evidence["differing"] == "Functional.embedding.0.forward.input.0"
    assert v.culprit.value < 0.015625
    assert v.culprit.evidence["beyond_rounding"] > 0


def test_a_table_off_by_roundings_with_the_same_ids_stays_quiet(dump_writer, store_dir):
    """The same ids; the target's table differs by one bfloat16 rounding in a few elements (its statistics still
    agree exactly): the copied elements move by a rounding, within the statistics' own rounding: quiet."""
    table = _table()
    noisy = table.copy()
    for (i, j), way in (((3, 1), 1), ((40, 2), -1), ((77, 5), 1)):  # one rounding each, elements no extreme
        noisy[i, j] = _bf16(noisy[i, j] + way * 2.0 ** (np.floor(np.log2(abs(noisy[i, j]))) - 7))
    assert (noisy != table).sum() == 3
    assert _leaf16(noisy) == _leaf16(table)  # the precondition: the table's statistics agree exactly
    ref = [_step(_ids(False, s), table) for s in range(2)]
    tgt = [_step(_ids(False, 0), table), _step(_ids(False, 1), noisy)]
    v = _verdict(dump_writer, store_dir, ref, tgt)
    assert v.culprit is None


def test_beyond_rounding_of_bfloat16_statistics():
    """set 4's mamba_data_step1, step 1: the embedding's output min -0.318 against -0.285 (17 roundings of it), its
    norm two roundings apart: what no three roundings of the statistics make is the min's excess, 0.00816."""
    out = {
        "dtype": "bfloat16",
        "numel": 1024,
        "norm": 3.1875,
        "ref_norm": 3.15625,
        "max": 0.3125,
        "ref_max": 0.3125,
        "min": -0.318359375,
        "ref_min": -0.28515625,
        "mean": -0.00811767578125,
        "ref_mean": -0.0084838867,
    }
    e = 2.0**-7
    want = (0.318359375 - 0.28515625 - 3 * e * 0.318359375) / 3.15625
    assert beyond_rounding(out) == pytest.approx(want, rel=1e-12)
    assert beyond_rounding(out) == pytest.approx(0.0081557, rel=1e-4)
    same = {**out, "min": -0.28515625, "mean": -0.0084838867, "norm": 3.15625}
    assert beyond_rounding(same) == 0.0
    assert beyond_rounding({**out, "ref_norm": None}) is None


def test_the_advice_for_labels_the_dump_does_not_list_names_the_labels(dump_writer, store_dir):
    """The labels reach the loss through ops msprobe does not record (its record lists the logits only): the
    verdict names the loss ahead of the backward of its step, and its advice names the labels, not the loss's
    output."""
    from test_stats_blind import _loss_step

    from dumpstore.analysis.explain import explain_findings

    ref = [_loss_step(s, False, 0.0, False, recorded=False) for s in range(2)]
    tgt = [_loss_step(0, False, 0.0, True, recorded=False), _loss_step(1, True, 0.05, True, recorded=False)]
    for name, steps in (("ref", ref), ("target", tgt)):
        w = dump_writer(name, "statistics")
        for i, recs in enumerate(steps):
            w.write(recs, step=i)
        ingest(w.root, name, store=store_dir, jobs=1)
    v = divergence(compare_runs(open_store(store_dir), "target", "ref"))
    assert v.culprit is not None and (v.culprit.step, v.culprit.op) == (1, "Functional.cross_entropy.0.forward")
    advice = explain_findings(open_store(store_dir), v)["culprit"].advice
    assert advice == (
        "The runs are fed different data: check the data pipeline, its seed and the preprocessing of the labels "
        "(the target of Functional.cross_entropy.0.forward, not recorded in the dump)."
    )

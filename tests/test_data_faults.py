"""Data changed after step 0 (issue 23, analysis/hidden_index.py and analysis/culprit.py): token ids whose
statistics agree read by a gather whose table's statistics agree exactly (a pure-bfloat16 run: msprobe keeps a
bfloat16 tensor's statistics in bfloat16), on small hand-made dump pairs."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.hidden_index import beyond_rounding, data_suspects
from helpers import leaf
from helpers import stats_verdict as _verdict

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


def test_beyond_rounding_counts_how_a_gathers_rows_add_up():
    """validation/data_faults.py's mamba_ids_step2 (set 4's Mamba, pure bf16, one token id +1 at step 2), the
    embedding's output (32 ids x 32) with its table's statistics equal: the mean moved 7.17e-4, within 3
    roundings of the elements' RMS (3 x 2^-7 x 0.104 = 2.4e-3) but beyond 3 roundings of what a table off by
    roundings moves the mean of 32 copied rows, RMS x sqrt(32 / 1024) (4.3e-4): 0.00275 beyond."""
    out = {
        "dtype": "bfloat16",
        "numel": 1024,
        "norm": 3.34375,
        "ref_norm": 3.328125,
        "max": 0.310546875,
        "ref_max": 0.310546875,
        "min": -0.318359375,
        "ref_min": -0.318359375,
        "mean": 0.0038299560546875,
        "ref_mean": 0.004547119140625,
    }
    e = 2.0**-7
    assert beyond_rounding(out) == 0.0
    size = 3.328125 / 32 * (32 / 1024) ** 0.5
    want = (0.004547119140625 - 0.0038299560546875 - 3 * e * size) * 32 / 3.328125
    assert beyond_rounding(out, reads=32) == pytest.approx(want, rel=1e-12)
    assert beyond_rounding(out, reads=32) == pytest.approx(0.00275, rel=1e-2)
    assert beyond_rounding({**out, "dtype": "float32"}, reads=32) == beyond_rounding({**out, "dtype": "float32"})
    # set 5's granite_ids_step2 (the same rule): mean -6.485e-4 against -7.095e-4 of 1024, 32 ids: within
    granite = {**out, "norm": 0.6796875, "ref_norm": 0.67578125, "mean": -6.4849853515625e-4}
    granite.update(ref_mean=-7.0953369140625e-4, max=0.0634765625, ref_max=0.06298828125)
    granite.update(min=-0.068359375, ref_min=-0.068359375)
    assert beyond_rounding(granite, reads=32) == 0.0


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


def test_where_integer_inputs_first_differ():
    """Per (rank, source, record, leaf), the first step whose integer or boolean input differs; float inputs,
    outputs and agreeing integers are left out."""
    import polars as pl

    from dumpstore.analysis.producers import discrete_first_differs

    rows = pl.DataFrame(
        {
            "step": [0, 1, 2, 1, 2, 2],
            "rank": [0] * 6,
            "source": [None] * 6,
            "_record": ["Functional.cross_entropy.0.forward"] * 3 + ["Functional.embedding.0.forward"] * 3,
            "name": ["ce.input.1"] * 3 + ["emb.input.0", "emb.input.0", "emb.output.0"],
            "_io": ["input", "input", "input", "input", "input", "output"],
            "kind": ["tensor"] * 6,
            "tol_dtype": ["int64", "int64", "int64", "int64", "int64", "int64"],
            "status": ["pass", "diverged", "diverged", "pass", "pass", "diverged"],
        },
        schema_overrides={"source": pl.String},
    )
    assert discrete_first_differs(rows) == {(0, None, "Functional.cross_entropy.0.forward", "ce.input.1"): 1}


def _ce_step(step: int, target: bool, loss_move: float, labels_changed: bool = False) -> dict:
    """float32 logits off by 1e-5 in the target, their cross-entropy with labels kept by max/min only (the
    target's loss off by `loss_move`, relative), the cross-entropy's backward (the gradient of the logits, given
    1.0), and a logit layer's backward off by 5 % in the target at step 1."""
    rng = np.random.default_rng(200 + step)
    n, c = 16, 32
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = (rng.normal(size=(c, 8)) * 0.3).astype(np.float32)
    z = (x @ w.T).astype(np.float32)
    labels = rng.integers(1, c - 1, size=n).astype(np.int64)
    labels[0], labels[1] = 0, c - 1  # the batch's range
    zt = (z * (1 + 1e-5)).astype(np.float32) if target else z
    if target and labels_changed:
        labels[2] = (labels[2] + 1) % c
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = float(-np.log(p[np.arange(n), labels]).mean())
    dz = p.copy()
    dz[np.arange(n), labels] -= 1
    dz = (dz / n).astype(np.float32)
    grad = (rng.normal(size=(n, c)) / n).astype(np.float32)
    gx = (grad @ w).astype(np.float32)
    return {
        "Functional.linear.0.forward": {"input_args": [x, w], "output": [zt]},
        "Functional.cross_entropy.0.forward": {
            "input_args": [zt, leaf(labels, stats=("Max", "Min"))],
            "output": [np.array(loss * (1 + loss_move if target else 1.0), dtype=np.float32)],
        },
        "Functional.cross_entropy.0.backward": {
            "input": [np.array(1.0, dtype=np.float32)],
            "output": [(dz * (1 + 1e-6)).astype(np.float32) if target else dz],
        },
        "Functional.linear.0.backward": {
            "input": [grad],
            "output": [(gx * (1.05 if target and step == 1 else 1.0)).astype(np.float32)],
        },
    }


def _ce_verdict(dump_writer, store_dir, moves: tuple[float, float], labels_changed: bool = False):
    ref = [_ce_step(s, False, 0.0) for s in range(2)]
    tgt = [_ce_step(0, True, moves[0]), _ce_step(1, True, moves[1], labels_changed)]
    return _verdict(dump_writer, store_dir, ref, tgt)


def test_a_loss_moved_within_what_its_logits_error_moves_it_is_no_data_suspect(dump_writer, store_dir):
    """Statistics mode (clean combinations draw 2's resnet_fp16_D class): the loss moved 20x more per logit error
    at step 1 than at step 0 (a one-step baseline), but 2e-6 of a loss ~3.6 is far inside what logits off by
    1e-5 move it through the gradient its backward records (||dz|| 0.24 x 1e-5 x ||z|| ~21): no data suspect;
    the logit layer's backward, 5 % off, is named."""
    v = _ce_verdict(dump_writer, store_dir, (1e-7, 2e-6))
    assert v.culprit is not None
    assert (v.culprit.step, v.culprit.op) == (1, "Functional.linear.0.backward")


def test_a_loss_moved_beyond_its_gradient_bound_is_named_before_the_backward(dump_writer, store_dir):
    """The same pair with the loss moved 1e-3 at step 1 (a label changed, its max/min kept): beyond STAND_OUT x
    what the logits' error moves it through its gradient: the labels, at the loss, ahead of the backward."""
    v = _ce_verdict(dump_writer, store_dir, (1e-7, 1e-3), labels_changed=True)
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.cross_entropy.0.forward", "input")
    assert c.evidence["differing"] == "Functional.cross_entropy.0.forward.input.1"
    assert c.evidence["ahead_of"] == "Functional.linear.0.backward"
    assert c.evidence["gradient_units"] > 3


def test_data_suspects_in_units_of_the_loss_gradient():
    """clean combinations draw 2's resnet_fp16_D, statistics, the cross-entropy of fp16 logits (80 elements,
    their statistics' bound 1.89e-4 and 9.48e-5, floored at eps(fp16)) and its backward (given the loss scale
    1024, its output's norm 362.04): the loss moved 1.12e-5 at step 0 and 1.34e-4 at step 1, 11.9x more per
    logit error, but 0.370 of what logits off by eps(fp16) move a loss of 2.462 through ||dz|| 0.354 (logits'
    norm 2.576): no suspect.  A move of 1.34e-3 is 3.70: a suspect."""
    ce, bw = "Functional.cross_entropy.0.forward", "Functional.cross_entropy.0.backward"
    recs = pl.DataFrame(
        {
            "step": [0, 0, 1, 1],
            "rank": [0] * 4,
            "source": [None] * 4,
            "_record": [ce, bw, ce, bw],
            "op_class": ["Functional.cross_entropy"] * 4,
            "idx_hidden": [True, False, True, False],
            "_direction": ["forward", "backward"] * 2,
            "_phase": [0, 1, 0, 1],
            "_seq": [10, 11, 10, 11],
            "out_dtype": ["float32"] * 4,
            "out_err": [1.1249e-5, 0.0, 1.33624e-4, 0.0],
            "out_norm": [2.355625, 362.038666, 2.462264, 362.038666],
            "in_float_err": [1.886e-4, 0.0, 9.4769e-5, 0.0],
            "in_float_eps": [2.0**-10, 2.0**-24, 2.0**-10, 2.0**-24],
            "in_float_norm": [2.894531, 1024.0, 2.576172, 1024.0],
            "out_float_norm": [2.355625, 362.038666, 2.462264, 362.038666],
        },
        schema_overrides={"source": pl.String},
    )
    assert data_suspects(recs) == {}
    grad = 362.038666 / 1024.0
    moved = recs.with_columns(pl.when(pl.col("step") == 1).then(pl.col("out_err") * 10).otherwise("out_err"))
    hits = data_suspects(moved)
    assert list(hits) == [(1, 0)]
    want = 1.33624e-3 * 2.462264 / (grad * 2.0**-10 * 2.576172)
    assert hits[(1, 0)][1]["_g"] == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(3.699, rel=1e-3)
    # no backward record: the history alone (11.9x the step-0 ratio)
    assert list(data_suspects(recs.filter(pl.col("_direction") == "forward"))) == [(1, 0)]


def _ids_v8(ids: np.ndarray) -> dict:
    """An integer leaf as msprobe 8.x writes it in statistics mode: max, min, and a mean and norm computed in
    float32."""
    out = leaf(ids, stats=("Max", "Min"))
    f = ids.astype(np.float32)
    out["Mean"] = float(f.mean(dtype=np.float32))
    out["Norm"] = float(np.float32(np.sqrt((f * f).sum(dtype=np.float32))))
    return out


def _v8_step(ids: np.ndarray) -> dict:
    recs = _step(ids, _bf16(0.05 + 0.1 * np.random.default_rng(4).normal(size=(V, D))))
    recs["Functional.embedding.0.forward"]["input_args"][0] = _ids_v8(ids)
    return recs


def test_an_integer_mean_kept_by_msprobe_8_shows_one_id_changed(dump_writer, store_dir):
    """msprobe 8.x keeps a float32 mean and norm of integer tensors: one id +1 inside the batch's range moves the
    mean of 32 ids by 1/32 (40.40625 -> 40.4375) while a pure-bfloat16 embedding's output stays equal in its
    extremes and 1e-5 off: the ids differ, `input` at the embedding at step 1.  The same pair with equal ids and
    the target's mean one float32 rounding off (a device dividing otherwise) is quiet."""
    ref = [_v8_step(_ids(False, s)) for s in range(2)]
    tgt = [_v8_step(_ids(False, 0)), _v8_step(_ids(True, 1))]
    v = _verdict(dump_writer, store_dir, ref, tgt)
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (1, "Functional.embedding.0.forward", "input")
    assert c.evidence["differing"] == "Functional.embedding.0.forward.input.0"
    assert "mean 40.4375 vs 40.4062" in c.detail and c.value < 1e-4
    rounded = _v8_step(_ids(False, 1))
    m = rounded["Functional.embedding.0.forward"]["input_args"][0]
    m["Mean"] = float(np.nextafter(np.float32(m["Mean"]), np.float32(100)))
    v = _verdict(dump_writer, store_dir / "rounded", ref, [_v8_step(_ids(False, 0)), rounded])
    assert v.culprit is None


def test_integer_sum_differs_only_where_the_sum_is_exact():
    """n max|x| < 2^24: a mean more than 2 float32 ulps apart is another sum (32 ids, 1/32 apart); one ulp is a
    division's rounding.  n max|x| >= 2^24 (4096 ids up to 50000): the float32 sum rounds, nothing is claimed.
    The norm alike, while n max|x|^2 < 2^24."""
    from dumpstore.analysis.hidden_index import integer_sum_differs

    base = {"numel": 32, "max": 95.0, "ref_max": 95.0, "min": 0.0, "ref_min": 0.0}
    assert integer_sum_differs({**base, "mean": 40.4375, "ref_mean": 40.40625})
    one_ulp = float(np.nextafter(np.float32(40.40625), np.float32(100)))
    assert not integer_sum_differs({**base, "mean": one_ulp, "ref_mean": 40.40625})
    assert not integer_sum_differs({**base, "mean": None, "ref_mean": 40.40625})
    big = {"numel": 4096, "max": 50000.0, "ref_max": 50000.0, "min": 0.0, "ref_min": 0.0}
    assert not integer_sum_differs({**big, "mean": 25000.25, "ref_mean": 25000.0})
    norm = {**base, "max": 9.0, "ref_max": 9.0, "norm": 30.0, "ref_norm": 30.016663}  # 32 x 81 < 2^24
    assert integer_sum_differs(norm)
    assert not integer_sum_differs({**norm, "max": 1000.0, "ref_max": 1000.0})  # 32 x 1e6 >= 2^24

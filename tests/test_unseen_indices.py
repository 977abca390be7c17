"""An op reading integer indices that differ only inside their max and min (analysis/culprit.py
`_unseen_integers`): a router whose weight rows are swapped keeps every statistic of its scores and of the
top-k's values, and msprobe keeps only max/min of the indices; the first output that differs is a `where` over
the expert mask.  Statistics mode names that op and says its integer inputs may have changed unseen, pointing
at the top-k; tensor mode compares the values and names the swapped weight."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.cli.main import main
from helpers import leaf

T, D, E = 16, 8, 4  # tokens, hidden size, experts


def _routing(swapped: bool) -> tuple[dict, np.ndarray, np.ndarray]:
    """The router's records (linear, softmax, top-2) and the expert-1 token indices the `where` returns."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(T, D)).astype(np.float32)
    w = rng.normal(size=(E, D)).astype(np.float32)
    scores = (x @ w.T).astype(np.float32)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    if swapped:  # rows 1 and 2 of the weight: columns 1 and 2 of what it makes, bit for bit
        swap = [0, 2, 1, 3]
        w, scores, p = w[swap], scores[:, swap], p[:, swap]
    idx = np.argsort(-p, axis=1, kind="stable")[:, :2].astype(np.int64)
    values = np.take_along_axis(p, idx, 1)
    mask = np.zeros((2, T), dtype=np.int64)  # one_hot(idx).permute(2, 1, 0)[1]: made by ops msprobe skips
    for t in range(T):
        for k in range(2):
            mask[k, t] = idx[t, k] == 1
    pos, tok = np.nonzero(mask)
    return {"x": x, "w": w, "scores": scores, "p": p, "values": values, "idx": idx, "mask": mask}, pos, tok


def _records(mode: str, swapped: bool) -> dict:
    r, pos, tok = _routing(swapped)

    def ints(a: np.ndarray):
        return a if mode == "tensor" else leaf(a, stats=("Max", "Min"))  # msprobe: max/min of integers only

    return {
        "Functional.linear.0.forward": {"input_args": [r["x"], r["w"]], "output": [r["scores"]]},
        "Functional.softmax.0.forward": {"input_args": [r["scores"]], "output": [r["p"]]},
        "Torch.topk.0.forward": {
            "input_args": [r["p"], {"type": "int", "value": 2}],
            "output": [r["values"], ints(r["idx"])],
        },
        "Torch.where.0.forward": {"input_args": [ints(r["mask"])], "output": [ints(pos), ints(tok)]},
    }


def _pair(dump_writer, store_dir, mode: str):
    for name, swapped in (("ref", False), ("target", True)):
        w = dump_writer(name, mode)
        w.write(_records(mode, swapped), step=0)
        ingest(w.root, name, store=store_dir, jobs=1)
    return divergence(compare_runs(open_store(store_dir), "target", "ref"))


def test_the_pair_hides_the_swap_from_statistics():
    """The premise: the swap keeps the weight's and the scores' values as sets, the indices' max and min, and
    the expert mask's; the token indices of expert 1 differ, in their max or min."""
    (ref, _, rtok), (tgt, _, ttok) = _routing(False), _routing(True)
    assert sorted(ref["w"].ravel()) == sorted(tgt["w"].ravel())
    assert np.array_equal(ref["values"], tgt["values"])
    assert not np.array_equal(ref["idx"], tgt["idx"])
    assert (ref["idx"].max(), ref["idx"].min()) == (tgt["idx"].max(), tgt["idx"].min())
    assert (rtok.max(), rtok.min()) != (ttok.max(), ttok.min())


def test_statistics_mode_says_the_integer_inputs_may_have_changed_unseen(dump_writer, store_dir):
    v = _pair(dump_writer, store_dir, "statistics")
    c = v.culprit
    assert c is not None and (c.step, c.op, c.kind) == (0, "Torch.where.0.forward", "op")
    assert c.evidence["reason"] == "integer inputs may differ unseen"
    assert c.evidence["unseen_integer_inputs"] == ["Torch.where.0.forward.input.0"]
    assert (c.evidence["choice_upstream"], c.evidence["choice_values_agree"]) == ("Torch.topk.0.forward", True)
    assert "may have changed unseen: statistics keep only their max and min" in c.detail
    assert "Torch.topk.0.forward" in c.detail
    out = CliRunner().invoke(main, ["divergence", "--target", "target", "--ref", "ref", "--store", str(store_dir)])
    assert out.exit_code == 0, out.output
    assert "fix: Its integer inputs may have changed unseen" in out.output
    assert "The op itself computes differently:" not in out.output
    js = CliRunner().invoke(
        main, ["divergence", "--target", "target", "--ref", "ref", "--store", str(store_dir), "--json"]
    )
    ex = json.loads(js.output)["culprit"]["explanation"]
    assert ex["advice"].startswith("Its integer inputs may have changed unseen") and "Torch.topk.0" in ex["advice"]
    assert ex["next_dump"]["tensor"]["list"] == [
        "Torch.where.0.forward",
        "Torch.where.0.backward",
        "Torch.topk.0.forward",
        "Torch.topk.0.backward",
    ]
    html = store_dir / "r.html"
    rep = CliRunner().invoke(
        main, ["report", "--target", "target", "--ref", "ref", "--store", str(store_dir), "--html", str(html)]
    )
    assert rep.exit_code in (0, 3), rep.output
    assert "Its integer inputs may have changed unseen" in html.read_text()


def test_tensor_mode_compares_the_indices_and_names_the_swapped_weight(dump_writer, store_dir):
    v = _pair(dump_writer, store_dir, "tensor")
    c = v.culprit
    assert c is not None and (c.step, c.op) == (0, "Functional.linear.0.forward")
    assert c.kind in ("input", "parameter") and c.evidence["differing"] == "Functional.linear.0.forward.input.1"
    assert "unseen_integer_inputs" not in c.evidence

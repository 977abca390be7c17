"""A module record named as the culprit op is named at the record inside it that makes most of its error
(analysis/culprit.py `_innermost`): a user needs the op; on a small hand-made dump pair."""

from __future__ import annotations

import numpy as np

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence

MODULE = "Module.attn.Attn.forward.0"


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _records(target: bool) -> dict:
    """A weight scaled by a recorded op (off 2e-5 in the target, within the float32 tolerance 1.2e-4), read by a
    linear inside the attention module (its output off 1.5e-4: not fresh, its weight's error being over a tenth
    of the tolerance, and amplifying it 7.5x, under 10), the module's output made from it by ops msprobe does
    not record: the module's input agrees and its output is off 1.5e-4."""
    rng = np.random.default_rng(3)
    x = _f32(rng.normal(size=(4, 8)))
    w = _f32(rng.normal(size=(8, 8)) * 0.1)
    w2 = _f32(w * 0.5 * (1 + 2e-5 if target else 1.0))
    y = _f32(x @ (w * 0.5).T)
    yt = _f32(y * (1 + 1.5e-4)) if target else y
    return {
        "Tensor.mul.0.forward": {"input_args": [w, {"type": "float", "value": 0.5}], "output": [w2]},
        "Functional.linear.0.forward": {"input_args": [x, w2], "output": [yt]},
        MODULE: {"input_args": [x], "output": [_f32(yt * 3.0)]},
    }


def test_a_module_named_as_the_culprit_op_is_named_at_the_record_inside_it_that_made_its_error(dump_writer, store_dir):
    for name, target in (("ref", False), ("target", True)):
        w = dump_writer(name, "tensor")
        w.write(_records(target), construct={"Functional.linear.0.forward": MODULE})
        ingest(w.root, name, store=store_dir, jobs=1)
    v = divergence(compare_runs(open_store(store_dir), "target", "ref"))
    c = v.culprit
    assert c is not None and (c.kind, c.step, c.op) == ("op", 0, "Functional.linear.0.forward")
    assert c.evidence["module"] == MODULE
    assert c.detail.startswith(f"module {MODULE}: inputs agree, output diverges")
    assert "no record inside it stood out on its own, and Functional.linear.0.forward makes most of its error" in (
        c.detail
    )
    assert v.first_divergence is not None and v.first_divergence.op == "Functional.linear.0.forward"

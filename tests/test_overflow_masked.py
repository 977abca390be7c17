"""An Inf that reaches nothing that matters is masked, not an overflow (analysis/_overflow.py `_Graph`): T5's
relative-position buckets take log(0) = -Inf and a `where` (or an integer cast msprobe does not record) discards
it; a log(0) that reaches the loss, or that arithmetic turns into a finite number, stays an overflow.  Small
hand-made dumps, both dump modes, with and without a reference; exact values."""

from __future__ import annotations

import numpy as np
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis._overflow import overflow

MODES = ("tensor", "statistics")
INT64_MIN = np.iinfo(np.int64).min  # what a cast of -Inf to int64 gives on x86


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _buckets(end: str, zero: bool = True) -> dict:
    """Relative positions 3 |i - j| / 2 (0 on the diagonal when `zero`), their log, x 2, then `end`:
    "where"     torch.where(small, position, large): the -Inf branch not taken;
    "cast"      .long() (not recorded), + 2, then torch.where: the integer branch not taken;
    "loss"      the mean of it: the model's loss is -Inf;
    "reciprocal" 1 / x: a finite number (-0) made of the -Inf by arithmetic, read by a linear."""
    i = np.arange(4)
    pos = _f32(3 * np.abs(i[:, None] - i[None, :]))
    if not zero:
        pos = pos + 1
    half = _f32(pos / 2)
    with np.errstate(divide="ignore"):
        lg = _f32(np.log(half))
    large = _f32(lg * 2)
    small = pos < 2
    recs: dict = {
        "Tensor.__truediv__.0.forward": {"input_args": [pos, {"type": "int", "value": 2}], "output": [half]},
        "Torch.log.0.forward": {"input_args": [half], "output": [lg]},
        "Tensor.__mul__.0.forward": {"input_args": [lg, {"type": "int", "value": 2}], "output": [large]},
    }
    if end == "where":
        recs["Torch.where.0.forward"] = {"input_args": [small, pos, large], "output": [np.where(small, pos, large)]}
    elif end == "cast":
        with np.errstate(invalid="ignore"):
            as_long = np.where(np.isfinite(large), large, INT64_MIN).astype(np.int64)
        plus = as_long + 2
        recs["Tensor.__radd__.0.forward"] = {"input_args": [as_long, {"type": "int", "value": 2}], "output": [plus]}
        out = np.where(small, pos.astype(np.int64), plus)
        recs["Torch.where.0.forward"] = {"input_args": [small, pos.astype(np.int64), plus], "output": [out]}
    elif end == "loss":
        recs["Tensor.mean.0.forward"] = {"input_args": [large], "output": [_f32(large.mean())]}
    else:
        with np.errstate(divide="ignore"):
            inv = _f32(1.0 / large)
        recs["Tensor.__rtruediv__.0.forward"] = {"input_args": [large, {"type": "int", "value": 1}], "output": [inv]}
        w = _f32(np.eye(4))
        recs["Functional.linear.0.forward"] = {"input_args": [inv, w], "output": [_f32(inv @ w.T)]}
    return recs


def _store(dump_writer, store_dir, mode: str, runs: dict[str, dict]):
    for name, recs in runs.items():
        w = dump_writer(name, mode)
        w.write(recs)
        ingest(w.root, name, store=store_dir, jobs=1)
    return open_store(store_dir)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("end", "by"),
    [
        ("where", "Torch.where.0.forward"),
        ("cast", "an integer cast msprobe does not record (read by Tensor.__radd__.0.forward)"),
    ],
)
def test_a_log_of_zero_that_a_later_op_discards_is_masked(dump_writer, store_dir, mode, end, by):
    st = _store(dump_writer, store_dir, mode, {"run": _buckets(end)})
    rep = overflow(st, "run")
    assert rep.first_overflow is None
    assert [(p["op"], p["kind"], p["likely_mask"], p["masked"], p["masked_by"]) for p in rep.producers] == [
        ("Torch.log.0.forward", "inf", False, True, by)
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("end", ["loss", "reciprocal"])
def test_a_log_of_zero_that_reaches_the_loss_or_arithmetic_is_overflow(dump_writer, store_dir, mode, end):
    """The -Inf becomes the loss (read by nothing recorded after it), or 1 / -Inf = -0 feeds a linear: a path
    goes on, the first overflow."""
    st = _store(dump_writer, store_dir, mode, {"run": _buckets(end)})
    rep = overflow(st, "run")
    assert rep.first_overflow is not None
    assert (rep.first_overflow["op"], rep.first_overflow["kind"], rep.first_overflow["masked"]) == (
        "Torch.log.0.forward",
        "inf",
        False,
    )


@pytest.mark.parametrize("mode", MODES)
def test_masked_beyond_a_reference_that_has_no_zero(dump_writer, store_dir, mode):
    """The target's log(0) is new (the reference's positions start at 1): masked by the where all the same; the
    loss path is an overflow."""
    st = _store(dump_writer, store_dir, mode, {"ref": _buckets("where", zero=False), "target": _buckets("where")})
    rep = overflow(st, "target", ref="ref")
    assert rep.first_overflow is None
    assert [(p["op"], p["masked"], p["masked_by"]) for p in rep.producers] == [
        ("Torch.log.0.forward", True, "Torch.where.0.forward")
    ]

"""One call of an API computed at a lower precision than its siblings (analysis/lone_precision.py), on small
hand-made dump pairs in both dump modes: named by the verdict, ranked by its siblings' tolerance in compare."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import polars as pl
import pytest

from analysis.lone_precision import lone_records
from analysis.rank import rank_rows
from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence

T, D = 16, 8


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest even), kept in float32 storage."""
    u = a.astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def _write(dump_writer, store_dir, mode: str, ref: dict, target: dict):
    for name, recs in (("ref", ref), ("target", target)):
        w = dump_writer(name, mode)
        w.write(recs)
        ingest(w.root, name, store=store_dir, jobs=1)
    return compare_runs(open_store(store_dir), "target", "ref")


def _model(layers: int, lowered: set[int]) -> dict:
    """`layers` float32 linears in a chain (each reads the previous one's output); the calls in `lowered` make a
    bfloat16 output (their values rounded to bfloat16: an autocast region around that call), the next call reads
    it upcast (msprobe records no `Tensor.float`) as float32."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(T, D)).astype(np.float32)
    recs: dict = {}
    for i in range(layers):
        w = (rng.normal(size=(D, D)) / np.sqrt(D)).astype(np.float32)
        y = (x @ w.T).astype(np.float32)
        out = _bf16(y).astype(ml_dtypes.bfloat16) if i in lowered else y
        recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, w], "output": [out]}
        x = np.tanh(y if i not in lowered else _bf16(y)).astype(np.float32)
    return recs


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_one_call_lowered_among_kept_siblings_is_named(dump_writer, store_dir, mode):
    """Twelve float32 linears; the target's sixth outputs bfloat16 on float32 inputs, the eleven others keep
    float32 (the run's precision: a dtype under 10% of its outputs, analysis/compare.py): not a policy (that
    lowers every call), named at that call with its siblings' counts."""
    cmp = _write(dump_writer, store_dir, mode, _model(12, set()), _model(12, {5}))
    c = divergence(cmp).culprit
    assert c is not None and (c.step, c.op, c.kind, c.metric) == (0, "Functional.linear.5.forward", "op", "dtype")
    assert (c.evidence["dtype"], c.evidence["ref_dtype"]) == ("bfloat16", "float32")
    assert (c.evidence["siblings_kept"], c.evidence["siblings_lowered"]) == (11, 1)
    top = rank_rows(cmp, top=1, culprit=None)
    assert top["name"][0] == "Functional.linear.5.forward.output.0"  # by significance alone


def _leaves(out_dtypes: list[str], in_dtype: str = "float32") -> pl.DataFrame:
    """Leaf rows of calls `Functional.linear.<i>.forward` (one input, one output; the reference's float32)."""
    rows = []
    for i, dt in enumerate(out_dtypes):
        for io, d in (("input", in_dtype), ("output", dt)):
            rows.append(("Functional.linear.%d.forward" % i, io, d, "float32", 2.0**-13 if d == "float32" else 2.0**-6))
    df = pl.DataFrame(rows, schema=["_record", "_io", "dtype", "ref_dtype", "tol"], orient="row")
    return df.with_columns(
        step=pl.lit(0),
        rank=pl.lit(0),
        source=pl.lit(None, pl.String),
        kind=pl.lit("tensor"),
        _direction=pl.lit("forward"),
    )


def test_every_call_lowered_is_a_policy():
    """Every call of the API lowered (a device's autocast policy for the op): no sibling keeps the dtype, no
    finding; one of eight lowered: found, measured against its kept siblings' tolerance."""
    lone = lone_records(_leaves(["bfloat16"] * 8), "_record", "_io", "_direction")
    assert lone["lone_low"].to_list() == [False] * 8 and lone["lone_kept"].to_list() == [0] * 8
    lone = lone_records(_leaves(["float32"] * 3 + ["bfloat16"] + ["float32"] * 4), "_record", "_io", "_direction")
    assert lone.select("_record", "lone_low", "lone_kept", "lone_lowered", "lone_tol", "lone_dtypes").rows() == [
        ("Functional.linear.3.forward", True, 7, 1, 2.0**-13, "bfloat16/float32")
    ]


def test_inputs_of_another_dtype_are_not_judged_here():
    """A call whose float input's dtype differs too (an unrecorded cast: analysis/dtype_change.py's evidence, or
    a dtype carried from an op before it) is no sibling and not judged."""
    df = _leaves(["float32"] * 7 + ["bfloat16"])
    df = df.with_columns(
        pl.when((pl.col("_record") == "Functional.linear.7.forward") & (pl.col("_io") == "input"))
        .then(pl.lit("bfloat16"))
        .otherwise(pl.col("dtype"))
        .alias("dtype")
    )
    assert lone_records(df, "_record", "_io", "_direction").height == 0


def test_too_few_kept_siblings_are_no_evidence(dump_writer, store_dir):
    """Twelve linears, ten lowered: the two calls that keep float32 (under MIN_KEPT, and fewer than the lowered)
    are no evidence of a policy."""
    cmp = _write(dump_writer, store_dir, "tensor", _model(12, set()), _model(12, set(range(1, 11))))
    assert divergence(cmp).culprit is None

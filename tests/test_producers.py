"""The public tensor-identity API of analysis/producers.py (`fingerprint`, `view_key`, `Producers`) on a small
hand-made frame of one run's leaves: a linear's output read by a mul through an unrecorded transpose, an integer
tensor reshaped the same way, and a leaf without its norm."""

from __future__ import annotations

import polars as pl

from dumpstore.analysis.producers import (
    STATS,
    Producers,
    fingerprint,
    fingerprint_column,
    integer_input,
    view_key,
    with_fingerprints,
)

LIN, MUL, ADD, SUB = (
    f"{op}.0.forward" for op in ("Functional.linear", "Tensor.__mul__", "Tensor.__add__", "Tensor.__sub__")
)
FLOAT = {"min": -1.5, "max": 2.25, "mean": 0.125, "norm": 7.5}
INTS = {"min": 0.0, "max": 31.0, "mean": 15.5, "norm": 102.0}  # a msprobe version that writes an integer's norm


def _leaf(seq, record, name, io, dtype, shape, stats, requires_grad=False):
    numel = 1
    for d in shape:
        numel *= d
    return {
        "step": 0,
        "rank": 0,
        "source": "",
        "seq": seq,
        "record": record,
        "name": f"{record}.{name}",
        "io": io,
        "kind": "tensor",
        "dtype": dtype,
        "shape": shape,
        "numel": numel,
        "requires_grad": requires_grad,
        **{s: stats.get(s) for s in STATS},
    }


def _rows() -> pl.DataFrame:
    return pl.DataFrame(
        [
            _leaf(0, LIN, "input.0", "input", "float32", [16, 32], {"min": -3.0, "max": 3.0, "mean": 0.0, "norm": 9.0}),
            _leaf(0, LIN, "output.0", "output", "float32", [16, 32], FLOAT),
            # the linear's output through a transpose msprobe does not record: another shape, the same values
            _leaf(1, MUL, "input.0", "input", "float32", [32, 16], FLOAT),
            _leaf(
                1, MUL, "output.0", "output", "float32", [32, 16], {"min": -3.0, "max": 4.5, "mean": 0.25, "norm": 15.0}
            ),
            _leaf(2, ADD, "output.0", "output", "int64", [4, 8], INTS),
            _leaf(3, SUB, "input.0", "input", "int64", [8, 4], INTS),  # integers: never linked through a view
            _leaf(3, SUB, "input.1", "input", "float32", [16, 32], {"min": -1.5, "max": 2.25, "mean": 0.125}),
        ]
    )


def test_fingerprint_columns_and_the_view_rule():
    assert [fingerprint_column(p, view=v) for p in ("", "ref_") for v in (False, True)] == [
        "_fp_t",
        "_vfp_t",
        "_fp_ref_",
        "_vfp_ref_",
    ]
    fp = _rows().with_columns(fingerprint(""), fingerprint("", view=True))
    exact, view = fp["_fp_t"].to_list(), fp["_vfp_t"].to_list()
    assert exact[1] != exact[2]  # another shape: not the same tensor
    assert view[1] == view[2]  # the same values through a view
    assert view[4] is None and view[5] is None and exact[4] != exact[5]  # integers: no view fingerprint
    assert exact[6] is not None and view[6] is None  # no norm: exact only
    assert len(set(exact)) == 7


def test_with_fingerprints_adds_both_runs_both_keys():
    rows = _rows()
    ref = rows.rename({c: f"ref_{c}" for c in ("dtype", "shape", "numel", *STATS)})
    both = with_fingerprints(
        pl.concat(
            [rows.select("step", "rank", "source", "dtype", "shape", "numel", *STATS), ref.select(pl.col("^ref_.*$"))],
            how="horizontal",
        )
    )
    assert both["_fp_t"].to_list() == both["_fp_ref_"].to_list()
    assert both["_vfp_t"].to_list() == both["_vfp_ref_"].to_list()


def test_view_key_on_one_row():
    rows = _rows().to_dicts()
    assert view_key(rows[1]) == ("float32", 512, -1.5, 2.25, 0.125, 7.5)
    assert view_key(rows[1]) == view_key(rows[2])
    assert view_key(rows[4]) == view_key(rows[5]) == ("int64", 32, 0.0, 31.0, 15.5, 102.0)  # any dtype
    assert view_key(rows[6]) is None  # a statistic unknown
    assert view_key(rows[6], stats=("max", "min")) == ("float32", 512, 2.25, -1.5)
    ref = {"ref_dtype": "bfloat16", "ref_numel": 4, "ref_max": 1.0, "ref_min": 0.0}
    assert view_key(ref, "ref_", stats=("max", "min")) == ("bfloat16", 4, 1.0, 0.0)


def test_producers_by_the_same_tensor_and_by_a_view():
    prod = Producers(_rows(), "")  # computes the fingerprint columns it lacks
    rows = prod.rows.to_dicts()
    assert prod.producer(rows[2]) == LIN  # through the unrecorded transpose
    assert prod.producer(rows[2], views=False) is None
    assert prod.producer(rows[5]) is None  # an integer tensor: no view match
    assert prod.producer(rows[6]) is None  # no norm: no view match
    assert prod.producer(rows[1]) is None  # an output is made by its own record, not before it
    assert prod.producer_of(rows[1]["_fp_t"], 1) == LIN
    assert prod.producer_of(rows[1]["_fp_t"], 0) is None
    assert prod.input_producer(MUL, f"{MUL}.input.0") == LIN
    assert prod.input_producer(MUL, f"{MUL}.input.0", views=False) is None
    assert prod.input_producer(MUL, f"{MUL}.output.0") is None  # not an input
    assert prod.input_producer(SUB, f"{SUB}.input.0") is None


def test_is_weight_without_parameters_leaves_is_requires_grad():
    rows = _rows().with_columns(pl.col("seq").eq(0).alias("requires_grad"))
    prod = Producers(rows, "")
    leaves = prod.rows.to_dicts()
    assert prod.is_weight(leaves[0]) and not prod.is_weight(leaves[2])


def test_integer_input_is_an_integer_or_boolean_tensor_input():
    rows = pl.DataFrame(
        {
            "_io": ["input", "input", "input", "output", "parameters", "input"],
            "kind": ["tensor", "tensor", "scalar", "tensor", "tensor", "tensor"],
            "tol_dtype": ["int64", "bool", "int64", "int64", "int32", "float32"],
        }
    )
    assert rows.select(integer_input())["_io"].to_list() == [True, True, False, False, True, False]

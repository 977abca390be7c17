"""Overflow: NaN, +-Inf and saturated (+-finfo.max, Ascend saturation mode) values, and who produced them first.

A tensor is dirty when it holds NaN, +Inf, -Inf or +-finfo(dtype).max.  With a reference run, only what the
reference does not also have at the aligned tensor counts (so the -Inf of attention masking is not overflow).
A masking op (masked_fill, where, fill, full, ...) whose fill argument is the dtype's extreme (a scalar or a
one-element tensor at +-Inf or +-finfo.max, e.g. `torch.where(mask, x, finfo.min)`) fills on purpose: its
output's extremes are a mask, not overflow, with or without a reference (`likely_mask`, reported but never the
first overflow); so is, without a reference, a -Inf-only output of a masking op.  A producer is a record whose
inputs and parameters are clean and whose output is dirty; the first overflow is the first producer in execution
order (steps in order, then dump order) per step and rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polars as pl

from dumpstore.dtypes import FINFO_MAX, is_float

from .compare import Comparison, compare_runs
from .load import load_run
from .order import ORDER, OUTPUT_IO, with_phase
from .select import check_selection

_FLAGS = ("has_nan", "has_posinf", "has_neginf", "has_sat")
_MASK_OPS = (
    "masked_fill",
    "masked_fill_",
    "where",
    "fill",
    "fill_",
    "full",
    "full_like",
    "new_full",
    "index_fill",
    "index_fill_",
    "masked_scatter",
    "triu",
    "tril",
    "select",  # MindSpore's where
    "masked_select",
)
# the dtype's extreme, to the dumper's print precision (as records.py's saturation test)
_EXTREME = {d: v * (1 - 1e-7) for d, v in FINFO_MAX.items() if is_float(d)}


@dataclass
class OverflowReport:
    run: str
    ref: str | None
    first_overflow: dict[str, Any] | None
    producers: list[dict[str, Any]]
    tensors: pl.DataFrame

    def to_dict(self) -> dict[str, Any]:
        d = {"run": self.run, "ref": self.ref, "first_overflow": self.first_overflow, "producers": self.producers}
        d["tensors"] = self.tensors.to_dicts()
        return d


def _negative_fill() -> pl.Expr:
    """Dirty by -Inf or -finfo.max only (no NaN, no +Inf, largest value below +finfo.max): what a masking op
    fills with (`masked_fill(mask, -inf)`, a Llama-style `torch.where(mask, finfo.min, x)`), not an overflow."""
    top = pl.col("dtype").replace_strict(FINFO_MAX, default=None, return_dtype=pl.Float64)
    below_top = (pl.col("max").cast(pl.Float64, strict=False) < top).fill_null(True)
    neg_sat = pl.col("new_sat") & (pl.col("min").cast(pl.Float64, strict=False) <= -top).fill_null(False)
    return (
        (pl.col("new_neginf") | neg_sat)
        & ~pl.col("new_nan")
        & ~pl.col("new_posinf")
        & (~pl.col("new_sat") | (neg_sat & below_top))
    )


def _kind(row: dict[str, Any]) -> str:
    if row["new_nan"]:
        return "nan"
    if row["new_posinf"] or row["new_neginf"]:
        return "inf"
    return "saturated"


def overflow(
    store,
    run: str,
    *,
    ref: str | None = None,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    cmp: Comparison | None = None,
) -> OverflowReport:
    """Dirty tensors of `run` (beyond what `ref` has) and their first producers.

    `cmp`: the comparison of `run` with `ref` when the caller already has it (it is not computed again).
    """
    check_selection(store, [run, ref], steps=steps, ranks=ranks)
    if ref is None:
        rows = load_run(store, run, steps=steps, ranks=ranks, sketches=False)
        rows = rows.with_columns([pl.col(f).fill_null(False).alias(f"new_{f[4:]}") for f in _FLAGS])
    else:
        cmp = cmp or compare_runs(store, run, ref, steps=steps, ranks=ranks)
        rows = cmp.rows.filter(pl.col("name").is_not_null())
        rows = rows.with_columns(
            [(pl.col(f).fill_null(False) & ~pl.col(f"ref_{f}").fill_null(False)).alias(f"new_{f[4:]}") for f in _FLAGS]
        )
    new = pl.any_horizontal([pl.col(f"new_{f[4:]}") for f in _FLAGS])
    only_neginf = pl.col("new_neginf") & ~pl.col("new_nan") & ~pl.col("new_posinf") & ~pl.col("new_sat")
    mask_op = pl.col("op_type").is_in(list(_MASK_OPS))
    rows = _with_fill(rows).filter(pl.col("kind") == "tensor")
    extreme = pl.col("dtype").replace_strict(_EXTREME, default=None, return_dtype=pl.Float64)
    fills_extreme = pl.col("_fill").is_not_null() & (pl.col("_fill") >= extreme.fill_null(float("inf")))
    rows = rows.with_columns(
        new.alias("dirty"),
        (mask_op & ~pl.col("new_nan") & ((only_neginf & pl.lit(ref is None)) | fills_extreme | _negative_fill())).alias(
            "likely_mask"
        ),
    ).drop("_fill")
    dirty = rows.filter(pl.col("dirty"))
    producers = _producers(rows)
    first = next((p for p in producers if not p["likely_mask"]), None)
    cols = [
        "step",
        "rank",
        "seq",
        "record",
        "name",
        "io",
        "dtype",
        "nan_count",
        "posinf_count",
        "neginf_count",
        "sat_count",
        "new_nan",
        "new_posinf",
        "new_neginf",
        "new_sat",
        "likely_mask",
    ]
    return OverflowReport(run, ref, first, producers, dirty.select(cols).sort(["step", "rank", "seq"]))


def _with_fill(rows: pl.DataFrame) -> pl.DataFrame:
    """`_fill`: per record, the largest |value| among its non-output scalars and one-element tensors (a fill
    value such as finfo.min or -inf), null when it has none."""
    one = pl.col("kind").eq("tensor") & pl.col("numel").le(1)
    value = (
        pl.when(pl.col("kind") == "scalar")
        .then(pl.col("scalar_value").abs())
        .when(one)
        .then(pl.max_horizontal(pl.col("max").abs(), pl.col("min").abs()))
        .otherwise(None)
    )
    value = pl.when(~pl.col("io").is_in(OUTPUT_IO)).then(value).otherwise(None)
    key = ["step", "rank", "source", "seq"]
    return rows.with_columns(value.fill_nan(None).max().over(key).alias("_fill"))


def _producers(rows: pl.DataFrame) -> list[dict[str, Any]]:
    is_out = pl.col("io").is_in(OUTPUT_IO)
    dirty_out = pl.col("dirty") & is_out
    leaf_cols = [
        "name",
        "likely_mask",
        "new_nan",
        "new_posinf",
        "new_neginf",
        "nan_count",
        "posinf_count",
        "neginf_count",
        "sat_count",
    ]
    per = (
        with_phase(rows)
        .group_by(["step", "rank", "source", "seq", "record"], maintain_order=True)
        .agg(
            (pl.col("dirty") & ~is_out).any().alias("dirty_in"),
            dirty_out.any().alias("dirty_out"),
            pl.col("_phase").first(),
            *[pl.col(c).filter(dirty_out).first() for c in leaf_cols],
        )
        .filter(~pl.col("dirty_in") & pl.col("dirty_out"))
        .sort(ORDER + ["seq"])
    )
    return [
        {
            "step": p["step"],
            "rank": p["rank"],
            "op": p["record"],
            "name": p["name"],
            "kind": _kind(p),
            "likely_mask": bool(p["likely_mask"]),
            "nan_count": p["nan_count"],
            "posinf_count": p["posinf_count"],
            "neginf_count": p["neginf_count"],
            "sat_count": p["sat_count"],
        }
        for p in per.iter_rows(named=True)
    ]

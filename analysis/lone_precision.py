"""One call of an API computed at a lower precision than its siblings (analysis/culprit.py, analysis/rank.py).

A device's precision is a policy of the op, not of the call: an autocast list, a kernel registered for one dtype,
TF32/HF32 matmuls.  Every call of one API on inputs of the same dtypes then makes outputs of the same dtype, in
every layer, micro-batch and step.  A record whose float output is in a lower-precision dtype than the
reference's (bfloat16 where the reference has float32), on inputs whose dtypes equal the reference's, is such a
policy when its siblings show it too (analysis/dtype_change.py does not count it as evidence for that reason);
when the siblings keep the reference's dtype it is not: one layer's code computes in another precision (an
autocast region around one call, a kernel chosen for one layer), and its error, at the lower dtype's rounding,
hides behind the lower dtype's tolerance.

Siblings: the records of the same API and direction (`Functional.conv2d` forward, its call counter dropped) with
the same reference dtypes of their float tensors (inputs and outputs, in order) whose float inputs have the
reference's dtypes in the target too, at every step and micro-batch of the pair.  A record is *lowered* when one
of its float outputs has a larger machine epsilon in the target; *kept* when every float output has the
reference's dtype.  The rule:

  lowered  and  kept >= MIN_KEPT  and  kept >= lowered

MIN_KEPT = 3 is noise.MIN_SIBLINGS (2 layers x 3 steps give a record 3 siblings): fewer calls that keep the
dtype are no evidence of a policy; `kept >= lowered`: the lowered calls are the exception, not the class's
rule (a device whose policy lowers one op class lowers every call of it, kept = 0).  Module records are not
judged (a module's output is what its code returned, upcast or not; the API record inside it shows the call).
The rule holds where the runs compute at the same precision and come from one framework (dtype_change.applies).

In compare (analysis/rank.py) a lowered record's output leaves are measured against the tolerance its kept
siblings are judged at (their median), not the lower dtype's: the error the op made is judged by what the pair
expects of that op.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dumpstore.dtypes import EPS, FLOAT_DTYPES
from dumpstore.names import CALL_DIRECTION_SQL, MODULE_RECORD_PREFIXES

from .order import INPUT_IO, OUTPUT_IO

MIN_KEPT = 3  # noise.MIN_SIBLINGS


def _eps(col: str) -> pl.Expr:
    return pl.col(col).replace_strict({d: EPS[d] for d in FLOAT_DTYPES}, default=None, return_dtype=pl.Float64)


def lone_records(rows: pl.DataFrame, rec: str, io: str, direction: str) -> pl.DataFrame:
    """Per record (`step`, `rank`, `source`, `rec`) of `rows` (leaves; the record, io and direction columns named
    by `rec`, `io`, `direction`): `lone_low` (the rule of the module doc), `lone_kept` and `lone_lowered` (the
    sibling counts), `lone_tol` (the median output tolerance of its kept siblings) and `lone_dtypes` (the
    lowered output's dtype in the target and in the reference).  Only records with a lowered output."""
    keys = ["step", "rank", "source", rec]
    need = {"dtype", "ref_dtype", "kind", "tol", rec, io, direction, "step", "rank", "source"}
    empty = pl.DataFrame(
        schema={
            "step": rows.schema.get("step", pl.Int64),
            "rank": rows.schema.get("rank", pl.Int64),
            "source": rows.schema.get("source", pl.String),
            rec: pl.String,
            "lone_low": pl.Boolean,
            "lone_kept": pl.UInt32,
            "lone_lowered": pl.UInt32,
            "lone_tol": pl.Float64,
            "lone_dtypes": pl.String,
        }
    )
    if not need <= set(rows.columns):
        return empty
    fl = (
        (pl.col("kind") == "tensor")
        & pl.col("dtype").is_in(list(FLOAT_DTYPES))
        & pl.col("ref_dtype").is_in(list(FLOAT_DTYPES))
    ).fill_null(False)
    is_in, is_out = pl.col(io).is_in(INPUT_IO), pl.col(io).is_in(OUTPUT_IO)
    lowered = fl & is_out & (_eps("dtype") > _eps("ref_dtype")).fill_null(False)
    module = pl.col(rec).str.starts_with(MODULE_RECORD_PREFIXES[0])
    for p in MODULE_RECORD_PREFIXES[1:]:
        module = module | pl.col(rec).str.starts_with(p)
    leaves = rows.filter(fl & pl.col(rec).is_not_null() & ~module.fill_null(False))
    if not leaves.height:
        return empty
    recs = leaves.group_by(keys, maintain_order=True).agg(
        pl.col(direction).first().alias("_dir"),
        pl.col("ref_dtype").str.join(",").alias("_sig"),  # the reference's float dtypes, in leaf order
        (fl & is_in & (pl.col("dtype") != pl.col("ref_dtype"))).any().alias("_in_moved"),
        lowered.any().alias("_low"),
        (is_out & (pl.col("dtype") != pl.col("ref_dtype"))).any().alias("_out_moved"),
        pl.col("tol").filter(is_out).max().alias("_tol"),
        pl.concat_str([pl.col("dtype"), pl.col("ref_dtype")], separator="/").filter(lowered).first().alias("_dt"),
        is_out.any().alias("_has_out"),
    )
    recs = recs.filter(~pl.col("_in_moved") & pl.col("_has_out")).with_columns(
        pl.col(rec).str.replace(CALL_DIRECTION_SQL, "${1}").alias("_api")
    )
    group = ["rank", "source", "_api", "_dir", "_sig"]
    kept = ~pl.col("_out_moved")
    n_kept = kept.sum().over(group).cast(pl.UInt32)
    n_low = pl.col("_low").sum().over(group).cast(pl.UInt32)
    sib_tol = pl.col("_tol").filter(kept).median().over(group)
    out = recs.with_columns(n_kept.alias("lone_kept"), n_low.alias("lone_lowered"), sib_tol.alias("lone_tol")).filter(
        pl.col("_low")
    )
    return out.select(
        *keys,
        ((pl.col("lone_kept") >= MIN_KEPT) & (pl.col("lone_kept") >= pl.col("lone_lowered"))).alias("lone_low"),
        "lone_kept",
        "lone_lowered",
        "lone_tol",
        pl.col("_dt").alias("lone_dtypes"),
    )


def with_lone(recs: pl.DataFrame, rows: pl.DataFrame) -> pl.DataFrame:
    """The verdict's record table (analysis/_divergence.py) with the columns of `lone_records` (its rows: the
    comparison's leaves in execution order); `lone_low` only where a float tensor's dtype differs between the
    runs and the dtype rule applies (`dtype_diff`)."""
    lone = lone_records(rows, "_record", "_io", "_direction")
    keys = ["step", "rank", "source", "_record"]
    out = recs.join(lone, on=keys, how="left", nulls_equal=True, maintain_order="left")
    diff = pl.col("dtype_diff").fill_null(False) if "dtype_diff" in out.columns else pl.lit(False)
    return out.with_columns((pl.col("lone_low").fill_null(False) & diff).alias("lone_low"))


def lone_detail(rec: dict[str, Any]) -> str:
    """The finding's sentence."""
    target, ref = (str(rec.get("lone_dtypes") or "?/?").split("/") + ["?"])[:2]
    return (
        f"its output is {target} in the target, {ref} in the reference, on inputs of the reference's dtypes, "
        f"where {rec['lone_kept']} other calls of this API on the same dtypes keep {ref} in both runs "
        f"({rec['lone_lowered']} lowered in all): not a device's policy for the op (that lowers every call) but "
        f"this call computed in {target}"
    )

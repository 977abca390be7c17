"""A tensor computed in another float dtype than the reference's (analysis/culprit.py).

Two runs of one model differ by rounding, never by the dtype of a tensor: the same code on another device makes
tensors of the same dtypes.  A float tensor of a paired record whose dtype differs between the runs (bfloat16
in the target where the reference has float32: an upcast the target's code left out, which msprobe does not
record as a call of its own) is discrete evidence, as a differing scalar argument is: the record computes in
another precision.  Its numeric error can stay inside the device noise (an RMSNorm computed in bfloat16 in a
bfloat16 model differs by bfloat16 rounding), so no noise model can find it; the dtype does.

The evidence is an input: a float input whose dtype differs and that no recorded op of one run made (a cast
msprobe does not record, `.float()` / `.to()`).  An output whose dtype differs on inputs of equal dtypes, and an
input both runs' recorded ops made in their own dtypes, can be a device's autocast policy (which ops run in
float32 differs between backends): not evidence.
The rule holds only where the runs compute at the same precision (`Comparison.precision`: a float32 reference
against a bfloat16 target differs in the dtype of every tensor, by design) and come from the same framework.
A tensor of a dtype made by a record of one run only is that record's (`extra_op` / `missing_op`, rule 6).
"""

from __future__ import annotations

import polars as pl

from dumpstore.dtypes import FLOAT_DTYPES


def changed_dtype() -> pl.Expr:
    """Row-level: a float tensor leaf whose dtype differs from the reference's (both float)."""
    return (
        (pl.col("kind") == "tensor")
        & pl.col("dtype").is_in(list(FLOAT_DTYPES))
        & pl.col("ref_dtype").is_in(list(FLOAT_DTYPES))
        & (pl.col("dtype") != pl.col("ref_dtype"))
    ).fill_null(False)


def dtype_columns() -> list[pl.Expr]:
    """Record-table aggregation (analysis/_divergence.py `_record_table`): `dtype_diff`, a float tensor of the
    record whose dtype differs between the runs (analysis/culprit.py judges its inputs)."""
    return [changed_dtype().any().alias("dtype_diff")]


def applies(precision: dict[str, str], cross_framework: bool) -> bool:
    """Whether the dtype rule applies to a pair: same compute precision, same framework."""
    return not cross_framework and precision.get("target") == precision.get("ref") is not None

"""A dtype difference carried from a recorded op to its consumers (analysis/culprit.py `_dtype_change`).

Two devices' autocast policies can differ on a recorded op: one run's `matmul` outputs float32 where the other's
outputs bfloat16, on inputs of equal dtypes (a backend that leaves `matmul` off its low-precision list).  The
tensor that op made carries the difference to every op that reads it, also through ops msprobe does not record
that keep dtype and values (view, reshape, transpose, permute, contiguous): the attention's `matmul` output
reaches the output projection through a transpose and a reshape.  That consumer's input then differs in dtype
although no cast was left out: the difference is the producer's, traced per tensor, and the consumer is judged
by its values (analysis/dtype_change.py says why a dtype with no producer is evidence otherwise).

The tensor is followed with analysis/producers.py: its producer is found in one run (its fingerprint, or its view
rule: the same statistics at any shape).  In the other run the producer's paired output must hold the same
values as the consumer's input there: the same dtype and number of elements, the same min and max (exact: no
order of the elements moves them), and mean and norm within the rounding of a sum taken in another order
(`reduction_slack`): a view made contiguous before its consumer (a transpose then a reshape) is summed in
another order by the dumper, whose float32 statistics then differ in their last bits, which the exact
fingerprint cannot see through.  The run whose tensor is 16-bit links it: its values sum exactly in float64
(tensor mode's statistics, from the file) and msprobe rounds its statistics of a 16-bit tensor to 16 bits.
Where neither run links it (both runs' statistics summed in another order and kept wider), the dtype is
judged as before: evidence.  The difference is carried only where the producer's output differs in the same
dtypes as the consumer's input (target and reference); a cast left out between them changes the dtype on one
side and is judged as before.

Backward, a gradient has the dtype of the tensor it is the gradient of (autograd casts it there, through casts
msprobe does not record): a backward record's gradient input whose dtypes are those of its forward record's
output (the same index) carries that output's difference, which was judged at the forward record, earlier in
execution order.
"""

from __future__ import annotations

import math
import re
from typing import Any

import polars as pl

from dumpstore.dtypes import EPS

from .order import OUTPUT_IO
from .producers import _Producers


def reduction_slack(dtype: str, n: int) -> tuple[float, float]:
    """How far the mean and the norm of the same `n` values of `dtype` can move when the dumper sums them in
    another order: (a bound on |mean difference| in units of the norm, a bound on the norm's relative
    difference).  A recursive sum of n terms errs by at most (n - 1) u sum|x| (u: the dtype's unit roundoff,
    EPS / 2; the dumper accumulates in the tensor's dtype or wider), and sum|x| <= sqrt(n) ||x||: the mean moves
    by at most (n - 1) u ||x|| / sqrt(n); the sum of squares by (n - 1) u relative, its square root by half of
    that.  Both bound a result rounded to the dtype too (one u).  Worst cases, not typical ones: the min and the
    max, exact, carry the identity."""
    u = EPS.get(dtype, EPS["float32"]) / 2
    m = max(n - 1, 1)
    return m * u / math.sqrt(max(n, 1)), m * u / 2


def same_values(a: dict[str, Any], b: dict[str, Any], prefix: str) -> bool:
    """Whether rows `a` and `b` hold the same values on one run's side (`prefix`: "" the target, "ref_" the
    reference): equal dtype, number of elements, min and max; mean and norm within `reduction_slack`."""
    keys = [f"{prefix}{k}" for k in ("dtype", "numel", "min", "max", "mean", "norm")]
    if any(a.get(k) is None or b.get(k) is None for k in keys):
        return False
    dtype, numel, lo, hi, mean, norm = keys
    if a[dtype] != b[dtype] or a[numel] != b[numel] or a[lo] != b[lo] or a[hi] != b[hi]:
        return False
    mean_slack, norm_rel = reduction_slack(str(a[dtype]), int(a[numel]))
    size = max(abs(float(a[norm])), abs(float(b[norm])))
    return (
        abs(float(a[mean]) - float(b[mean])) <= mean_slack * size
        and abs(float(a[norm]) - float(b[norm])) <= norm_rel * size
    )


class CarriedDtypes:
    """One step's rows (with both runs' fingerprint columns, analysis/culprit.py `_StepView.rows`) and each run's
    producers: which consumer inputs carry a recorded op's dtype difference, and the notes of those found."""

    def __init__(self, rows: pl.DataFrame, t_prod: _Producers, r_prod: _Producers):
        self.rows, self.prods = rows, {"": t_prod, "ref_": r_prod}

    def source(self, leaf: dict[str, Any]) -> dict[str, Any] | None:
        """The output row of the recorded op whose dtype difference `leaf` (a consumer's tensor input whose float
        dtype differs between the runs) carries, or None (a dtype no recorded op explains)."""
        forward = self._forward_output(leaf)
        if forward is not None:
            return forward
        for found, other in (("", "ref_"), ("ref_", "")):
            record = self.prods[found].producer(leaf)
            if record is None:
                continue
            made = self._output(found, record, leaf)
            if (
                made is not None
                and (made["dtype"], made["ref_dtype"]) == (leaf["dtype"], leaf["ref_dtype"])
                and same_values(made, leaf, other)
            ):
                return made
        return None

    def _forward_output(self, leaf: dict[str, Any]) -> dict[str, Any] | None:
        """For a backward record's gradient input: its forward record's output of the same index, where that
        output's dtypes are the gradient's (a gradient has its tensor's dtype), else None."""
        record = str(leaf.get("_record") or "")
        forward = _forward_name(record)
        if forward is None or leaf.get("_io") != "input":  # a backward record's inputs: its gradients
            return None
        hits = self.rows.filter(
            (pl.col("_record") == forward)
            & pl.col("_io").is_in(OUTPUT_IO)
            & (pl.col("kind") == "tensor")
            & (pl.col("index_path") == leaf.get("index_path"))
            & (pl.col("dtype") == leaf["dtype"])
            & (pl.col("ref_dtype") == leaf["ref_dtype"])
        )
        return hits.row(0, named=True) if hits.height else None

    def _output(self, prefix: str, record: str, leaf: dict[str, Any]) -> dict[str, Any] | None:
        """`record`'s output row in run `prefix` that produced `leaf` there (the same fingerprint, or view)."""
        tag = prefix or "t"
        same = pl.lit(False)
        for col in (f"_fp_{tag}", f"_vfp_{tag}"):
            if leaf.get(col) is not None:
                same = same | (pl.col(col) == leaf[col]).fill_null(False)
        hits = self.rows.filter(
            (pl.col(f"{prefix}record") == record)
            & pl.col(f"{prefix}io").is_in(OUTPUT_IO)
            & (pl.col(f"{prefix}kind") == "tensor")
            & same
        )
        return hits.row(0, named=True) if hits.height else None


def _forward_name(record: str) -> str | None:
    """The forward record of a backward record (`X.backward` -> `X.forward`, a module's `M.backward.N` ->
    `M.forward.N`), None for any other record."""
    if record.endswith(".backward"):
        return record[: -len(".backward")] + ".forward"
    forward = re.sub(r"\.backward\.(\d+)$", r".forward.\1", record)
    return forward if forward != record else None


def note(leaf: dict[str, Any], consumer: str, made: dict[str, Any]) -> dict[str, Any]:
    """The note of a carried dtype difference (analysis/noise.py `NoiseModel.carried_dtypes`, listed by a quiet
    verdict): where, which dtypes, and the recorded op that made them."""
    return {
        "step": leaf["step"],
        "rank": leaf["rank"],
        "op": consumer,
        "input": leaf["name"],
        "dtype": leaf["dtype"],
        "ref_dtype": leaf["ref_dtype"],
        "from": made.get("_record") or made.get("record") or made.get("ref_record"),
        "from_output": made.get("name") or made.get("ref_name"),
        "detail": (
            f"{leaf['name']} is {leaf['dtype']} in the target, {leaf['ref_dtype']} in the reference, as the output "
            f"of {made.get('_record') or made.get('record')} it carries (through ops msprobe does not record): "
            "judged by its values"
        ),
    }

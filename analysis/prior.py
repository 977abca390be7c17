"""The prior of the noise model: the precision each op class of a pair computes at, inferred from the pair.

A device may run float32 matmuls with inputs cut to 10 mantissa bits (NVIDIA TF32, Ascend HF32) or to bfloat16's
8, in runs whose tensors all say float32.  Every matmul of such a pair then differs by that rounding, nothing
else does, and an fp32 tolerance flags the very first matmul.  So the compute precision of the matmul class
(linear, matmul, bmm, addmm, baddbmm, einsum, conv, ...) is inferred from the pair itself:

  evidence   the class's *fresh* records: a float32-judged record whose tensor inputs agree (error at most
             QUIET x the fp32 tolerance: noise.QUIET) while its outputs may not; their output error is what
             the op itself made;
  nominal    float32 rounding of a K-term sum leaves a relative error of about eps32 x sqrt(K) (K: the
             reduction length, `reduction_length`: the last axis of the first input, the largest input axis
             for a convolution); the class is off nominal when the median
             of out_err / (eps32 x sqrt(K)) over at least MIN_EVIDENCE fresh records exceeds OFF_NOMINAL;
  precision  the finest lower precision whose tolerance holds that median: tf32 (10 mantissa bits, the
             tolerance of float16, which has as many) and then bfloat16.
The class's records (both directions: a backward matmul runs on the same units) are then judged at that
precision: tolerance, severity and status, and the eps floor of their amplification.  The verdict says so
(`precision["matmul"]`, `precision["note"]`).  Non-matmul classes are never re-judged: an activation computed
differently in every layer is a fault, not a device's right.

The constants were chosen on the development set (sample_dumps/ xdev pairs and the pairs of
sample_dumps/dev_extra.py), see docs/how-it-decides.md.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import polars as pl

from dumpstore.dtypes import EPS
from dumpstore.names import MODULE_RECORD_PREFIXES

from . import rules as R
from .noise import median
from .order import INPUT_IO, OUTPUT_IO
from .tolerance import REL_L2_DEFAULT, Tolerances

MIN_EVIDENCE = 3  # fresh matmul records needed before a class precision is inferred
OFF_NOMINAL = 8.0  # median fresh error beyond this many eps32 x sqrt(K): not float32 rounding
QUIET = 0.1  # as noise.QUIET: inputs agree below this share of the tolerance
LOWER = ("tf32", "bfloat16")  # candidate internal precisions of a float32 matmul, finest first
NOTE = {
    "tf32": "float32 matmuls of the pair differ as 10-bit-mantissa TF32/HF32 inputs would: judged at that precision",
    "bfloat16": "float32 matmuls of the pair differ as bfloat16 inputs would: judged at that precision",
}

_MATMUL_TOKENS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "mv", "dot", "tensordot"}


def is_matmul(api: str | None) -> bool:
    """Whether an API name (msprobe's `Functional.linear`, `Tensor.__matmul__`, `Torch.bmm`, `NPU.npu_bmmV2`,
    `Mint.nn.functional.conv2d`, ...) is a matrix product or convolution."""
    if not api:
        return False
    last = api.rsplit(".", 1)[-1].lower()
    tokens = [t for t in re.split(r"[^a-z0-9]+", last) if t]
    return any(t in _MATMUL_TOKENS or t.startswith("conv") or "matmul" in t or t.startswith("bmm") for t in tokens)


# ops that reduce over the last axis of their first input by default (softmax(dim=-1), a norm's normalised axis,
# a loss over its classes): K is that axis, as for a matrix product
_REDUCTIONS = frozenset(
    {
        "sum",
        "mean",
        "norm",
        "var",
        "std",
        "prod",
        "cumsum",
        "cumprod",
        "logsumexp",
        "softmax",
        "log_softmax",
        "layer_norm",
        "rms_norm",
        "group_norm",
        "batch_norm",
        "instance_norm",
        "cross_entropy",
        "nll_loss",
        "mse_loss",
        "l1_loss",
        "scaled_dot_product_attention",
        "vector_norm",
        "linalg_vector_norm",
    }
)


def is_reduction(op_class: str | None) -> bool:
    """Whether an op class (`Functional.softmax`, `Tensor.sum`, `Module.LlamaMLP`, ...) reduces over an axis."""
    if not op_class:
        return False
    if op_class.startswith(MODULE_RECORD_PREFIXES):
        return True
    op = op_class.rsplit(".", 1)[-1].lower().strip("_")
    return op in _REDUCTIONS or is_matmul(op)


_LAST_AXIS = frozenset({"softmax", "log_softmax", "logsumexp", "layer_norm", "rms_norm", "cross_entropy", "nll_loss"})


def reduction_length(op_class: str | None, k_last: float | None, k_max: float | None) -> float:
    """The reduction length K of an op from its tensor inputs' shapes, per op class: a matrix product (linear,
    matmul, bmm, ...) and an op reducing over the last axis (softmax, layer/RMS norm, cross-entropy) sum over
    the last axis of their first input (`k_last`); a convolution, a sum or mean over axes the record does not
    say, an attention (q k^T over the head size, then the weights times v over the keys) or a module record
    (which holds several ops) over at most the largest axis of their inputs (`k_max`: an upper bound); an
    elementwise op over 1."""
    if not is_reduction(op_class):
        return 1.0
    op = str(op_class).rsplit(".", 1)[-1].lower().strip("_")
    module = str(op_class).startswith(MODULE_RECORD_PREFIXES)
    product = is_matmul(op) and not op.startswith("conv") and "attention" not in op  # (SDPA: two products)
    last = not module and (op in _LAST_AXIS or product)
    k = k_last if last else k_max
    return max(float(k or 1.0), 1.0)


def _api() -> pl.Expr:
    return pl.coalesce(pl.col("api"), pl.col("ref_api"))


def reduction_columns(is_in: pl.Expr, tensor: pl.Expr) -> list[pl.Expr]:
    """Aggregations over a record's leaves (a group_by): `k_last`, the last axis of its first tensor input, and
    `red_len`, the largest axis of its tensor inputs: what `reduction_length` picks from."""
    inputs = is_in & tensor & pl.col("shape").list.len().gt(0).fill_null(False)
    return [
        pl.col("shape").filter(inputs).first().list.last().cast(pl.Float64).alias("k_last"),
        pl.col("shape").list.max().filter(inputs).max().cast(pl.Float64).alias("red_len"),
    ]


def class_precision(rows: pl.DataFrame) -> tuple[str | None, dict[str, Any]]:
    """The inferred compute precision of the pair's float32 matmuls (None: float32 explains them) and the
    evidence: records, median error in units of eps32 x sqrt(K)."""
    if not rows.height or "api" not in rows.columns:
        return None, {}
    apis = rows.select(_api().unique()).to_series().drop_nulls().to_list()
    mm = [a for a in apis if is_matmul(a)]
    if not mm:
        return None, {}
    tensor = (pl.col("kind") == "tensor") & (pl.col("ref_kind") == "tensor")
    part = rows.filter(_api().is_in(mm) & tensor & (pl.col("tol_dtype") == "float32"))
    if not part.height:
        return None, {}
    is_in, is_out = pl.col("io").is_in(INPUT_IO), pl.col("io").is_in(OUTPUT_IO)
    recs = part.group_by(["step", "rank", "source", "record"]).agg(
        pl.col("err").filter(is_out).max().alias("out_err"),
        pl.col("err").filter(is_in).max().alias("in_err"),
        pl.col("tol").max().alias("tol"),
        _api().first().alias("api"),
        *reduction_columns(is_in, pl.lit(True)),
    )
    fresh = recs.filter(  # records with inputs (parameters_grad records have none: nothing says they agree)
        pl.col("out_err").is_not_null()
        & pl.col("out_err").is_finite()
        & pl.col("in_err").is_not_null()
        & (pl.col("in_err") <= QUIET * pl.col("tol"))
    )
    if fresh.height < MIN_EVIDENCE:
        return None, {}
    k_ = np.array([reduction_length(a, kl, km) for a, kl, km in fresh.select("api", "k_last", "red_len").iter_rows()])
    err = fresh["out_err"].to_numpy()
    z = float(median(err / (EPS["float32"] * np.sqrt(k_))))
    level = float(median(err))
    evidence = {"fresh_matmuls": fresh.height, "median_err": level, "median_eps32_sqrtk": z}
    if z <= OFF_NOMINAL:
        return None, evidence
    table = Tolerances()
    for cand in LOWER:
        if level <= table.for_dtype(cand):
            return cand, evidence
    return None, evidence


def judge_classes(rows: pl.DataFrame, precision: dict[str, str], tol: Tolerances) -> pl.DataFrame:
    """Re-judge the matmul class at its inferred precision (see the module doc); `precision` gains `matmul`
    and `note` when it is lower than float32.  A float32 tolerance the user stated (`--tol float32=X`, `--tol X`)
    is taken as stated: the class is not re-judged."""
    if tol.all_dtypes is not None or tol.rel_l2.get("float32") != REL_L2_DEFAULT["float32"]:
        return rows
    cand, _ = class_precision(rows)
    if cand is None:
        return rows
    precision["matmul"] = cand
    precision["note"] = NOTE[cand]
    apis = [a for a in rows.select(_api().unique()).to_series().drop_nulls().to_list() if is_matmul(a)]
    tensor = (pl.col("kind") == "tensor") & (pl.col("ref_kind") == "tensor")
    hit = _api().is_in(apis) & tensor & (pl.col("tol_dtype") == "float32")
    new_tol = tol.all_dtypes if tol.all_dtypes is not None else tol.for_dtype(cand)
    rows = rows.with_columns(hit.alias("_rejudged"))
    hit = pl.col("_rejudged")
    rows = rows.with_columns(
        pl.when(hit).then(pl.lit(cand)).otherwise(pl.col("tol_dtype")).alias("tol_dtype"),
        pl.when(hit).then(pl.lit(new_tol)).otherwise(pl.col("tol")).alias("tol"),
    )
    unmatched = pl.col("match").is_in(["target_only", "ref_only"])
    status = R.pair_status(unmatched, R.unreadable_kind(), R.has_error_text())
    sev = R.severity(rows["err"].cast(pl.Float64).to_numpy(), rows["tol"].cast(pl.Float64).to_numpy())
    return rows.with_columns(
        pl.when(hit).then(status).otherwise(pl.col("status")).alias("status"),
        pl.when(hit).then(R.nullable("severity", sev)).otherwise(pl.col("severity")).alias("severity"),
    ).drop("_rejudged")

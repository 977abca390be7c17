"""What siblings may excuse: no more than the prior allows an op of its class and dtype (analysis/culprit.py).

The sibling rule (analysis/noise.py `sibling_bar`) calls an op's error the class's noise when the same op class in
other layers makes as much.  That holds for a device's rounding of a class, and equally for a fault repeated in
every layer (an op computed wrongly everywhere, with no argument or record to show it).  The two differ in size:
a device's rounding of one op stays within what its dtype and reduction length allow, a fault need not.  So
siblings excuse an op's error only up to the prior's reach:

  reach = max(PRIOR_TOLERANCES x tol, STAND_OUT x eps(dtype) x sqrt(K))

`tol` is the op's tolerance at its judged dtype (after the matmul class's inferred precision, analysis/prior.py);
PRIOR_TOLERANCES = 4 is the most a lower internal precision of one op was seen to do on the development set
(fp16 inside an fp32 softmax: 1.3 tolerances; TF32 matmuls 2-4 before the class is re-judged);
culprit.WEAK_SEVERITY is defined as this constant (an op within it yields to a stronger finding: the same bound
on what rounding the noise model has no evidence for can do).  eps(dtype) x sqrt(K) is the rounding of a K-term
sum accumulated at the judged dtype (a device may accumulate a bf16 reduction in bf16), K the reduction length of
prior.reduction_length (one definition, shared with the matmul class's precision): the last axis of the first
input for a matrix product and for ops reducing the last axis (softmax, layer/RMS norm, cross-entropy), the
largest axis of the tensor inputs for a convolution, a sum or mean over axes the record does not say, an
attention or a module record (an upper bound), 1 for an elementwise op.  Beyond the reach an op stands out of its
siblings' noise even when every sibling makes as much: a fault in every layer is named at its first instance.
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from dumpstore.dtypes import EPS

from .noise import STAND_OUT
from .prior import reduction_columns, reduction_length

PRIOR_TOLERANCES = 4.0


def reach_columns(is_in: pl.Expr, tensor: pl.Expr) -> list[pl.Expr]:
    """Record-table aggregations (analysis/_divergence.py): `k_last` and `red_len`, what the reduction length K
    is picked from per op class (prior.reduction_length)."""
    return reduction_columns(is_in, tensor)


def prior_reach(rec: dict[str, Any]) -> float | None:
    """The largest error the prior allows this record's op (see the module doc); None without a tolerance."""
    tol = rec.get("tol")
    if tol is None or not tol > 0:
        return None
    k = reduction_length(rec.get("op_class"), rec.get("k_last"), rec.get("red_len"))
    eps = EPS.get(str(rec.get("tol_dtype")), EPS["float32"])
    return max(PRIOR_TOLERANCES * float(tol), STAND_OUT * eps * math.sqrt(max(k, 1.0)))


def siblings_excuse(rec: dict[str, Any], value: float | None, sib: float | None) -> bool:
    """Whether the siblings' error excuses `value` (the op's output or local error): within STAND_OUT x their
    quantile (noise.sibling_bar) and within the prior's reach."""
    if sib is None or value is None or not value <= sib:
        return False
    reach = prior_reach(rec)
    return reach is None or value <= reach

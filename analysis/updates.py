"""The floor of the update-differs rule (analysis/steps.py `update_differs`): how far apart, in units of an update,
the runs' updates must be (median over the parameters) before "every parameter moved otherwise than its gradient
explains" names the optimizer (see docs/how-it-decides.md, section 5).

  the first update of the pair (no earlier step in the rows)
                   X_MIN, a quarter of an update: Adam's first update is lr sign(g) per element (m/sqrt(v) with
                   one gradient), so device noise flips whole elements whose gradient is near 0, in every
                   parameter alike, by a part of an update its gradients' norm-wise error does not explain
  a later update   UPDATE_X_MIN (a sixteenth of an update) and STAND_OUT x the median x of the update before it:
                   the pair's own measured optimizer noise is the baseline.  Clipping at another norm under an
                   adaptive optimizer (Adam, Adamax) from the second update on rescales the new gradient inside
                   m and u/v, which also hold the earlier gradients, so each element moves by its own factor:
                   the update sizes keep their ratio (the update-ratio rule sees nothing) while every element
                   moves by a tenth to a half of an update.  The first update under Adam or Adamax is the same
                   in both runs whatever the clipping (sign(g) is scale-free), so nothing is lost there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from . import steps as ST
from .noise import STAND_OUT, median


def update_floor(rows: pl.DataFrame, before: int, params: pl.DataFrame) -> tuple[float, float | None]:
    """(floor, the median x of the update before) for the update between step `before` and the next compared
    step; `params`: that later step's parameter candidates (the rows `steps.table` takes), looked up at `before`
    and the step before it by (rank, source, record, io, index path).  The median is None at the first update
    (no earlier step in `rows`, or none of the parameters measured there)."""
    earlier = [s for s in rows["step"].unique().to_list() if s is not None and s < before]
    if not earlier:
        return ST.X_MIN, None
    t = ST.table(rows, max(earlier), before, params)
    x = t["x"].fill_null(np.nan).to_numpy() if t is not None else np.zeros(0)
    x = x[np.isfinite(x)]
    if x.size < ST.MIN_MEASURED:
        return ST.X_MIN, None
    prev = float(median(x))
    return max(ST.UPDATE_X_MIN, STAND_OUT * prev), prev


def updates_differ(
    rows: pl.DataFrame, before: int, params: pl.DataFrame, table: pl.DataFrame | None
) -> dict[str, Any] | None:
    """`steps.update_differs` of `table` (the update between `before` and the next step) at its floor
    (`update_floor`, measured only where the rest of the rule holds), with the floor and the median x of the
    update before in the evidence; None when the updates do not differ."""
    found = ST.update_differs(table, 0.0)
    if found is None:
        return None
    floor, prev = update_floor(rows, before, params)
    if not found["median_update_units"] >= floor:
        return None
    return found | {"floor": floor, "previous_update_units": prev}

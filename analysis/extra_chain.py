"""The first of a chain of calls in one run only.

An extra (or missing) call found as the producer of a diverged input (analysis/culprit.py, rule 6) may itself
read the output of another call of the same run only: the target normalises its images twice, `sub, div` run
once more, and the diverged input of the first conv is the extra `div`'s output; the extra `sub` made `div`'s
input.  The culprit is the chain's first call, the one whose tensor inputs both runs have: walking back from
the named call through its tensor inputs, as long as one is the output of an earlier call of the same run only
(the same values, through a view or not: analysis/producers.py `view_key`, all four statistics, any dtype),
the earlier call is named.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import polars as pl

from .findings import Finding
from .order import INPUT_IO, OUTPUT_IO
from .producers import STATS, view_key

_SIDES = {
    "extra_op": ("target_only", "", "t_record", "target"),
    "missing_op": ("ref_only", "ref_", "r_record", "reference"),
}


def chain_head(found: tuple[Finding, tuple] | None, rows: pl.DataFrame, records: pl.DataFrame) -> Any:
    """`found` (a culprit and its order key) with an extra_op / missing_op culprit moved to the first call of
    its chain of calls in one run only (see the module's doc); unchanged otherwise."""
    if found is None or found[0].kind not in _SIDES:
        return found
    f, key = found
    how, pre, col, run = _SIDES[f.kind]
    only = set(
        records.filter((pl.col("how") == how) & (pl.col("step") == f.step) & (pl.col("rank") == f.rank))[col].to_list()
    )
    if f.op not in only:
        return found
    side = rows.filter(
        (pl.col("step") == f.step)
        & (pl.col("rank") == f.rank)
        & pl.col(f"{pre}record").is_in(list(only))
        & (pl.col(f"{pre}kind") == "tensor")
    ).select(f"{pre}record", f"{pre}seq", f"{pre}io", f"{pre}dtype", f"{pre}numel", *[f"{pre}{s}" for s in STATS])
    made: dict[tuple, tuple[int, str]] = {}  # view key -> (seq, record) of the first one-sided output
    ins: dict[str, list[tuple]] = {}
    for r in side.iter_rows(named=True):
        record, seq, io, fp = r[f"{pre}record"], r[f"{pre}seq"], r[f"{pre}io"], view_key(r, pre)
        if fp is None:
            continue  # no statistics: nothing to follow
        if io in OUTPUT_IO and (fp not in made or seq < made[fp][0]):
            made[fp] = (seq, record)
        elif io in INPUT_IO:
            ins.setdefault(record, []).append((seq, fp))
    chain, at = [f.op], f.op
    while len(chain) <= len(only):
        earlier = [made[fp] for seq, fp in ins.get(at, []) if fp in made and made[fp][0] < seq]
        if not earlier:
            break
        at = min(earlier)[1]
        if at in chain:
            break
        chain.append(at)
    if len(chain) == 1:
        return found
    path = " -> ".join(reversed(chain))
    tail = (f.detail or "").removeprefix(f"only in the {run}; ").replace("its output", f"{f.op}'s output", 1)
    detail = f"only in the {run}, the first of {len(chain)} calls there that feed each other ({path})"
    detail += f"; {tail}" if tail else ""
    return replace(f, op=chain[-1], name=None, detail=detail, evidence={**f.evidence, "chain": chain[::-1]}), key

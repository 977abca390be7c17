"""What the reports are rendered from: one comparison, its divergence verdict, overflow, checklist and health."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl

from .._checklist import Checklist, checklist
from .._divergence import divergence
from .._health import HealthReport, health
from .._overflow import OverflowReport, overflow
from ..compare import Comparison, compare_runs
from ..tolerance import Tolerances
from ..verdict import Question, Verdict, answer

__all__ = ["ReportData", "analyze", "fetch"]


@dataclass
class ReportData:
    """What both reports are rendered from."""

    cmp: Comparison
    verdict: Verdict
    overflow: OverflowReport | None
    checklist: Checklist | None = None
    health: HealthReport | None = None


def analyze(
    store,
    target: str,
    ref: str,
    *,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    tolerances: Tolerances | None = None,
    exact: bool = False,
    mapping: Any = None,
    maps: tuple[str, ...] = (),
    progress: Callable[[str, int, int], None] | None = None,
) -> ReportData:
    """Compare `target` with `ref`, find the first divergence and culprit, and scan `target` for overflow.

    Arguments as for `compare_runs`; name mappings either as files (`maps`, msprobe's forms: the verdict then
    comes from the store's memo like `dumpstore divergence`'s) or as an `analysis.mapping.Mapping` object.
    `progress(stage, done, total)` is called as each of the five stages starts and once at the end.
    """
    tell = progress or (lambda stage, done, total: None)
    tell("compare", 0, 5)
    q = Question(
        target,
        ref,
        tuple(steps) if steps else None,
        tuple(ranks) if ranks else None,
        tolerances or Tolerances(),
        tuple(maps),
        exact,
    )
    from_files = mapping is None
    if from_files:
        mapping = q.compare_options()["mapping"]
    cmp = compare_runs(
        store, target, ref, steps=steps, ranks=ranks, tolerances=tolerances, exact=exact, mapping=mapping
    )
    tell("divergence", 1, 5)
    verdict = answer(store, q, comparison=cmp) if from_files else divergence(cmp)
    tell("overflow", 2, 5)
    ovf = overflow(store, target, ref=ref, steps=steps, ranks=ranks, cmp=cmp)
    tell("checklist", 3, 5)
    cl = checklist(store, target, ref, tolerances=tolerances, cmp=cmp)
    tell("health", 4, 5)
    hr = health(store, target, overflow_report=ovf)  # the overflow scan once: the card and health share it
    tell("analysed", 5, 5)
    return ReportData(cmp, verdict, ovf, cl, hr)


def fetch(store, run: str, sql: str, params: dict) -> pl.DataFrame | None:
    """Rows of `sql` over the store's views, or None where the store lacks a column (the caller falls back)."""
    import duckdb

    from dumpstore.query import connect, fetch_arrow

    con = connect(store, runs=[run])
    try:
        return pl.from_arrow(fetch_arrow(con, sql, params))  # type: ignore[return-value]
    except duckdb.BinderException:
        return None
    finally:
        con.close()

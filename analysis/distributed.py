"""The Ray engine of divergence, overflow and compare: per-(step, rank) work mapped over a cluster, reduced here.

The common (step, rank) units of the runs are cut into partitions (one step, a run of ranks each).  A Ray task
calls the library's public function on its partition with `steps=[step], ranks=[...]` and returns its small
answer; the driver reduces the answers to what the local engine answers for the whole runs:

  divergence  the screen (`screen.screen`) of each partition; the driver concatenates their units, sums their
              dtype counts into the runs' compute precision and hands the merged screen to
              `divergence_by_steps`, which compares exactly (in the driver) only the units needing alignment
              and those of the first diverged step, as it does with its own screen;
  overflow    `overflow.overflow` of each partition; producers and dirty tensors concatenated in partition order,
              which is execution order (steps, then ranks) -- for msprobe 8.x stores, whose deferred
              parameters_grad records follow every rank of their step, a partition is a whole step;
  compare     `compare_runs` + `rank_rows(top=N)` of each partition; the driver ranks the partitions' tops.

Every partition judges tensors at its own compute precision; when a partition's differs from the runs' (ranks
computing in different dtypes) the driver answers with the local engine instead, so the answer never differs.
The store must be on a file system every node reaches.  Ray is imported only when one of these is called.
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from dumpstore.engine_ray import EngineError, session

from .compare import Comparison, coverage
from .rules import compute_dtype_from_counts, floor_of
from .tolerance import Tolerances

Partition = tuple[int, list[int]]


def partitions(
    store,
    target: str,
    ref: str | None,
    steps: list[int] | None,
    ranks: list[int] | None,
    cpus: float,
    size: int | None = None,
    whole_steps: bool = False,
) -> list[Partition]:
    """(step, ranks) partitions of the runs' common steps and ranks, about two per cluster CPU by default."""
    t_info = store.run_info(target)
    cov = coverage(t_info, store.run_info(ref) if ref else t_info)
    steps_c = [s for s in cov["common_steps"] if steps is None or s in steps]
    ranks_c = [k for k in cov["common_ranks"] if ranks is None or k in ranks]
    if size is not None and size < 1:
        raise EngineError(f"--batch {size}: give at least 1 rank per task")
    if whole_steps or not ranks_c:
        return [(s, ranks_c) for s in steps_c]
    size = size or max(1, math.ceil(len(steps_c) * len(ranks_c) / (2 * max(cpus, 1))))
    return [(s, ranks_c[i : i + size]) for s in steps_c for i in range(0, len(ranks_c), size)]


def _map(fn, store, parts: list[Partition], address: str | None, *args: Any) -> list:
    """fn(store root, step, ranks, *args) on Ray for every partition; the answers in partition order."""
    with session(address) as ray:
        task = ray.remote(max_retries=2)(fn)
        refs = [task.remote(str(store.root), s, ks, *args) for s, ks in parts]
        try:
            return ray.get(refs)
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, Exception) and cause.__class__.__module__.startswith("dumpstore"):
                raise cause.__class__(str(cause)) from None
            raise EngineError(
                f"a Ray task failed: {type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
            ) from None


def _cpus(address: str | None) -> float:
    with session(address) as ray:
        return ray.cluster_resources().get("CPU", 1)


# ------------------------------------------------------------------------------------------------ divergence
def divergence_by_steps(
    store,
    target: str,
    ref: str,
    *,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    tolerances: Tolerances | None = None,
    exact: bool = False,
    mapping: Any = None,
    address: str | None = None,
    batch: int | None = None,
):
    """`divergence.divergence_by_steps` with the screen mapped over a Ray cluster; the same Verdict."""
    from ._divergence import divergence_by_steps as local

    tol = tolerances or Tolerances()
    with session(address):
        cpus = _cpus(address)
        parts = partitions(store, target, ref, steps, ranks, cpus, batch)

        def screener(st, tgt, rf, steps_c, ranks_c, tolerances):
            return merge_screens(_map(_screen_part, st, parts, address, tgt, rf, tolerances))

        return local(
            store,
            target,
            ref,
            steps=steps,
            ranks=ranks,
            tolerances=tol,
            exact=exact,
            mapping=mapping,
            screener=screener,
        )


def _screen_part(root: str, step: int, ranks: list[int], target: str, ref: str, tol: Tolerances):
    """Task: the screen of one partition."""
    from dumpstore.store import open_store

    from .screen import screen

    return screen(open_store(root), target, ref, [step], ranks, tol, threads=1)


def merge_screens(parts: list):
    """One ScreenResult from the partitions'; raises screen.Unsupported (the caller then compares locally) when
    a partition judged at another compute precision than the runs'."""
    from .screen import ScreenResult, Unsupported, _empty_units

    counts: dict[str, dict[str, int]] = {"target": {}, "ref": {}}
    for p in parts:
        for side in counts:
            for d, n in p.dtype_counts.get(side, {}).items():
                counts[side][d] = counts[side].get(d, 0) + n
    a, b = compute_dtype_from_counts(counts["target"]), compute_dtype_from_counts(counts["ref"])
    precision = {"target": a, "ref": b, "floor": floor_of(a, b)}
    if any(p.precision["floor"] != precision["floor"] for p in parts if p.units.height):
        raise Unsupported("partitions compute at different precisions")
    frames = [p.units for p in parts if p.units.height]
    units = pl.concat(frames, how="vertical").sort(["step", "rank", "source"]) if frames else _empty_units()
    complex_units = sorted({u for p in parts for u in p.complex_units})
    return ScreenResult(units, complex_units, precision, counts)


# ------------------------------------------------------------------------------------------------ overflow
def overflow(
    store,
    run: str,
    *,
    ref: str | None = None,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    address: str | None = None,
    batch: int | None = None,
):
    """`overflow.overflow` mapped over a Ray cluster by partition; the same OverflowReport."""
    from ._overflow import OverflowReport, is_overflow

    whole = store.run_info(run).get("generation") == "8.x" or bool(
        ref and store.run_info(ref).get("generation") == "8.x"
    )
    with session(address):
        parts = partitions(store, run, ref, steps, ranks, _cpus(address), batch, whole_steps=whole)
        reports = _map(_overflow_part, store, parts, address, run, ref)
    producers = [p for r in reports for p in r.producers]
    first = next((p for p in producers if is_overflow(p)), None)
    frames = [r.tensors for r in reports]
    tensors = pl.concat(frames, how="vertical_relaxed") if frames else None
    if tensors is None:
        from ._overflow import overflow as local

        return local(store, run, ref=ref, steps=[], ranks=ranks)
    return OverflowReport(run, ref, first, producers, tensors)


def _overflow_part(root: str, step: int, ranks: list[int], run: str, ref: str | None):
    """Task: the overflow report of one partition."""
    from dumpstore.store import open_store

    from ._overflow import overflow

    return overflow(open_store(root), run, ref=ref, steps=[step], ranks=ranks)


# ------------------------------------------------------------------------------------------------ compare
def ranked(
    store,
    target: str,
    ref: str,
    *,
    rank_options: dict[str, Any],
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    address: str | None = None,
    batch: int | None = None,
    **compare_options: Any,
) -> pl.DataFrame:
    """`rank_rows(compare_runs(...), **rank_options)` with the comparison mapped over a Ray cluster by partition:
    each partition's top rows, ranked again here; the same rows (the local engine's when precisions differ)."""
    from .compare import compare_runs
    from .rank import rank_rows

    with session(address):
        parts = partitions(store, target, ref, steps, ranks, _cpus(address), batch)
        answers = _map(_compare_part, store, parts, address, target, ref, compare_options, rank_options)
    floors = {a[0]["floor"] for a in answers if a[1].height}
    if len(floors) > 1:  # ranks compute in different precisions: judge all at once, as the local engine
        cmp = compare_runs(store, target, ref, steps=steps, ranks=ranks, **compare_options)
        return rank_rows(cmp, **rank_options)
    if not answers:
        return rank_rows(compare_runs(store, target, ref, steps=[], ranks=ranks, **compare_options), **rank_options)
    rows = pl.concat([a[1] for a in answers], how="vertical_relaxed")
    rows = rows.with_columns(pl.lit(None, pl.String).alias("ref_name"))  # `name` holds it already
    rows = rows.rename({"rel_l2": "err"})  # rank_rows reads the comparison's `err` and shows it as rel_l2
    cmp = Comparison(
        rows, pl.DataFrame(), answers[0][0], compare_options.get("tolerances") or Tolerances(), target, ref, {}
    )
    # the filters ran in the partitions; the verdict's culprit (`culprit`) comes first again over all of them
    again = {k: v for k, v in rank_options.items() if k in ("by", "top", "culprit")}
    return rank_rows(cmp, **again)


def _compare_part(
    root: str, step: int, ranks: list[int], target: str, ref: str, compare_options: dict, rank_options: dict
) -> tuple[dict[str, str], pl.DataFrame]:
    """Task: one partition's compute precision and its top rows, with every column rank_rows sorts or filters."""
    from dumpstore.store import open_store

    from .compare import compare_runs
    from .rank import COLUMNS, CULPRIT_NOTE, rank_rows

    cmp = compare_runs(open_store(root), target, ref, steps=[step], ranks=ranks, **compare_options)
    top = rank_rows(cmp, **rank_options)
    if rank_options.get("culprit") is not None:  # kept among the top rows here; noted once, by the driver
        plain = pl.col("detail").str.strip_prefix(CULPRIT_NOTE).str.strip_prefix("; ")
        top = top.with_columns(pl.when(plain == "").then(None).otherwise(plain).alias("detail"))
    return cmp.precision, top.select([c for c in COLUMNS if c in top.columns])

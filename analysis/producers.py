"""Who produced a tensor within one step: the first earlier record whose output has the same fingerprint (dtype,
shape and statistics), or the same values through a view msprobe does not record (see docs/how-it-decides.md,
rule 6). Split from analysis/culprit.py, which asks it."""

from __future__ import annotations

from typing import Any

import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES, FLOAT_DTYPES

from .order import INPUT_IO, OUTPUT_IO

_FP_STATS = ("min", "max", "mean", "norm")


def _fingerprint(prefix: str) -> pl.Expr:
    """Hash of (dtype, shape, step, rank, source, statistics) of one side's tensor; null without statistics."""
    cols = [pl.col(f"{prefix}dtype"), pl.col(f"{prefix}shape"), pl.col("step"), pl.col("rank"), pl.col("source")]
    cols += [pl.col(f"{prefix}{s}") for s in _FP_STATS]
    known = pl.any_horizontal([pl.col(f"{prefix}{s}").is_not_null() for s in _FP_STATS])
    return pl.when(known).then(pl.struct(cols).hash()).alias(f"_fp_{prefix or 't'}")


def _view_fingerprint(prefix: str) -> pl.Expr:
    """Hash of (dtype, number of elements, step, rank, source, statistics) of a float tensor with all four
    statistics: the same values through a view msprobe does not record (view, reshape, transpose, permute: the
    statistics do not depend on the order), of any shape; null otherwise (integer statistics, max/min only,
    match too easily)."""
    cols = [pl.col(f"{prefix}dtype"), pl.col(f"{prefix}numel"), pl.col("step"), pl.col("rank"), pl.col("source")]
    cols += [pl.col(f"{prefix}{s}") for s in _FP_STATS]
    known = pl.all_horizontal([pl.col(f"{prefix}{s}").is_not_null() for s in _FP_STATS]) & pl.col(
        f"{prefix}dtype"
    ).is_in(list(FLOAT_DTYPES))
    return pl.when(known).then(pl.struct(cols).hash()).alias(f"_vfp_{prefix or 't'}")


def _first_outputs(rows: pl.DataFrame, prefix: str, col: str) -> dict[Any, tuple[int, str]]:
    """Fingerprint (column `col`) -> (seq, record) of the first output tensor of one run with it."""
    outs = (
        rows.lazy()  # lazy: only the columns used are filtered and sorted
        .filter(
            pl.col(f"{prefix}io").is_in(OUTPUT_IO) & (pl.col(f"{prefix}kind") == "tensor") & pl.col(col).is_not_null()
        )
        .sort(f"{prefix}seq")
        .group_by(col, maintain_order=True)
        .agg(pl.col(f"{prefix}seq").first(), pl.col(f"{prefix}record").first())
        .collect()
    )
    return dict(zip(outs[col].to_list(), zip(outs[f"{prefix}seq"].to_list(), outs[f"{prefix}record"].to_list())))


class _Producers:
    """Which record of one run first produced a tensor, by fingerprint (dtype, shape, statistics)."""

    def __init__(self, rows: pl.DataFrame, prefix: str):
        self.prefix = prefix
        col = f"_fp_{prefix or 't'}"
        self.first = _first_outputs(rows, prefix, col)
        self.first_view = _first_outputs(rows, prefix, f"_vfp_{prefix or 't'}")
        # the module records' `parameters` leaves (msprobe mix level): which tensors are weights
        self.params = set(
            rows.lazy()
            .filter((pl.col(f"{prefix}io") == "parameters") & pl.col(col).is_not_null())
            .select(col)
            .collect()[col]
            .to_list()
        )

    def is_weight(self, r: dict[str, Any]) -> bool:
        """A tensor input that is a weight: a `parameters` leaf, or one requiring grad that is a module's
        parameter where module records list them (else an activation reached through unrecorded ops, such
        as `k.transpose()`), or that requires grad where they list none."""
        if r.get(f"{self.prefix}io") == "parameters":
            return True
        if not r.get(f"{self.prefix}requires_grad"):
            return False
        return not self.params or r.get(f"_fp_{self.prefix or 't'}") in self.params

    def producer(self, r: dict[str, Any], views: bool = True) -> str | None:
        """The record that produced this tensor before its own record: the same tensor, or (`views`) the same
        values through a view msprobe does not record (a transpose or reshape of q_proj's output)."""
        seq = r.get(f"{self.prefix}seq")
        found = self.producer_of(r.get(f"_fp_{self.prefix or 't'}"), seq)
        if found is not None or not views:
            return found
        hit = self.first_view.get(r.get(f"_vfp_{self.prefix or 't'}"))
        if hit is None or seq is None or hit[0] >= seq:
            return None
        return hit[1]

    def producer_of(self, fingerprint: int | None, seq: int | None) -> str | None:
        """The record that produced a tensor of this fingerprint before record `seq` (None: none did)."""
        hit = self.first.get(fingerprint)
        if hit is None or seq is None or hit[0] >= seq:
            return None
        return hit[1]


def discrete_data_readers(rows: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """The records (`keys`) of one step's rows with an integer or boolean tensor input that differs between the
    runs (labels, ids, indices): candidates for the culprit judge even where their outputs stay within their
    tolerance (analysis/culprit.py `_discrete_data` decides whether no op made them)."""
    discrete = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
    return rows.filter(
        pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor") & discrete & (pl.col("status") == "diverged")
    ).select(keys)


def discrete_first_differs(rows: pl.DataFrame) -> dict[tuple, int]:
    """(rank, source, record, leaf name) -> the first step of `rows` at which that integer or boolean tensor input
    differs between the runs: data that differ at a later step only agreed before (analysis/culprit.py
    `_discrete_data`)."""
    discrete = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
    keys = ["rank", "source", "_record", "name"]
    first = (
        rows.lazy()
        .filter(
            pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor") & discrete & (pl.col("status") == "diverged")
        )
        .group_by(keys)
        .agg(pl.col("step").min())
        .collect()
    )
    return {tuple(r[:4]): int(r[4]) for r in first.select(*keys, "step").iter_rows()}

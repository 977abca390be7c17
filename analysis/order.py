"""Execution order of records within a step: dump order, with msprobe 8.x's parameters_grad placeholders moved.

msprobe writes records as ops complete, so dump.json order is execution order (forward, backward, then
optimizer updates), except in 8.x where a module's `parameters_grad` key sits right after its *forward*
record although it is filled during backward: such records (before the step's first backward record) go
after everything else of the step.
"""

from __future__ import annotations

import polars as pl

GROUP = ["step", "rank", "source"]
OUTPUT_IO = ("output", "parameters_grad", "debug", "tensor")  # leaves an op produces
INPUT_IO = ("input", "parameters")  # leaves an op consumes


def deferred_grad(seq: pl.Expr, direction: pl.Expr, first_backward: pl.Expr) -> pl.Expr:
    """The phase rule: an 8.x `parameters_grad` record dumped before its step's first backward record (at
    `first_backward`, the smallest seq of a backward record) is executed after the whole step."""
    return (direction == "parameters_grad") & (seq < first_backward.fill_null(-1))


def with_phase(df: pl.DataFrame, seq: str = "seq", direction: str = "direction") -> pl.DataFrame:
    """Add `_phase` (0 normal, 1 deferred 8.x parameters_grad); sort by step, _phase, rank, source, seq."""
    first_bwd = pl.when(pl.col(direction) == "backward").then(pl.col(seq)).otherwise(None).min().over(GROUP)
    early_grad = deferred_grad(pl.col(seq), pl.col(direction), first_bwd)
    return df.with_columns(pl.when(early_grad).then(1).otherwise(0).alias("_phase"))


ORDER = ["step", "_phase", "rank", "source"]


def sort_rows(df: pl.DataFrame, by: list[str], nulls_last: bool = False) -> pl.DataFrame:
    """`df.sort(by, maintain_order=True)`, without the copy of every column where `df` is in order already
    (Polars gathers them anyway; a comparison's frames are wide and mostly come in order)."""
    order = df.select(pl.arg_sort_by(by, nulls_last=nulls_last, maintain_order=True)).to_series()
    if order.is_sorted():
        return df
    return df[order]

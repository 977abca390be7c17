"""Top-N mismatching leaves of a comparison by any metric, filterable by step, rank, direction, module, op type."""

from __future__ import annotations

import polars as pl

from .compare import Comparison

METRICS = ("severity", "rel_l2", "max_abs_err", "max_rel_err", "cosine")
COLUMNS = [
    "step",
    "rank",
    "seq",
    "name",
    "dtype",
    "ref_dtype",
    "rel_l2",
    "err_source",
    "err_bound",
    "cosine",
    "max_abs_err",
    "tol",
    "tol_dtype",
    "severity",
    "status",
    "detail",
]


def rank_rows(
    cmp: Comparison,
    *,
    by: str = "severity",
    top: int | None = 20,
    direction: str | None = None,
    module: str | None = None,
    op_type: str | None = None,
    io: str | None = None,
    status: str | None = None,
    include_pass: bool = True,
) -> pl.DataFrame:
    """Rows sorted worst first by `by` (cosine: lowest first); filters match substrings of module / op type.

    The comparison's `err` column (relative L2 error) is shown as `rel_l2`, its name in every output."""
    if by not in METRICS:
        from dumpstore.errors import DumpstoreError

        raise DumpstoreError(f"unknown metric {by!r}; choose one of {', '.join(METRICS)}")
    if top is not None and top < 0:
        from dumpstore.errors import DumpstoreError

        raise DumpstoreError(f"top {top} is negative: give the number of rows to show (0 or None: all)")
    df = cmp.rows.with_columns(
        pl.coalesce(pl.col("name"), pl.col("ref_name")).alias("name"), pl.col("err").alias("rel_l2")
    )
    filters = []
    if direction:
        filters.append(pl.col("direction") == direction)
    if module:
        filters.append(_module_filter(module))
    if op_type:
        filters.append(pl.col("op_type").str.contains(op_type, literal=True))
    if io:
        filters.append(pl.col("io") == io)
    if status:
        filters.append(pl.col("status") == status)
    if not include_pass:
        filters.append(pl.col("status") != "pass")
    if filters:
        df = df.filter(*filters)
    df = df.filter(pl.col(by).is_not_null()) if by != "severity" else df
    df = df.sort(by, descending=by != "cosine", nulls_last=True, maintain_order=True)  # ties: execution order
    cols = [c for c in COLUMNS if c in df.columns]
    return df.select(cols).head(top) if top else df.select(cols)


def _module_filter(module: str) -> pl.Expr:
    return pl.col("module").str.contains(module, literal=True) | pl.col("record").str.contains(module, literal=True)


def check_filters(cmp: Comparison, *, module: str | None = None, op_type: str | None = None) -> None:
    """A --module or --op-type that matches no row of the comparison is an error listing what exists (never an
    empty table that reads as 'no mismatch')."""
    from dumpstore.errors import SelectionError

    rows = cmp.rows
    for flag, value, expr, column in (
        ("--module", module, _module_filter, "module"),
        ("--op-type", op_type, lambda v: pl.col("op_type").str.contains(v, literal=True), "op_type"),
    ):
        if not value or column not in rows.columns or rows.filter(expr(value)).height:
            continue
        known = rows.select(pl.col(column).drop_nulls().unique().sort()).to_series().to_list()
        shown = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20 else "")
        raise SelectionError(
            f"{flag} {value!r} matches nothing in this comparison ({column} values: {shown or 'none'})"
        )

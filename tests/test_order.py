"""analysis.order.sort_rows: df.sort(..., maintain_order=True), without a copy when rows are in order."""

import polars as pl

from dumpstore.analysis.order import sort_rows


def test_sort_rows_sorts_like_polars_and_keeps_ties_in_order():
    df = pl.DataFrame({"a": [2, 1, None, 1, 2], "b": [0, 5, 1, 5, None], "tie": [0, 1, 2, 3, 4]})
    for nulls_last in (False, True):
        want = df.sort(["a", "b"], nulls_last=nulls_last, maintain_order=True)
        got = sort_rows(df, ["a", "b"], nulls_last=nulls_last)
        assert got.equals(want)
    assert sort_rows(df, ["a", "b"], nulls_last=True)["tie"].to_list() == [1, 3, 0, 4, 2]


def test_sort_rows_returns_rows_in_order_as_they_are():
    df = pl.DataFrame({"a": [1, 1, 2], "b": [0, 3, 1]})
    assert sort_rows(df, ["a", "b"]) is df

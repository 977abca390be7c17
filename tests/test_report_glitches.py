"""Report details: the heat map's colour scale ignores exact zeros (drawn apart)."""

from __future__ import annotations

import polars as pl

from dumpstore.analysis.report.figures import ZERO, heat_figure
from dumpstore.analysis.verdict import Verdict


def _verdict() -> Verdict:
    return Verdict("t", "r", None, None, [], [], [], {}, {}, {})


def test_heat_map_scale_ignores_exact_zeros():
    ops = pl.DataFrame(
        {
            "step": [0, 0, 1, 1],
            "rank": [0, 0, 0, 0],
            "op": ["a", "b", "a", "b"],
            "seq": [1, 2, 1, 2],
            "err": [0.0, 1e-3, 2e-2, 0.0],
            "tol": [1e-4] * 4,
            "module": [None] * 4,
            "direction": ["forward"] * 4,
        }
    )
    fig = heat_figure(ops, "step", _verdict(), "rel_l2 by step and {cols}")
    heat, zeros = fig["data"][0], fig["data"][1]
    assert heat["z"] == [[None, -3.0], [-1.699, None]]  # log10 of the non-zero errors only
    assert zeros["name"] == ZERO and list(zip(zeros["x"], zeros["y"])) == [("a", "step 0"), ("b", "step 1")]
    assert heat["customdata"] == [[0.0, 0.001], [0.02, 0.0]]  # hover still says 0
    assert "exact zeros as open circles" in fig["layout"]["title"]["text"]

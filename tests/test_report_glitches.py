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
    assert "exact zeros as open circles, off the scale" in fig["layout"]["title"]["text"]


def test_only_differing_for_csv_and_page(tmp_path):
    import csv

    from click.testing import CliRunner

    from dumpstore.cli.main import main
    from helpers import SAMPLES

    store = tmp_path / "store"
    args = [str(SAMPLES / "ref_stats"), str(SAMPLES / "weight_1pct_stats"), "--run", "ref", "--run", "t"]
    assert CliRunner().invoke(main, ["ingest", *args, "--store", str(store)]).exit_code == 0
    out = {}
    for name, extra in (("all", []), ("diff", ["--only-differing"])):
        res = CliRunner().invoke(
            main,
            ["report", "--target", "t", "--ref", "ref", "--store", str(store), "--csv", str(tmp_path / f"{name}.csv")]
            + ["--html", str(tmp_path / f"{name}.html"), *extra],
        )
        assert res.exit_code == 0, res.output
        with open(tmp_path / f"{name}.csv", newline="") as f:
            out[name] = list(csv.DictReader(f))
    statuses = {r["status"] for r in out["diff"]}
    assert "pass" not in statuses and "diverged" in statuses
    assert len(out["diff"]) == sum(r["status"] != "pass" for r in out["all"]) < len(out["all"])
    page = (tmp_path / "diff.html").read_text()
    assert f"{len(out['diff'])} rows (the compared leaves that differ: --only-differing)" in page

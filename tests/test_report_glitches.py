"""Report details: the heat map's colour scale ignores exact zeros (drawn apart); --only-differing; the verdict's
link shows exactly the culprit's rows."""

from __future__ import annotations

import base64
import csv
import hashlib
import html
import re

import polars as pl
import pytest
from click.testing import CliRunner

import browser
from dumpstore.analysis.report.figures import ZERO, heat_figure
from dumpstore.analysis.verdict import Verdict
from dumpstore.cli.main import main
from helpers import SAMPLES


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
    statuses = {r["dumpstore_status"] for r in out["diff"]}
    assert "pass" not in statuses and "diverged" in statuses
    assert len(out["diff"]) == sum(r["dumpstore_status"] != "pass" for r in out["all"]) < len(out["all"])
    every = {(r["step"], r["NPU Name"]): r for r in out["all"]}  # msprobe's verdict: per op over all its rows
    assert all(r["Result"] == every[r["step"], r["NPU Name"]]["Result"] for r in out["diff"])
    assert any(r["Result"] == "warning" for r in out["diff"])
    page = (tmp_path / "diff.html").read_text()
    assert f"{len(out['diff'])} rows (the compared leaves that differ: --only-differing)" in page


_LINK_DRIVER = """
(function () {
  var a = document.querySelectorAll('a.show-rows')[1];
  a.click();
  var rows = Array.prototype.map.call(document.querySelectorAll('#top-table tbody tr'), function (tr) {
    return [tr.cells[0].textContent, tr.cells[1].textContent, tr.cells[2].textContent].join(',');
  });
  document.body.setAttribute('data-link-test', a.getAttribute('data-op') + '|' + rows.join(';'));
})();
"""


@pytest.mark.browser
def test_verdict_link_shows_exactly_the_culprits_rows(tmp_path):
    """The culprit card's link filters the table to that op (its exact name, not names containing it), step and
    rank: the rows a click on the chart's culprit star shows."""
    if browser.chromium() is None:
        pytest.skip(browser.why_no_chromium())
    store = tmp_path / "store"
    args = [str(SAMPLES / "ref_stats"), str(SAMPLES / "weight_1pct_stats"), "--run", "ref", "--run", "t"]
    assert CliRunner().invoke(main, ["ingest", *args, "--store", str(store)]).exit_code == 0
    page = tmp_path / "r.html"
    res = CliRunner().invoke(
        main, ["report", "--target", "t", "--ref", "ref", "--store", str(store), "--html", str(page)]
    )
    assert res.exit_code == 0, res.output
    text = page.read_text()
    digest = base64.b64encode(hashlib.sha256(_LINK_DRIVER.encode()).digest()).decode()
    text = text.replace("script-src ", f"script-src 'sha256-{digest}' ", 1)
    page.write_text(text.replace("</body>", f"<script>{_LINK_DRIVER}</script>\n</body>", 1))
    dom = browser.load(page).dom
    op, rows = html.unescape(re.search(r'data-link-test="([^"]*)"', dom).group(1)).split("|")
    assert op == "Functional.linear.6.forward"
    shown = [r.split(",") for r in rows.split(";")]
    assert shown and all(r == ["0", "0", op] for r in shown), shown


def test_culprit_star_hover_is_its_own():
    """On a long run many ops share the star's pixels; only the culprit's own op answers a hover there."""
    from dumpstore.analysis.report.figures import line_figure
    from dumpstore.analysis.verdict import Finding

    n, at = 3000, 1500
    ops = pl.DataFrame(
        {
            "step": [0] * n,
            "rank": [0] * n,
            "op": [f"Functional.op.{i}.forward" for i in range(n)],
            "leaf_name": [f"Functional.op.{i}.forward.output.0" for i in range(n)],
            "err": [0.01] * n,
            "tol": [1e-4] * n,
            "err_source": ["stats"] * n,
            "tol_dtype": ["float32"] * n,
            "unmatched": [False] * n,
            "direction": ["forward"] * n,
        }
    )
    culprit = Finding(0, 0, f"Functional.op.{at}.forward", None, "op")
    v = Verdict("t", "r", culprit, culprit, [], [], [], {}, {}, {})
    fig = line_figure(ops, v, 0, 10_000)
    hoverable = [t for t in fig["data"] if t.get("hoverinfo") != "skip" and t.get("mode") == "markers"]
    close = {x for t in hoverable for x in t["x"] if abs(x - at) <= 20}
    assert close == {at}
    quiet = [t for t in fig["data"] if t.get("hoverinfo") == "skip" and t.get("mode") == "markers"]
    assert sorted(x for t in quiet for x in t["x"]) == [x for x in range(at - 27, at + 28) if x != at]

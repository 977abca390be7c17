"""The report's overflow: scanned once (the First overflow card and the health section's overflow findings share
it), and equal to `dumpstore overflow --run T --ref R` on a sample pair that overflows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dumpstore._ingest import ingest
from dumpstore.analysis import _health, _overflow
from dumpstore.analysis.report import analyze, render_html
from dumpstore.analysis.report import data as report_data
from dumpstore.cli.main import main
from dumpstore.names import parse_record
from dumpstore.store import open_store

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"
CATALOG = {c["name"]: c for c in json.loads((SAMPLES / "catalog.json").read_text())["cases"]}
PAIR = ("overflow_stats", "ref_stats")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report_overflow") / "store"
    for run in PAIR:
        ingest(str(SAMPLES / run), run, store=path)
    return path


def test_the_report_scans_overflow_once_and_agrees_with_dumpstore_overflow(store, monkeypatch):
    calls = []
    real = _overflow.overflow

    def counted(*args, **kwargs):
        calls.append((args[1:], kwargs.get("ref")))
        return real(*args, **kwargs)

    monkeypatch.setattr(report_data, "overflow", counted)
    monkeypatch.setattr(_health, "overflow", counted)
    data = analyze(open_store(store), *PAIR)
    assert calls == [(("overflow_stats",), "ref_stats")]  # once, with the reference; health reuses it

    r = CliRunner().invoke(
        main, ["overflow", "--run", PAIR[0], "--ref", PAIR[1], "--store", str(store), "--json"], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    cli = json.loads(r.output)
    mine = json.loads(json.dumps(data.overflow.to_dict(), default=str))
    for key in ("first_overflow", "producers", "tensors"):
        assert mine[key] == cli[key], key
    want = CATALOG["overflow_stats"]["expected"]["first_overflow"]
    assert (cli["first_overflow"]["step"], cli["first_overflow"]["op"]) == (want["step"], want["op"])

    # the health section's overflow findings are the card's producers (masking -Inf and gradient records aside)
    hr = data.health
    assert hr is not None and hr.overflow_ref == "ref_stats"
    found = [(f.step, f.rank, f.op, f.value) for f in hr.findings if f.watchpoint == "overflow"]
    producers = [
        (p["step"], p["rank"], p["op"], p["kind"])
        for p in cli["producers"]
        if not p["likely_mask"] and parse_record(p["op"]).direction != "parameters_grad"
    ]
    assert found == producers and found[0][2] == cli["first_overflow"]["op"]
    page = render_html(data.cmp, data.verdict, data.overflow, health_report=hr)
    assert f'First overflow: <code class="op">{cli["first_overflow"]["op"]}</code>' in page
    assert (
        "<p>Overflow findings: the First overflow card's scan, NaN/Inf/saturated values beyond what ref_stats" in page
    )

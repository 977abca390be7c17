"""The benchmark harness runs end to end at its smallest size, so it never rots (the timings are not judged)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.processes
def test_tiny_bench_finds_every_injected_fault(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--tiny", "--data", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = doc["rows"]
    assert {r["scenario"] for r in rows} == {"stats_pair", "tensor_pair", "requery", "scale", "ingest_rate"}
    judged = [r for r in rows if r["verdict"] not in (None, "-")]
    assert len(judged) == 11  # 2 pairs × 2 flows, 6 requeries, 1 scale store
    assert all(r["verdict"] == "OK" for r in judged), [(r["item"], r["note"]) for r in judged]
    for r in rows:
        for run in r["runs"]:
            assert run["rc"] == 0 and run["killed"] is None, run
    timed = [r for r in rows if r["ds_wall_s"] is not None]
    assert all(r["ds_wall_s"] > 0 and r["ds_rss_mb"] > 0 for r in timed)
    assert all(r["store_b_per_row"] > 0 for r in rows if r["scenario"] in ("stats_pair", "tensor_pair", "scale"))
    assert "scenario" in proc.stdout and "stats ingest --jobs 1" in proc.stdout

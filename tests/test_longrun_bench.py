"""bench/longrun.py runs end to end at a small size, so it never rots (the timings are not judged)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT


def test_small_longrun_bench(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "longrun.py"), "--steps", "3000", "--monitor-rows", "40000",
         "--data", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["curves_points"] == 3000 and doc["curves_lr_mismatch_step"] == 1800  # lr x1.5 from 60 %
    assert doc["monitor_rows"] == 100_000  # at least one file of 50 steps per prefix: 8 x 250 parameters x 50
    assert doc["monitor_rows_per_s"] > 0 and doc["curves_s"] > 0
    # TrainerMon's default layout, a file per step, holds the same rows: the culprit over the two runs finds none
    assert (doc["monitor_1spf_files"], doc["monitor_1spf_rows"]) == (8 * 50, 100_000)
    assert doc["monitor_culprit_series"] == 8 * 250 and doc["monitor_culprit_first"] is None
    assert doc["monitor_1spf_ingest_rss_mb"] > 0 and doc["monitor_health_rss_mb"] > 0

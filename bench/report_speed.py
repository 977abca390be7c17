#!/usr/bin/env python
"""The HTML report's speed: writing a large page, and drawing it in headless Chromium (measured, not asserted).

Usage::

    python bench/report_speed.py            # weight_1pct_stats vs ref_stats over 30 steps (~4,300 ops, 13,590 rows)
    python bench/report_speed.py --repeat 5

Prints the seconds `report.write_html` takes for the page, and from Chromium (when one is installed; see
tests/browser.py) the page's own `render-ms` (charts drawn) and `data-first-paint-ms`, best of `--repeat` runs.
The tests check what the page holds; how fast it is made lives here.

    python bench/report_speed.py --large                # `dumpstore report --csv --html` on 311,179 rows per side
    python bench/report_speed.py --large --layers 200   # smaller (rows per side ~ 28 x layers x 11 steps)

`--large` makes a synthetic statistics pair with bench/synth.py (1000 layers x 11 steps x 1 rank, the fault at
step 3; cached under bench/.data/report_large/), ingests it once, then times the whole CLI process
`dumpstore report --target target --ref ref --csv ... --html ...` (start-up included), best of `--repeat`, with its
CPU time (user + system, the machine's load aside), its peak RSS and the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/browser.py: the headless Chromium driver


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--large", action="store_true", help="time `dumpstore report` on a ~300k-rows-per-side pair")
    ap.add_argument("--layers", type=int, default=1000, help="--large: layers per step (1000: 311,179 rows/side)")
    a = ap.parse_args()
    if a.large:
        return large(a.layers, a.repeat)
    import polars as pl

    from dumpstore._ingest import ingest
    from dumpstore.analysis import report
    from dumpstore.analysis._divergence import divergence
    from dumpstore.store import open_store

    with tempfile.TemporaryDirectory(prefix="report-speed-") as tmp:
        root = Path(tmp)
        for run in ("weight_1pct_stats", "ref_stats"):
            ingest(ROOT / "sample_dumps" / run, run, store=root / "store", jobs=1)
        st = open_store(root / "store")
        base = report.analyze(st, "weight_1pct_stats", "ref_stats")
        rows = pl.concat([base.cmp.rows.with_columns(pl.col("step") + 3 * i) for i in range(10)])
        cmp = dataclasses.replace(base.cmp, rows=rows)
        verdict = divergence(cmp)
        path = root / "big.html"
        writes = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            report.write_html(cmp, verdict, base.overflow, st, path)
            writes.append(time.perf_counter() - t0)
        print(f"write_html: {min(writes):.2f} s best of {a.repeat} ({rows.height} rows)")
        import browser

        if browser.chromium() is None:
            print(f"chromium: skipped ({browser.why_no_chromium()})")
            return 0
        drawn, paint = [], []
        for _ in range(a.repeat):
            dom = browser.load(path).dom
            drawn.append(int(re.search(r'id="render-ms">(\d+)<', dom).group(1)))
            p = re.search(r'data-first-paint-ms="(\d*)"', dom).group(1)
            if p:
                paint.append(int(p))
        print(f"chromium: charts drawn after {min(drawn)} ms, first paint {min(paint) if paint else '-'} ms (best)")
    return 0


def large(layers: int, repeat: int) -> int:
    """`dumpstore report --csv --html` end to end on a synthetic statistics pair (see the module docstring)."""
    import json
    import shutil
    import subprocess

    sys.path.insert(0, str(HERE))
    import synth

    data = HERE / ".data" / "report_large" / f"{layers}x11x1"
    store = data / "store"
    if not (data / "manifest.json").exists():
        shutil.rmtree(data, ignore_errors=True)
        synth.generate(data, layers, 11, 1, fault_step=3, fault_rank=0, fault_layer=int(layers * 0.7))
    cli = str(Path(sys.executable).with_name("dumpstore"))
    if not store.exists():
        subprocess.run([cli, "ingest", str(data / "ref"), str(data / "target"), "--run", "ref", "--run", "target",
                        "--store", str(store)], check=True)  # fmt: skip
    rows = json.loads((data / "manifest.json").read_text())["rows_per_side"]
    cmd = [cli, "report", "--target", "target", "--ref", "ref", "--store", str(store),
           "--csv", str(data / "report.csv"), "--html", str(data / "report.html")]  # fmt: skip
    import resource

    best, cpu = float("inf"), 0.0
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if wall < best:
            best = wall
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    sizes = ", ".join(
        f"{p.suffix[1:]} {p.stat().st_size / 1e6:.0f} MB" for p in (data / "report.csv", data / "report.html")
    )
    from dumpstore.analysis.report import analyze, write_csv, write_report_html
    from dumpstore.store import open_store

    st, parts = open_store(store), []  # the same three stages in this process, one at a time
    t0 = time.perf_counter()
    data_ = analyze(st, "target", "ref")
    parts.append(("analysis", time.perf_counter() - t0))
    t0 = time.perf_counter()
    write_csv(data_.cmp, data / "report.csv", store=st)
    parts.append(("csv", time.perf_counter() - t0))
    t0 = time.perf_counter()
    write_report_html(data_, st, data / "report.html")
    parts.append(("page", time.perf_counter() - t0))
    print("in one process: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts))
    load = os.getloadavg()[0]
    print(
        f"dumpstore report --csv --html: {best:.1f} s best of {repeat}, {cpu:.1f} s CPU (user + system), "
        f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MB peak RSS "
        f"({rows:,} rows per side; {sizes}; load average {load:.1f} on {os.cpu_count()} cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

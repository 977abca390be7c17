#!/usr/bin/env python
"""The tensor-mode report CSV written by columns against the row-by-row writer (measured, not asserted).

    python bench/report_csv_tensor.py [--steps 40] [--repeat 3]

The tensor sample pair weight_1pct_tensor vs ref_tensor (453 rows a step) copied into `--steps` steps (cached
under bench/.data/csv_tensor/), ingested, compared with the files read as `dumpstore report --csv` reads tensor
dumps (`exact=True`); then `write_csv` is timed both ways, best of `--repeat` (CPU of this process and wall): by
columns (analysis/report/csvcols.py) and row by row (`csvcols.frames` answering None, the path tensor mode took
before), and the two files compared byte for byte.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAIR = ("weight_1pct_tensor", "ref_tensor")


def tiled(steps: int) -> Path:
    data = HERE / ".data" / "csv_tensor" / f"{steps}steps"
    if (data / "done").exists():
        return data
    sys.path.insert(0, str(ROOT / "sample_dumps"))
    import fixtures  # the tensor samples' files, unpacked on first use

    for run in PAIR:
        fixtures.unpack(run)
    shutil.rmtree(data, ignore_errors=True)
    for run in PAIR:
        src = ROOT / "sample_dumps" / run / "step0"
        for s in range(steps):
            shutil.copytree(src, data / run / f"step{s}")
    (data / "done").write_text("")
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from dumpstore._ingest import ingest
    from dumpstore.analysis.report import analyze, csvcols, write_csv
    from dumpstore.store import open_store

    data = tiled(a.steps)
    store = data / "store"
    if not store.exists():
        for run in PAIR:
            ingest(str(data / run), run, store=store)
    st = open_store(store)
    cmp = analyze(st, *PAIR, exact=True).cmp
    frames = csvcols.frames
    out = {}
    for way in ("columns", "rows"):
        csvcols.frames = frames if way == "columns" else (lambda *args, **kw: None)
        best = (float("inf"), 0.0)
        for _ in range(a.repeat):
            c0, t0 = time.process_time(), time.perf_counter()
            n = write_csv(cmp, data / f"{way}.csv", store=st)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            best = min(best, (cpu, wall))
        out[way] = best
    csvcols.frames = frames
    same = (data / "columns.csv").read_bytes() == (data / "rows.csv").read_bytes()
    print(
        f"write_csv, tensor mode, {n:,} rows ({a.steps} steps of {PAIR[0]} vs {PAIR[1]}): "
        + ", ".join(f"{k} {v[0]:.2f} s CPU ({v[1]:.2f} s wall)" for k, v in out.items())
        + f"; same bytes: {same}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

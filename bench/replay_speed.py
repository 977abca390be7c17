#!/usr/bin/env python
"""Speed of `dumpstore replay`: replayed API calls per second, one process and `--jobs N` processes.

Usage::

    python bench/replay_speed.py                 # one big run: 4 steps of a 32-layer model (real msprobe dump)
    python bench/replay_speed.py --layers 8      # a smaller one
    python bench/replay_speed.py --samples       # instead every bundled tensor sample, one replay per run
    python bench/replay_speed.py --jobs 1,2,4    # process counts to time
    python bench/replay_speed.py --repeat 3      # keep the fastest of 3 (a busy machine)

The dumps are made (tests/replay_samples.py, msprobe on the CPU) and ingested once under bench/.data/replay/
(git-ignored). Each timing is the wall time of `dumpstore replay --run R --jobs N --json` processes, one per run,
as a user runs them: importing torch (once: in the command with N = 1, in the workers' fork server with N > 1)
and writing the store's table included. `calls/s` counts replayed forward calls (skipped and identical calls
not counted), `outputs/s` the judged outputs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
DATA = HERE / ".data" / "replay"

import polars as pl


def _dumps(samples: bool, layers: int) -> dict[str, Path]:
    import replay_samples

    if not samples:
        return {f"big{layers}": replay_samples.generate(DATA / f"big{layers}", big=layers)["big"]}
    out = {p.name: p for p in sorted((ROOT / "sample_dumps").glob("*_tensor"))}
    out.update(replay_samples.generate(DATA / "samples"))
    return out


def _store(samples: bool, layers: int):
    from dumpstore._ingest import ingest
    from dumpstore.store import open_store

    root = DATA / "store"
    dumps = _dumps(samples, layers)
    have = set(open_store(root).run_names()) if root.exists() else set()
    for name, path in dumps.items():
        if name not in have:
            ingest(path, name, store=root, jobs=1)
    return open_store(root), sorted(dumps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="1,2")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--samples", action="store_true")
    args = ap.parse_args()
    from dumpstore.replaytable import read_replay

    store, runs = _store(args.samples, args.layers)
    exe = str(Path(sys.executable).with_name("dumpstore"))
    print(f"{len(runs)} runs: {', '.join(runs)}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(
        f"{'jobs':>4}  {'wall s':>7}  {'calls':>6}  {'calls/s':>8}  {'outputs/s':>9}  {'identical':>9}  {'skipped':>7}"
    )
    for jobs in [int(j) for j in args.jobs.split(",")]:
        best = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for run in runs:
                cmd = [exe, "replay", "--run", run, "--jobs", str(jobs), "--store", str(store.root), "--json"]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            best = wall if best is None else min(best, wall)
        assert best is not None
        tables = [pl.from_arrow(read_replay(store, run)) for run in runs]
        ids = ["step", "rank", "record"]
        done = [t.filter(pl.col("output").is_not_null() & pl.col("same_as").is_null()) for t in tables]
        replayed = sum(t.unique(ids).height for t in done)
        outputs = sum(t.height for t in done)
        same = sum(t.filter(pl.col("same_as").is_not_null()).unique(ids).height for t in tables)
        skipped = sum(t.filter(pl.col("status") == "skipped").height for t in tables)
        print(
            f"{jobs:>4}  {best:7.2f}  {replayed:>6}  {replayed / best:8.0f}  {outputs / best:9.0f}  {same:>9}  {skipped:>7}"
        )


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Scaling of the Ray engine against the local one: ingest and verdict time by ranks and workers.

Usage::

    python bench/ray_scale.py [--ranks 100,1000] [--workers 1,2] [--repeat N] [--data DIR] [--json FILE]

For each rank count a synthetic statistics job (bench/synth.py: 2 layers, 2 steps, a fault on one rank at
step 1; ref and target) is generated once under DATA/synth-R.  For each worker count W, in this process:

  local  `ingest(..., jobs=W)` of both runs, then `divergence_by_steps` (the local engine);
  ray    `ray.init(num_cpus=W)` (a fresh local instance, timed apart), `ingest(..., engine="ray")` of both runs
         (the first tasks also start Ray's worker processes), then `distributed.divergence_by_steps`.

`load` is the 1-minute load average before each engine's try (local, ray): on a shared machine compare rows
measured at similar load.  Both verdicts must name the injected step, rank and op and be equal, else the script
fails.  Prints a Markdown table (seconds, wall clock) and writes the numbers to --json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _synth():
    spec = importlib.util.spec_from_file_location("synth", ROOT / "bench" / "synth.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synth"] = mod
    spec.loader.exec_module(mod)
    return mod


def job(data: Path, ranks: int) -> tuple[Path, dict]:
    """The synthetic job of `ranks` ranks (generated on first use)."""
    d = data / f"synth-{ranks}"
    man = d / "dumps" / "manifest.json"
    if not man.exists():
        shutil.rmtree(d, ignore_errors=True)
        _synth().generate(
            d / "dumps",
            layers=2,
            steps=2,
            ranks=ranks,
            fault_step=1,
            fault_rank=ranks * 3 // 8,
            fault_layer=1,
            log=lambda *a: None,
        )
    return d, json.loads(man.read_text())


def one(d: Path, man: dict, workers: int, engine: str) -> dict:
    """Ingest both runs and compute the verdict with one engine; the timings."""
    import ray

    from dumpstore._ingest import ingest
    from dumpstore.analysis import distributed
    from dumpstore.analysis._divergence import divergence_by_steps
    from dumpstore.store import open_store

    store = d / f"store-{engine}-{workers}"
    shutil.rmtree(store, ignore_errors=True)
    out = {
        "ranks": man["ranks"],
        "workers": workers,
        "engine": engine,
        "units": 2 * man["files_per_side"],
        "load_before": os.getloadavg()[0],
    }
    if engine == "ray":
        t = time.perf_counter()
        ray.init(address="local", num_cpus=workers, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        out["ray_init_s"] = time.perf_counter() - t
    try:
        t = time.perf_counter()
        for side in ("ref", "target"):
            ingest(d / "dumps" / side, side, store=store, jobs=workers, engine=engine)
        out["ingest_s"] = time.perf_counter() - t
        st = open_store(store)
        t = time.perf_counter()
        fn = distributed.divergence_by_steps if engine == "ray" else divergence_by_steps
        v = fn(st, "target", "ref").to_dict()
        out["verdict_s"] = time.perf_counter() - t
    finally:
        if engine == "ray":
            ray.shutdown()
    f, exp = v["first_divergence"], man["expected"]
    got = (f["step"], f["rank"], f["op"]) if f else None
    if got != (exp["step"], exp["rank"], exp["first_divergence_op"]):
        raise SystemExit(f"{engine} verdict {got} misses the injected fault {exp}")
    out["verdict"] = v
    return out


def best(d: Path, man: dict, workers: int, engine: str, repeat: int) -> dict:
    """The try with the smallest ingest + verdict time of `repeat`."""
    tries = [one(d, man, workers, engine) for _ in range(max(1, repeat))]
    return min(tries, key=lambda r: r["ingest_s"] + r["verdict_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="100,1000")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--data", type=Path, default=ROOT / "bench" / ".data" / "ray")
    ap.add_argument("--repeat", type=int, default=1, help="keep the fastest of N (for a busy machine)")
    ap.add_argument("--json", type=Path, default=None, help="results file (default DATA/results.json)")
    args = ap.parse_args(argv)
    rows = []
    for ranks in [int(x) for x in args.ranks.split(",")]:
        d, man = job(args.data, ranks)
        for workers in [int(x) for x in args.workers.split(",")]:
            pair = [best(d, man, workers, e, args.repeat) for e in ("local", "ray")]
            if pair[0].pop("verdict") != pair[1].pop("verdict"):
                raise SystemExit(f"{ranks} ranks, {workers} workers: the Ray verdict differs from the local one")
            rows += pair
            for r in pair:
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    print(
        "\n| ranks | units (both runs) | workers | local ingest s | ray ingest s | local verdict s | ray verdict s "
        "| ray.init s | load |\n|---|---|---|---|---|---|---|---|---|"
    )
    for i in range(0, len(rows), 2):
        lo, ra = rows[i], rows[i + 1]
        print(
            f"| {lo['ranks']} | {lo['units']} | {lo['workers']} | {lo['ingest_s']:.1f} | {ra['ingest_s']:.1f} | "
            f"{lo['verdict_s']:.1f} | {ra['verdict_s']:.1f} | {ra['ray_init_s']:.1f} | "
            f"{lo['load_before']:.1f}, {ra['load_before']:.1f} |"
        )
    path = args.json or args.data / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

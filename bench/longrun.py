#!/usr/bin/env python
"""Long-run benchmark: `dumpstore curves` on two 100k-step Megatron logs, the ingest rate of msprobe monitor CSV in
both of TrainerMon's layouts, and the monitor culprit and health on the ingested runs.

Usage::

    python bench/longrun.py                          # 2 x 100k-step logs, a 20M-row monitor run in each layout
    python bench/longrun.py --steps 20000 --monitor-rows 2000000     # smaller
    python bench/longrun.py --repeat 3               # keep the fastest of 3 (a busy machine)
    python bench/longrun.py --steps-per-file 1       # only TrainerMon's default layout: a file per step

Data is synthetic, generated once into bench/.data/longrun/ (git-ignored):
  logs      two Megatron logs of --steps iterations each (`iteration N/ M | consumed samples: ... | lm loss: ...`):
            a decaying loss with noise; the target's learning rate x1.5 from 60 % of the run
  monitor   a TrainerMon folder `<time>-rank0-<id>/<prefix>_<a>-<b>.csv` per --steps-per-file (default 50,1: 50 steps
            a file, then a file per step as TrainerMon writes by default), 8 prefixes, enough parameters x steps for
            --monitor-rows rows (the header and number format TrainerMon writes); every layout holds the same rows
Timed, each as a separate process exactly as typed (wall around the process, imports included; the sources
byte-compiled first, as bench/run.py does; peak RSS: the process's ru_maxrss from wait4):
  `dumpstore longrun-ingest LOG --run R`, `dumpstore curves --target T --ref R --json`,
  `dumpstore longrun-ingest MONITOR_DIR --run M` per layout (rows/s = monitor rows / wall; rows per CPU-second =
  monitor rows / the process's user + system time, all threads: on a shared machine the wall time says more about
  the other work than about this one); with two layouts, `dumpstore curves --target M1 --ref M0 --json` (the
  monitor culprit over both runs: the same rows, so no culprit) and `dumpstore curves --run M0 --health --json`.
Targets (issue 26): curves <= 2 s on 2 x 100k steps; monitor ingest >= 2M rows/s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dumpstore.longrun.monitor import PREFIXES as ALL_PREFIXES

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "longrun"
PREFIXES = tuple(p for p in ALL_PREFIXES if p != "other")  # TrainerMon writes `other` only for extras
OPS = ("norm", "min", "max", "zeros", "nans", "mean")


def write_log(path: Path, steps: int, *, seed: int, lr_change: int | None) -> None:
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    lr = 3e-4 * np.minimum(1.0, t / 2000) * (0.1 + 0.45 * (1 + np.cos(np.pi * t / steps)))
    if lr_change is not None:
        lr = np.where(t >= lr_change, lr * 1.5, lr)
    loss = 2.0 + 8.0 * np.exp(-t / (steps / 10)) + 0.05 * rng.standard_normal(steps)
    if lr_change is not None:
        loss = loss + np.where(t > lr_change, 0.02 * (1 - np.exp(-(t - lr_change) / 500)), 0.0)
    gnorm = 1.0 + 0.2 * rng.standard_normal(steps) ** 2
    with path.open("w") as f:
        for i in range(steps):
            f.write(
                f" [2026-12-07 00:00:00] iteration {i + 1:8d}/{steps:8d} | consumed samples: {1024 * (i + 1):12d} | "
                f"elapsed time per iteration (ms): 1500.0 | learning rate: {lr[i]:.6E} | global batch size:  1024 | "
                f"lm loss: {loss[i]:.6E} | loss scale: 1.0 | grad norm: {gnorm[i]:.3f} | "
                "number of skipped iterations:   0 | number of nan iterations:   0 |\n"
            )


PARAMS = 250


def monitor_steps(rows: int, per_file_steps: int = 50) -> int:
    """Steps of a monitor run of about `rows` rows, a whole number of files of `per_file_steps` steps."""
    return max(per_file_steps, -(-rows // (PARAMS * len(PREFIXES))) // per_file_steps * per_file_steps)


def write_monitor(root: Path, rows: int, per_file_steps: int = 50, steps: int | None = None) -> int:
    """A TrainerMon folder with about `rows` rows (or `steps` steps), `per_file_steps` steps a file (the last file
    shorter where they do not divide); returns the exact row count. The values depend on the steps only, not on
    the layout."""
    import polars as pl

    params = PARAMS
    steps = monitor_steps(rows, per_file_steps) if steps is None else steps
    d = root / "Dec07_00-00-00-rank0-0123abcd"
    d.mkdir(parents=True, exist_ok=True)
    names = [f"decoder.layers.{i // 10}.mlp.linear_fc{i % 10}.weight" for i in range(params)]
    rng = np.random.default_rng(0)
    total = 0
    for prefix in PREFIXES:
        micro = prefix in ("actv", "actv_grad")
        for a in range(0, steps, per_file_steps):
            k = min(per_file_steps, steps - a)
            n = k * params
            step = np.repeat(np.arange(a, a + k), params)
            cols = {"vpp_stage": np.zeros(n, np.int64), "name": names * k, "step": step}
            if micro:
                cols["micro_step"] = np.zeros(n, np.int64)
            base = rng.random(n)
            cols.update(
                {
                    "norm": np.round(base * 10, 6),
                    "min": np.round(-base, 6),
                    "max": np.round(base, 6),
                    "zeros": np.round(base * 0.01, 6),
                    "nans": np.zeros(n),
                    "mean": np.round(base * 1e-3, 6),
                    "shape": ["[4096, 4096]"] * n,
                    "dtype": ["torch.bfloat16"] * n,
                }
            )
            pl.DataFrame(cols).write_csv(d / f"{prefix}_{a}-{a + k - 1}.csv")
            total += n
    return total


def timed(cmd: list[str], repeat: int) -> tuple[float, float, str, float]:
    """(wall s, CPU s of the process: user + system, all its threads, output, peak RSS MB) of the fastest of
    `repeat` runs."""
    best, cpu, out, rss = float("inf"), 0.0, "", 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = _communicate(proc)
        wall = time.perf_counter() - t0
        _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {stderr.strip()}")
        if wall < best:
            best, cpu, out, rss = wall, usage.ru_utime + usage.ru_stime, stdout, usage.ru_maxrss / 1024
    return best, cpu, out, rss


def _communicate(proc: subprocess.Popen) -> tuple[str, str]:
    """The process's output, read to the end without reaping it (wait4 reaps it, with its rusage)."""
    import threading

    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))  # type: ignore[union-attr]
    reader.start()
    out = proc.stdout.read()  # type: ignore[union-attr]
    reader.join()
    return out, err[0] if err else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--monitor-rows", type=int, default=20_000_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--steps-per-file",
        default="50,1",
        help="monitor steps per CSV file, one layout per comma-separated value (TrainerMon's default: 1)",
    )
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args()
    layouts = [int(v) for v in str(args.steps_per_file).split(",") if v.strip()]
    exe = str(Path(sys.executable).with_name("dumpstore"))
    # byte-compiled first, as `pip install` leaves a package (bench/run.py does the same): an editable install
    # under PYTHONDONTWRITEBYTECODE=1 would compile every module again in every timed command
    sources = [str(HERE.parent / d) for d in ("dumpstore", "analysis", "cli")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sources], check=True, stdout=subprocess.DEVNULL)
    data = args.data
    data.mkdir(parents=True, exist_ok=True)
    logs = {"ref": data / f"ref_{args.steps}.log", "target": data / f"target_{args.steps}.log"}
    if not logs["ref"].exists() or not logs["target"].exists():
        write_log(logs["ref"], args.steps, seed=0, lr_change=None)
        write_log(logs["target"], args.steps, seed=1, lr_change=int(args.steps * 0.6))
    steps = monitor_steps(args.monitor_rows, layouts[0])  # every layout: the same steps, the same rows
    mons = {}
    for spf in layouts:
        tail = "" if spf == 50 else f"_{spf}spf"
        mon = data / f"monitor_{args.monitor_rows}{tail}"
        stamp = data / f"monitor_{args.monitor_rows}{tail}.rows"
        if not stamp.exists() or not stamp.read_text().startswith(f"{steps} "):
            shutil.rmtree(mon, ignore_errors=True)
            n = write_monitor(mon, args.monitor_rows, spf, steps)
            stamp.write_text(f"{steps} {n}")
        mons[spf] = (mon, int(stamp.read_text().split()[1]))
    store = data / "store"
    shutil.rmtree(store, ignore_errors=True)
    results: dict = {"cores": os.cpu_count(), "load": os.getloadavg()[0]}
    for run, log in logs.items():
        wall, cpu, _, rss = timed([exe, "longrun-ingest", str(log), "--run", run, "--store", str(store)], args.repeat)
        results[f"ingest_log_{run}_s"] = round(wall, 3)
        results[f"ingest_log_{run}_cpu_s"] = round(cpu, 3)
        results[f"ingest_log_{run}_rss_mb"] = round(rss)
    wall, cpu, out, rss = timed(
        [exe, "curves", "--target", "target", "--ref", "ref", "--store", str(store), "--json"], args.repeat
    )
    doc = json.loads(out)
    results["curves_s"] = round(wall, 3)
    results["curves_cpu_s"] = round(cpu, 3)
    results["curves_rss_mb"] = round(rss)
    results["curves_points"] = doc["n_points"]
    results["curves_divergence_step"] = doc["divergence"]["step"]
    results["curves_lr_mismatch_step"] = (doc["lr_mismatch"] or {}).get("step")
    runs = []
    for k, (spf, (mon, n_rows)) in enumerate(mons.items()):
        key = "monitor" if k == 0 else f"monitor_{spf}spf"  # the first layout keeps the plain keys
        run = f"mon{k}"
        runs.append(run)
        wall, cpu, _, rss = timed([exe, "longrun-ingest", str(mon), "--run", run, "--store", str(store)], args.repeat)
        results[f"{key}_steps_per_file"] = spf
        results[f"{key}_files"] = len(os.listdir(next(mon.iterdir())))
        results[f"{key}_rows"] = n_rows
        results[f"{key}_ingest_s"] = round(wall, 3)
        results[f"{key}_ingest_cpu_s"] = round(cpu, 3)
        results[f"{key}_ingest_rss_mb"] = round(rss)
        results[f"{key}_rows_per_s"] = round(n_rows / wall)
        results[f"{key}_rows_per_cpu_s"] = round(n_rows / cpu)  # what 2 idle cores could reach: twice this at most
    if len(runs) > 1:  # the monitor culprit over two runs of the same rows, and one run's health
        wall, cpu, out, rss = timed(
            [exe, "curves", "--target", runs[1], "--ref", runs[0], "--store", str(store), "--json"], args.repeat
        )
        culprit = json.loads(out)["culprit"]
        results["monitor_culprit_s"] = round(wall, 3)
        results["monitor_culprit_cpu_s"] = round(cpu, 3)
        results["monitor_culprit_rss_mb"] = round(rss)
        results["monitor_culprit_series"] = culprit["n_series"]
        results["monitor_culprit_first"] = culprit["first"]  # None: the two layouts hold the same rows
    if runs:
        wall, cpu, out, rss = timed(
            [exe, "curves", "--run", runs[0], "--health", "--store", str(store), "--json"], args.repeat
        )
        results["monitor_health_s"] = round(wall, 3)
        results["monitor_health_cpu_s"] = round(cpu, 3)
        results["monitor_health_rss_mb"] = round(rss)
    results["load_after"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))
    (data / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

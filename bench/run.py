#!/usr/bin/env python
"""dumpstore benchmark: wall time and peak RSS of the `dumpstore` CLI beside `msprobe compare` on the same input.

Usage::

    python bench/run.py                                   # every scenario, full size
    python bench/run.py --quick                           # small version of each (< 2 min once data is cached)
    python bench/run.py --only stats_pair,requery         # some scenarios
    python bench/run.py --only scale --scale 1000x50x8,1000x2x8   # scale ladder (layers x steps x ranks)
    python bench/run.py --profile stats_ingest,tensor_ingest,divergence   # cProfile hot spots (see README)

Every command runs as a separate process exactly as a user would type it (`dumpstore ingest ...`,
`dumpstore divergence ...`, `msprobe compare -tp ... -gp ... -o ...`).  Wall time is measured around the
process; peak RSS is the child's `ru_maxrss` from `wait4` (the largest single process of its tree, what GNU
`time -f %M` reports); `tree MB` is the largest sum of RSS over the child's process tree, sampled every
50 ms (matters for `ingest --jobs N`).  Inputs are read once before a scenario so both tools start warm.
A child whose tree exceeds --mem-cap-gb or runs past --timeout is killed and reported as such.

Data (generated once, cached) and stores live under bench/.data/ (git-ignored); the table is also written to
bench/.data/results.json.  msprobe (`mindstudio-probe`) is a development-only dependency: without it the
msprobe columns are skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_dumps
import synth

DATA = HERE / ".data"
SCENARIOS = ("stats_pair", "tensor_pair", "requery", "scale", "ingest_rate")
PROFILES = ("stats_ingest", "tensor_ingest", "divergence")
FULL_SCALE = "1000x50x8"
QUICK_SCALE = "200x5x4"
TINY_SCALE = "10x3x2"
SAMPLES = HERE.parent / "sample_dumps"

TARGETS = {  # from issue 7
    "stats_pair": "≥10× faster than msprobe",
    "tensor_pair": "≥5× faster than msprobe",
    "requery": "≥50× faster than msprobe",
    "scale": "≤5 s wall, ≤2 GB peak RSS",
    "stats_ingest": "≥100k rows/s per core",
    "tensor_ingest": "≥1 GB/s on 2 cores",
    "ingest_memory": "bounded by a batch (flat in input size)",
}


# ---------------------------------------------------------------- measuring one child process
@dataclass
class Run:
    cmd: list[str]
    wall_s: float
    peak_rss_mb: float  # max RSS of the largest single process (wait4 ru_maxrss)
    tree_rss_mb: float  # max of the summed RSS of the process tree (sampled)
    rc: int
    killed: str | None = None
    stdout: str = field(default="", repr=False)
    stderr: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.killed is None

    def brief(self) -> dict:
        d = asdict(self)
        d.pop("stdout")
        d["stderr_tail"] = d.pop("stderr")[-600:]
        return d


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _tree_rss(root_pid: int) -> int:
    """Summed RSS (bytes) of the processes in root_pid's session (the child starts a new session)."""
    total = 0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    for n in names:
        if not n.isdigit():
            continue
        try:
            with open(f"/proc/{n}/stat", "rb") as fh:
                st = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # fields after the comm: state ppid pgrp session ... rss is field 24 (index 21 here)
        if int(st[3]) == root_pid:
            total += int(st[21]) * _PAGE
    return total


def measure(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    env: dict | None = None,
    mem_cap_gb: float = 16.0,
    timeout: float = 1800.0,
    log=None,
) -> Run:
    """Run `cmd` as a child process; wall time, peak RSS; kill its tree past the memory cap or timeout."""
    out_f = open(DATA / ".stdout", "w+b")  # noqa: SIM115 - closed below, after the child exits
    err_f = open(DATA / ".stderr", "w+b")  # noqa: SIM115
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out_f, stderr=err_f, start_new_session=True)
    state = {"tree": 0, "killed": None}
    stop = threading.Event()
    cap = mem_cap_gb * (1 << 30)

    def watch() -> None:
        while not stop.wait(0.05):
            rss = _tree_rss(p.pid)
            state["tree"] = max(state["tree"], rss)
            reason = None
            if rss > cap:
                reason = f"killed: process tree RSS {rss / (1 << 30):.1f} GB > cap {mem_cap_gb} GB"
            elif time.perf_counter() - t0 > timeout:
                reason = f"killed: ran past the {timeout:.0f} s timeout"
            if reason:
                state["killed"] = reason
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                return

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    out_f.seek(0)
    err_f.seek(0)
    run = Run(
        cmd,
        round(wall, 3),
        round(ru.ru_maxrss / 1024, 1),
        round(state["tree"] / (1 << 20), 1),
        p.returncode,
        state["killed"],
        out_f.read().decode(errors="replace"),
        err_f.read().decode(errors="replace"),
    )
    out_f.close()
    err_f.close()
    if log:
        status_s = run.killed or ("ok" if run.rc == 0 else f"exit {run.rc}")
        log(f"    {run.wall_s:8.2f} s {run.peak_rss_mb:8.0f} MB  {status_s:<6} {_short(cmd)}")
        if not run.ok and run.stderr:
            log("      " + run.stderr.strip().splitlines()[-1][:300])
    return run


def _short(cmd: list[str]) -> str:
    parts = []
    for c in cmd:
        c = str(c)
        if "/" in c and len(c) > 40:
            c = ".../" + "/".join(Path(c).parts[-2:])
        parts.append(c)
    return " ".join(parts)[:160]


def prewarm(root: Path) -> int:
    """Read every file under root once (page cache), so neither tool pays for a cold disk; returns bytes."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                with open(os.path.join(dirpath, f), "rb") as fh:
                    while chunk := fh.read(1 << 24):
                        total += len(chunk)
            except OSError:
                pass
    return total


# ---------------------------------------------------------------- the bench
@dataclass
class Row:
    scenario: str
    item: str
    ds_wall_s: float | None = None
    ds_rss_mb: float | None = None
    ms_wall_s: float | None = None
    ms_rss_mb: float | None = None
    speedup: float | None = None  # msprobe wall / dumpstore wall
    metric: str | None = None  # a throughput etc. when there is no msprobe column
    target: str | None = None
    met: str | None = None  # yes / no / n/a
    verdict: str | None = None  # OK / WRONG / - (dumpstore's verdict vs the injected fault)
    note: str | None = None
    store_b_per_row: float | None = None  # bytes of Parquet (tensors/) per leaf row of the store
    load: str | None = None  # 1-minute load average when the row was measured
    runs: list[dict] = field(default_factory=list)


class Bench:
    def __init__(self, args):
        self.args = args
        self.quick = args.quick or args.tiny
        self.tiny = args.tiny
        self.size = "_tiny" if args.tiny else "_quick" if args.quick else ""
        self.rows: list[Row] = []
        self.mem_cap = args.mem_cap_gb
        self.timeout = args.timeout
        self.ds = self._dumpstore_cli()
        self.ms = None if args.no_msprobe else self._msprobe_cli()
        self.built: dict[str, Path] = {}  # pair name -> store (for requery)
        self.ms_runs: dict[str, Run] = {}  # msprobe measured once per input and tag
        self.log = print
        DATA.mkdir(parents=True, exist_ok=True)

    # ---- tools
    @staticmethod
    def _dumpstore_cli() -> list[str]:
        beside = Path(sys.executable).parent / "dumpstore"
        if beside.is_file():
            return [str(beside)]
        found = shutil.which("dumpstore")
        if found:
            return [found]
        return [sys.executable, "-m", "dumpstore.cli.main"]

    @staticmethod
    def _msprobe_cli() -> list[str] | None:
        if importlib.util.find_spec("msprobe") is None:
            return None
        beside = Path(sys.executable).parent / "msprobe"
        found = str(beside) if beside.is_file() else shutil.which("msprobe")
        return [found] if found else None

    def run(self, cmd: list[str], **kw) -> Run:
        kw.setdefault("mem_cap_gb", self.mem_cap)
        kw.setdefault("timeout", self.timeout)
        return measure(cmd, log=self.log, **kw)

    def dumpstore(self, *args: str, **kw) -> Run:
        return self.run(self.ds + [str(a) for a in args], **kw)

    def best(self, fn, key=None):
        """Call fn() --repeat times; keep the result with the least wall time (a list of Runs: their sum)."""
        key = key or (lambda res: sum(r.wall_s for r in res) if isinstance(res, list) else res.wall_s)
        results = [fn() for _ in range(max(1, self.args.repeat))]
        ok = [res for res in results if all(r.ok for r in (res if isinstance(res, list) else [res]))]
        return min(ok or results, key=key)

    def add(self, row: Row) -> None:
        row.load = _load()
        self.rows.append(row)

    def msprobe_compare(self, target_step: Path, ref_step: Path, out: Path) -> Run:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        return self.run(self.ms + ["compare", "-tp", str(target_step), "-gp", str(ref_step), "-o", str(out)], cwd=out)

    # ---- verdict check
    @staticmethod
    def check(div: Run, expected: dict) -> tuple[str, str]:
        if not div.ok:
            return "-", f"divergence failed: {div.killed or div.stderr.strip()[-200:]}"
        try:
            v = json.loads(div.stdout)
        except json.JSONDecodeError:
            return "WRONG", "divergence --json printed no JSON"
        f, c = v.get("first_divergence") or {}, v.get("culprit") or {}
        got = f"first {f.get('op')} (step {f.get('step')} rank {f.get('rank')}), culprit {c.get('kind')}"
        ok = (
            f.get("op") == expected["first_divergence_op"]
            and f.get("step") == expected["step"]
            and f.get("rank") == expected["rank"]
        )
        culprit_ok = c.get("kind") == expected.get("culprit_kind")
        if ok and not culprit_ok:
            got += f" (expected culprit {expected.get('culprit_kind')})"
        return ("OK" if ok else "WRONG"), got

    # ---- pairs of real dumps
    def _real_case(self, name: str) -> tuple[Path, dict]:
        if self.tiny:
            return self._sample_case(name)
        cdir = real_dumps.generate_case(name, DATA / "real", quick=self.quick, log=self.log)
        return cdir, json.loads((cdir / "manifest.json").read_text())

    def _sample_case(self, name: str) -> tuple[Path, dict]:
        """--tiny: the bundled sample pair weight_1pct_<name> / its reference, copied, instead of a deep model."""
        cdir = DATA / "real" / f"{name}_tiny"
        if not (cdir / "manifest.json").is_file():
            cases = {c["name"]: c for c in json.loads((SAMPLES / "catalog.json").read_text())["cases"]}
            case = cases[f"weight_1pct_{name}"]
            if cdir.exists():
                shutil.rmtree(cdir)
            shutil.copytree(SAMPLES / cases[case["ref"]]["path"], cdir / "ref")
            shutil.copytree(SAMPLES / case["path"], cdir / "target")
            docs = [json.loads(p.read_text()) for p in sorted((cdir / "ref").rglob("dump.json"))]
            exp = case["expected"]
            man = {
                "case": case["name"],
                "rows_per_side": sum(real_dumps._count_rows(d) for d in docs),
                "records_per_side": sum(len(d["data"]) for d in docs),
                "dump_json_bytes_per_side": sum(p.stat().st_size for p in (cdir / "ref").rglob("dump.json")),
                "pt_bytes_per_side": sum(p.stat().st_size for p in (cdir / "ref").rglob("*.pt")),
                "pt_files_per_side": sum(1 for _ in (cdir / "ref").rglob("*.pt")),
                "expected": {
                    "step": exp["first_divergence"]["step"],
                    "rank": exp["first_divergence"]["rank"],
                    "first_divergence_op": exp["first_divergence"]["op"],
                    "culprit_kind": exp["culprit"]["kind"],
                },
            }
            (cdir / "manifest.json").write_text(json.dumps(man, indent=1))
        return cdir, json.loads((cdir / "manifest.json").read_text())

    def pair(self, scenario: str, case: str, exact: bool) -> None:
        cdir, man = self._real_case(case)
        self.log(
            f"== {scenario}: {man['rows_per_side']:,} rows, {man['records_per_side']:,} records, "
            f"{man['dump_json_bytes_per_side'] / 1e6:.1f} MB dump.json + {man['pt_bytes_per_side'] / 1e6:.1f} "
            f"MB .pt per side"
        )
        prewarm(cdir)
        store = DATA / "stores" / (scenario + self.size)

        div_args = [
            "divergence",
            "--target",
            "target",
            "--ref",
            "ref",
            "--store",
            store,
            "--json",
            *(["--exact"] if exact else []),
        ]

        def apart() -> list[Run]:  # three commands, as a user types them one after the other
            if store.exists():
                shutil.rmtree(store)
            return [
                self.dumpstore("ingest", cdir / "ref", "--run", "ref", "--store", store),
                self.dumpstore("ingest", cdir / "target", "--run", "target", "--store", store),
                self.dumpstore(*div_args),
            ]

        def together() -> list[Run]:  # both dumps in one ingest command, then divergence
            if store.exists():
                shutil.rmtree(store)
            return [
                self.dumpstore(
                    "ingest", cdir / "ref", cdir / "target", "--run", "ref", "--run", "target", "--store", store
                ),
                self.dumpstore(*div_args),
            ]

        what = f"divergence{' --exact' if exact else ''}"
        for label, fn in (
            (f"ingest, ingest, {what} (3 commands)", apart),
            (f"ingest both at once, {what} (2 commands)", together),
        ):
            runs = self.best(fn)
            verdict, got = self.check(runs[-1], man["expected"])
            row = Row(
                scenario,
                label,
                round(sum(r.wall_s for r in runs), 2),
                max(r.peak_rss_mb for r in runs),
                target=TARGETS[scenario],
                verdict=verdict,
                note=got,
                runs=[r.brief() for r in runs],
                store_b_per_row=bytes_per_row(store, 2 * man["rows_per_side"]),
            )
            if not all(r.ok for r in runs):
                row.note = "dumpstore failed: " + "; ".join(
                    r.killed or r.stderr.strip()[-200:] for r in runs if not r.ok
                )
            self._msprobe_side(row, cdir, scenario, threshold=10.0 if scenario == "stats_pair" else 5.0)
            self.add(row)
        self.built[case] = store

    def _msprobe_side(self, row: Row, cdir: Path, tag: str, threshold: float) -> None:
        if self.ms is None:
            row.met = "n/a"
            row.note = (row.note or "") + (
                "; msprobe column skipped (--no-msprobe / --tiny)"
                if self.args.no_msprobe
                else "; msprobe not installed (pip install mindstudio-probe): column skipped"
            )
            return
        if tag not in self.ms_runs:
            self.ms_runs[tag] = self.best(
                lambda: self.msprobe_compare(
                    cdir / "target" / "step0", cdir / "ref" / "step0", DATA / "msprobe_out" / tag
                )
            )
        ms = self.ms_runs[tag]
        row.runs.append(ms.brief())
        if not ms.ok:
            row.note = (row.note or "") + f"; msprobe failed: {ms.killed or ms.stderr.strip()[-200:]}"
            row.met = "n/a"
            return
        row.ms_wall_s, row.ms_rss_mb = round(ms.wall_s, 2), ms.peak_rss_mb
        if row.ds_wall_s:
            row.speedup = round(ms.wall_s / row.ds_wall_s, 2)
            row.met = "yes" if row.speedup >= threshold else "no"

    def stats_pair(self) -> None:
        self.pair("stats_pair", "stats", exact=False)

    def tensor_pair(self) -> None:
        self.pair("tensor_pair", "tensor", exact=True)

    def requery(self) -> None:
        for case, variants in (("stats", [False]), ("tensor", [False, True])):
            cdir, man = self._real_case(case)
            store = self.built.get(case)
            if store is None or not (store / "runs.parquet").exists():
                store = DATA / "stores" / (f"requery_{case}" + self.size)
                self.log(f"== requery: building the {case} store first (not timed)")
                if store.exists():
                    shutil.rmtree(store)
                for side in ("ref", "target"):
                    self.dumpstore("ingest", cdir / side, "--run", side, "--store", store)
            prewarm(store)
            prewarm(cdir)
            if case == "stats":
                self.log("== startup floor: dumpstore runs (imports + catalog read)")
                r = self.best(lambda store=store: self.dumpstore("runs", "--store", store))
                self.add(
                    Row(
                        "requery",
                        "startup floor: dumpstore runs",
                        r.wall_s,
                        r.peak_rss_mb,
                        metric="-",
                        target="(context)",
                        met="n/a",
                        verdict="-",
                        note="any dumpstore command costs at least this; requery ≥50× needs the total "
                        "under msprobe's time / 50",
                        runs=[r.brief()],
                    )
                )
            for exact, fresh in ((e, f) for e in variants for f in (True, False)):
                flags = (["--exact"] if exact else []) + (["--no-cache"] if fresh else [])
                how = "recomputed (--no-cache)" if fresh else "memoized verdict"
                self.log(f"== requery {case}{' --exact' if exact else ''}: {how}")
                div = self.best(
                    lambda store=store, flags=flags: self.dumpstore(
                        "divergence", "--target", "target", "--ref", "ref", "--store", store, "--json", *flags
                    )
                )
                verdict, got = self.check(div, man["expected"])
                row = Row(
                    "requery",
                    f"{case}: divergence{' --exact' if exact else ''}, {how}",
                    div.wall_s,
                    div.peak_rss_mb,
                    target=TARGETS["requery"],
                    verdict=verdict,
                    note=got,
                    runs=[div.brief()],
                )
                if not div.ok:
                    row.note = f"dumpstore failed: {div.killed or div.stderr.strip()[-200:]}"
                self._msprobe_side(row, cdir, f"requery_{case}{'_exact' if exact else ''}", threshold=50.0)
                self.add(row)

    # ---- scale
    def _synth(self, spec: str) -> tuple[Path, dict]:
        layers, steps, ranks = (int(v) for v in spec.lower().split("x"))
        out = DATA / "synth" / f"L{layers}_S{steps}_R{ranks}"
        man_path = out / "manifest.json"
        if man_path.is_file():
            man = json.loads(man_path.read_text())
            self.log(f"synth {out.name}: cached ({man['rows_per_side']:,} rows per side)")
            return out, man
        fs = 3 if steps > 6 else steps // 2
        fr = 5 if ranks == 8 else ranks - 1
        self.log(f"synth {out.name}: generating ...")
        man = synth.generate(out, layers, steps, ranks, fs, fr, int(layers * 0.7), log=self.log)
        return out, man

    def scale(self) -> None:
        specs = self.args.scale or (TINY_SCALE if self.tiny else QUICK_SCALE if self.quick else FULL_SCALE)
        for spec in specs.split(","):
            self._scale_one(spec.strip())

    def _scale_one(self, spec: str) -> None:
        src, man = self._synth(spec)
        self.log(
            f"== scale {spec}: {man['rows_per_side']:,} rows per side ({man['files_per_side']} files, "
            f"{man['dump_json_bytes_per_side'] / 1e9:.2f} GB dump.json per side)"
        )
        store = DATA / "stores" / f"scale_{spec}"
        stamp = store / ".bench_stamp.json"
        ingest_runs: list[Run] = []
        reuse = self.args.reuse_store and stamp.is_file() and json.loads(stamp.read_text()).get("manifest") == man
        if reuse:
            info = json.loads(stamp.read_text())
            self.log(f"    reusing store {store} (ingest measured earlier: {info['ingest_wall_s']} s)")
            ingest_note = (
                f"store reused; ingest measured earlier: {info['ingest_wall_s']} s for 2 × "
                f"{man['rows_per_side']:,} rows = {2 * man['rows_per_side'] / info['ingest_wall_s']:,.0f} rows/s"
            )
        else:
            if store.exists():
                shutil.rmtree(store)
            prewarm(src)
            for side in ("ref", "target"):
                ingest_runs.append(self.dumpstore("ingest", src / side, "--run", side, "--store", store))
            ingest_wall = round(sum(r.wall_s for r in ingest_runs), 1)
            rate = 2 * man["rows_per_side"] / ingest_wall if ingest_wall else 0
            ingest_note = (
                f"ingest (not in the time) {ingest_wall} s for 2 × {man['rows_per_side']:,} rows "
                f"= {rate:,.0f} rows/s, peak {max(r.peak_rss_mb for r in ingest_runs):.0f} MB/process, "
                f"tree {max(r.tree_rss_mb for r in ingest_runs):.0f} MB"
            )
            if all(r.ok for r in ingest_runs):
                stamp.write_text(json.dumps({"manifest": man, "ingest_wall_s": ingest_wall}))
        if ingest_runs and not all(r.ok for r in ingest_runs):
            self.add(
                Row(
                    "scale",
                    f"{spec} ({man['rows_per_side'] / 1e6:.1f}M rows/side)",
                    target=TARGETS["scale"],
                    met="no",
                    verdict="-",
                    note="ingest failed: "
                    + "; ".join(r.killed or r.stderr.strip()[-200:] for r in ingest_runs if not r.ok),
                    runs=[r.brief() for r in ingest_runs],
                )
            )
            return
        prewarm(store)
        div = self.best(
            lambda: self.dumpstore(
                "divergence", "--target", "target", "--ref", "ref", "--store", store, "--json", "--no-cache"
            )
        )  # the work, not the memo
        verdict, got = self.check(div, man["expected"])
        if stamp.is_file():
            info = json.loads(stamp.read_text())
            info.update(divergence_ok=div.ok, divergence_wall_s=div.wall_s, divergence_rss_mb=div.peak_rss_mb)
            stamp.write_text(json.dumps(info))
        met = "yes" if div.ok and div.wall_s <= 5.0 and div.peak_rss_mb <= 2048 else "no"
        row = Row(
            "scale",
            f"{spec} ({man['rows_per_side'] / 1e6:.2f}M rows/side): divergence",
            div.wall_s,
            div.peak_rss_mb,
            metric=f"{2 * man['rows_per_side'] / div.wall_s:,.0f} rows/s" if div.ok else None,
            target=TARGETS["scale"],
            met=met,
            verdict=verdict,
            note=(got if div.ok else f"divergence {div.killed or 'failed: ' + div.stderr.strip()[-200:]}")
            + "; "
            + ingest_note
            + "; msprobe: n/a",
            runs=[r.brief() for r in ingest_runs + [div]],
            store_b_per_row=bytes_per_row(store, 2 * man["rows_per_side"]),
        )
        self.add(row)

    # ---- ingest rates
    def _fresh_ingest(self, src: Path, run: str, store: Path, jobs: int | None) -> Run:
        if store.exists():
            shutil.rmtree(store)
        return self.dumpstore("ingest", src, "--run", run, "--store", store, *(["--jobs", str(jobs)] if jobs else []))

    def ingest_rate(self) -> None:
        cores = os.cpu_count() or 1
        spec = "10x2x2" if self.tiny else "200x2x2" if self.quick else "1000x2x4"
        src, man = self._synth(spec)
        prewarm(src)
        rows = man["rows_per_side"]
        self.log(f"== ingest_rate: statistics, {rows:,} rows in {man['files_per_side']} files")
        for jobs in sorted({1, cores}):
            store = DATA / "stores" / f"rate_stats_j{jobs}"
            r = self.best(lambda store=store, jobs=jobs: self._fresh_ingest(src / "ref", "ref", store, jobs))
            rate = rows / r.wall_s / jobs
            self.add(
                Row(
                    "ingest_rate",
                    f"stats ingest --jobs {jobs} ({rows:,} rows)",
                    r.wall_s,
                    r.peak_rss_mb,
                    store_b_per_row=bytes_per_row(store, rows),
                    metric=f"{rate:,.0f} rows/s per core",
                    target=TARGETS["stats_ingest"],
                    met=("yes" if rate >= 100_000 else "no") if r.ok else "no",
                    verdict="-",
                    note=f"tree RSS {r.tree_rss_mb:.0f} MB"
                    + ("" if r.ok else f"; failed: {r.killed or r.stderr[-200:]}"),
                    runs=[r.brief()],
                )
            )
        # tensor: the real 50-layer dump (many small .pt files) and large synthetic .pt files
        cdir, rman = self._real_case("tensor")
        prewarm(cdir / "ref")
        nbytes = rman["pt_bytes_per_side"]
        store = DATA / "stores" / "rate_tensor_small"
        self.log(f"== ingest_rate: tensor, real dump ({rman['pt_files_per_side']} .pt files, {nbytes / 1e6:.0f} MB)")
        r = self.best(lambda: self._fresh_ingest(cdir / "ref", "ref", store, None))
        gbs = nbytes / r.wall_s / 1e9
        self.add(
            Row(
                "ingest_rate",
                f"tensor ingest, real dump ({rman['pt_files_per_side']} small .pt, {nbytes / 1e6:.0f} MB)",
                r.wall_s,
                r.peak_rss_mb,
                metric=f"{gbs:.3f} GB/s ({rman['pt_files_per_side'] / r.wall_s:,.0f} files/s)",
                target=TARGETS["tensor_ingest"],
                met="yes" if gbs >= 1 and r.ok else "no",
                verdict="-",
                note=f"{cores} cores (one unit: step0/rank0 -> one process); tree RSS {r.tree_rss_mb:.0f} MB",
                runs=[r.brief()],
                store_b_per_row=bytes_per_row(store, rman["rows_per_side"]),
            )
        )
        tspec = "1x2x1" if self.tiny else "2x4x16" if self.quick else "4x16x16"
        units, files, mb = (int(v) for v in tspec.split("x"))
        tdir = DATA / "synth" / f"tensors_{tspec}"
        if (tdir / "manifest.json").is_file():
            tman = json.loads((tdir / "manifest.json").read_text())
        else:
            tman = synth.tensor_dump(tdir, units, files, mb, log=self.log)
        prewarm(tdir)
        nbytes = tman["tensor_bytes"]
        for jobs in sorted({1, cores}):
            store = DATA / "stores" / f"rate_tensor_big_j{jobs}"
            self.log(f"== ingest_rate: tensor, {units * files} files of {mb} MB, --jobs {jobs}")
            r = self.best(lambda store=store, jobs=jobs: self._fresh_ingest(tdir, "big", store, jobs))
            gbs = nbytes / r.wall_s / 1e9
            self.add(
                Row(
                    "ingest_rate",
                    f"tensor ingest --jobs {jobs} ({units * files} × {mb} MB {tman['format']})",
                    r.wall_s,
                    r.peak_rss_mb,
                    metric=f"{gbs:.3f} GB/s",
                    target=TARGETS["tensor_ingest"] if jobs == cores else "(1 core)",
                    met=("yes" if gbs >= 1 and r.ok else "no") if jobs == cores else "n/a",
                    verdict="-",
                    store_b_per_row=bytes_per_row(store, units * files),
                    note=f"tree RSS {r.tree_rss_mb:.0f} MB"
                    + ("" if r.ok else f"; failed: {r.killed or r.stderr[-200:]}"),
                    runs=[r.brief()],
                )
            )
        # memory bounded by a batch? peak RSS per process against the size of one unit
        ing = [(row.item, row.ds_rss_mb) for row in self.rows if row.scenario == "ingest_rate" and row.ds_rss_mb]
        lo, hi = min(v for _, v in ing), max(v for _, v in ing)
        self.add(
            Row(
                "ingest_rate",
                "ingest memory (peak per process)",
                metric=f"{lo:.0f}–{hi:.0f} MB",
                target=TARGETS["ingest_memory"],
                met="see note",
                verdict="-",
                note="peak MB per process: "
                + ", ".join(f"{rss:.0f} ({item})" for item, rss in ing)
                + f"; one stats unit = {man['rows_per_file']:,} rows "
                f"({man['dump_json_bytes_per_side'] / man['files_per_side'] / 1e6:.1f} MB dump.json), one big "
                f"tensor unit = {files} × {mb} MB; compare with the scale ingest's peak (scale notes)",
            )
        )

    # ---- output
    def table(self) -> str:
        head = [
            "scenario",
            "what",
            "dumpstore s",
            "dumpstore MB",
            "msprobe s",
            "msprobe MB",
            "speedup",
            "metric",
            "store B/row",
            "target",
            "met",
            "verdict",
            "load",
        ]
        lines = []
        for r in self.rows:
            lines.append(
                [
                    r.scenario,
                    r.item,
                    _f(r.ds_wall_s),
                    _f(r.ds_rss_mb, 0),
                    _f(r.ms_wall_s),
                    _f(r.ms_rss_mb, 0),
                    (f"{r.speedup:.2f}×" if r.speedup is not None else "-"),
                    r.metric or "-",
                    _f(r.store_b_per_row, 0),
                    r.target or "-",
                    r.met or "-",
                    r.verdict or "-",
                    (r.load or "-").split()[0],
                ]
            )
        widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
        out = [" | ".join(h.ljust(w) for h, w in zip(head, widths)), "-+-".join("-" * w for w in widths)]
        out += [" | ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
        notes = [f"  [{r.scenario} / {r.item}] {r.note}" for r in self.rows if r.note]
        return "\n".join(out + (["notes:"] + notes if notes else []))

    def save(self, elapsed: float) -> Path:
        path = Path(self.args.json) if self.args.json else DATA / "results.json"
        doc = {
            "quick": self.quick,
            "repeat": self.args.repeat,
            "elapsed_s": round(elapsed, 1),
            "host": _host(),
            "targets": TARGETS,
            "table": self.table().splitlines(),
            "msprobe": self.ms is not None,
            "dumpstore_cli": self.ds,
            "rows": [asdict(r) for r in self.rows],
        }
        path.write_text(json.dumps(doc, indent=1))
        return path


def bytes_per_row(store: Path, rows: int) -> float | None:
    """Parquet bytes under the store's tensors/ folder per leaf row (live and replaced files alike)."""
    files = list((store / "tensors").rglob("*.parquet"))
    return round(sum(f.stat().st_size for f in files) / rows, 1) if files and rows else None


def _load() -> str | None:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return None


def _f(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def _host() -> dict:
    info = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    try:
        with open("/proc/meminfo") as fh:
            info["mem_gb"] = round(int(fh.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["dumpstore"] = version("dumpstore")
        info["msprobe"] = version("mindstudio-probe")
    except Exception:  # noqa: BLE001, S110 - metadata is informative only
        pass
    return info


# ---------------------------------------------------------------- profiles
def profile(bench: Bench, names: list[str], top: int) -> None:
    """Run the slow dumpstore commands under cProfile (in-process: --jobs 1) and print the hot spots."""
    import pstats

    pdir = DATA / "profiles"
    pdir.mkdir(parents=True, exist_ok=True)
    cli = bench.ds
    base = [sys.executable, "-m", "cProfile", "-o"] if cli[0] != sys.executable else None
    for name in names:
        prof = pdir / f"{name}{'_quick' if bench.quick else ''}.prof"
        if name == "stats_ingest":
            cdir, _ = bench._real_case("stats")
            store = DATA / "stores" / "profile_stats"
            shutil.rmtree(store, ignore_errors=True)
            args = ["ingest", str(cdir / "ref"), "--run", "ref", "--store", str(store), "--jobs", "1"]
        elif name == "tensor_ingest":
            cdir, _ = bench._real_case("tensor")
            store = DATA / "stores" / "profile_tensor"
            shutil.rmtree(store, ignore_errors=True)
            args = ["ingest", str(cdir / "ref"), "--run", "ref", "--store", str(store), "--jobs", "1"]
        elif name == "divergence":
            store = (
                (DATA / "stores" / f"scale_{bench.args.scale.split(',')[0]}") if bench.args.scale else _largest_store()
            )
            if store is None or not (store / "runs.parquet").exists():
                print("profile divergence: no scale store yet; run --only scale first (or give --scale LxSxR)")
                continue
            args = ["divergence", "--target", "target", "--ref", "ref", "--store", str(store), "--json"]
        else:
            raise SystemExit(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
        cmd = (
            base + [str(prof), cli[0]]
            if base
            else [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "dumpstore.cli.main"]
        ) + args
        print(f"== profile {name}: {_short(args)}")
        r = bench.run(cmd)
        if not r.ok or not prof.exists():
            print(f"   failed: {r.killed or r.stderr[-300:]}")
            continue
        st = pstats.Stats(str(prof))
        total = st.total_tt  # type: ignore[attr-defined]
        print(f"   profile total {total:.2f} s ({r.wall_s:.2f} s wall with profiler); {prof}")
        _print_profile(st.stats, total, top)  # type: ignore[attr-defined]


_OWN = ("/dumpstore/", "/analysis/", "/cli/")
_WRAPPERS = ("cli/main.py:20:invoke",)


def _print_profile(stats: dict, total: float, top: int) -> None:
    entries = [(tt, ct, nc, _where(fn, line), func) for (fn, line, func), (_, nc, tt, ct, _) in stats.items()]
    imports = max((ct for (fn, _, func), (_, _, _, ct, _) in stats.items() if func == "_find_and_load"), default=0.0)
    print(f"   imports (largest _find_and_load, cumulative): {imports:.2f} s = {100 * imports / total:.1f}%")
    print(f"   top {top} by self time (file:line:function):")
    for tt, _, nc, where, func in sorted(entries, key=lambda e: -e[0])[:top]:
        print(f"     {100 * tt / total:5.1f}%  {tt:7.2f} s  {nc:>9} calls  {where}:{func}")
    own = [
        e
        for e in entries
        if e[3].startswith(("dumpstore/", "analysis/", "cli/"))
        and f"{e[3]}:{e[4]}" not in _WRAPPERS
        and e[4] not in ("main", "invoke")
    ]
    print(f"   top {top} dumpstore functions by cumulative time (callees included):")
    for _, ct, nc, where, func in sorted(own, key=lambda e: -e[1])[:top]:
        print(f"     {100 * ct / total:5.1f}%  {ct:7.2f} s  {nc:>9} calls  {where}:{func}")
    by_file: dict[str, float] = {}
    for tt, _, _, where, _ in entries:
        f = where.split(":")[0]
        by_file[f] = by_file.get(f, 0.0) + tt
    print("   self time by file:")
    for f, tt in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        print(f"     {100 * tt / total:5.1f}%  {tt:7.2f} s  {f}")


def _where(fn: str, line: int) -> str:
    for marker in ("/dumpstore/", "/analysis/", "/cli/", "site-packages/"):
        if marker in fn:
            return (
                fn.split(marker, 1)[1]
                if marker == "site-packages/"
                else marker.strip("/") + "/" + fn.split(marker, 1)[1] + f":{line}"
            )
    return f"{fn}:{line}" if line else fn


def _largest_store() -> Path | None:
    """The largest scale store on which `divergence` completed (or any, when none has)."""
    best, size = None, (-1, -1)
    for st in (DATA / "stores").glob("scale_*"):
        stamp = st / ".bench_stamp.json"
        if stamp.is_file():
            info = json.loads(stamp.read_text())
            n = (1 if info.get("divergence_ok") else 0, info["manifest"]["rows_per_side"])
            if n > size:
                best, size = st, n
    return best


# ---------------------------------------------------------------- main
def _compile_bytecode() -> None:
    """Byte-compile dumpstore's sources, as `pip install` does for an installed package (and for msprobe here):
    an editable install under PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module in every command."""
    root = Path(__file__).resolve().parent.parent
    dirs = [str(root / d) for d in ("dumpstore", "analysis", "cli")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *dirs], check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    ap.add_argument("--quick", action="store_true", help="small version of every scenario")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="smallest version (the bundled sample pairs, no msprobe): the test suite's smoke run",
    )
    ap.add_argument("--no-msprobe", action="store_true", help="skip the msprobe columns")
    ap.add_argument("--data", default=None, help="data folder (default bench/.data)")
    ap.add_argument(
        "--scale",
        default=None,
        help=f"scale sizes LAYERSxSTEPSxRANKS, comma-separated (default {FULL_SCALE}; quick {QUICK_SCALE})",
    )
    ap.add_argument(
        "--reuse-store",
        action="store_true",
        help="scale: reuse a store built by an earlier run from the same synthetic data",
    )
    ap.add_argument(
        "--mem-cap-gb",
        type=float,
        default=None,
        help="kill a command whose process tree exceeds this RSS (default: 70%% of RAM, at most 16)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="kill a command after this many seconds")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each measurement N times and keep the fastest (use on a busy machine)",
    )
    ap.add_argument("--json", default=None, help="results file (default bench/.data/results.json)")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="NAMES",
        help=f"instead of timing: cProfile hot spots of {', '.join(PROFILES)}",
    )
    ap.add_argument("--top", type=int, default=15, help="profile rows to print")
    args = ap.parse_args(argv)
    args.no_msprobe = args.no_msprobe or args.tiny
    subprocess.run([sys.executable, str(SAMPLES / "fixtures.py")], check=True)  # the tensor samples' .pt files
    if args.data:
        global DATA
        DATA = Path(args.data).resolve()
    if args.mem_cap_gb is None:
        args.mem_cap_gb = min(16.0, 0.7 * _host().get("mem_gb", 8))
    bench = Bench(args)
    if args.profile:
        profile(bench, [p for p in args.profile.split(",") if p], args.top)
        return 0
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in chosen if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; choose from {', '.join(SCENARIOS)}")
    _compile_bytecode()
    t0 = time.perf_counter()
    print(
        f"dumpstore bench{' (quick)' if args.quick else ''}: {', '.join(chosen)}; dumpstore = {' '.join(bench.ds)}; "
        f"msprobe = {' '.join(bench.ms) if bench.ms else 'skipped' if args.no_msprobe else 'NOT INSTALLED (skipped)'}; "
        f"memory cap {args.mem_cap_gb:.1f} GB per command"
    )
    for s in SCENARIOS:  # fixed order: requery uses the stores built by the pairs
        if s in chosen:
            getattr(bench, s)()
    elapsed = time.perf_counter() - t0
    print()
    print(bench.table())
    if bench.ms is None and not args.no_msprobe:
        print(
            "note: msprobe (mindstudio-probe, a development-only dependency) is not installed; msprobe columns "
            "and speedups are skipped."
        )
    path = bench.save(elapsed)
    print(f"\n{elapsed:.0f} s in all; results written to {path}")
    return 1 if any(r.verdict == "WRONG" for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Real msprobe dumps of a deep model, for the benchmark (made by msprobe itself, like sample_dumps/generate.py).

Usage::

    python bench/real_dumps.py [--out bench/.data/real] [--only stats,tensor] [--quick] [--force]

Two cases, each a reference run and a target run in which one weight in the middle of the model is scaled by
1.01 before the step (so the expected first divergence is the forward linear that uses it):

    stats   200 x TinyBlock (d_model 32, hidden 64), msprobe statistics task, level mix, 1 step:
            ~11.6k records, ~36k rows per side (the workload of MSPROBE_FORMAT.md section 7)
    tensor  50 x TinyBlock, msprobe tensor task, level mix, 1 step: ~9k rows, ~64 MB of .pt per side

`--quick` makes small versions (20 and 5 layers) under a different folder name.  Generated dumps are cached:
a case folder with a complete `manifest.json` is reused unless `--force`.  Needs mindstudio-probe and torch
(CPU build); each run is a fresh subprocess because msprobe's PrecisionDebugger is a per-process singleton.

Each case folder holds `ref/` and `target/` (msprobe dump roots: step0/rank0/dump.json ...) and
`manifest.json` with the model, sizes, the scaled weight and the expected first-divergence op
(read back from the reference's construct.json: the Functional.linear record whose parent is that
weight's Linear module).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / ".data" / "real"

# name -> settings; "quick" variants are small versions of the same case
CASES = {
    "stats": {"task": "statistics", "layers": 200, "d_model": 32, "hidden": 64, "batch": 2, "seq": 8, "vocab": 10},
    "tensor": {"task": "tensor", "layers": 50, "d_model": 32, "hidden": 64, "batch": 4, "seq": 14, "vocab": 10},
}
QUICK_LAYERS = {"stats": 20, "tensor": 5}
SEED, DATA_SEED, LR = 0, 1234, 0.1
FAULT_SCALE = 1.01


def case_settings(name: str, quick: bool) -> dict:
    s = dict(CASES[name])
    if quick:
        s["layers"] = QUICK_LAYERS[name]
    s["fault_param"] = f"layers.{s['layers'] // 2}.fc1.weight"
    return s


def case_dir(out: Path, name: str, quick: bool) -> Path:
    return out / (f"{name}_quick" if quick else name)


# ---------------------------------------------------------------- the training job (subprocess)
def _train(settings: dict, side: str, dump_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    d, hidden, seq, batch, vocab = (settings[k] for k in ("d_model", "hidden", "seq", "batch", "vocab"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    init_file = os.path.join(os.getcwd(), "pg_init")
    # a process group makes msprobe write rank0/ instead of proc<pid>/
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=0, world_size=1)
    from msprobe.pytorch import PrecisionDebugger

    class TinyBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, hidden)
            self.fc2 = nn.Linear(hidden, d)

        def forward(self, x):
            h = self.ln1(x)
            q, k, v = self.qkv(h).split(d, dim=-1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(d)
            t = scores.shape[-1]
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
            scores = scores.masked_fill(mask, float("-inf"))
            x = x + self.proj(F.softmax(scores, dim=-1) @ v)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList([TinyBlock() for _ in range(settings["layers"])])
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.ln_f(x).mean(dim=1))

    torch.manual_seed(SEED)
    model = Deep()
    if side == "target":
        with torch.no_grad():
            dict(model.named_parameters())[settings["fault_param"]].mul_(FAULT_SCALE)
    g = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch,), generator=g)

    task = settings["task"]
    config = {
        "task": task,
        "dump_path": dump_path,
        "rank": [],
        "step": [0],
        "level": "mix",
        task: {"scope": [], "list": [], "data_mode": ["all"]},
    }
    if task == "statistics":
        config[task]["summary_mode"] = "statistics"
    with open("config.json", "w") as fh:
        json.dump(config, fh, indent=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    debugger = PrecisionDebugger(config_path=os.path.abspath("config.json"))
    debugger.start(model)
    loss = F.cross_entropy(model(tokens), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    debugger.stop()
    debugger.step()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver
def _dir_bytes(root: Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in root.rglob(f"*{suffix}") if p.is_file())


def _count_rows(doc: dict) -> int:
    def walk(v) -> int:
        if v is None:
            return 1
        if isinstance(v, dict):
            return 1 if "type" in v else sum(walk(x) for x in v.values())
        if isinstance(v, list):
            return sum(walk(x) for x in v)
        return 1

    return sum(walk(val) for rec in doc["data"].values() for sec, val in rec.items() if sec != "is_recompute")


def _expected_first(ref_rank: Path, fault_param: str) -> str:
    """The Functional.linear forward record inside the Linear module that owns the scaled weight."""
    construct = json.loads((ref_rank / "construct.json").read_text())
    module_path = fault_param.rsplit(".", 1)[0]  # layers.100.fc1
    parent = f"Module.{module_path}.Linear.forward.0"
    hits = [
        k
        for k, v in construct.items()
        if k.startswith("Functional.linear.")
        and k.endswith(".forward")
        and (v[0] if isinstance(v, list) else v) == parent
    ]
    if len(hits) != 1:
        raise SystemExit(f"cannot find the linear inside {parent} in construct.json: {hits}")
    return hits[0]


def generate_case(name: str, out: Path, quick: bool = False, force: bool = False, log=print) -> Path:
    """Make (or reuse) the ref/target dumps of one case; returns the case folder."""
    cdir = case_dir(out, name, quick)
    manifest = cdir / "manifest.json"
    settings = case_settings(name, quick)
    if manifest.is_file() and not force:
        m = json.loads(manifest.read_text())
        if m.get("settings") == settings and all(
            (cdir / s / "step0" / "rank0" / "dump.json").is_file() for s in ("ref", "target")
        ):
            log(f"real dumps {cdir.name}: cached ({m['rows_per_side']} rows per side)")
            return cdir
    if cdir.exists():
        shutil.rmtree(cdir)
    cdir.mkdir(parents=True)
    t0 = time.perf_counter()
    for side in ("ref", "target"):
        scratch = Path(tempfile.mkdtemp(prefix="dumpstore_bench_"))
        try:
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--_train",
                json.dumps(settings),
                "--_side",
                side,
                "--_dump",
                str(cdir / side),
            ]
            res = subprocess.run(
                cmd, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
            )
            if res.returncode != 0:
                raise SystemExit(f"msprobe dump of {name}/{side} failed (exit {res.returncode}):\n{res.stdout[-3000:]}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    ref_rank = cdir / "ref" / "step0" / "rank0"
    doc = json.loads((ref_rank / "dump.json").read_text())
    info = {
        "case": name,
        "quick": quick,
        "settings": settings,
        "records_per_side": len(doc["data"]),
        "rows_per_side": _count_rows(doc),
        "dump_json_bytes_per_side": (ref_rank / "dump.json").stat().st_size,
        "pt_bytes_per_side": _dir_bytes(cdir / "ref", ".pt"),
        "pt_files_per_side": sum(1 for _ in (cdir / "ref").rglob("*.pt")),
        "fault": f"{settings['fault_param']} x {FAULT_SCALE} before step 0",
        "expected": {
            "step": 0,
            "rank": 0,
            "first_divergence_op": _expected_first(ref_rank, settings["fault_param"]),
            "culprit_kind": "parameter",
        },
        "generated_s": round(time.perf_counter() - t0, 1),
        "msprobe_step_dir": {"ref": str(cdir / "ref" / "step0"), "target": str(cdir / "target" / "step0")},
    }
    manifest.write_text(json.dumps(info, indent=1))
    log(
        f"real dumps {cdir.name}: generated in {info['generated_s']} s ({info['records_per_side']} records, "
        f"{info['rows_per_side']} rows, {info['pt_bytes_per_side'] / 1e6:.1f} MB .pt per side)"
    )
    return cdir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", default="stats,tensor", help="comma-separated cases: stats, tensor")
    ap.add_argument("--quick", action="store_true", help="small versions (20 / 5 layers)")
    ap.add_argument("--force", action="store_true", help="regenerate even when cached")
    ap.add_argument("--_train", help=argparse.SUPPRESS)
    ap.add_argument("--_side", help=argparse.SUPPRESS)
    ap.add_argument("--_dump", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._train:
        _train(json.loads(args._train), args._side, args._dump)
        return
    for name in [c for c in args.only.split(",") if c]:
        if name not in CASES:
            ap.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
        generate_case(name, args.out, quick=args.quick, force=args.force)


if __name__ == "__main__":
    main()

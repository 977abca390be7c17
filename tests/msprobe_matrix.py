"""Real msprobe 26.2.0 dumps of one small network under many dump configurations, for the cell-for-cell test
against `msprobe compare` (tests/test_msprobe_cells.py).

    .venv/bin/python tests/msprobe_matrix.py OUT [--jobs 2] [RUN ...]

Every run trains a three-block MLP one SGD step on CPU (fixed seeds, one thread) under msprobe's
`PrecisionDebugger` in its own subprocess (the debugger is a process-wide singleton) and leaves msprobe's own
files in OUT/{run}/ (`step0/{rank}/dump.json`, `stack.json`, `construct.json`, `dump_tensor_data/`).  A run is a
configuration (task, level, data_mode, scope, list) and a variant of the network:

    ref       the reference network
    w1pct     block 1's fc2 weight scaled by 1.01
    extra     an extra `F.gelu` call in block 1 (its result used): later gelu calls renumber, forward and backward
    missing   block 0 without its `F.gelu`: the later calls renumber the other way

PAIRS names (target run, reference run); every pair is a real `msprobe compare -tp target -gp ref`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# configuration -> msprobe config (task, level, data_mode, scope, list, summary_mode)
CONFIGS: dict[str, dict] = {
    "stats_mix": {"task": "statistics", "level": "mix"},
    "stats_L0": {"task": "statistics", "level": "L0"},
    "stats_L1": {"task": "statistics", "level": "L1"},
    "stats_fwd": {"task": "statistics", "level": "mix", "data_mode": ["forward"]},
    "stats_bwd": {"task": "statistics", "level": "mix", "data_mode": ["backward"]},
    "stats_list": {"task": "statistics", "level": "L1", "list": ["gelu", "linear"]},
    "stats_modlist": {"task": "statistics", "level": "mix", "list": ["layers.1"]},
    "stats_scope": {
        "task": "statistics",
        "level": "L0",
        "scope": ["Module.layers.1.Block.forward.0", "Module.head.Linear.forward.0"],
    },
    "stats_apiscope": {
        "task": "statistics",
        "level": "L1",
        "scope": ["Functional.linear.1.forward", "Functional.linear.4.forward"],
    },
    "md5_mix": {"task": "statistics", "level": "mix", "summary_mode": "md5"},
    "md5_L1": {"task": "statistics", "level": "L1", "summary_mode": "md5"},
    "tensor_L1": {"task": "tensor", "level": "L1"},
    "tensor_mix": {"task": "tensor", "level": "mix"},
    "tensor_L0": {"task": "tensor", "level": "L0"},
}
VARIANTS = ("ref", "w1pct", "extra", "missing")
# pair -> (target run, reference run); a run is "{config}-{variant}"
PAIRS: dict[str, tuple[str, str]] = {
    "stats_mix_w1pct": ("stats_mix-w1pct", "stats_mix-ref"),
    "stats_mix_extra": ("stats_mix-extra", "stats_mix-ref"),
    "stats_mix_missing": ("stats_mix-missing", "stats_mix-ref"),
    "stats_L0_w1pct": ("stats_L0-w1pct", "stats_L0-ref"),
    "stats_L0_extra": ("stats_L0-extra", "stats_L0-ref"),
    "stats_L1_extra": ("stats_L1-extra", "stats_L1-ref"),
    "stats_L1_missing": ("stats_L1-missing", "stats_L1-ref"),
    "stats_fwd_extra": ("stats_fwd-extra", "stats_fwd-ref"),
    "stats_bwd_extra": ("stats_bwd-extra", "stats_bwd-ref"),
    "stats_bwd_missing": ("stats_bwd-missing", "stats_bwd-ref"),
    "stats_list_extra": ("stats_list-extra", "stats_list-ref"),
    "stats_modlist_w1pct": ("stats_modlist-w1pct", "stats_modlist-ref"),
    "stats_scope_extra": ("stats_scope-extra", "stats_scope-ref"),
    "stats_apiscope_missing": ("stats_apiscope-missing", "stats_apiscope-ref"),
    "md5_mix_w1pct": ("md5_mix-w1pct", "md5_mix-ref"),
    "md5_L1_extra": ("md5_L1-extra", "md5_L1-ref"),
    "tensor_L1_missing": ("tensor_L1-missing", "tensor_L1-ref"),
    "md5_mix_extra": ("md5_mix-extra", "md5_mix-ref"),
    "md5_mix_missing": ("md5_mix-missing", "md5_mix-ref"),
    "tensor_mix_w1pct": ("tensor_mix-w1pct", "tensor_mix-ref"),
    "tensor_mix_extra": ("tensor_mix-extra", "tensor_mix-ref"),
    "tensor_mix_missing": ("tensor_mix-missing", "tensor_mix-ref"),
    "tensor_L0_extra": ("tensor_L0-extra", "tensor_L0-ref"),
}
DIM, HIDDEN, BLOCKS, BATCH = 8, 16, 3, 4


def runs() -> list[str]:
    """Every run the pairs need, each once."""
    return sorted({run for pair in PAIRS.values() for run in pair})


def build(variant: str):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, idx: int):
            super().__init__()
            self.idx = idx
            self.fc1 = nn.Linear(DIM, HIDDEN)
            self.fc2 = nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            h = self.fc1(x)
            if not (variant == "missing" and self.idx == 0):
                h = F.gelu(h)
            if variant == "extra" and self.idx == 1:
                h = F.gelu(h)
            return x + self.fc2(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(i) for i in range(BLOCKS)])
            self.head = nn.Linear(DIM, 4)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    net = Net()
    if variant == "w1pct":
        with torch.no_grad():
            net.layers[1].fc2.weight.mul_(1.01)
    return net


def run_one(run: str, out: Path) -> None:
    """One run in this process (call it in a fresh one): msprobe's dump of one training step under `run`'s config."""
    import torch
    import torch.nn.functional as F

    config_name, variant = run.split("-")
    cfg = CONFIGS[config_name]
    task = cfg["task"]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    from msprobe.pytorch import PrecisionDebugger

    out.mkdir(parents=True, exist_ok=True)
    options = {"scope": cfg.get("scope", []), "list": cfg.get("list", []), "data_mode": cfg.get("data_mode", ["all"])}
    if task == "statistics":
        options["summary_mode"] = cfg.get("summary_mode", "statistics")
    config = {"task": task, "dump_path": str(out / run), "rank": [], "step": [0], "level": cfg["level"], task: options}
    config_path = out / f"config_{run}.json"
    config_path.write_text(json.dumps(config, indent=1))
    net = build(variant)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    debugger = PrecisionDebugger(config_path=str(config_path))
    debugger.start(net)
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    debugger.stop()
    debugger.step()


def generate(out: Path, names: list[str], jobs: int = 2) -> None:
    """Make the runs `names` under `out` (each in its own subprocess, `jobs` at a time); a run whose dump.json is
    there already is kept."""
    todo = [n for n in names if not any((out / n).rglob("dump.json"))]
    pending: list[tuple[str, subprocess.Popen]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    failed = []
    while todo or pending:
        while todo and len(pending) < jobs:
            n = todo.pop(0)
            log = out / f"log_{n}.txt"
            out.mkdir(parents=True, exist_ok=True)
            with open(log, "wb") as fh:
                cmd = [sys.executable, __file__, str(out), "--one", n]
                pending.append((n, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=out)))
        n, p = pending.pop(0)
        if p.wait(timeout=600) != 0:
            failed.append(n)
    if failed:
        tails = {n: (out / f"log_{n}.txt").read_text(errors="replace")[-1500:] for n in failed}
        raise RuntimeError(f"msprobe runs failed: {tails}")


def dump_json(out: Path, run: str) -> Path:
    """The run's dump.json (msprobe writes {dump_path}/step0/{rank}/dump.json)."""
    return next((out / run).rglob("dump.json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="*", help="runs to make (default: all the pairs need)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        run_one(a.one, a.out.resolve())
        return 0
    generate(a.out.resolve(), a.runs or runs(), a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

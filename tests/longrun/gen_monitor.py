"""Real msprobe monitor output, training logs and TensorBoard events from a small MLP trained on CPU.

Run: python tests/longrun/gen_monitor.py OUT_DIR [--steps N] [--fault-step K]
Writes (OUT_DIR is git-ignored; tests make it with a session fixture):
  ref/        clean run: monitor/ (TrainerMon CSV: grad_unreduced, grad_reduced, exp_avg, exp_avg_sq),
              train.log (Megatron lines), tb/ (TensorBoard events: lm loss, grad-norm, learning-rate)
  ref2/       the same run again (CPU: bit-identical, a clean rerun)
  drift/      from --fault-step on, the gradient of layers.2.weight is rounded to bfloat16 (one layer's
              precision) before the optimizer step: its gradient moves first, the loss only later
  scaled/     from --fault-step on, the gradient of layers.2.weight is 5 % too large (a wrong unscale of one
              bucket): its gradient moves at --fault-step, the loss a few steps later; with msprobe's anomaly
              detection on (AnomalyTurbulence, threshold 0.5, dumped: monitor/anomaly_detected/rank0/anomaly.json)
  allprefix/  a short run with every TrainerMon prefix (actv, actv_grad, param_origin, param_updated, ...)
  v2/         a short run of monitor_v2 (TrainerMonitorV2: rank_0/<slug>_step<a>-<b>.csv)
The answers by construction: drift's and scaled's first divergent parameter is layers.2.weight at --fault-step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

OPS = ["norm", "min", "max", "zeros", "nans", "mean"]


def _model(torch):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                [torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)]
            )

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.tanh(x)
            return x

    return Net()


def _train(
    torch, out: Path, cfg: dict, steps: int, fault_step: int | None, *, v2: bool = False, scale: float | None = None
) -> None:
    from msprobe.pytorch import TrainerMon

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = _model(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg_path = out / "monitor_config.json"
    cfg_path.write_text(json.dumps(cfg))
    if v2:
        from msprobe.core.monitor_v2 import TrainerMonitorV2

        (out / "monitor").mkdir(exist_ok=True)
        cfg = dict(cfg, output_dir=str(out / "monitor"))
        cfg_path.write_text(json.dumps(cfg))
        mon = TrainerMonitorV2(str(cfg_path), fr="pytorch")
        mon.start(model=model, optimizer=opt)
    else:
        os.environ["MONITOR_OUTPUT_DIR"] = str(out / "monitor")
        mon = TrainerMon(str(cfg_path), params_have_main_grad=False)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(16, 1, generator=gen)
    target_w = model.layers[2].weight
    log = []
    tb = None
    if not v2:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(out / "tb"))
    for it in range(steps):
        x = torch.randn(64, 16, generator=gen)
        y = torch.tanh(x @ w_true) + 0.05 * torch.randn(64, 1, generator=gen)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if fault_step is not None and it >= fault_step:
            if scale is None:
                target_w.grad.copy_(target_w.grad.to(torch.bfloat16).to(torch.float32))
            else:
                target_w.grad.mul_(scale)
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        opt.step()
        lr = opt.param_groups[0]["lr"]
        log.append(
            f" [2026-12-07 02:00:00] iteration {it + 1:8d}/{steps:8d} | consumed samples: {64 * (it + 1):12d} | "
            f"elapsed time per iteration (ms): 12.3 | learning rate: {lr:.6E} | global batch size:    64 | "
            f"lm loss: {float(loss):.6E} | loss scale: 1.0 | grad norm: {gnorm:.3f} | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |"
        )
        if tb is not None:
            tb.add_scalar("lm loss", float(loss), it + 1)
            tb.add_scalar("grad-norm", gnorm, it + 1)
            tb.add_scalar("learning-rate", lr, it + 1)
    if v2:
        mon.stop()
    if tb is not None:
        tb.close()
    (out / "train.log").write_text("\n".join(log) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--fault-step", type=int, default=60)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import msprobe.pytorch.monitor.module_hook as hook
    import torch

    # The toy model has no activation recomputation; msprobe's check for it walks the Python stack with
    # inspect.stack() on every module call (50 ms each). Its answer here is always False.
    hook.is_recomputation = lambda: False
    torch.set_num_threads(1)
    base = {"targets": {}, "ops": OPS, "format": "csv", "step_count_per_record": 50}
    grads = dict(base, wg_distribution=True, mv_distribution=True)
    _train(torch, args.out / "ref", grads, args.steps, None)
    _train(torch, args.out / "ref2", grads, args.steps, None)
    _train(torch, args.out / "drift", grads, args.steps, args.fault_step)
    alert = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}
    _train(torch, args.out / "scaled", dict(grads, alert=alert), args.steps, args.fault_step, scale=1.05)
    every = dict(base, xy_distribution=True, all_xy=True, param_distribution=True, step_count_per_record=4)
    _train(torch, args.out / "allprefix", dict(every, wg_distribution=True, mv_distribution=True), 6, None)
    v2 = {
        "framework": "pytorch",
        "step_count_per_record": 4,
        "monitors": {
            "module": {"enabled": True, "targets": [], "ops": ["min", "max", "mean", "norm", "nans"]},
            "weight_grad": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans"]},
            "param": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans"]},
        },
    }
    _train(torch, args.out / "v2", v2, 6, None, v2=True)
    (args.out / ".complete").write_text("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def ensure(base: Path | None = None, timeout: float = 300.0) -> Path:
    """The generated runs, made once per version of this script (tests/.data/longrun/<hash>, git-ignored):
    a subprocess runs main() into a temporary folder renamed into place when complete."""
    import hashlib
    import shutil
    import subprocess
    import tempfile

    base = base or Path(__file__).resolve().parents[1] / ".data" / "longrun"
    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    out = base / key
    if (out / ".complete").exists():
        return out
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=base))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, __file__, str(tmp)], check=True, env=env, timeout=timeout, capture_output=True, cwd=tmp
    )
    try:
        tmp.rename(out)
    except OSError:  # made meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    for old in base.iterdir():  # what earlier versions of this script made
        if old.name != key and not old.name.startswith(".") and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return out

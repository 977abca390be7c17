"""Training curves with answers by construction: SGD with Adam-free momentum on a noisy linear regression in
numpy, logged as Megatron lines. The data order comes from `data_seed` (a clean rerun with another order: a
different `data_seed`), the faults are set by the arguments."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def sgd_run(
    steps: int = 4000,
    *,
    data_seed: int = 0,
    lr: float = 0.02,
    lr_factor_from: tuple[int, float] | None = None,
    spike_at: int | None = None,
    dim: int = 32,
    batch: int = 16,
) -> dict[str, np.ndarray]:
    """Per step (1-based): loss, lr, grad_norm, loss_scale of SGD on y = X w* + noise from a fixed init."""
    init = np.random.default_rng(1234)
    w_true = init.normal(size=dim)
    w = np.zeros(dim)
    rng = np.random.default_rng(data_seed)
    out = {k: np.empty(steps) for k in ("loss", "lr", "grad_norm", "loss_scale")}
    warm = steps // 20
    for it in range(steps):
        x = rng.normal(size=(batch, dim))
        y = x @ w_true + 0.5 * rng.normal(size=batch)
        err = x @ w - y
        loss = float(err @ err / batch)
        g = 2 * x.T @ err / batch
        cur = lr * min(1.0, (it + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / steps)))
        if lr_factor_from is not None and it + 1 >= lr_factor_from[0]:
            cur *= lr_factor_from[1]
        if spike_at is not None and it + 1 == spike_at:
            loss *= 40.0
        w -= cur * g
        out["loss"][it], out["lr"][it], out["grad_norm"][it] = loss, cur, float(np.linalg.norm(g))
        out["loss_scale"][it] = 65536.0
    return out


def megatron_log(path: Path, run: dict[str, np.ndarray], gbs: int = 16) -> Path:
    lines = []
    n = len(run["loss"])
    for i in range(n):
        lines.append(
            f" iteration {i + 1:8d}/{n:8d} | consumed samples: {gbs * (i + 1):12d} | elapsed time per iteration "
            f"(ms): 100.0 | learning rate: {run['lr'][i]:.6E} | global batch size: {gbs:5d} | lm loss: "
            f"{run['loss'][i]:.6E} | loss scale: {run['loss_scale'][i]:.1f} | grad norm: {run['grad_norm'][i]:.3f} "
            "| number of skipped iterations:   0 | number of nan iterations:   0 |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path

"""The ratio replay gives a mean over n bf16 values accumulated in bf16 (docs/replay.md, limits of the method).

Usage: python bench/replay_bf16_mean.py  (prints n and the ratio; fails above 2)
"""

import torch

from dumpstore.analysis.replay.standards import rel_l2_floor


def rel(a: torch.Tensor, g: torch.Tensor) -> float:
    return ((a.double() - g).norm() / g.norm()).item()


torch.manual_seed(0)
for n in (16, 64, 256):
    x = torch.randn(4, n, 64).bfloat16()
    g = x.double().mean(1)
    acc = x[:, 0]
    for i in range(1, n):
        acc = acc + x[:, i]  # bf16 accumulation, one rounding per add
    print(n, round(rel(acc / n, g) / max(rel(x.mean(1), g), rel_l2_floor("bfloat16", g.numel())), 2))

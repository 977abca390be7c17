"""The network of tests/msgraph/generate.py in PyTorch, dumped by msprobe: the PyTorch side of a graph-mode-against-
PyTorch pair (module granularity).

    python tests/msgraph/generate_torch.py OUT [--level L0|mix] [--task statistics|tensor]

Same layers, names and initial weights as the MindSpore script (the same numpy draws, in the order of MindSpore's
`trainable_params()`, which is the order of `named_parameters()` here), MindSpore's defaults where they differ
from PyTorch's (LayerNorm epsilon 1e-7, GELU's tanh approximation), trained the same two SGD steps with MSE loss;
msprobe dumps steps 0 and 1 into OUT/step{0,1}/{rank}/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--level", choices=("L0", "mix"), default="L0")
    ap.add_argument("--task", choices=("statistics", "tensor"), default="statistics")
    args = ap.parse_args()
    out = Path(args.out).resolve()

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.ln = nn.LayerNorm(d, eps=1e-7)  # MindSpore's nn.LayerNorm default
            self.fc1 = nn.Linear(d, 2 * d)
            self.act = nn.GELU(approximate="tanh")  # MindSpore's nn.GELU() default
            self.fc2 = nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(self.ln(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.b0 = Block(8)
            self.b1 = Block(8)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.b1(self.b0(x)))

    net = Net()
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for _name, p in net.named_parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32) * 0.3))
    x = torch.from_numpy(rng.standard_normal((2, 8)).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((2, 4)).astype(np.float32))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    from msprobe.pytorch import PrecisionDebugger

    out.mkdir(parents=True, exist_ok=True)
    options = {"scope": [], "list": [], "data_mode": ["all"]}
    if args.task == "statistics":
        options["summary_mode"] = "statistics"
    config = {"task": args.task, "dump_path": str(out), "rank": [], "step": [0, 1], "level": args.level}
    config[args.task] = options
    config_path = out.with_name(out.name + ".msprobe_config.json")
    config_path.write_text(json.dumps(config))
    debugger = PrecisionDebugger(config_path=str(config_path))
    for _ in range(2):
        debugger.start(net)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()
    config_path.unlink()


if __name__ == "__main__":
    main()

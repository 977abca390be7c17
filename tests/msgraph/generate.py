"""Make a MindSpore graph-mode kernel dump (MINDSPORE_DUMP_CONFIG, tensor .npy) of a small network on CPU.

    python tests/msgraph/generate.py OUT [--fault gelu|weight]

Two blocks (LayerNorm, Dense, GELU, Dense, residual) and a head, trained two SGD steps with MSE loss; fixed
seeds, so two runs without a fault give identical dumps.  Faults: `gelu` makes the second block's GELU exact
(erf) where the reference uses the tanh approximation; `weight` scales the second block's fc1 weight by 1.01.
The dump lies in OUT/rank_0/Net/0/{0,1}/ with execution_order/ and graphs/ beside (MindSpore 2.10).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fault", choices=("gelu", "weight"), default=None)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    config = out.with_name(out.name + ".dump_config.json")
    settings = {
        "dump_mode": 0,
        "path": str(out),
        "net_name": "Net",
        "iteration": "all",
        "saved_data": "tensor",
        "input_output": 0,
        "kernels": [],
        "support_device": [0, 1, 2, 3, 4, 5, 6, 7],
        "op_debug_mode": 0,
        "file_format": "npy",
    }
    config.write_text(json.dumps({"common_dump_settings": settings, "e2e_dump_settings": {"enable": True}}))
    os.environ["MINDSPORE_DUMP_CONFIG"] = str(config)
    os.environ.setdefault("GLOG_v", "3")  # errors only

    import mindspore as ms
    import numpy as np
    from mindspore import nn

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)

    class Block(nn.Cell):
        def __init__(self, d: int, approximate: bool):
            super().__init__()
            self.ln = nn.LayerNorm((d,))
            self.fc1 = nn.Dense(d, 2 * d)
            self.act = nn.GELU(approximate=approximate)
            self.fc2 = nn.Dense(2 * d, d)

        def construct(self, x):
            return x + self.fc2(self.act(self.fc1(self.ln(x))))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.b0 = Block(8, True)
            self.b1 = Block(8, args.fault != "gelu")
            self.head = nn.Dense(8, 4)

        def construct(self, x):
            return self.head(self.b1(self.b0(x)))

    net = Net()
    rng = np.random.default_rng(0)
    for p in net.trainable_params():
        value = rng.standard_normal(p.shape).astype(np.float32) * 0.3
        if args.fault == "weight" and p.name == "b1.fc1.weight":
            value = value * np.float32(1.01)
        p.set_data(ms.Tensor(value))
    x = ms.Tensor(rng.standard_normal((2, 8)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((2, 4)).astype(np.float32))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.1))
    for _ in range(2):
        step(x, y)
    config.unlink()


if __name__ == "__main__":
    main()

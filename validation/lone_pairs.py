"""Pairs of one call computed at a lower precision in an fp32 model, to check analysis/lone_precision.py on
families other than set 6's ConvNeXt (development data: not a validation set; nothing is tuned on it).

    .venv/bin/python validation/lone_pairs.py OUT          # writes OUT/{stats,tensor}/<case>_{ref,target} + key.json
    .venv/bin/python validation/score.py --data OUT --compare-top 10

Families (fp32 weights and compute, AdamW lr 1e-3, 3 steps, one micro-batch each, msprobe level mix):
  tf   a pre-LayerNorm transformer LM written with torch.nn (2 layers, hidden 32, 4 heads, MLP 64, GELU; 16
       tokens, batch 2, vocab 64; next-token cross-entropy);
  cnn  a small CNN (four 3x3 convolutions 8-8-16-16 channels, the third of stride 2, each followed by GroupNorm
       and ReLU; global average pooling, a linear classifier of 10 classes; 4 images of 3x12x12).
Every target runs on set 6's device Y (validation/v6/devices.py: GELU's erf by a rational approximation,
LayerNorm's epilogue as one fused multiply-add, cross-entropy with a log1p log-sum-exp, nrm2 norms), the
reference is the stock fp32 run. Cases (the target's difference besides its device):
  tf_fc1_bf16_L1      layer 1's MLP up-projection (nn.Linear) under a bfloat16 autocast region, its output upcast;
  tf_scores_bf16_L0   layer 0's attention scores q @ k^T (torch.matmul) under a bfloat16 autocast region;
  tf_ln_fp16_L1       layer 1's second LayerNorm on float16 copies of its input and parameters, its output upcast;
  tf_clean_linear     every Linear under bfloat16 autocast (a device's policy for the op class): clean;
  cnn_conv_bf16_L2    the third convolution under a bfloat16 autocast region, its output upcast;
  cnn_clean_conv      every convolution under bfloat16 autocast (the class's policy): clean;
  tf_clean, cnn_clean the device alone: clean;
  tf_fc1_inner_bf16_L1  layer 1's MLP up-projection computed by a kernel that casts its inputs to bfloat16 and
                      its output back to float32 inside the recorded call (F.linear patched before msprobe wraps
                      it, as a device's kernel): the record shows float32 only, with a bfloat16-sized error.
The key names the faulty call's msprobe record at step 0 (the API's call counter read from the dump, first
micro-batch), in validation/score.py's format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    """A module of this folder by its path (validation/ is not put on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_pairs = _load("validation_make_pairs", HERE / "make_pairs.py")
STEPS = make_pairs.STEPS
INNER = [False]  # the inner-bf16 kernel's switch: on around the faulty call only


def inner_linear(stock):
    """F.linear whose kernel computes in bfloat16 and returns float32 while INNER is on."""

    def linear(input, weight, bias=None):
        if INNER[0]:
            low = stock(input.bfloat16(), weight.bfloat16(), None if bias is None else bias.bfloat16())
            return low.float()
        return stock(input, weight, bias)

    return linear


CASES = {
    "tf_fc1_bf16_L1": ("tf", {"kind": "fc1_bf16", "layer": 1}),
    "tf_scores_bf16_L0": ("tf", {"kind": "scores_bf16", "layer": 0}),
    "tf_ln_fp16_L1": ("tf", {"kind": "ln_fp16", "layer": 1}),
    "tf_clean_linear": ("tf", {"kind": "all_linear_bf16", "clean": True}),
    "cnn_conv_bf16_L2": ("cnn", {"kind": "conv_bf16", "layer": 2}),
    "cnn_clean_conv": ("cnn", {"kind": "all_conv_bf16", "clean": True}),
    "tf_clean": ("tf", {"kind": "none", "clean": True}),
    "tf_fc1_inner_bf16_L1": ("tf", {"kind": "fc1_inner_bf16", "layer": 1}),
    "cnn_clean": ("cnn", {"kind": "none", "clean": True}),
}
DEVICE = "Y"
# the faulty call: (API record prefix, its index among that API's calls in the first forward)
EXPECT = {
    "fc1_bf16": lambda f: ("Functional.linear", 4 * f["layer"] + 2),  # qkv, out, fc1, fc2 per layer
    "fc1_inner_bf16": lambda f: ("Functional.linear", 4 * f["layer"] + 2),
    "scores_bf16": lambda f: ("Torch.matmul", 2 * f["layer"]),  # scores, then probabilities @ v
    "ln_fp16": lambda f: ("Functional.layer_norm", 2 * f["layer"] + 1),  # ln1, ln2 per layer
    "conv_bf16": lambda f: ("Functional.conv2d", f["layer"]),
}


def build(family: str, fault: dict | None):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    kind = fault["kind"] if fault else None
    low = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731

    if family == "tf":
        H, NH, V = 32, 4, 64

        class Block(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.i = i
                self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
                self.qkv, self.out = nn.Linear(H, 3 * H), nn.Linear(H, H)
                self.fc1, self.fc2 = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

            def lin(self, m, x, name):
                if kind == "fc1_inner_bf16" and name == "fc1" and fault["layer"] == self.i:
                    INNER[0] = True
                    try:
                        return m(x)
                    finally:
                        INNER[0] = False
                if kind == "all_linear_bf16" or (kind == "fc1_bf16" and name == "fc1" and fault["layer"] == self.i):
                    with low():
                        return m(x).float()
                return m(x)

            def forward(self, x):
                B, T, _ = x.shape
                q, k, v = self.lin(self.qkv, self.ln1(x), "qkv").split(H, dim=-1)
                q, k, v = (t.reshape(B, T, NH, H // NH).transpose(1, 2) for t in (q, k, v))
                if kind == "scores_bf16" and fault["layer"] == self.i:
                    with low():
                        s = torch.matmul(q, k.transpose(-1, -2)).float()
                else:
                    s = torch.matmul(q, k.transpose(-1, -2))
                mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
                p = F.softmax((s / (H // NH) ** 0.5).masked_fill(mask, float("-inf")), dim=-1)
                a = torch.matmul(p, v).transpose(1, 2).reshape(B, T, H)
                x = x + self.lin(self.out, a, "out")
                if kind == "ln_fp16" and fault["layer"] == self.i:
                    h = F.layer_norm(x.half(), (H,), self.ln2.weight.half(), self.ln2.bias.half()).float()
                else:
                    h = self.ln2(x)
                return x + self.lin(self.fc2, F.gelu(self.lin(self.fc1, h, "fc1")), "fc2")

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(V, H)
                self.blocks = nn.ModuleList([Block(0), Block(1)])
                self.ln, self.head = nn.LayerNorm(H), nn.Linear(H, V)

            def forward(self, ids):
                x = self.emb(ids)
                for b in self.blocks:
                    x = b(x)
                return self.head(self.ln(x))

        model = LM()
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(0, V, (2, 17), generator=g) for _ in range(STEPS)]

        def loss(batch):
            logits = model(batch[:, :-1])
            return F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))

        return model, data, loss

    chans = [3, 8, 8, 16, 16]

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(
                [nn.Conv2d(chans[i], chans[i + 1], 3, stride=2 if i == 2 else 1, padding=1) for i in range(4)]
            )
            self.norms = nn.ModuleList([nn.GroupNorm(4, chans[i + 1]) for i in range(4)])
            self.fc = nn.Linear(chans[-1], 10)

        def forward(self, x):
            for i, (c, n) in enumerate(zip(self.convs, self.norms)):
                if kind == "all_conv_bf16" or (kind == "conv_bf16" and fault["layer"] == i):
                    with low():
                        y = c(x).float()
                else:
                    y = c(x)
                x = F.relu(n(y))
            return self.fc(x.mean(dim=(2, 3)))

    model = CNN()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(STEPS)]

    def loss(batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    return model, data, loss


def run(job: dict) -> None:
    """One msprobe run (a fresh process: msprobe keeps global state)."""
    import torch
    from msprobe.pytorch import PrecisionDebugger

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out, mode = Path(job["out"]), job["mode"]
    scratch = out.parent / (out.name + "_scratch")
    scratch.mkdir(parents=True, exist_ok=True)
    os.chdir(scratch)
    if job["role"] == "target":  # the device's kernels installed before msprobe wraps the APIs (as the sets do)
        _load("validation_v6_devices", HERE / "v6" / "devices.py").DEVICES[DEVICE].install()
    if job["fault"] and job["fault"]["kind"] == "fc1_inner_bf16":
        import torch.nn.functional as F

        F.linear = inner_linear(F.linear)
    make_pairs.write_config(scratch / "config.json", out, mode)  # set 1's msprobe config (3 steps, level mix)
    model, data, loss_of = build(job["family"], job["fault"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    debugger = PrecisionDebugger(config_path=str(scratch / "config.json"))
    for step in range(STEPS):
        debugger.start(model)
        loss = loss_of(data[step])
        loss.backward()
        debugger.stop()
        opt.step()
        opt.zero_grad()
        debugger.step()


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--job":
        run(json.loads(argv[1]))
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    out = Path(argv[0]).resolve()
    key: dict = {"cases": {}}
    jobs = []
    for mode in ("stats", "tensor"):
        for family in ("tf", "cnn"):
            job = {
                "family": family,
                "fault": None,
                "mode": mode,
                "role": "ref",
                "out": str(out / mode / f"{family}_ref"),
            }
            jobs.append(job)
        for case, (family, fault) in CASES.items():
            target = str(out / mode / f"{case}_target")
            jobs.append({"family": family, "fault": fault, "mode": mode, "role": "target", "out": target})
            expect = {"clean": True}
            if not fault.get("clean"):
                api, n = EXPECT[fault["kind"]](fault)
                expect = {"step": 0, "ops": [f"{api}.{n}.forward"], "modules": []}
            key["cases"][f"{case}_{mode}"] = {
                "case": case,
                "mode": mode,
                "family": family,
                "device": DEVICE,
                "ref": f"{mode}/{family}_ref",
                "target": f"{mode}/{case}_target",
                "expect": expect,
            }
    for job in jobs:
        if not Path(job["out"]).exists():
            subprocess.run([sys.executable, __file__, "--job", json.dumps(job)], check=True)
    (out / "key.json").write_text(json.dumps(key, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

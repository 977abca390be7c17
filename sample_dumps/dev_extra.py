#!/usr/bin/env python
"""Extra development pairs for the noise model (issue 23): other device noise and other fault classes.

Usage::

    /path/to/venv/bin/python sample_dumps/dev_extra.py                 # all cases into sample_dumps/dev_extra/
    /path/to/venv/bin/python sample_dumps/dev_extra.py --cases dx_ref_stats,dx_clean_stats
    /path/to/venv/bin/python sample_dumps/dev_extra.py --out DIR

The data is git-ignored (`sample_dumps/dev_extra/`): only this script is committed.  It writes
`dev_extra/catalog.json` in the form of `device_noise_cases` of sample_dumps/catalog.json, which
`measure_noise.py --dev-extra` scores.  These pairs are the DEVELOPMENT set the noise model's constants are
chosen on, with the `xdev_*` pairs of catalog.json; no held-out pair is made here.

Families (each runs msprobe 26.2.0 in its own subprocess, as generate.py does, 3 steps in both dump modes
(an optimizer fault from the second update shows at step 2); the same data batches, seed 0):

  dx_*  a 2-layer GPT-style model in fp32 (no autocast) with a Llama-like causal mask
        (`torch.where(mask, finfo.min, scores)`) and SGD with momentum.  The target ("device T") runs every fp32
        mm/addmm/bmm with its inputs rounded to 10 mantissa bits (TF32 / HF32), forward and backward.
  xb_*  generate.py's cross-device bf16 model (AdamW, device B's split bf16 reductions), with an optimizer fault.

Faults (the catalog's `expected.culprit`, checked by hand on the dumps: the op names are deterministic):
  dx_clean       none: TF32 matmuls only
  dx_router      none: a top-1 router in layer 0 whose two experts' scores are near-tied for every token
                 (TF32 noise may flip a token's choice: noise, not a culprit)
  dx_lr1pct      SGD learning rate x1.01 from the second update on (seen at step 2)
  dx_clip        gradients clipped to norm 0.5 before every update (the reference does not clip)
  dx_extra_mul   one extra in-place `h.mul_(1.02)` on layer 1's ln2 output, feeding fc1 (a parameterised op)
  dx_gelu_tanh   layer 1's F.gelu with approximate='tanh'
  dx_weight1pct  layers.1.fc2.weight x1.01 at init
  xb_lr5pct      AdamW learning rate x1.05 from the second update on, bf16 (seen at step 2)
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import generate as G  # noqa: E402  (the sample generator: msprobe config, batches, device B's kernels)

D_MODEL, HIDDEN, VOCAB = 32, 64, 16
DX_LR, DX_MOMENTUM = 0.05, 0.9
STEPS = {"statistics": 3, "tensor": 3}
DEVICE_T = {"tf32": True}
DEVICE_B = G.XDEV_B1

# name stem -> (faults, expected culprit or None, description); steps are filled per mode
DX = {
    "clean": ({}, None, "no fault: TF32 matmuls only"),
    "router": ({"router": True}, None, "no fault: near-tied top-1 router in layer 0"),
    "lr1pct": (
        {"lr_from_2nd": 1.01},
        (2, "Functional.embedding.0.forward", "optimizer"),
        "SGD lr x1.01 from the 2nd update",
    ),
    "clip": ({"clip": 0.5}, (1, "Functional.embedding.0.forward", "optimizer"), "gradient norm clipped to 0.5"),
    "extra_mul": (
        {"extra_mul": [1]},
        (0, "Tensor.mul_.0.forward", "extra_op"),
        "extra h.mul_(1.02) before layer 1 fc1",
    ),
    "gelu_tanh": ({"gelu_tanh": [1]}, (0, "Functional.gelu.1.forward", "scalar"), "layer 1 gelu approximate='tanh'"),
    "weight1pct": (
        {"weight_scale": {"layers.1.fc2.weight": 1.01}},
        (0, "Functional.linear.11.forward", "parameter"),
        "layers.1.fc2.weight x1.01 at init",
    ),
}
XB = {
    "lr5pct": (
        {"lr_from_2nd": 1.05},
        (2, "Functional.embedding.0.forward", "optimizer"),
        "AdamW lr x1.05 from the 2nd update",
    ),
}
TENSOR = ("clean", "router", "lr1pct")


def cases():
    """(name, family, mode, ref, faults, expected, description) of every case, refs first."""
    out = []
    for mode, sfx in (("statistics", "stats"), ("tensor", "tensor")):
        out.append(("dx_ref_" + sfx, "dx", mode, None, {}, None, "device A: fp32 reference"))
        out.append(("dx_rref_" + sfx, "dx", mode, None, {"router": True}, None, "device A: fp32 reference, router"))
        for stem, (faults, exp, desc) in DX.items():
            if mode == "tensor" and stem not in TENSOR:
                continue
            f = dict(faults, device=DEVICE_T)
            ref = ("dx_rref_" if faults.get("router") else "dx_ref_") + sfx
            out.append(("dx_%s_%s" % (stem, sfx), "dx", mode, ref, f, exp, "device T (TF32): " + desc))
    out.append(("xb_ref_stats", "xb", "statistics", None, {}, None, "device A: bf16 autocast reference"))
    for stem, (faults, exp, desc) in XB.items():
        f = dict(faults, device=DEVICE_B)
        out.append(("xb_%s_stats" % stem, "xb", "statistics", "xb_ref_stats", f, exp, "device B (bf16): " + desc))
    return out


CASE = {c[0]: c for c in cases()}


# ---------------------------------------------------------------------------------------------- the job
def tf32_kernels():
    """Device T: a TorchDispatchMode running fp32 mm/addmm/bmm with both inputs rounded to 10 mantissa bits
    (round half away from zero on the bit pattern), as TF32 / HF32 tensor cores do; accumulation stays fp32."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten, f32 = torch.ops.aten, torch.float32

    def cut(x):  # only aten calls: Python-level tensor methods would be recorded by msprobe's hooks
        if x.dtype != f32:
            return x
        bits = aten.view.dtype(aten.clone.default(x), torch.int32)
        bits = aten.bitwise_and.Scalar(aten.add.Tensor(bits, 1 << 12), -(1 << 13))
        return aten.view.dtype(bits, f32)

    class DeviceT(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (aten.mm.default, aten.bmm.default):
                return func(cut(args[0]), cut(args[1]), **kwargs)
            if func is aten.addmm.default:
                return func(args[0], cut(args[1]), cut(args[2]), **kwargs)
            return func(*args, **kwargs)

    return DeviceT()


def build_dx_model(faults):
    """fp32 2-layer GPT: biased q/k/v, Llama-like where-mask with finfo.min, LayerNorm, GELU; optional router."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, idx):
            super().__init__()
            self.idx = idx
            self.ln1 = nn.LayerNorm(D_MODEL)
            self.wq, self.wk = nn.Linear(D_MODEL, D_MODEL), nn.Linear(D_MODEL, D_MODEL)
            self.wv, self.wo = nn.Linear(D_MODEL, D_MODEL), nn.Linear(D_MODEL, D_MODEL)
            self.ln2 = nn.LayerNorm(D_MODEL)
            self.fc1, self.fc2 = nn.Linear(D_MODEL, HIDDEN), nn.Linear(HIDDEN, D_MODEL)
            self.gelu_kw = {"approximate": "tanh"} if idx in faults.get("gelu_tanh", []) else {}
            self.router = nn.Linear(D_MODEL, 2, bias=False) if faults.get("router") and idx == 0 else None
            if self.router is not None:
                self.fc1b = nn.Linear(D_MODEL, HIDDEN)

        def forward(self, x, mask):
            h = self.ln1(x)
            q, k, v = self.wq(h), self.wk(h), self.wv(h)
            scores = q @ k.transpose(-2, -1) / math.sqrt(D_MODEL)
            scores = torch.where(mask, torch.finfo(scores.dtype).min, scores)
            x = x + self.wo(F.softmax(scores, dim=-1) @ v)
            h = self.ln2(x)
            if self.idx in faults.get("extra_mul", []):
                h.mul_(1.02)
            a = self.fc1(h)
            if self.router is not None:  # top-1 of two experts' first layers
                choice = torch.topk(self.router(h), 1, dim=-1).indices
                a = torch.where(choice == 0, a, self.fc1b(h))
            return x + self.fc2(F.gelu(a, **self.gelu_kw))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.layers = nn.ModuleList([Block(i) for i in range(G.N_LAYERS)])
            self.ln_f = nn.LayerNorm(D_MODEL)
            self.head = nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens):
            t = tokens.shape[1]
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x, mask)
            return self.head(self.ln_f(x).mean(dim=1))

    torch.manual_seed(G.SEED)
    model = GPT()
    params = dict(model.named_parameters())
    with torch.no_grad():
        if faults.get("router"):  # both experts' router rows equal up to a relative 1e-6: a near tie everywhere
            r = model.layers[0].router.weight
            r[1] = r[0] * (1 + 1e-6)
        for name, factor in faults.get("weight_scale", {}).items():
            params[name].mul_(factor)
    return model


def run_case(name, init_file):
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    _, family, mode, _, faults, _, _ = CASE[name]
    steps = STEPS[mode]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=0, world_size=1)
    from msprobe.pytorch import PrecisionDebugger

    config_path = G.write_config(name, mode, steps, 0)
    if family == "dx":
        model = build_dx_model(faults)
        optimizer = torch.optim.SGD(model.parameters(), lr=DX_LR, momentum=DX_MOMENTUM)
        vocab, autocast = VOCAB, contextlib.nullcontext
        dev = faults.get("device")
        kernels = tf32_kernels if dev else contextlib.nullcontext
    else:
        model = G.build_xdev_model(faults)
        optimizer = torch.optim.AdamW(model.parameters(), lr=G.XD_LR)
        vocab = G.XD_VOCAB
        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        dev = faults.get("device")
        kernels = (lambda: G.xdev_kernels(dev["chunk"], dev["reverse"])) if dev else contextlib.nullcontext
    g = torch.Generator().manual_seed(G.DATA_SEED)
    batches = [
        (torch.randint(0, vocab, (G.BATCH, G.SEQ), generator=g), torch.randint(0, vocab, (G.BATCH,), generator=g))
        for _ in range(steps)
    ]
    debugger = PrecisionDebugger(config_path=config_path)
    for step, (tokens, labels) in enumerate(batches):
        debugger.start(model)
        with kernels():
            with autocast():
                loss = F.cross_entropy(model(tokens), labels)
            loss.backward()
        debugger.stop()
        if faults.get("clip"):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), faults["clip"])
            assert norm > faults["clip"], "the clip norm must clip (%s)" % float(norm)
        if step == 1 and faults.get("lr_from_2nd"):
            for group in optimizer.param_groups:
                group["lr"] *= faults["lr_from_2nd"]
        optimizer.step()
        optimizer.zero_grad()
        debugger.step()
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver
def generate(names, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        scratch = tempfile.mkdtemp(prefix="devextra_")
        try:
            print("== generating %s" % name, flush=True)
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
            res = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--run-case", name, "--scratch", scratch],
                env=env,
                cwd=scratch,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            if res.returncode != 0:
                print(res.stdout[-6000:])
                raise SystemExit("case %s failed (rc %d)" % (name, res.returncode))
            G.neutralise(os.path.join(scratch, name), scratch)
            dst = os.path.join(out_dir, name)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.move(os.path.join(scratch, name), dst)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def catalog(out_dir):
    out = []
    for name, _family, mode, ref, _faults, exp, desc in cases():
        out.append(
            {
                "name": name,
                "path": name,
                "mode": mode,
                "ref": ref,
                "steps": list(range(STEPS[mode])),
                "ranks": [0],
                "fault": desc,
                "expected": None
                if ref is None
                else {"culprit": None if exp is None else {"step": exp[0], "rank": 0, "op": exp[1], "kind": exp[2]}},
            }
        )
    with open(os.path.join(out_dir, "catalog.json"), "w") as f:
        json.dump({"generator": "sample_dumps/dev_extra.py", "device_noise_cases": out}, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "dev_extra"), help="output folder")
    ap.add_argument("--cases", default=None, help="comma-separated subset")
    ap.add_argument("--run-case", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_case:
        os.chdir(args.scratch)
        run_case(args.run_case, os.path.join(args.scratch, "pg_init_" + args.run_case))
        return
    names = args.cases.split(",") if args.cases else list(CASE)
    for n in names:
        if n not in CASE:
            raise SystemExit("unknown case %s" % n)
    out_dir = os.path.abspath(args.out)
    generate(names, out_dir)
    catalog(out_dir)


if __name__ == "__main__":
    main()

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
  ds_*  the dx model and reference; the target ("device S") computes fp32 softmax on float16 inside:
        ds_clean (none), ds_weight2pct (layers.0.fc1.weight x1.02 at init).
  dl_*  a Llama-like model (RMSNorm from tensor ops, RoPE, grouped-query attention with repeat_kv, an additive
        finfo.min mask, SwiGLU): dl_clean (TF32), dl_clean_sm (fp16 softmax), dl_rms_eps (layer 1's RMSNorm eps),
        dl_lr2pct (lr x1.02 from the 2nd update, fp16 softmax), dl_sm_bf16_all (every layer's softmax at
        bfloat16 inside: a fault in all siblings that only the prior can name; tensor mode only, its statistics
        bound is 1.5 tolerances); the first three in tensor mode too.
  xb_*  generate.py's cross-device bf16 model (AdamW, device B's split bf16 reductions), with an optimizer fault.

Faults (the catalog's `expected.culprit`, checked by hand on the dumps: the op names are deterministic):
  dx_clean       none: TF32 matmuls only
  dx_router      none: a top-1 router in layer 0 whose two experts' scores are near-tied for every token
                 (TF32 noise may flip a token's choice: noise, not a culprit)
  dx_moe         none: a 4-expert top-1 mixture of experts in layer 0 (softmax router, topk, per-expert token
                 dispatch with nonzero / index / index_add_), experts 0 and 1 near-tied for every token
  dx_lr1pct      SGD learning rate x1.01 from the second update on (seen at step 2)
  dx_clip        gradients clipped to norm 0.5 before every update (the reference does not clip)
  dx_extra_mul   one extra in-place `h.mul_(1.02)` on layer 1's ln2 output, feeding fc1 (a parameterised op)
  dx_gelu_tanh   layer 1's F.gelu with approximate='tanh'
  dx_weight1pct  layers.1.fc2.weight x1.01 at init
  xb_lr5pct      AdamW learning rate x1.05 from the second update on, bf16 (seen at step 2)
"""

import argparse
import itertools
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
MODES = (("statistics", "stats"), ("tensor", "tensor"))
DEVICE_B = G.XDEV_B1

# name stem -> (faults, expected culprit or None, description); steps are filled per mode
DX = {
    "clean": ({}, None, "no fault: TF32 matmuls only"),
    "router": ({"router": True}, None, "no fault: near-tied top-1 router in layer 0"),
    "moe": ({"moe": True}, None, "no fault: a 4-expert top-1 MoE in layer 0 dispatching tokens, near-tied router"),
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
# device S: exact fp32 matmuls, but softmax computed at float16 internally
SM = {
    "clean": ({}, None, "no fault: softmax at float16 inside"),
    "weight2pct": (
        {"weight_scale": {"layers.0.fc1.weight": 1.02}},
        (0, "Functional.linear.4.forward", "parameter"),
        "layers.0.fc1.weight x1.02 at init",
    ),
}
# a Llama-like family: RMSNorm from tensor ops, RoPE, grouped-query attention (repeat_kv), an additive finfo.min
# causal mask, SwiGLU MLP; fp32, SGD with momentum; device T (TF32) or S (fp16 softmax)
DL = {
    "clean": ({"device": {"tf32": True}}, None, "device T (TF32): no fault"),
    "clean_sm": ({"device": {"softmax16": True}}, None, "device S (fp16 softmax): no fault"),
    "rms_eps": (
        {"device": {"tf32": True}, "rms_eps": {1: 1e-3}},
        (0, "Tensor.__add__.7.forward", "scalar"),
        "device T: layer 1's RMSNorm eps 1e-3 instead of 1e-6",
    ),
    "lr2pct": (
        {"device": {"softmax16": True}, "lr_from_2nd": 1.02},
        (2, "Functional.embedding.0.forward", "optimizer"),
        "device S: SGD lr x1.02 from the 2nd update",
    ),
    "sm_bf16_all": (
        {"device": {"softmax_bf16": True}},
        (0, "Functional.softmax.0.forward", "op"),
        "every layer's fp32 softmax at bfloat16 inside: a fault in all siblings, no argument or record differs",
    ),
}
DL_TENSOR = ("clean", "clean_sm", "rms_eps", "sm_bf16_all")
DL_STATS_SKIP = ("sm_bf16_all",)  # its statistics bound (1.5 tolerances) cannot tell it from fp16 rounding
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
        if mode == "statistics":
            out.append(("dx_mref_" + sfx, "dx", mode, None, {"moe": True}, None, "device A: fp32 reference, MoE"))
        for stem, (faults, exp, desc) in DX.items():
            if mode == "tensor" and stem not in TENSOR:
                continue
            f = dict(faults, device=DEVICE_T)
            ref = ("dx_rref_" if faults.get("router") else "dx_mref_" if faults.get("moe") else "dx_ref_") + sfx
            out.append(("dx_%s_%s" % (stem, sfx), "dx", mode, ref, f, exp, "device T (TF32): " + desc))
    for (stem, (faults, exp, desc)), (mode, sfx) in itertools.product(SM.items(), MODES):
        f = dict(faults, device={"softmax16": True})
        name, ref = "ds_%s_%s" % (stem, sfx), "dx_ref_" + sfx
        out.append((name, "dx", mode, ref, f, exp, "device S (fp16 softmax): " + desc))
    for mode, sfx in MODES:
        out.append(("dl_ref_" + sfx, "dl", mode, None, {}, None, "device A: Llama-like fp32 reference"))
        for stem, (faults, exp, desc) in DL.items():
            if (mode == "tensor" and stem not in DL_TENSOR) or (mode == "statistics" and stem in DL_STATS_SKIP):
                continue
            out.append(("dl_%s_%s" % (stem, sfx), "dl", mode, "dl_ref_" + sfx, faults, exp, desc))
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


def softmax16_kernels(inner: str = "float16"):
    """Device S: a TorchDispatchMode computing fp32 softmax (forward) on float16 inside, as some accelerators'
    fused softmax does; everything else is untouched.  `inner="bfloat16"`: the same at bfloat16, a fault (an op
    computed wrongly in every layer: no argument or record differs)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    low = getattr(torch, inner)

    class DeviceS(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten._softmax.default and args[0].dtype == torch.float32:
                x16 = aten._to_copy.default(args[0], dtype=low)
                y16 = func(x16, args[1], False)
                return aten._to_copy.default(y16, dtype=torch.float32)
            return func(*args, **kwargs)

    return DeviceS()


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
            self.moe = faults.get("moe") and idx == 0
            if self.moe:
                self.gate = nn.Linear(D_MODEL, 4, bias=False)
                self.experts = nn.ModuleList([nn.Linear(D_MODEL, D_MODEL) for _ in range(4)])

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
            if self.moe:  # top-1 mixture of experts, tokens dispatched per expert (Mixtral-like)
                flat = h.reshape(-1, D_MODEL)
                probs = F.softmax(self.gate(flat), dim=-1)
                weight, choice = torch.topk(probs, 1, dim=-1)
                moe = torch.zeros_like(flat)
                for e, expert in enumerate(self.experts):
                    rows = torch.nonzero(choice.squeeze(-1) == e).squeeze(-1)
                    moe = moe.index_add(0, rows, expert(flat[rows]) * weight[rows])
                x = x + moe.reshape(h.shape)
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
        if faults.get("moe"):  # experts 0 and 1 near-tied for every token
            g = model.layers[0].gate.weight
            g[1] = g[0] * (1 + 1e-6)
        for name, factor in faults.get("weight_scale", {}).items():
            params[name].mul_(factor)
    return model


def build_dl_model(faults):
    """A 2-layer Llama-like model written as Hugging Face writes it (tensor ops msprobe records one by one)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    heads, kv_heads, head_dim = 4, 2, D_MODEL // 4

    class RMSNorm(nn.Module):
        def __init__(self, eps):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(D_MODEL)), eps

        def forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(var + self.eps))

    def rotate_half(x):
        return torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)

    class Block(nn.Module):
        def __init__(self, idx):
            super().__init__()
            eps = faults.get("rms_eps", {}).get(idx, 1e-6)
            self.norm1, self.norm2 = RMSNorm(eps), RMSNorm(1e-6)
            self.wq = nn.Linear(D_MODEL, heads * head_dim, bias=False)
            self.wk = nn.Linear(D_MODEL, kv_heads * head_dim, bias=False)
            self.wv = nn.Linear(D_MODEL, kv_heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, D_MODEL, bias=False)
            self.gate = nn.Linear(D_MODEL, HIDDEN, bias=False)
            self.up = nn.Linear(D_MODEL, HIDDEN, bias=False)
            self.down = nn.Linear(HIDDEN, D_MODEL, bias=False)

        def forward(self, x, mask, cos, sin):
            b, t, _ = x.shape
            h = self.norm1(x)
            q = self.wq(h).view(b, t, heads, head_dim).transpose(1, 2)
            k = self.wk(h).view(b, t, kv_heads, head_dim).transpose(1, 2)
            v = self.wv(h).view(b, t, kv_heads, head_dim).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            rep = heads // kv_heads  # repeat_kv: expand and reshape, not recorded
            k = k[:, :, None].expand(b, kv_heads, rep, t, head_dim).reshape(b, heads, t, head_dim)
            v = v[:, :, None].expand(b, kv_heads, rep, t, head_dim).reshape(b, heads, t, head_dim)
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(head_dim) + mask
            attn = F.softmax(scores, dim=-1, dtype=torch.float32)
            o = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, heads * head_dim)
            x = x + self.wo(o)
            h = self.norm2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.layers = nn.ModuleList([Block(i) for i in range(G.N_LAYERS)])
            self.norm = RMSNorm(1e-6)
            self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

        def forward(self, tokens):
            t = tokens.shape[1]
            fmin = torch.finfo(torch.float32).min
            mask = torch.full((t, t), fmin).triu(1)
            pos = torch.arange(t, dtype=torch.float32)
            inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            ang = torch.outer(pos, inv)
            emb = torch.cat((ang, ang), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x, mask, cos, sin)
            return self.head(self.norm(x).mean(dim=1))

    torch.manual_seed(G.SEED)
    return Llama()


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
    if family in ("dx", "dl"):
        model = build_dx_model(faults) if family == "dx" else build_dl_model(faults)
        optimizer = torch.optim.SGD(model.parameters(), lr=DX_LR, momentum=DX_MOMENTUM)
        vocab, autocast = VOCAB, contextlib.nullcontext
        dev = faults.get("device")
        kernels = (softmax16_kernels if dev.get("softmax16") else tf32_kernels) if dev else contextlib.nullcontext
        if dev and dev.get("softmax_bf16"):
            kernels = lambda: softmax16_kernels("bfloat16")  # noqa: E731
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

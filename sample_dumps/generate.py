#!/usr/bin/env python
"""Generate the bundled msprobe sample dumps and their catalog.

Usage::

    /path/to/venv/bin/python sample_dumps/generate.py [--out sample_dumps] [--cases a,b,...]

Needs ``mindstudio-probe==26.2.0`` and ``torch==2.13.0`` (CPU is enough).

Every case runs in its own subprocess (msprobe's ``PrecisionDebugger`` is a
process-wide singleton) with a fixed seed, one intra-op thread and the same
data batches.  The dumps are msprobe's own files; the only post-processing is
replacing machine paths in ``stack.json`` frames (and in ``dump_data_dir``,
should it ever be absolute) by neutral prefixes.  Afterwards the script reads
the dumps back, computes the expected answers (first divergence, culprit,
first overflow; for some cases the checklist and single-run health answers) by
comparing each case with its reference, checks them against what is known by
construction, and writes ``catalog.json``.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fixtures  # sample_dumps/fixtures.py, beside this script

HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------
# sizes and run parameters
# ----------------------------------------------------------------------------
D_MODEL = 16
HIDDEN = 32
SEQ = 8
BATCH = 2
VOCAB = 10
N_LAYERS = 2
SEED = 0
DATA_SEED = 1234
LR = 0.1

NEUTRAL_JOB = "/home/user/job"
NEUTRAL_VENV = "/opt/venv"
NEUTRAL_PYTHON = "/usr/local"

# ----------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------
# fault keys understood by build_model / run_training:
#   weight_scale: {param_name: factor}        (applied before step 0)
#   gelu_tanh: [layer]                        (F.gelu(..., approximate='tanh'))
#   ln2_eps: {layer: eps}                     (second LayerNorm of a block)
#   no_mask: [layer]                          (attention without causal mask)
#   overflow_fc2: layer                       (fc2 weight scaled to overflow fp32)
#   saturate_fc2: layer                       (fc2 output exactly +-finfo.max)
#   bf16: True                                (forward + loss under CPU autocast bf16)
#   lr: float
#   extra_gelu: [layer]                       (discarded extra F.gelu call)
#   rank_weight_scale: {rank: {param: factor}}
#   data_step0_seed: int                      (step 0's token ids drawn with another seed; labels kept)
#   reinit: {module_name: seed}               (module.reset_parameters() under another seed, before step 0)
#   loss_scale: [from_step, scale]            ((loss * scale).backward() from that step on, never unscaled)
CASES = [
    # name, task, ref, steps, world_size, faults, description
    ("ref_stats", "statistics", None, 3, 1, {}, "fp32 reference run, no fault."),
    (
        "weight_1pct_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"weight_scale": {"layers.1.fc1.weight": 1.01}},
        "Parameter layers.1.fc1.weight multiplied by 1.01 before step 0.",
    ),
    (
        "gelu_tanh_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"gelu_tanh": [1]},
        "Layer 1's GELU computed with approximate='tanh' instead of the exact erf form.",
    ),
    (
        "ln_eps_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"ln2_eps": {0: 1e-2}},
        "Layer 0's second LayerNorm uses eps=1e-2 instead of 1e-5.",
    ),
    (
        "no_mask_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"no_mask": [1]},
        "Layer 1's attention runs without the causal mask (no masked_fill call).",
    ),
    (
        "overflow_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"overflow_fc2": 1},
        "Layer 1's fc2 weight scaled so that its fp32 linear output overflows to inf "
        "from finite inputs; NaN/Inf then propagate.",
    ),
    (
        "saturation_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"saturate_fc2": 1},
        "Simulated Ascend saturation mode: layer 1's fc1 unit 0 is made constant (zero weights, "
        "bias 16 -> gelu 16) and fc2 rows 0/1 map it to exactly +finfo.max / -finfo.max, so the "
        "fc2 linear outputs saturated values (no inf) from clean inputs.",
    ),
    (
        "bf16_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"bf16": True},
        "Whole forward (and loss) under torch.autocast('cpu', dtype=torch.bfloat16); no fault.",
    ),
    (
        "lr_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"lr": 1.0},
        "SGD learning rate 1.0 instead of 0.1: forward/backward of step 0 identical, the step-0 "
        "optimizer updates (Tensor.add_ with alpha=-lr) differ, the model differs from step 1 on.",
    ),
    (
        "extra_gelu_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"extra_gelu": [0]},
        "One extra F.gelu call on layer 0's ln1 output whose result is discarded: renumbers later "
        "gelu records, changes no values.",
    ),
    ("ref_tensor", "tensor", None, 1, 1, {}, "fp32 reference run, no fault (tensor mode)."),
    (
        "weight_1pct_tensor",
        "tensor",
        "ref_tensor",
        1,
        1,
        {"weight_scale": {"layers.1.fc1.weight": 1.01}},
        "Parameter layers.1.fc1.weight multiplied by 1.01 before step 0 (tensor mode).",
    ),
    (
        "bf16_tensor",
        "tensor",
        "ref_tensor",
        1,
        1,
        {"bf16": True},
        "Whole forward (and loss) under CPU autocast bf16; no fault (tensor mode).",
    ),
    (
        "gelu_tanh_tensor",
        "tensor",
        "ref_tensor",
        1,
        1,
        {"gelu_tanh": [1]},
        "Layer 1's GELU computed with approximate='tanh' (tensor mode).",
    ),
    (
        "ref_2rank_stats",
        "statistics",
        None,
        2,
        2,
        {},
        "2-process gloo run (no DDP, plain per-rank model, each rank its own batch), fp32 reference.",
    ),
    (
        "rank1_fault_stats",
        "statistics",
        "ref_2rank_stats",
        2,
        2,
        {"rank_weight_scale": {1: {"layers.1.fc1.weight": 1.01}}},
        "2-process run; only rank 1 multiplies layers.1.fc1.weight by 1.01 before step 0.",
    ),
    (
        "data_batch_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"data_step0_seed": DATA_SEED + 1},
        "Step 0's token ids come from another data batch (labels and steps 1-2 unchanged).",
    ),
    (
        "init_weight_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"reinit": {"layers.0.qkv": SEED + 1}},
        "layers.0.qkv re-initialised (reset_parameters) with another seed before step 0.",
    ),
    (
        "grad_explode_stats",
        "statistics",
        "ref_stats",
        3,
        1,
        {"loss_scale": [1, 1e4]},
        "From step 1 the loss is scaled by 1e4 before backward and the gradients are never unscaled: "
        "gradients explode at step 1, the step-1 update is 1e4 times too large.",
    ),
]

# Cross-device noise cases (issue 11): a small GPT-style model with separate q/k/v projections that carry biases,
# both runs under CPU autocast bf16.  The target ("device B") runs its bf16 matmuls and bf16 sums through other
# kernels (xdev_kernels): the same aten ops, so msprobe records the same records under the same names, but the
# reduction is split into chunks whose partial results are rounded to bf16.  Faults are injected under that noise.
# fault keys understood by build_xdev_model / run_xdev_training:
#   device: {"chunk": int, "reverse": bool}  (the target's kernels; absent = device A, the reference)
#   weight_scale: {param_name: factor}       (applied at init)
#   no_mask: [layer]                         (attention without the causal masked_fill)
#   ln2_eps: {layer: eps}
#   gelu_tanh: [layer]
#   lr: float                                (AdamW learning rate; the optimizer runs outside msprobe's window)
XDEV_B1 = {"chunk": 8, "reverse": False}
XDEV_B2 = {"chunk": 16, "reverse": True}
XDEV_FAULTS = [
    # name stem, faults, description
    ("clean", {}, "no fault: device B's kernels only"),
    ("clean2", {"device": XDEV_B2}, "no fault: device B's kernels with another split (chunk 16, reversed)"),
    (
        "weight5pct",
        {"weight_scale": {"layers.0.wv.weight": 1.05}},
        "layers.0.wv.weight multiplied by 1.05 at init, under device B's noise",
    ),
    ("no_mask", {"no_mask": [1]}, "layer 1's attention without the causal mask (no masked_fill call), under noise"),
    ("ln_eps", {"ln2_eps": {0: 1e-2}}, "layer 0's ln2 eps 1e-2 instead of 1e-5, under noise"),
    ("gelu_tanh", {"gelu_tanh": [1]}, "layer 1's F.gelu called with approximate='tanh', under noise"),
    (
        "lr",
        {"lr": 0.011},
        "AdamW learning rate 0.011 instead of 0.01 (+10 %; the optimizer runs outside msprobe's "
        "start/stop window, so no record carries the learning rate), under noise",
    ),
]
# tensor mode costs ~1.9 MB per step and case (~370 .pt files): only the pairs whose verdict needs tensor data
# (false alarms on the clean pair, the optimizer's update sizes) and only the steps they need
XDEV_STEPS = {"statistics": 3, "tensor": 2}
XDEV_TENSOR = ("clean", "weight5pct", "no_mask", "ln_eps", "gelu_tanh", "lr")
XDEV_CASES = []
for _task, _sfx in (("statistics", "stats"), ("tensor", "tensor")):
    _ref = "xdev_ref_" + _sfx
    XDEV_CASES.append(
        (
            _ref,
            _task,
            None,
            XDEV_STEPS[_task],
            1,
            {"xdev": True},
            "Cross-device reference (device A): small GPT, bf16 autocast, no fault.",
        )
    )
    for _stem, _f, _desc in XDEV_FAULTS:
        if _task == "tensor" and _stem not in XDEV_TENSOR:
            continue
        _faults = dict({"xdev": True, "device": XDEV_B1}, **_f)
        XDEV_CASES.append(
            (
                "xdev_%s_%s" % (_stem, _sfx),
                _task,
                _ref,
                XDEV_STEPS[_task],
                1,
                _faults,
                "Device B (bf16 kernels rounding differently): %s." % _desc,
            )
        )
CASE_BY_NAME = {c[0]: c for c in CASES + XDEV_CASES}


# ============================================================================
# part 1: the training job (runs in a subprocess per case / per rank)
# ============================================================================
def build_model(faults, rank=0):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class TinyBlock(nn.Module):
        def __init__(self, idx):
            super().__init__()
            self.idx = idx
            self.ln1 = nn.LayerNorm(D_MODEL)
            self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
            self.proj = nn.Linear(D_MODEL, D_MODEL)
            self.ln2 = nn.LayerNorm(D_MODEL, eps=faults.get("ln2_eps", {}).get(idx, 1e-5))
            self.fc1 = nn.Linear(D_MODEL, HIDDEN)
            self.fc2 = nn.Linear(HIDDEN, D_MODEL)
            self.causal = idx not in faults.get("no_mask", [])
            self.gelu_tanh = idx in faults.get("gelu_tanh", [])
            self.extra_gelu = idx in faults.get("extra_gelu", [])

        def forward(self, x):
            h = self.ln1(x)
            if self.extra_gelu:
                _unused = F.gelu(h)  # extra API call, result discarded
            q, k, v = self.qkv(h).split(D_MODEL, dim=-1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(D_MODEL)
            if self.causal:
                t = scores.shape[-1]
                mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
                scores = scores.masked_fill(mask, float("-inf"))
            attn = F.softmax(scores, dim=-1)
            x = x + self.proj(attn @ v)
            h = self.fc1(self.ln2(x))
            if self.gelu_tanh:
                h = F.gelu(h, approximate="tanh")
            else:
                h = F.gelu(h)
            return x + self.fc2(h)

    class TinyTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.layers = nn.ModuleList([TinyBlock(i) for i in range(N_LAYERS)])
            self.ln_f = nn.LayerNorm(D_MODEL)
            self.head = nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens):
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.ln_f(x).mean(dim=1))

    torch.manual_seed(SEED)
    model = TinyTransformer()
    params = dict(model.named_parameters())
    fmax = torch.finfo(torch.float32).max
    with torch.no_grad():
        scales = dict(faults.get("weight_scale", {}))
        scales.update(faults.get("rank_weight_scale", {}).get(rank, {}))
        for name, factor in scales.items():
            params[name].mul_(factor)
        if "overflow_fc2" in faults:
            w = model.layers[faults["overflow_fc2"]].fc2.weight
            # largest |w| becomes finfo.max / 2: still finite, but the dot products
            # with gelu outputs of order 1..3 overflow fp32
            w.div_(w.abs().max()).mul_(fmax / 2)
        for mod_name, seed in faults.get("reinit", {}).items():
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                model.get_submodule(mod_name).reset_parameters()
        if "saturate_fc2" in faults:
            blk = model.layers[faults["saturate_fc2"]]
            blk.fc1.weight[0].zero_()
            blk.fc1.bias[0] = 16.0  # fc1 unit 0 == 16 for every token; gelu(16) == 16 exactly
            blk.fc2.weight[0:2].zero_()
            blk.fc2.bias[0:2] = 0.0
            blk.fc2.weight[0, 0] = fmax / 16  # 16 * (fmax / 16) == +fmax exactly
            blk.fc2.weight[1, 0] = -fmax / 16  # == -fmax exactly
    return model


def make_batches(steps, rank, faults=None):
    import torch

    g = torch.Generator().manual_seed(DATA_SEED + rank)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH,), generator=g)
        out.append((tokens, labels))
    if (faults or {}).get("data_step0_seed") is not None:
        other = torch.Generator().manual_seed(faults["data_step0_seed"])
        out[0] = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=other), out[0][1])
        assert not torch.equal(out[0][0], make_batches(1, rank)[0][0])
    return out


def write_config(name, task, steps, rank):
    """msprobe's config file for one case (level mix, all data), in the cwd; returns its path."""
    config_path = os.path.join(os.getcwd(), "config_%s_rank%d.json" % (name, rank))
    config = {
        "task": task,
        "dump_path": "./" + name,
        "rank": [],
        "step": list(range(steps)),
        "level": "mix",
        task: {"scope": [], "list": [], "data_mode": ["all"]},
    }
    if task == "statistics":
        config[task]["summary_mode"] = "statistics"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    return config_path


def run_training(name, rank, world_size, init_file):
    """Run one case (one rank) under msprobe. cwd is the scratch dir."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    _, task, _, steps, _, faults, _ = CASE_BY_NAME[name]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world_size)

    from msprobe.pytorch import PrecisionDebugger

    config_path = write_config(name, task, steps, rank)
    model = build_model(faults, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=faults.get("lr", LR))
    batches = make_batches(steps, rank, faults)
    scale_from, scale = faults.get("loss_scale", [steps, 1.0])
    debugger = PrecisionDebugger(config_path=config_path)
    for step, (tokens, labels) in enumerate(batches):
        debugger.start(model)
        if faults.get("bf16"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens), labels)
        else:
            loss = F.cross_entropy(model(tokens), labels)
        if step >= scale_from:
            loss = loss * scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        debugger.stop()
        debugger.step()
    dist.barrier()
    dist.destroy_process_group()


def _spawn_entry(rank, name, world_size, init_file):
    run_training(name, rank, world_size, init_file)


def run_case_process(name, scratch):
    """Entry of the per-case subprocess."""
    _, _, _, _, world_size, _, _ = CASE_BY_NAME[name]
    init_file = os.path.join(scratch, "pg_init_" + name)
    os.chdir(scratch)
    if CASE_BY_NAME[name][5].get("xdev"):
        run_xdev_training(name, init_file)
    elif world_size == 1:
        run_training(name, 0, 1, init_file)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_spawn_entry, args=(name, world_size, init_file), nprocs=world_size, join=True)


# ============================================================================
# part 1b: the cross-device noise cases (a small GPT, bf16 autocast, device B's kernels)
# ============================================================================
XD_MODEL, XD_HIDDEN, XD_VOCAB, XD_LR = 32, 64, 16, 1e-2


def build_xdev_model(faults):
    """A 2-layer GPT-style model: separate biased q/k/v projections, causal masked_fill, LayerNorm, GELU."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, idx):
            super().__init__()
            self.ln1 = nn.LayerNorm(XD_MODEL)
            self.wq = nn.Linear(XD_MODEL, XD_MODEL)
            self.wk = nn.Linear(XD_MODEL, XD_MODEL)
            self.wv = nn.Linear(XD_MODEL, XD_MODEL)
            self.wo = nn.Linear(XD_MODEL, XD_MODEL)
            self.ln2 = nn.LayerNorm(XD_MODEL, eps=faults.get("ln2_eps", {}).get(idx, 1e-5))
            self.fc1 = nn.Linear(XD_MODEL, XD_HIDDEN)
            self.fc2 = nn.Linear(XD_HIDDEN, XD_MODEL)
            self.causal = idx not in faults.get("no_mask", [])
            self.gelu_kw = {"approximate": "tanh"} if idx in faults.get("gelu_tanh", []) else {}

        def forward(self, x, mask):
            h = self.ln1(x)
            q, k, v = self.wq(h), self.wk(h), self.wv(h)
            scores = q @ k.transpose(-2, -1) / math.sqrt(XD_MODEL)
            if self.causal:
                scores = scores.masked_fill(mask, float("-inf"))
            x = x + self.wo(F.softmax(scores, dim=-1) @ v)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), **self.gelu_kw))

    class SmallGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(XD_VOCAB, XD_MODEL)
            self.layers = nn.ModuleList([Block(i) for i in range(N_LAYERS)])
            self.ln_f = nn.LayerNorm(XD_MODEL)
            self.head = nn.Linear(XD_MODEL, XD_VOCAB)

        def forward(self, tokens):
            t = tokens.shape[1]
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x, mask)
            return self.head(self.ln_f(x).mean(dim=1))

    torch.manual_seed(SEED)
    model = SmallGPT()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, factor in faults.get("weight_scale", {}).items():
            params[name].mul_(factor)
    return model


def xdev_kernels(chunk, reverse):
    """Device B: a TorchDispatchMode that runs bf16 mm/addmm/bmm and bf16 sums with split reductions.

    Each reduction over K (or over the summed rows) is cut into chunks of `chunk`; every chunk is reduced in
    fp32 and rounded to bf16, the partials are added in fp32 (in reverse order if asked) and the result is
    rounded to bf16 once more.  The aten ops called from Python are the same, so msprobe records the same
    records; only the rounding differs, as between two devices' kernels.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten, bf16, f32 = torch.ops.aten, torch.bfloat16, torch.float32
    # only torch.ops.aten calls in here: Python-level tensor methods would be recorded by msprobe's hooks
    cast = lambda x, dt: aten._to_copy.default(x, dtype=dt)

    def add_up(parts):
        order = parts[::-1] if reverse else parts
        acc = order[0]
        for p in order[1:]:
            acc = aten.add.Tensor(acc, p)
        return acc

    def split_mm(a, b, batched):
        mm = aten.bmm.default if batched else aten.mm.default
        k = a.shape[-1]
        parts = []
        for lo in range(0, k, chunk):
            hi = min(lo + chunk, k)
            x = cast(aten.slice.Tensor(a, a.dim() - 1, lo, hi), f32)
            y = cast(aten.slice.Tensor(b, b.dim() - 2, lo, hi), f32)
            parts.append(cast(cast(mm(x, y), bf16), f32))
        return add_up(parts)

    def split_sum(x, dim, keepdim):
        rows = x.shape[dim]
        parts = [
            cast(
                cast(
                    aten.sum.dim_IntList(
                        cast(aten.slice.Tensor(x, dim, lo, min(lo + chunk, rows)), f32), [dim], keepdim
                    ),
                    bf16,
                ),
                f32,
            )
            for lo in range(0, rows, chunk)
        ]
        return cast(add_up(parts), bf16)

    class DeviceB(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (aten.mm.default, aten.bmm.default) and args[0].dtype == bf16 and not kwargs:
                return cast(split_mm(args[0], args[1], func is aten.bmm.default), bf16)
            if func is aten.addmm.default and args[1].dtype == bf16:
                beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
                acc = aten.add.Tensor(
                    aten.mul.Tensor(cast(args[0], f32), beta), aten.mul.Tensor(split_mm(args[1], args[2], False), alpha)
                )
                return cast(acc, bf16)
            if (
                func is aten.sum.dim_IntList
                and args[0].dtype == bf16
                and kwargs.get("dtype") is None
                and len(args) >= 2
                and args[1] is not None
                and len(args[1]) == 1
            ):
                keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
                return split_sum(args[0], args[1][0] % args[0].dim(), keepdim)
            return func(*args, **kwargs)

    return DeviceB()


def run_xdev_training(name, init_file):
    """One cross-device case: bf16 autocast forward, backward inside the dump window, SGD step outside."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    _, task, _, steps, _, faults, _ = CASE_BY_NAME[name]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=0, world_size=1)
    from msprobe.pytorch import PrecisionDebugger

    config_path = write_config(name, task, steps, 0)
    model = build_xdev_model(faults)
    optimizer = torch.optim.AdamW(model.parameters(), lr=faults.get("lr", XD_LR))
    g = torch.Generator().manual_seed(DATA_SEED)
    batches = [
        (torch.randint(0, XD_VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, XD_VOCAB, (BATCH,), generator=g))
        for _ in range(steps)
    ]
    dev = faults.get("device")
    kernels = xdev_kernels(dev["chunk"], dev["reverse"]) if dev else contextlib.nullcontext()
    debugger = PrecisionDebugger(config_path=config_path)
    for tokens, labels in batches:
        debugger.start(model)
        with kernels:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens), labels)
            loss.backward()
        debugger.stop()
        optimizer.step()
        optimizer.zero_grad()
        debugger.step()
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================
# part 2: driver, post-processing
# ============================================================================
def path_replacements(scratch):
    import sysconfig

    reps = []
    purelib = sysconfig.get_paths()["purelib"]
    rel = os.path.relpath(purelib, sys.prefix)  # lib/python3.11/site-packages
    reps.append((os.path.realpath(purelib), os.path.join(NEUTRAL_VENV, rel)))
    reps.append((purelib, os.path.join(NEUTRAL_VENV, rel)))
    reps.append((os.path.realpath(scratch), NEUTRAL_JOB))
    reps.append((scratch, NEUTRAL_JOB))
    reps.append((HERE, NEUTRAL_JOB))
    reps.append((os.path.realpath(HERE), NEUTRAL_JOB))
    for p in {sys.prefix, os.path.realpath(sys.prefix)}:
        reps.append((p, NEUTRAL_VENV))
    for p in {sys.base_prefix, os.path.realpath(sys.base_prefix)}:
        if p != NEUTRAL_PYTHON:
            reps.append((p, NEUTRAL_PYTHON))
    # longest first so that nested prefixes win; drop duplicates
    seen, out = set(), []
    for old, new in sorted(reps, key=lambda r: -len(r[0])):
        if old not in seen and old not in ("/", ""):
            seen.add(old)
            out.append((old, new))
    return out


def neutralise(case_dir, scratch):
    reps = path_replacements(scratch)
    for root, _, files in os.walk(case_dir):
        for fn in files:
            p = os.path.join(root, fn)
            if fn == "stack.json":
                with open(p, encoding="utf-8") as f:
                    text = f.read()
                new = text
                for old, rep in reps:
                    new = new.replace("File " + old + "/", "File " + rep + "/")
                if new != text:
                    with open(p, "w", encoding="utf-8") as f:
                        f.write(new)
            elif fn == "dump.json":
                with open(p, encoding="utf-8") as f:
                    text = f.read()
                # only the dump_data_dir line, and only when absolute
                head, sep, rest = text.partition('\n "dump_data_dir": "')
                if sep and rest.startswith("/"):
                    value, q, tail = rest.partition('"')
                    for old, rep in reps:
                        if value.startswith(old + "/"):
                            value = rep + value[len(old) :]
                            break
                    with open(p, "w", encoding="utf-8") as f:
                        f.write(head + sep + value + q + tail)


def generate(names, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        scratch = tempfile.mkdtemp(prefix="dumpgen_")
        try:
            print("== generating %s" % name, flush=True)
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("MKL_NUM_THREADS", "1")
            env["PYTHONHASHSEED"] = "0"
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
            src = os.path.join(scratch, name)
            neutralise(src, scratch)
            dst = os.path.join(out_dir, name)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            shutil.move(src, dst)
            if any(os.path.isdir(os.path.join(r, "dump_tensor_data")) for r, _, _ in os.walk(dst)):
                fixtures.pack(name, Path(out_dir))  # the tracked form: tensor_data/<name>.tar.xz (fixtures.py)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


# ============================================================================
# part 3: reading the dumps back, expected answers
# ============================================================================
FMAX = {
    "torch.float32": 3.4028234663852886e38,
    "torch.bfloat16": 3.3895313892515355e38,
    "torch.float16": 65504.0,
}


class Dump:
    def __init__(self, out_dir, name):
        c = CASE_BY_NAME[name]
        self.name, self.task, self.ref, self.nsteps, self.world = name, c[1], c[2], c[3], c[4]
        self.root = os.path.join(out_dir, name)
        self._cache = {}

    def rank_dir(self, step, rank):
        return os.path.join(self.root, "step%d" % step, "rank%d" % rank)

    def load(self, step, rank):
        key = (step, rank)
        if key not in self._cache:
            d = self.rank_dir(step, rank)
            with open(os.path.join(d, "dump.json")) as f:
                dump = json.load(f)
            with open(os.path.join(d, "construct.json")) as f:
                construct = json.load(f)
            self._cache[key] = (dump, construct)
        return self._cache[key]

    def data(self, step, rank):
        return self.load(step, rank)[0]["data"]

    def parent(self, step, rank, key):
        p = self.load(step, rank)[1].get(key)
        if isinstance(p, list):
            p = p[0] if p else None
        return p

    def find(self, step, rank, prefix, parent, nth=0):
        """nth record (in dump.json order) named prefix.* whose construct parent is parent."""
        hits = [k for k in self.data(step, rank) if k.startswith(prefix + ".") and self.parent(step, rank, k) == parent]
        if len(hits) <= nth:
            raise AssertionError("%s: no %s under %s at step %d rank %d" % (self.name, prefix, parent, step, rank))
        return hits[nth]


def iter_leaves(obj, path=()):
    if isinstance(obj, dict) and ("type" in obj or "class_type" in obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, path + (i,))
    else:
        yield path, obj  # None


def out_part(rec):
    return rec["output"] if "output" in rec else rec  # parameters_grad: whole record


def in_part(rec):
    if "output" not in rec:
        return {}
    return {k: v for k, v in rec.items() if k != "output"}


def _same(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        ka = set(a) - {"data_name"}
        kb = set(b) - {"data_name"}
        return ka == kb and all(_same(a[k], b[k]) for k in ka)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def outputs_differ_stats(rec, ref_rec):
    return not _same(out_part(rec), out_part(ref_rec))


_TORCH = None


def _load_pt(path):
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = torch
    return _TORCH.load(path, weights_only=True)


def outputs_differ_tensor(rec, ref_rec, tdir, rdir):
    a = list(iter_leaves(out_part(rec)))
    b = list(iter_leaves(out_part(ref_rec)))
    if [p for p, _ in a] != [p for p, _ in b]:
        return True
    for (_, la), (_, lb) in zip(a, b):
        if isinstance(la, dict) and "data_name" in la and isinstance(lb, dict) and "data_name" in lb:
            ta = _load_pt(os.path.join(tdir, "dump_tensor_data", la["data_name"]))
            tb = _load_pt(os.path.join(rdir, "dump_tensor_data", lb["data_name"]))
            if ta.dtype != tb.dtype or ta.shape != tb.shape:
                return True
            if ta.is_floating_point():
                if not _TORCH.equal(_TORCH.nan_to_num(ta, nan=0.0), _TORCH.nan_to_num(tb, nan=0.0)) or not _TORCH.equal(
                    ta.isnan(), tb.isnan()
                ):
                    return True
            elif not _TORCH.equal(ta, tb):
                return True
        elif not _same(la, lb):
            return True
    return False


def first_divergence(tgt, ref):
    for step in range(tgt.nsteps):
        for rank in range(tgt.world):
            rdata = ref.data(step, rank)
            for key, rec in tgt.data(step, rank).items():
                if key not in rdata:
                    return {"step": step, "rank": rank, "op": key}
                if tgt.task == "tensor":
                    differ = outputs_differ_tensor(rec, rdata[key], tgt.rank_dir(step, rank), ref.rank_dir(step, rank))
                else:
                    differ = outputs_differ_stats(rec, rdata[key])
                if differ:
                    return {"step": step, "rank": rank, "op": key}
    return None


def leaf_flags(leaf):
    """Anomaly flags of one leaf from its Max/Min (tensors) or value (float scalars)."""
    flags = set()
    if not isinstance(leaf, dict):
        return flags
    vals = []
    if leaf.get("type") == "float":
        vals = [leaf.get("value")]
    elif "Max" in leaf:
        vals = [leaf.get("Max"), leaf.get("Min")]
    fmax = FMAX.get(leaf.get("dtype"), FMAX["torch.float32"])
    for v in vals:
        if not isinstance(v, float):
            continue
        if math.isnan(v):
            flags.add("nan")
        elif math.isinf(v):
            flags.add("inf")
        elif abs(v) == fmax:
            flags.add("saturated")
    return flags


def first_overflow(tgt, ref):
    for step in range(tgt.nsteps):
        for rank in range(tgt.world):
            rdata = ref.data(step, rank)
            for key, rec in tgt.data(step, rank).items():
                if any(leaf_flags(l) for _, l in iter_leaves(in_part(rec))):
                    continue
                ref_flags = {}
                if key in rdata:
                    ref_flags = {p: leaf_flags(l) for p, l in iter_leaves(out_part(rdata[key]))}
                new = set()
                for p, l in iter_leaves(out_part(rec)):
                    new |= leaf_flags(l) - ref_flags.get(p, set())
                if new:
                    kind = "nan" if "nan" in new else ("inf" if "inf" in new else "saturated")
                    return {"step": step, "rank": rank, "op": key, "kind": kind}
    return None


def construction_truth(tgt, ref):
    """Expected answers known by construction, located in the dumps by parent module."""
    name = tgt.name
    L = lambda i, sub: "Module.layers.%d.%s.forward.0" % (i, sub)
    blk = lambda i: "Module.layers.%d.TinyBlock.forward.0" % i
    e = {"first_divergence": None, "culprit": None, "first_overflow": None}
    extra = {}
    if name.startswith("weight_1pct") or name == "rank1_fault_stats":
        rank = 1 if name == "rank1_fault_stats" else 0
        op = tgt.find(0, rank, "Functional.linear", L(1, "fc1.Linear"))
        e["first_divergence"] = {"step": 0, "rank": rank, "op": op}
        e["culprit"] = {"step": 0, "rank": rank, "op": op, "kind": "parameter"}
        extra["parameter"] = "layers.1.fc1.weight"
    elif name.startswith("gelu_tanh"):
        op = tgt.find(0, 0, "Functional.gelu", blk(1))
        e["first_divergence"] = {"step": 0, "rank": 0, "op": op}
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "scalar"}  # a keyword in the target only
        assert tgt.data(0, 0)[op]["input_kwargs"] == {"approximate": {"type": "str", "value": "tanh"}}
        assert ref.data(0, 0)[op]["input_kwargs"] == {}
        extra["scalar_argument"] = {"op": op, "name": op + ".input.approximate", "value": "tanh", "ref_value": None}
    elif name == "ln_eps_stats":
        op = tgt.find(0, 0, "Functional.layer_norm", L(0, "ln2.LayerNorm"))
        e["first_divergence"] = {"step": 0, "rank": 0, "op": op}
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "scalar"}
        args = tgt.data(0, 0)[op]["input_args"]
        assert args[4] == {"type": "float", "value": 0.01}, args[4]
        assert ref.data(0, 0)[op]["input_args"][4] == {"type": "float", "value": 1e-05}
        extra["scalar_argument"] = {"op": op, "name": op + ".input.4", "value": 0.01, "ref_value": 1e-05}
    elif name == "no_mask_stats":
        soft = tgt.find(0, 0, "Functional.softmax", blk(1))
        mf = ref.find(0, 0, "Tensor.masked_fill", blk(1))
        assert mf not in tgt.data(0, 0)
        e["first_divergence"] = {"step": 0, "rank": 0, "op": soft}
        e["culprit"] = {"step": 0, "rank": 0, "op": mf, "kind": "missing_or_extra", "side": "ref"}
        extra["missing_in_target"] = [mf, mf.replace(".forward", ".backward")]
    elif name == "overflow_stats":
        op = tgt.find(0, 0, "Functional.linear", L(1, "fc2.Linear"))
        e["first_divergence"] = {"step": 0, "rank": 0, "op": op}
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "parameter"}
        e["first_overflow"] = {"step": 0, "rank": 0, "op": op, "kind": "inf"}
        extra["parameter"] = "layers.1.fc2.weight"
    elif name == "saturation_stats":
        fc1 = tgt.find(0, 0, "Functional.linear", L(1, "fc1.Linear"))
        fc2 = tgt.find(0, 0, "Functional.linear", L(1, "fc2.Linear"))
        out = tgt.data(0, 0)[fc2]["output"][0]
        assert out["Max"] == FMAX["torch.float32"] and out["Min"] == -FMAX["torch.float32"], out
        e["first_divergence"] = {"step": 0, "rank": 0, "op": fc1}
        e["culprit"] = {"step": 0, "rank": 0, "op": fc1, "kind": "parameter"}
        e["first_overflow"] = {"step": 0, "rank": 0, "op": fc2, "kind": "saturated"}
        extra["parameter"] = ["layers.1.fc1.weight", "layers.1.fc1.bias", "layers.1.fc2.weight", "layers.1.fc2.bias"]
    elif name.startswith("bf16"):
        # the first record whose output autocast computed in bf16
        first_bf16 = None
        for k, rec in tgt.data(0, 0).items():
            if any(isinstance(l, dict) and l.get("dtype") == "torch.bfloat16" for _, l in iter_leaves(out_part(rec))):
                first_bf16 = k
                break
        e["first_divergence"] = {"step": 0, "rank": 0, "op": first_bf16}
    elif name == "lr_stats":
        # step 0: forward/backward identical; the optimizer's first Tensor.add_ (update of
        # emb.weight, alpha=-lr) is the first record whose output differs
        add0 = next(k for k in tgt.data(0, 0) if tgt.parent(0, 0, k) == "optimizer")
        rec = tgt.data(0, 0)[add0]
        assert rec["input_kwargs"]["alpha"] == {"type": "float", "value": -1.0}, rec["input_kwargs"]
        assert ref.data(0, 0)[add0]["input_kwargs"]["alpha"] == {"type": "float", "value": -0.1}
        e["first_divergence"] = {"step": 0, "rank": 0, "op": add0}
        e["culprit"] = {"step": 0, "rank": 0, "op": add0, "kind": "scalar"}
        extra["scalar_argument"] = {"op": add0, "name": add0 + ".input.alpha", "value": -1.0, "ref_value": -0.1}
        emb = tgt.find(1, 0, "Functional.embedding", "Module.emb.Embedding.forward.0")
        extra["first_model_divergence"] = {"step": 1, "rank": 0, "op": emb, "kind": "parameter"}
    elif name == "extra_gelu_stats":
        gel = tgt.find(0, 0, "Functional.gelu", blk(0), nth=0)
        t0, r0 = tgt.data(0, 0), ref.data(0, 0)
        n_t = sum(1 for k in t0 if k.startswith("Functional.gelu.") and k.endswith(".forward"))
        n_r = sum(1 for k in r0 if k.startswith("Functional.gelu.") and k.endswith(".forward"))
        assert n_t == n_r + 1
        # renumbered real gelus carry the ref's values unchanged
        for i in range(n_r):
            assert _same(
                out_part(t0["Functional.gelu.%d.forward" % (i + 1)]), out_part(r0["Functional.gelu.%d.forward" % i])
            )
        e["first_divergence"] = {"step": 0, "rank": 0, "op": gel}
        e["culprit"] = {"step": 0, "rank": 0, "op": gel, "kind": "missing_or_extra", "side": "target"}
        extra["renumbered"] = {"Functional.gelu.%d" % (i + 1): "Functional.gelu.%d" % i for i in range(n_r)}
        extra["values_changed"] = False
    elif name == "data_batch_stats":
        # the token ids differ at step 0 only; the model differs from the embedding on. The culprit is the
        # data input itself: the op that consumes it, kind "input".
        emb = tgt.find(0, 0, "Functional.embedding", "Module.emb.Embedding.forward.0")
        e["first_divergence"] = {"step": 0, "rank": 0, "op": emb}
        e["culprit"] = {"step": 0, "rank": 0, "op": emb, "kind": "input"}
        extra["data_input"] = {"step": 0, "rank": 0, "op": emb, "name": emb + ".input.0"}
    elif name == "init_weight_stats":
        op = tgt.find(0, 0, "Functional.linear", L(0, "qkv.Linear"))
        e["first_divergence"] = {"step": 0, "rank": 0, "op": op}
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "parameter"}
        extra["parameter"] = ["layers.0.qkv.weight", "layers.0.qkv.bias"]
    elif name == "grad_explode_stats":
        # step 0 identical; at step 1 the loss is multiplied by the scale (a Tensor.__mul__ the ref lacks):
        # that extra op is where the target first differs, and what makes every gradient after it differ.
        mul = next(k for k in tgt.data(1, 0) if k not in ref.data(1, 0))
        assert mul.startswith("Tensor.__mul__."), mul
        e["first_divergence"] = {"step": 1, "rank": 0, "op": mul}
        e["culprit"] = {"step": 1, "rank": 0, "op": mul, "kind": "missing_or_extra", "side": "target"}
        extra["loss_scale"] = {"step": 1, "rank": 0, "op": mul, "scale": 1e4}
    return e, extra


def build_catalog(out_dir):
    dumps = {name: Dump(out_dir, name) for name in CASE_BY_NAME}
    cat = []
    for name, task, refname, steps, world, _faults, desc in CASES:
        entry = {
            "name": name,
            "path": name,
            "mode": task,
            "ref": refname,
            "steps": list(range(steps)),
            "ranks": list(range(world)),
            "fault": desc,
        }
        if refname is None:
            entry["expected"] = None
        else:
            tgt, ref = dumps[name], dumps[refname]
            truth, extra = construction_truth(tgt, ref)
            found = {"first_divergence": first_divergence(tgt, ref), "first_overflow": first_overflow(tgt, ref)}
            for k in ("first_divergence", "first_overflow"):
                if found[k] != truth[k]:
                    raise AssertionError("%s: %s by construction %r, from the dumps %r" % (name, k, truth[k], found[k]))
            entry["expected"] = dict(truth)
            entry["expected"].update(extra)
            if name in CHECKLIST_CASES:
                checklist, health = checklist_answers(tgt, ref), health_answers(tgt)
                checklist_construction(name, checklist, health)
                entry["expected"].update(checklist=checklist, health=health)
        cat.append(entry)
    # refs against themselves: nothing
    for name in ("ref_stats", "ref_tensor", "ref_2rank_stats"):
        d = dumps[name]
        assert first_divergence(d, d) is None and first_overflow(d, d) is None
    return cat


# ============================================================================
# part 3b: expected answers of the cross-device noise cases
# ============================================================================
def xdev_truth(tgt, ref, clean):
    """Answers known by construction for one device-B case; `clean` is the same device's fault-free run."""
    stem = tgt.name[len("xdev_") :].rsplit("_", 1)[0]
    L = lambda i, sub: "Module.layers.%d.%s.forward.0" % (i, sub)
    blk = lambda i: "Module.layers.%d.Block.forward.0" % i
    # device B rounds differently from the first bf16 matmul on (layer 0's q projection); which record is the
    # first to show it depends on the mode (statistics of a bf16 output can round to the same values), so the
    # first difference is read from the dumps and only its place is checked: a matmul-backed record of step 0,
    # no later than the fault's op
    first = first_divergence(tgt, ref)
    assert first["step"] == 0 and first["op"].split(".")[1] in ("linear", "__matmul__"), first
    e = {"first_divergence": first, "culprit": None, "first_overflow": None}
    extra, at = {}, None  # at: where the fault shows first against the clean run of the same device
    if stem == "weight5pct":
        op = tgt.find(0, 0, "Functional.linear", L(0, "wv.Linear"))
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "parameter"}
        extra["parameter"] = "layers.0.wv.weight"
        at = {"step": 0, "rank": 0, "op": op}
    elif stem == "no_mask":
        mf = ref.find(0, 0, "Tensor.masked_fill", blk(1))
        soft = tgt.find(0, 0, "Functional.softmax", blk(1))
        assert mf not in tgt.data(0, 0) and mf in clean.data(0, 0)
        e["culprit"] = {"step": 0, "rank": 0, "op": mf, "kind": "missing_or_extra", "side": "ref"}
        extra["missing_in_target"] = [mf, mf.replace(".forward", ".backward")]
        extra["first_consumer"] = {"step": 0, "rank": 0, "op": soft}
        at = {"step": 0, "rank": 0, "op": soft}
    elif stem == "ln_eps":
        op = tgt.find(0, 0, "Functional.layer_norm", L(0, "ln2.LayerNorm"))
        assert tgt.data(0, 0)[op]["input_args"][4] == {"type": "float", "value": 0.01}
        assert ref.data(0, 0)[op]["input_args"][4] == {"type": "float", "value": 1e-05}
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "scalar"}
        extra["scalar_argument"] = {"op": op, "name": op + ".input.4", "value": 0.01, "ref_value": 1e-05}
        at = {"step": 0, "rank": 0, "op": op}
    elif stem == "gelu_tanh":
        op = tgt.find(0, 0, "Functional.gelu", blk(1))
        assert tgt.data(0, 0)[op]["input_kwargs"] == {"approximate": {"type": "str", "value": "tanh"}}
        assert ref.data(0, 0)[op]["input_kwargs"] == {}
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "scalar"}
        extra["scalar_argument"] = {"op": op, "name": op + ".input.approximate", "value": "tanh", "ref_value": None}
        at = {"step": 0, "rank": 0, "op": op}
    elif stem == "lr":
        # step 0 (forward and backward) is the clean run's bit for bit; the update after it is 1.1x as large,
        # so step 1 starts from other parameters: its first record, the embedding, is where that shows
        op = tgt.find(1, 0, "Functional.embedding", "Module.emb.Embedding.forward.0")
        assert op == next(iter(tgt.data(1, 0)))
        e["culprit"] = {"step": 1, "rank": 0, "op": op, "kind": "optimizer"}
        extra["optimizer"] = {
            "name": "AdamW",
            "lr": 0.011,
            "ref_lr": XD_LR,
            "update_ratio": 1.1,
            "between_steps": [0, 1],
        }
        at = {"step": 1, "rank": 0, "op": op}
    else:
        assert stem in ("clean", "clean2"), stem
    if at is not None and at["step"] == 0:
        order = list(tgt.data(0, 0)) + list(ref.data(0, 0))
        assert order.index(first["op"]) <= order.index(at["op"]), (first, at)
    if clean is not tgt:
        # against the same device's clean run only the fault differs: nothing before its op, and its op or a
        # later record of that step differs (statistics of a bf16 output can hide a change below its rounding)
        got = first_divergence(tgt, clean)
        order = list(tgt.data(at["step"], 0))
        assert got and got["step"] == at["step"] and order.index(got["op"]) >= order.index(at["op"]), (
            "%s against %s: first difference %r, the fault is at %r" % (tgt.name, clean.name, got, at)
        )
        extra["against_clean"] = {"case": clean.name, "first_difference": got}
    return e, extra


def xdev_device(faults):
    return None if not faults.get("device") else dict(faults["device"])


def build_xdev_catalog(out_dir):
    """Catalog entries of the cross-device noise cases, checked against construction."""
    dumps = {c[0]: Dump(out_dir, c[0]) for c in XDEV_CASES}
    cat = []
    for name, task, refname, steps, world, faults, desc in XDEV_CASES:
        entry = {
            "name": name,
            "path": name,
            "mode": task,
            "ref": refname,
            "steps": list(range(steps)),
            "ranks": list(range(world)),
            "fault": desc,
            "kernels": xdev_device(faults),
        }
        if refname is None:
            entry["expected"] = None
            cat.append(entry)
            continue
        tgt, ref = dumps[name], dumps[refname]
        clean = dumps["xdev_clean_" + name.rsplit("_", 1)[1]] if faults.get("device") == XDEV_B1 else tgt
        truth, extra = xdev_truth(tgt, ref, clean)
        found = {"first_divergence": first_divergence(tgt, ref), "first_overflow": first_overflow(tgt, ref)}
        for k in ("first_divergence", "first_overflow"):
            if found[k] != truth[k]:
                raise AssertionError("%s: %s by construction %r, from the dumps %r" % (name, k, truth[k], found[k]))
        scalars = check_scalars(tgt, ref)
        if truth["culprit"] and truth["culprit"]["kind"] == "scalar":
            sa = extra["scalar_argument"]
            assert scalars["first"]["op"] == sa["op"] and scalars["first"]["name"] == sa["name"], scalars
            assert scalars["distinct"] == 1, scalars
        else:
            assert scalars["status"] == "pass", (name, scalars)
        entry["expected"] = dict(truth, **extra)
        cat.append(entry)
    return cat


# ============================================================================
# part 4: checklist and single-run health answers, computed independently from dump.json
# (the rules of dumpstore.analysis.checklist / health, restated here with the stdlib only)
# ============================================================================
CHECKLIST_CASES = ("data_batch_stats", "init_weight_stats", "lr_stats", "grad_explode_stats")
STATS = ("Max", "Min", "Mean", "Norm")
LOSS_OPS = {
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
}
INT_DTYPES = {"torch.int8", "torch.int16", "torch.int32", "torch.int64", "torch.uint8"}
EXPLODE, VANISH, UPDATE, GROWTH, GROWTH_STEPS, NEAR_MAX = 10.0, 1e-7, 0.1, 0.2, 3, 0.5
MASK_OPS = ("masked_fill", "where", "fill", "full", "triu", "tril")


def is_tensor(leaf):
    return isinstance(leaf, dict) and leaf.get("type") == "torch.Tensor"


def nan_key(v):
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def fingerprint(leaf):
    return (leaf.get("dtype"), tuple(leaf.get("shape") or ())) + tuple(nan_key(leaf.get(s)) for s in STATS)


def stats_equal(a, b):
    return all(_same(a.get(s), b.get(s)) for s in STATS)


def direction(key):
    if ".parameters_grad" in key:
        return "parameters_grad"
    return "backward" if ".backward" in key else "forward"


def module_path(key):
    """Module.layers.0.qkv.Linear.forward.0 -> layers.0.qkv"""
    body = key.split(".", 1)[1]
    for d in (".forward.", ".backward.", ".parameters_grad"):
        if d in body:
            body = body[: body.index(d)]
    return body.rsplit(".", 1)[0]


def counter_free(key):
    parts = key.split(".")
    if parts[0] == "Module":
        return key
    return ".".join(parts[:-2] + parts[-1:])  # Functional.gelu.1.forward -> Functional.gelu.forward


def input_leaves(key, rec):
    """(row name, leaf) of the inputs of a forward record, as dumpstore names them."""
    out = []
    for path, leaf in iter_leaves(rec.get("input_args", [])):
        out.append((key + ".input." + ".".join(str(p) for p in path), leaf))
    for path, leaf in iter_leaves(rec.get("input_kwargs", {})):
        out.append((key + ".input." + ".".join(str(p) for p in path), leaf))
    return out


def output_leaves(key, rec):
    if direction(key) == "parameters_grad":
        return [(key + "." + p[0], leaf) for p, leaf in iter_leaves(rec)]
    return [(key + ".output." + ".".join(str(p) for p in path), leaf) for path, leaf in iter_leaves(rec.get("output"))]


def forward_keys(d, step, rank):
    return [k for k in d.data(step, rank) if direction(k) == "forward" and d.parent(step, rank, k) != "optimizer"]


# -- checklist ---------------------------------------------------------------------------------------------
def data_leaves(d, step, rank):
    """Non-grad tensor inputs no earlier record output: the first record's, and integer ones anywhere."""
    data = d.data(step, rank)
    produced, cands, seen = set(), [], set()
    for key, rec in data.items():
        if key in forward_keys(d, step, rank):
            for name, leaf in input_leaves(key, rec):
                fp = fingerprint(leaf) if is_tensor(leaf) else None
                new = fp not in produced and fp not in seen
                if is_tensor(leaf) and not leaf.get("requires_grad") and new:
                    seen.add(fp)
                    cands.append((key, name, leaf))
        for _, leaf in output_leaves(key, rec):
            if is_tensor(leaf):
                produced.add(fingerprint(leaf))
    if not cands:
        return []
    first = cands[0][0]
    return [(n, l) for k, n, l in cands if k == first or l.get("dtype") in INT_DTYPES]


def leaf_named(d, step, rank, name):
    for key, rec in d.data(step, rank).items():
        if name.startswith(key + "."):
            for n, leaf in input_leaves(key, rec) + output_leaves(key, rec):
                if n == name:
                    return leaf
    return None


def check_data(tgt, ref):
    for step in range(tgt.nsteps):
        for rank in range(tgt.world):
            for name, leaf in data_leaves(tgt, step, rank):
                other = leaf_named(ref, step, rank, name)
                if other is None or not stats_equal(leaf, other):
                    return {"status": "differs", "step": step, "rank": rank, "name": name}
    return {"status": "pass"}


def module_params(d, step, rank):
    """{parameter name: leaf} from the first call of each module forward record."""
    out = {}
    for key, rec in d.data(step, rank).items():
        if key.startswith("Module.") and direction(key) == "forward":
            for pname, leaf in (rec.get("parameters") or {}).items():
                out.setdefault(module_path(key) + "." + pname, leaf)
    return out


def check_weights(tgt, ref):
    differ = []
    for rank in range(tgt.world):
        t, r = module_params(tgt, 0, rank), module_params(ref, 0, rank)
        differ += [p for p in t if p not in r or not stats_equal(t[p], r[p])]
    return {"status": "differs" if differ else "pass", "params": differ}


def check_structure(tgt, ref):
    t_only, r_only, shapes, dtypes, first = 0, 0, 0, 0, None
    for step in range(tgt.nsteps):
        for rank in range(tgt.world):
            t, r = tgt.data(step, rank), ref.data(step, rank)
            extra_t, extra_r = [k for k in t if k not in r], [k for k in r if k not in t]
            # this restatement holds without renumbering: the extra records' counter-free keys are new
            assert not ({counter_free(k) for k in extra_t} & {counter_free(k) for k in extra_r})
            t_only, r_only = t_only + len(extra_t), r_only + len(extra_r)
            if first is None and (extra_t or extra_r):
                first = {"step": step, "rank": rank, "op": (extra_t or extra_r)[0]}
            for key in (k for k in t if k in r):
                a = [l for _, l in input_leaves(key, t[key]) + output_leaves(key, t[key]) if is_tensor(l)]
                b = [l for _, l in input_leaves(key, r[key]) + output_leaves(key, r[key]) if is_tensor(l)]
                shapes += sum(1 for x, y in zip(a, b) if x.get("shape") != y.get("shape"))
                dtypes += sum(1 for x, y in zip(a, b) if x.get("dtype") != y.get("dtype"))
    differs = t_only or r_only or shapes or dtypes
    return {
        "status": "differs" if differs else "pass",
        "target_only_records": t_only,
        "ref_only_records": r_only,
        "shape_differences": shapes,
        "dtype_differences": dtypes,
        "first": first,
    }


def scalar_text(leaf):
    if leaf is None:
        return "None"
    return json.dumps(leaf.get("value"))


def check_scalars(tgt, ref):
    groups = []
    for step in range(tgt.nsteps):
        for rank in range(tgt.world):
            t, r = tgt.data(step, rank), ref.data(step, rank)
            for key in (k for k in t if k in r and direction(k) == "forward"):
                a = {n: l for n, l in input_leaves(key, t[key]) if not is_tensor(l)}
                b = {n: l for n, l in input_leaves(key, r[key]) if not is_tensor(l)}
                for n in list(a) + [n for n in b if n not in a]:
                    va = scalar_text(a[n]) if n in a else "(absent)"
                    vb = scalar_text(b[n]) if n in b else "(absent)"
                    if va == vb or (a.get(n) is None and b.get(n) is None):
                        continue
                    g = (counter_free(key), n[len(key) + 1 :], va, vb)
                    hit = next((x for x in groups if x["key"] == g), None)
                    if hit is None:
                        groups.append(
                            {"key": g, "count": 0, "first": {"step": step, "rank": rank, "op": key, "name": n}}
                        )
                        hit = groups[-1]
                    hit["count"] += 1
    if not groups:
        return {"status": "pass"}
    g = groups[0]
    return {
        "status": "differs",
        "first": g["first"],
        "arg": g["key"][1],
        "value": g["key"][2],
        "ref_value": g["key"][3],
        "count": g["count"],
        "distinct": len(groups),
    }


FLOAT_EPS = {"torch.float16": 2.0**-10, "torch.bfloat16": 2.0**-7, "torch.float32": 2.0**-23, "torch.float64": 2.0**-52}


def compute_dtype(d):
    counts, total = {}, 0
    for step in range(d.nsteps):
        for rank in range(d.world):
            for key in forward_keys(d, step, rank):
                for _, leaf in output_leaves(key, d.data(step, rank)[key]):
                    if is_tensor(leaf) and leaf.get("dtype") in FLOAT_EPS:
                        counts[leaf["dtype"]] = counts.get(leaf["dtype"], 0) + 1
                        total += 1
    common = [dt for dt, n in counts.items() if n >= 0.1 * total]
    return max(common, key=FLOAT_EPS.get).replace("torch.", "") if common else "float32"


def checklist_answers(tgt, ref):
    pt, pr = compute_dtype(tgt), compute_dtype(ref)
    same_cov = tgt.nsteps == ref.nsteps and tgt.world == ref.world
    return {
        "data": check_data(tgt, ref),
        "weights": check_weights(tgt, ref),
        "structure": check_structure(tgt, ref),
        "scalars": check_scalars(tgt, ref),
        "precision": {"status": "pass" if pt == pr else "differs", "target": pt, "ref": pr},
        "coverage": {"status": "pass" if same_cov else "differs"},
    }


# -- health ------------------------------------------------------------------------------------------------
def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return None if not n else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)


def finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def ordered_leaves(d, kinds):
    """(step, rank, order, key, name, leaf, kind) in execution order for the wanted leaf kinds."""
    out = []
    for step in range(d.nsteps):
        for rank in range(d.world):
            fwd = set(forward_keys(d, step, rank))
            for i, (key, rec) in enumerate(d.data(step, rank).items()):
                dirn = direction(key)
                if "grad" in kinds and dirn == "parameters_grad":
                    out += [(step, rank, i, key, n, l, "parameter") for n, l in output_leaves(key, rec)]
                if "grad" in kinds and dirn == "backward":
                    out += [(step, rank, i, key, n, l, "backward") for n, l in output_leaves(key, rec)]
                if "act" in kinds and key in fwd:
                    out += [(step, rank, i, key, n, l, "act") for n, l in output_leaves(key, rec)]
    return [x for x in out if is_tensor(x[5])]


def first_and_count(found):
    found.sort(key=lambda f: f[0])
    first = None
    if found:
        (step, rank, _, _), key, name = found[0][0], found[0][1], found[0][2]
        first = {"step": step, "rank": rank, "op": key, "name": name}
    return {"count": len(found), "first": first}


def grad_findings(d):
    explode, vanish, history = [], [], {}
    for step, rank, i, key, name, leaf, kind in ordered_leaves(d, ("grad",)):
        n = leaf.get("Norm")
        param = module_path(key) + "." + name.rsplit(".", 1)[1]
        tensor = (rank, param) if kind == "parameter" else (rank, name)
        past = history.setdefault(tensor, [])
        m = median([x for x in past if finite(x)])
        if finite(n) and m and n > EXPLODE * m:
            explode.append(((step, rank, i, 0), key, name))
        if finite(n) and n < VANISH:
            vanish.append(((step, rank, i, 0), key, name))
        past.append(n)
    return {"grad_explosion": first_and_count(explode), "grad_vanishing": first_and_count(vanish)}


def weight_findings(d):
    change, frozen, prev = [], [], {}
    for step in range(d.nsteps):
        for rank in range(d.world):
            seen = set()
            for i, (key, rec) in enumerate(d.data(step, rank).items()):
                if not (key.startswith("Module.") and direction(key) == "forward"):
                    continue
                for pname, w in (rec.get("parameters") or {}).items():
                    param = (rank, module_path(key) + "." + pname)
                    if param in seen:
                        continue
                    seen.add(param)
                    p = prev.get(param)
                    prev[param] = w
                    if p is None:
                        continue
                    name = key + ".parameters." + pname
                    diffs = [
                        abs(w["Norm"] - p["Norm"]),
                        abs(w["Mean"] - p["Mean"]) * math.sqrt(numel(w)),
                        abs(w["Max"] - p["Max"]),
                        abs(w["Min"] - p["Min"]),
                    ]
                    if all(finite(x) for x in (w["Norm"], w["Max"], w["Min"])) and stats_equal(w, p):
                        frozen.append(((step, rank, i, 0), key, name))
                    elif len(w["shape"]) >= 2 and p["Norm"] and max(diffs) / p["Norm"] > UPDATE:
                        change.append(((step, rank, i, 0), key, name))
    return {"weight_change": first_and_count(change), "weight_frozen": first_and_count(frozen)}


def numel(leaf):
    n = 1
    for s in leaf.get("shape") or ():
        n *= s
    return n


def activation_findings(d):
    growth, zero, series = [], [], {}
    for step, rank, i, key, name, leaf, _ in ordered_leaves(d, ("act",)):
        n = leaf.get("Norm")
        s = series.setdefault((rank, name), {"prev": None, "run": 0, "done": False})
        grew = finite(n) and s["prev"] is not None and s["prev"] > 0 and n > (1 + GROWTH) * s["prev"]
        s["run"] = s["run"] + 1 if grew else 0
        if s["run"] >= GROWTH_STEPS and not s["done"]:
            s["done"] = True
            growth.append(((step, rank, i, 0), key, name))
        s["prev"] = n
        if leaf.get("dtype") in FLOAT_EPS and leaf.get("Max") == 0 and leaf.get("Min") == 0 and numel(leaf):
            zero.append(((step, rank, i, 0), key, name))
    return {"activation_growth": first_and_count(growth), "all_zero": first_and_count(zero)}


def near_max_findings(d):
    found = []
    for step in range(d.nsteps):
        for rank in range(d.world):
            for i, (key, rec) in enumerate(d.data(step, rank).items()):
                leaves = output_leaves(key, rec)
                leaves += [(key + ".parameters." + p, l) for p, l in (rec.get("parameters") or {}).items()]
                for name, leaf in leaves:
                    fmax = FMAX.get(leaf.get("dtype")) if is_tensor(leaf) else None
                    vals = [abs(v) for v in (leaf.get("Max"), leaf.get("Min")) if finite(v)] if fmax else []
                    if vals and NEAR_MAX * fmax <= max(vals) < fmax:
                        found.append(((step, rank, i, 0), key, name))
    return {"near_dtype_max": first_and_count(found)}


def loss_series(d):
    out = []
    for step in range(d.nsteps):
        for rank in range(d.world):
            for key in forward_keys(d, step, rank):
                api = key.split(".")[1] if not key.startswith("Module.") else ""
                for name, leaf in output_leaves(key, d.data(step, rank)[key]):
                    if api in LOSS_OPS and is_tensor(leaf) and leaf.get("shape") == []:
                        out.append((step, rank, key, name, leaf.get("Mean")))
    return out


def loss_findings(d, series):
    bad, spike, past = [], [], {}
    for step, rank, key, name, v in series:
        h = past.setdefault((rank, key), [])
        m = median([x for x in h if finite(x)])
        order = ((step, rank, list(d.data(step, rank)).index(key), 0), key, name)
        if not finite(v):
            bad.append(order)
        elif m and v > EXPLODE * m:
            spike.append(order)
        h.append(v)
    return {"loss_nonfinite": first_and_count(bad), "loss_spike": first_and_count(spike)}


def overflow_findings(d):
    """Producers: clean tensor inputs, an output with NaN/inf/+-max (masking -inf, gradient records aside)."""
    found = []
    for step in range(d.nsteps):
        for rank in range(d.world):
            for i, (key, rec) in enumerate(d.data(step, rank).items()):
                if direction(key) == "parameters_grad":
                    continue
                ins = [l for _, l in iter_leaves(in_part(rec)) if is_tensor(l)]
                if any(leaf_flags(l) for l in ins):
                    continue
                for name, leaf in output_leaves(key, rec):
                    flags = leaf_flags(leaf)
                    neg_only = flags == {"inf"} and leaf.get("Max") != math.inf  # -inf only
                    mask_only = neg_only and key.split(".")[1] in MASK_OPS
                    if flags and not mask_only:
                        found.append(((step, rank, i, 0), key, name))
                        break
    return {"overflow": first_and_count(found)}


def health_answers(d):
    series = loss_series(d)
    out = {"loss": [v for _, _, _, _, v in series]}
    found = {}
    for part in (
        overflow_findings(d),
        grad_findings(d),
        weight_findings(d),
        activation_findings(d),
        near_max_findings(d),
        loss_findings(d, series),
    ):
        found.update(part)
    found["kernel"] = first_and_count([])  # a kernel finding needs `dumpstore replay`: no sample is replayed
    out["findings"] = found
    return out


def checklist_construction(name, checklist, health):
    """What the faults make true, checked against the answers computed above."""
    others = lambda keep: all(v["status"] == "pass" for k, v in checklist.items() if k not in keep)
    if name == "data_batch_stats":
        assert checklist["data"]["status"] == "differs" and checklist["data"]["step"] == 0, checklist["data"]
        assert checklist["data"]["name"] == "Functional.embedding.0.forward.input.0"
        assert others({"data"})
    elif name == "init_weight_stats":
        assert checklist["weights"]["params"] == ["layers.0.qkv.weight", "layers.0.qkv.bias"]
        assert others({"weights"})
    elif name == "lr_stats":
        assert checklist["scalars"]["arg"] == "input.alpha" and checklist["scalars"]["value"] == "-1.0"
        assert others({"scalars"})
    elif name == "grad_explode_stats":
        s = checklist["structure"]
        assert s["first"]["step"] == 1 and s["first"]["op"].startswith("Tensor.__mul__.")
        assert s["ref_only_records"] == 0
        assert others({"structure"})
        assert health["findings"]["grad_explosion"]["first"]["step"] == 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=HERE, help="output folder (default: this script's folder)")
    ap.add_argument("--cases", default=None, help="comma-separated subset to regenerate")
    ap.add_argument("--catalog-only", action="store_true", help="only rebuild catalog.json")
    ap.add_argument("--run-case", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_case:
        run_case_process(args.run_case, args.scratch)
        return
    out_dir = os.path.abspath(args.out)
    if not args.catalog_only:
        names = args.cases.split(",") if args.cases else [c[0] for c in CASES]
        for n in names:
            if n not in CASE_BY_NAME:
                raise SystemExit("unknown case %s" % n)
        generate(names, out_dir)
    if os.path.exists(os.path.join(out_dir, fixtures.ARCHIVES, fixtures.MANIFEST)):
        fixtures.unpack_all(Path(out_dir))  # the tensor cases not generated now, from their archives
    cat, xcat = build_catalog(out_dir), build_xdev_catalog(out_dir)
    with open(os.path.join(out_dir, "catalog.json"), "w") as f:
        json.dump(
            {
                "generator": "sample_dumps/generate.py",
                "msprobe": "26.2.0",
                "torch": "2.13.0",
                "cases": cat,
                "device_noise_cases": xcat,
            },
            f,
            indent=1,
        )
        f.write("\n")
    print("catalog.json written with %d cases and %d device-noise cases" % (len(cat), len(xcat)))


if __name__ == "__main__":
    main()

"""Tensor-mode msprobe dumps for `dumpstore replay`: clean runs and runs whose one kernel is wrong but plausible.

Each case trains a small transformer for one step under msprobe 26.2.0 (`task` tensor, `level` mix) on the CPU.
The faulty kernels are written at the aten level (a TorchDispatchMode that calls only `torch.ops.aten`, which
msprobe does not hook), so the Python-level API calls that msprobe records are exactly those of the clean run;
only the values of one op's output differ:

  clean_fp32, clean_bf16, clean_fp16   stock kernels, model weights and activations in that dtype
  gelu_tanh      fp32; every `F.gelu` (erf form) computed with the tanh approximation (another device's GELU)
  mean_bf16      fp32; the sequence mean (`Tensor.mean`) accumulated in bf16, one element at a time
  attn_noscale   bf16; `F.scaled_dot_product_attention` of layer 1 computed without its 1/sqrt(d) scale
  autocast_ln_bf16  fp32 weights under bf16 autocast, LayerNorm run at bf16 (a device's autocast policy; the CPU's
                 runs it in fp32): clean, replay must stay quiet
  autocast_mean_bf16  fp32 weights under bf16 autocast, the sequence mean accumulated in bf16

Run as a script: `python tests/replay_samples.py OUT_DIR [CASE ...]` (each case in its own subprocess: msprobe's
PrecisionDebugger is a per-process singleton). tests/test_replay.py makes them into a git-ignored folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CASES: dict[str, dict] = {
    "clean_fp32": {"dtype": "float32"},
    "clean_bf16": {"dtype": "bfloat16"},
    "clean_fp16": {"dtype": "float16"},
    "gelu_tanh": {"dtype": "float32", "fault": "gelu_tanh"},
    "mean_bf16": {"dtype": "float32", "fault": "mean_bf16"},
    "attn_noscale": {"dtype": "bfloat16", "fault": "attn_noscale", "layer": 1},
    "autocast_ln_bf16": {"dtype": "float32", "autocast": True, "fault": "ln_bf16"},
    "autocast_mean_bf16": {"dtype": "float32", "autocast": True, "fault": "mean_bf16"},
}
# the op each faulty case must be found at (record key), by replay alone
EXPECTED = {
    "gelu_tanh": "Functional.gelu.0.forward",
    "mean_bf16": "Tensor.mean.0.forward",
    "attn_noscale": "Functional.scaled_dot_product_attention.1.forward",
    "autocast_mean_bf16": "Tensor.mean.0.forward",
}
VOCAB, D_MODEL, HEADS, HIDDEN, LAYERS, BATCH, SEQ = 32, 32, 2, 64, 2, 2, 16


def _fault_mode(fault: str, layer: int | None):
    """A TorchDispatchMode computing one kernel wrongly, with aten ops only."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    def gelu_tanh(x):  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        inner = aten.mul.Tensor(
            aten.add.Tensor(x, aten.mul.Tensor(aten.pow.Tensor_Scalar(x, 3), 0.044715)), 0.7978845608
        )
        return aten.mul.Tensor(aten.mul.Tensor(x, 0.5), aten.add.Tensor(aten.tanh.default(inner), 1.0))

    def mean_bf16(x, dims, keepdim):
        (dim,) = dims
        acc = aten.select.int(aten._to_copy.default(x, dtype=torch.bfloat16), dim, 0)
        for i in range(1, x.shape[dim]):  # one bf16 rounding per element added
            acc = aten.add.Tensor(acc, aten._to_copy.default(aten.select.int(x, dim, i), dtype=torch.bfloat16))
        out = aten._to_copy.default(aten.div.Tensor(acc, x.shape[dim]), dtype=x.dtype)
        return aten.unsqueeze.default(out, dim) if keepdim else out

    class Fault(TorchDispatchMode):
        sdpa_calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if fault == "gelu_tanh" and func is aten.gelu.default and kwargs.get("approximate", "none") == "none":
                return gelu_tanh(args[0])
            if fault == "mean_bf16" and func is aten.mean.dim and args[0].dtype == torch.float32 and len(args[1]) == 1:
                return mean_bf16(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("keepdim", False))
            if fault == "ln_bf16" and func is aten.native_layer_norm.default and args[0].dtype == torch.float32:
                low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) else a for a in args]
                return tuple(t.to(torch.float32) for t in func(*low, **kwargs))
            if fault == "attn_noscale" and "scaled_dot_product" in func.__name__:
                Fault.sdpa_calls += 1
                if Fault.sdpa_calls - 1 == layer:
                    kwargs["scale"] = 1.0
            return func(*args, **kwargs)

    return Fault()


def _model(dtype):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
            self.fc1, self.fc2 = nn.Linear(D_MODEL, HIDDEN), nn.Linear(HIDDEN, D_MODEL)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, d_head]
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, D_MODEL))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.ln_f, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens):
            x = self.emb(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.ln_f(x).mean(dim=1))

    torch.manual_seed(0)
    return Net().to(getattr(torch, dtype))


def run_all(out: Path, big: int = 0) -> None:
    """All cases in this process, one msprobe step each (case i is `out/dump/step<i>`); with `big`, instead 4 steps
    of the clean bf16 model with `big` layers (bench/replay_speed.py)."""
    global LAYERS
    cases = list(CASES.values())
    if big:
        LAYERS, cases = big, [CASES["clean_bf16"]] * 4
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.chdir(out)
    dist.init_process_group("gloo", init_method=f"file://{out / '.pg_init'}", rank=0, world_size=1)
    from msprobe.pytorch import PrecisionDebugger

    config = {
        "task": "tensor",
        "dump_path": "./dump",
        "rank": [],
        "step": list(range(len(cases))),
        "level": "mix",
        "tensor": {"scope": [], "list": [], "data_mode": ["all"]},
    }
    (out / "config.json").write_text(json.dumps(config))
    debugger = PrecisionDebugger(config_path=str(out / "config.json"))
    for i, case in enumerate(cases):
        model = _model(case["dtype"])
        g = torch.Generator().manual_seed(1 + i)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH,), generator=g)
        fault = case.get("fault")
        mode = _fault_mode(fault, case.get("layer")) if fault else contextlib.nullcontext()
        debugger.start(model)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if case.get("autocast") else contextlib.nullcontext()
        with mode, amp:
            logits = model(tokens)
        F.cross_entropy(logits.float(), labels).backward()
        debugger.stop()
        debugger.step()
    dist.destroy_process_group()


def generate(out: Path, big: int = 0) -> dict[str, Path]:
    """Make the cases under `out` (kept when already made); returns {case: its step folder, a dump to ingest}; with
    `big`, {"big": the dump root of 4 steps of a `big`-layer clean bf16 model}."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # made again when this script changes
    done = out / ".complete"
    if not done.exists() or done.read_text() != stamp:
        shutil.rmtree(out / "dump", ignore_errors=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        cmd = [sys.executable, __file__, "--make", str(out), str(big)]
        proc = subprocess.run(cmd, env=env, capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"replay samples failed:\n{(proc.stdout + proc.stderr).decode(errors='replace')[-3000:]}"
            )
        done.write_text(stamp)
    if big:
        return {"big": out / "dump"}
    return {name: out / "dump" / f"step{i}" for i, name in enumerate(CASES)}


if __name__ == "__main__":
    if sys.argv[1] == "--make":
        run_all(Path(sys.argv[2]).resolve(), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    else:
        print(generate(Path(sys.argv[1]).resolve()))

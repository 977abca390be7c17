#!/usr/bin/env python
"""Fast synthetic msprobe statistics dumps at scale, with an injected divergence at a known step/rank/op.

Usage::

    python bench/synth.py --layers 1000 --steps 50 --ranks 8 --out DIR \
        [--fault-step 3 --fault-rank 5 --fault-layer 700 --fault-scale 1.01] [--jobs N] [--indent 1] [--copy]
    python bench/synth.py --tensors 4x16x16 --out DIR     # tensor-mode dump of large .pt files (ingest GB/s)

Writes two msprobe dump roots, DIR/ref and DIR/target (`step<S>/rank<R>/{dump.json,construct.json,stack.json}`,
task statistics, level mix, 26.x names) and DIR/manifest.json with the sizes and the expected answer.

What one step/rank file holds, modelled on a real mix-level dump (sample_dumps/ref_stats/step0/rank0):
  Functional.embedding + Module.emb.Embedding (int64 token ids: Mean/Norm null, as msprobe 26.x writes them);
  per layer L: Functional.linear.L (input_args [x, weight, bias]), Module.layers.L.fc.Linear.forward.0
  (input_args, output, parameters {weight, bias}), Functional.gelu.L, then, in turn,
  Functional.layer_norm (input_args [x, [int d], weight, bias, float eps] -- a nested list and a scalar),
  Torch.add (residual; input_kwargs {"alpha": int 1}), Functional.layer_norm, Tensor.mul (scalar input 0.5);
  the head Linear and Functional.cross_entropy (int64 labels, scalar kwargs); then the backward records in
  reverse order (Functional.*.backward, Module.*.parameters_grad.0 just before Module.*.backward.0) with
  null gradient leaves where autograd has none.  Activations flow: an op's input leaf is the producer's output
  leaf (same statistics), parameters are identical across ranks and change from step to step.
  About 28 rows per layer: 1000 layers give ~28k rows per file.
  construct.json maps each record to its parent module; stack.json groups forward records by call site.

The fault: in the target, at (--fault-step, --fault-rank), the output statistics of
Functional.linear.<fault-layer>.forward (its inputs unchanged) and of every later forward op are scaled by
--fault-scale, and every backward record of that step and rank too (the loss changed).  From the next step on
every rank differs (gradients are all-reduced, so all weights and activations move).  Files that are equal to
the reference's (earlier steps, other ranks of the fault step) are hard links to them unless --copy.
Expected first divergence and culprit: step fault-step, rank fault-rank, Functional.linear.<fault-layer>.forward
output.0, culprit kind `op` (its inputs agree, its output does not).

Output is plain `json.dumps` (compact, C encoder) unless --indent (msprobe writes indent=1; much slower).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

FLOAT = "torch.float32"
INT = "torch.int64"
HIDDEN = 256
BATCH, SEQ, VOCAB = 2, 128, 32000
KINDS = ("layer_norm", "add", "layer_norm", "mul")  # the extra op of layer L is KINDS[L % 4]
FRAMES = [
    (
        "File /opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py, line 1789, in _call_impl, \n "
        "return forward_call(*args, **kwargs)"
    ),
    (
        "File /opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py, line 1778, in _wrapped_call_impl, \n "
        "return self._call_impl(*args, **kwargs)"
    ),
    "File /home/user/job/train.py, line 88, in forward, \n x = layer(x)",
    "File /home/user/job/train.py, line 141, in train_step, \n loss = F.cross_entropy(model(tokens), labels)",
    "File /home/user/job/train.py, line 190, in main, \n train_step(batch)",
    "File /home/user/job/train.py, line 212, in <module>, \n main()",
]


# ---------------------------------------------------------------- leaves
class Gen:
    """Statistics of tensors, drawn from one seeded stream; `scale` perturbs float outputs (the fault)."""

    def __init__(self, seed: int, scale: float = 1.0):
        self.rng = np.random.default_rng(seed)
        self.buf = self.rng.random(1 << 16).tolist()
        self.i = 0
        self.scale = scale

    def u(self) -> float:
        if self.i == len(self.buf):
            self.buf = self.rng.random(1 << 16).tolist()
            self.i = 0
        self.i += 1
        return self.buf[self.i - 1]

    def tensor(self, shape: list[int], std: float, requires_grad: bool, scaled: bool = True) -> dict:
        n = math.prod(shape)
        s = std * (0.5 + self.u())
        mean = s * (self.u() - 0.5) * 0.1
        mx, mn = mean + s * (3.0 + self.u()), mean - s * (3.0 + self.u())
        norm = math.sqrt(n * (s * s + mean * mean))
        k = self.scale if scaled else 1.0
        return {
            "type": "torch.Tensor",
            "dtype": FLOAT,
            "shape": shape,
            "Max": mx * k,
            "Min": mn * k,
            "Mean": mean * k,
            "Norm": norm * k,
            "requires_grad": requires_grad,
        }

    def ints(self, shape: list[int], hi: int) -> dict:
        lo = int(self.u() * 3)
        return {
            "type": "torch.Tensor",
            "dtype": INT,
            "shape": shape,
            "Max": hi - 1 - lo,
            "Min": lo,
            "Mean": None,
            "Norm": None,
            "requires_grad": False,
        }


def scalar(kind: str, value) -> dict:
    return {"type": kind, "value": value}


# ---------------------------------------------------------------- one step/rank file
def params(layers: int, step: int, moved: bool) -> list[dict]:
    """Per-layer parameters (equal on every rank of a step); `moved`: after the fault step (weights differ)."""
    g = Gen(1_000_003 * step + 17, 1.0 + 1e-3 if moved else 1.0)
    d = HIDDEN
    out = []
    for _ in range(layers + 1):  # + head
        out.append(
            {
                "w": g.tensor([d, d], 0.02, True),
                "b": g.tensor([d], 0.01, True),
                "lnw": g.tensor([d], 1.0, True),
                "lnb": g.tensor([d], 0.01, True),
            }
        )
    out.append({"emb": g.tensor([VOCAB, d], 0.02, True), "head_w": g.tensor([VOCAB, d], 0.02, True)})
    return out


def render(
    layers: int, step: int, rank: int, mode: str, fault_layer: int, fault_scale: float, indent: int | None
) -> tuple[str, dict, dict]:
    """dump.json text, construct dict and stack groups of one step/rank.

    mode: 'ref' (reference values), 'at' (the fault step and rank: forward from fault_layer on and all backward
    perturbed), 'after' (a later step: everything perturbed).
    """
    moved = mode == "after"
    P = params(layers, step, moved)
    a = Gen(7919 * step + 104_729 * rank + 1, fault_scale if moved else 1.0)  # activations, forward
    d, act = HIDDEN, [BATCH, SEQ, HIDDEN]
    data: dict[str, dict] = {}
    construct: dict[str, str | None] = {}
    stacks: dict[str, list[str]] = {}

    def add(key: str, record: dict, parent: str | None = None, site: str | None = None) -> None:
        data[key] = record
        construct[key] = parent
        if site is not None:
            stacks.setdefault(site, []).append(key)

    tokens = a.ints([BATCH, SEQ], VOCAB)
    x = a.tensor(act, 1.0, True)
    emb = P[-1]["emb"]
    add(
        "Functional.embedding.0.forward",
        {
            "input_args": [tokens, emb, None, None, scalar("float", 2.0), scalar("bool", False), scalar("bool", False)],
            "input_kwargs": {},
            "output": [x],
        },
        "Module.emb.Embedding.forward.0",
        "embedding",
    )
    add(
        "Module.emb.Embedding.forward.0",
        {"input_args": [tokens], "input_kwargs": {}, "output": [x], "parameters": {"weight": emb}},
        None,
        "Module.Embedding",
    )
    counters = {"layer_norm": 0, "add": 0, "mul": 0}
    extra_keys: list[tuple[str, str]] = []
    for L in range(layers):
        if mode == "at" and L == fault_layer:
            a.scale = fault_scale  # this op's output and everything after it
        p = P[L]
        mod = f"Module.layers.{L}.fc.Linear.forward.0"
        y = a.tensor(act, 1.0, True)
        add(
            f"Functional.linear.{L}.forward",
            {"input_args": [x, p["w"], p["b"]], "input_kwargs": {}, "output": [y]},
            mod,
            "linear",
        )
        add(
            mod,
            {"input_args": [x], "input_kwargs": {}, "output": [y], "parameters": {"weight": p["w"], "bias": p["b"]}},
            None,
            "Module.Linear",
        )
        h = a.tensor(act, 0.7, True)
        add(f"Functional.gelu.{L}.forward", {"input_args": [y], "input_kwargs": {}, "output": [h]}, None, "gelu")
        kind = KINDS[L % 4]
        n = counters[kind]
        counters[kind] += 1
        out = a.tensor(act, 1.0, True)
        if kind == "layer_norm":
            key = f"Functional.layer_norm.{n}.forward"
            rec = {
                "input_args": [h, [scalar("int", d)], p["lnw"], p["lnb"], scalar("float", 1e-05)],
                "input_kwargs": {},
                "output": [out],
            }
        elif kind == "add":
            key = f"Torch.add.{n}.forward"
            rec = {"input_args": [x, h], "input_kwargs": {"alpha": scalar("int", 1)}, "output": [out]}
        else:
            key = f"Tensor.mul.{n}.forward"
            rec = {"input_args": [h, scalar("float", 0.5)], "input_kwargs": {}, "output": [out]}
        add(key, rec, None, kind)
        extra_keys.append((kind, key))
        x = out
    # head and loss
    hp = P[layers]
    logits = a.tensor([BATCH, SEQ, VOCAB], 2.0, True)
    add(
        f"Functional.linear.{layers}.forward",
        {"input_args": [x, P[-1]["head_w"], None], "input_kwargs": {}, "output": [logits]},
        "Module.head.Linear.forward.0",
        "linear",
    )
    add(
        "Module.head.Linear.forward.0",
        {"input_args": [x], "input_kwargs": {}, "output": [logits], "parameters": {"weight": P[-1]["head_w"]}},
        None,
        "Module.Linear",
    )
    labels = a.ints([BATCH, SEQ], VOCAB)
    loss = a.tensor([], 1.0, True)
    loss["shape"] = []
    add(
        "Functional.cross_entropy.0.forward",
        {
            "input_args": [logits, labels],
            "input_kwargs": {
                "ignore_index": scalar("int", -100),
                "reduction": scalar("str", "mean"),
                "label_smoothing": scalar("float", 0.0),
            },
            "output": [loss],
        },
        None,
        "cross_entropy",
    )
    del hp
    # backward (reverse order); gradients change whenever the loss did
    b = Gen(15_485_863 * step + 32_452_843 * rank + 5, fault_scale if mode in ("at", "after") else 1.0)
    g = b.tensor([BATCH, SEQ, VOCAB], 1e-3, False)
    add("Functional.cross_entropy.0.backward", {"input": [b.tensor([], 1.0, False)], "output": [g, None]})
    gx = b.tensor(act, 1e-3, False)
    add(
        f"Functional.linear.{layers}.backward",
        {"input": [g], "output": [None, gx, b.tensor([d, VOCAB], 1e-3, False)]},
        "Module.head.Linear.backward.0",
    )
    add("Module.head.Linear.parameters_grad.0", {"weight": [b.tensor([VOCAB, d], 1e-3, False)]})
    add("Module.head.Linear.backward.0", {"input": [g], "output": [gx]})
    for L in reversed(range(layers)):
        kind, key = extra_keys[L]
        bkey = key.replace(".forward", ".backward")
        gin = gx
        if kind == "layer_norm":
            gx = b.tensor(act, 1e-3, False)
            add(bkey, {"input": [gin], "output": [gx, b.tensor([d], 1e-3, False), b.tensor([d], 1e-3, False)]})
        elif kind == "add":
            gx = b.tensor(act, 1e-3, False)
            add(bkey, {"input": [gin], "output": [gin, gx]})
        else:
            gx = b.tensor(act, 1e-3, False)
            add(bkey, {"input": [gin], "output": [gx, None]})
        gy = b.tensor(act, 1e-3, False)
        add(f"Functional.gelu.{L}.backward", {"input": [gx], "output": [gy]})
        gw, gb, gxin = b.tensor([d, d], 1e-3, False), b.tensor([d], 1e-3, False), b.tensor(act, 1e-3, False)
        modb = f"Module.layers.{L}.fc.Linear.backward.0"
        add(f"Functional.linear.{L}.backward", {"input": [gy], "output": [gb, gxin, gw]}, modb)
        add(f"Module.layers.{L}.fc.Linear.parameters_grad.0", {"bias": [gb], "weight": [gw]})
        add(modb, {"input": [gy], "output": [gxin]})
        gx = gxin
    add(
        "Functional.embedding.0.backward",
        {"input": [gx], "output": [b.tensor([VOCAB, d], 1e-3, False)]},
        "Module.emb.Embedding.backward.0",
    )
    add("Module.emb.Embedding.parameters_grad.0", {"weight": [b.tensor([VOCAB, d], 1e-3, False)]})
    add("Module.emb.Embedding.backward.0", {"input": [gx], "output": [None]})
    doc = {"task": "statistics", "level": "mix", "framework": "pytorch", "dump_data_dir": None, "data": data}
    return json.dumps(doc, indent=indent), construct, stacks


def count_rows(record: dict) -> int:
    def walk(v) -> int:
        if v is None:
            return 1
        if isinstance(v, dict):
            return 1 if "type" in v else sum(walk(x) for x in v.values())
        if isinstance(v, list):
            return sum(walk(x) for x in v)
        return 1

    return sum(walk(v) for v in record.values())


def stack_doc(stacks: dict[str, list[str]]) -> dict:
    out = {}
    for i, (site, keys) in enumerate(stacks.items()):
        frames = [
            (
                f"File /opt/venv/lib/python3.11/site-packages/torch/nn/functional.py, line {2000 + i}, in {site}, "
                f"\n return torch._C._nn.{site}(input)"
            ),
            *FRAMES,
        ]
        out[str(i)] = [keys, frames]
    return out


# ---------------------------------------------------------------- large tensor files (tensor-mode ingest rate)
def tensor_dump(
    out: Path, units: int = 4, files_per_unit: int = 16, mb_per_file: int = 16, seed: int = 0, log=print
) -> dict:
    """An msprobe tensor-mode dump of large fp32 tensors: `units` rank folders of `files_per_unit` files.

    Each record `Functional.linear.<i>.forward` has one output leaf with statistics and a data_name; the
    files are `torch.save` of the tensor (msprobe's .pt) when torch is installed, else `.npy`.
    """
    t0 = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    try:
        import torch
    except ImportError:
        torch = None
    ext = ".pt" if torch is not None else ".npy"
    rng = np.random.default_rng(seed)
    cols = 1024
    rows = max(1, mb_per_file * (1 << 20) // (4 * cols))
    base = rng.standard_normal((rows, cols), dtype=np.float32)
    total = 0
    for r in range(units):
        d = out / "step0" / f"rank{r}"
        (d / "dump_tensor_data").mkdir(parents=True)
        data = {}
        for i in range(files_per_unit):
            arr = base * np.float32(1.0 + 0.01 * i + 0.1 * r)
            key = f"Functional.linear.{i}.forward"
            name = f"{key}.output.0{ext}"
            if torch is not None:
                torch.save(torch.from_numpy(arr).clone(), d / "dump_tensor_data" / name)
            else:
                np.save(d / "dump_tensor_data" / name, arr)
            total += arr.nbytes
            a64 = arr.astype(np.float64)
            data[key] = {
                "input_args": [],
                "input_kwargs": {},
                "output": [
                    {
                        "type": "torch.Tensor",
                        "dtype": FLOAT,
                        "shape": [rows, cols],
                        "Max": float(arr.max()),
                        "Min": float(arr.min()),
                        "Mean": float(a64.mean()),
                        "Norm": float(np.linalg.norm(a64)),
                        "requires_grad": False,
                        "data_name": name,
                    }
                ],
            }
        doc = {
            "task": "tensor",
            "level": "L1",
            "framework": "pytorch",
            "dump_data_dir": str(d / "dump_tensor_data"),
            "data": data,
        }
        (d / "dump.json").write_text(json.dumps(doc, indent=1))
    manifest = {
        "generator": "bench/synth.py tensor_dump",
        "units": units,
        "files_per_unit": files_per_unit,
        "mb_per_file": mb_per_file,
        "format": ext,
        "tensor_bytes": total,
        "generated_s": round(time.perf_counter() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(
        f"synth tensors {out}: {units} x {files_per_unit} files of {mb_per_file} MB ({ext}), "
        f"{total / 1e9:.2f} GB in {manifest['generated_s']} s"
    )
    return manifest


# ---------------------------------------------------------------- driver
def _write_unit(args: tuple) -> tuple[str, int, int]:
    out, side, step, rank, mode, layers, fault_layer, fault_scale, indent, aux = args
    d = Path(out) / side / f"step{step}" / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    text, _, _ = render(layers, step, rank, mode, fault_layer, fault_scale, indent)
    (d / "dump.json").write_text(text)
    for name in ("construct.json", "stack.json"):
        _link_or_copy(Path(aux) / name, d / name, copy=False)
    return side, step, rank


def _link_or_copy(src: Path, dst: Path, copy: bool) -> None:
    if dst.exists():
        dst.unlink()
    if not copy:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


def generate(
    out: Path,
    layers: int,
    steps: int,
    ranks: int,
    fault_step: int,
    fault_rank: int,
    fault_layer: int,
    fault_scale: float = 1.01,
    jobs: int | None = None,
    indent: int | None = None,
    copy: bool = False,
    log=print,
) -> dict:
    if not (0 <= fault_step < steps and 0 <= fault_rank < ranks and 0 <= fault_layer < layers):
        raise SystemExit(
            "the fault must lie inside the run: 0 <= fault-step < steps, 0 <= fault-rank < ranks, "
            "0 <= fault-layer < layers"
        )
    t0 = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    aux = out / "_aux"
    aux.mkdir(parents=True)
    text, construct, stacks = render(layers, 0, 0, "ref", fault_layer, fault_scale, None)
    doc = json.loads(text)
    rows = sum(count_rows(r) for r in doc["data"].values())
    records = len(doc["data"])
    (aux / "construct.json").write_text(json.dumps(construct, indent=indent))
    (aux / "stack.json").write_text(json.dumps(stack_doc(stacks), indent=indent))
    del text, doc
    tasks, links = [], []
    for step in range(steps):
        for rank in range(ranks):
            tasks.append((str(out), "ref", step, rank, "ref", layers, fault_layer, fault_scale, indent, str(aux)))
            if step < fault_step or (step == fault_step and rank != fault_rank):
                links.append((step, rank))
            else:
                mode = "at" if step == fault_step else "after"
                tasks.append((str(out), "target", step, rank, mode, layers, fault_layer, fault_scale, indent, str(aux)))
    n_jobs = max(1, jobs or os.cpu_count() or 1)
    done = 0
    with ProcessPoolExecutor(max_workers=n_jobs) as pool:
        for _ in pool.map(_write_unit, tasks, chunksize=1):
            done += 1
            if done % 50 == 0:
                log(f"  synth: {done}/{len(tasks)} files written ({time.perf_counter() - t0:.0f} s)")
    for step, rank in links:
        src = out / "ref" / f"step{step}" / f"rank{rank}"
        dst = out / "target" / f"step{step}" / f"rank{rank}"
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("dump.json", "construct.json", "stack.json"):
            _link_or_copy(src / name, dst / name, copy)
    dump_bytes = sum(p.stat().st_size for p in (out / "ref").rglob("dump.json"))
    manifest = {
        "generator": "bench/synth.py",
        "layers": layers,
        "steps": steps,
        "ranks": ranks,
        "hidden": HIDDEN,
        "records_per_file": records,
        "rows_per_file": rows,
        "files_per_side": steps * ranks,
        "rows_per_side": rows * steps * ranks,
        "dump_json_bytes_per_side": dump_bytes,
        "indent": indent,
        "fault": {"step": fault_step, "rank": fault_rank, "layer": fault_layer, "scale": fault_scale},
        "expected": {
            "step": fault_step,
            "rank": fault_rank,
            "first_divergence_op": f"Functional.linear.{fault_layer}.forward",
            "first_divergence_name": f"Functional.linear.{fault_layer}.forward.output.0",
            "culprit_kind": "op",
        },
        "generated_s": round(time.perf_counter() - t0, 1),
        "hard_links": not copy,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(
        f"synth {out}: {layers} layers x {steps} steps x {ranks} ranks, {rows} rows per file, "
        f"{manifest['rows_per_side']:,} rows per side, {dump_bytes / 1e9:.2f} GB dump.json per side, "
        f"in {manifest['generated_s']} s"
    )
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fault-step", type=int, default=None, help="default: steps // 2 (3 when steps > 6)")
    ap.add_argument("--fault-rank", type=int, default=None, help="default: ranks - 1 (5 when ranks == 8)")
    ap.add_argument("--fault-layer", type=int, default=None, help="default: 70%% of the layers")
    ap.add_argument("--fault-scale", type=float, default=1.01)
    ap.add_argument("--jobs", "-j", type=int, default=None)
    ap.add_argument("--indent", type=int, default=None, help="JSON indent (msprobe uses 1; slow)")
    ap.add_argument("--copy", action="store_true", help="write copies instead of hard links for equal files")
    ap.add_argument(
        "--tensors",
        metavar="UNITSxFILESxMB",
        default=None,
        help="instead: a tensor-mode dump of large fp32 files, e.g. 4x16x16 (4 ranks x 16 files x 16 MB)",
    )
    a = ap.parse_args(argv)
    if a.tensors:
        units, files, mb = (int(v) for v in a.tensors.lower().split("x"))
        tensor_dump(a.out, units, files, mb)
        return
    fs = a.fault_step if a.fault_step is not None else (3 if a.steps > 6 else a.steps // 2)
    fr = a.fault_rank if a.fault_rank is not None else (5 if a.ranks == 8 else a.ranks - 1)
    fl = a.fault_layer if a.fault_layer is not None else int(a.layers * 0.7)
    generate(a.out, a.layers, a.steps, a.ranks, fs, fr, fl, a.fault_scale, a.jobs, a.indent, a.copy)


if __name__ == "__main__":
    main()

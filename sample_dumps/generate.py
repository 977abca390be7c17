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
first overflow) by comparing each case with its reference, checks them against
what is known by construction, and writes ``catalog.json``.
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
CASES = [
    # name, task, ref, steps, world_size, faults, description
    ("ref_stats", "statistics", None, 3, 1, {}, "fp32 reference run, no fault."),
    ("weight_1pct_stats", "statistics", "ref_stats", 3, 1,
     {"weight_scale": {"layers.1.fc1.weight": 1.01}},
     "Parameter layers.1.fc1.weight multiplied by 1.01 before step 0."),
    ("gelu_tanh_stats", "statistics", "ref_stats", 3, 1, {"gelu_tanh": [1]},
     "Layer 1's GELU computed with approximate='tanh' instead of the exact erf form."),
    ("ln_eps_stats", "statistics", "ref_stats", 3, 1, {"ln2_eps": {0: 1e-2}},
     "Layer 0's second LayerNorm uses eps=1e-2 instead of 1e-5."),
    ("no_mask_stats", "statistics", "ref_stats", 3, 1, {"no_mask": [1]},
     "Layer 1's attention runs without the causal mask (no masked_fill call)."),
    ("overflow_stats", "statistics", "ref_stats", 3, 1, {"overflow_fc2": 1},
     "Layer 1's fc2 weight scaled so that its fp32 linear output overflows to inf "
     "from finite inputs; NaN/Inf then propagate."),
    ("saturation_stats", "statistics", "ref_stats", 3, 1, {"saturate_fc2": 1},
     "Simulated Ascend saturation mode: layer 1's fc1 unit 0 is made constant (zero weights, "
     "bias 16 -> gelu 16) and fc2 rows 0/1 map it to exactly +finfo.max / -finfo.max, so the "
     "fc2 linear outputs saturated values (no inf) from clean inputs."),
    ("bf16_stats", "statistics", "ref_stats", 3, 1, {"bf16": True},
     "Whole forward (and loss) under torch.autocast('cpu', dtype=torch.bfloat16); no fault."),
    ("lr_stats", "statistics", "ref_stats", 3, 1, {"lr": 1.0},
     "SGD learning rate 1.0 instead of 0.1: forward/backward of step 0 identical, the step-0 "
     "optimizer updates (Tensor.add_ with alpha=-lr) differ, the model differs from step 1 on."),
    ("extra_gelu_stats", "statistics", "ref_stats", 3, 1, {"extra_gelu": [0]},
     "One extra F.gelu call on layer 0's ln1 output whose result is discarded: renumbers later "
     "gelu records, changes no values."),
    ("ref_tensor", "tensor", None, 1, 1, {}, "fp32 reference run, no fault (tensor mode)."),
    ("weight_1pct_tensor", "tensor", "ref_tensor", 1, 1,
     {"weight_scale": {"layers.1.fc1.weight": 1.01}},
     "Parameter layers.1.fc1.weight multiplied by 1.01 before step 0 (tensor mode)."),
    ("bf16_tensor", "tensor", "ref_tensor", 1, 1, {"bf16": True},
     "Whole forward (and loss) under CPU autocast bf16; no fault (tensor mode)."),
    ("gelu_tanh_tensor", "tensor", "ref_tensor", 1, 1, {"gelu_tanh": [1]},
     "Layer 1's GELU computed with approximate='tanh' (tensor mode)."),
    ("ref_2rank_stats", "statistics", None, 2, 2, {},
     "2-process gloo run (no DDP, plain per-rank model, each rank its own batch), fp32 reference."),
    ("rank1_fault_stats", "statistics", "ref_2rank_stats", 2, 2,
     {"rank_weight_scale": {1: {"layers.1.fc1.weight": 1.01}}},
     "2-process run; only rank 1 multiplies layers.1.fc1.weight by 1.01 before step 0."),
]
CASE_BY_NAME = {c[0]: c for c in CASES}


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
        if "saturate_fc2" in faults:
            blk = model.layers[faults["saturate_fc2"]]
            blk.fc1.weight[0].zero_()
            blk.fc1.bias[0] = 16.0           # fc1 unit 0 == 16 for every token; gelu(16) == 16 exactly
            blk.fc2.weight[0:2].zero_()
            blk.fc2.bias[0:2] = 0.0
            blk.fc2.weight[0, 0] = fmax / 16  # 16 * (fmax / 16) == +fmax exactly
            blk.fc2.weight[1, 0] = -fmax / 16  # == -fmax exactly
    return model


def make_batches(steps, rank):
    import torch
    g = torch.Generator().manual_seed(DATA_SEED + rank)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH,), generator=g)
        out.append((tokens, labels))
    return out


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

    model = build_model(faults, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=faults.get("lr", LR))
    batches = make_batches(steps, rank)
    debugger = PrecisionDebugger(config_path=config_path)
    for tokens, labels in batches:
        debugger.start(model)
        if faults.get("bf16"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens), labels)
        else:
            loss = F.cross_entropy(model(tokens), labels)
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
    if world_size == 1:
        run_training(name, 0, 1, init_file)
    else:
        import torch.multiprocessing as mp
        mp.spawn(_spawn_entry, args=(name, world_size, init_file), nprocs=world_size, join=True)


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
                            value = rep + value[len(old):]
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
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--run-case", name,
                                  "--scratch", scratch], env=env, cwd=scratch,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if res.returncode != 0:
                print(res.stdout[-6000:])
                raise SystemExit("case %s failed (rc %d)" % (name, res.returncode))
            src = os.path.join(scratch, name)
            neutralise(src, scratch)
            dst = os.path.join(out_dir, name)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            shutil.move(src, dst)
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
        hits = [k for k in self.data(step, rank)
                if k.startswith(prefix + ".") and self.parent(step, rank, k) == parent]
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
                if not _TORCH.equal(_TORCH.nan_to_num(ta, nan=0.0), _TORCH.nan_to_num(tb, nan=0.0)) or \
                        not _TORCH.equal(ta.isnan(), tb.isnan()):
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
        e["culprit"] = {"step": 0, "rank": 0, "op": op, "kind": "op"}
        assert tgt.data(0, 0)[op]["input_kwargs"] == {"approximate": {"type": "str", "value": "tanh"}}
        assert ref.data(0, 0)[op]["input_kwargs"] == {}
        extra["scalar_argument"] = {"op": op, "name": op + ".input.approximate", "value": "tanh",
                                    "ref_value": None}
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
        extra["parameter"] = ["layers.1.fc1.weight", "layers.1.fc1.bias", "layers.1.fc2.weight",
                              "layers.1.fc2.bias"]
    elif name.startswith("bf16"):
        # the first record whose output autocast computed in bf16
        first_bf16 = None
        for k, rec in tgt.data(0, 0).items():
            if any(isinstance(l, dict) and l.get("dtype") == "torch.bfloat16"
                   for _, l in iter_leaves(out_part(rec))):
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
            assert _same(out_part(t0["Functional.gelu.%d.forward" % (i + 1)]),
                         out_part(r0["Functional.gelu.%d.forward" % i]))
        e["first_divergence"] = {"step": 0, "rank": 0, "op": gel}
        e["culprit"] = {"step": 0, "rank": 0, "op": gel, "kind": "missing_or_extra", "side": "target"}
        extra["renumbered"] = {"Functional.gelu.%d" % (i + 1): "Functional.gelu.%d" % i for i in range(n_r)}
        extra["values_changed"] = False
    return e, extra


def build_catalog(out_dir):
    dumps = {name: Dump(out_dir, name) for name in CASE_BY_NAME}
    cat = []
    for name, task, refname, steps, world, faults, desc in CASES:
        entry = {"name": name, "path": name, "mode": task, "ref": refname,
                 "steps": list(range(steps)), "ranks": list(range(world)), "fault": desc}
        if refname is None:
            entry["expected"] = None
        else:
            tgt, ref = dumps[name], dumps[refname]
            truth, extra = construction_truth(tgt, ref)
            found = {"first_divergence": first_divergence(tgt, ref),
                     "first_overflow": first_overflow(tgt, ref)}
            for k in ("first_divergence", "first_overflow"):
                if found[k] != truth[k]:
                    raise AssertionError("%s: %s by construction %r, from the dumps %r"
                                         % (name, k, truth[k], found[k]))
            entry["expected"] = dict(truth)
            entry["expected"].update(extra)
        cat.append(entry)
    # refs against themselves: nothing
    for name in ("ref_stats", "ref_tensor", "ref_2rank_stats"):
        d = dumps[name]
        assert first_divergence(d, d) is None and first_overflow(d, d) is None
    return cat


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
    cat = build_catalog(out_dir)
    with open(os.path.join(out_dir, "catalog.json"), "w") as f:
        json.dump({"generator": "sample_dumps/generate.py", "msprobe": "26.2.0", "torch": "2.13.0",
                   "cases": cat}, f, indent=1)
        f.write("\n")
    print("catalog.json written with %d cases" % len(cat))


if __name__ == "__main__":
    main()

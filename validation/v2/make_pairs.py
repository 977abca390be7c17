"""Validation set 2 for dumpstore's verdict: msprobe dumps of four model families the project does not use elsewhere.

Built apart from the development set and from validation set 1 (``validation/make_pairs.py``): other families
(Qwen2, Gemma, OPT, Qwen2-MoE with a shared expert), other dtype setups and other simulated devices
(``validation/v2/devices.py``: round-half-away casts, an unfused bias epilogue, activation lookup tables, a wide
accumulator, bf16x3 emulation of fp32 matmuls, fp16 chunk accumulation, Welford LayerNorm, softmax without max
subtraction, a blocked cross-entropy). Every pair is a reference run ("GPU": plain CPU torch in the family's dtype)
and a target run on the family's simulated device, with or without one fault. The answer of every case is known
by construction and written to ``<out>/key.json`` (the format of set 1, so ``validation/score.py`` scores it); the
culprit's msprobe record name is read from msprobe while the faulty call runs, never from dumpstore.

    .venv/bin/python validation/v2/make_pairs.py --out validation/v2/.data [--jobs 2] [--only CASE ...]

Each run is a fresh process forked from this one after torch, transformers and msprobe are imported (msprobe's
debugger is a process-wide singleton). Runs: 3 training steps, AdamW (weight decay 0.01), gradient clipping at 1.0,
optimizer step outside msprobe's window (forward + backward dumped), msprobe level "mix", statistics mode for
every case and tensor mode for a subset.

The run harness (the tracer that reads msprobe's record names, the forked runs, the structure check, the near-tie
crafting) follows set 1's and is copied, not imported, so that changes to set 1 do not change this set.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
harness = sys.modules.get("validation_harness")
if harness is None:  # the driver's shared pieces (the near-tie search), loaded once, by path
    _spec = importlib.util.spec_from_file_location("validation_harness", HERE.parent / "harness.py")
    harness = sys.modules["validation_harness"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(harness)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: nothing to download, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SET = 2
STEPS = 3
BATCH, SEQ, VOCAB = 2, 16, 96
LR, CLIP, WD, BETAS = 2e-3, 1.0, 0.01, (0.9, 0.999)
DATA_SEED = 4321

FAMILIES = {
    "qwen2": {
        "text": "Qwen2: GQA (4 query heads, 2 KV heads), bias on q/k/v, RMSNorm, SiLU MLP, RoPE; hidden 48, "
        "2 layers; pure bf16 (weights, activations and AdamW state)",
        "device": "E",
        "seed": 21,
    },
    "gemma": {
        "text": "Gemma: multi-query attention (4 heads, 1 KV head), GeGLU MLP with GELU(tanh), (1 + w) RMSNorm, "
        "embeddings x sqrt(hidden); hidden 48, 2 layers; fp32 weights under bf16 autocast",
        "device": "F",
        "seed": 22,
    },
    "opt": {
        "text": "OPT: learned positions, pre-LayerNorm, ReLU MLP, biases everywhere; hidden 48, 4 layers; fp32 "
        "weights under fp16 autocast with dynamic loss scaling (GradScaler, initial scale 2^10)",
        "device": "G",
        "seed": 23,
    },
    "qmoe": {
        "text": "Qwen2-MoE: 4 routed experts top-2 plus a sigmoid-gated shared expert (eager expert loop), GQA, "
        "q/k/v bias, RMSNorm; hidden 32, 2 layers; fp32",
        "device": "H",
        "seed": 24,
    },
}

# name -> family, reference variant ("flip": a router tilted to a near-tie, see craft_near_tie), fault (None:
# clean), dump modes. The expected culprit is derived in expectation() from what msprobe named at the faulty call.
CASES = {
    "qwen2_clean": ("qwen2", "base", None, ("stats", "tensor")),
    "gemma_clean": ("gemma", "base", None, ("stats", "tensor")),
    "opt_clean": ("opt", "base", None, ("stats", "tensor")),
    "qmoe_clean": ("qmoe", "base", None, ("stats",)),
    "qmoe_flip": ("qmoe", "flip", None, ("stats", "tensor")),
    # optimizer, from the second update on
    "qwen2_betas_step2": ("qwen2", "base", {"kind": "betas", "after_step": 1, "betas": (0.85, 0.95)}, ("stats",)),
    "gemma_wd_step2": ("gemma", "base", {"kind": "wd", "after_step": 1, "wd": 0.1}, ("stats", "tensor")),
    # an op in the target only, an op missing in the target
    "opt_extra_embed_scale": ("opt", "base", {"kind": "extra_embed_scale"}, ("stats", "tensor")),
    "gemma_missing_embed_scale": ("gemma", "base", {"kind": "missing_embed_scale"}, ("stats",)),
    "qmoe_norm_topk": ("qmoe", "base", {"kind": "norm_topk"}, ("stats",)),
    # a wrong variant, dtype, scale
    "gemma_gelu_exact": ("gemma", "base", {"kind": "act", "layer": 1}, ("stats", "tensor")),
    "qwen2_norm_bf16": ("qwen2", "base", {"kind": "norm_dtype", "layer": 1}, ("stats", "tensor")),
    "qwen2_attn_scale": ("qwen2", "base", {"kind": "attn_scale", "layer": 1}, ("stats", "tensor")),
    # parameters and data
    "qmoe_shared_up_step1": (
        "qmoe",
        "base",
        {"kind": "weight", "param": "model.layers.1.mlp.shared_expert.up_proj.weight", "step": 1, "how": "sign2pct"},
        ("stats",),
    ),
    "opt_fc2_row_step2": (
        "opt",
        "base",
        {"kind": "weight", "param": "model.decoder.layers.0.fc2.weight", "step": 2, "how": "row3zero"},
        ("stats",),
    ),
    "opt_qproj_transposed_L2": (
        "opt",
        "base",
        {"kind": "weight", "param": "model.decoder.layers.2.self_attn.q_proj.weight", "step": 0, "how": "transpose"},
        ("stats",),
    ),
    "gemma_labels_step2": ("gemma", "base", {"kind": "labels", "step": 2}, ("stats",)),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "row3zero": "row 3 zeroed (a lost slice of a shard)",
    "transpose": "loaded transposed (a checkpoint-conversion slip)",
}


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
class Tracer(harness.Tracer):
    """Set 2's record-name tracer (``harness.Tracer``) and the calls its key needs."""

    def install(self) -> None:
        """Wrap (after the device's replacements) the calls the key needs: parameter uses by linear, top-k,
        the loss and the pad of the labels."""
        import torch
        import torch.nn.functional as F

        lin, topk, ce, pad = F.linear, torch.topk, F.cross_entropy, F.pad
        tracer = self

        def linear(input, weight, bias=None):
            out = lin(input, weight, bias)
            tracer._param_use(weight)
            return out

        def cross_entropy(*args, **kwargs):
            out = ce(*args, **kwargs)
            tracer.mark("cross_entropy")
            return out

        def pad_fn(input, *args, **kwargs):
            out = pad(input, *args, **kwargs)
            if not input.dtype.is_floating_point:
                tracer.mark("labels_pad")
            return out

        F.linear, torch.topk, F.cross_entropy, F.pad = linear, tracer.topk_logged(topk), cross_entropy, pad_fn


def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    common = dict(vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager")
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            **common,
        )
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    elif family == "gemma":
        from transformers import GemmaConfig, GemmaForCausalLM
        from transformers.activations import GELUTanh

        cfg = GemmaConfig(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=12,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            **common,
        )
        model = GemmaForCausalLM(cfg)
        with torch.no_grad():  # Gemma's norms start at w = 0, i.e. a scale of 1 + w = 1; a trained model's are not 0
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.1)
        for m in model.modules():  # the activation looks F.gelu up at call time, so the device and msprobe see it
            if isinstance(m, GELUTanh):
                m.act = lambda x: torch.nn.functional.gelu(x, approximate="tanh")
    elif family == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        cfg = OPTConfig(
            hidden_size=48,
            word_embed_proj_dim=48,
            ffn_dim=192,
            num_hidden_layers=4,
            num_attention_heads=4,
            do_layer_norm_before=True,
            dropout=0.0,
            attention_dropout=0.0,
            activation_function="relu",
            **common,
        )
        model = OPTForCausalLM(cfg)
    else:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            output_router_logits=False,
            experts_implementation="eager",
            **common,
        )
        model = Qwen2MoeForCausalLM(cfg)
    model.train()
    return model


def batches(fault):
    """(input ids, labels) of each step; a labels fault changes two labels of one step (the inputs stay)."""
    import torch

    g = torch.Generator().manual_seed(DATA_SEED)
    ids = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    labels = [x.clone() for x in ids]
    if fault and fault["kind"] == "labels":
        lab = labels[fault["step"]]
        lab[1, 7] = (lab[1, 7] + 1) % VOCAB
        lab[1, 8] = (lab[1, 8] + 5) % VOCAB
    return ids, labels


def _hf(family: str):
    if family == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as hf
    elif family == "gemma":
        from transformers.models.gemma import modeling_gemma as hf
    elif family == "opt":
        from transformers.models.opt import modeling_opt as hf
    else:
        from transformers.models.qwen2_moe import modeling_qwen2_moe as hf
    return hf


def patch_attention(family: str, tracer: Tracer, fault) -> None:  # fault: the active one (targets) or None
    """Every run: the family's eager attention, call for call as in transformers, with marks (and the fault)."""
    import torch

    hf = _hf(family)
    repeat_kv = getattr(hf, "repeat_kv", None)
    kind = fault["kind"] if fault else None
    layer = fault.get("layer") if fault else None

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        li = module.layer_idx
        if repeat_kv is not None and hasattr(module, "num_key_value_groups"):
            key = repeat_kv(key, module.num_key_value_groups)
            value = repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query, key.transpose(-1, -2))
        tracer.mark("L%d.qk" % li)
        if kind == "attn_scale" and li == layer:
            scaling = scaling * scaling  # 1/head_dim where 1/sqrt(head_dim) is meant
        scores = scores * scaling
        tracer.mark("L%d.scale" % li)
        if attention_mask is not None:
            scores = scores + attention_mask
            tracer.mark("L%d.mask_add" % li)
        probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        tracer.mark("L%d.softmax" % li)
        probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        out = torch.matmul(probs, value)
        out = out.transpose(1, 2).contiguous()
        return out, probs

    hf.eager_attention_forward = attention


def family_faults(family: str) -> list[dict]:
    return [fault for fam, _, fault, _ in CASES.values() if fam == family and fault]


def _layers(family: str, model):
    return model.model.decoder.layers if family == "opt" else model.model.layers


def patch_modules(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch

    layers = _layers(family, model)
    emb = model.get_input_embeddings()
    emb_forward = emb.forward
    kinds = {f["kind"]: f for f in family_faults(family)}
    scale_on = active is not None and active["kind"] in ("extra_embed_scale", "missing_embed_scale")

    if family == "gemma":  # GemmaTextScaledWordEmbedding: embedding x sqrt(hidden), with a mark

        def embed(ids):
            out = torch.nn.Embedding.forward(emb, ids)
            tracer.mark("embedding")
            if not scale_on:
                out = out * emb.embed_scale.to(emb.weight.dtype)
                tracer.mark("embed_scale")
            return out

    else:

        def embed(ids):
            out = emb_forward(ids)
            tracer.mark("embedding")
            if family == "opt" and scale_on:  # Gemma's sqrt(hidden) scale, ported into OPT by mistake
                out = out * math.sqrt(out.shape[-1])
                tracer.mark("embed_scale")
            return out

    emb.forward = embed
    if "missing_embed_scale" in kinds:  # mark the first op of layer 0's input norm: the consumer of the embedding
        norm = layers[0].input_layernorm

        def norm0(x, norm=norm):
            xf = x.float()  # (msprobe does not record Tensor.float: the pow is the first record)
            sq = xf.pow(2)
            tracer.mark("L0.norm_in")
            out = xf * torch.rsqrt(sq.mean(-1, keepdim=True) + norm.eps)
            out = out * (1.0 + norm.weight.float())
            return out.type_as(x)

        norm.forward = norm0
    if "act" in kinds:  # the module stays (its record name too); its forward calls exact GELU in the faulty run
        li = kinds["act"]["layer"]
        on = active is not None and active["kind"] == "act"

        def act(x, on=on, tag="L%d.act" % li):
            y = torch.nn.functional.gelu(x, approximate="none" if on else "tanh")
            tracer.mark(tag)
            return y

        layers[li].mlp.act_fn.act = act
    if "norm_dtype" in kinds:  # Qwen2RMSNorm, call for call; the faulty run computes it in bf16 (no upcast)
        li = kinds["norm_dtype"]["layer"]
        norm = layers[li].post_attention_layernorm
        on = active is not None and active["kind"] == "norm_dtype"

        def rms(hidden_states, norm=norm, on=on, t="L%d.norm_" % li):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(input_dtype if on else torch.float32)  # msprobe records no Tensor.to
            variance = hidden_states.pow(2)
            tracer.mark(t + "pow")
            variance = variance.mean(-1, keepdim=True)
            tracer.mark(t + "mean")
            v = variance + norm.variance_epsilon
            tracer.mark(t + "eps")
            r = torch.rsqrt(v)
            tracer.mark(t + "rsqrt")
            hidden_states = hidden_states * r
            tracer.mark(t + "mul")
            return norm.weight * hidden_states.to(input_dtype)

        norm.forward = rms
    if "norm_topk" in kinds:  # Qwen2MoeTopKRouter, call for call; the faulty run normalises the top-k weights
        on = active is not None and active["kind"] == "norm_topk"
        for li, lay in enumerate(layers):
            router = lay.mlp.gate

            def route(hidden_states, router=router, on=on, li=li):
                hidden_states = hidden_states.reshape(-1, router.hidden_dim)
                router_logits = torch.nn.functional.linear(hidden_states, router.weight)
                router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
                router_top_value, router_indices = torch.topk(router_probs, router.top_k, dim=-1)
                if on:
                    total = router_top_value.sum(dim=-1, keepdim=True)
                    tracer.mark("L%d.topk_sum" % li)
                    router_top_value = router_top_value / total  # (an in-place /= msprobe would not record)
                    tracer.mark("L%d.topk_div" % li)
                router_top_value = router_top_value.to(router_logits.dtype)
                return router_logits, router_top_value, router_indices

            router.forward = route
    for fault in family_faults(family):
        if fault["kind"] == "weight":
            params = dict(model.named_parameters())
            tracer.watch[id(params[fault["param"]])] = (fault["param"], fault["step"])


def corrupt(model, fault) -> None:
    import torch

    p = dict(model.named_parameters())[fault["param"]]
    with torch.no_grad():
        if fault["how"] == "sign2pct":
            g = torch.Generator().manual_seed(7)
            sel = torch.rand(p.shape, generator=g) < 0.02
            p[sel] = -p[sel]
        elif fault["how"] == "row3zero":
            p[3].zero_()
        elif fault["how"] == "transpose":
            p.copy_(p.t().clone())
        else:
            raise ValueError(fault["how"])


FLIP_STEP = STEPS - 1  # the crafted tie is at the last step: the flip is the pair's only discrete difference


def _routers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """qmoe 'flip' variant, in both runs alike (``harness.craft_router_tie``): a tilt of layer 0's router weight,
    added before the last step, that ties one token's 2nd and 3rd experts in the reference to within a few fp32 ulps,
    chosen (by simulating both runs without msprobe) so that the device's rounding flips that token's choice and
    nothing else.

    Returns (what was done, the tilt to add to the router weight before step FLIP_STEP)."""
    import torch

    ids, labels = data
    return harness.craft_router_tie(
        model,
        _routers(model),
        device,
        lambda step: model(input_ids=ids[step], labels=labels[step]).loss,
        lambda step: model(input_ids=ids[step]),
        lambda: torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD),
        CLIP,
        FLIP_STEP,
        3,
        harness.ULPS,
    )


def write_config(path: Path, dump_dir: Path, mode: str) -> None:
    """msprobe's config of a run (``harness.write_config``)."""
    harness.write_config(path, dump_dir, mode, STEPS)


AUTOCAST = {"gemma": "bfloat16", "opt": "float16"}


def run_one(job: dict) -> dict:
    """One msprobe run; returns the marks and the top-k log. Runs in a fresh forked process."""
    import torch
    import torch.distributed as dist
    from devices import DEVICES

    family, variant, fault, role, mode = job["family"], job["variant"], job["fault"], job["role"], job["mode"]
    target = role == "target"
    out_dir, scratch = harness.start_child(job)

    tracer = Tracer()
    model = build_model(family)
    ids, labels = batches(fault if target else None)
    device = DEVICES[FAMILIES[family]["device"]]
    info: dict = {}
    tilt = None
    active = fault if target else None
    patch_attention(family, tracer, active)
    patch_modules(family, model, tracer, active)
    if variant == "flip":
        info["flip"], tilt = craft_near_tie(model, batches(None), device)
        tracer.marks.clear()  # the crafting's own forward calls are not the run's
    if target:
        device.install()
    tracer.install()

    from msprobe.pytorch import PrecisionDebugger

    write_config(scratch / "config.json", out_dir, mode)
    debugger = PrecisionDebugger(config_path=str(scratch / "config.json"))
    tracer.install_modules(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    kind = fault["kind"] if (fault and target) else None
    autocast = getattr(torch, AUTOCAST[family]) if family in AUTOCAST else None
    # fp16: dynamic loss scaling (the scaled loss is what backward sees, and what msprobe records)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if autocast == torch.float16 else None
    losses = []
    for step in range(STEPS):
        tracer.step = step
        if kind == "weight" and fault["step"] == step:
            corrupt(model, fault)
        if tilt is not None and step == FLIP_STEP:
            with torch.no_grad():
                _routers(model)[0].weight += tilt
        debugger.start(model)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(input_ids=ids[step], labels=labels[step])
        (scaler.scale(out.loss) if scaler else out.loss).backward()
        debugger.stop()
        if scaler:
            scaler.unscale_(opt)
        losses.append(float(out.loss.detach()))
        info.setdefault("grad_norm", []).append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if kind in ("betas", "wd") and step == fault["after_step"]:
            for group in opt.param_groups:
                if kind == "betas":
                    group["betas"] = tuple(fault["betas"])
                else:
                    group["weight_decay"] = fault["wd"]
        harness.optimizer_step(opt, scaler, info)
        debugger.step()
    dist.destroy_process_group()
    return {
        "job": job["name"],
        "marks": tracer.marks,
        "topk": tracer.topk,
        "leaf": tracer.leaf_modules(),
        "norm_module": {
            str(s): tracer.module_record("Module.model.layers.%d.post_attention_layernorm." % fault["layer"], s)
            for s in range(STEPS)
        }
        if fault and fault["kind"] == "norm_dtype"
        else {},
        "losses": losses,
        "info": info,
    }


def run_jobs(jobs: list[dict], n: int) -> dict:
    """Run jobs in forked children, at most n at a time (``harness.run_jobs``), each by this module's ``run_one``
    (looked up when the child runs); returns name -> result."""
    return harness.run_jobs(jobs, n, lambda job: run_one(job))


# =================================================================================================================
# the key
# =================================================================================================================
_names = harness.names


def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
    """What the verdict should say, from the marks both runs made at the faulty call."""
    if fault is None:
        return {"clean": True}
    kind = fault["kind"]

    def one(res, tag, step):
        names = _names(res, tag, step)
        if len(names) != 1 or names[0] is None:
            raise SystemExit("%s: mark %r at step %d: %r" % (case, tag, step, names))
        return names[0]

    def both(tag, step):
        return sorted({one(tgt, tag, step), one(ref, tag, step)})

    if kind in ("betas", "wd"):
        step = fault["after_step"] + 1
        what = (
            "AdamW betas %s instead of %s" % (tuple(fault["betas"]), BETAS)
            if kind == "betas"
            else ("AdamW weight decay %g instead of %g" % (fault["wd"], WD))
        )
        return {
            "step": step,
            "ops": [],
            "optimizer": True,
            "what": "%s in the updates after step %d: parameters first differ at step %d"
            % (what, fault["after_step"], step),
        }
    if kind == "extra_embed_scale":
        return {
            "step": 0,
            "ops": [one(tgt, "embed_scale", 0)],
            "what": "an extra x sqrt(hidden) on the token embeddings (Gemma's scale ported into OPT), target only",
        }
    if kind == "missing_embed_scale":
        return {
            "step": 0,
            "ops": [one(ref, "embed_scale", 0), one(tgt, "L0.norm_in", 0)],
            "what": "the embedding's x sqrt(hidden) is missing in the target (the reference's multiply; its consumer,"
            " the first op of layer 0's input norm, also counts)",
        }
    if kind == "norm_topk":
        return {
            "step": 0,
            "ops": sorted({one(tgt, "L0.topk_sum", 0), one(tgt, "L0.topk_div", 0)}),
            "what": "the router's top-k weights renormalised (norm_topk_prob) in the target only: an extra sum and "
            "divide in every MoE layer, the first in layer 0",
        }
    if kind == "act":
        return {
            "step": 0,
            "ops": both("L%d.act" % fault["layer"], 0),
            "what": "exact GELU instead of GELU(tanh) in layer %d's MLP" % fault["layer"],
        }
    if kind == "norm_dtype":
        t = "L%d.norm_" % fault["layer"]
        ops = sorted({op for part in ("pow", "mean", "eps", "rsqrt", "mul") for op in both(t + part, 0)})
        mods = sorted({r for res in (tgt, ref) for r in [res["norm_module"].get("0")] if r})
        return {
            "step": 0,
            "ops": ops,
            "modules": mods,
            "what": "layer %d's post-attention RMSNorm computed in bf16 (no upcast to fp32); any op of the norm "
            "from the square to the normalising multiply, or the norm module, counts" % fault["layer"],
        }
    if kind == "attn_scale":
        return {
            "step": 0,
            "ops": both("L%d.scale" % fault["layer"], 0),
            "what": "attention scores x 1/head_dim instead of 1/sqrt(head_dim) in layer %d" % fault["layer"],
        }
    if kind == "weight":
        tag = "uses:" + fault["param"]
        step = fault["step"]
        return {
            "step": step,
            "ops": both(tag, step),
            "what": "%s %s before step %d; the op is its first consumer" % (fault["param"], HOW[fault["how"]], step),
        }
    if kind == "labels":
        step = fault["step"]
        return {
            "step": step,
            "ops": sorted(set(both("labels_pad", step)) | set(both("cross_entropy", step))),
            "what": "two labels (not the input ids) differ in the batch of step %d; the pad of the labels (their "
            "first consumer) or the cross-entropy counts" % step,
        }
    raise ValueError(kind)


topk_flips = harness.topk_flips


_leaves = harness.leaves


def structure_differences(ref_dir: Path, tgt_dir: Path) -> list[str]:
    """Where two runs' dumps differ in records, leaf types, dtypes, shapes or requires_grad (values aside)."""
    return harness.structure_differences(ref_dir, tgt_dir, STEPS)


plan_jobs = harness.plan_jobs


def warm() -> None:
    """The imports made once, before forking (the forked runs use this copy of ``devices``)."""
    import devices  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from msprobe.pytorch import PrecisionDebugger  # noqa: F401
    from transformers import (  # noqa: F401
        GemmaForCausalLM,
        OPTForCausalLM,
        Qwen2ForCausalLM,
        Qwen2MoeForCausalLM,
    )
    from transformers.activations import GELUTanh  # noqa: F401


def device_table() -> dict:
    """This set's devices (``devices.DEVICES``)."""
    from devices import DEVICES

    return DEVICES


def main(argv=None) -> int:
    """Make the pairs and their key (``harness.main_routed``: one generation at a time in an output folder)."""
    return harness.main_routed(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

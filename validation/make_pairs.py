"""Held-out validation pairs for dumpstore's verdict: msprobe dumps of four Hugging Face model families.

Every pair is a reference run ("GPU": plain CPU torch in the family's dtype) and a target run on a simulated
device (``validation/devices.py``: other blocking, summation order, exp/erf/rsqrt formulas, stochastic
rounding), with or without one fault. The answer of every case is known by construction and written to
``<out>/key.json``; the culprit's msprobe record name is read from msprobe while the faulty call runs (both runs
mark the same call), so the key never depends on dumpstore.

    .venv/bin/python validation/make_pairs.py [--out validation/.data] [--jobs 2] [--only CASE ...] [--modes M ...]

Each run is a fresh process forked from this one after torch, transformers and msprobe are imported (msprobe's
debugger is a process-wide singleton). Runs: 3 training steps, AdamW, optimizer step and gradient clipping
outside msprobe's window (forward + backward dumped), msprobe level "mix", statistics mode for every case and
tensor mode for a subset.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
harness = sys.modules.get("validation_harness")
if harness is None:  # the driver's shared pieces (the near-tie search), loaded once, by path
    _spec = importlib.util.spec_from_file_location("validation_harness", HERE / "harness.py")
    harness = sys.modules["validation_harness"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(harness)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: nothing to download, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

STEPS = 3
BATCH, SEQ, VOCAB = 2, 16, 96
LR, CLIP = 2e-3, 1.0
DATA_SEED = 1234

# family -> model, dtype, device; every family is a transformers model built from a config (no download)
FAMILIES = {
    "llama": {
        "text": "Llama, GQA (4 query heads, 2 KV heads), RMSNorm, SiLU MLP, RoPE; hidden 48, 2 layers; pure bf16 "
        "(weights, activations and AdamW state)",
        "device": "A",
        "seed": 11,
    },
    "moe": {
        "text": "Mixtral MoE, 4 experts top-2 (eager expert loop), GQA, RMSNorm; hidden 32, 2 layers; fp32",
        "device": "B",
        "seed": 12,
    },
    "neox": {
        "text": "GPT-NeoX, LayerNorm, GELU, parallel residual, partial rotary (50 %); hidden 48, 2 layers; fp32 "
        "weights under bf16 autocast",
        "device": "C",
        "seed": 13,
    },
    "gpt2": {
        "text": "GPT-2, Conv1D (addmm) projections, learned positions, LayerNorm, tanh-GELU; hidden 48, 2 layers; "
        "fp32 weights under fp16 autocast with dynamic loss scaling (GradScaler, initial scale 2^12)",
        "device": "D",
        "seed": 14,
    },
}

# name -> family, reference variant ("flip": a router tilted to a near-tie, see craft_near_tie), fault (None:
# clean), dump modes; the expected culprit is derived in expectation() from what msprobe named at the faulty call
# fault kinds: eps, act, softmax_dtype, lr, weight, clip, extra_mul, data, missing_scale
CASES = {
    "llama_clean": ("llama", "base", None, ("stats", "tensor")),
    "moe_clean": ("moe", "base", None, ("stats",)),
    "neox_clean": ("neox", "base", None, ("stats", "tensor")),
    "moe_flip": ("moe", "flip", None, ("stats", "tensor")),
    "llama_rmsnorm_eps": ("llama", "base", {"kind": "eps", "layer": 1, "eps": 1e-5}, ("stats",)),
    "llama_silu_to_gelu": ("llama", "base", {"kind": "act", "layer": 1}, ("stats", "tensor")),
    "llama_softmax_dtype": ("llama", "base", {"kind": "softmax_dtype", "layer": 1}, ("stats",)),
    "llama_lr_step2": ("llama", "base", {"kind": "lr", "after_step": 1, "factor": 1.05}, ("stats",)),
    "moe_router_weight": (
        "moe",
        "base",
        {"kind": "weight", "param": "model.layers.1.mlp.gate.weight", "step": 0, "how": "row0x1.03"},
        ("stats",),
    ),
    "moe_vproj_step1": (
        "moe",
        "base",
        {"kind": "weight", "param": "model.layers.0.self_attn.v_proj.weight", "step": 1, "how": "sign3pct"},
        ("stats", "tensor"),
    ),
    "moe_grad_clip_step2": ("moe", "base", {"kind": "clip", "after_step": 1, "max_norm": 0.05}, ("stats", "tensor")),
    "moe_extra_mul": ("moe", "base", {"kind": "extra_mul", "layer": 1, "factor": 1.05}, ("stats",)),
    "neox_data_step1": ("neox", "base", {"kind": "data", "step": 1}, ("stats",)),
    "neox_missing_scale": ("neox", "base", {"kind": "missing_scale", "layer": 1}, ("stats", "tensor")),
    "neox_lr_step2": ("neox", "base", {"kind": "lr", "after_step": 1, "factor": 1.05}, ("stats",)),
    "gpt2_clean": ("gpt2", "base", None, ("stats", "tensor")),
    "gpt2_cfc_step1": (
        "gpt2",
        "base",
        {"kind": "weight", "param": "transformer.h.1.mlp.c_fc.weight", "step": 1, "how": "sign3pct"},
        ("stats",),
    ),
    "neox_ln_weight_step2": (
        "neox",
        "base",
        {"kind": "weight", "param": "gpt_neox.layers.0.post_attention_layernorm.weight", "step": 2, "how": "head8x1.1"},
        ("stats",),
    ),
}


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
class Tracer(harness.Tracer):
    """Set 1's record-name tracer (``harness.Tracer``) and the calls its key needs."""

    def install(self) -> None:
        import torch
        import torch.nn.functional as F

        lin, ln, topk, addmm = F.linear, F.layer_norm, torch.topk, torch.addmm
        tracer = self

        def addmm_fn(input, mat1, mat2, *, beta=1, alpha=1, out=None):
            res = addmm(input, mat1, mat2, beta=beta, alpha=alpha, out=out)
            tracer._param_use(mat2)
            return res

        def linear(input, weight, bias=None):
            out = lin(input, weight, bias)
            tracer._param_use(weight)
            return out

        def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
            out = ln(input, normalized_shape, weight, bias, eps)
            tracer._param_use(weight)
            return out

        F.linear, F.layer_norm, torch.topk, torch.addmm = linear, layer_norm, tracer.topk_logged(topk), addmm_fn


def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    elif family == "moe":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
            experts_implementation="eager",
        )
        model = MixtralForCausalLM(cfg)
    elif family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_embd=48,
            n_layer=2,
            n_head=4,
            n_positions=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = GPT2LMHeadModel(cfg)
    else:
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        from transformers.activations import GELUActivation

        cfg = GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            rotary_pct=0.5,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = GPTNeoXForCausalLM(cfg)
        for m in model.modules():  # the activation looks F.gelu up at call time, so msprobe records it
            if isinstance(m, GELUActivation):
                m.act = lambda x: torch.nn.functional.gelu(x)
    model.train()
    return model


def batches(fault):
    import torch

    g = torch.Generator().manual_seed(DATA_SEED)
    out = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    if fault and fault["kind"] == "data":
        ids = out[fault["step"]].clone()
        ids[0, 5] = (ids[0, 5] + 1) % VOCAB
        out[fault["step"]] = ids
    return out


def patch_attention(family: str, tracer: Tracer, fault) -> None:  # fault: the active one (targets) or None
    """Both runs: the family's eager attention, call for call as in transformers, with marks (and the fault)."""
    import torch

    if family == "gpt2":
        return  # transformers' own attention (no fault of this family is in it)
    if family == "llama":
        from transformers.models.llama import modeling_llama as hf
    elif family == "moe":
        from transformers.models.mixtral import modeling_mixtral as hf
    else:
        from transformers.models.gpt_neox import modeling_gpt_neox as hf
    repeat_kv = getattr(hf, "repeat_kv", None)
    kind = fault["kind"] if fault else None
    layer = fault.get("layer") if fault else None

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        li = module.layer_idx
        if repeat_kv is not None and hasattr(module, "num_key_value_groups"):
            key = repeat_kv(key, module.num_key_value_groups)
            value = repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query, key.transpose(2, 3))
        tracer.mark("L%d.qk" % li)
        if not (kind == "missing_scale" and li == layer):
            scores = scores * scaling
            tracer.mark("L%d.scale" % li)
        if attention_mask is not None:
            scores = scores + attention_mask
            tracer.mark("L%d.mask_add" % li)
        if kind == "softmax_dtype" and li == layer:
            probs = torch.nn.functional.softmax(scores, dim=-1)
        else:
            probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
        tracer.mark("L%d.softmax" % li)
        probs = probs.to(query.dtype)
        probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        out = torch.matmul(probs, value)
        out = out.transpose(1, 2).contiguous()
        return out, probs

    hf.eager_attention_forward = attention


def family_faults(family: str) -> list[dict]:
    return [fault for fam, _, fault, _ in CASES.values() if fam == family and fault]


def patch_modules(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls as transformers
    makes, so runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch

    layers = {"neox": lambda: model.gpt_neox.layers, "gpt2": lambda: model.transformer.h}.get(
        family, lambda: model.model.layers
    )()
    emb = model.get_input_embeddings()
    emb_forward = emb.forward

    def embed(ids):
        out = emb_forward(ids)
        tracer.mark("embedding")
        return out

    emb.forward = embed
    for fault in family_faults(family):
        on = fault is active
        kind = fault["kind"]
        if kind == "eps":
            norm = layers[fault["layer"]].post_attention_layernorm
            if on:
                norm.variance_epsilon = fault["eps"]
            tag = "L%d.eps_add" % fault["layer"]

            def rms(hidden_states, norm=norm, tag=tag):
                input_dtype = hidden_states.dtype
                hidden_states = hidden_states.to(torch.float32)
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                v = variance + norm.variance_epsilon
                tracer.mark(tag)
                hidden_states = hidden_states * torch.rsqrt(v)
                return norm.weight * hidden_states.to(input_dtype)

            norm.forward = rms
        elif kind == "act":  # the module stays (its record name too); its forward calls GELU in the faulty run
            tag = "L%d.act" % fault["layer"]

            def act(x, on=on, tag=tag):
                y = torch.nn.functional.gelu(x) if on else torch.nn.functional.silu(x)
                tracer.mark(tag)
                return y

            layers[fault["layer"]].mlp.act_fn.forward = act
        elif kind == "extra_mul":
            proj = layers[fault["layer"]].self_attn.o_proj

            def o_proj(x, on=on, proj_forward=proj.forward, fault=fault):
                if on:
                    x.mul_(fault["factor"])
                    tracer.mark("L%d.extra_mul" % fault["layer"])
                return proj_forward(x)

            proj.forward = o_proj
        elif kind == "weight":
            params = dict(model.named_parameters())
            tracer.watch[id(params[fault["param"]])] = (fault["param"], fault["step"])


HOW = {
    "row0x1.03": "row 0 x1.03",
    "sign3pct": "the sign of 3 % of the elements flipped",
    "head8x1.1": "the first 8 elements x1.1",
}


def corrupt(model, fault) -> None:
    import torch

    p = dict(model.named_parameters())[fault["param"]]
    with torch.no_grad():
        if fault["how"] == "row0x1.03":
            p[0].mul_(1.03)
        elif fault["how"] == "sign3pct":
            g = torch.Generator().manual_seed(5)
            sel = torch.rand(p.shape, generator=g) < 0.03
            p[sel] = -p[sel]
        elif fault["how"] == "head8x1.1":
            p[:8].mul_(1.1)
        else:
            raise ValueError(fault["how"])


FLIP_STEP = STEPS - 1  # the crafted tie is at the last step: the flip is the pair's only discrete difference


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """moe 'flip' variant, in both runs alike (``harness.craft_router_tie``): a tilt of layer 0's router weight,
    added before the last step, that ties one token's 2nd and 3rd experts in the reference to within a few fp32 ulps,
    chosen (by simulating both runs without msprobe) so that device B's rounding flips that token's choice and
    nothing else.

    Returns (what was done, the tilt to add to the router weight before step FLIP_STEP)."""
    import torch

    return harness.craft_router_tie(
        model,
        [m for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"],
        device,
        lambda step: model(input_ids=data[step], labels=data[step]).loss,
        lambda step: model(input_ids=data[step]),
        lambda: torch.optim.AdamW(model.parameters(), lr=LR),
        CLIP,
        FLIP_STEP,
        1,
        harness.ULPS[:17],
    )


def write_config(path: Path, dump_dir: Path, mode: str) -> None:
    """msprobe's config of a run (``harness.write_config``)."""
    harness.write_config(path, dump_dir, mode, STEPS)


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
    data = batches(fault if target else None)
    device = DEVICES[FAMILIES[family]["device"]]
    info: dict = {}
    tilt = None
    if variant == "flip":
        info["flip"], tilt = craft_near_tie(model, data, device)
    active = fault if target else None
    patch_attention(family, tracer, active)
    patch_modules(family, model, tracer, active)
    if target:
        device.install()
    tracer.install()

    from msprobe.pytorch import PrecisionDebugger

    write_config(scratch / "config.json", out_dir, mode)
    debugger = PrecisionDebugger(config_path=str(scratch / "config.json"))
    tracer.install_modules(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    kind = fault["kind"] if (fault and target) else None
    autocast = {"neox": torch.bfloat16, "gpt2": torch.float16}.get(family)
    # fp16: dynamic loss scaling (the scaled loss is what backward sees, and what msprobe records)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if autocast == torch.float16 else None
    losses = []
    for step in range(STEPS):
        tracer.step = step
        if kind == "weight" and fault["step"] == step:
            corrupt(model, fault)
        if tilt is not None and step == FLIP_STEP:
            with torch.no_grad():
                [m for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"][0].weight += tilt
        debugger.start(model)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(input_ids=data[step], labels=data[step])
        (scaler.scale(out.loss) if scaler else out.loss).backward()
        debugger.stop()
        if scaler:
            scaler.unscale_(opt)
        losses.append(float(out.loss.detach()))
        max_norm = CLIP
        if kind == "clip" and step >= fault["after_step"]:
            max_norm = fault["max_norm"]
        info.setdefault("grad_norm", []).append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        if kind == "lr" and step == fault["after_step"]:
            for group in opt.param_groups:
                group["lr"] = LR * fault["factor"]
        harness.optimizer_step(opt, scaler, info)
        debugger.step()
    dist.destroy_process_group()
    return {
        "job": job["name"],
        "marks": tracer.marks,
        "topk": tracer.topk,
        "leaf": tracer.leaf_modules(),
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

    if kind in ("lr", "clip"):
        step = fault["after_step"] + 1
        return {
            "step": step,
            "ops": [],
            "optimizer": True,
            "what": "%s changed in the update after step %d: parameters first differ at step %d"
            % (
                "learning rate x%g" % fault["factor"]
                if kind == "lr"
                else "gradient clipping at max_norm %g" % fault["max_norm"],
                fault["after_step"],
                step,
            ),
        }
    if kind == "eps":
        tag = "L%d.eps_add" % fault["layer"]
        what = "RMSNorm eps %g instead of 1e-6 in layer %d (post-attention norm)" % (fault["eps"], fault["layer"])
        return {"step": 0, "ops": sorted({one(tgt, tag, 0), one(ref, tag, 0)}), "what": what}
    if kind == "act":
        return {
            "step": 0,
            "ops": [one(tgt, "L%d.act" % fault["layer"], 0), one(ref, "L%d.act" % fault["layer"], 0)],
            "what": "GELU instead of SiLU in layer %d's MLP" % fault["layer"],
        }
    if kind == "softmax_dtype":
        tag = "L%d.softmax" % fault["layer"]
        return {
            "step": 0,
            "ops": sorted({one(tgt, tag, 0), one(ref, tag, 0)}),
            "what": "attention softmax in bf16 (no dtype=float32) in layer %d" % fault["layer"],
        }
    if kind == "weight":
        tag = "uses:" + fault["param"]
        step = fault["step"]
        return {
            "step": step,
            "ops": sorted({one(tgt, tag, step), one(ref, tag, step)}),
            "what": "%s corrupted (%s) before step %d; the op is its first consumer"
            % (fault["param"], HOW[fault["how"]], step),
        }
    if kind == "extra_mul":
        return {
            "step": 0,
            "ops": [one(tgt, "L%d.extra_mul" % fault["layer"], 0)],
            "what": "an extra in-place x.mul_(%g) on the input of layer %d's o_proj, in the target only"
            % (fault["factor"], fault["layer"]),
        }
    if kind == "data":
        step = fault["step"]
        return {
            "step": step,
            "ops": sorted({one(tgt, "embedding", step), one(ref, "embedding", step)}),
            "what": "one token id differs in the batch of step %d" % step,
        }
    if kind == "missing_scale":
        li = fault["layer"]
        missing = one(ref, "L%d.scale" % li, 0)
        consumer = one(tgt, "L%d.mask_add" % li, 0)
        return {
            "step": 0,
            "ops": [missing, consumer],
            "what": "attention scores not multiplied by 1/sqrt(head_dim) in layer %d (the reference's multiply "
            "is missing in the target; its consumer, the mask add, also counts)" % li,
        }
    raise ValueError(kind)


topk_flips = harness.topk_flips


_leaves = harness.leaves


def structure_differences(ref_dir: Path, tgt_dir: Path) -> list[str]:
    """Where two runs' dumps differ in records, leaf types, dtypes, shapes or requires_grad (values aside)."""
    return harness.structure_differences(ref_dir, tgt_dir, STEPS)


def warm() -> None:
    """The imports made once, before forking (the forked runs use this copy of ``devices``)."""
    import devices  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from msprobe.pytorch import PrecisionDebugger  # noqa: F401
    from transformers import GPTNeoXForCausalLM, LlamaForCausalLM, MixtralForCausalLM  # noqa: F401
    from transformers.activations import GELUActivation  # noqa: F401


def device_table() -> dict:
    """This set's devices (``devices.DEVICES``)."""
    from devices import DEVICES

    return DEVICES


def main(argv=None) -> int:
    """Make the pairs and their key (``harness.main_routed``: one generation at a time in an output folder)."""
    return harness.main_routed(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

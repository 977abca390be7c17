"""Validation set 6 for dumpstore's verdict: msprobe dumps of four model families no other set uses.

Built apart from the development set and from sets 1 to 5: other families (ConvNeXt V2, CLIP, RWKV, DeBERTa-v2: a
convolutional vision network with depthwise 7x7 convolutions, LayerNorm over channels and global response
normalisation; a two-tower contrastive model with a learned logit scale through exp; an attention-free recurrent
language model with the WKV time-mix recurrence; an encoder with disentangled relative attention trained as a
masked LM), other dtype and optimizer setups (LAMB with a built-in warmup and cosine decay over 3 micro-batches,
Adafactor under fp16 autocast with loss scaling, Lion in pure bf16, ASGD under bf16 autocast) and other simulated
devices (``validation/v6/devices.py``: GELU with a rational erf, a fused multiply-add LayerNorm epilogue, scaled
2-norms, a log1p log-sum-exp in the cross-entropy, a two-sided sigmoid, a table-driven exp, stochastic rounding of
the bf16 parameter store, an autocast policy with softmax in fp32). Every pair is a reference run ("GPU": plain CPU
torch in the family's dtype) and a target run on the family's simulated device, with or without one fault. The
answer of every case is known by construction and written to ``<out>/key.json`` (set 1's format, so
``validation/score.py`` scores it); the culprit's msprobe record name is read from msprobe while the faulty call
runs, never from dumpstore.

    .venv/bin/python validation/v6/make_pairs.py --out validation/v6/.data [--jobs 2] [--only CASE ...]

The driver (arguments, runs, checks, key, the training loop, one run) is ``validation/harness.py``; the run harness
(the tracer of msprobe's record names, the forked runs, msprobe's config, the structure check) is set 2's
``validation/v2/make_pairs.py``; the clean pairs' structure check of an "amp" variant (dtypes may differ) is the
driver's. What is here: the families, their optimizers and setups, the faults and the expected culprits. Runs: 3
training steps; forward and backward (every micro-batch where there are three) inside msprobe's window, clipping and
the optimizer step outside it; msprobe level "mix"; statistics mode for every case and tensor mode for a subset.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs: nothing to download, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

harness = sys.modules.get("validation_harness")
if harness is None:  # the driver (arguments, runs, checks, key), loaded once, by path
    _spec = importlib.util.spec_from_file_location("validation_harness", HERE.parent / "harness.py")
    harness = sys.modules["validation_harness"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(harness)
devices6 = harness._load("validation_v6_devices", HERE / "devices.py")  # this set's devices, under their own name
v2 = harness.set2()  # set 2's run harness
# set 5's generator: its GELU-at-call-time patch and its n-th mark reader
v5 = harness._load("validation_v5_make_pairs", HERE.parent / "v5" / "make_pairs.py")

SET = 6
STEPS = v2.STEPS  # 3
VOCAB = 96
IMAGES, SIZE, CLASSES = 2, 12, 10  # convnext: 2 images of 3x12x12 per micro-batch, 10 classes
PAIRS = 4  # clip: 4 image-caption pairs per batch
CAPTION = 8
RWKV_SEQ = 8
BATCH, SEQ = 2, 16  # deberta
WIDE_HIDDEN, WIDE_SEQ = 512, 64  # deberta_wide: the long reductions
MASK_ID, N_MASKED = 3, 4
LABEL_SMOOTHING = 0.1
CLIP = 1.0
DATA_SEED = 6173
DEVICES = devices6.DEVICES
NOISY_REF = "AD"
AMP_DEVICE = "AC"  # the "amp" variant's target: the family's device under another autocast policy
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as ConvNeXt's image processor normalises
STD = (0.229, 0.224, 0.225)
LOGIT_SCALE_INIT = 2.6592  # CLIP's ln(1 / 0.07)

FAMILIES = {
    "convnext": {
        "text": "ConvNeXt V2 (convolutional vision network): a 2x2 patchify stem (stride 2) with LayerNorm over "
        "channels, 2 stages (16 and 32 channels, one block each, a LayerNorm + 2x2 stride-2 downsampling between), "
        "blocks of a depthwise 7x7 convolution, LayerNorm (channels last), pointwise linear 4x, GELU, global response "
        "normalisation (a 2-norm over the spatial dimensions), pointwise linear; global average pooling, LayerNorm, "
        "a linear classifier (10 classes); 2 images of 3x12x12 per micro-batch normalised with ImageNet's mean and "
        "std inside the window; cross-entropy with label smoothing 0.1; fp32; gradient accumulation over 3 "
        "micro-batches; LAMB (lr 2e-3, weight decay 0.05, eps 1e-6) with a built-in schedule (linear warmup over 2 "
        "updates, cosine decay to 0.1 over 8); stage 1's GELU a memory-efficient custom autograd function "
        "(recomputes in backward); the batch's predicted classes (an argmax) inside the window",
        "device": "Y",
        "seed": 61,
    },
    "clip": {
        "text": "CLIP (two towers, contrastive): a ViT image tower (4x4 patches of 3x12x12 images, a class token, "
        "pre-LayerNorm before the blocks, post-LayerNorm on the class token) and a causal text tower (8-token "
        "captions, the end-of-text token's state pooled), both hidden 32 (4 heads, MLP 64, quick GELU), 2 and 1 "
        "layers, projections to 16; embeddings L2-normalised, logits scaled by exp(logit_scale), symmetric "
        "cross-entropy over 4 image-caption pairs; fp32 weights under fp16 autocast with dynamic loss scaling "
        "(GradScaler, initial scale 2^10); Adafactor (lr 1e-3, no parameter scaling, no relative step, update clipping "
        "1.0)",
        "device": "Z",
        "seed": 62,
    },
    "rwkv": {
        "text": "RWKV (attention-free recurrent LM): token shift and time-mix, the WKV recurrence (transformers' CPU "
        "kernel: a running maximum, exp and weighted sums per token, state in fp32), sigmoid receptance, a squared-"
        "ReLU channel mix, LayerNorm; hidden 32 (MLP 64), 2 layers; 8 tokens, batch 2; next-token cross-entropy; "
        "pure bf16 (weights, activations and optimizer state); Lion (lr 1e-3, betas 0.9 / 0.99, weight decay 0.01), "
        "a hand-written optimizer that stores its new parameters through the device",
        "device": "AA",
        "seed": 63,
    },
    "deberta": {
        "text": "DeBERTa-v2 (encoder, masked LM): disentangled attention (content-to-position and position-to-"
        "content terms over 8 log-bucketed relative positions, shared key projection, LayerNorm on the relative "
        "embeddings), post-LN blocks, GELU, tied output embeddings; hidden 32 (4 heads, MLP 64), 2 layers; 16 "
        "tokens, batch 2, 4 tokens per sequence masked; cross-entropy with label smoothing 0.1 over the masked "
        "tokens; fp32 weights under bf16 autocast; ASGD (lr 0.05, lambd 1e-4, alpha 0.75)",
        "device": "AB",
        "seed": 64,
    },
    "deberta_wide": {
        "text": "DeBERTa-v2 as above with long reductions: hidden 512 (8 heads of 64, MLP 1024), 2 layers; 64 "
        "tokens, batch 1 (linear sums of 512 and 1024 terms, LayerNorm over 512); bf16 autocast; ASGD",
        "device": "AB",
        "seed": 65,
    },
}

# name -> family, reference variant ("flip": the classifier tilted to a near-tie; "noisyref": the reference rerun on
# device AD; "amp": the target under another autocast policy, device AC), fault (None: clean), dump modes. The
# expected culprit comes from what msprobe named at the faulty call.
CASES = {
    "convnext_clean": ("convnext", "base", None, ("stats",)),
    "clip_clean": ("clip", "base", None, ("stats", "tensor")),
    "rwkv_clean": ("rwkv", "base", None, ("stats",)),
    "deberta_clean": ("deberta", "base", None, ("stats", "tensor")),
    "deberta_wide_clean": ("deberta_wide", "base", None, ("stats",)),
    "convnext_flip": ("convnext", "flip", None, ("stats",)),
    "clip_noisyref": ("clip", "noisyref", None, ("stats", "tensor")),
    "deberta_amp": ("deberta", "amp", None, ("stats", "tensor")),
    # optimizer, from the second update on
    "convnext_lr_step2": harness.optimizer_case("convnext", "lr", 1.1),
    "rwkv_lr_step2": harness.optimizer_case("rwkv", "lr", 1.05),
    "rwkv_betas_step2": harness.optimizer_case("rwkv", "betas", (0.95, 0.98)),
    "convnext_wd_step2": harness.optimizer_case("convnext", "weight_decay", 0.1),
    "deberta_wd_step2": harness.optimizer_case("deberta", "weight_decay", 0.01, harness.BOTH),
    "convnext_eps_step2": harness.optimizer_case("convnext", "eps", 1e-4),
    "clip_gradclip_step2": harness.optimizer_case("clip", "clip", 0.1),
    # an op in the target only, an op missing in the target
    "convnext_extra_rescale": ("convnext", "base", {"kind": "rescale"}, ("stats",)),
    "clip_missing_pre_ln": ("clip", "base", {"kind": "missing_pre_ln"}, ("stats", "tensor")),
    # a changed scalar argument
    "rwkv_ln_eps_L1": ("rwkv", "base", {"kind": "ln_eps", "layer": 1, "value": 1e-3}, ("stats",)),
    # a wrong kernel in one layer
    "convnext_dwconv_bf16_S1": ("convnext", "base", {"kind": "dwconv_bf16", "stage": 1}, ("stats",)),
    "clip_quickgelu_exact_L1": ("clip", "base", {"kind": "quickgelu_exact", "layer": 1}, ("stats", "tensor")),
    # backward only: a hand-written GELU backward with a wrong constant
    "convnext_gelu_backward_S1": ("convnext", "base", {"kind": "gelu_backward", "stage": 1}, ("stats",)),
    # parameters and data
    "rwkv_time_first_step1": harness.weight_case("rwkv", "rwkv.blocks.1.attention.time_first", 1, "from_layer0"),
    "clip_textproj_step2": harness.weight_case("clip", "text_projection.weight", 2, "sign2pct"),
    "clip_logit_scale_step1": harness.weight_case("clip", "logit_scale", 1, "reinit", harness.BOTH),
    "convnext_bgr_mb2_step2": ("convnext", "base", {"kind": "bgr", "step": 2, "micro": 1}, ("stats",)),
    "clip_caption_step1": ("clip", "base", {"kind": "ids", "step": 1}, ("stats", "tensor")),
    "deberta_labels_step2": ("deberta", "base", {"kind": "labels", "step": 2}, ("stats", "tensor")),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "from_layer0": "replaced by layer 0's (a resumed checkpoint's key mapped to the wrong layer)",
    "reinit": "reset to its initial value ln(1/0.07) (a resume that re-initialises it: the checkpoint lacks it)",
}
MICRO = {"convnext": 3}  # micro-batches per step
AUTOCAST = {"clip": "float16", "deberta": "bfloat16", "deberta_wide": "bfloat16"}
PURE_BF16 = {"rwkv"}
FLIP_STEP = STEPS - 1  # the crafted tie is at the last step
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
INV_SQRT_PI = 1.0 / math.sqrt(math.pi)  # the wrong constant of the faulty GELU backward


class Tracer(v2.Tracer):
    """Set 2's tracer (record names, marks, parameter uses by linear, the loss); parameter uses by conv2d and by
    ``Tensor.exp`` too, every argmax's output, and marks of "the next API record msprobe makes" (``mark_next``)."""

    def __init__(self):
        super().__init__()
        self.argmax: list[dict] = []
        self.pending: list[str] = []

    def mark_next(self, tag: str) -> None:
        self.pending.append(tag)

    def install(self) -> None:
        import torch
        import torch.nn.functional as F

        super().install()
        conv2d, texp = F.conv2d, torch.Tensor.exp
        tracer = self

        def conv2d_fn(input, weight, *args, **kwargs):
            out = conv2d(input, weight, *args, **kwargs)
            tracer._param_use(weight)
            return out

        def exp_fn(self):
            out = texp(self)
            tracer._param_use(self)
            return out

        F.conv2d, torch.Tensor.exp = conv2d_fn, exp_fn

    def install_modules(self, model) -> None:
        from msprobe.core.dump.data_dump.data_processor.base import BaseDataProcessor

        super().install_modules(model)
        tracer = self
        update = BaseDataProcessor.update_api_or_module_name

        def named(dp, name):
            out = update(dp, name)
            if tracer.pending and not name.startswith("Module.") and name.endswith(".forward"):
                for tag in tracer.pending:
                    tracer.marks.append({"step": tracer.step, "tag": tag, "record": name})
                tracer.pending = []
            return out

        BaseDataProcessor.update_api_or_module_name = named


# =================================================================================================================
# optimizers written here (as users write them)
# =================================================================================================================
def _optim_classes():
    import torch

    class LAMB(torch.optim.Optimizer):
        """LAMB (You et al.): Adam's bias-corrected direction plus weight decay, scaled per parameter by the trust
        ratio ||p|| / ||update||, with the learning-rate schedule built in: linear warmup over ``warmup`` updates,
        then cosine decay to 0.1 of the rate at ``total``."""

        def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, warmup=2, total=8):
            defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
            super().__init__(params, {**defaults, "warmup": warmup, "total": total})

        @staticmethod
        def factor(t: int, warmup: int, total: int) -> float:
            if t <= warmup:
                return t / warmup
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (total - warmup)))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                b1, b2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["step"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                    st["step"] += 1
                    t = st["step"]
                    m, v = st["m"], st["v"]
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"])
                    if group["weight_decay"]:
                        u = u + group["weight_decay"] * p
                    wn, un = float(p.norm()), float(u.norm())
                    trust = wn / un if wn > 0 and un > 0 else 1.0
                    p.sub_(u * (group["lr"] * self.factor(t, group["warmup"], group["total"]) * trust))

    class Lion(torch.optim.Optimizer):
        """Lion (Chen et al.): p <- p (1 - lr wd) - lr sign(b1 m + (1 - b1) g); m <- b2 m + (1 - b2) g; computed in
        fp32 from the bf16 parameter and state; the new parameter stored through the device
        (``devices6.store``: round to nearest, or the device's stochastic rounding)."""

        def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
            super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                b1, b2 = group["betas"]
                lr, wd = group["lr"], group["weight_decay"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["m"] = torch.zeros_like(p)
                    g, m = p.grad.float(), st["m"].float()
                    c = b1 * m + (1 - b1) * g
                    new = p.float() * (1 - lr * wd) - lr * torch.sign(c)
                    st["m"].copy_(b2 * m + (1 - b2) * g)
                    devices6.store(p, new)

    return LAMB, Lion


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    if family == "convnext":
        from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

        cfg = ConvNextV2Config(
            num_channels=3,
            patch_size=2,
            num_stages=2,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            hidden_act="gelu",
            drop_path_rate=0.0,
            image_size=SIZE,
            num_labels=CLASSES,
        )
        model = ConvNextV2ForImageClassification(cfg)
    elif family == "clip":
        from transformers import CLIPConfig, CLIPModel

        common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "hidden_act": "quick_gelu", "attention_dropout": 0.0}  # fmt: skip
        cfg = CLIPConfig(
            text_config={
                **common,
                "num_hidden_layers": 1,
                "vocab_size": VOCAB,
                "max_position_embeddings": 16,
                "bos_token_id": 0,
                "pad_token_id": 1,
                "eos_token_id": VOCAB - 1,
            },  # fmt: skip
            vision_config={**common, "image_size": SIZE, "patch_size": 4, "num_channels": 3},
            projection_dim=16,
            logit_scale_init_value=LOGIT_SCALE_INIT,
        )
        cfg._attn_implementation = "eager"
        cfg.text_config._attn_implementation = "eager"
        cfg.vision_config._attn_implementation = "eager"
        model = CLIPModel(cfg)
    elif family == "rwkv":
        from transformers import RwkvConfig, RwkvForCausalLM

        cfg = RwkvConfig(
            vocab_size=VOCAB,
            context_length=32,
            hidden_size=32,
            num_hidden_layers=2,
            attention_hidden_size=32,
            intermediate_size=64,
            layer_norm_epsilon=1e-5,
            rescale_every=0,
            tie_word_embeddings=False,
            use_cache=False,
        )
        model = RwkvForCausalLM(cfg).to(torch.bfloat16)
    else:
        from transformers import DebertaV2Config, DebertaV2ForMaskedLM

        wide = family == "deberta_wide"
        cfg = DebertaV2Config(
            vocab_size=VOCAB,
            hidden_size=WIDE_HIDDEN if wide else 32,
            num_hidden_layers=2,
            num_attention_heads=8 if wide else 4,
            intermediate_size=2 * WIDE_HIDDEN if wide else 64,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=WIDE_SEQ,
            type_vocab_size=0,
            relative_attention=True,
            position_buckets=8,
            max_relative_positions=-1,
            pos_att_type=["p2c", "c2p"],
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            position_biased_input=False,
            layer_norm_eps=1e-7,
            pad_token_id=0,
            attn_implementation="eager",
        )
        model = DebertaV2ForMaskedLM(cfg)
    v5._gelu_at_call_time(model)  # GELU modules look F.gelu up at call time (msprobe and the devices see it)
    model.train()
    return model


def batches(family: str, fault) -> list[list[dict]]:
    """Per step, per micro-batch: the model's inputs (``harness.draw_batches``). A data fault changes one step's
    batch (one micro-batch)."""
    out = harness.draw_batches(DATA_SEED, STEPS, MICRO.get(family, 1), lambda g: _micro_batch(family, g))
    if fault and fault["kind"] in ("bgr", "ids", "labels"):
        b = out[fault["step"]][fault.get("micro", 0)]
        if fault["kind"] == "bgr":  # one micro-batch's images loaded BGR (a loader that decodes with OpenCV)
            b["pixel_values"] = b["pixel_values"].flip(1)
        elif fault["kind"] == "ids":  # one caption token +1
            t = int(b["input_ids"][0, 3])
            b["input_ids"][0, 3] = t + 1 if t + 1 < VOCAB - 1 else 3
        else:  # two masked tokens' labels changed (+1)
            pos = b["masked"][0, :2]
            b["labels"][0, pos] = (b["labels"][0, pos] - 4 + 1) % (VOCAB - 4) + 4
    return out


def _micro_batch(family: str, g) -> dict:
    """One micro-batch of ``family``'s inputs, drawn from generator ``g``."""
    import torch

    if family == "convnext":
        px = torch.rand(IMAGES, 3, SIZE, SIZE, generator=g)
        return {"pixel_values": px, "labels": torch.randint(0, CLASSES, (IMAGES,), generator=g)}
    elif family == "clip":
        px = torch.randn(PAIRS, 3, SIZE, SIZE, generator=g) * 0.5
        ids = torch.randint(3, VOCAB - 1, (PAIRS, CAPTION), generator=g)
        ids[:, 0] = 0  # start of text
        ids[:, -1] = VOCAB - 1  # end of text (pooled)
        return {"pixel_values": px, "input_ids": ids}
    elif family == "rwkv":
        return {"input_ids": torch.randint(0, VOCAB, (BATCH, RWKV_SEQ), generator=g)}
    else:
        n, seq = (1, WIDE_SEQ) if family == "deberta_wide" else (BATCH, SEQ)
        ids = torch.randint(4, VOCAB, (n, seq), generator=g)
        pos = torch.stack([torch.randperm(seq, generator=g)[:N_MASKED] for _ in range(n)])
        labels = torch.full_like(ids, -100)
        labels.scatter_(1, pos, ids.gather(1, pos))
        inp = ids.scatter(1, pos, torch.full_like(pos, MASK_ID))
        return {"input_ids": inp, "labels": labels, "masked": pos}


def family_faults(family: str) -> list[dict]:
    return harness.family_faults(sys.modules[__name__], family)


def _wkv(tracer):
    """transformers' CPU WKV kernel (``rwkv_linear_attention_cpu``), call for call, with the first use of a watched
    ``time_first`` reported to the tracer."""
    import torch

    def wkv(time_decay, time_first, key, value, state=None, return_state=False):
        _, seq_length, _ = key.size()
        output = torch.zeros_like(key)
        num_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
        den_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
        max_state = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
        time_decay = -torch.exp(time_decay)
        for current_index in range(seq_length):
            current_key = key[:, current_index].float()
            current_value = value[:, current_index]
            k_u = current_key + time_first
            if current_index == 0:
                tracer._param_use(time_first)
            max_for_output = torch.maximum(max_state, k_u)
            e1 = torch.exp(max_state - max_for_output)
            e2 = torch.exp(current_key + time_first - max_for_output)
            numerator = e1 * num_state + e2 * current_value
            denominator = e1 * den_state + e2
            output[:, current_index] = (numerator / denominator).to(output.dtype)
            max_for_state = torch.maximum(max_state + time_decay, current_key)
            e1 = torch.exp(max_state + time_decay - max_for_state)
            e2 = torch.exp(current_key - max_for_state)
            num_state = e1 * num_state + e2 * current_value
            den_state = e1 * den_state + e2
            max_state = max_for_state
        return output, None

    return wkv


def patch(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch
    import torch.nn.functional as F

    on = lambda kind: active is not None and active["kind"] == kind  # noqa: E731

    if family == "convnext":
        for stage in model.convnextv2.encoder.stages:
            for layer in stage.layers:
                grn = layer.grn

                def grn_fwd(h, grn=grn):  # ConvNeXt-V2's own GRN (torch.norm): transformers' vector_norm, same math
                    gx = torch.norm(h, p=2, dim=(1, 2), keepdim=True)
                    nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
                    return grn.weight * (h * nx) + grn.bias + h

                grn.forward = grn_fwd
        layer = model.convnextv2.encoder.stages[1].layers[0]
        dw = layer.dwconv
        low = on("dwconv_bf16")

        def dw_fwd(x, dw=dw, low=low):  # the depthwise conv, its output made fp32 (a no-op in the reference)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):  # a kernel registered for bf16 only
                y = F.conv2d(x, dw.weight, dw.bias, dw.stride, dw.padding, dw.dilation, dw.groups)
            tracer.mark("dwconv")
            return y.float()

        dw.forward = dw_fwd
        const = INV_SQRT_PI if on("gelu_backward") else INV_SQRT_2PI

        class GeluME(torch.autograd.Function):
            """A memory-efficient GELU: saves the input only, recomputes the derivative in backward."""

            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return F.gelu(x)

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                cdf = 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
                pdf = torch.exp(-0.5 * x * x) * const
                tracer.mark("gelu_back.pdf")
                return grad * (cdf + x * pdf)

        layer.act.forward = lambda x: GeluME.apply(x)

    if family == "clip":
        vm = model.vision_model
        pre = vm.pre_layrnorm
        skip = on("missing_pre_ln")

        def pre_fwd(x, pre=pre, skip=skip):
            if skip:  # a port that drops CLIP's extra LayerNorm before the image tower's blocks
                tracer.mark_next("pre_ln_consumer")
                return x
            y = F.layer_norm(x, pre.normalized_shape, pre.weight, pre.bias, pre.eps)
            tracer.mark("pre_ln")
            return y

        pre.forward = pre_fwd
        for fault in family_faults(family):
            if fault["kind"] == "quickgelu_exact":
                mlp = vm.encoder.layers[fault["layer"]].mlp
                exact = on("quickgelu_exact")

                def act(x, exact=exact):
                    if exact:  # hidden_act "quick_gelu" mapped to the exact GELU (OpenCLIP's -quickgelu mix-up)
                        y = F.gelu(x)
                        tracer.mark("act")
                        return y
                    a = 1.702 * x
                    tracer.mark("act")
                    return x * torch.sigmoid(a)

                mlp.activation_fn.forward = act
        tm = model.text_model
        tm.register_forward_pre_hook(lambda m, a: tracer.mark_next("text_in"))
        harness.embed_mark(tracer, tm.embeddings.token_embedding, "embedding")

    if family == "rwkv":
        hf = harness.hf_module("rwkv")
        hf.rwkv_linear_attention = _wkv(tracer)
        for fault in family_faults(family):
            if fault["kind"] == "ln_eps":
                ln = model.rwkv.blocks[fault["layer"]].ln2
                eps = active["value"] if on("ln_eps") else ln.eps

                def ln_fwd(x, ln=ln, eps=eps):  # a port that reads another config key for this norm's eps
                    y = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, eps)
                    tracer.mark("ln")
                    return y

                ln.forward = ln_fwd

    harness.watch_weights(sys.modules[__name__], family, model, tracer)


def corrupt(model, fault) -> None:
    import torch

    params = dict(model.named_parameters())
    p = params[fault["param"]]
    with torch.no_grad():
        if fault["how"] == "from_layer0":
            p.copy_(params[fault["param"].replace(".1.", ".0.")])
        elif fault["how"] == "reinit":
            p.fill_(LOGIT_SCALE_INIT)
        else:
            harness.corrupt(model, fault, {})


def make_optimizer(family: str, model):
    import torch

    LAMB, Lion = _optim_classes()
    params = model.parameters()
    if family == "convnext":
        return LAMB(params, lr=2e-3, weight_decay=0.05, eps=1e-6)
    if family == "clip":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False,
                         clip_threshold=1.0)  # fmt: skip
    if family == "rwkv":
        return Lion(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    return torch.optim.ASGD(params, lr=0.05, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0)


def forward_loss(family: str, model, batch: dict, fault, tracer):
    """The model's loss and logits."""
    import torch
    import torch.nn.functional as F

    kind = fault["kind"] if fault else None
    mark = tracer.mark if tracer is not None else (lambda tag: None)
    if family == "convnext":
        px = batch["pixel_values"]
        if kind == "rescale":  # the image processor's 1/255 applied to images the loader already scaled to [0, 1]
            px = px * (1.0 / 255.0)
            mark("rescale")
        px = px - torch.tensor(MEAN).view(1, 3, 1, 1)
        mark("px_sub")
        px = px / torch.tensor(STD).view(1, 3, 1, 1)
        logits = model(pixel_values=px).logits
        return F.cross_entropy(logits, batch["labels"], label_smoothing=LABEL_SMOOTHING), logits
    if family == "clip":
        out = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], return_loss=True)
        return out.loss, out.logits_per_text
    if family == "rwkv":
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return loss, logits
    logits = model(input_ids=batch["input_ids"]).logits
    lab = batch["labels"].reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), lab, label_smoothing=LABEL_SMOOTHING)
    return loss, logits


OPTIMIZER_KINDS = ("lr", "clip", "betas", "weight_decay", "eps")
ARGMAX_FAMILY = "convnext"  # the batch's predicted classes, an argmax over the logits inside the window


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """convnext 'flip' variant, in both runs alike: a tilt of one row of the classifier, added before the last step,
    that ties one image's top-2 logits in the reference to within a few fp32 ulps, chosen (by simulating both runs
    without msprobe) so that the device's rounding flips that image's predicted class and no other
    (``harness.craft_near_tie`` on each step's first micro-batch: the generator checks all three).

    Returns (what was done, the tilt to add to the classifier's weight before step FLIP_STEP)."""
    return harness.craft_first_micro(sys.modules[__name__], "convnext", model, model.classifier, data, device)


def flip_head(model):
    return model.classifier


# =================================================================================================================
# the key
# =================================================================================================================
def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
    """What the verdict should say about a fault, from the marks both runs made at the faulty call."""
    kind = fault["kind"]
    one, first, both = harness.mark_readers(case, tgt, ref)
    if kind in OPTIMIZER_KINDS:
        what = {
            "betas": "Lion betas %s instead of (0.9, 0.99)",
            "weight_decay": "weight decay %g instead of "
            + ("0.05 (LAMB)" if case.startswith("convnext") else "0 (ASGD)"),
            "eps": "LAMB eps %g instead of 1e-6",
        }
        return harness.optimizer_expectation(fault, harness.optimizer_what(fault, CLIP, what))
    if kind == "rescale":
        return {
            "step": 0,
            "ops": [first(tgt, "rescale", 0)],
            "what": "the images rescaled by 1/255 in the target only (the image processor's rescale applied to images "
            "the loader already scaled to [0, 1]): an extra multiply, the first record the reference does not have",
        }
    if kind == "missing_pre_ln":
        ln, nxt = first(ref, "pre_ln", 0), first(tgt, "pre_ln_consumer", 0)
        what = (
            "the image tower's LayerNorm before the blocks (pre_layrnorm) missing in the target (a port that drops "
            "it): the reference's layer_norm; its consumer in the target, block 0's first LayerNorm, also counts"
        )
        return harness.missing_op_expectation(ref, ln, tgt, nxt, what)
    if kind == "ln_eps":
        return {
            "step": 0,
            "ops": both("ln", 0),
            "what": "block %d's channel-mix LayerNorm (ln2) with eps %g instead of 1e-5 (a scalar argument)"
            % (fault["layer"], fault["value"]),
        }
    if kind == "dwconv_bf16":
        return {
            "step": 0,
            "ops": both("dwconv", 0, first),
            "what": "stage %d's depthwise 7x7 convolution computed in bf16 (a kernel registered for bf16 only: its "
            "inputs cast down, its output bf16, then upcast) in the fp32 model (the first micro-batch's)"
            % fault["stage"],
        }
    if kind == "quickgelu_exact":
        return {
            "step": 0,
            "ops": both("act", 0),
            "what": "the image tower's block %d MLP activation: exact GELU instead of quick GELU x sigmoid(1.702 x) "
            "(the reference's first op of quick GELU, the multiply by 1.702; the target's gelu)" % fault["layer"],
        }
    if kind == "gelu_backward":
        return {
            "step": 0,
            "ops": both("gelu_back.pdf", 0, first),
            "backward_only": True,
            "what": "stage %d's memory-efficient GELU (a custom autograd function) with a wrong constant in its "
            "hand-written backward: the density's 1/sqrt(2 pi) written 1/sqrt(pi); the forward is the same; the "
            "multiply by the constant (recorded after the loss, the first micro-batch's) is the culprit"
            % fault["stage"],
        }
    if kind == "weight":
        return harness.weight_expectation(fault, HOW[fault["how"]], both)
    if kind == "bgr":
        step, mb = fault["step"], fault["micro"]
        return harness.data_expectation(
            fault,
            sorted({v5._nth(case, r, "px_sub", step, mb) for r in (tgt, ref)}),
            "micro-batch %d's images with their colour channels reversed (BGR) in step %%d (one loader shard "
            "decoding with OpenCV); their first consumer: the mean subtraction of that micro-batch" % (mb + 1),
        )
    if kind == "ids":
        step = fault["step"]
        return harness.data_expectation(
            fault,
            sorted(set(both("text_in", step, first)) | set(both("embedding", step, first))),
            "one caption token id differs in the batch of step %d; the text tower's first op on the ids (the view "
            "of the ids) or the token embedding counts",
        )
    if kind == "labels":
        step = fault["step"]
        return harness.data_expectation(
            fault,
            both("cross_entropy", step),
            "two masked tokens' labels differ (+1) in the batch of step %d (the inputs unchanged); the cross-entropy "
            "is their first consumer (msprobe writes no record of the labels' reshape)",
        )
    raise ValueError(kind)


def argmax_flips(tgt: dict, ref: dict) -> list[dict]:
    return harness.argmax_flips(tgt, ref)


def warm() -> None:
    """The imports made once, before forking."""
    harness.warm("ConvNextV2ForImageClassification", "CLIPModel", "RwkvForCausalLM", "DebertaV2ForMaskedLM")
    import transformers.optimization  # noqa: F401


def main(argv=None) -> int:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

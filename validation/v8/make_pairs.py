"""Validation set 8 for dumpstore's verdict: msprobe dumps of four model families no other set uses.

Built apart from the development set and from sets 1 to 7: other families (MobileNetV2, FNet, StableLM, PatchTST: a
convolutional network with depthwise convolutions, inverted residuals, ReLU6 and BatchNorm in training mode; an
encoder that mixes tokens with a 2-d FFT instead of attention, trained as a masked LM; a decoder with partial rotary
embeddings, LayerNorm, QKV biases and SwiGLU; a time-series transformer over patches with instance standardisation
and BatchNorm, trained on an MSE forecast), other dtype and optimizer setups (SGD with Nesterov momentum in fp32,
centered RMSprop with momentum in fp32, NAdam with decoupled weight decay on fp32 master weights of a bf16 model,
RAdam with decoupled weight decay under fp16 autocast with loss scaling) and other simulated devices
(``validation/v8/devices.py``: the FFT as DFT GEMMs, a tanh-GELU through a sigmoid, a GEMM accumulator started at
the bias, BatchNorm as a scale and shift, sqrt as x rsqrt(x), depthwise convolutions as fused multiply-add chains,
pooling by a reciprocal, SiLU's gradient from its output, an autocast policy with pow in fp32). Every pair is a
reference run ("GPU": plain CPU torch in the family's dtype) and a target run on the family's simulated device, with
or without one fault. The answer of every case is known by construction and written to ``<out>/key.json`` (set 1's
format, so ``validation/score.py`` scores it); the culprit's msprobe record name is read from msprobe while the
faulty call runs, never from dumpstore.

    .venv/bin/python validation/v8/make_pairs.py --out validation/v8/.data [--jobs 2] [--only CASE ...]

The driver (arguments, runs, checks, key, the training loop, one run, the near-tie) is ``validation/harness.py``; the
run harness (the tracer of msprobe's record names) is set 2's ``validation/v2/make_pairs.py`` through set 6's tracer
(parameter uses by conv2d, argmax logs); set 5's "amp" structure check is imported. What is here: the families, their
optimizers and setups, the faults and the expected culprits. Runs: 3 training steps; forward and backward inside
msprobe's window, clipping and the optimizer step outside it; msprobe level "mix"; statistics mode for every case and
tensor mode for a subset.
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

if "validation_harness" not in sys.modules:  # the driver (arguments, runs, checks, key), loaded once, by path
    _spec = importlib.util.spec_from_file_location("validation_harness", HERE.parent / "harness.py")
    sys.modules["validation_harness"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["validation_harness"])
harness = sys.modules["validation_harness"]
devices8 = harness._load("validation_v8_devices", HERE / "devices.py")  # this set's devices, under their own name
v5 = harness._load("validation_v5_make_pairs", HERE.parent / "v5" / "make_pairs.py")  # its "amp" structure check
v6 = harness._load("validation_v6_make_pairs", HERE.parent / "v6" / "make_pairs.py")  # its tracer

SET = 8
STEPS = 3
VOCAB = 96
IMAGES, SIZE, CLASSES = 2, 80, 10  # mobilenet: 2 images of 3x80x80, 10 classes
BATCH, SEQ, MASKED = 2, 16, 4  # fnet and stablelm: 2 sequences of 16 tokens; fnet masks 4 per sequence
MASK_ID = 2
WIDE_HIDDEN, WIDE_SEQ = 512, 64  # stablelm_wide: the long reductions
CHANNELS, CONTEXT, HORIZON, PATCH = 3, 32, 8, 4  # patchtst: 3 series, 32 steps of context, 8 to forecast
CLIP = 1.0
DATA_SEED = 8291
DEVICES = devices8.DEVICES
NOISY_REF = {"fnet": "AP", "mobilenet": "AQ"}  # the "noisyref" variant's reference device, per family
AMP_DEVICE = "AO"  # the "amp" variant's target: the family's device under another autocast policy

FAMILIES = {
    "mobilenet": {
        "text": "MobileNetV2 (convolutional, inverted residuals): 3x80x80 images, depth multiplier 0.35, the 17 "
        "blocks of the architecture (1x1 expansion, 3x3 depthwise convolution, 1x1 linear bottleneck; residuals "
        "where shapes agree), TensorFlow 'SAME' padding by F.pad, BatchNorm in training mode, ReLU6, global average "
        "pooling over 3x3, a linear classifier (10 classes), the convolutions initialised as torchvision does (He, "
        "fan out); cross-entropy; batch 2; fp32; SGD with Nesterov momentum (lr 0.005, momentum 0.9, weight decay "
        "4e-5)",
        "device": "AK",
        "seed": 81,
    },
    "fnet": {
        "text": "FNet (attention-free encoder): token mixing by the real part of a 2-d FFT over the sequence and "
        "hidden dimensions (torch.fft.fftn), 2 layers, hidden 32 (MLP 64, tanh-GELU), post-LN, learned positions, "
        "an input projection after the embeddings' LayerNorm; masked LM (4 of 16 tokens masked per sequence, batch "
        "2) with an untied decoder; cross-entropy over the masked tokens; the predicted tokens (an argmax) inside "
        "the window; fp32; centered RMSprop with momentum (lr 2e-4, alpha 0.99, momentum 0.9, eps 1e-8)",
        "device": "AL",
        "seed": 82,
    },
    "stablelm": {
        "text": "StableLM (decoder): partial rotary embeddings (25 % of each head), LayerNorm, QKV biases, grouped-"
        "query attention (4 query heads, 2 KV heads), SwiGLU MLP (layer 1's as a hand-written autograd function, "
        "Liger-style, in every run), hidden 32 (MLP 64), 2 layers, untied head; 16 tokens, batch 2; next-token "
        "cross-entropy; a bf16 model with fp32 master weights (Megatron-style: the bf16 gradients copied to fp32, "
        "the update in fp32, the parameters copied back to bf16); NAdam (lr 2e-3, betas 0.9 / 0.95, decoupled "
        "weight decay 0.01)",
        "device": "AM",
        "seed": 83,
    },
    "stablelm_wide": {
        "text": "StableLM as above with long reductions: hidden 512 (8 heads of 64, 4 KV heads, MLP 512), 2 layers; "
        "64 tokens, batch 1 (linear sums of 512 terms, LayerNorm over 512); bf16 with fp32 master weights; NAdam",
        "device": "AM",
        "seed": 84,
    },
    "patchtst": {
        "text": "PatchTST (time-series transformer): 3 series of 32 steps (sines with noise), standardised per "
        "series (mean, sqrt of the variance), patches of 4 (stride 4, 8 patches per series, channel-independent), "
        "a linear patch embedding, sin-cos positions, 2 encoder layers of hidden 32 (4 heads, MLP 64, the tanh GELU "
        "written out with torch.pow and torch.tanh), BatchNorm over the patches (training mode), a flatten-linear "
        "head forecasting 8 steps, de-standardised; MSE; batch 2; fp32 weights under fp16 autocast with dynamic loss "
        "scaling (GradScaler, initial scale 2^10); RAdam (lr 1e-2, decoupled weight decay 0.01)",
        "device": "AN",
        "seed": 85,
    },
}

S, B = harness.STATS, harness.BOTH
# name -> family, reference variant ("flip": the decoder tilted to a near-tie; "noisyref": the reference rerun on
# the family's NOISY_REF device; "amp": the target under another autocast policy, device AO), fault (None: clean),
# dump modes. The expected culprit comes from what msprobe named at the faulty call.
CASES = {
    "mobilenet_clean": ("mobilenet", "base", None, S),
    "fnet_clean": ("fnet", "base", None, B),
    "stablelm_clean": ("stablelm", "base", None, B),
    "patchtst_clean": ("patchtst", "base", None, B),
    "stablelm_wide_clean": ("stablelm_wide", "base", None, S),
    "fnet_flip": ("fnet", "flip", None, S),
    "fnet_noisyref": ("fnet", "noisyref", None, S),
    "mobilenet_noisyref": ("mobilenet", "noisyref", None, S),
    "patchtst_amp": ("patchtst", "amp", None, B),
    # optimizer, from the second update on
    "stablelm_lr_step2": harness.optimizer_case("stablelm", "lr", 1.05),
    "fnet_lr_step2": harness.optimizer_case("fnet", "lr", 1.01),
    "patchtst_lr_step2": harness.optimizer_case("patchtst", "lr", 1.02),
    "mobilenet_momentum_step2": harness.optimizer_case("mobilenet", "momentum", 0.8),
    "stablelm_betas_step2": harness.optimizer_case("stablelm", "betas", (0.8, 0.95)),
    "patchtst_wd_step2": harness.optimizer_case("patchtst", "weight_decay", 1.0),  # 0.01 without the lr factor
    "fnet_eps_step2": harness.optimizer_case("fnet", "eps", 1e-5),
    "patchtst_gradclip_step2": harness.optimizer_case("patchtst", "clip", 0.1, B),
    # an op in the target only, an op missing in the target
    "mobilenet_extra_relu6_B3": ("mobilenet", "base", {"kind": "extra_relu6", "block": 3}, S),
    "mobilenet_missing_bn_B5": ("mobilenet", "base", {"kind": "missing_bn", "block": 5}, S),
    # a changed scalar argument
    "fnet_embed_ln_eps": ("fnet", "base", {"kind": "ln_eps", "value": 1e-5}, B),
    "stablelm_attn_scale_L1": ("stablelm", "base", {"kind": "attn_scale", "layer": 1}, S),
    # a wrong kernel in one layer (forward; backward only), a wrong mask, one op in lower precision
    "fnet_gelu_exact_L1": ("fnet", "base", {"kind": "gelu_exact", "layer": 1}, S),
    "stablelm_swiglu_backward_L1": ("stablelm", "base", {"kind": "swiglu_backward", "layer": 1}, S),
    "stablelm_mask_L0": ("stablelm", "base", {"kind": "mask", "layer": 0}, B),
    "patchtst_bn_eval_L1": ("patchtst", "base", {"kind": "bn_eval", "layer": 1}, S),
    "fnet_dense_bf16_L1": ("fnet", "base", {"kind": "dense_bf16", "layer": 1}, B),
    # parameters and data
    "fnet_transposed_proj_step0": harness.weight_case("fnet", "fnet.embeddings.projection.weight", 0, "transpose"),
    "stablelm_swap_gate_up_step1": harness.weight_case(
        "stablelm", "model.layers.1.mlp.gate_proj.weight", 1, "swap_gate_up", B
    ),  # fmt: skip
    "mobilenet_dw_weight_step2": harness.weight_case(
        "mobilenet", "mobilenet_v2.layer.2.conv_3x3.convolution.weight", 2, "sign2pct"
    ),
    "mobilenet_bgr_step1": ("mobilenet", "base", {"kind": "bgr", "step": 1}, S),
    "stablelm_tokens_step2": ("stablelm", "base", {"kind": "tokens", "step": 2}, S),
    "fnet_labels_step2": ("fnet", "base", {"kind": "labels", "step": 2}, S),
    "patchtst_gap_step1": ("patchtst", "base", {"kind": "gap", "step": 1}, B),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "transpose": "transposed (a checkpoint converted from a framework that stores linear weights as [in, out])",
    "swap_gate_up": "swapped with the layer's up projection weight (a checkpoint conversion that reads the fused "
    "gate_up matrix's halves in the wrong order)",
}
MICRO: dict = {}  # one micro-batch per step
AUTOCAST = {"patchtst": "float16"}
MASTER = {"stablelm", "stablelm_wide"}  # bf16 models with fp32 master weights
FLIP_STEP = STEPS - 1  # the crafted tie is at the last step
OPTIMIZER_KINDS = ("lr", "clip", "betas", "weight_decay", "eps", "momentum")
ZERO_DROPOUT = ("dropout", "attention_dropout", "ff_dropout", "positional_dropout", "path_dropout", "head_dropout")
ARGMAX_FAMILY = "fnet"  # the masked LM's predicted tokens, an argmax over the logits inside the window


class Tracer(v6.Tracer):
    """Set 6's tracer (set 2's record names, marks, parameter uses by linear and conv2d, the loss; every argmax's
    output)."""


# =================================================================================================================
# optimizers and setups
# =================================================================================================================
class MasterWeights:
    """fp32 master weights of a bf16 model (Megatron's mixed precision): ``step`` copies the bf16 gradients to the
    fp32 masters, steps the inner optimizer (made by ``make(masters)``) on them and copies the masters back to the
    bf16 parameters (round to nearest); ``param_groups`` are the inner optimizer's."""

    def __init__(self, params, make):
        import torch

        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = make(self.masters)
        self._torch = torch

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self):
        with self._torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
            self.inner.step()
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def make_optimizer(family: str, model):
    import torch

    if family == "mobilenet":
        return torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, nesterov=True, weight_decay=4e-5)
    if family == "fnet":
        return torch.optim.RMSprop(model.parameters(), lr=2e-4, alpha=0.99, eps=1e-8, momentum=0.9, centered=True)
    if family in MASTER:
        return MasterWeights(
            model.parameters(),
            lambda ps: torch.optim.NAdam(
                ps, lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True
            ),
        )
    return torch.optim.RAdam(model.parameters(), lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True)


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    if family == "mobilenet":
        from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

        cfg = MobileNetV2Config(
            num_channels=3,
            image_size=SIZE,
            depth_multiplier=0.35,
            min_depth=8,
            finegrained_output=False,
            hidden_act="relu6",
            classifier_dropout_prob=0.0,
            num_labels=CLASSES,
        )
        model = MobileNetV2ForImageClassification(cfg)
        with torch.no_grad():  # torchvision's MobileNetV2 initialisation of the convolutions (He, fan out)
            for m in model.modules():
                if isinstance(m, torch.nn.Conv2d):
                    torch.nn.init.kaiming_normal_(m.weight, mode="fan_out")
    elif family == "fnet":
        from transformers import FNetConfig, FNetForMaskedLM

        cfg = FNetConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            hidden_act="gelu_pytorch_tanh",
            hidden_dropout_prob=0.0,
            max_position_embeddings=SEQ,
            type_vocab_size=2,
            layer_norm_eps=1e-12,
            initializer_range=0.2,  # activations of order 1 (a trained model's), not 0.1 as at 0.02
            tie_word_embeddings=False,
            pad_token_id=0,
        )
        model = FNetForMaskedLM(cfg)
    elif family in ("stablelm", "stablelm_wide"):
        from transformers import StableLmConfig, StableLmForCausalLM

        sizes = (WIDE_HIDDEN, WIDE_HIDDEN, 8, 4) if family == "stablelm_wide" else (32, 64, 4, 2)
        cfg = StableLmConfig(
            **dict(zip(("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"), sizes)),
            **dict.fromkeys(("hidden_dropout", "attention_dropout"), 0.0),
            vocab_size=VOCAB,
            num_hidden_layers=2,
            max_position_embeddings=WIDE_SEQ,
            use_qkv_bias=True,
            tie_word_embeddings=False,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=VOCAB - 1,
        )
        cfg._attn_implementation = "eager"
        model = StableLmForCausalLM(cfg).to(torch.bfloat16)
    else:
        from transformers import PatchTSTConfig, PatchTSTForPrediction

        cfg = PatchTSTConfig(
            num_input_channels=CHANNELS,
            context_length=CONTEXT,
            patch_length=PATCH,
            patch_stride=PATCH,
            prediction_length=HORIZON,
            d_model=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            ffn_dim=64,
            **dict.fromkeys(ZERO_DROPOUT, 0.0),
            activation_function="gelu_new",
            scaling="std",
            loss="mse",
            norm_type="batchnorm",
            do_mask_input=False,
        )
        cfg._attn_implementation = "eager"
        model = PatchTSTForPrediction(cfg)
    model.train()
    return model


def batches(family: str, fault) -> list[list[dict]]:
    """Per step (one micro-batch): the model's inputs. A data fault changes one step's batch."""
    import torch

    def draw(g):
        if family == "mobilenet":
            px = (torch.rand(IMAGES, 3, SIZE, SIZE, generator=g) - 0.45) / 0.25  # normalised by the loader
            return {"pixel_values": px, "labels": torch.randint(0, CLASSES, (IMAGES,), generator=g)}
        if family == "fnet":
            ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
            pos = torch.stack([torch.randperm(SEQ, generator=g)[:MASKED] for _ in range(BATCH)])
            labels = torch.full_like(ids, -100)
            labels.scatter_(1, pos, ids.gather(1, pos))
            return {"input_ids": ids.scatter(1, pos, MASK_ID), "labels": labels}
        if family in ("stablelm", "stablelm_wide"):
            n, seq = (1, WIDE_SEQ) if family == "stablelm_wide" else (BATCH, SEQ)
            return {"input_ids": torch.randint(3, VOCAB, (n, seq), generator=g)}
        t = torch.arange(CONTEXT + HORIZON, dtype=torch.float32)
        period = 6.0 + 10.0 * torch.rand(BATCH, 1, CHANNELS, generator=g)
        phase = 6.3 * torch.rand(BATCH, 1, CHANNELS, generator=g)
        level = 5.0 * torch.randn(BATCH, 1, CHANNELS, generator=g)
        amp = 1.0 + 2.0 * torch.rand(BATCH, 1, CHANNELS, generator=g)
        noise = 0.1 * torch.randn(BATCH, CONTEXT + HORIZON, CHANNELS, generator=g)
        x = level + amp * torch.sin(2 * math.pi * t[None, :, None] / period + phase) + noise
        return {"past_values": x[:, :CONTEXT].contiguous(), "future_values": x[:, CONTEXT:].contiguous()}

    out = harness.draw_batches(DATA_SEED, STEPS, 1, draw)
    if fault and fault["kind"] in ("bgr", "tokens", "labels", "gap"):
        b = out[fault["step"]][0]
        if fault["kind"] == "bgr":  # the step's images decoded as BGR (channels in reverse order)
            b["pixel_values"] = b["pixel_values"].flip(1).contiguous()
        elif fault["kind"] == "tokens":  # two tokens of sequence 0 replaced (a tokenizer with another merge table)
            b["input_ids"] = b["input_ids"].clone()
            b["input_ids"][0, 5:7] = (b["input_ids"][0, 5:7] - 3 + 7) % (VOCAB - 3) + 3
        elif fault["kind"] == "labels":  # two masked tokens' labels changed (+1): labels off by one id
            b["labels"] = b["labels"].clone()
            cols = (b["labels"][0] != -100).nonzero()[:2, 0]
            b["labels"][0, cols] = (b["labels"][0, cols] - 3 + 1) % (VOCAB - 3) + 3
        else:  # a gap of 8 missing values filled with zeros instead of being marked unobserved (series 0, channel 1)
            b["past_values"] = b["past_values"].clone()
            b["past_values"][0, 12:20, 1] = 0.0
    return out


def family_faults(family: str) -> list[dict]:
    return harness.family_faults(sys.modules[__name__], family)


def _conv_layer(tracer, layer, tags: dict, skip_bn: bool):
    """transformers' MobileNetV2ConvLayer forward, call for call, with marks after the pad, the convolution, the
    BatchNorm and the activation (``tags``: step -> tag, for those to mark); ``skip_bn``: the BatchNorm left out."""
    import torch.nn.functional as F

    pad = harness.hf_module("mobilenet_v2").apply_tf_padding

    def forward(features):
        if layer.config.tf_padding:
            features = pad(features, layer.convolution)
            if "pad" in tags:
                tracer.mark(tags["pad"])
        features = layer.convolution(features)
        if "conv" in tags:
            tracer.mark(tags["conv"])
        bn = layer.normalization
        if bn is not None and not skip_bn and "bn" in tags:  # nn.BatchNorm2d's call (its counter aside), marked
            features = F.batch_norm(features, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, bn.momentum,
                                    bn.eps)  # fmt: skip
            tracer.mark(tags["bn"])
        elif bn is not None and not skip_bn:
            features = bn(features)
        if layer.activation is not None:
            features = layer.activation(features)
            if "act" in tags:
                tracer.mark(tags["act"])
        return features

    return forward


def _stablelm_attention(tracer, active, wrong_mask):
    """transformers' eager attention of StableLM (``eager_attention_forward``), op for op, with marks after the
    scores' scaling ("scale.L<i>") and the mask's add ("mask.L<i>"); the run's fault: layer ``layer``'s scaling
    1 / head_dim instead of its inverse square root, or its mask ``wrong_mask``."""
    import torch
    import torch.nn.functional as F

    repeat_kv = harness.hf_module("stablelm").repeat_kv

    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        at = active is not None and active.get("layer") == layer
        if at and active["kind"] == "attn_scale":
            scaling = 1.0 / module.head_dim  # a port that scales the scores by 1 / d
        key_states = repeat_kv(key, module.num_key_value_groups)
        value_states = repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        tracer.mark("scale.L%d" % layer)
        if attention_mask is not None:
            mask = wrong_mask if at and active["kind"] == "mask" else attention_mask
            attn_weights = attn_weights + mask
            tracer.mark("mask.L%d" % layer)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output.transpose(1, 2).contiguous(), attn_weights

    return forward


def _swiglu(tracer, wrong: bool):
    """A hand-written SwiGLU autograd function (Liger's and Megatron's fused form): forward silu(g) * u; backward
    written out, d/dg = grad u s (1 + g (1 - s)) with s = sigmoid(g), d/du = grad silu(g). ``wrong``: the
    derivative's (1 - s) written as s (a sign slip: s (1 + g s))."""
    import torch
    import torch.nn.functional as F

    class SwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, u):
            ctx.save_for_backward(g, u)
            return F.silu(g) * u

        @staticmethod
        def backward(ctx, grad):
            g, u = ctx.saved_tensors
            s = torch.sigmoid(g)
            rest = 1 - s
            term = g * (s if wrong else rest)
            tracer.mark("swiglu_back.term")
            dg = grad * u * s * (1 + term)
            du = grad * F.silu(g)
            return dg, du

    return SwiGLU


def patch(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch
    import torch.nn.functional as F

    on = lambda kind: active is not None and active["kind"] == kind  # noqa: E731
    kinds = {f["kind"]: f for f in family_faults(family)}

    if family == "mobilenet":
        first = model.mobilenet_v2.conv_stem.first_conv
        first.forward = _conv_layer(tracer, first, {"pad": "stem_pad", "conv": "stem_conv"}, False)
        if "missing_bn" in kinds:
            dw = model.mobilenet_v2.layer[kinds["missing_bn"]["block"]].conv_3x3
            dw.forward = _conv_layer(tracer, dw, {"bn": "dw_bn", "act": "dw_act"}, on("missing_bn"))
        if "extra_relu6" in kinds:
            proj = model.mobilenet_v2.layer[kinds["extra_relu6"]["block"]].reduce_1x1
            plain = proj.forward
            extra = on("extra_relu6")

            def proj_fwd(features, plain=plain, extra=extra):
                out = plain(features)
                if extra:  # a port that ends the linear bottleneck with ReLU6 too (MobileNetV1's block)
                    out = F.hardtanh(out, 0.0, 6.0)
                    tracer.mark("extra_relu6")
                return out

            proj.forward = proj_fwd

    if family == "fnet":
        from transformers.activations import GELUTanh

        for m in model.modules():
            if hasattr(m, "fourier_transform"):  # torch.fft.fftn looked up at call time (msprobe, the devices)
                m.fourier_transform = lambda h: torch.fft.fftn(h, dim=(1, 2))
            if isinstance(m, GELUTanh):
                m.act = lambda x: F.gelu(x, approximate="tanh")
        ln = model.fnet.embeddings.LayerNorm
        eps = active["value"] if on("ln_eps") else ln.eps

        def ln_fwd(x, ln=ln, eps=eps):  # a port that builds the LayerNorm with torch's default eps
            y = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, eps)
            tracer.mark("embed_ln")
            return y

        ln.forward = ln_fwd
        if "gelu_exact" in kinds:
            act = model.fnet.encoder.layer[kinds["gelu_exact"]["layer"]].intermediate.intermediate_act_fn
            approx = "none" if on("gelu_exact") else "tanh"

            def act_fn(x, approx=approx):  # "gelu_pytorch_tanh" mapped to the exact GELU by a port
                y = F.gelu(x, approximate=approx)
                tracer.mark("act")
                return y

            act.act = act_fn
        if "dense_bf16" in kinds:
            dense = model.fnet.encoder.layer[kinds["dense_bf16"]["layer"]].output.dense
            low = on("dense_bf16")

            def dense_fwd(x, dense=dense, low=low):  # a leftover autocast region around one projection
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                    y = F.linear(x, dense.weight, dense.bias)
                tracer.mark("dense")
                return y

            dense.forward = dense_fwd

    if family in ("stablelm", "stablelm_wide"):
        mod = harness.hf_module("stablelm")
        wrong = None
        if on("mask"):  # an off-by-one causal mask: each token also sees the next one
            low = torch.finfo(torch.bfloat16).min
            wrong = torch.full((BATCH, 1, SEQ, SEQ), low, dtype=torch.bfloat16).triu(2)
        mod.eager_attention_forward = _stablelm_attention(tracer, active, wrong)  # (this forked run's)
        harness.embed_mark(tracer, model.model.embed_tokens, "embedding")
        if family == "stablelm":
            mlp = model.model.layers[1].mlp
            fn = _swiglu(tracer, on("swiglu_backward"))
            mlp.forward = lambda x, mlp=mlp, fn=fn: mlp.down_proj(fn.apply(mlp.gate_proj(x), mlp.up_proj(x)))

    if family == "patchtst":
        scaler = model.model.scaler.scaler
        min_scale, dim, keep = scaler.minimum_scale, scaler.dim, scaler.keepdim

        def scale_fwd(data, observed):  # transformers' PatchTSTStdScaler, op for op, marked at its first op
            masked = data * observed
            tracer.mark("scaler_mul")
            denominator = observed.sum(dim, keepdim=keep).clamp_min(1.0)
            loc = masked.sum(dim, keepdim=keep) / denominator
            variance = (((data - loc) * observed) ** 2).sum(dim, keepdim=keep) / denominator
            scale = torch.sqrt(variance + min_scale)
            return (data - loc) / scale, loc, scale

        scaler.forward = scale_fwd
        if "bn_eval" in kinds:
            norm = model.model.encoder.layers[kinds["bn_eval"]["layer"]].norm_sublayer1
            bn = norm.batchnorm
            training = not on("bn_eval")

            def bn_fwd(inputs, bn=bn, training=training):  # a port that calls BatchNorm with training=False
                out = inputs.transpose(1, 2)
                out = F.batch_norm(out, bn.running_mean, bn.running_var, bn.weight, bn.bias, training, bn.momentum,
                                   bn.eps)  # fmt: skip
                tracer.mark("bn")
                return out.transpose(1, 2)

            norm.forward = bn_fwd

    harness.watch_weights(sys.modules[__name__], family, model, tracer)


def corrupt(model, fault) -> None:
    import torch

    params = dict(model.named_parameters())
    p = params[fault["param"]]
    with torch.no_grad():
        if fault["how"] == "transpose":
            p.copy_(p.t().clone())
        elif fault["how"] == "swap_gate_up":
            up = params[fault["param"].replace("gate_proj", "up_proj")]
            tmp = p.clone()
            p.copy_(up)
            up.copy_(tmp)
        else:
            harness.corrupt(model, fault, {})


def forward_loss(family: str, model, batch: dict, fault, tracer):
    """The model's loss and logits (PatchTST: the forecast)."""
    import torch.nn.functional as F

    if family == "mobilenet":
        logits = model(pixel_values=batch["pixel_values"]).logits
        return F.cross_entropy(logits, batch["labels"]), logits
    if family == "fnet":
        logits = model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)), logits
    if family in ("stablelm", "stablelm_wide"):
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return loss, logits
    pred = model(past_values=batch["past_values"]).prediction_outputs
    return F.mse_loss(pred, batch["future_values"]), pred


def train(family: str, model, data, fault, **kw):
    """The training loop of every run (``harness.train``)."""
    return harness.train(sys.modules[__name__], family, model, data, fault, **kw)


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """fnet 'flip' variant, in both runs alike: a tilt of one row of the masked LM's decoder, added before the last
    step, that ties one token's top-2 logits in the reference to within a few fp32 ulps, chosen (by simulating both
    runs without msprobe) so that the device's rounding flips that token's predicted id and no other.

    Returns (what was done, the tilt to add to the decoder's weight before step FLIP_STEP)."""
    return harness.craft_first_micro(sys.modules[__name__], "fnet", model, flip_head(model), data, device)


def setup(family: str, variant: str, target: bool, active, tracer: Tracer, info: dict):
    """A run's model, patched, its device installed (``harness.setup``; a "noisyref" variant's reference on the
    family's ``NOISY_REF`` device)."""
    s = sys.modules[__name__]
    if variant == "noisyref" and not target:
        model = build_model(family)
        DEVICES[NOISY_REF[family]].install()
        patch(family, model, tracer, active)
        return model, None
    return harness.setup(s, family, variant, target, active, tracer, info)


def flip_head(model):
    return model.cls.predictions.decoder


def run_one(job: dict) -> dict:
    """One msprobe run (``harness.run_one``)."""
    return harness.run_one(sys.modules[__name__], job)


def device_label(family: str, variant: str) -> str:
    """The key's device of a pair: the target's, "+" the reference's where that is noisy too."""
    if variant == "amp":
        return AMP_DEVICE
    return FAMILIES[family]["device"] + ("+" + NOISY_REF[family] if variant == "noisyref" else "")


# set 2's structure check; the "amp" variant's runs may differ in dtypes (its autocast policy), nothing else
structure_differences = v5.structure_differences


# =================================================================================================================
# the key
# =================================================================================================================
def _modules(res: dict, op: str, step: int = 0) -> set:
    return set(res["leaf"].get(str(step), {}).get(op, []))


def _api(res: dict, record: str, step: int) -> str:
    """The API record of a mark made after a leaf module's call (whose record msprobe made last): the one API record
    that module's forward made; an API record as it is."""
    if not record.startswith("Module."):
        return record
    apis = [api for api, mods in res["leaf"].get(str(step), {}).items() if record in mods]
    if len(apis) != 1:
        raise SystemExit("no single API record of module %s at step %d: %r" % (record, step, apis))
    return apis[0]


OPTIMIZER_WHAT: dict = {  # an optimizer fault's key: the setting's text (per family where it is the family's own)
    "lr": "the learning rate x%g",
    "clip": "gradient clipping at max_norm %%g instead of %g" % CLIP,
    "stablelm": {"betas": "NAdam betas %s instead of (0.9, 0.95)"},
    "fnet": {"eps": "RMSprop eps %g instead of 1e-8"},
    "mobilenet": {"momentum": "SGD Nesterov momentum %g instead of 0.9"},
    "patchtst": {
        "weight_decay": "RAdam decoupled weight decay %g instead of 0.01 (a port of an optimizer whose decay is not "
        "multiplied by the learning rate: p -= 0.01 p per update, which is torch's lr * wd with wd = 0.01 / lr)"
    },
}


# faults at step 0 whose culprit is the marked call in both runs: kind -> (mark, "one" or "first" call of the step,
# what; both formatted with the fault's fields)
AT_CALL = {
    "ln_eps": (
        "embed_ln",
        "one",
        "the embeddings' LayerNorm with eps {value:g} instead of the config's 1e-12 (a port that builds it with "
        "torch's default): a scalar argument",
    ),
    "attn_scale": (
        "scale.L{layer}",
        "first",
        "layer {layer}'s attention scores scaled by 1/head_dim instead of 1/sqrt(head_dim) (a scalar argument: the "
        "multiply of the scores, the first sequence's call)",
    ),
    "gelu_exact": (
        "act",
        "one",
        "layer {layer}'s MLP activation: the exact GELU instead of the tanh approximation the model was built with "
        '("gelu_pytorch_tanh" mapped to "gelu")',
    ),
    "swiglu_backward": (
        "swiglu_back.term",
        "one",
        "layer {layer}'s hand-written SwiGLU autograd function with a sign slip in its backward: the gate's "
        "derivative s (1 + g (1 - s)) written s (1 + g s); the forward is the same; the multiply g * s (g * (1 - s) "
        "in the reference; recorded after the loss as a forward record of the step) is the culprit",
    ),
    "mask": (
        "mask.L{layer}",
        "one",
        "layer {layer}'s causal mask off by one in the target (each token also sees the next token): the add of the "
        "mask to the scores",
    ),
    "bn_eval": (
        "bn",
        "one",
        "layer {layer}'s first BatchNorm called with training=False (the running statistics instead of the batch's: "
        "a port that passes self.training of another module): a scalar argument",
    ),
    "dense_bf16": (
        "dense",
        "one",
        "layer {layer}'s MLP output projection run in bf16 in the fp32 model (a leftover autocast region around one "
        "linear): its output bf16",
    ),
}
# data faults: kind -> (the mark of their first consumer, what; a %d for the step)
DATA = {
    "tokens": (
        "embedding",
        "two tokens of sequence 0 replaced in the batch of step %d (a tokenizer with another merge table); their first "
        "consumer: the token embedding",
    ),
    "labels": (
        "cross_entropy",
        "two masked tokens' labels changed (+1) in the batch of step %d (the inputs unchanged); the cross-entropy is "
        "their first consumer",
    ),
    "gap": (
        "scaler_mul",
        "a gap of 8 missing values of one series filled with zeros (instead of being marked unobserved) in the batch "
        "of step %d; their first consumer: the standardiser's multiply by the observed mask",
    ),
}


def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
    """What the verdict should say about a fault, from the marks both runs made at the faulty call."""
    kind = fault["kind"]
    family = case.split("_")[0]
    one, first, both = harness.mark_readers(case, tgt, ref)
    if kind in OPTIMIZER_KINDS:
        value = fault["value"]
        what = OPTIMIZER_WHAT.get(kind) or OPTIMIZER_WHAT[family][kind]
        return harness.optimizer_expectation(fault, what % (tuple(value) if isinstance(value, tuple) else value,))
    if kind == "extra_relu6":
        op = first(tgt, "extra_relu6", 0)
        return {
            "step": 0,
            "ops": [op],
            "modules": sorted(_modules(tgt, op)),  # (the reference's call of that name is another op)
            "what": "block %d's linear bottleneck ended with a ReLU6 in the target only (a port using MobileNetV1's "
            "block): an extra activation, the first record the reference does not have" % fault["block"],
        }
    if kind == "missing_bn":
        bn, act = _api(ref, first(ref, "dw_bn", 0), 0), _api(tgt, first(tgt, "dw_act", 0), 0)
        return {
            "step": 0,
            "ops": sorted({bn, act}),
            "modules": sorted(_modules(ref, bn) | _modules(tgt, act)),
            "what": "block %d's BatchNorm after the depthwise convolution left out in the target (a conv-BN fusion "
            "that drops the BatchNorm without folding it): the reference's batch_norm; its consumer in the target, "
            "the ReLU6 of the unnormalised convolution, also counts" % fault["block"],
        }
    if kind in AT_CALL:
        tag, pick, what = AT_CALL[kind]
        exp = {"step": 0, "ops": both(tag.format(**fault), 0, first if pick == "first" else one)}
        exp["what"] = what.format(**fault)
        if kind == "swiglu_backward":
            exp["backward_only"] = True
        return exp
    if kind in DATA:
        tag, what = DATA[kind]
        return harness.data_expectation(fault, both(tag, fault["step"]), what)
    if kind == "weight":
        return harness.weight_expectation(fault, HOW[fault["how"]], both)
    if kind == "bgr":
        step = fault["step"]
        return harness.data_expectation(
            fault,
            sorted(
                {first(r, "stem_pad", step) for r in (tgt, ref)}
                | {_api(r, first(r, "stem_conv", step), step) for r in (tgt, ref)}
            ),
            "the images of step %d decoded as BGR (channels in reverse order); their first consumer: the stem's "
            "'SAME' padding (F.pad); the stem's convolution after it also counts",
        )
    raise ValueError(kind)


argmax_flips = harness.argmax_flips  # the argmax flips (FNet's predicted tokens) of a pair: no routing here


def warm() -> None:
    """The imports made once, before forking: torch, msprobe, the four model classes and the modeling modules whose
    functions the runs reroute."""
    harness.warm("MobileNetV2ForImageClassification", "FNetForMaskedLM", "StableLmForCausalLM", "PatchTSTForPrediction")
    list(map(harness.hf_module, ("mobilenet_v2", "stablelm")))


def main(argv=None) -> int:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

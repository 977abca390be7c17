"""Validation set 5 for dumpstore's verdict: msprobe dumps of four model families no other set uses.

Built apart from the development set and from sets 1 to 4: other families (ViT, wav2vec2 with a CTC head, BART,
Granite: a vision transformer, a speech encoder on raw audio, an encoder-decoder with learned positions and label
smoothing, a decoder with Granite's multipliers), other dtype and optimizer setups and other simulated devices
(``validation/v5/devices.py``: softmax through the log-sum-exp, GELU through erfc, a fused label-smoothed
cross-entropy, FFT convolution, the scaled CTC recursion, shifted one-pass LayerNorm statistics, a fused optimizer
kernel, an autocast policy without matmul). Every pair is a reference run ("GPU": plain CPU torch in the family's
dtype) and a target run on the family's simulated device, with or without one fault. The answer of every case is
known by construction and written to ``<out>/key.json`` (set 1's format, so ``validation/score.py`` scores it); the
culprit's msprobe record name is read from msprobe while the faulty call runs, never from dumpstore.

    .venv/bin/python validation/v5/make_pairs.py --out validation/v5/.data [--jobs 2] [--only CASE ...]

The driver (arguments, runs, checks, key, the training loop, one run) is ``validation/harness.py``; the run harness
(the tracer of msprobe's record names, the forked runs, msprobe's config, the structure check) is set 2's
``validation/v2/make_pairs.py``. What is here: the families, their optimizers and setups, the faults and the expected
culprits. Runs: 3 training steps; forward and backward (both micro-batches where there are two) inside msprobe's
window, clipping and the optimizer step outside it; msprobe level "mix"; statistics mode for every case and tensor
mode for a subset.
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
devices5 = harness._load("validation_v5_devices", HERE / "devices.py")  # this set's devices, under their own name
v2 = harness.set2()  # set 2's run harness

SET = 5
STEPS = v2.STEPS  # 3
BATCH, SEQ, VOCAB = 2, 16, 96
IMAGES, SIZE, CLASSES = 8, 16, 10
SAMPLES, CTC_VOCAB, TRANSCRIPT = 160, 12, 6  # wav2vec2: 160 samples -> 15 frames; 12 symbols (0: blank); 6 labels
TGT_LEN = 8  # BART's decoder labels
WIDE_HIDDEN, WIDE_SEQ = 512, 64  # granite_wide: the long reductions
LABEL_SMOOTHING = 0.1
CLIP = 1.0
DATA_SEED = 7531
DEVICES = devices5.DEVICES
NOISY_REF = "X"
AMP_DEVICE = "T"  # the "amp" variant's target: the family's device under another autocast policy

FAMILIES = {
    "vit": {
        "text": "ViT (vision transformer): a 4x4 patch-embedding convolution (stride 4) on 3x16x16 images, a CLS "
        "token and learned positions, pre-LayerNorm blocks, exact GELU, eager attention with an fp32 softmax; hidden "
        "32 (4 heads, MLP 64), 2 layers, a linear classifier (10 classes) on the CLS token; 8 images normalised "
        "(x - 0.5) / 0.5 inside the window; cross-entropy with label smoothing 0.1; fp32 weights under bf16 "
        "autocast; AdamW with amsgrad (lr 1e-3, weight decay 0.05)",
        "device": "S",
        "seed": 51,
    },
    "wav2vec2": {
        "text": "wav2vec2 with a CTC head (speech): a convolutional feature encoder on raw audio (conv1d 1 -> 16, "
        "kernel 10, stride 5, GroupNorm over time per channel, GELU; conv1d 16 -> 16, kernel 3, stride 2), a feature "
        "projection with LayerNorm, a grouped positional convolution (kernel 8, 4 groups, weight norm), post-LN "
        "encoder blocks; hidden 32 (4 heads, MLP 64), 2 layers; 2 utterances of 160 samples (15 frames) per "
        "micro-batch, CTC over 12 symbols (blank 0, 6 labels per utterance); fp32; gradient accumulation over 2 "
        "micro-batches; SGD with momentum 0.9, dampening 0.1, weight decay 1e-4 (lr 0.05); the greedy CTC "
        "transcript (an argmax over each frame's logits) inside the window",
        "device": "U",
        "seed": 52,
    },
    "bart": {
        "text": "BART (encoder-decoder): learned positions (offset 2), LayerNorm on the embeddings, post-LN blocks, "
        "GELU, tied input and output embeddings, decoder inputs the labels shifted right; d_model 32 (4 heads, FFN "
        "64), 2 encoder and 2 decoder layers; 16 source and 8 target tokens, batch 2; cross-entropy with label "
        "smoothing 0.1; fp32 weights under fp16 autocast with dynamic loss scaling (GradScaler, initial scale "
        "2^10); Adamax (lr 2e-3)",
        "device": "V",
        "seed": 53,
    },
    "granite": {
        "text": "Granite (decoder): Llama-like (RMSNorm, SiLU MLP, RoPE, GQA 4 query / 2 KV heads) with Granite's "
        "multipliers: embeddings x 6, attention scores x 1/16 (attention_multiplier), residual branches x 0.5, "
        "logits / 4; hidden 32, 2 layers; 16 tokens, batch 2; pure bf16 (weights, activations and optimizer "
        "state); Adagrad (lr 1e-2)",
        "device": "W",
        "seed": 54,
    },
    "granite_wide": {
        "text": "Granite as above with long reductions: hidden 512 (8 heads of 64, 4 KV heads, MLP 1024), 2 "
        "layers; 64 tokens, batch 1 (linear sums of 512 and 1024 terms, RMSNorm means over 512); pure bf16; "
        "Adagrad (lr 1e-2)",
        "device": "W",
        "seed": 55,
    },
}

# name -> family, reference variant ("flip": the CTC head tilted to a near-tie; "noisyref": the reference rerun on
# device X; "amp": the target under another autocast policy, device T), fault (None: clean), dump modes. The
# expected culprit comes from what msprobe named at the faulty call.
CASES = {
    "vit_clean": ("vit", "base", None, ("stats", "tensor")),
    "wav2vec2_clean": ("wav2vec2", "base", None, ("stats", "tensor")),
    "bart_clean": ("bart", "base", None, ("stats", "tensor")),
    "granite_clean": ("granite", "base", None, ("stats", "tensor")),
    "granite_wide_clean": ("granite_wide", "base", None, ("stats",)),
    "wav2vec2_flip": ("wav2vec2", "flip", None, ("stats",)),
    "vit_noisyref": ("vit", "noisyref", None, ("stats",)),
    "vit_amp": ("vit", "amp", None, ("stats",)),
    # optimizer, from the second update on
    "wav2vec2_lr_step2": harness.optimizer_case("wav2vec2", "lr", 1.1),
    "granite_lr_step2": harness.optimizer_case("granite", "lr", 1.05, harness.BOTH),
    "wav2vec2_momentum_step2": harness.optimizer_case("wav2vec2", "momentum", 0.8),
    "vit_wd_step2": harness.optimizer_case("vit", "weight_decay", 0.1),
    "bart_clip_step2": harness.optimizer_case("bart", "clip", 0.25),
    "bart_eps_step2": harness.optimizer_case("bart", "eps", 1e-6),
    # an op in the target only, an op missing in the target
    "wav2vec2_extra_normalize": ("wav2vec2", "base", {"kind": "normalize"}, ("stats",)),
    "bart_missing_ln_embedding": ("bart", "base", {"kind": "missing_ln_emb"}, ("stats",)),
    # a changed scalar argument
    "bart_no_label_smoothing": ("bart", "base", {"kind": "smoothing", "value": 0.0}, ("stats",)),
    "granite_logits_scaling": ("granite", "base", {"kind": "logits_scaling", "value": 1.0}, ("stats",)),
    # a wrong kernel in one layer
    "bart_softmax_fp16_L1": ("bart", "base", {"kind": "softmax_fp16", "layer": 1}, ("stats", "tensor")),
    "wav2vec2_gelu_tanh_L1": ("wav2vec2", "base", {"kind": "gelu_tanh", "layer": 1}, ("stats",)),
    "vit_key_nobias_L1": ("vit", "base", {"kind": "key_nobias", "layer": 1}, ("stats", "tensor")),
    # backward only: the feature encoder's gradient multiplier
    "wav2vec2_grad_mult": ("wav2vec2", "base", {"kind": "grad_mult", "value": 1.0}, ("stats", "tensor")),
    # parameters and data
    "vit_patch_step1": harness.weight_case("vit", "vit.embeddings.patch_embeddings.projection.weight", 1, "sign2pct"),
    "granite_down_swap_step2": harness.weight_case(
        "granite", "model.layers.1.mlp.down_proj.weight", 2, "from_layer0", harness.BOTH
    ),
    "wav2vec2_gain_mb2_step1": ("wav2vec2", "base", {"kind": "gain", "step": 1, "micro": 1}, ("stats",)),
    "granite_ids_step2": ("granite", "base", {"kind": "ids", "step": 2}, ("stats", "tensor")),
    "wav2vec2_transcript_step2": ("wav2vec2", "base", {"kind": "labels", "step": 2}, ("stats",)),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "from_layer0": "replaced by layer 0's down_proj weight (a resumed checkpoint's key mapped to the wrong layer)",
}
MICRO = {"wav2vec2": 2}  # micro-batches per step
AUTOCAST = {"vit": "bfloat16", "bart": "float16"}
PURE_BF16 = {"granite", "granite_wide"}
FLIP_STEP = STEPS - 1  # the crafted tie is at the last step
GRAD_MULT = 0.1  # fairseq's feature_grad_mult: the feature encoder's gradient x 0.1 (its forward the identity)
LOGITS_SCALING = 4.0


class Tracer(v2.Tracer):
    """Set 2's tracer (record names, marks, parameter uses by linear, the loss); parameter uses by conv2d too, the
    dropouts and (where asked) the divisions marked, and every argmax's output."""

    def __init__(self):
        super().__init__()
        self.argmax: list[dict] = []
        self.mark_div = False

    def install(self) -> None:
        import torch
        import torch.nn.functional as F

        super().install()
        conv2d, dropout, div = F.conv2d, F.dropout, torch.Tensor.__truediv__
        tracer = self

        def conv2d_fn(input, weight, *args, **kwargs):
            out = conv2d(input, weight, *args, **kwargs)
            tracer._param_use(weight)
            return out

        def dropout_fn(input, *args, **kwargs):
            out = dropout(input, *args, **kwargs)
            tracer.mark("dropout")
            return out

        def div_fn(self, other):
            out = div(self, other)
            if tracer.mark_div:
                tracer.mark_div = False
                tracer.mark("div")
            return out

        F.conv2d, F.dropout, torch.Tensor.__truediv__ = conv2d_fn, dropout_fn, div_fn


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
def _gelu_at_call_time(model) -> None:
    """transformers' GELU modules keep the F.gelu they were built with: make them look it up at call time, so that
    msprobe (and a device) see it."""
    import torch.nn.functional as F
    from transformers.activations import GELUActivation

    for m in model.modules():
        if isinstance(m, GELUActivation):
            m.act = lambda x: F.gelu(x)


def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    if family == "vit":
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(
            image_size=SIZE,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=CLASSES,
            attn_implementation="eager",
        )
        model = ViTForImageClassification(cfg)
    elif family == "wav2vec2":
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        cfg = Wav2Vec2Config(
            vocab_size=CTC_VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_act="gelu",
            feat_extract_norm="group",
            feat_extract_activation="gelu",
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            conv_bias=False,
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4,
            do_stable_layer_norm=False,
            hidden_dropout=0.0,
            activation_dropout=0.0,
            attention_dropout=0.0,
            feat_proj_dropout=0.0,
            final_dropout=0.0,
            layerdrop=0.0,
            mask_time_prob=0.0,
            mask_feature_prob=0.0,
            pad_token_id=0,
            ctc_loss_reduction="mean",
            attn_implementation="eager",
        )
        model = Wav2Vec2ForCTC(cfg)
    elif family == "bart":
        from transformers import BartConfig, BartForConditionalGeneration

        cfg = BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            activation_function="gelu",
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
            scale_embedding=False,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            attn_implementation="eager",
        )
        model = BartForConditionalGeneration(cfg)
    else:
        from transformers import GraniteConfig, GraniteForCausalLM

        wide = family == "granite_wide"
        cfg = GraniteConfig(
            vocab_size=VOCAB,
            hidden_size=WIDE_HIDDEN if wide else 32,
            intermediate_size=2 * WIDE_HIDDEN if wide else 64,
            num_hidden_layers=2,
            num_attention_heads=8 if wide else 4,
            num_key_value_heads=4 if wide else 2,
            max_position_embeddings=WIDE_SEQ if wide else 64,
            embedding_multiplier=6.0,
            attention_multiplier=1.0 / 16,
            residual_multiplier=0.5,
            logits_scaling=LOGITS_SCALING,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = GraniteForCausalLM(cfg).to(torch.bfloat16)
    _gelu_at_call_time(model)
    model.train()
    return model


def _waveforms(g, n: int):
    """``n`` utterances of SAMPLES samples: three tones with random pitch and a random envelope, noise and a small
    DC offset (amplitude about 0.2: not normalised)."""
    import torch

    t = torch.arange(SAMPLES, dtype=torch.float32) / 16000.0
    waves = []
    for _ in range(n):
        f = 200.0 + 1800.0 * torch.rand(3, generator=g)
        a = 0.05 + 0.1 * torch.rand(3, generator=g)
        env = torch.sigmoid((t - 0.001 - 0.003 * torch.rand(1, generator=g)) * 4000.0)
        w = (a[:, None] * torch.sin(2 * math.pi * f[:, None] * t)).sum(0) * env
        waves.append(w + 0.01 * torch.randn(SAMPLES, generator=g) + 0.02)
    return torch.stack(waves)


def batches(family: str, fault) -> list[list[dict]]:
    """Per step, per micro-batch: the model's inputs (``harness.draw_batches``). A data fault changes one step's
    batch."""
    out = harness.draw_batches(DATA_SEED, STEPS, MICRO.get(family, 1), lambda g: _micro_batch(family, g))
    if fault and fault["kind"] in ("ids", "labels", "gain"):
        b = out[fault["step"]][fault.get("micro", 0)]
        if fault["kind"] == "ids":
            b["input_ids"][0, 6] = (b["input_ids"][0, 6] + 1) % VOCAB  # one token id +1
        elif fault["kind"] == "labels":  # two symbols of the first utterance's transcript changed
            lab = b["labels"]
            lab[0, 2] = lab[0, 2] % (CTC_VOCAB - 1) + 1
            lab[0, 4] = (lab[0, 4] + 4) % (CTC_VOCAB - 1) + 1
        else:
            b["input_values"] = b["input_values"] * 0.5  # a gain augmentation applied twice
    return out


def _micro_batch(family: str, g) -> dict:
    """One micro-batch of ``family``'s inputs, drawn from generator ``g``."""
    import torch

    if family == "vit":
        px = torch.rand(IMAGES, 3, SIZE, SIZE, generator=g)
        return {"pixel_values": px, "labels": torch.randint(0, CLASSES, (IMAGES,), generator=g)}
    elif family == "wav2vec2":
        wave = _waveforms(g, BATCH)
        return {"input_values": wave, "labels": torch.randint(1, CTC_VOCAB, (BATCH, TRANSCRIPT), generator=g)}
    elif family == "bart":
        src = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)
        lab = torch.randint(4, VOCAB, (BATCH, TGT_LEN), generator=g)
        return {"input_ids": src, "labels": lab}
    else:
        n, seq = (1, WIDE_SEQ) if family == "granite_wide" else (BATCH, SEQ)
        ids = torch.randint(0, VOCAB, (n, seq), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def _hf(family: str):
    return harness.hf_module("granite" if family == "granite_wide" else family)


def family_faults(family: str) -> list[dict]:
    return harness.family_faults(sys.modules[__name__], family)


class GradMultiply:
    """fairseq's GradMultiply: the identity forward (a copy) and the gradient x ``scale`` backward (a
    custom autograd function: msprobe records its backward's multiply as a forward record after the loss)."""

    @staticmethod
    def make(tracer):
        import torch

        class _GradMultiply(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, scale):
                ctx.scale = scale
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                out = grad * ctx.scale
                tracer.mark("grad_mult.back")
                return out, None

        return _GradMultiply.apply


def patch(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch
    import torch.nn.functional as F

    on = lambda kind: active is not None and active["kind"] == kind  # noqa: E731

    if family == "vit":
        for fault in family_faults(family):
            if fault["kind"] == "key_nobias":
                li = fault["layer"]
                key = model.vit.layers[li].attention.k_proj
                drop = on("key_nobias")

                def key_fwd(x, key=key, drop=drop, tag="L%d.key" % li):
                    y = F.linear(x, key.weight, None if drop else key.bias)
                    tracer.mark(tag)
                    return y

                key.forward = key_fwd

    if family == "wav2vec2":
        enc = model.wav2vec2.feature_extractor
        grad_mult = GradMultiply.make(tracer)
        scale = active["value"] if on("grad_mult") else GRAD_MULT

        def fe_fwd(input_values, enc=enc):  # Wav2Vec2FeatureEncoder.forward, then fairseq's gradient multiplier
            h = input_values[:, None]
            if enc._requires_grad and enc.training:
                h.requires_grad = True
            for layer in enc.conv_layers:
                h = layer(h)
            return grad_mult(h, scale)

        enc.forward = fe_fwd
        conv0 = enc.conv_layers[0]

        def conv0_fwd(x, layer=conv0):  # the first conv layer: conv (F.conv1d, marked), GroupNorm, GELU
            c = layer.conv
            y = F.conv1d(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)
            tracer.mark("conv0.conv")
            return layer.activation(layer.layer_norm(y))

        conv0.forward = conv0_fwd
        for fault in family_faults(family):
            if fault["kind"] == "gelu_tanh":
                li = fault["layer"]
                ff = model.wav2vec2.encoder.layers[li].feed_forward
                approx = "tanh" if on("gelu_tanh") else "none"

                def act(x, approx=approx, tag="L%d.act" % li):
                    y = F.gelu(x, approximate=approx)
                    tracer.mark(tag)
                    return y

                ff.intermediate_act_fn.act = act  # the GELU module of that layer (its own instance)

    if family == "bart":
        hf = _hf(family)
        enc = model.model.encoder
        ln = enc.layernorm_embedding
        skip = on("missing_ln_emb")

        def ln_fwd(x, ln=ln, skip=skip):
            if skip:  # a port that drops the embeddings' LayerNorm
                return x
            y = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
            tracer.mark("ln_emb")
            return y

        ln.forward = ln_fwd
        faulty = None
        for fault in family_faults(family):
            if fault["kind"] == "softmax_fp16":
                faulty = model.model.decoder.layers[fault["layer"]].self_attn
        wrong = on("softmax_fp16")

        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            """BART's eager attention, call for call; the faulty layer's softmax marked (and, with the fault, a
            hand-written fp16 softmax without max subtraction)."""
            if scaling is None:
                scaling = query.size(-1) ** -0.5
            attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            if module is faulty and wrong:
                e = torch.exp(attn_weights.half())  # msprobe records no casts: the exp is the kernel's first record
                tracer.mark("L.softmax")
                attn_weights = e / e.sum(dim=-1, keepdim=True)
            else:
                attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
                if module is faulty:
                    tracer.mark("L.softmax")
            attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
            attn_output = torch.matmul(attn_weights, value)
            attn_output = attn_output.transpose(1, 2).contiguous()
            return attn_output, attn_weights

        hf.eager_attention_forward = attention

    if family in ("granite", "granite_wide"):
        emb = model.model.embed_tokens
        harness.embed_mark(tracer, emb, "embedding")
        head = model.lm_head

        def head_fwd(x, head=head):
            y = F.linear(x, head.weight, head.bias)
            tracer.mark("lm_head")
            tracer.mark_div = True  # the next division is the logits' / logits_scaling
            return y

        head.forward = head_fwd
        if on("logits_scaling"):
            model.config.logits_scaling = active["value"]  # a port that ignores the checkpoint's logits_scaling

    harness.watch_weights(sys.modules[__name__], family, model, tracer)


def corrupt(model, fault) -> None:
    import torch

    if fault["how"] == "from_layer0":
        params = dict(model.named_parameters())
        with torch.no_grad():
            params[fault["param"]].copy_(params[fault["param"].replace("layers.1.", "layers.0.")])
        return
    harness.corrupt(model, fault, {})


def make_optimizer(family: str, model):
    """The family's optimizer; on a device with a fused optimizer kernel, that kernel (checked on every step)."""
    import torch

    dev = devices5.installed()
    make = dev.optimizer if dev is not None else (lambda cls, params, **kw: cls(params, **kw))
    params = model.parameters()
    if family == "vit":
        return make(torch.optim.AdamW, params, lr=1e-3, weight_decay=0.05, amsgrad=True)
    if family == "wav2vec2":
        return make(torch.optim.SGD, params, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-4)
    if family == "bart":
        return make(torch.optim.Adamax, params, lr=2e-3)
    return make(torch.optim.Adagrad, params, lr=1e-2)


def forward_loss(family: str, model, batch: dict, fault, tracer):
    """The model's loss and logits."""
    import torch
    import torch.nn.functional as F

    kind = fault["kind"] if fault else None
    if family == "vit":
        px = (batch["pixel_values"] - 0.5) / 0.5
        logits = model(pixel_values=px).logits
        return F.cross_entropy(logits, batch["labels"], label_smoothing=LABEL_SMOOTHING), logits
    if family == "wav2vec2":
        wave = batch["input_values"]
        if kind == "normalize":  # the feature extractor's do_normalize applied on top of a normalising loader
            mean = wave.mean(-1, keepdim=True)
            if tracer is not None:
                tracer.mark("norm_mean")
            wave = (wave - mean) / torch.sqrt(wave.var(-1, keepdim=True) + 1e-7)
        logits = model(input_values=wave).logits
        log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
        lab = batch["labels"]
        n, frames = logits.shape[0], logits.shape[1]
        loss = F.ctc_loss(
            log_probs,
            lab,
            torch.full((n,), frames, dtype=torch.long),
            torch.full((n,), lab.shape[1], dtype=torch.long),
            blank=0,
            reduction="mean",
            zero_infinity=True,
        )
        if tracer is not None:
            tracer.mark("ctc")
        return loss, logits
    if family == "bart":
        lab = batch["labels"]
        dec_in = torch.cat([torch.full((lab.shape[0], 1), 2, dtype=lab.dtype), lab[:, :-1]], dim=1)
        logits = model(input_ids=batch["input_ids"], decoder_input_ids=dec_in).logits
        smoothing = fault["value"] if kind == "smoothing" else LABEL_SMOOTHING
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), label_smoothing=smoothing)
        return loss, logits
    if tracer is not None:
        tracer.mark_div = False
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    if tracer is not None:
        tracer.mark_div = False
    return out.loss, out.logits


OPTIMIZER_KINDS = ("lr", "clip", "momentum", "weight_decay", "eps")
ARGMAX_FAMILY = "wav2vec2"  # the greedy CTC transcript, an argmax over each frame's logits inside the window


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """wav2vec2 'flip' variant, in both runs alike: a tilt of one row of the CTC head, added before the last step,
    that ties one frame's top-2 logits in the reference to within a few fp32 ulps, chosen (by simulating both runs
    without msprobe) so that the device's rounding flips that frame's greedy symbol and no other
    (``harness.craft_near_tie``, on each step's first micro-batch: the generator checks both).

    Returns (what was done, the tilt to add to the head's weight before step FLIP_STEP)."""
    return harness.craft_first_micro(sys.modules[__name__], "wav2vec2", model, model.lm_head, data, device)


def run_device(family: str, variant: str, target: bool):
    """The device a run is on (None: the stock reference; ``harness.run_device``)."""
    return harness.run_device(sys.modules[__name__], family, variant, target)


def flip_head(model):
    return model.lm_head


def run_one(job: dict) -> dict:
    """One msprobe run (``harness.run_one``)."""
    return harness.run_one(sys.modules[__name__], job)


def structure_differences(ref_dir: Path, tgt_dir: Path, variant: str) -> list[str]:
    """Set 2's structure check; the "amp" variant's runs may differ in dtypes (its autocast policy), nothing else
    (``harness.structure_differences``; the cross set checks its pairs with it)."""
    return harness.structure_differences(ref_dir, tgt_dir, STEPS, variant)


# =================================================================================================================
# the key
# =================================================================================================================
def _nth(case: str, res: dict, tag: str, step: int, n: int) -> str:
    names = v2._names(res, tag, step)
    if len(names) <= n or names[n] is None:
        raise SystemExit("%s: mark %r #%d at step %d: %r" % (case, tag, n, step, names))
    return names[n]


def _after(case: str, res: dict, first: str, tag: str, step: int) -> str:
    """The record of the first mark ``tag`` after the first mark ``first`` at ``step``."""
    seen = False
    for m in res["marks"]:
        if m["step"] != step:
            continue
        if m["tag"] == first:
            seen = True
        elif seen and m["tag"] == tag and m["record"]:
            return m["record"]
    raise SystemExit("%s: no mark %r after %r at step %d" % (case, tag, first, step))


def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
    """What the verdict should say about a fault, from the marks both runs made at the faulty call."""
    kind = fault["kind"]
    one, first, both = harness.mark_readers(case, tgt, ref)
    if kind in OPTIMIZER_KINDS:
        what = {
            "momentum": "SGD momentum %g instead of 0.9",
            "weight_decay": "AdamW weight decay %g instead of 0.05",
            "eps": "Adamax eps %g instead of 1e-8",
        }
        return harness.optimizer_expectation(fault, harness.optimizer_what(fault, CLIP, what))
    if kind == "normalize":
        return {
            "step": 0,
            "ops": [first(tgt, "norm_mean", 0)],
            "what": "the waveforms normalised to zero mean and unit variance in the target only (the feature "
            "extractor's do_normalize applied on audio the reference feeds raw): an extra mean, subtract, variance, "
            "add, sqrt and divide; the mean is the first record the reference does not have",
        }
    if kind == "missing_ln_emb":
        ln, drop = first(ref, "ln_emb", 0), first(tgt, "dropout", 0)
        return {
            "step": 0,
            "ops": sorted({ln, drop}),
            # the leaf modules of each run's own record (the target's layer_norm.0 is another LayerNorm)
            "modules": sorted(set(ref["leaf"].get("0", {}).get(ln, [])) | set(tgt["leaf"].get("0", {}).get(drop, []))),
            "what": "the encoder's LayerNorm on the embeddings (layernorm_embedding) missing in the target (the "
            "reference's layer_norm; its consumer in the target, the dropout (p = 0) after it, also counts)",
        }
    if kind == "smoothing":
        return {
            "step": 0,
            "ops": both("cross_entropy", 0),
            "what": "the cross-entropy without label smoothing (label_smoothing %g instead of %g: a scalar argument)"
            % (fault["value"], LABEL_SMOOTHING),
        }
    if kind == "logits_scaling":
        return {
            "step": 0,
            "ops": sorted({_after(case, r, "lm_head", "div", 0) for r in (tgt, ref)}),
            "what": "the logits divided by %g instead of Granite's logits_scaling %g (a port that ignores the "
            "config: a scalar argument of the division after the lm_head)" % (fault["value"], LOGITS_SCALING),
        }
    if kind == "softmax_fp16":
        return {
            "step": 0,
            "ops": sorted({first(tgt, "L.softmax", 0), first(ref, "L.softmax", 0)}),
            "what": "decoder layer %d's self-attention softmax by a hand-written kernel: the scores cast to fp16, "
            "exp and a sum without max subtraction, a divide (the reference's softmax; the target's exp, the "
            "kernel's first record)" % fault["layer"],
        }
    if kind == "gelu_tanh":
        li = fault["layer"]
        return {
            "step": 0,
            "ops": both("L%d.act" % li, 0, first),  # the first micro-batch's
            "what": "layer %d's feed-forward GELU with approximate='tanh' instead of the exact GELU" % li,
        }
    if kind == "key_nobias":
        li = fault["layer"]
        return {
            "step": 0,
            "ops": both("L%d.key" % li, 0),
            "what": "layer %d's attention key projection computed without its bias (a kernel that drops it)" % li,
        }
    if kind == "grad_mult":
        return {
            "step": 0,
            "ops": both("grad_mult.back", 0, first),
            "backward_only": True,
            "what": "the feature encoder's gradient multiplier (fairseq's feature_grad_mult) %g instead of %g: the "
            "forward is the same, the gradient into the feature encoder not; the multiply in the custom backward "
            "(recorded after the loss; the first micro-batch's: backward runs per micro-batch) is the culprit"
            % (fault["value"], GRAD_MULT),
        }
    if kind == "weight":
        return harness.weight_expectation(fault, HOW[fault["how"]], both)
    if kind == "ids":
        return harness.data_expectation(
            fault,
            both("embedding", fault["step"], first),
            "one token id differs (+1) in the batch of step %d; the embedding is its first consumer",
        )
    if kind == "gain":
        step, mb = fault["step"], fault["micro"]
        ops = sorted({_nth(case, r, "conv0.conv", step, mb) for r in (tgt, ref)})
        return harness.data_expectation(
            fault,
            ops,
            "the second micro-batch's waveforms at half amplitude in step %%d (a gain augmentation applied twice); "
            "their first consumer: the feature encoder's first convolution (micro-batch %d; msprobe records no "
            "slice of the input before it)" % (mb + 1),
        )
    if kind == "labels":
        return harness.data_expectation(
            fault,
            both("ctc", fault["step"], first),
            "two symbols of the first utterance's transcript differ in step %d's first micro-batch; the CTC loss is "
            "their first consumer",
        )
    raise ValueError(kind)


def argmax_flips(tgt: dict, ref: dict) -> list[dict]:
    return harness.argmax_flips(tgt, ref)


def warm() -> None:
    """The imports made once, before forking."""
    harness.warm("ViTForImageClassification", "Wav2Vec2ForCTC", "BartForConditionalGeneration", "GraniteForCausalLM")


def main(argv=None) -> int:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

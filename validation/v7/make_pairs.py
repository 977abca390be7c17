"""Validation set 7 for dumpstore's verdict: msprobe dumps of four model families no other set uses.

Built apart from the development set and from sets 1 to 6: other families (Swin, Whisper, OLMoE, SigLIP: a
hierarchical vision transformer with shifted-window attention, relative position bias and patch merging; a speech
encoder-decoder with a conv1d stem over log-mel features and cross-attention; a mixture-of-experts language model
with top-2 routing over 4 experts, grouped-query attention and QK-norm; a two-tower image-text model with a
sigmoid pairwise loss and a learned bias), other dtype and optimizer setups (SGD with momentum and a polynomial
learning-rate decay over 2 micro-batches, a hand-written Adan under fp16 autocast with loss scaling, a hand-written
AdaBelief with parameter groups in pure bf16, Adagrad with learning-rate decay and a frozen embedding under bf16
autocast) and other simulated devices (``validation/v7/devices.py``: Strassen matmuls, a base-2 cross-entropy,
Winograd conv1d, a matrix unit with a truncated accumulator, fp32 segment sums in the embedding's backward, an
autocast policy with norm in fp32). Every pair is a reference run ("GPU": plain CPU torch in the family's dtype) and
a target run on the family's simulated device, with or without one fault. The answer of every case is known by
construction and written to ``<out>/key.json`` (set 1's format, so ``validation/score.py`` scores it); the culprit's
msprobe record name is read from msprobe while the faulty call runs, never from dumpstore.

    .venv/bin/python validation/v7/make_pairs.py --out validation/v7/.data [--jobs 2] [--only CASE ...]

The driver (arguments, runs, checks, key, the training loop, one run) is ``validation/harness.py``; the run harness
(the tracer of msprobe's record names, the forked runs, msprobe's config, the structure check) is set 2's
``validation/v2/make_pairs.py``; set 6's tracer (parameter uses by conv2d and exp, argmax logs) and set 5's
GELU-at-call-time patch and n-th mark reader are imported. What is here: the families, their optimizers and setups,
the faults and the expected culprits. Runs: 3 training steps; forward and backward (every
micro-batch where there are two) inside msprobe's window, clipping and the optimizer step outside it; msprobe level
"mix"; statistics mode for every case and tensor mode for a subset.
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
devices7 = harness._load("validation_v7_devices", HERE / "devices.py")  # this set's devices, under their own name
v2 = harness.set2()  # set 2's run harness (its tracer, its top-k flips)
# set 5's generator: its GELU-at-call-time patch and its n-th mark reader
v5 = harness._load("validation_v5_make_pairs", HERE.parent / "v5" / "make_pairs.py")
# set 6's generator: its tracer (parameter uses by conv2d and exp, the next record after a mark)
v6 = harness._load("validation_v6_make_pairs", HERE.parent / "v6" / "make_pairs.py")

SET = 7
STEPS = v2.STEPS  # 3
VOCAB = 96
IMAGES, SIZE, CLASSES = 2, 16, 10  # swin: 2 images of 3x16x16 per micro-batch, 10 classes
MELS, FRAMES, TOKENS = 16, 32, 8  # whisper: 16 mel bins x 32 frames, 8 transcript tokens, batch 2
BATCH, SEQ = 2, 16  # olmoe
WIDE_HIDDEN, WIDE_SEQ = 512, 64  # olmoe_wide: the long reductions
PAIRS, CAPTION, SIG_SIZE = 4, 8, 12  # siglip: 4 image-caption pairs of 3x12x12 images and 8 tokens
LABEL_SMOOTHING = 0.1
CLIP = 1.0
DATA_SEED = 7193
DEVICES = devices7.DEVICES
NOISY_REF = "AJ"
AMP_DEVICE = "AI"  # the "amp" variant's target: the family's device under another autocast policy
DECODER_START = 2

FAMILIES = {
    "swin": {
        "text": "Swin (hierarchical vision transformer): 2x2 patches of 3x16x16 images (an 8x8 grid, embedding 16, "
        "LayerNorm), stage 0 of 2 blocks (window 4x4 attention with a learned relative position bias, the second "
        "block's windows shifted by 2 with torch.roll and an attention mask), patch merging to 4x4 (32 channels), "
        "stage 1 of one block; MLP ratio 2, GELU (stage 1's a fused tanh-GELU autograd function with a hand-written "
        "backward, Megatron's bias_gelu formula), pre-LN; mean pooling, LayerNorm, a linear classifier (10 classes); "
        "cross-entropy with label smoothing 0.1; fp32; gradient accumulation over 2 micro-batches of 2 images; SGD "
        "(lr 0.05, momentum 0.9, weight decay 1e-4) with a polynomial learning-rate decay (power 2 over 10 updates) "
        "built in; the batch's predicted classes (an argmax) inside the window",
        "device": "AE",
        "seed": 71,
    },
    "whisper": {
        "text": "Whisper (speech encoder-decoder): log-mel features (16 bins x 32 frames), a conv1d stem (kernel 3, "
        "then kernel 3 stride 2, GELU), sinusoidal positions, 2 encoder layers and 1 decoder layer (self- and "
        "cross-attention), hidden 32 (4 heads, MLP 64), GELU, pre-LN, output projection tied to the token "
        "embedding; 8-token transcripts (teacher forcing), batch 2; next-token cross-entropy; fp32 weights under "
        "fp16 autocast with dynamic loss scaling (GradScaler, initial scale 2^10); Adan (hand-written: lr 2e-3, "
        "betas 0.98 / 0.92 / 0.99, weight decay 0.02, eps 1e-8)",
        "device": "AF",
        "seed": 72,
    },
    "olmoe": {
        "text": "OLMoE (mixture-of-experts LM): 4 experts, top-2 routing (softmax over the experts in fp32, "
        "unnormalised top-2 weights, the eager expert loop), SwiGLU experts, grouped-query attention (4 query heads, "
        "2 KV heads) with QK-norm (RMSNorm over the query and key projections), RoPE, RMSNorm; hidden 32 (expert MLP "
        "32), 2 layers; 16 tokens, batch 2; next-token cross-entropy; pure bf16 (weights, activations, optimizer "
        "state); AdaBelief (hand-written: lr 2e-3, betas 0.9 / 0.999, eps 1e-8, decoupled weight decay) with two "
        "parameter groups: matrices weight decay 0.01, norms and the router 0",
        "device": "AG",
        "seed": 73,
    },
    "olmoe_wide": {
        "text": "OLMoE as above with long reductions: hidden 512 (8 heads of 64, 4 KV heads, expert MLP 512), 2 "
        "layers; 64 tokens, batch 1 (linear sums of 512 terms, RMSNorm over 512); pure bf16; AdaBelief",
        "device": "AG",
        "seed": 74,
    },
    "siglip": {
        "text": "SigLIP (two towers, sigmoid loss): a ViT image tower (4x4 patches of 3x12x12 images, learned "
        "positions, 2 layers, a multi-head attention pooling head) and a text tower (8-token captions, 1 layer, the "
        "last token pooled, a linear head), both hidden 32 (4 heads, MLP 64, tanh-GELU); embeddings L2-normalised "
        "(Tensor.norm), logits scaled by exp(logit_scale) plus a learned bias, the pairwise sigmoid loss "
        "(logsigmoid) over 4 image-caption pairs; fp32 weights under bf16 autocast; Adagrad (lr 0.02, lr_decay "
        "0.01, initial accumulator 0.1); the text token embedding frozen",
        "device": "AH",
        "seed": 75,
    },
}

# name -> family, reference variant ("flip": the classifier tilted to a near-tie; "noisyref": the reference rerun on
# device AJ; "amp": the target under another autocast policy, device AI), fault (None: clean), dump modes. The
# expected culprit comes from what msprobe named at the faulty call.
CASES = {
    "swin_clean": ("swin", "base", None, ("stats",)),
    "whisper_clean": ("whisper", "base", None, ("stats", "tensor")),
    "olmoe_clean": ("olmoe", "base", None, ("stats", "tensor")),
    "siglip_clean": ("siglip", "base", None, ("stats", "tensor")),
    "olmoe_wide_clean": ("olmoe_wide", "base", None, ("stats",)),
    "swin_flip": ("swin", "flip", None, ("stats",)),
    "whisper_noisyref": ("whisper", "noisyref", None, ("stats",)),
    "siglip_amp": ("siglip", "amp", None, ("stats", "tensor")),
    # optimizer, from the second update on
    "swin_lr_step2": harness.optimizer_case("swin", "lr", 1.1),
    "olmoe_lr_step2": harness.optimizer_case("olmoe", "lr", 1.05),
    "swin_momentum_step2": harness.optimizer_case("swin", "momentum", 0.8),
    "whisper_betas_step2": harness.optimizer_case("whisper", "betas", (0.9, 0.92, 0.99)),
    "olmoe_wd_step2": harness.optimizer_case("olmoe", "weight_decay", 0.1),
    "whisper_eps_step2": harness.optimizer_case("whisper", "eps", 1e-3),
    "siglip_gradclip_step2": harness.optimizer_case("siglip", "clip", 0.1, harness.BOTH),
    # an op in the target only, an op missing in the target
    "whisper_extra_embed_scale": ("whisper", "base", {"kind": "embed_scale"}, ("stats", "tensor")),
    "swin_missing_shift_mask": ("swin", "base", {"kind": "missing_mask"}, ("stats",)),
    # a changed scalar argument
    "swin_roll_shift_B1": ("swin", "base", {"kind": "roll_shift", "value": 1}, ("stats",)),
    # a wrong kernel in one layer
    "whisper_gelu_tanh_L1": ("whisper", "base", {"kind": "gelu_tanh", "layer": 1}, ("stats",)),
    "siglip_fc2_nobias_L1": ("siglip", "base", {"kind": "fc2_nobias", "layer": 1}, ("stats", "tensor")),
    # backward only: the fused tanh-GELU's hand-written backward with a wrong constant
    "swin_gelu_backward_S1": ("swin", "base", {"kind": "gelu_backward"}, ("stats",)),
    # parameters and data
    "olmoe_router_swap_step1": harness.weight_case(
        "olmoe", "model.layers.1.mlp.gate.weight", 1, "swap_experts", harness.BOTH
    ),
    "swin_query_step2": harness.weight_case(
        "swin", "swin.encoder.layers.0.blocks.0.attention.q_proj.weight", 2, "sign2pct"
    ),
    "whisper_features_step1": ("whisper", "base", {"kind": "features", "step": 1}, ("stats", "tensor")),
    "swin_transposed_mb2_step2": ("swin", "base", {"kind": "transposed", "step": 2, "micro": 1}, ("stats",)),
    "siglip_stale_image_step2": ("siglip", "base", {"kind": "stale_image", "step": 2}, ("stats", "tensor")),
    "whisper_labels_step2": ("whisper", "base", {"kind": "labels", "step": 2}, ("stats",)),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "swap_experts": "with the rows of experts 1 and 2 swapped (a checkpoint conversion that orders the experts "
    "differently from the expert weights)",
}
MICRO = {"swin": 2}  # micro-batches per step
AUTOCAST = {"whisper": "float16", "siglip": "bfloat16"}
PURE_BF16 = {"olmoe", "olmoe_wide"}
FLIP_STEP = STEPS - 1  # the crafted tie is at the last step
GELU_K = 0.79788456  # sqrt(2 / pi), as Megatron's bias_gelu writes it
GELU_C = 0.044715
GELU_DC = 0.1070322243  # 3 * GELU_C * GELU_K: the derivative's coefficient
GELU_DC_WRONG = 0.0356774081  # GELU_C * GELU_K: the factor 3 forgotten


class Tracer(v6.Tracer):
    """Set 6's tracer (set 2's record names, marks, parameter uses by linear, conv2d and exp, the loss, the top-k
    choices; every argmax's output; the next API record after a mark)."""


# =================================================================================================================
# optimizers written here (as users write them)
# =================================================================================================================
def _optim_classes():
    import torch

    class PolySGD(torch.optim.SGD):
        """torch's SGD whose learning rate decays polynomially, built in: update t uses lr (1 - (t - 1) / total)^power
        (the group's "lr" is the peak rate)."""

        def __init__(self, params, lr, momentum, weight_decay, total=10, power=2.0):
            super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
            self.total, self.power, self.t = total, power, 0

        def step(self, closure=None):
            self.t += 1
            factor = (1.0 - (self.t - 1) / self.total) ** self.power
            peaks = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] = group["lr"] * factor
            try:
                return super().step(closure)
            finally:
                for group, peak in zip(self.param_groups, peaks):
                    group["lr"] = peak

    class Adan(torch.optim.Optimizer):
        """Adan (Xie et al. 2022): m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2)(g - g_prev);
        n <- b3 n + (1 - b3)(g + b2 (g - g_prev))^2; p <- p (1 - lr wd) - lr (m^ + b2 v^) / (sqrt(n^) + eps), the
        hats bias-corrected; g_prev = g at the first update."""

        def __init__(self, params, lr, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0):
            super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                b1, b2, b3 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    g = p.grad
                    st = self.state[p]
                    if not st:
                        st["step"] = 0
                        st["m"], st["v"], st["n"] = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
                        st["prev"] = g.clone()
                    st["step"] += 1
                    t = st["step"]
                    diff = g - st["prev"]
                    st["m"].mul_(b1).add_(g, alpha=1 - b1)
                    st["v"].mul_(b2).add_(diff, alpha=1 - b2)
                    st["n"].mul_(b3).addcmul_(g + b2 * diff, g + b2 * diff, value=1 - b3)
                    denom = (st["n"] / (1 - b3**t)).sqrt() + group["eps"]
                    update = (st["m"] / (1 - b1**t) + b2 * st["v"] / (1 - b2**t)) / denom
                    p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                    st["prev"].copy_(g)

    class AdaBelief(torch.optim.Optimizer):
        """AdaBelief (Zhuang et al. 2020): m <- b1 m + (1 - b1) g; s <- b2 s + (1 - b2)(g - m)^2 + eps;
        p <- p (1 - lr wd) - lr m^ / (sqrt(s^) + eps), the hats bias-corrected; computed in fp32 from the bf16
        parameter and state, stored back in bf16 (round to nearest)."""

        def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
            super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                b1, b2 = group["betas"]
                lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["step"], st["m"], st["s"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                    st["step"] += 1
                    t = st["step"]
                    g, m, s = p.grad.float(), st["m"].float(), st["s"].float()
                    m = b1 * m + (1 - b1) * g
                    s = b2 * s + (1 - b2) * (g - m) ** 2 + eps
                    new = p.float() * (1 - lr * wd) - lr * (m / (1 - b1**t)) / ((s / (1 - b2**t)).sqrt() + eps)
                    st["m"].copy_(m)
                    st["s"].copy_(s)
                    p.copy_(new)

    return PolySGD, Adan, AdaBelief


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    if family == "swin":
        from transformers import SwinConfig, SwinForImageClassification

        cfg = SwinConfig(
            image_size=SIZE,
            patch_size=2,
            num_channels=3,
            embed_dim=16,
            depths=[2, 1],
            num_heads=[2, 4],
            window_size=4,
            mlp_ratio=2.0,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            drop_path_rate=0.0,
            num_labels=CLASSES,
        )
        cfg._attn_implementation = "eager"
        model = SwinForImageClassification(cfg)
    elif family == "whisper":
        from transformers import WhisperConfig, WhisperForConditionalGeneration

        cfg = WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=MELS,
            encoder_layers=2,
            encoder_attention_heads=4,
            decoder_layers=1,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            d_model=32,
            max_source_positions=FRAMES // 2,
            max_target_positions=16,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            activation_function="gelu",
            scale_embedding=False,
            pad_token_id=1,
            bos_token_id=DECODER_START,
            eos_token_id=VOCAB - 1,
            decoder_start_token_id=DECODER_START,
            use_cache=False,
        )
        cfg._attn_implementation = "eager"
        model = WhisperForConditionalGeneration(cfg)
    elif family in ("olmoe", "olmoe_wide"):
        from transformers import OlmoeConfig, OlmoeForCausalLM

        wide = family == "olmoe_wide"
        cfg = OlmoeConfig(
            vocab_size=VOCAB,
            hidden_size=WIDE_HIDDEN if wide else 32,
            intermediate_size=WIDE_HIDDEN if wide else 32,
            num_hidden_layers=2,
            num_attention_heads=8 if wide else 4,
            num_key_value_heads=4 if wide else 2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=WIDE_SEQ,
            router_aux_loss_coef=0.0,
            output_router_logits=False,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=VOCAB - 1,
            experts_implementation="eager",
        )
        cfg._attn_implementation = "eager"
        model = OlmoeForCausalLM(cfg).to(torch.bfloat16)
    else:
        from transformers import SiglipConfig, SiglipModel

        common = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "attention_dropout": 0.0}
        cfg = SiglipConfig(
            text_config={**common, "num_hidden_layers": 1, "vocab_size": VOCAB, "max_position_embeddings": CAPTION,
                         "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": VOCAB - 1, "projection_size": 32},
            vision_config={**common, "num_hidden_layers": 2, "image_size": SIG_SIZE, "patch_size": 4,
                           "num_channels": 3},
        )  # fmt: skip
        cfg._attn_implementation = "eager"
        cfg.text_config._attn_implementation = "eager"
        cfg.vision_config._attn_implementation = "eager"
        model = SiglipModel(cfg)
        with torch.no_grad():  # SigLIP's initial logit scale and bias: ln(10) and -10
            model.logit_scale.fill_(math.log(10.0))
            model.logit_bias.fill_(-10.0)
        model.text_model.embeddings.token_embedding.weight.requires_grad_(False)  # frozen
    v5._gelu_at_call_time(model)  # GELU modules look F.gelu up at call time (msprobe and the devices see it)
    model.train()
    return model


def _micro_batch(family: str, g) -> dict:
    """One micro-batch's inputs of ``family``, drawn from generator ``g``."""
    import torch

    if family == "swin":
        px = (torch.rand(IMAGES, 3, SIZE, SIZE, generator=g) - 0.45) / 0.25  # normalised by the loader
        return {"pixel_values": px, "labels": torch.randint(0, CLASSES, (IMAGES,), generator=g)}
    if family == "whisper":
        # log-mel features as Whisper's extractor scales them: (max(log10 mel, max - 8) + 4) / 4
        mel = torch.randn(2, MELS, FRAMES, generator=g) * 1.5 - 2.0
        feats = (torch.maximum(mel, mel.amax(dim=(1, 2), keepdim=True) - 8.0) + 4.0) / 4.0
        labels = torch.randint(3, VOCAB - 1, (2, TOKENS), generator=g)
        labels[:, -1] = VOCAB - 1  # end of transcript
        return {"input_features": feats, "mel": mel, "labels": labels}
    if family in ("olmoe", "olmoe_wide"):
        n, seq = (1, WIDE_SEQ) if family == "olmoe_wide" else (BATCH, SEQ)
        return {"input_ids": torch.randint(3, VOCAB, (n, seq), generator=g)}
    px = torch.randn(PAIRS, 3, SIG_SIZE, SIG_SIZE, generator=g) * 0.5
    ids = torch.randint(3, VOCAB, (PAIRS, CAPTION), generator=g)
    return {"pixel_values": px, "input_ids": ids}


def batches(family: str, fault) -> list[list[dict]]:
    """Per step, per micro-batch: the model's inputs (``harness.draw_batches``). A data fault changes one step's
    batch (one micro-batch)."""
    import torch

    out = harness.draw_batches(DATA_SEED, STEPS, MICRO.get(family, 1), lambda g: _micro_batch(family, g))
    if fault and fault["kind"] in ("transposed", "features", "labels", "stale_image"):
        b = out[fault["step"]][fault.get("micro", 0)]
        if fault["kind"] == "transposed":  # one micro-batch's images read HWC as WHC (height and width swapped)
            b["pixel_values"] = b["pixel_values"].transpose(2, 3).contiguous()
        elif fault["kind"] == "features":  # one utterance's features without the extractor's (x + 4) / 4 scaling
            mel = b["mel"][1]
            b["input_features"] = b["input_features"].clone()
            b["input_features"][1] = torch.maximum(mel, mel.max() - 8.0)
        elif fault["kind"] == "labels":  # two transcript labels changed (+1), the decoder's inputs unchanged
            b["decoder_input_ids"] = _shift_right(b["labels"])
            b["labels"] = b["labels"].clone()
            b["labels"][0, 2:4] = (b["labels"][0, 2:4] - 3 + 1) % (VOCAB - 4) + 3
        else:  # pair 0's image from the previous step's batch (a loader reusing a stale buffer)
            b["pixel_values"] = b["pixel_values"].clone()
            b["pixel_values"][0] = out[fault["step"] - 1][0]["pixel_values"][0]
    return out


def _shift_right(labels):
    """The decoder's inputs under teacher forcing: the start token, then the labels but the last."""
    import torch

    start = torch.full_like(labels[:, :1], DECODER_START)
    return torch.cat([start, labels[:, :-1]], 1)


def family_faults(family: str) -> list[dict]:
    return harness.family_faults(sys.modules[__name__], family)


def _swin_attention(tracer, attn, tags: dict, skip_mask: bool):
    """transformers' Swin window attention (eager), call for call, with marks: ``tags`` names the mask's add
    ("mask_add") and the scores' add ("scores_add") to mark; ``skip_mask``: the shift mask not added to the
    relative position bias (a port whose combined mask forgets it)."""
    import torch
    import torch.nn.functional as F

    def forward(hidden_states, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q = attn.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = attn.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        combined = attn.relative_position_bias()
        if attention_mask is not None:
            num_windows, seq_len = attention_mask.shape[0], input_shape[1]
            mask = (
                attention_mask.unsqueeze(1)
                .unsqueeze(0)
                .expand(input_shape[0] // num_windows, -1, -1, -1, -1)
                .reshape(-1, 1, seq_len, seq_len)
            )
            if not skip_mask:
                combined = combined + mask
                if "mask_add" in tags:
                    tracer.mark(tags["mask_add"])
        w = torch.matmul(q, k.transpose(2, 3)) * attn.scaling
        w = w + combined
        if "scores_add" in tags:
            tracer.mark(tags["scores_add"])
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).contiguous()
        return attn.o_proj(out.reshape(*input_shape, -1).contiguous()), w

    return forward


def patch(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch
    import torch.nn.functional as F

    on = lambda kind: active is not None and active["kind"] == kind  # noqa: E731

    if family == "swin":
        proj = model.swin.embeddings.patch_embeddings.projection

        def patch_fwd(x, proj=proj):  # the patch embedding's convolution: the first op on the images
            y = F.conv2d(x, proj.weight, proj.bias, proj.stride, proj.padding)
            tracer.mark("patch")
            return y

        proj.forward = patch_fwd
        block = model.swin.encoder.layers[0].blocks[1]  # the shifted-window block
        block.attention.forward = _swin_attention(
            tracer, block.attention, {"mask_add": "mask_add", "scores_add": "scores_add"}, on("missing_mask")
        )
        shift = active["value"] if on("roll_shift") else None

        def cyclic_shift(h, reverse=False, block=block, shift=shift):  # transformers' cyclic shift, its roll marked
            s = block.shift_size if shift is None else shift  # a port taking the shift from another config key
            y = torch.roll(h, shifts=(s, s) if reverse else (-s, -s), dims=(1, 2))
            if not reverse:
                tracer.mark("roll")
            return y

        block.cyclic_shift = cyclic_shift
        mlp = model.swin.encoder.layers[1].blocks[0].mlp
        wrong = on("gelu_backward")

        class FusedGelu(torch.autograd.Function):
            """Megatron's fused tanh-GELU: forward F.gelu(approximate="tanh"), the backward written out."""

            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return F.gelu(x, approximate="tanh")

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                cx = x * (GELU_DC_WRONG if wrong else GELU_DC)
                tracer.mark("gelu_back.c")
                tanh_out = torch.tanh(GELU_K * x * (1 + GELU_C * x * x))
                ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (GELU_K + cx * x)) + 0.5 * (1 + tanh_out)
                return grad * ff

        mlp.activation_fn.forward = lambda x: FusedGelu.apply(x)

    if family == "whisper":
        enc = model.model.encoder
        conv1 = enc.conv1

        def conv1_fwd(x, conv1=conv1):  # the stem's first convolution: the first op on the features
            y = F.conv1d(x, conv1.weight, conv1.bias, conv1.stride, conv1.padding)
            tracer.mark("conv1")
            return y

        conv1.forward = conv1_fwd
        for fault in family_faults(family):
            if fault["kind"] == "gelu_tanh":
                layer = enc.layers[fault["layer"]]
                tanh = on("gelu_tanh")

                def act(x, tanh=tanh):  # "gelu" mapped to the tanh approximation (a port's "gelu_new")
                    y = F.gelu(x, approximate="tanh" if tanh else "none")
                    tracer.mark("act")
                    return y

                layer.activation_fn.forward = act
        emb = model.model.decoder.embed_tokens
        scale = on("embed_scale")

        def embed(ids, emb=emb, scale=scale):
            out = torch.nn.Embedding.forward(emb, ids)
            tracer.mark("embedding")
            if scale:  # a port that sets scale_embedding: the token embeddings x sqrt(d_model)
                out = out * math.sqrt(emb.embedding_dim)
                tracer.mark("extra_scale")
            return out

        emb.forward = embed

    if family == "siglip":
        vm = model.vision_model
        proj = vm.embeddings.patch_embedding

        def patch_fwd(x, proj=proj):
            y = F.conv2d(x, proj.weight, proj.bias, proj.stride, proj.padding)
            tracer.mark("patch")
            return y

        proj.forward = patch_fwd
        for fault in family_faults(family):
            if fault["kind"] == "fc2_nobias":
                fc2 = vm.encoder.layers[fault["layer"]].mlp.fc2
                drop = on("fc2_nobias")

                def fc2_fwd(x, fc2=fc2, drop=drop):  # a port that loads fc2's weight but not its bias
                    y = F.linear(x, fc2.weight, None if drop else fc2.bias)
                    tracer.mark("fc2")
                    return y

                fc2.forward = fc2_fwd

    harness.watch_weights(sys.modules[__name__], family, model, tracer)


def corrupt(model, fault) -> None:
    import torch

    p = dict(model.named_parameters())[fault["param"]]
    with torch.no_grad():
        if fault["how"] == "swap_experts":
            p[[1, 2]] = p[[2, 1]].clone()
        else:
            harness.corrupt(model, fault, {})


def make_optimizer(family: str, model):
    import torch

    PolySGD, Adan, AdaBelief = _optim_classes()
    if family == "swin":
        return PolySGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    if family == "whisper":
        return Adan(model.parameters(), lr=2e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.02)
    if family in ("olmoe", "olmoe_wide"):
        named = list(model.named_parameters())
        flat = [p for n, p in named if "norm" in n or ".gate." in n]
        ids = {id(p) for p in flat}
        groups = [
            {"params": [p for _, p in named if id(p) not in ids], "weight_decay": 0.01},
            {"params": flat, "weight_decay": 0.0},
        ]
        return AdaBelief(groups, lr=2e-3, betas=(0.9, 0.999), eps=1e-8)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.Adagrad(params, lr=0.02, lr_decay=0.01, initial_accumulator_value=0.1)


def forward_loss(family: str, model, batch: dict, fault, tracer):
    """The model's loss and logits."""
    import torch.nn.functional as F

    if family == "swin":
        logits = model(pixel_values=batch["pixel_values"]).logits
        return F.cross_entropy(logits, batch["labels"], label_smoothing=LABEL_SMOOTHING), logits
    if family == "whisper":
        labels = batch["labels"]
        dec = batch.get("decoder_input_ids")
        dec = _shift_right(labels) if dec is None else dec
        logits = model(input_features=batch["input_features"], decoder_input_ids=dec).logits
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1)), logits
    if family in ("olmoe", "olmoe_wide"):
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return loss, logits
    out = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], return_loss=True)
    return out.loss, out.logits_per_text


OPTIMIZER_KINDS = ("lr", "clip", "betas", "weight_decay", "eps", "momentum")
ARGMAX_FAMILY = "swin"  # the batch's predicted classes, an argmax over the logits inside the window


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """swin 'flip' variant, in both runs alike: a tilt of one row of the classifier, added before the last step,
    that ties one image's top-2 logits in the reference to within a few fp32 ulps, chosen (by simulating both runs
    without msprobe) so that the device's rounding flips that image's predicted class and no other
    (``harness.craft_near_tie`` on each step's first micro-batch: the generator checks both).

    Returns (what was done, the tilt to add to the classifier's weight before step FLIP_STEP)."""
    return harness.craft_first_micro(sys.modules[__name__], "swin", model, model.classifier, data, device)


def setup(family: str, variant: str, target: bool, active, tracer: Tracer, info: dict):
    """A run's model, patched, its device installed (``harness.setup``); the tracer's top-k log kept in ``info``
    (the routing choices of OLMoE's routers, checked for flips)."""
    info["topk"] = tracer.topk
    return harness.setup(sys.modules[__name__], family, variant, target, active, tracer, info)


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
            "betas": "Adan betas %s instead of (0.98, 0.92, 0.99)",
            "weight_decay": "weight decay %g in every parameter group instead of 0.01 (matrices) and 0 (norms, router)",
            "momentum": "SGD momentum %g instead of 0.9",
            "eps": "Adan eps %g instead of 1e-8",
        }
        return harness.optimizer_expectation(fault, harness.optimizer_what(fault, CLIP, what))
    if kind == "embed_scale":
        return {
            "step": 0,
            "ops": [first(tgt, "extra_scale", 0)],
            "what": "the decoder's token embeddings multiplied by sqrt(d_model) in the target only (a port that sets "
            "scale_embedding): an extra multiply, the first record the reference does not have",
        }
    if kind == "missing_mask":
        add, nxt = first(ref, "mask_add", 0), first(tgt, "scores_add", 0)
        return harness.missing_op_expectation(
            ref,
            add,
            tgt,
            nxt,
            "the shifted-window block's attention mask not added to the relative position bias in the target (a port "
            "whose combined mask forgets the shift mask): the reference's add; its consumer in the target, the add of "
            "the (unmasked) bias to the scores, also counts",
        )
    if kind == "roll_shift":
        return {
            "step": 0,
            "ops": both("roll", 0, first),
            "what": "the shifted-window block's cyclic shift by %d instead of 2 (torch.roll's shifts, a scalar "
            "argument; the reverse shift too; the mask as in the reference; the first micro-batch's)" % fault["value"],
        }
    if kind == "gelu_tanh":
        return {
            "step": 0,
            "ops": both("act", 0),
            "what": "the encoder's layer %d MLP activation: GELU's tanh approximation instead of the exact GELU "
            '("gelu" mapped to "gelu_new")' % fault["layer"],
        }
    if kind == "fc2_nobias":
        return {
            "step": 0,
            "ops": both("fc2", 0),
            "what": "the image tower's layer %d MLP output projection (fc2) without its bias (a port that loads the "
            "weight but not the bias)" % fault["layer"],
        }
    if kind == "gelu_backward":
        return {
            "step": 0,
            "ops": both("gelu_back.c", 0, first),
            "backward_only": True,
            "what": "stage 1's fused tanh-GELU (a custom autograd function, Megatron's bias_gelu formula) with a "
            "wrong constant in its hand-written backward: the derivative's 3 x 0.044715 x sqrt(2/pi) = 0.1070322243 "
            "written 0.0356774081 (the factor 3 forgotten); the forward is the same; the multiply by the constant "
            "(recorded after the loss, the first micro-batch's) is the culprit",
        }
    if kind == "weight":
        return harness.weight_expectation(fault, HOW[fault["how"]], both)
    if kind == "transposed":
        step, mb = fault["step"], fault["micro"]
        return harness.data_expectation(
            fault,
            sorted({v5._nth(case, r, "patch", step, mb) for r in (tgt, ref)}),
            "micro-batch %d's images with height and width swapped in step %%d (one loader shard reading HWC as "
            "WHC); their first consumer: the patch embedding's convolution of that micro-batch" % (mb + 1),
        )
    if kind == "features":
        return harness.data_expectation(
            fault,
            both("conv1", fault["step"]),
            "one utterance's log-mel features without the extractor's (x + 4) / 4 scaling in the batch of step %d; "
            "their first consumer: the stem's first conv1d",
        )
    if kind == "stale_image":
        return harness.data_expectation(
            fault,
            both("patch", fault["step"]),
            "pair 0's image replaced by the previous step's (a loader reusing a stale buffer) in the batch of step "
            "%d; its first consumer: the image tower's patch embedding convolution",
        )
    if kind == "labels":
        return harness.data_expectation(
            fault,
            both("cross_entropy", fault["step"]),
            "two transcript labels changed (+1) in the batch of step %d (the decoder's inputs unchanged); the "
            "cross-entropy is their first consumer",
        )
    raise ValueError(kind)


def argmax_flips(tgt: dict, ref: dict) -> list[dict]:
    """The argmax flips (swin's predicted classes) and the routing flips (OLMoE's top-2 experts) of a pair."""
    return harness.argmax_flips(tgt, ref) + v2.topk_flips(
        {"topk": tgt["info"].get("topk", [])}, {"topk": ref["info"].get("topk", [])}
    )


def warm() -> None:
    """The imports made once, before forking."""
    harness.warm("SwinForImageClassification", "WhisperForConditionalGeneration", "OlmoeForCausalLM", "SiglipModel")


def main(argv=None) -> int:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

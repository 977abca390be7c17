"""Validation set 9 for dumpstore's verdict: msprobe dumps of four model families no other set uses.

Built apart from the development set and from sets 1 to 8: other families (ELECTRA, RegNet, Cohere, MarianMT: an
encoder with factorised embeddings (embedding size 16, projected to the hidden size) trained as a masked LM; a
convolutional network with grouped 3x3 convolutions, squeeze-and-excitation and BatchNorm; a decoder with attention
and MLP in parallel, LayerNorm without bias, interleaved rotary embeddings, tied embeddings and a logit scale; an
encoder-decoder translation model with sinusoidal positions, scaled embeddings, SiLU and cross-attention), other
dtype and optimizer setups (Adamax with two parameter groups in fp32, SGD with momentum and dampening over 2
micro-batches in fp32, AdamW with amsgrad in pure bf16, Adadelta under fp16 autocast with loss scaling) and other
simulated devices (``validation/v9/devices.py``: split-K GEMMs with a tree of partial sums, the online softmax,
LayerNorm by a division, split-K convolutions, Chan-merged BatchNorm statistics, sigmoid through tanh, stochastic
rounding of bf16 GEMM outputs, GEMMs walking K backwards with 16-bit partials, an autocast policy with layer_norm in
fp32). Every pair is a reference run ("GPU": plain CPU torch in the family's dtype) and a target run on the
family's simulated device, with or without one fault. The answer of every case is known by construction and written
to ``<out>/key.json`` (set 1's format, so ``validation/score.py`` scores it); the culprit's msprobe record name is
read from msprobe while the faulty call runs, never from dumpstore.

    .venv/bin/python validation/v9/make_pairs.py --out validation/v9/.data [--jobs 2] [--only CASE ...]

The driver (arguments, runs, checks, key, the training loop, one run, the near-tie, the setup of a run) is
``validation/harness.py``; the tracer is set 6's (through set 8's), set 8's StableLM attention with marks (the same
eager attention as Cohere's) and its reader of a module record's API record are imported. What is here: the
families, their optimizers and setups, the faults and the expected culprits. Runs: 3 training steps; forward and
backward (both micro-batches where there are two) inside msprobe's window, clipping and the optimizer step outside
it; msprobe level "mix"; statistics mode for every case and tensor mode for a subset.
"""

from __future__ import annotations

import importlib.util
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
devices9 = harness._load("validation_v9_devices", HERE / "devices.py")  # this set's devices, under their own name
v8 = harness._load("validation_v8_make_pairs", HERE.parent / "v8" / "make_pairs.py")  # tracer, attention, _api

SET = 9
STEPS = 3
VOCAB = 96
IMAGES, SIZE, CLASSES = 2, 32, 10  # regnet: 2 images of 3x32x32 per micro-batch, 10 classes
BATCH, SEQ, MASKED = 2, 16, 4  # the text families: 2 sequences of 16 tokens; electra masks 4 per sequence
MASK_ID = 2
WIDE_HIDDEN, WIDE_SEQ = 512, 64  # the "_wide" families: long reductions
CLIP = 1.0
DATA_SEED = 9173
DEVICES = devices9.DEVICES
NOISY_REF = "BF"  # the "noisyref" variant's reference device
AMP_DEVICE = "BE"  # the "amp" variant's target: marian's device under another autocast policy

FAMILIES = {
    "electra": {
        "text": "ELECTRA generator (encoder) trained as a masked LM: factorised embeddings (size 16, LayerNorm, a "
        "linear projection to hidden 32), 2 layers, 4 heads, MLP 64 with the exact GELU, post-LN; 4 of 16 tokens "
        "masked per sequence, batch 2; cross-entropy over the masked tokens; the predicted tokens (an argmax) inside "
        "the window; fp32; Adamax (lr 2e-3, betas 0.9 / 0.999, eps 1e-8) with two parameter groups (weights: L2 "
        "weight decay 0.01; biases and LayerNorms: none)",
        "device": "BA",
        "seed": 91,
    },
    "electra_wide": {
        "text": "ELECTRA as above with long reductions: embeddings 128, hidden 512 (8 heads, MLP 512), 2 layers; 64 "
        "tokens (16 masked), batch 1; fp32; Adamax",
        "device": "BA",
        "seed": 92,
    },
    "regnet": {
        "text": "RegNetY (convolutional): 3x32x32 images, a 3x3 stem of 16 channels, 2 stages (widths 16, 32, one "
        "Y block each: 1x1, grouped 3x3 (group width 8), squeeze-and-excitation with a sigmoid, 1x1, residual), "
        "BatchNorm in training mode, ReLU, global average pooling, a linear classifier (10 classes); cross-entropy; "
        "2 micro-batches of 2 images per step (gradients accumulated); fp32; SGD with momentum 0.9 and dampening "
        "0.1 (lr 0.02, weight decay 1e-4)",
        "device": "BB",
        "seed": 93,
    },
    "regnet_wide": {
        "text": "RegNetY as above with long reductions: stem 64, widths 64 and 128 (group width 32); fp32; SGD",
        "device": "BB",
        "seed": 94,
    },
    "cohere": {
        "text": "Cohere (decoder): attention and SwiGLU MLP in parallel from one LayerNorm without bias, interleaved "
        "rotary embeddings, 4 heads (4 KV heads), hidden 32 (MLP 64), 2 layers, tied embeddings, logits scaled by "
        "logit_scale 1/16; 16 tokens, batch 2; next-token cross-entropy; pure bf16 (parameters, gradients and "
        "optimizer state); AdamW with amsgrad (lr 2e-3, betas 0.9 / 0.95, weight decay 0.1)",
        "device": "BC",
        "seed": 95,
    },
    "cohere_wide": {
        "text": "Cohere as above with long reductions: hidden 512 (8 heads of 64, MLP 512), 2 layers; 64 tokens, "
        "batch 1; pure bf16; AdamW amsgrad",
        "device": "BC",
        "seed": 96,
    },
    "marian": {
        "text": "MarianMT (encoder-decoder): 2 encoder and 2 decoder layers, hidden 32, 4 heads, MLP 64 with SiLU, "
        "sinusoidal positions, embeddings scaled by sqrt(32), cross-attention, separate source and target "
        "embeddings, the output projection tied to the target embedding; 16 source and 16 target tokens, batch 2 "
        "(teacher forcing); cross-entropy; fp32 weights under fp16 autocast with dynamic loss scaling (GradScaler, "
        "initial scale 2^10); Adadelta (lr 1.0, rho 0.9, eps 1e-6)",
        "device": "BD",
        "seed": 97,
    },
}

S, B = harness.STATS, harness.BOTH
# name -> family, reference variant ("flip": electra's LM head tilted to a near-tie; "noisyref": the reference rerun
# on device BF; "amp": marian's target under another autocast policy, device BE), fault (None: clean), dump modes
# (tensor mode: no RegNet pair and of Marian only the "amp" pair: their activations make the data large).
CASES = {
    "electra_clean": ("electra", "base", None, B),
    "regnet_clean": ("regnet", "base", None, S),
    "cohere_clean": ("cohere", "base", None, B),
    "marian_clean": ("marian", "base", None, S),
    "electra_wide_clean": ("electra_wide", "base", None, S),
    "regnet_wide_clean": ("regnet_wide", "base", None, S),
    "cohere_wide_clean": ("cohere_wide", "base", None, S),
    "electra_flip": ("electra", "flip", None, S),
    "electra_noisyref": ("electra", "noisyref", None, S),
    "regnet_noisyref": ("regnet", "noisyref", None, S),
    "cohere_noisyref": ("cohere", "noisyref", None, S),
    "marian_noisyref": ("marian", "noisyref", None, S),
    "marian_amp": ("marian", "amp", None, B),
    # optimizer, from the second update on
    "cohere_lr_step2": harness.optimizer_case("cohere", "lr", 1.05, B),
    "electra_lr_step2": harness.optimizer_case("electra", "lr", 1.01),
    "regnet_lr_step2": harness.optimizer_case("regnet", "lr", 1.02),
    "cohere_betas_step2": harness.optimizer_case("cohere", "betas", (0.8, 0.95)),
    "electra_eps_step2": harness.optimizer_case("electra", "eps", 1e-4),
    "regnet_dampening_step2": harness.optimizer_case("regnet", "dampening", 0.0),
    "marian_wd_step2": harness.optimizer_case("marian", "weight_decay", 0.1),
    "marian_gradclip_step2": harness.optimizer_case("marian", "clip", 0.1),
    "electra_frozen_norms_step2": harness.optimizer_case("electra", "frozen", "no_decay"),
    # an op in the target only, an op missing in the target
    "regnet_extra_silu_S0": ("regnet", "base", {"kind": "extra_silu", "stage": 0}, S),
    "electra_missing_emb_ln": ("electra", "base", {"kind": "missing_ln"}, S),
    # a changed scalar argument
    "cohere_logit_scale": ("cohere", "base", {"kind": "logit_scale", "value": 0.125}, B),
    "cohere_attn_scale_L1": ("cohere", "base", {"kind": "attn_scale", "layer": 1}, S),
    "marian_embed_scale": ("marian", "base", {"kind": "embed_scale"}, S),
    # a wrong kernel in one layer (forward; backward only), a wrong mask, one op in lower precision
    "electra_gelu_tanh_L1": ("electra", "base", {"kind": "gelu_tanh", "layer": 1}, B),
    "regnet_sigmoid_backward_S1": ("regnet", "base", {"kind": "sigmoid_backward", "stage": 1}, S),
    "cohere_mask_L0": ("cohere", "base", {"kind": "mask", "layer": 0}, B),
    "electra_dense_fp16_L1": ("electra", "base", {"kind": "dense_fp16", "layer": 1}, B),
    # parameters and data
    "marian_transposed_q_step0": harness.weight_case(
        "marian", "model.encoder.layers.0.self_attn.q_proj.weight", 0, "transpose"
    ),
    "cohere_swap_qk_step1": harness.weight_case("cohere", "model.layers.0.self_attn.q_proj.weight", 1, "swap_qk", B),
    "electra_query_sign_step1": harness.weight_case(
        "electra", "electra.encoder.layer.1.attention.self.query.weight", 1, "sign2pct"
    ),
    "regnet_group_conv_sign_step2": harness.weight_case(
        "regnet", "regnet.encoder.stages.1.layers.0.layer.1.convolution.weight", 2, "sign2pct"
    ),
    "electra_labels_step2": ("electra", "base", {"kind": "labels", "step": 2}, S),
    "cohere_tokens_step1": ("cohere", "base", {"kind": "tokens", "step": 1}, S),
    "regnet_flip_rows_step1": ("regnet", "base", {"kind": "flip_rows", "step": 1}, S),
    "marian_src_tokens_step2": ("marian", "base", {"kind": "src_tokens", "step": 2}, S),
    "marian_labels_step1": ("marian", "base", {"kind": "labels", "step": 1}, S),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "transpose": "transposed (a checkpoint converted from a framework that stores linear weights as [in, out])",
    "swap_qk": "swapped with the layer's key projection weight (a conversion script that maps the fused qkv "
    "matrix's blocks in the wrong order)",
}
MICRO = {"regnet": 2, "regnet_wide": 2}  # regnet: 2 micro-batches per step, gradients accumulated
AUTOCAST = {"marian": "float16"}
BF16 = {"cohere", "cohere_wide"}  # pure bf16
FLIP_STEP = STEPS - 1  # the crafted tie is at the last step
OPTIMIZER_KINDS = ("lr", "clip", "betas", "weight_decay", "eps", "dampening", "frozen")
ARGMAX_FAMILY = "electra"  # the masked LM's predicted tokens, an argmax over the logits inside the window


class Tracer(v8.Tracer):
    """Set 8's tracer (set 6's: set 2's record names, marks, parameter uses by linear and conv2d, the loss; every
    argmax's output; marks of the next API record)."""


# =================================================================================================================
# optimizers and setups
# =================================================================================================================
class GroupFreeze:
    """An optimizer whose parameter groups carry a name; a group whose "frozen" setting names it is not updated (its
    gradients dropped before the step: a freezing bug that hits the wrong group)."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self):
        for group in self.inner.param_groups:
            if group.get("frozen") == group["name"]:
                for p in group["params"]:
                    p.grad = None
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()


def make_optimizer(family: str, model):
    import torch

    if family.startswith("electra"):
        named = list(model.named_parameters())
        plain = [p for n, p in named if n.endswith("bias") or "LayerNorm" in n]
        decay = [p for n, p in named if not (n.endswith("bias") or "LayerNorm" in n)]
        groups = [
            {"params": decay, "weight_decay": 0.01, "name": "decay"},
            {"params": plain, "weight_decay": 0.0, "name": "no_decay"},
        ]
        return GroupFreeze(torch.optim.Adamax(groups, lr=2e-3, betas=(0.9, 0.999), eps=1e-8))
    if family.startswith("regnet"):
        return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, dampening=0.1, weight_decay=1e-4)
    if family in BF16:
        return torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, amsgrad=True)
    return torch.optim.Adadelta(model.parameters(), lr=1.0, rho=0.9, eps=1e-6)


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
def build_model(family: str):
    import torch
    import transformers as tf

    torch.manual_seed(FAMILIES[family]["seed"])
    wide = family.endswith("_wide")
    if family.startswith("electra"):
        emb, hid, heads, mlp = (128, WIDE_HIDDEN, 8, WIDE_HIDDEN) if wide else (16, 32, 4, 64)
        cfg = tf.ElectraConfig(
            vocab_size=VOCAB,
            embedding_size=emb,
            hidden_size=hid,
            num_hidden_layers=2,
            num_attention_heads=heads,
            intermediate_size=mlp,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=WIDE_SEQ,
            initializer_range=0.1,
            pad_token_id=0,
        )
        cfg._attn_implementation = "eager"
        model = tf.ElectraForMaskedLM(cfg)
    elif family.startswith("regnet"):
        stem, widths, gw = (64, [64, 128], 32) if wide else (16, [16, 32], 8)
        cfg = tf.RegNetConfig(
            num_channels=3,
            embedding_size=stem,
            hidden_sizes=widths,
            depths=[1, 1],
            groups_width=gw,
            layer_type="y",
            hidden_act="relu",
            num_labels=CLASSES,
        )
        model = tf.RegNetForImageClassification(cfg)
    elif family in BF16:
        hid, heads, mlp = (WIDE_HIDDEN, 8, WIDE_HIDDEN) if wide else (32, 4, 64)
        cfg = tf.CohereConfig(
            vocab_size=VOCAB,
            hidden_size=hid,
            intermediate_size=mlp,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=WIDE_SEQ,
            logit_scale=0.0625,
            use_qk_norm=False,
            tie_word_embeddings=True,
            use_cache=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=VOCAB - 1,
            attention_dropout=0.0,
        )
        cfg._attn_implementation = "eager"
        model = tf.CohereForCausalLM(cfg).to(torch.bfloat16)
    else:
        cfg = tf.MarianConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            activation_function="swish",
            max_position_embeddings=SEQ,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            scale_embedding=True,
            share_encoder_decoder_embeddings=False,
            pad_token_id=0,
            decoder_start_token_id=0,
            eos_token_id=VOCAB - 1,
            use_cache=False,
        )
        cfg._attn_implementation = "eager"
        model = tf.MarianMTModel(cfg)
    model.train()
    return model


def batches(family: str, fault) -> list[list[dict]]:
    """Per step, per micro-batch: the model's inputs. A data fault changes one step's (first micro-batch's) batch."""
    import torch

    def draw(g):
        if family.startswith("electra"):
            n, seq = (1, WIDE_SEQ) if family.endswith("_wide") else (BATCH, SEQ)
            ids = torch.randint(3, VOCAB, (n, seq), generator=g)
            pos = torch.stack([torch.randperm(seq, generator=g)[: seq // 4] for _ in range(n)])
            labels = torch.full_like(ids, -100)
            labels.scatter_(1, pos, ids.gather(1, pos))
            return {"input_ids": ids.scatter(1, pos, MASK_ID), "labels": labels}
        if family.startswith("regnet"):
            px = (torch.rand(IMAGES, 3, SIZE, SIZE, generator=g) - 0.45) / 0.25
            return {"pixel_values": px, "labels": torch.randint(0, CLASSES, (IMAGES,), generator=g)}
        if family in BF16:
            n, seq = (1, WIDE_SEQ) if family.endswith("_wide") else (BATCH, SEQ)
            return {"input_ids": torch.randint(3, VOCAB, (n, seq), generator=g)}
        src = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        tgt = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        dec_in = torch.cat([torch.zeros(BATCH, 1, dtype=tgt.dtype), tgt[:, :-1]], 1)
        return {"input_ids": src, "decoder_input_ids": dec_in, "labels": tgt}

    out = harness.draw_batches(DATA_SEED, STEPS, MICRO.get(family, 1), draw)
    if fault and fault["kind"] in DATA:
        b = out[fault["step"]][0]
        kind = fault["kind"]
        if kind == "flip_rows":  # the images of step 1 upside down (a loader's decode flag): same statistics
            b["pixel_values"] = b["pixel_values"].flip(2).contiguous()
        elif kind in ("tokens", "src_tokens"):  # two tokens of sequence 0 replaced (another tokenizer's merges)
            b["input_ids"] = b["input_ids"].clone()
            b["input_ids"][0, 5:7] = (b["input_ids"][0, 5:7] - 3 + 7) % (VOCAB - 3) + 3
        elif family == "electra":  # two masked tokens' labels off by one id
            b["labels"] = b["labels"].clone()
            cols = (b["labels"][0] != -100).nonzero()[:2, 0]
            b["labels"][0, cols] = (b["labels"][0, cols] - 3 + 1) % (VOCAB - 3) + 3
        else:  # marian: the labels of sequence 0 shifted by one position (a collator's off-by-one), inputs unchanged
            b["labels"] = b["labels"].clone()
            b["labels"][0] = b["labels"][0].roll(1)
    return out


def _sigmoid_fn(tracer, wrong: bool):
    """A hand-written sigmoid autograd function (a fused SE kernel's): forward torch.sigmoid, backward written out,
    grad s (1 - s); ``wrong``: the derivative written s s (a slip: the same ops, the wrong operand)."""
    import torch

    class Sigmoid(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            s = torch.sigmoid(x)
            ctx.save_for_backward(s)
            return s

        @staticmethod
        def backward(ctx, grad):
            (s,) = ctx.saved_tensors
            rest = 1 - s
            d = s * (s if wrong else rest)
            tracer.mark("sigmoid_back")
            return grad * d

    return Sigmoid


def patch(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch
    import torch.nn.functional as F

    on = lambda kind: active is not None and active["kind"] == kind  # noqa: E731
    kinds = {f["kind"]: f for f in harness.family_faults(sys.modules[__name__], family)}

    if family.startswith("electra"):
        from transformers.activations import GELUActivation

        for m in model.modules():
            if isinstance(m, GELUActivation):  # F.gelu looked up at call time (msprobe, the devices)
                m.act = lambda x: F.gelu(x)
        ln = model.electra.embeddings.LayerNorm
        skip = on("missing_ln")

        def ln_fwd(x, ln=ln, skip=skip):  # a port that leaves the embeddings' LayerNorm out
            if not skip:
                x = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
                tracer.mark("emb_ln")
            tracer.mark_next("after_emb_ln")
            return x

        ln.forward = ln_fwd
        if "gelu_tanh" in kinds:
            act = model.electra.encoder.layer[kinds["gelu_tanh"]["layer"]].intermediate.intermediate_act_fn
            approx = "tanh" if on("gelu_tanh") else "none"

            def act_fn(x, approx=approx):  # "gelu" mapped to "gelu_new" (the tanh approximation) by a port
                y = F.gelu(x, approximate=approx)
                tracer.mark("act")
                return y

            act.act = act_fn
        if "dense_fp16" in kinds:
            dense = model.electra.encoder.layer[kinds["dense_fp16"]["layer"]].output.dense
            low = on("dense_fp16")

            def dense_fwd(x, dense=dense, low=low):  # a leftover fp16 autocast region around one projection
                with torch.autocast("cpu", dtype=torch.float16, enabled=low):
                    y = F.linear(x, dense.weight, dense.bias)
                tracer.mark("dense")
                return y

            dense.forward = dense_fwd

    if family.startswith("regnet"):
        conv = model.regnet.embedder.embedder.convolution

        def stem_fwd(x, conv=conv):
            y = torch.nn.Conv2d.forward(conv, x)
            tracer.mark("stem_conv")
            return y

        conv.forward = stem_fwd
        if "extra_silu" in kinds:
            last = model.regnet.encoder.stages[kinds["extra_silu"]["stage"]].layers[0].layer[3]
            if on("extra_silu"):

                def act_fwd(x):  # a port that ends the block's last 1x1 convolution with a SiLU too
                    y = F.silu(x)
                    tracer.mark("extra_silu")
                    return y

                last.activation.forward = act_fwd
        if "sigmoid_backward" in kinds:
            sig = model.regnet.encoder.stages[kinds["sigmoid_backward"]["stage"]].layers[0].layer[2].attention[3]
            fn = _sigmoid_fn(tracer, on("sigmoid_backward"))
            sig.forward = lambda x, fn=fn: fn.apply(x)

    if family in BF16:
        mod = harness.hf_module("cohere")
        wrong = None
        if on("mask"):  # an off-by-one causal mask: each token also sees the next one
            low = torch.finfo(torch.bfloat16).min
            wrong = torch.full((BATCH, 1, SEQ, SEQ), low, dtype=torch.bfloat16).triu(2)
        mod.eager_attention_forward = v8._stablelm_attention(tracer, active, wrong)  # (this forked run's)
        harness.embed_mark(tracer, model.model.embed_tokens, "embedding")
        if on("logit_scale"):  # a port that reads the logit scale as 1/8
            model.logit_scale = active["value"]
        head = model.lm_head

        def head_fwd(x, head=head):
            y = F.linear(x, head.weight, head.bias)
            tracer.mark_next("logit_scale")
            return y

        head.forward = head_fwd

    if family == "marian":
        harness.embed_mark(tracer, model.model.encoder.embed_tokens, "src_embedding")
        dec = model.model.decoder
        emb = dec.embed_tokens

        def dec_emb(ids, emb=emb):
            y = torch.nn.Embedding.forward(emb, ids)
            tracer.mark_next("embed_scale")
            return y

        emb.forward = dec_emb
        if on("embed_scale"):  # a port that forgets the decoder's scale_embedding
            dec.embed_scale = 1.0

    harness.watch_weights(sys.modules[__name__], family, model, tracer)


def corrupt(model, fault) -> None:
    """A weight fault before its step: "swap_qk" here, set 8's "transpose", the harness's "sign2pct"."""
    import torch

    if fault["how"] != "swap_qk":
        return v8.corrupt(model, fault)
    params = dict(model.named_parameters())
    q, k = params[fault["param"]], params[fault["param"].replace("q_proj", "k_proj")]
    with torch.no_grad():
        tmp = q.clone()
        q.copy_(k)
        k.copy_(tmp)


def forward_loss(family: str, model, batch: dict, fault, tracer):
    """The model's loss and logits."""
    import torch.nn.functional as F

    if family.startswith("electra"):
        logits = model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)), logits
    if family.startswith("regnet"):
        logits = model(pixel_values=batch["pixel_values"]).logits
        return F.cross_entropy(logits, batch["labels"]), logits
    if family in BF16:
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1)), logits
    logits = model(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"]).logits
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["labels"].reshape(-1)), logits


def train(family: str, model, data, fault, **kw):
    """The training loop of every run (``harness.train``)."""
    return harness.train(sys.modules[__name__], family, model, data, fault, **kw)


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """electra 'flip' variant, in both runs alike: a tilt of one row of the LM head, added before the last step, that
    ties one token's top-2 logits in the reference to within a few fp32 ulps, chosen (by simulating both runs without
    msprobe) so that the device's rounding flips that token's predicted id and no other."""
    return harness.craft_first_micro(sys.modules[__name__], "electra", model, flip_head(model), data, device)


def flip_head(model):
    return model.generator_lm_head


# =================================================================================================================
# the key
# =================================================================================================================
OPTIMIZER_WHAT: dict = {
    "betas": "AdamW betas %s instead of (0.9, 0.95)",
    "eps": "Adamax eps %g instead of 1e-8",
    "dampening": "SGD dampening %g instead of 0.1",
    "weight_decay": "Adadelta weight decay %g instead of 0",
    "frozen": "the %r parameter group (biases and LayerNorms) not updated (a freezing bug that drops that group's "
    "gradients)",
}

# faults at step 0 whose culprit is the marked call in both runs: kind -> (mark, "one" or "first" call, what)
AT_CALL = {
    "attn_scale": (
        "scale.L{layer}",
        "first",
        "layer {layer}'s attention scores scaled by 1/head_dim instead of 1/sqrt(head_dim) (a scalar argument: the "
        "multiply of the scores)",
    ),
    "mask": (
        "mask.L{layer}",
        "one",
        "layer {layer}'s causal mask off by one in the target (each token also sees the next token): the add of the "
        "mask to the scores",
    ),
    "gelu_tanh": (
        "act",
        "one",
        "layer {layer}'s MLP activation: the tanh-approximated GELU instead of the exact one the model was built "
        'with ("gelu" mapped to "gelu_new" by a port)',
    ),
    "dense_fp16": (
        "dense",
        "one",
        "layer {layer}'s MLP output projection run in fp16 in the fp32 model (a leftover autocast region around one "
        "linear): its output fp16",
    ),
    "logit_scale": (
        "logit_scale",
        "one",
        "the logits scaled by {value:g} instead of the config's logit_scale 0.0625 (a scalar argument: the multiply "
        "after the LM head)",
    ),
    "sigmoid_backward": (
        "sigmoid_back",
        "first",
        "stage {stage}'s squeeze-and-excitation sigmoid, a hand-written autograd function, with a slip in its "
        "backward: the derivative s (1 - s) written s s; the forward is the same; the multiply s * s (s * (1 - s) in "
        "the reference; recorded after the loss as a forward record of the step; the first micro-batch's call) is the "
        "culprit",
    ),
}
# data faults: kind -> (the mark of their first consumer, "one" or "first", what; a %d for the step)
DATA = {
    "tokens": (
        "embedding",
        "one",
        "two tokens of sequence 0 replaced in the batch of step %d; their first consumer: the token embedding",
    ),  # fmt: skip
    "src_tokens": (
        "src_embedding",
        "one",
        "two source tokens of sequence 0 replaced in the batch of step %d; their "
        "first consumer: the encoder's token embedding",
    ),  # fmt: skip
    "labels": (
        "cross_entropy",
        "one",
        "the labels changed in the batch of step %d (electra: two masked tokens' "
        "labels off by one id; marian: sequence 0's labels shifted by one position), the inputs unchanged; the "
        "cross-entropy is their first consumer",
    ),  # fmt: skip
    "flip_rows": (
        "stem_conv",
        "first",
        "the first micro-batch's images of step %d upside down (a loader's decode "
        "flag; the same values, so the same statistics); their first consumer: the stem's convolution",
    ),  # fmt: skip
}


def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
    """What the verdict should say about a fault, from the marks both runs made at the faulty call."""
    kind = fault["kind"]
    one, first, both = harness.mark_readers(case, tgt, ref)
    if kind in OPTIMIZER_KINDS:
        return harness.optimizer_expectation(fault, harness.optimizer_what(fault, CLIP, OPTIMIZER_WHAT))
    if kind == "extra_silu":
        op = first(tgt, "extra_silu", 0)
        return {
            "step": 0,
            "ops": [op],
            "modules": sorted(v8._modules(tgt, op)),
            "what": "stage %d's block ended its last 1x1 convolution with a SiLU in the target only (a port whose "
            "ConvLayers all end with the network's activation, EfficientNet-style): an extra op, the first record the "
            "reference does not have" % fault["stage"],
        }
    if kind == "missing_ln":
        return harness.missing_op_expectation(
            ref,
            one(ref, "emb_ln", 0),
            tgt,
            one(tgt, "after_emb_ln", 0),
            "the embeddings' LayerNorm left out in the target (a port that drops it): the reference's layer_norm; "
            "its consumer in the target, the dropout of the unnormalised embeddings, also counts",
        )
    if kind == "embed_scale":
        dec = lambda r: harness.names(r, "embed_scale", 0)[0]  # noqa: E731
        return {
            "step": 0,
            "ops": sorted({dec(tgt), dec(ref)}),
            "what": "the decoder's embeddings not scaled by sqrt(d_model) in the target (scale_embedding forgotten by "
            "a port): a scalar argument, the multiply after the target embedding",
        }
    if kind in AT_CALL:
        tag, pick, what = AT_CALL[kind]
        exp = {"step": 0, "ops": both(tag.format(**fault), 0, first if pick == "first" else one)}
        exp["what"] = what.format(**fault)
        if kind == "sigmoid_backward":
            exp["backward_only"] = True
        return exp
    if kind in DATA:
        tag, pick, what = DATA[kind]
        step = fault["step"]
        reader = first if pick == "first" else one
        ops = sorted({v8._api(r, reader(r, tag, step), step) for r in (tgt, ref)})
        return harness.data_expectation(fault, ops, what)
    if kind == "weight":
        return harness.weight_expectation(fault, HOW[fault["how"]], both)
    raise ValueError(kind)


argmax_flips = harness.argmax_flips  # the argmax flips (ELECTRA's predicted tokens) of a pair: no routing here


def warm() -> None:
    """The imports made once, before forking: torch, msprobe, the four model classes and the modeling modules whose
    functions the runs reroute."""
    harness.warm("ElectraForMaskedLM", "RegNetForImageClassification", "CohereForCausalLM", "MarianMTModel")
    list(map(harness.hf_module, ("cohere", "stablelm")))


def main(argv=None) -> int:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

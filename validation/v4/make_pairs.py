"""Validation set 4 for dumpstore's verdict: msprobe dumps of four model families no other set uses.

Built apart from the development set and from sets 1 to 3: other families (T5, ResNet, Mamba, GPT-J: an
encoder-decoder, a convolutional network with BatchNorm, an attention-free state-space model, a decoder with
interleaved rotary), other dtype and optimizer setups and other simulated devices (``validation/v4/devices.py``:
convolutions as per-tap implicit GEMMs, one-pass BatchNorm statistics, blocked means, pow through exp2/log2, fast
sin/cos, a stable softplus, SiLU through a hardware reciprocal; a reference rerun with another convolution
algorithm). Every pair is a reference run ("GPU": plain CPU torch in the family's dtype) and a target run on the
family's simulated device, with or without one fault. The answer of every case is known by construction and
written to ``<out>/key.json`` (set 1's format, so ``validation/score.py`` scores it); the culprit's msprobe record
name is read from msprobe while the faulty call runs, never from dumpstore.

    .venv/bin/python validation/v4/make_pairs.py --out validation/v4/.data [--jobs 2] [--only CASE ...]

The driver (arguments, runs, checks, key) is ``validation/harness.py``; the run harness (the tracer of msprobe's
record names, the forked runs, msprobe's config, the structure check) is set 2's ``validation/v2/make_pairs.py``.
What is here: the families, their optimizers and setups, the faults and the expected culprits (the training loop and
the run are the driver's). Runs: 3 training steps; forward and backward (both micro-batches where there are two)
inside msprobe's window, clipping and the optimizer step outside it; msprobe level "mix"; statistics mode for every
case and tensor mode for a subset.
"""

from __future__ import annotations

import importlib.util
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
devices4 = harness._load("validation_v4_devices", HERE / "devices.py")  # this set's devices, under their own name
v2 = harness.set2()  # set 2's run harness

SET = 4
STEPS = v2.STEPS  # 3
BATCH, SEQ, VOCAB = 2, 16, 96
IMAGES, SIZE, CLASSES = 8, 16, 10
PIXEL_MEAN, PIXEL_STD = 0.5, 0.25
TGT_LEN = 8  # T5's decoder labels
CLIP = 1.0
DATA_SEED = 6421
DEVICES = devices4.DEVICES
NOISY_REF = "R"

FAMILIES = {
    "t5": {
        "text": "T5 (encoder-decoder): relative position buckets (8, shared by the layers of a stack), T5LayerNorm "
        "(RMS, fp32 variance), gated GELU(tanh) feed-forward, tied embeddings with the decoder output scaled by "
        "d_model^-0.5; d_model 32 (4 heads of 8, d_ff 64), 2 encoder and 2 decoder blocks; fp32 weights under bf16 "
        "autocast; gradient accumulation over 2 micro-batches; RAdam (lr 3e-3)",
        "device": "P",
        "seed": 41,
    },
    "resnet": {
        "text": "ResNet (basic blocks): a 3x3 stem convolution, BatchNorm in training mode, ReLU, a 3x3 max-pool, "
        "two stages (8 and 16 channels, a strided 1x1 shortcut), average pool, a linear classifier (10 classes); "
        "8 images of 3x16x16 normalised (x - 0.5) / 0.25 inside the window; fp32; SGD with Nesterov momentum 0.9, "
        "weight decay 1e-4 (lr 0.05); an argmax over the logits (the batch's accuracy) inside the window",
        "device": "N",
        "seed": 42,
    },
    "mamba": {
        "text": "Mamba (attention-free): in_proj, a causal depthwise conv1d (kernel 4), SiLU, selective scan with "
        "input-dependent dt (softplus), B and C, the D skip and a SiLU gate, RMSNorm; hidden 32 (state 8, expand 2), "
        "2 layers; pure bf16 (weights, activations and optimizer state); NAdam (lr 2e-3)",
        "device": "O",
        "seed": 43,
    },
    "gptj": {
        "text": "GPT-J: interleaved rotary (rotate every two) on 4 of each head's 8 dims from a sinusoid table, "
        "attention and MLP in parallel from one LayerNorm, no q/k/v biases, GELU(tanh) written with torch.pow and "
        "torch.tanh; hidden 32 (4 heads), 2 layers; fp32 weights under fp16 autocast with dynamic loss scaling "
        "(GradScaler, initial scale 2^10); RMSprop (lr 1e-3, alpha 0.99)",
        "device": "Q",
        "seed": 44,
    },
}

# name -> family, reference variant ("flip": a classifier tilted to a near-tie; "noisyref": the reference rerun on
# device R), fault (None: clean), dump modes. The expected culprit comes from what msprobe named at the faulty call.
CASES = {
    "resnet_clean": ("resnet", "base", None, ("stats", "tensor")),
    "t5_clean": ("t5", "base", None, ("stats",)),
    "mamba_clean": ("mamba", "base", None, ("stats", "tensor")),
    "gptj_clean": ("gptj", "base", None, ("stats", "tensor")),
    "resnet_flip": ("resnet", "flip", None, ("stats", "tensor")),
    "resnet_noisyref": ("resnet", "noisyref", None, ("stats",)),
    # optimizer, from the second update on
    "t5_lr_step2": harness.optimizer_case("t5", "lr", 1.1),
    "resnet_nesterov_step2": harness.optimizer_case("resnet", "nesterov", False),
    "gptj_alpha_step2": harness.optimizer_case("gptj", "alpha", 0.9),
    # an op in the target only, an op missing in the target
    "resnet_double_normalize": ("resnet", "base", {"kind": "double_norm"}, ("stats", "tensor")),
    "t5_missing_tied_scale": ("t5", "base", {"kind": "missing_scale"}, ("stats",)),
    # a changed scalar argument; a wrong kernel in one layer
    "gptj_ln_eps_L1": ("gptj", "base", {"kind": "ln_eps", "layer": 1, "value": 1e-2}, ("stats", "tensor")),
    "resnet_frozen_bn_S1": ("resnet", "base", {"kind": "frozen_bn"}, ("stats",)),
    "gptj_fcin_nobias_L1": ("gptj", "base", {"kind": "nobias", "layer": 1}, ("stats", "tensor")),
    "resnet_conv_bf16_S0": ("resnet", "base", {"kind": "conv_bf16"}, ("stats",)),
    # backward only: a custom SiLU's gradient formula
    "mamba_silu_backward": ("mamba", "base", {"kind": "silu_back"}, ("stats", "tensor")),
    # parameters and data
    "resnet_conv_step1": harness.weight_case(
        "resnet", "resnet.encoder.stages.1.layers.0.layer.0.convolution.weight", 1, "sign2pct", harness.BOTH
    ),
    "t5_relbias_step2": harness.weight_case(
        "t5", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", 2, "row3neg"
    ),
    "mamba_data_step1": ("mamba", "base", {"kind": "ids", "step": 1}, ("stats",)),
    "t5_ids_step2": ("t5", "base", {"kind": "ids", "step": 2}, ("stats",)),
    "resnet_labels_step2": ("resnet", "base", {"kind": "labels", "step": 2}, ("stats",)),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "row3neg": "row 3 (one position bucket's bias for every head) negated",
}
MICRO = {"t5": 2}  # micro-batches per step
AUTOCAST = {"t5": "bfloat16", "gptj": "float16"}
BUILD_ON_DEVICE = {"gptj"}  # GPT-J's rotary table is computed when the model is built: on the target's device
FLIP_STEP = STEPS - 1  # the crafted tie is at the last step


class Tracer(v2.Tracer):
    """Set 2's tracer (record names, marks, parameter uses by linear, the loss); parameter uses by conv2d and
    embedding too, and every argmax's output."""

    def __init__(self):
        super().__init__()
        self.argmax: list[dict] = []

    def install(self) -> None:
        import torch.nn.functional as F

        super().install()
        conv2d, embedding = F.conv2d, F.embedding
        tracer = self

        def conv2d_fn(input, weight, *args, **kwargs):
            out = conv2d(input, weight, *args, **kwargs)
            tracer._param_use(weight)
            return out

        def embedding_fn(input, weight, *args, **kwargs):
            out = embedding(input, weight, *args, **kwargs)
            tracer._param_use(weight)
            return out

        F.conv2d, F.embedding = conv2d_fn, embedding_fn


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    if family == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        model = T5ForConditionalGeneration(cfg)
        # the decoder output's d_model^-0.5 (tied embeddings) is made by the lm_head patch below, with marks
        model.config.scale_decoder_outputs = False
    elif family == "resnet":
        from transformers import ResNetConfig, ResNetForImageClassification

        cfg = ResNetConfig(
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            hidden_act="relu",
            num_labels=CLASSES,
            downsample_in_first_stage=False,
        )
        model = ResNetForImageClassification(cfg)
    elif family == "mamba":
        from transformers import MambaConfig, MambaForCausalLM

        cfg = MambaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            conv_kernel=4,
            expand=2,
            use_cache=False,
            tie_word_embeddings=False,
        )
        model = MambaForCausalLM(cfg).to(torch.bfloat16)
    else:
        from transformers import GPTJConfig, GPTJForCausalLM

        cfg = GPTJConfig(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=1,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = GPTJForCausalLM(cfg)
    model.train()
    return model


def batches(family: str, fault) -> list[list[dict]]:
    """Per step, per micro-batch: the model's inputs (``harness.draw_batches``). A data fault changes one step's
    batch."""
    out = harness.draw_batches(DATA_SEED, STEPS, MICRO.get(family, 1), lambda g: _micro_batch(family, g))
    if fault and fault["kind"] in ("ids", "labels"):
        b = out[fault["step"]][0]
        if fault["kind"] == "ids":
            b["input_ids"][0, 6] = (b["input_ids"][0, 6] + 1 - 2) % (VOCAB - 2) + 2  # one token id +1
        else:
            lab = b["labels"]
            lab[2] = (lab[2] + 3) % CLASSES  # two images' labels changed
            lab[5] = (lab[5] + 7) % CLASSES
    return out


def _micro_batch(family: str, g) -> dict:
    """One micro-batch of ``family``'s inputs, drawn from generator ``g``."""
    import torch

    if family == "resnet":
        px = torch.rand(IMAGES, 3, SIZE, SIZE, generator=g)
        return {"pixel_values": px, "labels": torch.randint(0, CLASSES, (IMAGES,), generator=g)}
    elif family == "t5":
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        return {"input_ids": ids, "labels": torch.randint(2, VOCAB, (BATCH, TGT_LEN), generator=g)}
    else:
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def _hf(family: str):
    return harness.hf_module(family)  # the families are named as transformers' models


def family_faults(family: str) -> list[dict]:
    return harness.family_faults(sys.modules[__name__], family)


SILU_BACK_WRONG = "1 + s"  # the derivative's (1 - s) written (1 + s): d/dx x s(x) = s (1 + x (1 - s))


def patch(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch
    import torch.nn.functional as F

    hf = _hf(family)
    on = lambda kind: active is not None and active["kind"] == kind

    def embed_mark(emb, tag):
        harness.embed_mark(tracer, emb, tag)

    if family == "t5":
        embed_mark(model.encoder.embed_tokens, "embedding")  # the encoder's (its table is the shared one)
        head = model.lm_head
        skip = on("missing_scale")
        scale = model.model_dim**-0.5

        def head_fwd(x, head=head, skip=skip, scale=scale):  # T5ForConditionalGeneration's scale, then lm_head
            if not skip:
                x = x * scale
                tracer.mark("dec_scale")
            y = F.linear(x, head.weight, head.bias)
            tracer.mark("lm_head")
            return y

        head.forward = head_fwd

    if family == "mamba":
        embed_mark(model.backbone.embeddings, "embedding")
        wrong = on("silu_back")

        class SiLUFunction(torch.autograd.Function):  # a memory-efficient SiLU (saves the input only)
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * torch.sigmoid(x)

            @staticmethod
            def backward(ctx, grad_output):
                (x,) = ctx.saved_tensors
                s = torch.sigmoid(x)
                t = (1 + s) if wrong else (1 - s)
                tracer.mark("silu_back.first")
                return grad_output * (s * (1 + x * t))

        hf.ACT2FN = {"silu": SiLUFunction.apply}  # the conv's activation (looked up at call time)

    if family == "gptj":
        layers = model.transformer.h
        for fault in family_faults(family):
            li = fault.get("layer")
            if fault["kind"] == "ln_eps":
                ln = layers[li].ln_1
                eps = fault["value"] if on("ln_eps") else ln.eps

                def ln_fwd(x, ln=ln, eps=eps, tag="L%d.ln_1" % li):
                    y = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, eps)
                    tracer.mark(tag)
                    return y

                ln.forward = ln_fwd
            if fault["kind"] == "nobias":
                fc = layers[li].mlp.fc_in
                drop = on("nobias")

                def fc_fwd(x, fc=fc, drop=drop, tag="L%d.fc_in" % li):
                    y = F.linear(x, fc.weight, None if drop else fc.bias)
                    tracer.mark(tag)
                    return y

                fc.forward = fc_fwd

    if family == "resnet":
        conv = model.resnet.encoder.stages[0].layers[0].layer[1].convolution  # stage 0's second convolution
        lower = on("conv_bf16")

        def conv_fwd(x, conv=conv, lower=lower):
            if lower:  # msprobe writes no record of the casts (Tensor.to): the conv2d gets bf16 inputs
                w = conv.weight.to(torch.bfloat16)
                y = F.conv2d(x.to(torch.bfloat16), w, None, conv.stride, conv.padding, conv.dilation, conv.groups)
                tracer.mark("S0.conv2")
                return y.to(x.dtype)
            y = F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
            tracer.mark("S0.conv2")
            return y

        conv.forward = conv_fwd
        bn = model.resnet.encoder.stages[1].layers[0].layer[0].normalization  # stage 1's first BatchNorm
        if on("frozen_bn"):
            bn.eval()  # left in eval mode (a freeze meant for fine-tuning): running statistics in training

        def bn_fwd(x, bn=bn):
            y = torch.nn.BatchNorm2d.forward(bn, x)
            tracer.mark("S1.bn")
            return y

        bn.forward = bn_fwd

    harness.watch_weights(sys.modules[__name__], family, model, tracer)


def _row3neg(p) -> None:
    p[3] = -p[3]


def corrupt(model, fault) -> None:
    harness.corrupt(model, fault, {"row3neg": _row3neg})


def make_optimizer(family: str, model):
    import torch

    params = model.parameters()
    if family == "t5":
        return torch.optim.RAdam(params, lr=3e-3)
    if family == "resnet":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    if family == "mamba":
        return torch.optim.NAdam(params, lr=2e-3)
    return torch.optim.RMSprop(params, lr=1e-3, alpha=0.99)


def forward_loss(family: str, model, batch: dict, fault, tracer):
    """The model's loss and logits; ResNet's images normalised first (twice with the ``double_norm`` fault)."""
    if family == "resnet":
        px = (batch["pixel_values"] - PIXEL_MEAN) / PIXEL_STD
        if fault and fault["kind"] == "double_norm":  # the loader normalised already: normalised twice
            px = px - PIXEL_MEAN
            if tracer is not None:
                tracer.mark("norm2_sub")
            px = px / PIXEL_STD
        out = model(pixel_values=px, labels=batch["labels"])
    else:
        out = model(**batch)
    return out.loss, out.logits


OPTIMIZER_KINDS = ("lr", "nesterov", "alpha")
ARGMAX_FAMILY = "resnet"  # the batch's accuracy, an argmax over the logits inside the window


def train(family: str, model, data, fault, **kw):
    """The training loop of every run (``harness.train``): the optimizer faults are the learning rate, SGD's
    Nesterov switch and RMSprop's alpha."""
    return harness.train(sys.modules[__name__], family, model, data, fault, **kw)


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """resnet 'flip' variant, in both runs alike: a tilt of one classifier row, added before the last step, that
    ties one image's top-2 logits in the reference to within a few fp32 ulps, chosen (by simulating both runs
    without msprobe) so that the device's rounding flips that image's argmax and no other
    (``harness.craft_near_tie``).

    Returns (what was done, the tilt to add to the classifier's weight before step FLIP_STEP)."""

    def run(on_step, hooks):
        return train("resnet", model, data, None, on_step=on_step, hooks=hooks)

    return harness.craft_near_tie(model, model.classifier[-1], run, device, FLIP_STEP)


def setup(family: str, variant: str, target: bool, active, tracer: Tracer, info: dict):
    """A run's model (built on the device where the family computes tables when built), patched; a "flip"
    variant's tilt crafted on a model of its own; the device installed (``harness.run_one``)."""
    device = DEVICES[FAMILIES[family]["device"]]
    if not target and variant == "noisyref":
        device = DEVICES[NOISY_REF]
    on_device = target or variant == "noisyref"
    tilt = None
    if variant == "flip":  # crafted on a model of its own (the device installs itself for its simulated run)
        info["flip"], tilt = craft_near_tie(
            build_model(family), batches(family, None), DEVICES[FAMILIES[family]["device"]]
        )
    if on_device and family in BUILD_ON_DEVICE:
        device.install()
    model = build_model(family)
    if on_device and family not in BUILD_ON_DEVICE:
        device.install()
    patch(family, model, tracer, active)
    return model, tilt


def flip_head(model):
    return model.classifier[-1]


def run_one(job: dict) -> dict:
    """One msprobe run (``harness.run_one``)."""
    return harness.run_one(sys.modules[__name__], job)


# =================================================================================================================
# the key
# =================================================================================================================
def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
    """What the verdict should say about a fault, from the marks both runs made at the faulty call."""
    kind = fault["kind"]
    _, first, both = harness.mark_readers(case, tgt, ref)
    if kind in OPTIMIZER_KINDS:
        what = {
            "lr": "the learning rate x%g (RAdam, fp32 master weights)" % fault["value"],
            "nesterov": "SGD momentum without Nesterov (nesterov=False) instead of Nesterov",
            "alpha": "RMSprop alpha %g instead of 0.99" % fault["value"],
        }[kind]
        return harness.optimizer_expectation(fault, what)
    if kind == "double_norm":
        return {
            "step": 0,
            "ops": [first(tgt, "norm2_sub", 0)],
            "what": "the images normalised twice in the target ((x - 0.5) / 0.25 applied again: the loader had "
            "normalised already): an extra subtract and divide; the subtract is the first record the reference "
            "does not have",
        }
    if kind == "missing_scale":
        return {
            "step": 0,
            "ops": sorted({first(ref, "dec_scale", 0), first(tgt, "lm_head", 0)}),
            "what": "the decoder output's x d_model^-0.5 (T5's tied-embedding rescale) missing in the target (the "
            "reference's multiply; its consumer, the lm_head linear on the unscaled output, also counts)",
        }
    if kind == "ln_eps":
        li = fault["layer"]
        return {
            "step": 0,
            "ops": both("L%d.ln_1" % li, 0),
            "what": "layer %d's LayerNorm with eps %g instead of 1e-5 (a scalar argument)" % (li, fault["value"]),
        }
    if kind == "nobias":
        li = fault["layer"]
        return {
            "step": 0,
            "ops": both("L%d.fc_in" % li, 0),
            "what": "layer %d's MLP fc_in computed without its bias (a kernel that drops the bias)" % li,
        }
    if kind == "frozen_bn":
        return {
            "step": 0,
            "ops": both("S1.bn", 0),
            "what": "stage 1's first BatchNorm left in eval mode during training (normalised by the running "
            "statistics; training=False in its batch_norm call)",
        }
    if kind == "conv_bf16":
        return {
            "step": 0,
            "ops": both("S0.conv2", 0),
            "what": "stage 0's second convolution computed in bf16 in an fp32 run (its input and weight cast down, "
            "its output back up; msprobe writes no record of the casts)",
        }
    if kind == "silu_back":
        return {
            "step": 0,
            "ops": both("silu_back.first", 0, first),
            "backward_only": True,
            "what": "the conv activation's custom SiLU backward computes s (1 + x (1 + s)) where s (1 + x (1 - s)) "
            "is right: the forward is right, the gradient wrong; the first op of the backward formula that differs "
            "(the (1 - s) of the last layer: backward runs from the top) is the culprit",
        }
    if kind == "weight":
        return harness.weight_expectation(fault, HOW[fault["how"]], both)
    if kind == "ids":
        return harness.data_expectation(
            fault,
            both("embedding", fault["step"], first),
            "one token id differs (+1) in the batch of step %d; the embedding is its first consumer",
        )
    if kind == "labels":
        return harness.data_expectation(
            fault,
            both("cross_entropy", fault["step"]),
            "two images' labels differ in the batch of step %d; the cross-entropy is their first consumer",
        )
    raise ValueError(kind)


argmax_flips = harness.argmax_flips


def warm() -> None:
    """The imports made once, before forking."""
    harness.warm("GPTJForCausalLM", "MambaForCausalLM", "ResNetForImageClassification", "T5ForConditionalGeneration")


def main(argv=None) -> int:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

"""Validation set 3 for dumpstore's verdict: msprobe dumps of four model families no other set uses.

Built apart from the development set and from sets 1 and 2: other families (BLOOM, Falcon, BERT, Phi), other
dtype and optimizer setups and other simulated devices (``validation/v3/devices.py``: no-FMA SIMD matmuls, a
polynomial exp, the embedding gradient accumulated in another order, Kahan LayerNorm, the attention scale folded
into the query, fp16 flush-to-zero; a reference rerun with non-determinism on). Every pair is a reference run
("GPU": plain CPU torch in the family's dtype) and a target run on the family's simulated device, with or without
one fault. The answer of every case is known by construction and written to ``<out>/key.json`` (the format of
sets 1 and 2, so ``validation/score.py`` scores it); the culprit's msprobe record name is read from msprobe while
the faulty call runs, never from dumpstore.

    .venv/bin/python validation/v3/make_pairs.py --out validation/v3/.data [--jobs 2] [--only CASE ...]

The run harness (the tracer of msprobe's record names, the forked runs, msprobe's config, the structure check) is
imported from ``validation/v2/make_pairs.py``, the driver (arguments, checks that every fault changes its run, the
key, the training loop, the run) from ``validation/harness.py``; what is here is the families, their optimizers and
setups, the faults and the expected culprits. Runs: 3 training steps; forward and backward (both micro-batches where
there are two) inside msprobe's window, clipping and the optimizer step outside it; msprobe level "mix"; statistics
mode for every case and tensor mode for a subset.
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
devices3 = harness._load("validation_v3_devices", HERE / "devices.py")  # this set's devices, under their own name
v2 = harness.set2()  # set 2's run harness

STEPS = v2.STEPS  # 3
BATCH, SEQ, VOCAB = 2, 16, 96
CLIP = 1.0
DATA_SEED = 5309
MASK_ID = 1  # BERT's [MASK] in the tiny vocabulary

FAMILIES = {
    "falcon": {
        "text": "Falcon: multi-query attention (4 query heads, 1 KV head), parallel attention and MLP from one "
        "LayerNorm, RoPE, no biases, exact GELU; hidden 32 (MLP 128), 4 layers; fp32; SGD with momentum 0.9 (lr 0.05); "
        "an argmax over the logits (the batch's accuracy) inside the window",
        "device": "I",
        "seed": 31,
    },
    "bloom": {
        "text": "BLOOM: ALiBi position bias through baddbmm, LayerNorm on the embeddings, GELU(tanh) in a custom "
        "autograd function, fused QKV with biases; hidden 48, 2 layers; pure bf16 (weights, activations and Adam "
        "state); Adam with L2 weight decay 0.01 in the gradient (not decoupled), lr 2e-3",
        "device": "K",
        "seed": 32,
    },
    "bert": {
        "text": "BERT: encoder with post-LayerNorm, token types (two segments), learned positions, exact GELU, "
        "masked-LM head (15 % of tokens masked); hidden 48 (4 heads of 12, MLP 96), 2 layers; fp32 weights under "
        "bf16 autocast; Adafactor (lr 1e-2)",
        "device": "J",
        "seed": 33,
    },
    "phi": {
        "text": "Phi: parallel attention and MLP block, partial rotary (half of each head), q/k/v/dense biases, "
        "GELU(tanh) written out with torch.tanh; hidden 32 (4 heads of 8, MLP 64), 2 layers; fp32 weights under "
        "fp16 autocast with dynamic loss scaling (GradScaler, initial scale 2^10); gradient accumulation over 2 "
        "micro-batches; AdamW (lr 2e-3, weight decay 0.01)",
        "device": "L",
        "seed": 34,
    },
}

# name -> family, reference variant ("flip": an lm_head tilted to a near-tie; "noisyref": the reference rerun on
# device M), fault (None: clean), dump modes. The expected culprit comes from what msprobe named at the faulty call.
CASES = {
    "falcon_clean": ("falcon", "base", None, ("stats", "tensor")),
    "bloom_clean": ("bloom", "base", None, ("stats", "tensor")),
    "bert_clean": ("bert", "base", None, ("stats", "tensor")),
    "phi_clean": ("phi", "base", None, ("stats",)),
    "falcon_flip": ("falcon", "flip", None, ("stats", "tensor")),
    "bert_noisyref": ("bert", "noisyref", None, ("stats",)),
    # optimizer, from the second update on
    "falcon_momentum_step2": harness.optimizer_case("falcon", "momentum", 0.8),
    "falcon_clip_step2": harness.optimizer_case("falcon", "clip", 0.25),
    "bloom_lr_step2": harness.optimizer_case("bloom", "lr", 1.05),
    # an op in the target only, an op missing in the target
    "phi_extra_softcap": ("phi", "base", {"kind": "softcap"}, ("stats", "tensor")),
    "bloom_missing_embed_ln": ("bloom", "base", {"kind": "missing_embed_ln"}, ("stats",)),
    # a wrong variant, a lower precision, a wrong scale, one layer of four
    "bert_gelu_tanh_L1": ("bert", "base", {"kind": "gelu_tanh", "layer": 1}, ("stats", "tensor")),
    "falcon_ln_bf16_L2": ("falcon", "base", {"kind": "ln_bf16", "layer": 2}, ("stats", "tensor")),
    "phi_scale_rotary_L1": ("phi", "base", {"kind": "rotary_scale", "layer": 1}, ("stats",)),
    # backward only: the custom autograd function's gradient formula
    "bloom_gelu_backward": ("bloom", "base", {"kind": "gelu_back"}, ("stats", "tensor")),
    # parameters and data
    "bert_value_step1": harness.weight_case("bert", "bert.encoder.layer.1.attention.self.value.weight", 1, "sign2pct"),
    "phi_fc1_step2": harness.weight_case("phi", "model.layers.0.mlp.fc1.weight", 2, "col5scale"),
    "falcon_data_step2": ("falcon", "base", {"kind": "ids", "step": 2}, ("stats",)),
    "bert_token_type_step1": ("bert", "base", {"kind": "token_type", "step": 1}, ("stats",)),
    "bert_labels_step2": ("bert", "base", {"kind": "labels", "step": 2}, ("stats",)),
}

HOW = {
    "sign2pct": "the sign of 2 % of the elements flipped",
    "col5scale": "column 5 (one input feature) x1.25",
}
GELU_BACK_WRONG = 0.0356774081  # sqrt(2/pi) x 0.044715: the factor 3 of d/dx x^3 forgotten (right: 0.1070322243)


# =================================================================================================================
# one run (in a forked child)
# =================================================================================================================
class Tracer(v2.Tracer):
    """Set 2's tracer (record names, marks, parameter uses by linear, the loss); and every argmax's inputs."""

    def __init__(self):
        super().__init__()
        self.argmax: list[dict] = []


def build_model(family: str):
    import torch

    torch.manual_seed(FAMILIES[family]["seed"])
    if family == "falcon":
        from transformers import FalconConfig, FalconForCausalLM
        from transformers.models.falcon import modeling_falcon

        cfg = FalconConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            multi_query=True,
            parallel_attn=True,
            new_decoder_architecture=False,
            bias=False,
            alibi=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        # FalconLinear computes x @ W.T (+ b): the same function as nn.Linear, which msprobe records as one op
        modeling_falcon.FalconLinear.forward = torch.nn.Linear.forward
        model = FalconForCausalLM(cfg)
    elif family == "bloom":
        from transformers import BloomConfig, BloomForCausalLM

        cfg = BloomConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            n_layer=2,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = BloomForCausalLM(cfg).to(torch.bfloat16)
    elif family == "bert":
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=96,
            hidden_act="gelu",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
            type_vocab_size=2,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = BertForMaskedLM(cfg)
    else:
        from transformers import PhiConfig, PhiForCausalLM

        cfg = PhiConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            partial_rotary_factor=0.5,
            hidden_act="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = PhiForCausalLM(cfg)
    model.train()
    return model


MICRO = {"phi": 2}  # micro-batches per step


def batches(family: str, fault) -> list[list[dict]]:
    """Per step, per micro-batch: the model's inputs (``harness.draw_batches``). A data fault changes one step's
    batch."""
    out = harness.draw_batches(DATA_SEED, STEPS, MICRO.get(family, 1), lambda g: _micro_batch(family, g))
    if fault and fault["kind"] in ("ids", "token_type", "labels"):
        b = out[fault["step"]][0]
        if fault["kind"] == "ids":
            b["input_ids"][0, 6] = (b["input_ids"][0, 6] + 1 - 2) % (VOCAB - 2) + 2  # one token id +1
        elif fault["kind"] == "token_type":
            b["token_type_ids"][1, SEQ // 2 - 2 : SEQ // 2] = 1  # the segment boundary 2 tokens early in one row
        else:
            lab = b["labels"]
            pos = [(i, j) for i in range(BATCH) for j in range(SEQ) if lab[i, j] >= 0][:2]
            for i, j in pos:
                lab[i, j] = (lab[i, j] + 7 - 2) % (VOCAB - 2) + 2
    return out


def _micro_batch(family: str, g) -> dict:
    """One micro-batch of ``family``'s inputs, drawn from generator ``g``."""
    import torch

    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    if family == "bert":
        masked = torch.rand(BATCH, SEQ, generator=g) < 0.15
        masked[:, 3] = True  # at least one masked token per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        inp = torch.where(masked, torch.full_like(ids, MASK_ID), ids)
        types = torch.zeros_like(ids)
        types[:, SEQ // 2 :] = 1
        return {"input_ids": inp, "token_type_ids": types, "labels": labels}
    else:
        return {"input_ids": ids, "labels": ids.clone()}


def _hf(family: str):
    return harness.hf_module(family)  # the families are named as transformers' models


def family_faults(family: str) -> list[dict]:
    return harness.family_faults(sys.modules[__name__], family)


def _layers(family: str, model):
    return {
        "falcon": lambda: model.transformer.h,
        "bloom": lambda: model.transformer.h,
        "bert": lambda: model.bert.encoder.layer,
        "phi": lambda: model.model.layers,
    }[family]()


def patch(family: str, model, tracer: Tracer, active) -> None:
    """Every run of a family: marks at the call of each of the family's faults (the same calls transformers makes,
    so the runs of a family have the same records); ``active``: the fault this run has (targets only)."""
    import torch
    import torch.nn.functional as F

    hf = _hf(family)
    kinds = {f["kind"]: f for f in family_faults(family)}
    on = lambda kind: active is not None and active["kind"] == kind
    layers = _layers(family, model)

    def embed_mark(emb, tag):
        harness.embed_mark(tracer, emb, tag)

    if family == "falcon":
        embed_mark(model.transformer.word_embeddings, "embedding")
    if family == "bert":
        e = model.bert.embeddings
        embed_mark(e.word_embeddings, "embedding")
        embed_mark(e.token_type_embeddings, "token_type_embedding")

    if family in ("falcon", "phi"):  # the family's eager attention, call for call as in transformers, with marks
        repeat_kv = hf.repeat_kv

        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            li = module.layer_idx
            key_states = repeat_kv(key, module.num_key_value_groups)
            value_states = repeat_kv(value, module.num_key_value_groups)
            if on("rotary_scale") and li == active["layer"]:
                scaling = module.rotary_ndims**-0.5  # 1/sqrt(rotary dims) where 1/sqrt(head_dim) is meant
            attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
            tracer.mark("L%d.scale" % li)
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
            attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
            attn_output = torch.matmul(attn_weights, value_states)
            attn_output = attn_output.transpose(1, 2).contiguous()
            return attn_output, attn_weights

        hf.eager_attention_forward = attention  # looked up in the module at call time

    if "ln_bf16" in kinds:  # Falcon's input LayerNorm of one layer, computed in bf16 in the faulty run
        li = kinds["ln_bf16"]["layer"]
        ln = layers[li].input_layernorm

        lower = on("ln_bf16")

        def ln_fwd(x, ln=ln, lower=lower):
            if lower:  # msprobe writes no record of the casts (Tensor.to): the layer_norm gets bf16 inputs
                xb = x.to(torch.bfloat16)
                w, b = ln.weight.to(torch.bfloat16), None if ln.bias is None else ln.bias.to(torch.bfloat16)
                y = F.layer_norm(xb, ln.normalized_shape, w, b, ln.eps)
                tracer.mark("L%d.ln" % li)
                return y.to(x.dtype)
            y = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
            tracer.mark("L%d.ln" % li)
            return y

        ln.forward = ln_fwd

    if family == "bloom":
        emb_ln = model.transformer.word_embeddings_layernorm
        ln0 = layers[0].input_layernorm
        skip = on("missing_embed_ln")

        def emb_ln_fwd(x, m=emb_ln, skip=skip):
            if skip:  # the embeddings' LayerNorm missing in the target
                return x
            y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
            tracer.mark("embed_ln")
            return y

        def ln0_fwd(x, m=ln0):
            y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
            tracer.mark("L0.ln_in")
            return y

        emb_ln.forward = emb_ln_fwd
        ln0.forward = ln0_fwd

        wrong = on("gelu_back")

        class GeLUFunction(torch.autograd.Function):  # transformers' GeLUFunction, call for call, with marks
            @staticmethod
            def forward(ctx, input):
                ctx.save_for_backward(input)
                return hf.bloom_gelu_forward(input)

            @staticmethod
            def backward(ctx, grad_output):
                (x,) = ctx.saved_tensors
                tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
                c = GELU_BACK_WRONG if wrong else 0.1070322243
                cx = c * x
                tracer.mark("gelu_back.inner")
                inner = 0.79788456 + cx * x
                ff = 0.5 * x * ((1 - tanh_out * tanh_out) * inner) + 0.5 * (1 + tanh_out)
                out = ff * grad_output
                tracer.mark("gelu_back.out")
                return out

        hf.GeLUFunction = GeLUFunction

    if "gelu_tanh" in kinds:  # BERT's intermediate activation of one layer
        li = kinds["gelu_tanh"]["layer"]
        inter = layers[li].intermediate

        tanh = on("gelu_tanh")

        def act(x, tag="L%d.act" % li, tanh=tanh):
            y = F.gelu(x, approximate="tanh" if tanh else "none")
            tracer.mark(tag)
            return y

        inter.intermediate_act_fn.forward = act  # the module stays (its record too)

    if "softcap" in kinds:  # Phi's lm_head; the faulty run soft-caps the logits (Gemma 2's 30 tanh(x / 30))
        head = model.lm_head

        cap = on("softcap")

        def head_fwd(x, head=head, cap=cap):
            y = F.linear(x, head.weight, head.bias)
            if cap:
                y = y / 30.0
                tracer.mark("cap_div")
                y = torch.tanh(y)
                tracer.mark("cap_tanh")
                y = y * 30.0
                tracer.mark("cap_mul")
            return y

        head.forward = head_fwd

    harness.watch_weights(sys.modules[__name__], family, model, tracer)


def _col5scale(p) -> None:
    p[:, 5] *= 1.25


def corrupt(model, fault) -> None:
    harness.corrupt(model, fault, {"col5scale": _col5scale})


FLIP_STEP = STEPS - 1  # the crafted tie is at the last step


def make_optimizer(family: str, model):
    import torch

    params = model.parameters()
    if family == "falcon":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if family == "bloom":
        return torch.optim.Adam(params, lr=2e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    if family == "bert":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.999), weight_decay=0.01)


AUTOCAST = {"bert": "bfloat16", "phi": "float16"}


def forward_loss(family: str, model, batch: dict, fault=None, tracer=None):
    """The model's loss (BERT: the masked-LM loss; the others: causal LM) and logits."""
    out = model(**batch)
    return out.loss, out.logits


OPTIMIZER_KINDS = ("momentum", "clip", "lr")
ARGMAX_FAMILY = "falcon"  # the batch's accuracy, an argmax over the logits inside the window


def train(family: str, model, data, fault, **kw):
    """The training loop of every run (``harness.train``): the optimizer faults are SGD's momentum, the clipping
    norm and the learning rate."""
    return harness.train(sys.modules[__name__], family, model, data, fault, **kw)


def craft_near_tie(model, data, device) -> tuple[dict, object]:
    """falcon 'flip' variant, in both runs alike: a tilt of one lm_head row, added before the last step, that ties
    one token's top-2 logits in the reference to within a few fp32 ulps, chosen (by simulating both runs without
    msprobe) so that the device's rounding flips that token's argmax and no other (``harness.craft_near_tie``).

    Returns (what was done, the tilt to add to the lm_head weight before step FLIP_STEP)."""

    def run(on_step, hooks):
        return train("falcon", model, data, None, on_step=on_step, hooks=hooks)

    return harness.craft_near_tie(model, model.lm_head, run, device, FLIP_STEP)


def setup(family: str, variant: str, target: bool, active, tracer: Tracer, info: dict):
    """A run's model, patched; a "flip" variant's tilt crafted on it; the device installed (``harness.run_one``)."""
    model = build_model(family)
    device = devices3.DEVICES[FAMILIES[family]["device"]]
    if not target and variant == "noisyref":
        device = devices3.DEVICES[NOISY_REF]
    tilt = None
    patch(family, model, tracer, active)
    if variant == "flip":
        info["flip"], tilt = craft_near_tie(model, batches(family, None), device)
        tracer.marks.clear()  # the crafting's own calls are not the run's
    if target or variant == "noisyref":
        device.install()
    return model, tilt


def flip_head(model):
    return model.lm_head


def run_one(job: dict) -> dict:
    """One msprobe run (``harness.run_one``)."""
    return harness.run_one(sys.modules[__name__], job)


# =================================================================================================================
# the key
# =================================================================================================================
def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
    """What the verdict should say about a fault, from the marks both runs made at the faulty call."""
    kind = fault["kind"]
    one, first, both = harness.mark_readers(case, tgt, ref)
    if kind in OPTIMIZER_KINDS:
        what = {"momentum": "SGD momentum %g instead of 0.9", "lr": "the learning rate x%g (bf16 run)"}
        return harness.optimizer_expectation(fault, harness.optimizer_what(fault, CLIP, what))
    if kind == "softcap":
        return {
            "step": 0,
            "ops": [first(tgt, "cap_div", 0)],
            "what": "logit soft-capping 30 tanh(x / 30) (Gemma 2's) in the target only: an extra divide, tanh and "
            "multiply after lm_head; the divide is the first record the reference does not have",
        }
    if kind == "missing_embed_ln":
        return {
            "step": 0,
            "ops": sorted({one(ref, "embed_ln", 0), one(tgt, "L0.ln_in", 0)}),
            "what": "the LayerNorm on the word embeddings missing in the target (the reference's layer_norm; its "
            "consumer, layer 0's input LayerNorm, also counts)",
        }
    if kind == "gelu_tanh":
        return {
            "step": 0,
            "ops": both("L%d.act" % fault["layer"], 0),
            "what": "GELU(tanh) instead of exact GELU in layer %d's intermediate activation" % fault["layer"],
        }
    if kind == "ln_bf16":
        li = fault["layer"]
        return {
            "step": 0,
            "ops": both("L%d.ln" % li, 0),
            "what": "layer %d's (of 4) input LayerNorm computed in bf16 in an fp32 run (its input, weight and bias "
            "cast down, its output back up; msprobe writes no record of the casts)" % li,
        }
    if kind == "rotary_scale":
        return {
            "step": 0,
            "ops": both("L%d.scale" % fault["layer"], 0, first),
            "what": "attention scores x 1/sqrt(rotary dims 4) instead of 1/sqrt(head_dim 8) in layer %d"
            % fault["layer"],
        }
    if kind == "gelu_back":
        return {
            "step": 0,
            "ops": both("gelu_back.inner", 0, first),
            "backward_only": True,
            "what": "the GELU's custom backward uses sqrt(2/pi) x 0.044715 where 3 x that is right (the factor 3 "
            "of d/dx x^3 forgotten): the forward is right, the gradient wrong; the first op of the backward formula "
            "that uses the constant (the last layer's GELU: backward runs from the top) is the culprit",
        }
    if kind == "weight":
        return harness.weight_expectation(fault, HOW[fault["how"]], both)
    if kind == "ids":
        return harness.data_expectation(
            fault,
            both("embedding", fault["step"]),
            "one token id differs (+1) in the batch of step %d; the embedding is its first consumer",
        )
    if kind == "token_type":
        return harness.data_expectation(
            fault,
            both("token_type_embedding", fault["step"]),
            "the segment boundary of one sequence 2 tokens early (token types) in the batch of step %d; the "
            "token-type embedding is its first consumer",
        )
    if kind == "labels":
        return harness.data_expectation(
            fault,
            both("cross_entropy", fault["step"]),
            "two masked-LM labels differ in the batch of step %d; the cross-entropy is their first consumer",
        )
    raise ValueError(kind)


argmax_flips = harness.argmax_flips


SET = 3
NOISY_REF = "M"
DEVICES = devices3.DEVICES


def warm() -> None:
    """The imports made once, before forking."""
    harness.warm("BertForMaskedLM", "BloomForCausalLM", "FalconForCausalLM", "PhiForCausalLM")


def main(argv=None) -> int:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

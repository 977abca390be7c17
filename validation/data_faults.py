"""More instances of two fault classes, made with the generators of validation sets 3, 4 and 7: data changed
after step 0 (one token id +1, or labels, at step 1 or 2; set 7: a stale image read after other records of its
step already differ by the pair's noise) and a small weight change after step 0 (a weight x1.01 before step 1),
in other families, dtypes and dump modes than the sets' own cases.

    .venv/bin/python validation/data_faults.py --set 4 --out /tmp/data_faults_v4 [--jobs 2] [--only CASE ...]
    .venv/bin/python validation/data_faults.py --set 7 --text-first --out /tmp/data_faults_v7tf --only siglip_clean \
        siglip_stale_image_step2
    .venv/bin/python validation/score.py --data /tmp/data_faults_v4

Each set's families, devices, training loop and key are its own (``validation/v3/make_pairs.py``,
``validation/v4/make_pairs.py``, ``validation/v7/make_pairs.py``, driven by ``validation/harness.py``): this module
only adds cases to its ``CASES``, one way to change a weight (``x1.01``: every element times 1.01), a stale image
in a later micro-batch (set 7) and ``--text-first`` (set 7's SigLIP with its text tower run before its image
tower: a two-tower model whose image is read second). Nothing here is written into the repository: the pairs go
to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# set -> case -> (family, variant, fault, modes), as the sets' own CASES
EXTRA = {
    # float data read after other records of the step already differ by the pair's noise: a stale image (pair 0's
    # replaced by the previous step's) in Swin's second micro-batch (fp32), and in SigLIP's image tower run after
    # its text tower (``--text-first``; bf16 autocast); the clean pairs of the same modes
    7: {
        "swin_clean": ("swin", "base", None, ("stats", "tensor")),
        "siglip_clean": ("siglip", "base", None, ("stats", "tensor")),
        "swin_stale_image_mb2_step2": (
            "swin",
            "base",
            {"kind": "stale_image", "step": 2, "micro": 1},
            ("stats", "tensor"),
        ),
        "siglip_stale_image_step2": ("siglip", "base", {"kind": "stale_image", "step": 2}, ("stats", "tensor")),
        "siglip_stale_image_step1": ("siglip", "base", {"kind": "stale_image", "step": 1}, ("stats", "tensor")),
    },
    4: {
        "mamba_clean": ("mamba", "base", None, ("stats", "tensor")),
        "resnet_clean": ("resnet", "base", None, ("stats", "tensor")),
        "gptj_clean": ("gptj", "base", None, ("stats", "tensor")),
        "mamba_ids_step1": ("mamba", "base", {"kind": "ids", "step": 1}, ("stats", "tensor")),
        "mamba_ids_step2": ("mamba", "base", {"kind": "ids", "step": 2}, ("stats", "tensor")),
        "t5_ids_step1": ("t5", "base", {"kind": "ids", "step": 1}, ("stats",)),
        "resnet_labels_step1": ("resnet", "base", {"kind": "labels", "step": 1}, ("stats", "tensor")),
        "mamba_inproj_x101_step1": (
            "mamba",
            "base",
            {"kind": "weight", "param": "backbone.layers.1.mixer.in_proj.weight", "step": 1, "how": "x1.01"},
            ("stats", "tensor"),
        ),
        "resnet_conv_x101_step1": (
            "resnet",
            "base",
            {
                "kind": "weight",
                "param": "resnet.encoder.stages.1.layers.0.layer.0.convolution.weight",
                "step": 1,
                "how": "x1.01",
            },
            ("stats", "tensor"),
        ),
        "gptj_fcin_x101_step1": (
            "gptj",
            "base",
            {"kind": "weight", "param": "transformer.h.1.mlp.fc_in.weight", "step": 1, "how": "x1.01"},
            ("stats", "tensor"),
        ),
    },
    3: {
        "falcon_clean": ("falcon", "base", None, ("stats", "tensor")),
        "bloom_clean": ("bloom", "base", None, ("stats", "tensor")),
        "bert_clean": ("bert", "base", None, ("stats", "tensor")),
        "falcon_ids_step1": ("falcon", "base", {"kind": "ids", "step": 1}, ("stats", "tensor")),
        "falcon_ids_step2": ("falcon", "base", {"kind": "ids", "step": 2}, ("tensor",)),
        "bert_labels_step1": ("bert", "base", {"kind": "labels", "step": 1}, ("stats", "tensor")),
        "bert_ids_step1": ("bert", "base", {"kind": "ids", "step": 1}, ("stats",)),
        "bloom_mlp_x101_step1": (
            "bloom",
            "base",
            {"kind": "weight", "param": "transformer.h.1.mlp.dense_h_to_4h.weight", "step": 1, "how": "x1.01"},
            ("stats", "tensor"),
        ),
        # labels changed inside their range (two labels +1, each below the batch's largest: the labels' max/min,
        # ignore_index -100 included, stay), the inputs unchanged: BERT's masked LM (-100 at unmasked tokens), bf16
        # autocast; Phi's and BLOOM's causal LM (-100 where Hugging Face pads the shifted labels), fp16 autocast
        # with loss scaling and pure bf16
        "bert_labels_in_step1": ("bert", "base", {"kind": "labels", "step": 1, "how": "inside"}, ("stats",)),
        "bert_labels_in_step2": ("bert", "base", {"kind": "labels", "step": 2, "how": "inside"}, ("stats", "tensor")),
        "phi_labels_in_step1": ("phi", "base", {"kind": "labels", "step": 1, "how": "inside"}, ("stats",)),
        "phi_labels_in_step2": ("phi", "base", {"kind": "labels", "step": 2, "how": "inside"}, ("stats", "tensor")),
        "bloom_labels_in_step2": ("bloom", "base", {"kind": "labels", "step": 2, "how": "inside"}, ("stats",)),
        "falcon_mlp_x101_step1": (
            "falcon",
            "base",
            {"kind": "weight", "param": "transformer.h.1.mlp.dense_h_to_4h.weight", "step": 1, "how": "x1.01"},
            ("stats", "tensor"),
        ),
    },
}


def _load(number: int):
    path = HERE / ("v%d" % number) / "make_pairs.py"
    spec = importlib.util.spec_from_file_location("validation_v%d_make_pairs" % number, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _labels_inside(batches):
    """The set's `batches`, with a labels fault whose `how` is "inside" made here: in the first micro-batch of the
    fault's step, two labels +1 (at positions past each sequence's first, which a causal LM's shifted loss reads;
    each below the largest label of the micro-batch, so its max and min, -100 included, stay)."""

    def made(family: str, fault) -> list[list[dict]]:
        if not (fault and fault.get("kind") == "labels" and fault.get("how") == "inside"):
            return batches(family, fault)
        out = batches(family, None)
        lab = out[fault["step"]][0]["labels"]
        top = int(lab.max())
        pos = [(i, j) for i in range(lab.shape[0]) for j in range(1, lab.shape[1]) if 0 <= int(lab[i, j]) < top]
        for i, j in pos[:2]:
            lab[i, j] += 1
        return out

    return made


def _text_first(own):
    """Set 7's ``forward_loss`` with SigLIP's two towers in the other order: the text tower, then the image tower
    (the loss as ``SiglipModel.forward`` computes it); other families as the set has them."""

    def forward_loss(family: str, model, batch: dict, fault, tracer):
        if family != "siglip":
            return own(family, model, batch, fault, tracer)
        import torch
        import torch.nn.functional as F

        text = model.text_model(input_ids=batch["input_ids"]).pooler_output
        image = model.vision_model(pixel_values=batch["pixel_values"]).pooler_output
        text = text / text.norm(p=2, dim=-1, keepdim=True)
        image = image / image.norm(p=2, dim=-1, keepdim=True)
        logits = torch.matmul(text, image.t()) * model.logit_scale.exp() + model.logit_bias
        sign = 2 * torch.eye(logits.size(0), device=logits.device) - 1
        nll = -torch.sum(F.logsigmoid(sign * logits), dim=-1)  # the mean last, as SiglipModel's
        return nll.mean(), logits

    return forward_loss


def _stale_in_micro(own_expectation, s):
    """Set 7's ``expectation``, with a stale image in a micro-batch other than the first: that micro-batch's patch
    embedding reads it (the set's own stale image is in the first)."""

    def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
        mb = fault.get("micro", 0)
        if fault.get("kind") != "stale_image" or not mb:
            return own_expectation(case, fault, tgt, ref)
        step = fault["step"]
        return s.harness.data_expectation(
            fault,
            sorted({s.v5._nth(case, r, "patch", step, mb) for r in (tgt, ref)}),
            "image 0 of micro-batch %d replaced by an image of the previous step in step %%d (a loader reusing a "
            "stale buffer); its first consumer: the patch embedding's convolution of that micro-batch" % (mb + 1),
        )

    return expectation


def _scale(p) -> None:
    p.mul_(1.01)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", type=int, choices=sorted(EXTRA), required=True)
    ap.add_argument("--out", required=True, help="folder for the pairs and key.json (never a set's own .data)")
    ap.add_argument("--text-first", action="store_true", help="set 7: SigLIP's text tower before its image tower")
    args, rest = ap.parse_known_args(argv)
    rest = ["--out", args.out, *rest]
    s = _load(args.set)
    s.CASES = dict(EXTRA[args.set])
    if args.text_first:
        s.forward_loss = _text_first(s.forward_loss)
    if args.set == 7:
        s.expectation = _stale_in_micro(s.expectation, s)
    own = s.corrupt

    def corrupt(model, fault) -> None:
        if fault.get("how") == "x1.01":
            import torch

            with torch.no_grad():
                _scale(dict(model.named_parameters())[fault["param"]])
            return
        own(model, fault)

    s.corrupt = corrupt
    s.batches = _labels_inside(s.batches)
    own_expectation = s.expectation

    def expectation(case: str, fault, tgt: dict, ref: dict) -> dict:
        if not (fault.get("kind") == "labels" and fault.get("how") == "inside"):
            return own_expectation(case, fault, tgt, ref)
        # the first micro-batch's cross-entropy reads the changed labels (a step may hold several)
        names = {s.harness.mark_readers(case, tgt, ref)[1](res, "cross_entropy", fault["step"]) for res in (tgt, ref)}
        what = "two labels +1 inside the labels' range (max/min and the ignore_index entries unchanged) in the first "
        what += "micro-batch of step %d, the inputs unchanged; the cross-entropy is their first consumer"
        return s.harness.data_expectation(fault, sorted(names), what)

    s.expectation = expectation
    s.HOW = {**getattr(s, "HOW", {}), "x1.01": "every element times 1.01"}
    return s.main(rest)


if __name__ == "__main__":
    sys.exit(main())

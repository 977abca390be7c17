"""Parameters changed between steps, made on two families of the validation sets (the changed-parameter rule of
analysis/steps.py; docs/how-it-decides.md, section 5 and Known limits):

    .venv/bin/python validation/param_pairs.py v5|v6 small|scalar --out DIR [--jobs 1] [--modes stats tensor]

``v5``: set 5's Granite (pure bf16, Adagrad lr 1e-2); ``v6``: set 6's ConvNeXt V2 (fp32 weights, LAMB), each with
its clean pair. ``small``: a small parameter a module lists (Granite: an RMSNorm weight scaled by 0.9 before step
1, reset to ones before step 2, the final norm scaled by 0.9 before step 1; ConvNeXt: a GRN gamma reset to zeros
before step 2, a GRN beta negated before step 1). ``scalar``: a learned logit temperature added to the model (a
0-d parameter of the top model, in no module's ``parameters``, multiplying the logits through ``Tensor.__mul__``;
Granite init 0.1, ConvNeXt 1.0), reset to its initial value before step 1 or halved before step 2. The set's own
generator makes the runs (its devices, optimizers, msprobe config); the expected op is the parameter's first
consumer at the fault's step, read from the dump (the set generator's key names only uses it traced, so the
key is not written for these). Score with ``dumpstore divergence`` per pair (ingest ``<family>_base_ref_<mode>``
and the target).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SMALL = {
    "v5": {
        "granite_ln_x09_step1": ("model.layers.0.input_layernorm.weight", 1, "x0.9", ("stats",)),
        "granite_ln_ones_step2": ("model.layers.1.post_attention_layernorm.weight", 2, "ones", ("stats", "tensor")),
        "granite_norm_x09_step1": ("model.norm.weight", 1, "x0.9", ("stats",)),
    },
    "v6": {
        "convnext_grn_gamma_zeros_step2": (
            "convnextv2.encoder.stages.1.layers.0.grn.weight",
            2,
            "zeros",
            ("stats", "tensor"),
        ),
        "convnext_grn_beta_neg_step1": ("convnextv2.encoder.stages.0.layers.0.grn.bias", 1, "neg", ("stats",)),
    },
}
HOW = {
    "x0.9": "scaled by 0.9",
    "ones": "reset to ones (a resume that re-initialises it)",
    "zeros": "reset to zeros (a resume that re-initialises it)",
    "neg": "negated",
    "reinit": "reset to its initial value (a resume whose checkpoint lacks it)",
    "half": "halved",
}
FAMILY = {"v5": "granite", "v6": "convnext"}
TEMP_INIT = {"v5": 0.1, "v6": 1.0}  # the temperature's initial value (Granite: pure bf16, 16+ ulps per update)


def _load(which: str):
    spec = importlib.util.spec_from_file_location(f"param_pairs_{which}", HERE / which / "make_pairs.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _change(p, how: str, init: float) -> None:
    if how == "x0.9":
        p.mul_(0.9)
    elif how == "ones":
        p.fill_(1.0)
    elif how == "zeros":
        p.zero_()
    elif how == "neg":
        p.neg_()
    elif how == "reinit":
        p.fill_(init)
    elif how == "half":
        p.mul_(0.5)
    else:
        raise ValueError(how)


def _with_temperature(m, which: str) -> None:
    """The set module `m` with a learned logit temperature on its family's model."""
    import torch
    import torch.nn.functional as F

    build, loss_of = m.build_model, m.forward_loss

    def build_model(family):
        model = build(family)
        model.hp_temp = torch.nn.Parameter(torch.tensor(TEMP_INIT[which], dtype=next(model.parameters()).dtype))
        if family == "convnext":
            forward = model.forward

            def scaled(*a, **k):
                out = forward(*a, **k)
                out.logits = out.logits * model.hp_temp
                return out

            model.forward = scaled
        return model

    def forward_loss(family, model, batch, fault, tracer):
        if family != "granite":
            return loss_of(family, model, batch, fault, tracer)
        logits = model(input_ids=batch["input_ids"]).logits * model.hp_temp  # the causal-LM loss, as HF's
        flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, batch["labels"][:, 1:].reshape(-1), ignore_index=-100), logits

    m.build_model, m.forward_loss = build_model, forward_loss


def main(argv: list[str]) -> int:
    import torch

    if len(argv) < 2 or argv[0] not in FAMILY or argv[1] not in ("small", "scalar"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    which, kind, rest = argv[0], argv[1], argv[2:]
    m = _load(which)
    family = FAMILY[which]
    corrupt = m.corrupt

    def own_corrupt(model, fault):
        if fault.get("how") not in HOW:
            return corrupt(model, fault)
        with torch.no_grad():
            _change(dict(model.named_parameters())[fault["param"]], fault["how"], TEMP_INIT[which])

    m.corrupt = own_corrupt
    m.HOW.update(HOW)
    if kind == "scalar":
        _with_temperature(m, which)
        cases = {
            f"{family}_temp_reset_step1": ("hp_temp", 1, "reinit", ("stats", "tensor")),
            f"{family}_temp_half_step2": ("hp_temp", 2, "half", ("stats",)),
        }
        clean = f"{family}_temp_clean"
    else:
        cases, clean = SMALL[which], f"{family}_clean"
    m.CASES = {clean: (family, "base", None, ("stats", "tensor"))} | {
        name: (family, "base", {"kind": "weight", "param": p, "step": step, "how": how}, modes)
        for name, (p, step, how, modes) in cases.items()
    }
    return m.harness.main(m, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

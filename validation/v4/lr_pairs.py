"""Learning-rate changes from the second update on, under optimizers other than Adam (set 4's RMSprop GPT-J, NAdam
Mamba in pure bf16, Nesterov SGD ResNet) and their clean pairs; or a sweep of learning-rate factors in pure bf16
(``--sweep mamba``: set 4's Mamba, NAdam; ``--sweep llama``: set 1's Llama, AdamW), statistics mode, where bf16
statistics limit what the optimizer rule can see (docs/how-it-decides.md, section 5). The families, runs and key
are those of set 4's (``make_pairs.py``) or set 1's (``validation/make_pairs.py``) harness, with these cases in
place of the set's own.

    .venv/bin/python validation/v4/lr_pairs.py [--sweep mamba|llama] [--optimizer NAME] [--only CASE ...]
        [--out validation/v4/.lr_data] [--jobs 2]
    .venv/bin/python validation/score.py --data validation/v4/.lr_data

``--optimizer`` trains every family with another ``torch.optim`` optimizer (OPTIMIZERS: Adagrad, Adadelta,
Adamax, ...; use its own ``--out``: its references differ). ``--clip VALUE`` makes gradient clipping at max_norm
VALUE instead of 1.0 from the second update on (``<family>_clip_step2``, statistics mode) with each family's clean
pair, in place of the learning-rate cases (set 4's families: GPT-J fp32 under fp16 autocast with a GradScaler,
ResNet fp32, Mamba pure bf16; with ``--optimizer`` under that optimizer). ``--only`` and ``--modes`` as in
make_pairs.py; the default folder is git-ignored (never a set's own ``.data``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASES = {
    "gptj_lr11_step2": ("gptj", "base", {"kind": "lr", "after_step": 1, "value": 1.1}, ("stats", "tensor")),
    "gptj_lr101_step2": ("gptj", "base", {"kind": "lr", "after_step": 1, "value": 1.01}, ("stats",)),
    "mamba_lr105_step2": ("mamba", "base", {"kind": "lr", "after_step": 1, "value": 1.05}, ("stats", "tensor")),
    "resnet_lr11_step2": ("resnet", "base", {"kind": "lr", "after_step": 1, "value": 1.1}, ("stats", "tensor")),
    "resnet_lr101_step2": ("resnet", "base", {"kind": "lr", "after_step": 1, "value": 1.01}, ("stats",)),
    "gptj_clean": ("gptj", "base", None, ("stats", "tensor")),
    "mamba_clean": ("mamba", "base", None, ("stats", "tensor")),
    "resnet_clean": ("resnet", "base", None, ("stats", "tensor")),
}
SWEEP = (1.1, 1.2, 1.5, 2.0)  # learning-rate factors from the second update on
# --optimizer NAME: every family trained with torch.optim.NAME at this learning rate instead of its own
OPTIMIZERS = {
    "Adagrad": 1e-2,
    "Adadelta": 1.0,
    "Adamax": 2e-3,
    "SGD": 0.05,
    "RAdam": 3e-3,
    "NAdam": 2e-3,
    "Adam": 1e-3,
    "AdamW": 1e-3,
}
CLIP_FAMILIES = ("gptj", "resnet", "mamba")  # --clip: set 4's fp16-autocast, fp32 and pure-bf16 families


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep = optimizer = clip = None
    if "--clip" in argv:
        at = argv.index("--clip")
        clip = float(argv[at + 1])
        del argv[at : at + 2]
    if "--sweep" in argv:
        at = argv.index("--sweep")
        sweep = argv[at + 1]
        del argv[at : at + 2]
    if "--optimizer" in argv:
        at = argv.index("--optimizer")
        optimizer = argv[at + 1]
        del argv[at : at + 2]
        if optimizer not in OPTIMIZERS:
            raise SystemExit("--optimizer: one of %s, not %r" % (", ".join(OPTIMIZERS), optimizer))
    if sweep == "llama":  # set 1's harness (it imports its devices module from its own folder)
        sys.path.insert(0, str(HERE.parent))
        mod = _load("validation_make_pairs", HERE.parent / "make_pairs.py")
        key = "factor"
    else:
        mod = _load("validation_v4_make_pairs", HERE / "make_pairs.py")
        key = "value"
    mod.CASES.clear()
    if optimizer is not None:

        def make_optimizer(family, model, name=optimizer):
            import torch

            return getattr(torch.optim, name)(model.parameters(), lr=OPTIMIZERS[name])

        mod.make_optimizer = make_optimizer
    if sweep in ("llama", "mamba"):
        for f in SWEEP:
            fault = {"kind": "lr", "after_step": 1, key: f}
            mod.CASES["%s_lr%d_step2" % (sweep, round(f * 100))] = (sweep, "base", fault, ("stats",))
        mod.CASES["%s_clean" % sweep] = (sweep, "base", None, ("stats",))
    elif sweep is not None:
        raise SystemExit("--sweep: llama or mamba, not %r" % sweep)
    elif clip is not None:  # the harness lowers the clipping norm; the key names the optimizer at step 2
        for family in CLIP_FAMILIES:
            mod.CASES["%s_clip_step2" % family] = (
                family,
                "base",
                {"kind": "clip", "after_step": 1, "value": clip},
                ("stats",),
            )
            mod.CASES["%s_clean" % family] = (family, "base", None, ("stats",))
        expectation = mod.expectation

        def clip_expectation(case, fault, tgt, ref):
            if fault is not None and fault["kind"] == "clip":
                what = "gradient clipping at max_norm %g instead of %g" % (fault["value"], mod.CLIP)
                return mod.harness.optimizer_expectation(fault, what)
            return expectation(case, fault, tgt, ref)

        mod.expectation = clip_expectation
    else:
        mod.CASES.update(CASES)
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        folder = ".lr_data" if sweep is None else ".lr_data_" + sweep
        argv = ["--out", str(HERE / (folder if clip is None else ".clip_data")), *argv]
    return mod.main(argv)


if __name__ == "__main__":
    sys.exit(main())

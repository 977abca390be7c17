"""Learning-rate changes from the second update on, under set 4's optimizers (RMSprop GPT-J, NAdam Mamba in pure
bf16, Nesterov SGD ResNet), and their clean pairs: set 4's families and harness (``make_pairs.py``) with these
cases in place of its own. The optimizer rule (docs/how-it-decides.md, section 5) is checked on optimizers
other than Adam with them.

    .venv/bin/python validation/v4/lr_pairs.py [--out validation/v4/.lr_data] [--jobs 2]
    .venv/bin/python validation/score.py --data validation/v4/.lr_data

``--only`` and ``--modes`` as in make_pairs.py; the default folder is git-ignored (never set 4's own ``.data``).
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


def main(argv=None) -> int:
    spec = importlib.util.spec_from_file_location("validation_v4_make_pairs", HERE / "make_pairs.py")
    assert spec and spec.loader
    v4 = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = v4
    spec.loader.exec_module(v4)
    v4.CASES.clear()
    v4.CASES.update(CASES)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv = ["--out", str(HERE / ".lr_data"), *argv]
    return v4.main(argv)


if __name__ == "__main__":
    sys.exit(main())

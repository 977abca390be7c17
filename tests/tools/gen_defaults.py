"""Write analysis/_defaults_table.py: each hooked API's keyword defaults, per framework, from the signatures.

    python tests/tools/gen_defaults.py            # needs torch, mindspore and mindstudio-probe installed

The APIs are the ones msprobe hooks (its support_wrap_ops.yaml lists), under msprobe's record prefixes:
PyTorch `Functional` (torch.nn.functional), `Torch` (torch), `Tensor` (torch.Tensor); MindSpore `Functional`
(mindspore.ops), `Tensor` (mindspore.Tensor), `Mint` (mindspore.mint), `MintFunctional`
(mindspore.mint.nn.functional).  A keyword is kept when its default is None, a bool, an int, a float or a str
(what a dump records as a non-tensor argument); functions without a Python signature are left out.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import pprint
import re
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[2] / "analysis" / "_defaults_table.py"


def _doc_signature(fn, name: str) -> inspect.Signature | None:
    """A C builtin's signature from its docstring's first line (`gelu(input, approximate='none') -> Tensor`)."""
    for line in (getattr(fn, "__doc__", None) or "").strip().splitlines()[:3]:
        m = re.match(rf"^\s*(?:torch\.)?(?:nn\.functional\.)?(?:Tensor\.)?{re.escape(name)}\((.*)\)", line)
        if not m:
            continue
        args = m[1].split(") ->")[0]
        try:
            tree = ast.parse(f"def f({args}): pass")
        except SyntaxError:
            return None
        a = tree.body[0].args
        params, plain = [], a.posonlyargs + a.args
        for arg, default in zip(plain, [None] * (len(plain) - len(a.defaults)) + list(a.defaults)):
            params.append(_param(arg.arg, default))
        for arg, default in zip(a.kwonlyargs, a.kw_defaults):
            params.append(_param(arg.arg, default))
        try:
            return inspect.Signature([p for p in params if p is not None])
        except ValueError:
            return None
    return None


def _param(name: str, node) -> inspect.Parameter | None:
    if node is None:
        return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=value)


def _defaults(fn, name: str = "") -> dict:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = _doc_signature(fn, name)
        if sig is None:
            return {}
    out = {}
    for p in sig.parameters.values():
        d = p.default
        if d is inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if d is None or isinstance(d, (bool, int, str)) or (isinstance(d, float) and math.isfinite(d)):
            out[p.name] = d
    return out


def _table(spec: dict[str, tuple[str, list[str]]]) -> dict[str, dict]:
    table = {}
    for prefix, (module, names) in spec.items():
        try:
            owner = importlib.import_module(module)
        except ImportError:
            owner = None
        if owner is None:  # a class (Tensor)
            mod, cls = module.rsplit(".", 1)
            owner = getattr(importlib.import_module(mod), cls)
        for name in sorted(set(names)):
            fn = getattr(owner, name, None)
            found = _defaults(fn, name) if fn is not None else {}
            if found:
                table[f"{prefix}.{name}"] = found
    return table


def main() -> None:
    import msprobe

    root = Path(msprobe.__file__).parent
    pt = yaml.safe_load((root / "pytorch/dump/api_dump/support_wrap_ops.yaml").read_text())
    ms = yaml.safe_load((root / "mindspore/dump/dump_processor/hook_cell/support_wrap_ops.yaml").read_text())
    tables = {
        "pytorch": _table(
            {
                "Functional": ("torch.nn.functional", pt["functional"]),
                "Torch": ("torch", pt["torch"]),
                "Tensor": ("torch.Tensor", pt["tensor"]),
            }
        ),
        "mindspore": _table(
            {
                "Functional": ("mindspore.ops", ms["ops"]),
                "Tensor": ("mindspore.Tensor", ms["tensor"]),
                "Mint": ("mindspore.mint", ms["mint.ops"]),
                "MintFunctional": ("mindspore.mint.nn.functional", ms["mint.nn.functional"]),
            }
        ),
    }
    import mindspore
    import torch

    head = (
        '"""Keyword defaults of the APIs msprobe hooks, per framework: written by tests/tools/gen_defaults.py from\n'
        f"the signatures of torch {torch.__version__.split('+')[0]} and mindspore {mindspore.__version__} "
        '(do not edit by hand).\n\nSize: a generated table, one line per API."""\n\n'
        "# fmt: off\n"
    )
    OUT.write_text(head + "DEFAULTS: dict[str, dict[str, dict]] = " + pprint.pformat(tables, width=120) + "\n")
    print(OUT, {k: len(v) for k, v in tables.items()})


if __name__ == "__main__":
    main()

"""Argument signatures: a tensor argument given to a call in one run only (`F.linear(x, w)` against
`F.linear(x, w, b)`; `bias=None` against a bias tensor) is a discrete difference, like a changed scalar argument,
found at the first step it shows even when the outputs still agree (a bias that starts at zero).

What counts, per forward record pair of the same API (analysis/_divergence.py `same_call`): a top-level argument
(positional `input.2` or keyword `input.bias`; a module's `parameters.bias`) that is a tensor in one run and absent
or None in the other.  What does not, because it follows from the data or the compute dtype rather than from the
call: a backward record's inputs (gradients: None where no gradient flows), a tensor argument's shape (a routing
flip changes how many tokens an expert gets), its dtype (autocast; a cast msprobe does not record is
analysis/dtype_change.py's), an element of a list argument (`torch.cat` of the experts that got tokens), and a
tensor against a Python number (`x * 0.5` against `x * torch.tensor(0.5)`: the same value).
See docs/how-it-decides.md, section 4, rule 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polars as pl

from .arguments import argument_name
from .findings import Finding
from .order import INPUT_IO, OUTPUT_IO

Found = tuple[Finding, tuple]


def _absent(prefix: str) -> pl.Expr:
    """No value on this side: the leaf is missing, or recorded as None."""
    kind = pl.col(f"{prefix}kind")
    return kind.is_null() | (kind == "null")


def one_run_tensor() -> pl.Expr:
    """Row-level: a top-level input of a record pair that is a tensor in one run, absent or None in the other
    (`_io`, `_paired`: analysis/_divergence.py `_ordered`)."""
    index = pl.coalesce(pl.col("index_path"), pl.col("ref_index_path"))
    top = ~index.str.contains(".", literal=True).fill_null(True)
    t_tensor, r_tensor = pl.col("kind") == "tensor", pl.col("ref_kind") == "tensor"
    one = (t_tensor & _absent("ref_")) | (r_tensor & _absent(""))
    forward = pl.col("_direction") == "forward"  # a backward record's inputs are gradients: None where none flows
    return (pl.col("_io").is_in(INPUT_IO) & pl.col("_paired") & forward & top & one).fill_null(False)


def signature_column() -> pl.Expr:
    """group_by aggregation per record pair: whether its argument signature differs (`one_run_tensor`)."""
    return one_run_tensor().any().alias("sig_diff")


def _describe(leaf: dict[str, Any], prefix: str) -> str:
    if leaf.get(f"{prefix}kind") != "tensor":
        return "None" if leaf.get(f"{prefix}kind") == "null" else "not given"
    shape = leaf.get(f"{prefix}shape")
    dims = "x".join(str(d) for d in shape) if shape else "scalar"
    return f"a {leaf.get(f'{prefix}dtype') or ''} tensor [{dims}]".replace("a  tensor", "a tensor")


def signature_finding(
    rec: dict[str, Any], leaves: pl.DataFrame, key: tuple, finding_of: Callable[[dict[str, Any]], Finding]
) -> tuple[Found, Found] | None:
    """(culprit, first divergence) for a record whose argument signature differs: the first such argument, named
    by keyword or by its position in the op's signature (analysis/arguments.py `argument_name`); the first
    divergence is its first diverged output (as `finding_of` reads an output row: culprit.py's), else the record
    itself."""
    hits = leaves.filter(one_run_tensor())
    if not hits.height:
        return None
    leaf = hits.row(0, named=True)
    row = {**leaf, "index_path": leaf.get("index_path") or leaf.get("ref_index_path")}
    row["op_type"] = row.get("op_type") or row.get("ref_op_type")
    arg, _ = argument_name(row)
    side = "reference" if leaf.get("ref_kind") == "tensor" else "target"
    name = leaf.get("name") or leaf.get("ref_name")
    detail = (
        f"{arg} given in the {side} only: {_describe(leaf, '')} in the target, {_describe(leaf, 'ref_')} in the "
        "reference (the call's argument list differs)"
    )
    evidence = {"argument": arg, "scalar": name, "given_in": side}
    culprit = Finding(leaf["step"], leaf["rank"], rec["_record"], name, "signature", detail=detail, evidence=evidence)
    outs = leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("status") == "diverged"))
    if outs.height:
        return (culprit, key), (finding_of(outs.row(0, named=True)), key)
    culprit.evidence["outputs"] = "within tolerance"
    first = Finding(**{**culprit.__dict__, "evidence": {}})
    return (culprit, key), (first, key)

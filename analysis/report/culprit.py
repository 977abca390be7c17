"""The culprit in words: which parameter, argument or op is at fault, named as a user would name it.

A divergent input that no earlier op produced is a parameter or data; the divergence verdict names the leaf
(`Functional.linear.6.forward.input.1`).  Its parent module's record dumps the module's parameters; the one
whose target statistics equal the leaf's is that parameter, named by module path (`layers.1.fc1.weight`).
"""

from __future__ import annotations

import polars as pl

from ..findings import Finding
from .text import fmt

__all__ = ["culprit_words", "parameter_name"]

_STATS = ("max", "min", "mean", "norm")


def culprit_words(rows: pl.DataFrame, f: Finding) -> str:
    """One or two sentences naming what is at fault (`rows`: figures.prepared(cmp.rows))."""
    ev = f.evidence or {}
    leaf = ev.get("differing")
    if f.kind in ("parameter", "input") and leaf:
        how = _how(rows, f, leaf, ev.get("input_err"))
        short = leaf.removeprefix(f.op + ".")
        if f.kind == "parameter":
            pname = parameter_name(rows, f.step, f.rank, leaf)
            what = f"The parameter {pname}" if pname else f"The trainable tensor {leaf}"
            return (
                f"{what} differs between the runs{how}: {f.op} reads it as {short} and no earlier op produced "
                "it. Check how each run initialises, loads or updates it."
            )
        return (
            f"The input {short} of {f.op} differs{how} and no earlier op produced it: the two runs are fed "
            "different data. Check the data pipeline and its seed."
        )
    if f.kind == "scalar":
        return f"The argument {ev.get('scalar') or '?'} of {f.op} differs between the runs ({f.detail or 'value'})."
    if f.kind == "op":
        why = ev.get("reason") or "inputs agree, output diverges"
        return f"The op {f.op} itself: {why}. Check its kernel, dtype and compute precision on the target device."
    if f.kind in ("extra_op", "missing_op"):
        return f"The op {f.op} runs in one run only ({f.detail or f.kind})."
    return f"{f.op}: {f.detail or f.kind}."


def _how(rows: pl.DataFrame, f: Finding, leaf: str, err: float | None) -> str:
    """' (rel_l2 ≥ 0.01, from statistics)': the leaf's error with its source (statistics give a lower bound)."""
    if err is None:
        return ""
    hit = rows.filter((pl.col("step") == f.step) & (pl.col("rank") == f.rank) & (pl.col("_name") == leaf))
    src = hit["err_source"][0] if hit.height else None
    if src == "stats":
        return f" (rel_l2 ≥ {fmt(err)}, a lower bound from the dumped statistics)"
    return f" (rel_l2 {fmt(err)}" + (f", from {src})" if src else ")")


def parameter_name(rows: pl.DataFrame, step: int, rank: int, leaf: str) -> str | None:
    """The module parameter that the input leaf `leaf` is (equal target statistics), by module path."""
    here = rows.filter((pl.col("step") == step) & (pl.col("rank") == rank))
    hit = here.filter(pl.col("_name") == leaf)
    if hit.height == 0:
        return None
    src = hit.row(0, named=True)
    if src["_io"] == "parameters":
        return _dotted(src)
    if not src.get("_module") or any(src.get(s) is None for s in _STATS):
        return None
    same = here.filter(
        (pl.col("_io") == "parameters")
        & (pl.col("_op") == src["_module"])
        & pl.all_horizontal([pl.col(s) == src[s] for s in _STATS])
    )
    return _dotted(same.row(0, named=True)) if same.height == 1 else None


def _dotted(r: dict) -> str:
    """'layers.1.fc1' + '.' + 'weight' from a parameters leaf (api 'layers.1.fc1.Linear', op_type 'Linear')."""
    api, op_type = r.get("api") or "", r.get("op_type") or ""
    path = api[: -len(op_type) - 1] if op_type and api.endswith("." + op_type) else api
    return f"{path}.{r.get('index_path')}" if path else str(r.get("_name"))

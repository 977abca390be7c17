"""Which parameter a row is, for the changed-parameter rule of analysis/steps.py (see docs/how-it-decides.md,
section 5, *Parameters after the first step*).

A tensor is recognised across records by its fingerprint (analysis/producers.py: dtype, shape, step, rank and
statistics).  One run's fingerprint alone does not say which parameter a row is: two parameters with equal
values in the target (one layer's weight copied into another's: a wrong checkpoint mapping, a tied weight
written to) have one target fingerprint, and a change of one of them would be named at the first consumer of
either, and would make the other its own copy, not its sibling.  The reference tells them apart: a parameter
is its pair of fingerprints (target, reference), and a consumer reads it where both of its input's
fingerprints are the pair's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from .producers import fingerprint_column

T_FP = fingerprint_column()  # the target side's fingerprint (analysis/producers.py)
REF_FP = fingerprint_column("ref_")  # the reference side's


def key_expr(columns: list[str]) -> pl.Expr:
    """The parameter key of a row: the hash of its (target, reference) fingerprints; the target fingerprint
    alone where the frame has no reference fingerprint; null where the target has none."""
    if REF_FP not in columns:
        return pl.col(T_FP).alias("_pkey")
    pair = pl.struct(pl.col(T_FP), pl.col(REF_FP)).hash(seed=0)
    return pl.when(pl.col(T_FP).is_not_null()).then(pair).otherwise(None).alias("_pkey")


def keys(frame: pl.DataFrame) -> list[Any]:
    """`key_expr` of every row of `frame`, in order."""
    return frame.select(key_expr(frame.columns))["_pkey"].to_list()


def table_keys(t: pl.DataFrame) -> list[Any]:
    """The parameter key of each row of a parameter table (analysis/steps.py `table`, which adds `_pkey`); the
    target fingerprint where the table has no key column."""
    return t["_pkey" if "_pkey" in t.columns else T_FP].to_list()


def others_count(flag: np.ndarray, measured: np.ndarray, owner: list, least: int) -> np.ndarray:
    """For each row, how many rows of every other tensor (`owner`: analysis/steps.py `_owners`; another call of
    the same module is the same tensor) that are `measured` have `flag`; -1 where fewer than `least` other
    tensors are measured (no evidence either way)."""
    out = np.full(len(flag), -1)
    for i in range(len(flag)):
        rows = {owner[j]: bool(flag[j]) for j in range(len(flag)) if owner[j] != owner[i] and measured[j]}
        if len(rows) >= least:
            out[i] = sum(rows.values())
    return out

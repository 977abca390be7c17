"""Which tensor is which within one step of one run, and which record produced it (see docs/how-it-decides.md,
rule 6).  The one place that says when two tensor leaves are the same tensor; analysis/culprit.py,
analysis/extra_chain.py and analysis/_overflow.py ask it.

msprobe knows a tensor only as an input or output leaf of a recorded op, by its dtype, shape and statistics (min,
max, mean, norm; in tensor mode those of its file).  Two leaves of one step, rank and source of one run are

- **the same tensor** when their dtype, shape and statistics are equal (`fingerprint(prefix)`: nulls compare
  equal, at least one statistic known);
- **the same values through a view** (the view rule) when their dtype, number of elements and statistics are equal,
  of any shape: an op msprobe does not record between a producer and its reader (view, reshape, transpose,
  permute, flatten, contiguous) keeps the dtype, the number of elements and the values in another order, so every
  statistic (none depends on the order), not the shape (`fingerprint(prefix, view=True)` on a frame,
  `view_key(row, prefix, stats)` on one row).

How many statistics a view must match is its caller's trade between missing a link and making a false one, and is
given by `stats` with the rule applied only where all of them are known:

- the producer of a diverged input (analysis/culprit.py, `Producers.producer`): a float tensor, all four
  statistics (`fingerprint(view=True)`); integer statistics (max/min, some msprobe versions the mean and norm)
  match too easily: two index tensors of one length;
- a chain of calls of one run only (analysis/extra_chain.py): all four, any dtype (`view_key(row, prefix)`), among
  the one-run records only;
- overflow reaching its readers (analysis/_overflow.py): max and min only (`view_key(row, stats=("max", "min"))`),
  any dtype: a dirty tensor's mean and norm are NaN or Inf, which match nothing, and an integer cast's reader keeps
  only its max and min.

`view_key` compares values as Python does (a NaN statistic matches nothing); the hashed `fingerprint` columns let
NaN equal NaN.  A producer is the first record of the run (execution order `seq`) with an output of the key,
before the reader's own record (`Producers`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES, FLOAT_DTYPES

from .order import INPUT_IO, OUTPUT_IO
from .rules import COUNTS, stats_bound

STATS = ("min", "max", "mean", "norm")


def fingerprint_column(prefix: str = "", *, view: bool = False) -> str:
    """The name of the column `fingerprint(prefix, view=view)` makes: `_fp_t`, `_vfp_t`, `_fp_ref_`, `_vfp_ref_`."""
    return f"_{'v' if view else ''}fp_{prefix or 't'}"


def fingerprint(prefix: str = "", *, view: bool = False) -> pl.Expr:
    """One run's (`prefix`: "" the target, "ref_" the reference) fingerprint of each tensor leaf, a hash: the same
    tensor (dtype, shape, step, rank, source, statistics; null without any statistic), or with `view` the same
    values through a view msprobe does not record (dtype, number of elements, step, rank, source, statistics; null
    unless a float tensor with all four statistics).  See the module's doc."""
    size = f"{prefix}numel" if view else f"{prefix}shape"
    cols = [pl.col(f"{prefix}dtype"), pl.col(size), pl.col("step"), pl.col("rank"), pl.col("source")]
    cols += [pl.col(f"{prefix}{s}") for s in STATS]
    if view:
        known = pl.all_horizontal([pl.col(f"{prefix}{s}").is_not_null() for s in STATS]) & pl.col(
            f"{prefix}dtype"
        ).is_in(list(FLOAT_DTYPES))
    else:
        known = pl.any_horizontal([pl.col(f"{prefix}{s}").is_not_null() for s in STATS])
    return pl.when(known).then(pl.struct(cols).hash()).alias(fingerprint_column(prefix, view=view))


def with_fingerprints(rows: pl.DataFrame) -> pl.DataFrame:
    """`rows` (a comparison's pair rows) with both runs' fingerprints: `_fp_t`, `_fp_ref_`, `_vfp_t`, `_vfp_ref_`."""
    return rows.with_columns(
        fingerprint(""), fingerprint("ref_"), fingerprint("", view=True), fingerprint("ref_", view=True)
    )


def view_key(row: Mapping[str, Any], prefix: str = "", stats: Sequence[str] = STATS) -> tuple | None:
    """The view rule on one row (a dict of a frame's columns, one run's by `prefix`): (dtype, number of elements,
    the `stats` in order), what a tensor keeps through a view msprobe does not record; None where one of `stats`
    is unknown.  The caller keeps to one step, rank and source (see the module's doc)."""
    values = tuple(row[f"{prefix}{s}"] for s in stats)
    if any(v is None for v in values):
        return None
    return (row[f"{prefix}dtype"], row[f"{prefix}numel"], *values)


def _first_outputs(rows: pl.DataFrame, prefix: str, col: str) -> dict[Any, tuple[int, str]]:
    """Fingerprint (column `col`) -> (seq, record) of the first output tensor of one run with it."""
    outs = (
        rows.lazy()  # lazy: only the columns used are filtered and sorted
        .filter(
            pl.col(f"{prefix}io").is_in(OUTPUT_IO) & (pl.col(f"{prefix}kind") == "tensor") & pl.col(col).is_not_null()
        )
        .sort(f"{prefix}seq")
        .group_by(col, maintain_order=True)
        .agg(pl.col(f"{prefix}seq").first(), pl.col(f"{prefix}record").first())
        .collect()
    )
    return dict(zip(outs[col].to_list(), zip(outs[f"{prefix}seq"].to_list(), outs[f"{prefix}record"].to_list())))


class Producers:
    """Which record of one run (`prefix`: "" the target, "ref_" the reference) first produced a tensor within
    one step's `rows` (a comparison's pair rows, with or without `with_fingerprints`' columns): by the same tensor,
    then by the view rule (see the module's doc)."""

    def __init__(self, rows: pl.DataFrame, prefix: str):
        self.prefix = prefix
        self._fp, self._vfp = fingerprint_column(prefix), fingerprint_column(prefix, view=True)
        if self._fp not in rows.columns or self._vfp not in rows.columns:
            rows = rows.with_columns(fingerprint(prefix), fingerprint(prefix, view=True))
        self.rows = rows  # with this run's fingerprint columns: the rows `producer` reads
        self.first = _first_outputs(rows, prefix, self._fp)
        self.first_view = _first_outputs(rows, prefix, self._vfp)
        # the module records' `parameters` leaves (msprobe mix level): which tensors are weights
        self.params = set(
            rows.lazy()
            .filter((pl.col(f"{prefix}io") == "parameters") & pl.col(self._fp).is_not_null())
            .select(self._fp)
            .collect()[self._fp]
            .to_list()
        )

    def is_weight(self, r: Mapping[str, Any]) -> bool:
        """A tensor input that is a weight: a `parameters` leaf, or one requiring grad that is a module's
        parameter where module records list them (else an activation reached through unrecorded ops, such
        as `k.transpose()`), or that requires grad where they list none."""
        if r.get(f"{self.prefix}io") == "parameters":
            return True
        if not r.get(f"{self.prefix}requires_grad"):
            return False
        return not self.params or r.get(self._fp) in self.params

    def producer(self, r: Mapping[str, Any], views: bool = True) -> str | None:
        """The record that produced the tensor of row `r` (a row of `self.rows`, as a dict) before its own
        record: the same tensor, or (`views`) the same values through a view msprobe does not record (a
        transpose or reshape of q_proj's output); None where no recorded op of this run did."""
        seq = r.get(f"{self.prefix}seq")
        found = self.producer_of(r.get(self._fp), seq)
        if found is not None or not views:
            return found
        hit = self.first_view.get(r.get(self._vfp))
        if hit is None or seq is None or hit[0] >= seq:
            return None
        return hit[1]

    def producer_of(self, fingerprint: int | None, seq: int | None) -> str | None:
        """The record that produced a tensor of this (same-tensor) fingerprint before record `seq` (None: none
        did)."""
        hit = self.first.get(fingerprint)
        if hit is None or seq is None or hit[0] >= seq:
            return None
        return hit[1]

    def made_by(self, r: Mapping[str, Any], record: str) -> bool:
        """Whether record `record` of this run has, before row `r`'s own record, an output that is `r`'s tensor
        (the same tensor, or the same values through a view): not only the first producer `producer` names, any
        record that made the same values (a result computed twice)."""
        seq = r.get(f"{self.prefix}seq")
        fp, vfp = r.get(self._fp), r.get(self._vfp)
        if seq is None or (fp is None and vfp is None):
            return False
        same = pl.col(self._fp) == fp if fp is not None else pl.lit(False)
        if vfp is not None:
            same = same | (pl.col(self._vfp) == vfp)
        return self._outputs_before(record, seq).filter(same.fill_null(False)).height > 0

    def distance_to(self, r: Mapping[str, Any], record: str) -> float | None:
        """The least statistics bound of relative L2 distance (rules.stats_bound, within this run) between row `r`'s
        tensor and an output of `record` of this run before it with the same dtype and number of elements; inf
        where their NaN/Inf/saturation counts differ; None where `record` has no such output or no bound is
        known.  How far `r` is from being that output after an op msprobe does not record."""
        p, seq = self.prefix, r.get(f"{self.prefix}seq")
        if seq is None:
            return None
        outs = self._outputs_before(record, seq).filter(
            (pl.col(f"{p}dtype") == r.get(f"{p}dtype")) & (pl.col(f"{p}numel") == r.get(f"{p}numel"))
        )
        found = [_distance(r, o, p) for o in outs.iter_rows(named=True)]
        known = [d for d in found if d is not None]
        return min(known) if known else None

    def _outputs_before(self, record: str, seq: int) -> pl.DataFrame:
        """The tensor outputs of `record` of this run that come before sequence number `seq`."""
        p = self.prefix
        return self.rows.filter(
            (pl.col(f"{p}record") == record)
            & pl.col(f"{p}io").is_in(OUTPUT_IO)
            & (pl.col(f"{p}kind") == "tensor")
            & (pl.col(f"{p}seq") < seq)
        )

    def input_producer(self, record: str, name: str, views: bool = True) -> str | None:
        """`producer` of the input leaf `name` (this run's leaf name, e.g. `Functional.linear.3.forward.input.0`)
        of `record` (this run's record name); None where the leaf is not in `rows` or no recorded op made it."""
        p = self.prefix
        leaf = self.rows.filter(
            (pl.col(f"{p}record") == record) & (pl.col(f"{p}name") == name) & pl.col(f"{p}io").is_in(INPUT_IO)
        )
        return self.producer(leaf.row(0, named=True), views=views) if leaf.height else None


def integer_input() -> pl.Expr:
    """Row-level (a comparison's ordered rows, `_io`): an integer or boolean tensor input of its record (labels,
    ids, indices, masks; by the pair's tolerance dtype)."""
    return pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor") & pl.col("tol_dtype").is_in(DISCRETE_DTYPES)


def discrete_data_readers(rows: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """The records (`keys`) of one step's rows with an integer or boolean tensor input that differs between the
    runs (labels, ids, indices): candidates for the culprit judge even where their outputs stay within their
    tolerance (analysis/culprit.py `_discrete_data` decides whether no op made them)."""
    return rows.filter(integer_input() & (pl.col("status") == "diverged")).select(keys)


def discrete_first_differs(rows: pl.DataFrame) -> dict[tuple, int]:
    """(rank, source, record, leaf name) -> the first step of `rows` at which that integer or boolean tensor input
    differs between the runs: data that differ at a later step only agreed before (analysis/culprit.py
    `_discrete_data`)."""
    keys = ["rank", "source", "_record", "name"]
    first = (
        rows.lazy()
        .filter(integer_input() & (pl.col("status") == "diverged"))
        .group_by(keys)
        .agg(pl.col("step").min())
        .collect()
    )
    return {tuple(r[:4]): int(r[4]) for r in first.select(*keys, "step").iter_rows()}


def _distance(r: Mapping[str, Any], o: Mapping[str, Any], p: str) -> float | None:
    """The statistics bound of relative L2 distance of row `r`'s tensor from row `o`'s (one run's columns, by
    prefix `p`): inf where a NaN/Inf/saturation count known for `o` differs; None where no bound is known."""
    if any(o.get(f"{p}{k}") is not None and o.get(f"{p}{k}") != r.get(f"{p}{k}") for k in COUNTS):
        return float("inf")

    def arr(row: Mapping[str, Any], s: str) -> np.ndarray:
        v = row.get(f"{p}{s}")
        return np.array([np.nan if v is None else float(v)])

    a, b = {s: arr(r, s) for s in STATS}, {s: arr(o, s) for s in STATS}
    n = np.array([math.sqrt(float(r.get(f"{p}numel") or 1))])
    err, known = stats_bound(
        a, b, {s: np.isnan(a[s]) for s in STATS}, {s: np.isnan(b[s]) for s in STATS}, n, np.array([False])
    )
    return float(err[0]) if known[0] else None

"""Overflow: NaN, +-Inf and saturated (+-finfo.max, Ascend saturation mode) values, and who produced them first.

A tensor is dirty when it holds NaN, +Inf, -Inf or +-finfo(dtype).max.  With a reference run, only what the
reference does not also have at the aligned tensor counts (so the -Inf of attention masking is not overflow).
A masking op (masked_fill, where, fill, full, ...) whose fill argument is the dtype's extreme (a scalar or a
one-element tensor at +-Inf or +-finfo.max, e.g. `torch.where(mask, x, finfo.min)`) fills on purpose: its
output's extremes are a mask, not overflow, with or without a reference (`likely_mask`, reported but never the
first overflow); so is, without a reference, a -Inf-only output of a masking op.  A producer is a record whose
inputs and parameters are clean and whose output is dirty; the first overflow is the first producer in execution
order (steps in order, then dump order) per step and rank that is neither a mask fill nor **masked**.

A producer's Inf/NaN is masked when it reaches nothing that matters (`_masked`), in both runs, with and without a
reference: following its dirty outputs through the records that read them (linked by analysis/producers.py's view
rule on max and min: dtype, element count, max and min, which a view msprobe does not record keeps), every path
ends in a record whose outputs are clean and that selects or saturates (`where`, `masked_fill`, `clamp`,
`min`/`max`, `exp`/`softmax` of -Inf only, a comparison or cast with integer or boolean outputs: the Inf's value is
discarded by definition), or in an integer cast msprobe does not record (a dirty float output no recorded op reads,
while a later record reads an integer tensor of its element count that no recorded op made: T5's relative-position
buckets take log(0) = -Inf, cast to long, and a `where` picks the exact bucket there). An arithmetic op that turns
an Inf into a finite number (1 / Inf = 0, rsqrt(Inf) = 0) is not masking: the wrong finite value matters; nor is a
dirty output that nothing later reads (a loss of -Inf). Masked producers are listed (`masked`, `masked_by`), never
the first overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES, FINFO_MAX, is_float

from .compare import Comparison, compare_runs
from .load import load_run
from .order import ORDER, OUTPUT_IO, with_phase
from .producers import view_key
from .select import check_selection

_FLAGS = ("has_nan", "has_posinf", "has_neginf", "has_sat")
# ops whose clean output from a dirty input discards the Inf by definition: they select (where, masked_fill,
# masked_select; MindSpore's select) or saturate (clamp, min/max); exp and softmax map -Inf to 0 (a mask's use)
_SELECTING = frozenset(
    {
        "where",
        "masked_fill",
        "masked_fill_",
        "masked_select",
        "select",
        "clamp",
        "clamp_",
        "clamp_min",
        "clamp_min_",
        "clamp_max",
        "clamp_max_",
        "clip",
        "clip_",
        "min",
        "max",
        "minimum",
        "maximum",
        "fmin",
        "fmax",
        "amin",
        "amax",
        "nan_to_num",
        "nan_to_num_",
    }
)
_EXP_LIKE = frozenset({"exp", "exp_", "exp2", "softmax", "_softmax", "sigmoid"})
_MASK_OPS = (
    "masked_fill",
    "masked_fill_",
    "where",
    "fill",
    "fill_",
    "full",
    "full_like",
    "new_full",
    "index_fill",
    "index_fill_",
    "masked_scatter",
    "triu",
    "tril",
    "select",  # MindSpore's where
    "masked_select",
)
# the dtype's extreme, to the dumper's print precision (as records.py's saturation test)
_EXTREME = {d: v * (1 - 1e-7) for d, v in FINFO_MAX.items() if is_float(d)}


@dataclass
class OverflowReport:
    run: str
    ref: str | None
    first_overflow: dict[str, Any] | None
    producers: list[dict[str, Any]]
    tensors: pl.DataFrame

    def to_dict(self) -> dict[str, Any]:
        d = {"run": self.run, "ref": self.ref, "first_overflow": self.first_overflow, "producers": self.producers}
        d["tensors"] = self.tensors.to_dicts()
        return d


def _negative_fill() -> pl.Expr:
    """Dirty by -Inf or -finfo.max only (no NaN, no +Inf, largest value below +finfo.max): what a masking op
    fills with (`masked_fill(mask, -inf)`, a Llama-style `torch.where(mask, finfo.min, x)`), not an overflow."""
    top = pl.col("dtype").replace_strict(FINFO_MAX, default=None, return_dtype=pl.Float64)
    below_top = (pl.col("max").cast(pl.Float64, strict=False) < top).fill_null(True)
    neg_sat = pl.col("new_sat") & (pl.col("min").cast(pl.Float64, strict=False) <= -top).fill_null(False)
    return (
        (pl.col("new_neginf") | neg_sat)
        & ~pl.col("new_nan")
        & ~pl.col("new_posinf")
        & (~pl.col("new_sat") | (neg_sat & below_top))
    )


def _kind(row: dict[str, Any]) -> str:
    if row["new_nan"]:
        return "nan"
    if row["new_posinf"] or row["new_neginf"]:
        return "inf"
    return "saturated"


def overflow(
    store,
    run: str,
    *,
    ref: str | None = None,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    cmp: Comparison | None = None,
) -> OverflowReport:
    """Dirty tensors of `run` (beyond what `ref` has) and their first producers.

    `cmp`: the comparison of `run` with `ref` when the caller already has it (it is not computed again).
    """
    check_selection(store, [run, ref], steps=steps, ranks=ranks)
    if ref is None:
        rows = load_run(store, run, steps=steps, ranks=ranks, sketches=False)
        rows = rows.with_columns([pl.col(f).fill_null(False).alias(f"new_{f[4:]}") for f in _FLAGS])
    else:
        cmp = cmp or compare_runs(store, run, ref, steps=steps, ranks=ranks)
        rows = cmp.rows.filter(pl.col("name").is_not_null())
        rows = rows.with_columns(
            [(pl.col(f).fill_null(False) & ~pl.col(f"ref_{f}").fill_null(False)).alias(f"new_{f[4:]}") for f in _FLAGS]
        )
    new = pl.any_horizontal([pl.col(f"new_{f[4:]}") for f in _FLAGS])
    only_neginf = pl.col("new_neginf") & ~pl.col("new_nan") & ~pl.col("new_posinf") & ~pl.col("new_sat")
    mask_op = pl.col("op_type").is_in(list(_MASK_OPS))
    rows = _with_fill(rows).filter(pl.col("kind") == "tensor")
    extreme = pl.col("dtype").replace_strict(_EXTREME, default=None, return_dtype=pl.Float64)
    fills_extreme = pl.col("_fill").is_not_null() & (pl.col("_fill") >= extreme.fill_null(float("inf")))
    rows = rows.with_columns(
        new.alias("dirty"),
        (mask_op & ~pl.col("new_nan") & ((only_neginf & pl.lit(ref is None)) | fills_extreme | _negative_fill())).alias(
            "likely_mask"
        ),
    ).drop("_fill")
    dirty = rows.filter(pl.col("dirty"))
    producers = _producers(rows)
    first = next((p for p in producers if is_overflow(p)), None)
    cols = [
        "step",
        "rank",
        "seq",
        "record",
        "name",
        "io",
        "dtype",
        "nan_count",
        "posinf_count",
        "neginf_count",
        "sat_count",
        "new_nan",
        "new_posinf",
        "new_neginf",
        "new_sat",
        "likely_mask",
    ]
    return OverflowReport(run, ref, first, producers, dirty.select(cols).sort(["step", "rank", "seq"]))


def _with_fill(rows: pl.DataFrame) -> pl.DataFrame:
    """`_fill`: per record, the largest |value| among its non-output scalars and one-element tensors (a fill
    value such as finfo.min or -inf), null when it has none."""
    one = pl.col("kind").eq("tensor") & pl.col("numel").le(1)
    value = (
        pl.when(pl.col("kind") == "scalar")
        .then(pl.col("scalar_value").abs())
        .when(one)
        .then(pl.max_horizontal(pl.col("max").abs(), pl.col("min").abs()))
        .otherwise(None)
    )
    value = pl.when(~pl.col("io").is_in(OUTPUT_IO)).then(value).otherwise(None)
    key = ["step", "rank", "source", "seq"]
    return rows.with_columns(value.fill_nan(None).max().over(key).alias("_fill"))


def is_overflow(producer: dict[str, Any]) -> bool:
    """Whether a producer counts as an overflow: neither a mask fill nor masked downstream."""
    return not producer["likely_mask"] and not producer.get("masked")


def _producers(rows: pl.DataFrame) -> list[dict[str, Any]]:
    is_out = pl.col("io").is_in(OUTPUT_IO)
    dirty_out = pl.col("dirty") & is_out
    leaf_cols = [
        "name",
        "likely_mask",
        "new_nan",
        "new_posinf",
        "new_neginf",
        "nan_count",
        "posinf_count",
        "neginf_count",
        "sat_count",
    ]
    per = (
        with_phase(rows)
        .group_by(["step", "rank", "source", "seq", "record"], maintain_order=True)
        .agg(
            (pl.col("dirty") & ~is_out).any().alias("dirty_in"),
            dirty_out.any().alias("dirty_out"),
            pl.col("_phase").first(),
            *[pl.col(c).filter(dirty_out).first() for c in leaf_cols],
        )
        .filter(~pl.col("dirty_in") & pl.col("dirty_out"))
        .sort(ORDER + ["seq"])
    )
    graphs = _graphs(
        rows, {(p["step"], p["rank"], p["source"]) for p in per.iter_rows(named=True) if not p["likely_mask"]}
    )
    out = []
    for p in per.iter_rows(named=True):
        g = None if p["likely_mask"] else graphs.get((p["step"], p["rank"], p["source"]))
        masked_by = None if g is None else g.masked_by(p["seq"])
        out.append(
            {
                "step": p["step"],
                "rank": p["rank"],
                "op": p["record"],
                "name": p["name"],
                "kind": _kind(p),
                "likely_mask": bool(p["likely_mask"]),
                "masked": masked_by is not None,
                "masked_by": masked_by,
                "nan_count": p["nan_count"],
                "posinf_count": p["posinf_count"],
                "neginf_count": p["neginf_count"],
                "sat_count": p["sat_count"],
            }
        )
    return out


# the view rule's statistics here: a dirty tensor's mean and norm are NaN or Inf (they match nothing); an integer
# cast's reader keeps only its max and min
_LINK_STATS = ("max", "min")
_GRAPH_COLS = [
    "seq",
    "record",
    "io",
    "op_type",
    "dtype",
    "numel",
    "max",
    "min",
    "dirty",
    "new_nan",
    "new_posinf",
    "new_sat",
]


def _graphs(rows: pl.DataFrame, groups: set[tuple]) -> dict[tuple, _Graph]:
    """The `_Graph` of each (step, rank, source) in `groups`, from one pass over `rows`."""
    if not groups:
        return {}
    keys = ["step", "rank", "source"]
    want = pl.DataFrame([dict(zip(keys, g)) for g in groups], schema={k: rows.schema[k] for k in keys})
    parts = (
        rows.join(want, on=keys, how="semi", nulls_equal=True)
        .select(*keys, *_GRAPH_COLS)
        .partition_by(keys, as_dict=True, maintain_order=True)
    )
    return {at: _Graph(part) for at, part in parts.items()}


def _link(row: dict[str, Any]) -> tuple | None:
    """What a tensor is known by where msprobe does not record the op between a producer and its reader (a view,
    a reshape): analysis/producers.py's view rule on max and min (`view_key`; None where one is unknown)."""
    return view_key(row, stats=_LINK_STATS)


class _Graph:
    """One step, rank and source of a run: its dirty leaves, linked from output to later input (`_link`), for
    `masked_by`."""

    def __init__(self, here: pl.DataFrame):
        self.rows = here
        is_out = pl.col("io").is_in(OUTPUT_IO)
        dirty = here.filter(pl.col("dirty"))
        self.outs: dict[int, list[dict[str, Any]]] = {}
        for r in dirty.filter(is_out).iter_rows(named=True):
            self.outs.setdefault(r["seq"], []).append(r)
        self.readers: dict[tuple, list[int]] = {}
        for r in dirty.filter(~is_out).iter_rows(named=True):
            if (link := _link(r)) is not None:
                self.readers.setdefault(link, []).append(r["seq"])
        self.records = {
            r["seq"]: r
            for r in here.group_by("seq", maintain_order=True)
            .agg(
                pl.col("record").first(),
                pl.col("op_type").first(),
                (pl.col("dirty") & is_out).any().alias("dirty_out"),
                (is_out & ~pl.col("dtype").is_in(list(DISCRETE_DTYPES)) & pl.col("dtype").is_not_null())
                .any()
                .alias("float_out"),
                (pl.col("dirty") & ~is_out & (pl.col("new_nan") | pl.col("new_posinf") | pl.col("new_sat")))
                .any()
                .alias("not_only_neginf"),
            )
            .iter_rows(named=True)
        }
        self._ints: list[dict[str, Any]] | None = None

    def masked_by(self, seq: int) -> str | None:
        """How the producer at `seq`'s Inf/NaN is discarded on every path (the records or casts that end them),
        or None where a path goes on (a dirty output nothing recorded reads, a finite value made by arithmetic)."""
        ends: list[str] = []
        todo, seen = [seq], {seq}
        while todo:
            at = todo.pop(0)  # breadth first: the nearest ends are named first
            for out in self.outs.get(at, []):
                link = _link(out)  # (a dirty leaf has its max and min)
                readers = [s for s in (self.readers.get(link, []) if link else []) if s > at]
                if not readers:
                    cast = self._integer_cast(out)
                    if cast is None:
                        return None  # read by nothing recorded, and no integer cast of it: it goes on
                    ends.append(cast)
                for s in readers:
                    if s in seen:
                        continue
                    seen.add(s)
                    rec = self.records[s]
                    if rec["dirty_out"]:
                        todo.append(s)
                    elif self._selects(rec):
                        ends.append(rec["record"])
                    else:
                        return None  # arithmetic made a finite number of it: a wrong value that matters
        return ", ".join(dict.fromkeys(ends)) or None

    @staticmethod
    def _selects(rec: dict[str, Any]) -> bool:
        op = str(rec["op_type"] or "")
        if not rec["float_out"]:
            return True  # a comparison or a cast: integer or boolean outputs
        return op in _SELECTING or (op in _EXP_LIKE and not rec["not_only_neginf"])

    def _integer_cast(self, out: dict[str, Any]) -> str | None:
        """A later record's integer input of `out`'s element count that no recorded op made: the integer cast
        (`.long()`, `.to(torch.long)`) msprobe did not record, of `out`.  Its name, or None."""
        if self._ints is None:
            ints = self.rows.filter(pl.col("dtype").is_in(list(DISCRETE_DTYPES)) & pl.col("numel").is_not_null())
            is_out = ints["io"].is_in(list(OUTPUT_IO))
            made = {_link(r) for r in ints.filter(is_out).iter_rows(named=True)} - {None}
            self._ints = [r for r in ints.filter(~is_out).iter_rows(named=True) if _link(r) not in made]
        for r in self._ints:
            if r["seq"] > out["seq"] and r["numel"] == out["numel"]:
                return f"an integer cast msprobe does not record (read by {r['record']})"
        return None

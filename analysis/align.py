"""Align a target run with a reference run: records by name, or by counter-free sequence when counts shift.

Per step, rank and source: when both runs have the same record names, records pair by name.  Otherwise the
two record sequences are aligned on counter-free keys (`Functional.gelu.forward`), preferring equal output
shapes, so that one extra or missing API call does not shift every later call of that API; records left over
pair in order only where their output shapes can match (else they stay unmatched: an alignment choice is never
reported as a divergence).  Leaves then pair by io and index path.  What stays unmatched is reported, not dropped.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import polars as pl

from dumpstore.names import parse_record

from .align_repeats import Values, agreeing, place_by_values, tolerance_of
from .tolerance import Tolerances

GROUP = ["step", "rank", "source"]


def counter_free(key: str) -> str:
    r = parse_record(key)
    if r.direction in ("forward", "backward", "parameters_grad"):
        return f"{r.prefix}.{r.api}.{r.direction}"
    return key


def _records(rows: pl.DataFrame) -> pl.DataFrame:
    return rows.select(GROUP + ["seq", "record"]).unique(GROUP + ["seq"], keep="first", maintain_order=True)


def _signatures(rows: pl.DataFrame) -> pl.DataFrame:
    """Records of one group with the shapes of their outputs (to prefer equal shapes when aligning)."""
    squeezed = pl.col("shape").list.eval(pl.element().filter(pl.element() != 1))  # msprobe squeezes: [1, N] ~ [N]
    shape_text = pl.concat_str(pl.lit("("), squeezed.cast(pl.List(pl.String)).list.join("x"), pl.lit(")"))
    out_shape = pl.when(pl.col("io") == "output").then(shape_text).otherwise(None)  # 0-d: "()"
    fields = ("io", "index_path", "dtype", "numel", "min", "max", "mean", "norm")
    leaf = pl.struct([pl.col(f) if f in rows.columns else pl.lit(None).alias(f) for f in fields])
    return rows.group_by(GROUP + ["seq", "record"], maintain_order=True).agg(
        out_shape.drop_nulls().str.join(",").alias("sig"),
        leaf.filter(pl.col("kind") == "tensor" if "kind" in rows.columns else pl.lit(True)).alias(
            "vals"
        ),  # for repeats placed by values (align_repeats)
    )


def align_records(
    target: pl.DataFrame, ref: pl.DataFrame, tolerances: Tolerances | None = None, floor: str = "float32"
) -> pl.DataFrame:
    """Pairs (step, rank, source, t_record, r_record, how); a null side means unmatched.  `tolerances` and
    `floor` (the runs' compute precision) judge which calls of a repeat agree (analysis/align_repeats.py)."""
    tol = tolerance_of(floor, (tolerances or Tolerances()).for_dtype)
    t_rec, r_rec = _records(target), _records(ref)
    both = t_rec.join(r_rec, on=GROUP + ["record"], how="full", coalesce=True, suffix="_r")
    bad = both.filter(pl.col("seq").is_null() | pl.col("seq_r").is_null()).select(GROUP).unique()
    exact = both.join(bad, on=GROUP, how="anti").select(
        GROUP + [pl.col("record").alias("t_record"), pl.col("record").alias("r_record"), pl.lit("exact").alias("how")]
    )
    parts = [exact]
    if bad.height:
        t_bad = _signatures(target.join(bad, on=GROUP, how="semi"))
        r_bad = _signatures(ref.join(bad, on=GROUP, how="semi"))
    for key in bad.iter_rows(named=True):
        t = t_bad.filter(*[pl.col(c) == key[c] for c in GROUP])
        r = r_bad.filter(*[pl.col(c) == key[c] for c in GROUP])
        parts.append(_sequence_pairs(key, t, r, tol))
    types: dict[str, Any] = {c: exact.schema[c] for c in GROUP}
    schema = pl.Schema({**types, "t_record": pl.String, "r_record": pl.String, "how": pl.String})
    if not parts:
        return pl.DataFrame(schema=schema)
    return pl.concat([p.cast(schema) for p in parts], how="vertical")


def _sequence_pairs(
    key: dict, t: pl.DataFrame, r: pl.DataFrame, tol: Callable[[str | None, str | None], float]
) -> pl.DataFrame:
    tk, rk = t["record"].to_list(), r["record"].to_list()
    ts = [f"{counter_free(k)}|{s}" for k, s in zip(tk, t["sig"].to_list())]
    rs = [f"{counter_free(k)}|{s}" for k, s in zip(rk, r["sig"].to_list())]
    pairs: list[tuple[str | None, str | None, str]] = []
    used_t, used_r = set(), set()
    blocks = difflib.SequenceMatcher(None, ts, rs, autojunk=False).get_matching_blocks()
    matched = [(a + i, b + i) for a, b, size in blocks for i in range(size)]
    values = (_LeafValues(t["vals"]), _LeafValues(r["vals"]))
    for i, j in place_by_values(matched, (ts, rs), lambda i, j: agreeing(values[0][i], values[1][j], tol)):
        pairs.append((tk[i], rk[j], "exact" if tk[i] == rk[j] else "sequence"))
        used_t.add(i)
        used_r.add(j)
    tsig, rsig = t["sig"].to_list(), r["sig"].to_list()
    left_t: dict[str, list[int]] = {counter_free(tk[i]): [] for i in range(len(tk)) if i not in used_t}
    for i in range(len(tk)):
        if i not in used_t:
            left_t[counter_free(tk[i])].append(i)
    # same API out of order: pair leftovers in order of appearance, by their own name (msprobe's exact match: a
    # shape change is then a finding) or where the output shapes can match; a pairing chosen here must never
    # become a divergence ([5, 2] against [] under different names is two unmatched calls)
    for j in range(len(rk)):
        if j in used_r:
            continue
        cand = left_t.get(counter_free(rk[j]), [])
        hit = next((i for i in cand if tk[i] == rk[j] or _shapes_can_match(tsig[i], rsig[j])), None)
        if hit is not None:
            cand.remove(hit)
            pairs.append((tk[hit], rk[j], "sequence"))
            used_t.add(hit)
            used_r.add(j)
    pairs += [(tk[i], None, "target_only") for i in range(len(tk)) if i not in used_t]
    pairs += [(None, rk[j], "ref_only") for j in range(len(rk)) if j not in used_r]
    return pl.DataFrame(
        {
            **{c: [key[c]] * len(pairs) for c in GROUP},
            "t_record": [p[0] for p in pairs],
            "r_record": [p[1] for p in pairs],
            "how": [p[2] for p in pairs],
        }
    )


class _LeafValues:
    """Each record's tensor leaves by (io, index_path), built on first use (only repeats are scored)."""

    def __init__(self, column: pl.Series):
        self.column = column
        self.done: dict[int, Values] = {}

    def __getitem__(self, i: int) -> Values:
        if i not in self.done:
            self.done[i] = {
                (v["io"], v["index_path"]): (v["dtype"], v["numel"], v["min"], v["max"], v["mean"], v["norm"])
                for v in self.column[i]
            }
        return self.done[i]


def _shapes_can_match(a: str | None, b: str | None) -> bool:
    """Output shape signatures (squeezed) that do not contradict each other: equal, or one side has none."""
    return not a or not b or a == b


def align_leaves(target: pl.DataFrame, ref: pl.DataFrame, records: pl.DataFrame) -> pl.DataFrame:
    """Leaf pairs: target columns as-is, reference columns prefixed `ref_`; unmatched leaves keep one side null."""
    in_place = _pairs_in_place(target, ref, records)
    if in_place is not None:
        return in_place
    matched = records.filter(pl.col("t_record").is_not_null() & pl.col("r_record").is_not_null())
    t = target.join(
        matched.select(GROUP + ["t_record", "r_record", "how"]),
        left_on=GROUP + ["record"],
        right_on=GROUP + ["t_record"],
        how="left",
    )
    r = ref.rename({c: f"ref_{c}" for c in ref.columns if c not in GROUP})
    keys_t = GROUP + ["r_record", "io", "index_path"]
    keys_r = GROUP + ["ref_record", "ref_io", "ref_index_path"]
    pairs = t.join(r, left_on=keys_t, right_on=keys_r, how="full", coalesce=False, suffix="_x")
    for c in GROUP:
        pairs = pairs.with_columns(pl.coalesce(pl.col(c), pl.col(f"{c}_x")).alias(c)).drop(f"{c}_x")
    return _with_match(pairs)


def _with_match(pairs: pl.DataFrame) -> pl.DataFrame:
    return pairs.with_columns(
        pl.when(pl.col("name").is_null())
        .then(pl.lit("ref_only"))
        .when(pl.col("ref_name").is_null())
        .then(pl.lit("target_only"))
        .otherwise(pl.col("how"))
        .alias("match")
    )


def _pairs_in_place(target: pl.DataFrame, ref: pl.DataFrame, records: pl.DataFrame) -> pl.DataFrame | None:
    """align_leaves' result where both runs have the same records and leaves, row for row (the common case): the
    two runs side by side, without the two joins (which copy every column of these wide frames); None otherwise."""
    keys = GROUP + ["record", "io", "index_path"]
    if target.height != ref.height or not records.height or not (records["how"] == "exact").all():
        return None
    if not target.select(keys).equals(ref.select(keys)):
        return None
    if target.select(pl.struct(keys).is_duplicated().any()).item():
        return None  # a leaf twice: the join pairs every copy with every copy
    t = target.with_columns(pl.col("record").alias("r_record"), pl.lit("exact").alias("how"))
    r = ref.rename({c: f"ref_{c}" for c in ref.columns if c not in GROUP}).drop(GROUP)
    return _with_match(pl.concat([t, r], how="horizontal"))


def apply_data_mapping(pairs: pl.DataFrame, data: dict[str, str]) -> pl.DataFrame:
    """Pair leaves left unmatched by name through a row-name mapping (target row -> reference row)."""
    if not data:
        return pairs
    t_only = pairs.filter((pl.col("match") == "target_only") & pl.col("name").is_in(list(data)))
    r_only = pairs.filter((pl.col("match") == "ref_only") & pl.col("ref_name").is_in(list(data.values())))
    if t_only.height == 0 or r_only.height == 0:
        return pairs
    t_cols = [c for c in pairs.columns if not c.startswith("ref_") and c not in GROUP + ["match", "how", "r_record"]]
    r_cols = [c for c in pairs.columns if c.startswith("ref_")]
    left = t_only.select(GROUP + t_cols).with_columns(pl.col("name").replace_strict(data, default=None).alias("_to"))
    right = r_only.select(GROUP + r_cols)
    joined = left.join(right, left_on=GROUP + ["_to"], right_on=GROUP + ["ref_name"], how="inner")
    joined = joined.with_columns(
        pl.col("_to").alias("ref_name"),
        pl.lit("mapped").alias("match"),
        pl.lit("mapped").alias("how"),
        pl.col("ref_record").alias("r_record"),
    ).drop("_to")
    done_t = joined.select(GROUP + ["name"])
    done_r = joined.select(GROUP + ["ref_name"])
    rest = pairs.join(done_t, on=GROUP + ["name"], how="anti", nulls_equal=False).join(
        done_r, on=GROUP + ["ref_name"], how="anti", nulls_equal=False
    )
    return pl.concat([rest, joined.select(pairs.columns)], how="vertical_relaxed")

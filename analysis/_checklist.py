"""The first questions of a precision hunt, answered from the dumps: an ordered checklist of verdicts.

Each check is `pass`, `differs` or `unknown`, with its evidence (the first differing tensor or value and
where):

  data        the model's first inputs at each step: the tensor inputs that need no grad and that no earlier
              op produced, of the first forward record (token ids into the embedding), plus integer inputs of
              that kind anywhere in the forward pass (labels).  Identical when every statistic both runs have
              (and the checksum, and the sketch in tensor mode) is equal; statistics from different sources
              (recomputed from tensor files vs the dumper's) are equal within a relative 1e-5.  Integer
              tensors carry only max/min in msprobe statistics mode, so when those agree but the consuming
              record's output differs while its other inputs are identical, the data differ (inferred).
  weights     the parameters at the first common step: module `parameters` leaves; in dumps without
              module records (level L1), the weight/bias inputs of the first calls instead (requires_grad,
              produced by no earlier recorded op; an activation from an op msprobe skips, such as split,
              can look alike).
              Identical, or which ones differ and by how much (relative L2, labelled by its source).
  structure   records in one run only, per step; tensor arguments in one run only; shape and dtype differences
              of aligned tensors (dtype differences explained by the runs' compute precision are left to
              `precision`).
  scalars     non-tensor arguments of aligned records that differ or exist in one run only (eps, alpha, p...),
              grouped by op and argument, each with its count and first occurrence.
  precision   the compute precision of each run (the lowest float dtype of >= 10 % of the forward
              outputs); when they differ (bf16 autocast vs fp32) it is said once, with the number of
              tensors whose dtype differs by design.
  coverage    the steps and ranks of each run (only the common ones are compared).

Size: six checks over one pair of loaded runs, each a few short functions; they share its frames and helpers
(the first forward record, the aligned pairs), which a split would pass between modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from dumpstore.dtypes import INT_DTYPES
from dumpstore.names import strip_call
from dumpstore.store import Store

from .compare import Comparison, compare_runs
from .defaults import default_keywords, frameworks
from .order import OUTPUT_IO
from .tolerance import Tolerances

STATS = ("min", "max", "mean", "norm")
KEYS = ("step", "rank", "source")
CHECKS = ("data", "weights", "structure", "scalars", "precision", "coverage")
TITLES = {
    "data": "data (first inputs per step)",
    "weights": "initial weights",
    "structure": "structure (ops, shapes, dtypes)",
    "scalars": "scalar arguments",
    "precision": "mixed precision",
    "coverage": "steps and ranks",
}
MAX_ITEMS = 50
MIXED_SOURCE_RTOL = 1e-5  # float64 statistics from tensor files vs the dumper's float32 ones: rounding only
_SIDE_COLS = (
    "seq",
    "leaf",
    "record",
    "api",
    "op_type",
    "module",
    "direction",
    "io",
    "index_path",
    "name",
    "kind",
    "dtype",
    "shape",
    "requires_grad",
    "min",
    "max",
    "mean",
    "norm",
)


@dataclass
class Check:
    """One line of the checklist: its verdict, the evidence in words, the first difference, the details."""

    key: str
    title: str
    status: str  # pass / differs / unknown
    evidence: str
    first: dict[str, Any] | None = None
    items: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Checklist:
    """The six checks in order; `to_dict()` gives one key per check."""

    target: str
    ref: str
    checks: list[Check]

    def __getitem__(self, key: str) -> Check:
        return next(c for c in self.checks if c.key == key)

    def to_dict(self) -> dict[str, Any]:
        return {c.key: asdict(c) for c in self.checks}


def checklist(
    store: Store,
    target: str,
    ref: str,
    *,
    tolerances: Tolerances | None = None,
    cmp: Comparison | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Checklist:
    """Answer the six checks for `target` against `ref` (pass `cmp` to reuse an existing comparison).
    `progress(stage, done, total)` is called as the comparison and each check start, and at the end."""
    tell = progress or (lambda stage, done, total: None)
    tell("compare", 0, 7)
    cmp = cmp or compare_runs(store, target, ref, tolerances=tolerances)
    rows = cmp.rows.with_row_index("_i")
    sides = {p: _side(rows, p) for p in ("", "ref_")}
    inputs = {p: _unproduced_inputs(s) for p, s in sides.items()}
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("data", lambda: _data(rows, inputs)),
        ("weights", lambda: _weights(rows, sides, inputs)),
        ("structure", lambda: _structure(cmp)),
        ("scalars", lambda: _scalars(cmp)),
        ("precision", lambda: _precision(cmp)),
        ("coverage", lambda: _coverage(cmp)),
    ]
    checks = []
    for i, (name, check) in enumerate(steps, 1):
        tell(name, i, 7)
        checks.append(check())
    tell("done", 7, 7)
    if not cmp.coverage["common_steps"] or not cmp.coverage["common_ranks"]:
        for c in checks[:-1]:
            c.status, c.evidence = "unknown", "no common step and rank to compare"
    return Checklist(target, ref, checks)


# -- shared helpers ---------------------------------------------------------------------------------------


def _side(rows: pl.DataFrame, p: str) -> pl.DataFrame:
    """One run's leaves with unprefixed column names, keeping the pair index `_i`."""
    cols = [pl.col(f"{p}{c}").alias(c) for c in _SIDE_COLS]
    return rows.select([pl.col("_i"), *KEYS, *cols]).filter(pl.col("name").is_not_null())


def _nan_safe(v: Any) -> Any:
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def _fingerprint(r: dict[str, Any]) -> tuple | None:
    stats = tuple(_nan_safe(r[s]) for s in STATS)
    if all(v is None for v in stats):
        return None
    return (r["step"], r["rank"], r["source"], r["dtype"], tuple(r["shape"] or ())) + stats


def _unproduced_inputs(side: pl.DataFrame) -> pl.DataFrame:
    """Forward tensor inputs no earlier record of the same step, rank and source output (first of each).

    A leaf's fingerprint is its step, rank, source, dtype, shape and statistics (NaN equal to NaN, -0.0 to 0.0);
    none when it has no statistic.  An input is kept when it has none, or when it is the first input of its
    fingerprint (execution order) and no output of that fingerprint comes before it."""
    fp_cols = ["step", "rank", "source", "dtype", "_shape"]
    prints = [
        pl.col("shape").list.eval(pl.element().cast(pl.String)).list.join(",").fill_null("").alias("_shape"),
        pl.any_horizontal([pl.col(s).is_not_null() for s in STATS]).alias("_has_fp"),
    ]
    for s in STATS:
        v = pl.col(s).cast(pl.Float64)
        prints += [(v.fill_nan(None) + 0.0).alias(f"_v_{s}"), v.is_nan().fill_null(False).alias(f"_nan_{s}")]
        fp_cols += [f"_v_{s}", f"_nan_{s}"]
    outs = side.filter(pl.col("io").is_in(OUTPUT_IO) & (pl.col("kind") == "tensor")).with_columns(prints)
    first_out = (
        outs.filter(pl.col("_has_fp") & pl.col("seq").is_not_null())
        .group_by(fp_cols)
        .agg(pl.col("seq").min().alias("_first_out"))
    )
    ins = side.filter(
        (pl.col("direction") == "forward")
        & (pl.col("io") == "input")
        & (pl.col("kind") == "tensor")
        & (pl.col("module").fill_null("") != "optimizer")
    )
    ins = ins.sort([*KEYS, "seq", "leaf"])
    marked = ins.with_columns(prints).with_columns(pl.struct(fp_cols).is_first_distinct().alias("_first"))
    marked = marked.join(first_out, on=fp_cols, how="left", nulls_equal=True, maintain_order="left")
    produced = (pl.col("_first_out") < pl.col("seq")).fill_null(False)
    keep = ~pl.col("_has_fp") | (pl.col("_first") & ~produced)
    return ins.filter(marked.select(keep.alias("keep"))["keep"])


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _pair_diff(r: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
    """Exact identity of an aligned tensor pair from what both runs have: (differs or None, why)."""
    if r["name"] is None or r["ref_name"] is None:
        return True, {"only_in": "reference" if r["name"] is None else "target"}
    diffs: dict[str, Any] = {}
    compared: list[str] = []
    rtol = MIXED_SOURCE_RTOL if r.get("stats_source") != r.get("ref_stats_source") else 0.0
    for s in STATS:
        a, b = r[s], r[f"ref_{s}"]
        if a is not None and b is not None:
            compared.append(s)
            if not (_same(a, b) or (rtol and math.isclose(a, b, rel_tol=rtol))):
                diffs[s] = [a, b]
    if r.get("checksum") is not None and r.get("ref_checksum") is not None:
        compared.append("checksum")
        if r["checksum"] != r["ref_checksum"]:
            diffs["checksum"] = [r["checksum"], r["ref_checksum"]]
    if r.get("err_source") == "sketch":
        compared.append("sketch")
        if r["err"]:
            diffs["sketch_rel_l2"] = r["err"]
    for s in ("dtype", "shape"):
        if r[s] != r[f"ref_{s}"]:
            diffs[s] = [r[s], r[f"ref_{s}"]]
    if not compared and not diffs:
        return None, {}
    return bool(diffs), {"compared": compared, "diffs": diffs}


def _where(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": r["step"],
        "rank": r["rank"],
        "op": r["record"] or r["ref_record"],
        "name": r["name"] or r["ref_name"],
    }


def _diff_text(why: dict[str, Any]) -> str:
    if "only_in" in why:
        return f"only in the {why['only_in']}"
    parts = []
    for k, v in why["diffs"].items():
        parts.append(f"{k} {_num(v[0])} vs {_num(v[1])}" if isinstance(v, list) else f"{k} {_num(v)}")
    return ", ".join(parts)


def _num(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _by_index(rows: pl.DataFrame, idx: list[int]) -> list[dict[str, Any]]:
    return rows.filter(pl.col("_i").is_in(idx)).sort("_i").to_dicts() if idx else []


# -- data --------------------------------------------------------------------------------------------------


def _data_leaves(inputs: pl.DataFrame) -> dict[tuple, tuple[str | None, list[int]]]:
    """Per (step, rank, source): the first forward record with data inputs, the data leaves' pair indices."""
    data = inputs.filter(pl.col("requires_grad").fill_null(False).not_())
    out: dict[tuple, tuple[str | None, list[int]]] = {}
    for key, g in data.group_by(list(KEYS), maintain_order=True):
        g = g.sort(["seq", "leaf"])
        first = g.row(0, named=True)["record"]
        pick = g.filter((pl.col("record") == first) | pl.col("dtype").is_in(list(INT_DTYPES)))
        out[tuple(key)] = (first, pick["_i"].to_list())
    return out


def _data(rows: pl.DataFrame, inputs: dict[str, pl.DataFrame]) -> Check:
    per = {}
    for p in ("ref_", ""):  # target's view wins where both have the group
        per.update(_data_leaves(inputs[p]))
    items = [_data_group(rows, key, rec, idx) for key, (rec, idx) in sorted(per.items())]
    bad = [it for it in items if it["status"] == "differs"]
    if bad:
        first = bad[0]["first"]
        ev = (
            f"step {first['step']} rank {first['rank']}  {first['name']}: {first['why']}"
            f"{' (inferred)' if bad[0].get('inferred') else ''}; {len(bad)} of {len(items)} step/rank(s) "
            "differ"
        )
        counts = {"differs": len(bad), "checked": len(items)}
        return Check("data", TITLES["data"], "differs", ev, first, items, counts)
    if not items or any(it["status"] == "unknown" for it in items):
        return Check(
            "data",
            TITLES["data"],
            "unknown",
            "no data inputs with statistics found"
            if not items
            else "some steps have no comparable statistics for their data inputs",
            None,
            items,
            {"checked": len(items)},
        )
    names = sorted({n for it in items for n in it["leaves"]})
    compared = sorted({c for it in items for c in it["compared"]})
    steps = sorted({it["step"] for it in items})
    ev = f"identical at steps {steps}: {', '.join(names)} (compared: {', '.join(compared)})"
    return Check("data", TITLES["data"], "pass", ev, None, items, {"checked": len(items)})


def _data_group(rows: pl.DataFrame, key: tuple, record: str | None, idx: list[int]) -> dict[str, Any]:
    pairs = _by_index(rows, idx)
    item: dict[str, Any] = {
        "step": key[0],
        "rank": key[1],
        "source": key[2],
        "record": record,
        "leaves": [r["name"] or r["ref_name"] for r in pairs],
        "compared": [],
    }
    verdicts = [(r, *_pair_diff(r)) for r in pairs]
    for r, differs, why in verdicts:
        item["compared"] = sorted(set(item["compared"]) | set(why.get("compared", [])))
        if differs:
            first = {**_where(r), "why": _diff_text(why), "diffs": why.get("diffs")}
            item.update(status="differs", first=first)
            return item
    if any(d is None for _, d, _ in verdicts) or not verdicts:
        item["status"] = "unknown"
        return item
    inferred = _inferred(rows, key, record, set(idx))
    if inferred is not None:
        r, out_row, why = inferred
        item.update(
            status="differs",
            inferred=True,
            first={
                **_where(r),
                "why": f"statistics equal ({', '.join(item['compared'])}), but "
                f"{out_row['name']} differs ({why}) while the other inputs are identical",
            },
        )
        return item
    item["status"] = "pass"
    return item


def _inferred(rows: pl.DataFrame, key: tuple, record: str | None, data_idx: set[int]):
    """Data equal by their (weak) statistics, yet the consuming record's output differs, weights identical."""
    rec = rows.filter(
        (pl.col("step") == key[0])
        & (pl.col("rank") == key[1])
        & (pl.col("source") == key[2])
        & (pl.coalesce(pl.col("record"), pl.col("ref_record")) == record)
    )
    if rec.height == 0:
        return None
    out = [r for r in rec.filter(pl.col("io") == "output").to_dicts() if r["kind"] == "tensor"]
    others = [
        r
        for r in rec.filter(pl.col("io").is_in(["input", "parameters"])).to_dicts()
        if r["kind"] == "tensor" and r["_i"] not in data_idx
    ]
    if any(_pair_diff(r)[0] is not False for r in others):
        return None
    for r in out:
        differs, why = _pair_diff(r)
        if differs:
            first_data = rows.filter(pl.col("_i") == min(data_idx)).row(0, named=True)
            return first_data, r, _diff_text(why)
    return None


# -- weights -----------------------------------------------------------------------------------------------


def _module_path(api: str | None, op_type: str | None) -> str:
    if api and op_type and api.endswith("." + op_type):
        return api[: -len(op_type) - 1]
    return api or ""


def _weight_leaves(side: pl.DataFrame, inputs: pl.DataFrame, step: int) -> dict[int, str]:
    """Pair index -> parameter name at `step`: module parameters, else (L1) the unproduced grad inputs."""
    params = side.filter((pl.col("step") == step) & (pl.col("io") == "parameters") & (pl.col("kind") == "tensor"))
    out: dict[int, str] = {}
    seen_names: set[tuple] = set()
    seen_fp: set[tuple | None] = set()
    for r in params.sort(["rank", "source", "seq", "leaf"]).iter_rows(named=True):
        pname = f"{_module_path(r['api'], r['op_type'])}.{r['index_path']}"
        if (r["rank"], r["source"], pname) in seen_names:
            continue
        seen_names.add((r["rank"], r["source"], pname))
        seen_fp.add(_fingerprint(r))
        out[r["_i"]] = pname
    if out:
        return out  # module records hold the parameters; unrecorded ops (split) make inputs look unproduced
    grads = inputs.filter((pl.col("step") == step) & pl.col("requires_grad").fill_null(False))
    for r in grads.iter_rows(named=True):
        fp = _fingerprint(r)
        if fp is None or fp not in seen_fp:
            out[r["_i"]] = r["name"]
            seen_fp.add(fp)
    return out


def _weights(rows: pl.DataFrame, sides: dict[str, pl.DataFrame], inputs: dict[str, pl.DataFrame]) -> Check:
    steps = rows["step"].drop_nulls()
    if steps.len() == 0:
        return Check("weights", TITLES["weights"], "unknown", "no parameters found")
    step = int(steps.min())  # type: ignore[arg-type]
    names: dict[int, str] = {}
    for p in ("ref_", ""):
        names.update(_weight_leaves(sides[p], inputs[p], step))
    pairs = _by_index(rows, sorted(names))
    items, unknown = [], 0
    for r in pairs:
        differs, why = _pair_diff(r)
        if differs is None:
            unknown += 1
        elif differs:
            items.append(
                {
                    **_where(r),
                    "param": names[r["_i"]],
                    "why": _diff_text(why),
                    "rel_l2": r.get("err"),
                    "err_source": r.get("err_source"),
                    "norm_ratio": r.get("norm_ratio"),
                }
            )
    counts = {"parameters": len(pairs), "differ": len(items), "unknown": unknown}
    if items:
        f = items[0]
        listed = ", ".join(f"{it['param']} ({_rel(it)})" for it in items[:5])
        ev = f"{len(items)} of {len(pairs)} parameters differ at step {step}: {listed}"
        return Check("weights", TITLES["weights"], "differs", ev, f, items[:MAX_ITEMS], counts)
    if not pairs or unknown:
        ev = f"{unknown} of {len(pairs)} parameters have no statistics" if pairs else "no parameters found"
        return Check("weights", TITLES["weights"], "unknown", ev, None, [], counts)
    return Check(
        "weights", TITLES["weights"], "pass", f"{len(pairs)} parameters identical at step {step}", None, [], counts
    )


def _rel(it: dict[str, Any]) -> str:
    """How much a parameter differs: relative L2, a lower bound when it comes from the statistics."""
    if it["rel_l2"] is None:
        return it["why"]
    bound = ">= " if it["err_source"] == "stats" else ""
    return f"rel_l2 {bound}{it['rel_l2']:.3g}, {it['err_source']}"


# -- structure, scalars, precision, coverage --------------------------------------------------------------


def _by_design(cmp: Comparison) -> pl.Expr:
    p = cmp.precision
    if p["target"] == p["ref"]:
        return pl.lit(False)
    return (pl.col("dtype") == p["target"]) & (pl.col("ref_dtype") == p["ref"])


def _matched_tensors(cmp: Comparison) -> pl.DataFrame:
    return cmp.rows.filter((pl.col("kind") == "tensor") & (pl.col("ref_kind") == "tensor"))


def _one_run_leaves(cmp: Comparison, kinds: tuple[str, ...]) -> pl.DataFrame:
    """Leaves of records present in both runs that exist in one run only (an extra or missing argument)."""
    paired = cmp.records.filter(pl.col("t_record").is_not_null() & pl.col("r_record").is_not_null())
    t_only = cmp.rows.filter(
        pl.col("ref_name").is_null() & pl.col("r_record").is_not_null() & pl.col("kind").is_in(list(kinds))
    )
    r_only = cmp.rows.filter(pl.col("name").is_null() & pl.col("ref_kind").is_in(list(kinds))).join(
        paired.select([*KEYS, pl.col("r_record").alias("ref_record")]), on=[*KEYS, "ref_record"], how="semi"
    )
    return pl.concat([t_only, r_only], how="vertical")


def _structure(cmp: Comparison) -> Check:
    un = cmp.records.filter(pl.col("how").is_in(["target_only", "ref_only"]))
    un = un.sort([*KEYS], maintain_order=True)
    t = _matched_tensors(cmp)
    shapes = t.filter(pl.col("shape") != pl.col("ref_shape"))
    dtypes = t.filter((pl.col("dtype") != pl.col("ref_dtype")) & ~_by_design(cmp))
    extra_args = _one_run_leaves(cmp, ("tensor",))
    counts = {
        "target_only_records": int((un["how"] == "target_only").sum()),
        "ref_only_records": int((un["how"] == "ref_only").sum()),
        "renumbered_records": int((cmp.records["how"] == "sequence").sum()),
        "shape_differences": shapes.height,
        "dtype_differences": dtypes.height,
        "tensor_args_in_one_run": extra_args.height,
    }
    items = [
        {
            "step": r["step"],
            "rank": r["rank"],
            "op": r["t_record"] or r["r_record"],
            "only_in": "target" if r["how"] == "target_only" else "reference",
        }
        for r in un.head(MAX_ITEMS).to_dicts()
    ]
    for df, what in ((shapes, "shape"), (dtypes, "dtype")):
        items += [{**_where(r), what: [r[what], r[f"ref_{what}"]]} for r in df.head(MAX_ITEMS).to_dicts()]
    items += [
        {**_where(r), "only_in": "target" if r["name"] else "reference"} for r in extra_args.head(MAX_ITEMS).to_dicts()
    ]
    differing = {k: v for k, v in counts.items() if v and k != "renumbered_records"}
    if not differing:
        n = cmp.records.height
        return Check(
            "structure",
            TITLES["structure"],
            "pass",
            f"same {n} records (per step and rank), shapes and dtypes",
            None,
            [],
            counts,
        )
    first = items[0]
    ev = (
        f"{counts['target_only_records']} records only in the target, {counts['ref_only_records']} only in "
        f"the reference; {counts['shape_differences']} shape and {counts['dtype_differences']} dtype "
        f"differences; {counts['tensor_args_in_one_run']} tensor arguments in one run only; first: "
        f"step {first['step']} rank {first['rank']} {first.get('name') or first['op']} "
        f"{_struct_what(first)}"
    )
    return Check("structure", TITLES["structure"], "differs", ev, first, items, counts)


def _struct_what(it: dict[str, Any]) -> str:
    if "only_in" in it:
        return f"(only in the {it['only_in']})"
    k = "shape" if "shape" in it else "dtype"
    return f"({k} {it[k][0]} vs {it[k][1]})"


def _scalar_rows(cmp: Comparison) -> tuple[pl.DataFrame, int]:
    values = ["scalar", "null"]
    both = cmp.rows.filter(
        pl.col("kind").is_in(values)
        & pl.col("ref_kind").is_in(values)
        & ((pl.col("kind") == "scalar") | (pl.col("ref_kind") == "scalar"))
    )
    differ = both.filter(pl.col("value").fill_null("") != pl.col("ref_value").fill_null(""))
    both_nan = (pl.col("scalar_value").is_nan() & pl.col("ref_scalar_value").is_nan()).fill_null(False)
    differ = differ.filter(~both_nan)
    one = _one_run_leaves(cmp, ("scalar",))
    one = one.filter(~default_keywords(one, frameworks(cmp.rows)))  # a keyword left at the API's default
    return pl.concat([differ, one.select(differ.columns)], how="vertical"), both.height + one.height


def _scalars(cmp: Comparison) -> Check:
    rows, n = _scalar_rows(cmp)
    groups: dict[tuple, dict[str, Any]] = {}
    order = [*KEYS, pl.coalesce(pl.col("seq"), pl.col("ref_seq")), "leaf"]
    for r in rows.sort(order, nulls_last=True).to_dicts():
        rec = r["record"] or r["ref_record"]
        arg = f"{r['io'] or r['ref_io']}.{r['index_path'] or r['ref_index_path']}"
        value, ref_value = _scalar_value(r, ""), _scalar_value(r, "ref_")
        key = (strip_call(rec), arg, value, ref_value)
        g = groups.setdefault(
            key,
            {"op": strip_call(rec), "arg": arg, "value": value, "ref_value": ref_value, "count": 0, "first": _where(r)},
        )
        g["count"] += 1
    items = list(groups.values())
    counts = {"scalar_arguments": n, "differ": rows.height, "distinct": len(items)}
    if not items:
        status = "pass" if n else "unknown"
        ev = f"{n} scalar arguments identical" if n else "no scalar arguments in the aligned records"
        return Check("scalars", TITLES["scalars"], status, ev, None, [], counts)
    listed = "; ".join(
        f"{g['op']} {g['arg']}: {g['value']} vs {g['ref_value']} ({g['count']} calls, first "
        f"step {g['first']['step']} rank {g['first']['rank']} {g['first']['op']})"
        for g in items[:5]
    )
    first = {**items[0]["first"], "value": items[0]["value"], "ref_value": items[0]["ref_value"]}
    return Check("scalars", TITLES["scalars"], "differs", listed, first, items[:MAX_ITEMS], counts)


def _scalar_value(r: dict[str, Any], p: str) -> str:
    if r[f"{p}name"] is None:
        return "(absent)"
    return "None" if r[f"{p}kind"] == "null" else str(r[f"{p}value"])


def _precision(cmp: Comparison) -> Check:
    p = cmp.precision
    by_design = _matched_tensors(cmp).filter((pl.col("dtype") != pl.col("ref_dtype")) & _by_design(cmp))
    counts = {"dtype_differences_by_design": by_design.height}
    if p["target"] == p["ref"]:
        ev = f"both runs compute in {p['target']}"
        return Check("precision", TITLES["precision"], "pass", ev, None, [], counts)
    first = _where(by_design.row(0, named=True)) if by_design.height else None
    where = f" (first: step {first['step']} rank {first['rank']} {first['name']})" if first else ""
    ev = (
        f"the target computes in {p['target']} and the reference in {p['ref']} (mixed precision by design, "
        f"e.g. autocast): {by_design.height} tensors differ in dtype {p['target']} vs {p['ref']}{where}; "
        f"values are judged at the {p['floor']} tolerance"
    )
    return Check("precision", TITLES["precision"], "differs", ev, first, [dict(p)], counts)


def _coverage(cmp: Comparison) -> Check:
    c = cmp.coverage
    counts = {"common_steps": len(c["common_steps"]), "common_ranks": len(c["common_ranks"])}
    extra = []
    for what in ("steps", "ranks"):
        for side, label in (("target", "target"), ("ref", "reference")):
            only = sorted(set(c[f"{side}_{what}"]) - set(c[f"common_{what}"]))
            if only:
                extra.append({"only_in": label, what: only})
    if not extra:
        ev = f"steps {c['common_steps']} and ranks {c['common_ranks']} in both runs"
        return Check("coverage", TITLES["coverage"], "pass", ev, None, [], counts)
    parts = [f"{k} only in the {e['only_in']}: {e[k]}" for e in extra for k in ("steps", "ranks") if k in e]
    ev = "; ".join(parts) + f" (compared: steps {c['common_steps']}, ranks {c['common_ranks']})"
    return Check("coverage", TITLES["coverage"], "differs", ev, extra[0], extra, counts)

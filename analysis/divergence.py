"""First divergence and culprit, per step and rank and across steps, from a Comparison.

First divergence: the first record in execution order (steps in order, then dump order; see
analysis/order.py) with a diverged output.  Culprit: walking diverged records in that
order, the first that *introduces* error:
  scalar     a non-tensor argument differs (eps, alpha, p, ...);
  op         its outputs diverge while its tensor inputs agree, or its error amplification
             (output err / max(input err, dtype eps)) is at least `Tolerances.amplification`;
  parameter  a diverged input that no earlier op of either run produced and that requires grad (a weight);
  input      the same for data (requires_grad false: token ids, images, masks);
  missing_op / extra_op
             a diverged input produced by a record that exists in one run only.
The first divergence is the first *target* record that differs: a diverged output, or an op the reference
does not have (extra_op); an op missing from the target has no place in its order and is named as culprit.
When no value diverges but records exist in one run only, the first of them is the culprit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import polars as pl

from dumpstore.dtypes import eps

from .compare import Comparison
from .order import INPUT_IO, ORDER, OUTPUT_IO, with_phase
from .tolerance import Tolerances

QUIET = 0.1  # inputs "agree" when their error is below this share of the tolerance


@dataclass
class Finding:
    step: int
    rank: int
    op: str
    name: str | None
    kind: str
    metric: str | None = None
    value: float | None = None
    threshold: float | None = None
    source: str | None = None
    dtype: str | None = None
    severity: float | None = None
    detail: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verdict:
    target: str
    ref: str
    first_divergence: Finding | None
    culprit: Finding | None
    steps: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    unmatched: list[dict[str, Any]]
    precision: dict[str, str]
    counts: dict[str, int]
    coverage: dict[str, list[int]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ordered(rows: pl.DataFrame) -> pl.DataFrame:
    rows = rows.with_columns(
        pl.coalesce(pl.col("seq"), pl.col("ref_seq")).alias("_seq"),
        pl.coalesce(pl.col("direction"), pl.col("ref_direction")).alias("_direction"),
        pl.coalesce(pl.col("record"), pl.col("ref_record")).alias("_record"),
        pl.coalesce(pl.col("io"), pl.col("ref_io")).alias("_io"))
    return with_phase(rows, "_seq", "_direction").sort(ORDER + ["_seq", "leaf"], nulls_last=True)


def _record_table(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per record pair with its worst output and input error."""
    is_out = pl.col("_io").is_in(OUTPUT_IO)
    is_in = pl.col("_io").is_in(INPUT_IO)
    div = pl.col("status") == "diverged"
    keys = ["step", "rank", "source", "_record"]
    return (rows.group_by(keys, maintain_order=True).agg(
        pl.col("_phase").first(), pl.col("_seq").first(),
        (div & is_out).any().alias("out_div"), (div & is_in).any().alias("in_div"),
        pl.col("err").filter(is_out & (pl.col("kind") == "tensor")).max().alias("out_err"),
        pl.col("err").filter(is_in & (pl.col("kind") == "tensor")).max().alias("in_err"),
        pl.col("match").first(),
    ).sort(["step", "_phase", "rank", "source", "_seq"]))


def divergence(cmp: Comparison) -> Verdict:
    rows = _ordered(cmp.rows)
    recs = _record_table(rows)
    unmatched = _unmatched(cmp.records)
    first = _first_divergence(rows)
    culprit = _culprit(rows, recs, cmp) if recs["out_div"].any() else None
    first, culprit = _settle(first, culprit, unmatched)
    counts = {s: int(n) for s, n in rows.group_by("status").len().iter_rows() if s is not None}
    return Verdict(cmp.target, cmp.ref, first, culprit, _timeline(rows), _rank_view(rows), unmatched,
                   cmp.precision, counts, cmp.coverage)


def _settle(first: Finding | None, culprit: Finding | None, unmatched: list[dict[str, Any]]
            ) -> tuple[Finding | None, Finding | None]:
    """An extra op that is the first divergence is its own culprit when no diverged op is; without any
    divergence, the first record in one run only is both."""
    if culprit is None and first is not None and first.kind == "extra_op":
        culprit = replace(first, evidence={})
    if first is None and unmatched:
        u = unmatched[0]
        first = Finding(u["step"], u["rank"], u["op"], None, u["kind"], detail=f"record only in the {u['side']}")
        culprit = replace(first)
    return first, culprit


def _finding(row: dict[str, Any], kind: str | None = None) -> Finding:
    return Finding(step=row["step"], rank=row["rank"], op=row["_record"], name=row.get("name") or row.get("ref_name"),
                   kind=kind or _row_kind(row), metric="rel_l2", value=row["err"], threshold=row["tol"],
                   source=row["err_source"], dtype=row["tol_dtype"], severity=row["severity"], detail=row["detail"])


def _row_kind(row: dict[str, Any]) -> str:
    if row.get("nonfinite_mismatch"):
        return "nonfinite"
    if row["err_source"] == "checksum":
        return "checksum"
    if row["kind"] == "scalar":
        return "scalar"
    if row.get("detail", "") and str(row.get("detail")).startswith("shape"):
        return "shape"
    return "value"


def _first_divergence(rows: pl.DataFrame) -> Finding | None:
    """The first target record that differs: a diverged output, or a record the reference does not have."""
    hit = rows.filter(((pl.col("status") == "diverged") & pl.col("_io").is_in(OUTPUT_IO))
                      | ((pl.col("match") == "target_only") & pl.col("how").is_null())).head(1)
    if not hit.height:
        return None
    row = hit.row(0, named=True)
    if row["match"] == "target_only":
        return Finding(row["step"], row["rank"], row["_record"], None, "extra_op",
                       detail="record only in the target")
    return _finding(row)


_FP_STATS = ("min", "max", "mean", "norm")


def _fingerprint(prefix: str) -> pl.Expr:
    """Hash of (dtype, shape, step, rank, source, statistics) of one side's tensor; null without statistics."""
    cols = [pl.col(f"{prefix}dtype"), pl.col(f"{prefix}shape"), pl.col("step"), pl.col("rank"), pl.col("source")]
    cols += [pl.col(f"{prefix}{s}") for s in _FP_STATS]
    known = pl.any_horizontal([pl.col(f"{prefix}{s}").is_not_null() for s in _FP_STATS])
    return pl.when(known).then(pl.struct(cols).hash()).alias(f"_fp_{prefix or 't'}")


class _Producers:
    """Which record of one run first produced a tensor, by fingerprint (dtype, shape, statistics)."""

    def __init__(self, rows: pl.DataFrame, prefix: str):
        self.prefix = prefix
        col = f"_fp_{prefix or 't'}"
        outs = (rows.filter(pl.col(f"{prefix}io").is_in(OUTPUT_IO) & (pl.col(f"{prefix}kind") == "tensor")
                            & pl.col(col).is_not_null())
                .sort(f"{prefix}seq").group_by(col, maintain_order=True)
                .agg(pl.col(f"{prefix}seq").first(), pl.col(f"{prefix}record").first()))
        self.first = dict(zip(outs[col].to_list(), zip(outs[f"{prefix}seq"].to_list(),
                                                      outs[f"{prefix}record"].to_list())))

    def producer(self, r: dict[str, Any]) -> str | None:
        hit = self.first.get(r.get(f"_fp_{self.prefix or 't'}"))
        seq = r.get(f"{self.prefix}seq")
        if hit is None or seq is None or hit[0] >= seq:
            return None
        return hit[1]


def _culprit(rows: pl.DataFrame, recs: pl.DataFrame, cmp: Comparison, batch: int = 64) -> Finding | None:
    first_step = recs.filter(pl.col("out_div"))["step"].min()
    step_rows = rows.filter(pl.col("step") == first_step).with_columns(_fingerprint(""), _fingerprint("ref_"))
    t_prod, r_prod = _Producers(step_rows, ""), _Producers(step_rows, "ref_")
    only = {(r["step"], r["rank"], r["source"], r["t_record"] or r["r_record"]): r["how"]
            for r in cmp.records.filter(pl.col("how").is_in(["target_only", "ref_only"])).iter_rows(named=True)}
    keys = ["rank", "source", "_record"]
    candidates = recs.filter(pl.col("out_div") & (pl.col("step") == first_step))
    for start in range(0, candidates.height, batch):
        chunk = candidates.slice(start, batch)
        leaves = step_rows.join(chunk.select(keys), on=keys, how="semi")
        by_rec = leaves.partition_by(keys, as_dict=True, maintain_order=True)
        for rec in chunk.iter_rows(named=True):
            found = _judge(rec, by_rec[(rec["rank"], rec["source"], rec["_record"])], t_prod, r_prod, only, cmp)
            if found is not None:
                return found
    return None


def _judge(rec: dict, leaves: pl.DataFrame, t_prod: _Producers, r_prod: _Producers, only: dict,
           cmp: Comparison) -> Finding | None:
    out = leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("status") == "diverged")).row(0, named=True)
    bad_in = leaves.filter(pl.col("_io").is_in(INPUT_IO) & (pl.col("status") == "diverged"))
    scalars = bad_in.filter(pl.col("kind") == "scalar")
    if scalars.height:
        s = scalars.row(0, named=True)
        return _with_evidence(_finding(out, "scalar"), scalar=s["name"], detail=s["detail"])
    tensors = bad_in.filter(pl.col("kind") == "tensor")
    if tensors.height == 0 and (rec["in_err"] or 0.0) <= QUIET * out["tol"]:
        one_sided = leaves.filter(pl.col("_io").is_in(INPUT_IO) & pl.col("match").is_in(["target_only", "ref_only"]))
        args = [f"{r['name'] or r['ref_name']} ({'target' if r['match'] == 'target_only' else 'reference'} only"
                f": {r['value'] if r['match'] == 'target_only' else r['ref_value']})"
                for r in one_sided.iter_rows(named=True)]
        return _with_evidence(_finding(out, "op"), input_err=rec["in_err"], reason="inputs agree, output diverges",
                              arguments_in_one_run=args or None)
    for leaf in tensors.iter_rows(named=True):
        tp, rp = t_prod.producer(leaf), r_prod.producer(leaf)
        key = (leaf["step"], leaf["rank"], leaf["source"])
        if rp and only.get(key + (rp,)) == "ref_only":
            return Finding(leaf["step"], leaf["rank"], _forward_of(rp, key, only, "ref_only"), None, "missing_op",
                           detail=f"only in the reference; its output feeds {leaf['name']}")
        if tp and only.get(key + (tp,)) == "target_only":
            return Finding(leaf["step"], leaf["rank"], _forward_of(tp, key, only, "target_only"), None, "extra_op",
                           detail=f"only in the target; its output feeds {leaf['name']}")
        if tp is None and rp is None:
            kind = "parameter" if leaf.get("requires_grad") or leaf["_io"] == "parameters" else "input"
            return _with_evidence(_finding(out, kind), differing=leaf["name"], input_err=leaf["err"],
                                  detail=f"{leaf['name']} differs and no earlier op produced it")
    floor = eps(out["tol_dtype"] or "float32")
    amp = (rec["out_err"] or 0.0) / max(rec["in_err"] or 0.0, floor)
    if amp >= cmp.tolerances.amplification:
        return _with_evidence(_finding(out, "op"), input_err=rec["in_err"], amplification=amp,
                              reason="error amplification stands out")
    return None


def _forward_of(record: str, key: tuple, only: dict, side: str) -> str:
    """An unmatched backward record is blamed on its forward record when that is unmatched too."""
    if record.endswith(".backward"):
        fwd = record[: -len(".backward")] + ".forward"
        if only.get(key + (fwd,)) == side:
            return fwd
    return record


def _with_evidence(f: Finding, detail: str | None = None, **evidence: Any) -> Finding:
    f.evidence.update({k: v for k, v in evidence.items() if v is not None})
    if detail:
        f.detail = detail
    return f


def _unmatched(records: pl.DataFrame) -> list[dict[str, Any]]:
    un = records.filter(pl.col("how").is_in(["target_only", "ref_only"])).sort(["step", "rank", "source"],
                                                                              maintain_order=True)
    out = []
    for r in un.iter_rows(named=True):
        side = "target" if r["how"] == "target_only" else "reference"
        out.append({"step": r["step"], "rank": r["rank"], "source": r["source"], "op": r["t_record"] or r["r_record"],
                    "side": side, "kind": "extra_op" if side == "target" else "missing_op"})
    return out


def _timeline(rows: pl.DataFrame) -> list[dict[str, Any]]:
    out = []
    for (step,), g in rows.group_by(["step"], maintain_order=True):
        fd = _first_divergence(g)
        out.append({"step": step, "compared": int((g["status"].is_in(["pass", "diverged"])).sum()),
                    "diverged": int((g["status"] == "diverged").sum()),
                    "unmatched": int((g["status"] == "unmatched").sum()),
                    "max_err": _finite_max(g), "first_divergence": fd.op if fd else None})
    return sorted(out, key=lambda s: s["step"])


def _finite_max(g: pl.DataFrame) -> float | None:
    v = g.filter(pl.col("err").is_not_null())["err"].max()
    return float(v) if v is not None else None


def _rank_view(rows: pl.DataFrame) -> list[dict[str, Any]]:
    out = []
    for (rank,), g in rows.group_by(["rank"], maintain_order=True):
        fd = _first_divergence(g)
        out.append({"rank": rank, "diverged": int((g["status"] == "diverged").sum()),
                    "max_err": _finite_max(g), "first_divergence": fd.op if fd else None,
                    "first_step": fd.step if fd else None})
    return _peers(out)


def _peers(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rank disagrees with its peers when it diverges while most ranks do not."""
    out.sort(key=lambda r: r["rank"])
    clean = [r for r in out if r["diverged"] == 0]
    for r in out:
        r["disagrees_with_peers"] = bool(r["diverged"]) and len(clean) * 2 >= len(out) and len(out) > 1
    return out


MAX_ROWS_IN_MEMORY = 250_000  # leaf rows per run compared at once by divergence_by_steps (~1 GB)


def divergence_by_steps(store, target: str, ref: str, *, steps: list[int] | None = None,
                        max_rows: int = MAX_ROWS_IN_MEMORY, screener: Any = None, **compare_options: Any) -> Verdict:
    """`divergence(compare_runs(...))` for runs of any size: memory is bounded by a batch, not by the runs.

    Runs of at most `max_rows` rows are compared in one piece.  For larger ones the screen (analysis/screen.py)
    judges every unit whose records pair by position in one fast pass; what it
    cannot pair (units needing alignment) and the units where the first diverged output lies are compared
    exactly, in batches of whole steps of at most `max_rows` rows per run, and give the first divergence, the
    culprit and the unmatched records.  The timeline, rank view and counts merge both.  Options the screen does
    not serve (`exact`, name mappings, runs with different sketch sizes) compare every step exactly, in batches.
    """
    from .screen import Unsupported

    t_info, r_info = store.run_info(target), store.run_info(ref)
    # `screener`: screen.screen's stand-in (analysis/distributed.py screens on a cluster); it always screens
    if screener is None and max(t_info["n_rows"], r_info["n_rows"]) <= max_rows:  # one batch: nothing to screen
        return divergence_in_batches(store, target, ref, steps=steps, max_rows=max_rows, **compare_options)
    try:
        return _screened(store, target, ref, steps=steps, max_rows=max_rows, screener=screener, **compare_options)
    except Unsupported:
        return divergence_in_batches(store, target, ref, steps=steps, max_rows=max_rows, **compare_options)


def divergence_in_batches(store, target: str, ref: str, *, steps: list[int] | None = None,
                          max_rows: int = MAX_ROWS_IN_MEMORY, **compare_options: Any) -> Verdict:
    """`divergence(compare_runs(...))` over batches of steps, every step compared exactly (the slow way).

    The verdict is the same: steps are compared in order, the first divergence and culprit come from the first
    batch that has one, and the timeline, rank view, unmatched ops and counts are merged.
    """
    from .compare import compare_runs

    t_info, r_info = store.run_info(target), store.run_info(ref)
    common = sorted(set(t_info["steps"]) & set(r_info["steps"]) & (set(steps) if steps is not None else set(
        t_info["steps"])))
    per_step = max(t_info["n_rows"], r_info["n_rows"]) / max(len(t_info["steps"]), 1)
    size = max(1, int(max_rows // max(per_step, 1)))
    parts = [divergence(compare_runs(store, target, ref, steps=common[i:i + size], **compare_options))
             for i in range(0, len(common), size)] or [divergence(compare_runs(store, target, ref, steps=[],
                                                                               **compare_options))]
    return _merge(parts)


def _screened(store, target: str, ref: str, *, steps: list[int] | None, max_rows: int,
              ranks: list[int] | None = None, tolerances: Tolerances | None = None, exact: bool = False,
              mapping: Any = None, screener: Any = None) -> Verdict:
    from .compare import _coverage, builtin_mindspore_names, compare_runs
    from .screen import Unsupported, screen

    t_info, r_info = store.run_info(target), store.run_info(ref)
    if exact or mapping or builtin_mindspore_names(t_info, r_info):
        raise Unsupported("exact metrics or name mappings")
    tol = tolerances or Tolerances()
    coverage = _coverage(t_info, r_info)
    steps_c = [s for s in coverage["common_steps"] if steps is None or s in steps]
    ranks_c = [k for k in coverage["common_ranks"] if ranks is None or k in ranks]
    scr = (screener or screen)(store, target, ref, steps_c, ranks_c, tol)
    units = scr.units
    # exactly: units needing alignment, and the units of the first step with a diverged output of the screen
    hit = units.filter(pl.col("first_seq").is_not_null())
    exact_units = set(scr.complex_units)
    if hit.height:
        first_step = hit["step"].min()
        exact_units |= set(hit.filter(pl.col("step") == first_step).select("step", "rank").iter_rows())
    per_unit = max(t_info["n_rows"], r_info["n_rows"]) / max(len(t_info["steps"]) * len(t_info["ranks"]), 1)
    batches: list[list[tuple[int, int]]] = []
    for step in sorted({s for s, _ in exact_units}):
        these = sorted(u for u in exact_units if u[0] == step)
        if batches and (len(batches[-1]) + len(these)) * per_unit <= max_rows:
            batches[-1] += these
        else:
            batches.append(these)
    first: Finding | None = None
    culprit: Finding | None = None
    culprit_done = False
    unmatched: list[dict[str, Any]] = []
    summaries = []
    for batch in batches:
        cmp = compare_runs(store, target, ref, steps=steps_c, ranks=ranks_c, tolerances=tol, units=batch,
                           precision=scr.precision)
        rows = _ordered(cmp.rows)
        recs = _record_table(rows)
        if first is None:
            first = _first_divergence(rows)
        if not culprit_done and recs["out_div"].any():  # the first step with a diverged output is in this batch
            culprit, culprit_done = _culprit(rows, recs, cmp), True
        unmatched += _unmatched(cmp.records)
        summaries.append(_unit_summaries(rows))
    first, culprit = _settle(first, culprit, unmatched)
    if exact_units:
        done = pl.DataFrame(sorted(exact_units), schema={"step": pl.Int64, "rank": pl.Int64}, orient="row")
        units = units.join(done, on=["step", "rank"], how="anti")
    allu = pl.concat([units] + [u.cast(units.schema) for u in summaries], how="vertical")  # type: ignore[arg-type]
    allu = allu.filter(pl.col("rows") > 0)
    counts = {s: int(allu[s].sum()) for s in STATUSES if allu[s].sum()}
    return Verdict(target, ref, first, culprit, _timeline_of_units(allu), _rank_view_of_units(allu), unmatched,
                   scr.precision, counts, coverage)


STATUSES = ("pass", "diverged", "unmatched", "error", "unknown")


def _unit_summaries(rows: pl.DataFrame) -> pl.DataFrame:
    """Per (step, rank, source) of ordered rows: rows, counts by status, largest err, first differing record
    (as `_first_divergence` picks it) with its phase, seq and leaf; the screen's `units` columns."""
    cand = (((pl.col("status") == "diverged") & pl.col("_io").is_in(OUTPUT_IO))
            | ((pl.col("match") == "target_only") & pl.col("how").is_null()))
    return rows.group_by(["step", "rank", "source"], maintain_order=True).agg(
        pl.len().alias("rows"), *[(pl.col("status") == s).sum().alias(s) for s in STATUSES],
        pl.col("err").max().alias("max_err"),
        pl.col("_phase").filter(cand).first().alias("first_phase"),
        pl.col("_seq").filter(cand).first().alias("first_seq"),
        pl.col("leaf").filter(cand).first().alias("first_leaf"),
        pl.col("_record").filter(cand).first().alias("first_record"))


def _timeline_of_units(units: pl.DataFrame) -> list[dict[str, Any]]:
    """`_timeline` from unit summaries."""
    first = (units.filter(pl.col("first_seq").is_not_null())
             .sort(["step", "first_phase", "rank", "source", "first_seq", "first_leaf"])
             .group_by("step", maintain_order=True).agg(pl.col("first_record").first()))
    ops = dict(first.iter_rows())
    agg = units.group_by("step").agg(pl.col("pass").sum(), pl.col("diverged").sum(), pl.col("unmatched").sum(),
                                     pl.col("max_err").max()).sort("step")
    return [{"step": r["step"], "compared": int(r["pass"] + r["diverged"]), "diverged": int(r["diverged"]),
             "unmatched": int(r["unmatched"]), "max_err": None if r["max_err"] is None else float(r["max_err"]),
             "first_divergence": ops.get(r["step"])} for r in agg.iter_rows(named=True)]


def _rank_view_of_units(units: pl.DataFrame) -> list[dict[str, Any]]:
    """`_rank_view` from unit summaries."""
    first = (units.filter(pl.col("first_seq").is_not_null())
             .sort(["rank", "step", "first_phase", "source", "first_seq", "first_leaf"])
             .group_by("rank", maintain_order=True).agg(pl.col("first_record").first(), pl.col("step").first()))
    firsts = {r: (op, step) for r, op, step in first.iter_rows()}
    agg = units.group_by("rank").agg(pl.col("diverged").sum(), pl.col("max_err").max())
    out = []
    for r in agg.iter_rows(named=True):
        op, step = firsts.get(r["rank"], (None, None))
        out.append({"rank": r["rank"], "diverged": int(r["diverged"]),
                    "max_err": None if r["max_err"] is None else float(r["max_err"]),
                    "first_divergence": op, "first_step": step})
    return _peers(out)


def _merge(parts: list[Verdict]) -> Verdict:
    if len(parts) == 1:
        return parts[0]
    first = next((p for p in parts if p.first_divergence is not None), None)
    counts: dict[str, int] = {}
    for p in parts:
        for k, n in p.counts.items():
            counts[k] = counts.get(k, 0) + n
    ranks: dict[int, dict[str, Any]] = {}
    for p in parts:
        for r in p.ranks:
            cur = ranks.setdefault(r["rank"], {"rank": r["rank"], "diverged": 0, "max_err": None,
                                               "first_divergence": None, "first_step": None})
            cur["diverged"] += r["diverged"]
            if r["max_err"] is not None and (cur["max_err"] is None or r["max_err"] > cur["max_err"]):
                cur["max_err"] = r["max_err"]
            if cur["first_divergence"] is None and r["first_divergence"] is not None:
                cur["first_divergence"], cur["first_step"] = r["first_divergence"], r["first_step"]
    floors = [p.precision for p in parts]
    precision = max(floors, key=lambda f: eps(f["floor"]))
    base = first or parts[0]
    return Verdict(base.target, base.ref, base.first_divergence, base.culprit,
                   [s for p in parts for s in p.steps], _peers(list(ranks.values())),
                   [u for p in parts for u in p.unmatched], precision, counts, base.coverage)

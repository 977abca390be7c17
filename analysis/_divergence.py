"""First divergence and culprit, per step and rank and across steps, from a Comparison.

Walking records in execution order (steps in order, then dump order; see analysis/order.py), the culprit is
the first finding that stands out of the pair's own noise (analysis/noise.py; the judge is analysis/culprit.py,
the method and its constants docs/how-it-decides.md):
  scalar     a non-tensor argument differs (a value beyond the record's tolerance, or a keyword present in one
             run only: eps, alpha, approximate, p, ...), even when the outputs agree within noise;
  optimizer  the parameters differ at this step because the runs moved them by different amounts, beyond the
             update ratios' own spread across parameters (learning rate), or most of them otherwise than their
             gradients explain (clipping; analysis/steps.py);
  op         its outputs diverge while its tensor inputs agree, by more than the pair's fresh ops and its
             siblings (the same op class at other positions) do; or its error amplification (output err /
             max(carried input err, dtype eps)) is at least `Tolerances.amplification` and beyond the pair's own
             spread of amplifications and its siblings' own error; an op within 4 tolerances yields to any
             stronger later finding;
  parameter  a diverged weight that no earlier op of either run produced, at the first compared step; later
             (parameters carry the optimizer's noise) only when it changed between the steps beyond what its
             update explains and beyond its siblings (analysis/steps.py), at its first consumer;
  input      the same for other tensors (data; a gradient reached through unrecorded ops), beyond the error
             the pair carries at that point;
  missing_op / extra_op
             a diverged input produced by a record that exists in one run only.
Discrete outputs (indices, masks) that flip where the values agree within noise are near ties: noise.
The first divergence is where the culprit shows in the target's order (its first diverged output, or the
differing argument), or an earlier op the reference does not have (extra_op).  Outputs over their tolerance
that stand out of nothing are the pair's noise: the verdict says the runs agree within it, and how large it is.
When no value diverges but records exist in one run only, the first of them is the culprit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import polars as pl

from dumpstore.dtypes import eps

from . import rules as R
from .compare import Comparison
from .culprit import _culprit
from .defaults import default_keywords, framework_of
from .dtype_change import applies as dtype_applies
from .dtype_change import dtype_columns
from .extra_chain import chain_head
from .findings import Finding, Verdict
from .flipflow import mark_possible_flips
from .hidden_index import hidden_index_columns
from .lone_precision import with_lone
from .noise import NoiseModel, gain_columns, order_key, parameter_error, record_measures, saves_result
from .order import INPUT_IO, ORDER, OUTPUT_IO, sort_rows, with_phase
from .rules import STATUSES
from .sibling_prior import reach_columns
from .signature import signature_column
from .tolerance import Tolerances


def _ordered(rows: pl.DataFrame, records: pl.DataFrame | None = None) -> pl.DataFrame:
    """Rows in execution order with the target's names: a leaf only in the reference of a record pair joins its
    target record (`records`: the record pairs) and `_paired` says the record exists in both runs."""
    if records is not None and rows["record"].null_count():  # leaves only in the reference: their target record
        pairs = records.filter(pl.col("t_record").is_not_null() & pl.col("r_record").is_not_null()).select(
            "step", "rank", "source", pl.col("r_record").alias("ref_record"), pl.col("t_record").alias("_t_record")
        )
        rows = rows.join(pairs, on=["step", "rank", "source", "ref_record"], how="left", nulls_equal=True)
    else:
        rows = rows.with_columns(pl.lit(None, pl.String).alias("_t_record"))
    rows = rows.with_columns(
        pl.coalesce(pl.col("seq"), pl.col("ref_seq")).alias("_seq"),
        pl.coalesce(pl.col("direction"), pl.col("ref_direction")).alias("_direction"),
        pl.coalesce(pl.col("record"), pl.col("_t_record"), pl.col("ref_record")).alias("_record"),
        (pl.col("how").is_not_null() | pl.col("_t_record").is_not_null()).alias("_paired"),
        pl.coalesce(pl.col("io"), pl.col("ref_io")).alias("_io"),
    ).drop("_t_record")
    return sort_rows(with_phase(rows, "_seq", "_direction"), ORDER + ["_seq", "leaf"], nulls_last=True)


_DEVICE = r"^(cpu|cuda|npu|xpu|mps|meta|hpu)(:\d+)?$"


def _record_table(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per record pair: its worst output and input error, tolerance, amplification and whether a
    non-tensor argument differs (beyond the record's tolerance; device names aside) or is in one run only, in
    two calls of the same API."""
    is_out = pl.col("_io").is_in(OUTPUT_IO)
    is_in = pl.col("_io").is_in(INPUT_IO)
    div = pl.col("status") == "diverged"
    tensor = pl.col("kind") == "tensor"
    scalar_arg = (
        is_in
        & (pl.col("kind") == "scalar")
        & (pl.col("ref_kind") == "scalar")
        & ~(
            pl.col("value").str.contains(_DEVICE).fill_null(False)
            & pl.col("ref_value").str.contains(_DEVICE).fill_null(False)
        )
    )
    one_sided = (
        is_in
        & pl.col("match").is_in(["target_only", "ref_only"])
        & pl.col("_paired")
        & (pl.coalesce(pl.col("kind"), pl.col("ref_kind")).is_in(["scalar", "null"]))
        & ~pl.col("_kw_default")  # a keyword one run leaves at the API's default (analysis/defaults.py)
    )
    rows = rows.with_columns(default_keywords(rows))
    keys = ["step", "rank", "source", "_record"]
    recs = (
        rows.group_by(keys, maintain_order=True)
        .agg(
            pl.col("_phase").first(),
            pl.col("_seq").first(),
            pl.col("_direction").first(),
            (div & is_out).any().alias("out_div"),
            (div & is_in).any().alias("in_div"),
            pl.col("err").filter(is_out & tensor).max().alias("out_err"),
            pl.col("err").filter(is_in & tensor).max().alias("in_err"),
            _norm_of_worst(is_in & tensor).alias("in_norm"),
            (pl.col("err_source") == "stats").filter(is_in & tensor).any().alias("in_bound"),
            pl.concat_str([pl.col("prefix"), pl.col("op_type")], separator=".").drop_nulls().first().alias("op_class"),
            _norm_of_worst(is_out & tensor, judged="judged_norm" in rows.columns).alias("out_norm"),
            pl.col("tol").filter(is_out & tensor).max().alias("tol"),
            pl.col("tol_dtype").filter(is_out & tensor).first().alias("tol_dtype"),
            pl.col("err").filter(scalar_arg).max().alias("arg_err"),
            one_sided.any().alias("arg_one_sided"),
            signature_column(),  # a tensor argument given in one run only (analysis/signature.py)
            ((pl.col("api") == pl.col("ref_api")) & (pl.col("prefix") == pl.col("ref_prefix")))
            .fill_null(False)
            .any()
            .alias("same_call"),
            pl.col("match").first(),
            pl.col("module").drop_nulls().first().alias("_module"),  # its enclosing module record (msprobe's)
            *hidden_index_columns(is_in, is_out, tensor),
            *reach_columns(is_in, tensor),
            parameter_error(tensor),  # the error of the parameters it lists (noise.record_measures)
            *gain_columns(is_in, is_out, tensor, rows.columns),  # an elementwise backward's gain (noise.py)
            *dtype_columns(),
        )
        .sort(["step", "_phase", "rank", "source", "_seq"])
    )
    arg_tol = pl.max_horizontal(pl.col("tol").fill_null(0.0), pl.lit(R.VALUE_RTOL))
    # arguments compare only between calls of the same API (a mapped MindSpore/PyTorch pair has other signatures)
    recs = recs.with_columns(
        (
            ((pl.col("arg_err") > arg_tol).fill_null(False) | pl.col("arg_one_sided") | pl.col("sig_diff"))
            & pl.col("same_call")
        ).alias("arg_diff")
    )
    return record_measures(_with_saved_inputs(recs))


def _with_saved_inputs(recs: pl.DataFrame) -> pl.DataFrame:
    """A backward record computes from what its forward record saved (the forward inputs: layer_norm's input
    and weight, linear's activation), which its own record does not list: its input error is at least its
    forward record's."""
    keys = ["step", "rank", "source"]
    # an op whose derivative is a function of its result (exp, tanh, rsqrt, softmax: noise.SAVES_RESULT) saves its
    # output too: its forward's output error counts as well
    saved = pl.max_horizontal("in_err", pl.when(saves_result(pl.col("op_class"))).then(pl.col("out_err")))
    fwd = recs.filter(pl.col("_record").str.ends_with(".forward")).select(
        *keys,
        pl.col("_record").str.replace(r"\.forward$", ".backward").alias("_record"),
        saved.alias("_fwd_in_err"),
    )
    if not fwd.height:
        return recs
    out = recs.join(fwd, on=keys + ["_record"], how="left", nulls_equal=True, maintain_order="left")
    bwd = pl.col("_fwd_in_err").is_not_null() & pl.col("_record").str.ends_with(".backward")
    return out.with_columns(
        pl.when(bwd).then(pl.max_horizontal("in_err", "_fwd_in_err")).otherwise(pl.col("in_err")).alias("in_err"),
        # what it saved, on its own: what a module enclosing it reads without listing it (noise.record_measures)
        pl.when(bwd).then(pl.col("_fwd_in_err")).alias("saved_err"),
    ).drop("_fwd_in_err")


def _norm_of_worst(where: pl.Expr, judged: bool = False) -> pl.Expr:
    """The reference norm of the leaf with the largest error among `where` (in a group_by); with `judged`, the
    norm its error is relative to where the small-value rule judged it on its terms' scale (`judged_norm`,
    rules.apply_small_values)."""
    norm = pl.col("ref_norm").cast(pl.Float64)
    if judged:
        norm = pl.coalesce(pl.col("judged_norm").cast(pl.Float64), norm)
    return norm.filter(where).sort_by(pl.col("err").filter(where)).last()


def divergence(cmp: Comparison) -> Verdict:
    return _verdict_of(_ordered(cmp.rows, cmp.records), cmp)


def _verdict_of(rows: pl.DataFrame, cmp: Comparison, judged_from: int | None = None) -> Verdict:
    """The verdict of a comparison whose rows are in execution order (`_ordered`); steps before `judged_from`
    are context, not judged (analysis/culprit.py `_culprit`)."""
    recs = _record_table(rows)
    if not dtype_applies(cmp.precision, _cross_framework(rows)):
        recs = recs.with_columns(pl.lit(False).alias("dtype_diff"))
    recs = with_lone(recs, rows)  # one call computed at a lower precision than its siblings (lone_precision.py)
    noise = NoiseModel.fit(recs)
    mark_possible_flips(noise, rows, recs)  # discrete outputs whose flip the statistics cannot show
    unmatched = _unmatched(cmp.records)
    found, shown = _culprit(rows, recs, cmp, noise, judged_from=judged_from)
    found = chain_head(found, rows, cmp.records)  # an extra op fed by another: the first (analysis/extra_chain.py)
    # across frameworks (MindSpore vs PyTorch), records of one framework only are expected structure: listed as
    # unmatched, named only as the producer of a diverged input (missing_op / extra_op culprits)
    cross = _cross_framework(rows)
    extra = None if cross else _extra_op(rows)
    first, culprit = _settle(_earliest(extra, shown), found, [] if cross else unmatched)
    counts = {s: int(n) for s, n in rows.group_by("status", maintain_order=True).len().iter_rows() if s is not None}
    quiet = first is None and culprit is None
    units = _unit_summaries(rows)
    return Verdict(
        cmp.target,
        cmp.ref,
        first,
        culprit,
        _timeline(units),
        _rank_view(units),
        unmatched,
        cmp.precision,
        counts,
        cmp.coverage,
        noise.summary(recs) if quiet else {},
    )


def _cross_framework(rows: pl.DataFrame) -> bool:
    """Whether the target and the reference come from different frameworks (their tensor leaves' types)."""
    if "value_type" not in rows.columns or "ref_value_type" not in rows.columns:
        return False
    fw = framework_of(rows["value_type"]), framework_of(rows["ref_value_type"])
    return None not in fw and fw[0] != fw[1]


def _earliest(*found: tuple[Finding, tuple] | None) -> tuple[Finding, tuple] | None:
    """The finding earliest in execution order (each with its order key: step, phase, rank, source, seq)."""
    hits = [f for f in found if f is not None]
    return min(hits, key=lambda f: f[1]) if hits else None


def _public(f: tuple[Finding, tuple] | Finding | None) -> Finding | None:
    return f[0] if isinstance(f, tuple) else f


def _settle(
    first: tuple[Finding, tuple] | None, culprit: tuple[Finding, tuple] | None, unmatched: list[dict[str, Any]]
) -> tuple[Finding | None, Finding | None]:
    """An extra op that is the first divergence is its own culprit when no diverged op is; without any
    divergence, the first record in one run only is both."""
    f, c = _public(first), _public(culprit)
    if c is None and f is not None and f.kind == "extra_op":
        c = replace(f, evidence={})
    if f is None and c is None and unmatched:
        u = unmatched[0]
        f = Finding(u["step"], u["rank"], u["op"], None, u["kind"], detail=f"record only in the {u['side']}")
        c = replace(f)
    return f, c


def _extra_op(rows: pl.DataFrame) -> tuple[Finding, tuple] | None:
    """The first record the reference does not have, in the target's order."""
    row = _first_row(rows, (pl.col("match") == "target_only") & pl.col("how").is_null())
    if row is None:
        return None
    return Finding(
        row["step"], row["rank"], row["_record"], None, "extra_op", detail="record only in the target"
    ), order_key(row)


def _first_row(rows: pl.DataFrame, where: pl.Expr) -> dict[str, Any] | None:
    """The first row where `where` holds (rows.filter copies every column of every hit: these frames are wide)."""
    at = rows.select(where.arg_true().first()).item()
    return None if at is None else rows.row(at, named=True)


def _unmatched(records: pl.DataFrame) -> list[dict[str, Any]]:
    un = records.filter(pl.col("how").is_in(["target_only", "ref_only"])).sort(
        ["step", "rank", "source"], maintain_order=True
    )
    out = []
    for r in un.iter_rows(named=True):
        side = "target" if r["how"] == "target_only" else "reference"
        out.append(
            {
                "step": r["step"],
                "rank": r["rank"],
                "source": r["source"],
                "op": r["t_record"] or r["r_record"],
                "side": side,
                "kind": "extra_op" if side == "target" else "missing_op",
            }
        )
    return out


def _peers(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rank disagrees with its peers when it diverges while most ranks do not."""
    out.sort(key=lambda r: r["rank"])
    clean = [r for r in out if r["diverged"] == 0]
    for r in out:
        r["disagrees_with_peers"] = bool(r["diverged"]) and len(clean) * 2 >= len(out) and len(out) > 1
    return out


MAX_ROWS_IN_MEMORY = 250_000  # leaf rows per run compared at once by divergence_by_steps (~1 GB)


def divergence_by_steps(
    store,
    target: str,
    ref: str,
    *,
    steps: list[int] | None = None,
    max_rows: int = MAX_ROWS_IN_MEMORY,
    screener: Any = None,
    **compare_options: Any,
) -> Verdict:
    """`divergence(compare_runs(...))` for runs of any size: memory is bounded by a batch, not by the runs.

    Runs of at most `max_rows` rows are compared in one piece.  For larger ones the screen (analysis/screen.py)
    judges every unit whose records pair by position in one fast pass; what it
    cannot pair (units needing alignment) and the units where the first diverged output lies are compared
    exactly, in batches of whole steps of at most `max_rows` rows per run, and give the first divergence, the
    culprit and the unmatched records.  The timeline, rank view and counts merge both.  Options the screen does
    not serve (`exact`, name mappings, runs with different sketch sizes) compare every step exactly, in batches.
    """
    from .screen import Unsupported
    from .select import check_selection

    check_selection(store, [target, ref], steps=steps, ranks=compare_options.get("ranks"))
    t_info, r_info = store.run_info(target), store.run_info(ref)
    # `screener`: screen.screen's stand-in (analysis/distributed.py screens on a cluster); it always screens
    if screener is None and max(t_info["n_rows"], r_info["n_rows"]) <= max_rows:  # one batch: nothing to screen
        return divergence_in_batches(store, target, ref, steps=steps, max_rows=max_rows, **compare_options)
    try:
        return _screened(store, target, ref, steps=steps, max_rows=max_rows, screener=screener, **compare_options)
    except Unsupported:
        return divergence_in_batches(store, target, ref, steps=steps, max_rows=max_rows, **compare_options)


def divergence_in_batches(
    store,
    target: str,
    ref: str,
    *,
    steps: list[int] | None = None,
    max_rows: int = MAX_ROWS_IN_MEMORY,
    **compare_options: Any,
) -> Verdict:
    """`divergence(compare_runs(...))` over batches of steps, every step compared exactly (the slow way).

    The verdict is the same: steps are compared in order, the first divergence and culprit come from the first
    batch that has one, and the timeline, rank view, unmatched ops and counts are merged.
    """
    from .compare import compare_runs

    t_info, r_info = store.run_info(target), store.run_info(ref)
    common = sorted(
        set(t_info["steps"]) & set(r_info["steps"]) & (set(steps) if steps is not None else set(t_info["steps"]))
    )
    per_step = max(t_info["n_rows"], r_info["n_rows"]) / max(len(t_info["steps"]), 1)
    size = max(1, int(max_rows // max(per_step, 1)))
    parts = [
        divergence(compare_runs(store, target, ref, steps=common[i : i + size], **compare_options))
        for i in range(0, len(common), size)
    ] or [divergence(compare_runs(store, target, ref, steps=[], **compare_options))]
    return _merge(parts)


def _screened(
    store,
    target: str,
    ref: str,
    *,
    steps: list[int] | None,
    max_rows: int,
    ranks: list[int] | None = None,
    tolerances: Tolerances | None = None,
    exact: bool = False,
    mapping: Any = None,
    screener: Any = None,
    noise_ref: str | None = None,
) -> Verdict:
    from .compare import builtin_mindspore_names, compare_runs, coverage
    from .screen import Unsupported, screen

    t_info, r_info = store.run_info(target), store.run_info(ref)
    if exact or mapping or noise_ref or builtin_mindspore_names(t_info, r_info):
        raise Unsupported("exact metrics, name mappings or a noise reference")
    tol = tolerances or Tolerances()
    cov = coverage(t_info, r_info)
    steps_c = [s for s in cov["common_steps"] if steps is None or s in steps]
    ranks_c = [k for k in cov["common_ranks"] if ranks is None or k in ranks]
    scr = (screener or screen)(store, target, ref, steps_c, ranks_c, tol)
    units = scr.units
    # in detail: units needing alignment, and the units of each step where the screen saw an output over its
    # tolerance (or an argument differ), in order, until one of them holds a finding beyond the pair's noise
    hit = units.filter(pl.col("first_seq").is_not_null() | (pl.col("args") > 0))
    complex_units = set(scr.complex_units)
    hits = set(hit.select("step", "rank").iter_rows())
    first: Finding | None = None
    culprit: Finding | None = None
    noise: dict[str, Any] = {}
    unmatched: list[dict[str, Any]] = []
    summaries, detailed = [], set()
    for step in sorted({s for s, _ in complex_units | hits}):
        open_ = culprit is None or _held(culprit)  # nothing found yet, or only a weak op alarm (culprit.py)
        these = {u for u in complex_units | (hits if open_ else set()) if u[0] == step}
        if not these:  # found already: later steps only for their units that need alignment
            continue
        # context, not judged: the step before (the update into `step` starts there) and the one before it (the
        # update before, which the optimizer rule judges the update into `step` against: analysis/updates.py)
        before = sorted(x for x in steps_c if x < step)[-2:]
        context = {(p, k) for _, k in these for p in before} if open_ else set()
        cmp = compare_runs(
            store,
            target,
            ref,
            steps=steps_c,
            ranks=ranks_c,
            tolerances=tol,
            units=sorted(these | context),
            precision=scr.precision,
        )
        rows = _ordered(cmp.rows, cmp.records)
        v = _verdict_of(rows, cmp, judged_from=step if context else None)  # the previous step: context only
        stronger = _held(culprit) and v.culprit is not None and not _held(v.culprit)
        if (culprit is None and (v.culprit is not None or v.first_divergence is not None)) or stronger:
            first, culprit, noise = v.first_divergence, v.culprit, v.noise
        elif not noise or (v.noise.get("largest_amplification") or 0) > (noise.get("largest_amplification") or 0):
            noise = noise if culprit is not None else v.noise
        unmatched += [u for u in v.unmatched if u["step"] == step]
        summaries.append(_unit_summaries(rows.filter(pl.col("step") == step)))
        detailed |= these
    same_framework = t_info.get("framework") == r_info.get("framework")  # else one-sided records are structure
    if culprit is None and first is None and unmatched and same_framework:
        first, culprit = _settle(None, None, unmatched)
    if detailed:
        done = pl.DataFrame(sorted(detailed), schema={"step": pl.Int64, "rank": pl.Int64}, orient="row")
        units = units.join(done, on=["step", "rank"], how="anti")
    allu = pl.concat([units] + [u.cast(units.schema) for u in summaries], how="vertical")  # type: ignore[arg-type]
    allu = allu.filter(pl.col("rows") > 0)
    counts = {s: int(allu[s].sum()) for s in STATUSES if allu[s].sum()}
    return Verdict(
        target,
        ref,
        first,
        culprit,
        _timeline(allu),
        _rank_view(allu),
        unmatched,
        scr.precision,
        counts,
        cov,
        noise,
    )


def _unit_summaries(rows: pl.DataFrame) -> pl.DataFrame:
    """Per (step, rank, source) of ordered rows: rows, counts by status, largest err, first differing record (an
    output over its tolerance, or a record the reference lacks) with its phase, seq and leaf, differing
    non-tensor arguments; the screen's `units` columns."""
    cand = ((pl.col("status") == "diverged") & pl.col("_io").is_in(OUTPUT_IO)) | (
        (pl.col("match") == "target_only") & pl.col("how").is_null()
    )
    args = (pl.col("status") == "diverged") & pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "scalar")
    return rows.group_by(["step", "rank", "source"], maintain_order=True).agg(
        pl.len().alias("rows"),
        args.sum().alias("args"),
        *[(pl.col("status") == s).sum().alias(s) for s in STATUSES],
        pl.col("err").max().alias("max_err"),
        pl.col("_phase").filter(cand).first().alias("first_phase"),
        pl.col("_seq").filter(cand).first().alias("first_seq"),
        pl.col("leaf").filter(cand).first().alias("first_leaf"),
        pl.col("_record").filter(cand).first().alias("first_record"),
    )


def _timeline(units: pl.DataFrame) -> list[dict[str, Any]]:
    """Per step: records compared, diverged and unmatched, the largest err and the first differing record."""
    first = (
        units.filter(pl.col("first_seq").is_not_null())
        .sort(["step", "first_phase", "rank", "source", "first_seq", "first_leaf"])
        .group_by("step", maintain_order=True)
        .agg(pl.col("first_record").first())
    )
    ops = dict(first.iter_rows())
    agg = (
        units.group_by("step")
        .agg(pl.col("pass").sum(), pl.col("diverged").sum(), pl.col("unmatched").sum(), pl.col("max_err").max())
        .sort("step")
    )
    return [
        {
            "step": r["step"],
            "compared": int(r["pass"] + r["diverged"]),
            "diverged": int(r["diverged"]),
            "unmatched": int(r["unmatched"]),
            "max_err": None if r["max_err"] is None else float(r["max_err"]),
            "first_divergence": ops.get(r["step"]),
        }
        for r in agg.iter_rows(named=True)
    ]


def _rank_view(units: pl.DataFrame) -> list[dict[str, Any]]:
    """Per rank: records diverged, the largest err and the first differing record with its step."""
    first = (
        units.filter(pl.col("first_seq").is_not_null())
        .sort(["rank", "step", "first_phase", "source", "first_seq", "first_leaf"])
        .group_by("rank", maintain_order=True)
        .agg(pl.col("first_record").first(), pl.col("step").first())
    )
    firsts = {r: (op, step) for r, op, step in first.iter_rows()}
    agg = units.group_by("rank").agg(pl.col("diverged").sum(), pl.col("max_err").max())
    out = []
    for r in agg.iter_rows(named=True):
        op, step = firsts.get(r["rank"], (None, None))
        out.append(
            {
                "rank": r["rank"],
                "diverged": int(r["diverged"]),
                "max_err": None if r["max_err"] is None else float(r["max_err"]),
                "first_divergence": op,
                "first_step": step,
            }
        )
    return _peers(out)


def _held(f: Finding | None) -> bool:
    """A weak op alarm (culprit.py `_is_weak`): a later batch's stronger finding replaces it."""
    return f is not None and bool(f.evidence.get("weak"))


def _merge(parts: list[Verdict]) -> Verdict:
    if len(parts) == 1:
        return parts[0]
    first = next((p for p in parts if p.first_divergence is not None), None)
    if first is not None and _held(first.culprit):  # a weak op alarm yields to a later part's stronger finding
        first = next((p for p in parts if p.culprit is not None and not _held(p.culprit)), first)
    counts: dict[str, int] = {}
    for p in parts:
        for k, n in p.counts.items():
            counts[k] = counts.get(k, 0) + n
    ranks: dict[int, dict[str, Any]] = {}
    for p in parts:
        for r in p.ranks:
            cur = ranks.setdefault(
                r["rank"],
                {"rank": r["rank"], "diverged": 0, "max_err": None, "first_divergence": None, "first_step": None},
            )
            cur["diverged"] += r["diverged"]
            if r["max_err"] is not None and (cur["max_err"] is None or r["max_err"] > cur["max_err"]):
                cur["max_err"] = r["max_err"]
            if cur["first_divergence"] is None and r["first_divergence"] is not None:
                cur["first_divergence"], cur["first_step"] = r["first_divergence"], r["first_step"]
    floors = [p.precision for p in parts]
    precision = max(floors, key=lambda f: eps(f["floor"]))
    base = first or parts[0]
    noise = (
        base.noise
        if first is not None
        else max((p.noise for p in parts), key=lambda n: n.get("largest_amplification") or 0.0)
    )
    return Verdict(
        base.target,
        base.ref,
        base.first_divergence,
        base.culprit,
        [s for p in parts for s in p.steps],
        _peers(list(ranks.values())),
        [u for p in parts for u in p.unmatched],
        precision,
        counts,
        base.coverage,
        noise,
    )

"""The culprit judge: walking a comparison's candidate records in execution order, the first that stands out of
the pair's noise (see analysis/_divergence.py for the rules, analysis/noise.py for the noise model).

Size: one judge whose per-op tests (argument, numeric, discrete flip, fresh, producer) and the optimizer test
share the step view and its cached frames; the rules' arithmetic lives in steps.py, rules.py, prior.py and
sibling_prior.py."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cached_property
from typing import Any

import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES, FLOAT_DTYPES
from dumpstore.names import MODULE_RECORD_PREFIXES, is_module_record_expr

from . import param_change as PC
from . import steps as ST
from .carried_dtype import CarriedDtypes, note
from .compare import Comparison
from .dtype_change import changed_dtype
from .findings import Finding
from .flipflow import enclosing_modules, explained_by_flip, fed_by_flip, step_level
from .float_data import data_read, decision_before, float_data_input, float_data_starts, starts_at, state_argument
from .hidden_index import (
    ROUNDINGS,
    data_suspects,
    hidden_index_stands,
    integer_sum_differs,
    is_loss,
    unseen_ids_reader,
)
from .lone_precision import call_record, lone_detail
from .noise import QUANTILE, QUIET, STAND_OUT, NoiseModel, order_key, statistics_hidden, update_evidence
from .order import INPUT_IO, OUTPUT_IO
from .producers import (
    Producers,
    discrete_data_readers,
    discrete_first_differs,
    fingerprint_column,
    integer_input,
    with_fingerprints,
)
from .rank import significance
from .rules import within_estimates
from .sibling_prior import PRIOR_TOLERANCES, siblings_excuse
from .signature import signature_finding
from .updates import decay_shift, ratio_shift, replayed_update, updates_differ


def _finding(row: dict[str, Any], kind: str | None = None) -> Finding:
    return Finding(
        step=row["step"],
        rank=row["rank"],
        op=row["_record"],
        name=row.get("name") or row.get("ref_name"),
        kind=kind or _row_kind(row),
        metric="rel_l2",
        value=row["err"],
        threshold=row["tol"],
        source=row["err_source"],
        dtype=row["tol_dtype"],
        severity=row["severity"],
        detail=row["detail"],
    )


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


Found = tuple[Finding, tuple]  # a finding and its place in execution order


def _culprit(
    rows: pl.DataFrame,
    recs: pl.DataFrame,
    cmp: Comparison,
    noise: NoiseModel,
    batch: int = 64,
    judged_from: int | None = None,
) -> tuple[Found | None, Found | None]:
    """(culprit, first divergence): the first finding in execution order, and where it shows in the target.
    Steps before `judged_from` are context only (the previous step the screened path compares with a step: the
    optimizer's earlier step and the noise before it), not judged: at the first compared step every weight over
    its tolerance is a culprit, which a context step, later in the run, is not."""
    only = {
        (r["step"], r["rank"], r["source"], r["t_record"] or r["r_record"]): r["how"]
        for r in cmp.records.filter(pl.col("how").is_in(["target_only", "ref_only"])).iter_rows(named=True)
    }
    steps = sorted(set(recs["step"].to_list()))
    keys = ["rank", "source", "_record"]
    weak: tuple[Found, Found] | None = None  # the first finding within WEAK_SEVERITY tolerances, held
    suspects = data_suspects(recs, rows)  # data the statistics cannot verify, named before later findings of its step
    int_first = discrete_first_differs(rows)  # where integer inputs first differ (data changed at a later step)
    starts = float_data_starts(rows)  # float data that start to differ after agreeing (analysis/float_data.py)
    float_first = starts_at(starts)
    history = _history(recs)  # each record's output error at every step (a data reader agreed earlier)
    for i, step in enumerate(steps):
        if judged_from is not None and step < judged_from:
            continue
        view = _StepView(rows, step)
        changed: dict[int, dict[str, Any]] = {}
        if i:
            found, changed = _optimizer(rows, recs, view, steps[i - 1])
            if found is not None:
                return found
        hidden = pl.col("idx_hidden").fill_null(False) & (pl.col("out_err") > 0)  # analysis/hidden_index.py
        dtype = pl.col("dtype_diff").fill_null(False) if "dtype_diff" in recs.columns else pl.lit(False)
        also = _also_judged(view.rows, keys, changed, starts.filter(pl.col("step") == step))
        candidates = recs.filter(pl.col("step") == step).join(
            also, on=keys, how="left", nulls_equal=True, maintain_order="left"
        )
        candidates = candidates.filter(
            pl.col("out_div") | pl.col("arg_diff") | hidden | dtype | pl.col("_also").fill_null(False)
        ).drop("_also")
        if not candidates.height:
            continue
        t_prod, r_prod = view.producers(""), view.producers("ref_")
        carried = CarriedDtypes(view.rows, t_prod, r_prod)
        for start in range(0, candidates.height, batch):
            chunk = candidates.slice(start, batch)
            leaves = view.rows.join(chunk.select(keys), on=keys, how="semi")
            by_rec = leaves.partition_by(keys, as_dict=True, maintain_order=True)
            for rec in chunk.iter_rows(named=True):
                judge = _Judge(
                    rec,
                    by_rec[(rec["rank"], rec["source"], rec["_record"])],
                    t_prod,
                    r_prod,
                    only,
                    cmp,
                    noise,
                    first_step=steps[0],
                    changed=changed,
                    parents=view.parents,
                    int_first=int_first,
                    carried=carried,
                    float_first=float_first,
                    history=history,
                    paired=view.paired,
                )
                found = judge.verdict()
                if found is None:
                    continue
                ahead = _data_first(found, suspects, view)
                if ahead is None and found[0][0].evidence.get("within_hidden") is not None:
                    continue  # within what its inputs' statistics hide: no finding unless a data suspect precedes
                found = ahead or found
                found = _ids_first(found, recs, view) or found
                strong = not _is_weak(found[0][0])
                found = _innermost(found, recs, view) or found
                if strong:
                    return found
                weak = weak or found
    if weak is None:
        return None, None
    weak[0][0].evidence["weak"] = True  # (a batched verdict keeps looking for a stronger one in later batches)
    return weak


def _innermost(found: tuple[Found, Found], recs: pl.DataFrame, view: _StepView) -> tuple[Found, Found] | None:
    """An `op` finding at a module record is named at the record inside it (its own or a nested module's op,
    same step, rank and direction) whose output diverges with the largest local error (the error it made
    beyond what its inputs carry; the earliest on a tie): a user needs the op, and the module was named only
    because none of its inner records stood out on its own (each was judged before it: msprobe writes a
    module's record when it returns).  None: not a module, or no inner record diverges."""
    f, key = found[0]
    if f.kind != "op" or not f.op.startswith(MODULE_RECORD_PREFIXES):
        return None
    inner = [r for r, _ in view.parents.items() if f.op in enclosing_modules(r, view.parents)]
    if not inner:
        return None
    here = recs.filter((pl.col("step") == f.step) & (pl.col("rank") == f.rank))
    direction = here.filter(pl.col("_record") == f.op)["_direction"].first()
    cand = here.filter(
        pl.col("_record").is_in(inner)
        & pl.col("out_div")
        & (pl.col("_direction") == direction)
        & ~is_module_record_expr(pl.col("_record"))
        & pl.col("local").is_finite().fill_null(False)  # (a discrete output's error is no local error)
    )
    if not cand.height:
        return None
    best = cand.with_row_index("_i").sort(["local", "_i"], descending=[True, False], nulls_last=True).row(0, named=True)
    out = view.rows.filter(
        (pl.col("rank") == best["rank"])
        & pl.col("source").eq_missing(best["source"])
        & (pl.col("_record") == best["_record"])
        & pl.col("_io").is_in(OUTPUT_IO)
        & (pl.col("status") == "diverged")
    )
    if not out.height:
        return None
    g = _finding(out.row(0, named=True), "op")
    g.evidence = {**f.evidence, "module": f.op, "local_error": best["local"]}
    local, err = float(best["local"] or 0.0), float(best["out_err"] or 0.0)
    g.detail = (
        f"module {f.op}: {f.detail or 'its output diverges'}; no record inside it stood out on its own, and "
        f"{best['_record']} makes most of its error (local {local:.3g} of its output's {err:.3g})"
    )
    k = order_key(best)
    return (g, k), (g, k)


def _also_judged(
    rows: pl.DataFrame, keys: list[str], changed: dict[int, Any], starts: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The records (`keys`, with `_also` true) of one step's rows judged even where their outputs stay within
    their tolerance: the consumers of a parameter changed between the steps (by parameter key), the records
    reading integer data that differ (analysis/producers.py `discrete_data_readers`), and those reading float
    data that start to differ at this step (`starts`: analysis/float_data.py)."""
    consumers = rows.filter(pl.col("_io").is_in(INPUT_IO) & PC.key_expr(rows.columns).is_in(list(changed))).select(keys)
    floats = [] if starts is None or not starts.height else [starts.select(keys).cast(consumers.schema)]
    return (
        pl.concat([consumers, discrete_data_readers(rows, keys), *floats])
        .unique(maintain_order=True)
        .with_columns(pl.lit(True).alias("_also"))
    )


# an op finding within this many tolerances yields to any stronger finding: the prior's bound on what one op's
# lower internal precision does (sibling_prior.PRIOR_TOLERANCES, one constant)
WEAK_SEVERITY = PRIOR_TOLERANCES


def _is_weak(f: Finding) -> bool:
    """An op whose output is within WEAK_SEVERITY tolerances: what a device's rounding the noise model has no
    evidence for yet can do (a lower internal precision puts the first matmul 2-4x over an fp32 tolerance).  It
    stays the culprit only when no stronger finding follows, in its step or a later one (a weight, an argument,
    an op in one run only, the optimizer, an op far beyond its tolerance): one such alarm must not hide every
    later finding."""
    return f.kind == "op" and f.severity is not None and f.severity < WEAK_SEVERITY


def _data_first(found: tuple[Found, Found], suspects: dict, view: _StepView) -> tuple[Found, Found] | None:
    """Precedence of data the statistics cannot verify (analysis/hidden_index.py `data_suspects`): a finding
    after a forward record of its step whose integer data input (labels, ids; max/min only) is suspect is named
    at that record instead: every later record of the step, the backward above all, descends from it."""
    f, key = found[0]
    hit = suspects.get((f.step, f.rank))
    # at the suspect itself, an op finding beyond what its inputs' statistics hide is the data's error, not the
    # op's computing (one within it is no finding: the walk goes on to a later one)
    itself = hit is not None and hit[0] == key and f.kind == "op" and f.evidence.get("within_hidden") is None
    if hit is None or not (hit[0] < key or itself):
        return None
    skey, rec = hit
    leaves = view.rows.filter(
        (pl.col("rank") == rec["rank"])
        & pl.col("source").eq_missing(rec["source"])
        & (pl.col("_record") == rec["_record"])
        & (pl.col("kind") == "tensor")
    )
    exact = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
    ints = leaves.filter(pl.col("_io").is_in(INPUT_IO) & exact & (pl.col("err_source") == "stats"))
    outs = leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & ~exact & pl.col("err").is_not_null())
    unrecorded = not ints.height and is_loss(rec.get("op_class"))  # a loss whose labels the dump does not list
    if not (ints.height or unrecorded) or not outs.height:
        return None
    out = outs.sort("err", descending=True).row(0, named=True)
    h, before = rec["_h"], rec["_h_before"]
    floor = max(float(rec["in_float_err"] or 0.0), float(rec.get("in_float_eps") or 0.0), float(rec["_eps"]))
    f_new = _finding(out, "input")
    g = rec.get("_g")
    through = "" if g is None else f"; {g:.3g}x the most that error moves it through its recorded gradient"
    if before > 0:
        f_new.threshold = STAND_OUT * before * floor
        history = f"{h / before:.3g}x the most at any earlier step"
    else:  # equal in both runs at every earlier step: the gradient test alone (hidden_index.data_suspects)
        f_new.threshold = STAND_OUT * float(rec["out_err"]) / g if g else None
        history = "equal in both runs at every earlier step"
    f_new.dtype = rec["out_dtype"]
    after = "beyond its own tolerance" if itself else f"ahead of {f.op} later in the step"
    moved = f"this op's output error is {h:.3g}x its float inputs' ({history}{through}), {after}"
    if unrecorded:
        name, why = (
            None,
            (
                f"a loss whose target (data) the dump does not list: {moved}: its target differs (read through ops "
                "msprobe does not record)"
            ),
        )
    else:
        name = ints.row(0, named=True)["name"]
        why = (
            f"{name} (integer data no earlier op produced) has the same max/min in both runs, but {moved}: its "
            "values differ (msprobe's statistics of integers keep only max/min)"
        )
    f_new = _with_evidence(
        f_new,
        differing=name,
        # (the advice names what differs: the labels the loss's record does not list, not its output)
        differing_unrecorded=f"the labels (the target of {rec['_record']}, not recorded in the dump)"
        if unrecorded
        else None,
        hidden_by_statistics=True,
        error_per_input_error=h,
        earlier_steps_max=before,
        gradient_units=rec.get("_g"),
        ahead_of=f.op,
        detail=why,
    )
    return (f_new, skey), (f_new, skey)


def _ids_first(found: tuple[Found, Found], recs: pl.DataFrame, view: _StepView) -> tuple[Found, Found] | None:
    """Statistics mode: an `input` finding at an activation (a forward tensor requiring grad in both runs, made by
    ops msprobe does not record: a slice of q for a partial rotary embedding) says that it differs beyond anything
    recorded before it in its step; those records' errors are statistics lower bounds, so the difference entered
    before it unseen.  Where a gather of its step reads integer data (no recorded op made them) compared by max/min
    only and its output differs (hidden_index.py `unseen_ids_reader`), the ids are where it entered: the finding
    is named there (`input`), the activation kept as `ahead_of`.  None otherwise."""
    f, _ = found[0]
    if f.kind != "input" or f.source != "stats" or not f.evidence.get("differing"):
        return None
    at = view.rows.filter(
        (pl.col("rank") == f.rank) & (pl.col("_record") == f.op) & (pl.col("name") == f.evidence["differing"])
    )
    if not at.height:
        return None
    act = at.row(0, named=True)
    if act["_direction"] != "forward" or not (
        act.get("requires_grad") is True and act.get("ref_requires_grad") is True
    ):
        return None  # (data require no grad: the finding is right where it is)
    rec = unseen_ids_reader(recs, f.step, f.rank, act["source"], act["_seq"])
    if rec is None:
        return None
    leaves = view.rows.filter(
        (pl.col("rank") == rec["rank"])
        & pl.col("source").eq_missing(rec["source"])
        & (pl.col("_record") == rec["_record"])
    )
    t_prod, r_prod = view.producers(""), view.producers("ref_")
    ints = [
        r
        for r in leaves.filter(integer_input() & (pl.col("err_source") == "stats")).iter_rows(named=True)
        if t_prod.producer(r) is None and r_prod.producer(r) is None
    ]
    outs = leaves.filter(
        pl.col("_io").is_in(OUTPUT_IO) & (pl.col("kind") == "tensor") & ~pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
    )
    if not ints or not outs.height:
        return None
    out = outs.sort("err", descending=True, nulls_last=True).row(0, named=True)
    name = ints[0]["name"]
    g = _with_evidence(
        _finding(out, "input"),
        differing=name,
        hidden_by_statistics=True,
        ahead_of=f.op,
        activation=f.evidence["differing"],
        activation_err=f.evidence.get("input_err"),
        detail=(
            f"{name} (integer data no earlier op produced) has the same max/min in both runs and this op's output "
            f"differs ({out['err']:.3g}); later in the step {f.evidence['differing']}, an activation no recorded op "
            f"made, differs {f.evidence.get('input_err') or 0.0:.3g}, beyond anything recorded before it, whose "
            "errors are statistics lower bounds: the difference entered unseen, and integer data enter unseen here "
            "(msprobe's statistics of integers keep only max/min: a tensor dump of this op tells)"
        ),
    )
    k = order_key(rec)
    return (g, k), (g, k)


class _StepView:
    """One step's ordered rows with both runs' fingerprints, and each run's producers, built on first use and
    shared by the optimizer rule and the walk over the step's candidates."""

    def __init__(self, rows: pl.DataFrame, step: int):
        self.step, self._all = step, rows
        self._producers: dict[str, Producers] = {}

    @cached_property
    def parents(self) -> dict[str, str]:
        """Each record's enclosing module record (msprobe's `module` of a record), in the target's names."""
        pairs = self.rows.select("_record", "module").drop_nulls().unique(subset="_record")
        return dict(zip(pairs["_record"].to_list(), pairs["module"].to_list()))

    @cached_property
    def rows(self) -> pl.DataFrame:
        rows = self._all if self._all["step"].n_unique() == 1 else self._all.filter(pl.col("step") == self.step)
        return with_fingerprints(rows)

    @cached_property
    def paired(self) -> dict[tuple, str]:
        """(run prefix, rank, source, record) -> the other run's name of that record, for records in both runs:
        ("", ..., target name) -> reference name and ("ref_", ..., reference name) -> target name."""
        pairs = self.rows.select("rank", "source", "record", "ref_record").drop_nulls(["record", "ref_record"]).unique()
        out: dict[tuple, str] = {}
        for rank, source, t, r in pairs.iter_rows():
            out[("", rank, source, t)] = r
            out[("ref_", rank, source, r)] = t
        return out

    def producers(self, prefix: str) -> Producers:
        if prefix not in self._producers:
            self._producers[prefix] = Producers(self.rows, prefix)
        return self._producers[prefix]


def _optimizer(
    rows: pl.DataFrame, recs: pl.DataFrame, view: _StepView, before: int
) -> tuple[tuple[Found, Found] | None, dict[int, dict[str, Any]]]:
    """The update between two agreeing steps as culprit (see analysis/noise.py and analysis/steps.py), located at
    the first record of the later step that takes an updated parameter; the first divergence is the later step's
    first diverged output.  Else the parameters changed between the steps beyond what the update explains
    (analysis/steps.py `corrupted`, by target fingerprint), for the judges of the later step."""
    after, step_rows = view.step, view.rows
    weights = step_rows.filter(
        pl.col("_io").is_in(INPUT_IO)
        & (pl.col("kind") == "tensor")
        & (pl.col("requires_grad").fill_null(False) | (pl.col("_io") == "parameters"))
    )
    over = weights.filter(pl.col("status") == "diverged").height > 0
    if not over and not weights.filter(pl.col("err").fill_null(0) > 0).height:
        return None, {}  # the parameters agree: nothing moved them apart
    produced = view.producers("")
    fresh = [produced.producer_of(fp, seq) is None for fp, seq in weights.select("_fp_t", "seq").iter_rows()]
    params = weights.filter(pl.Series(fresh, dtype=pl.Boolean))  # (named rows of every column: a second a step)
    distinct = ST.parameters_of(params)  # one row per tensor: a weight read by several records counts once
    # the update ratio is judged whether or not a parameter is over its tolerance: an optimizer whose updates are
    # proportional to the gradient (SGD, RAdam's first steps) moves the parameters by far less than Adam, and a
    # changed learning rate leaves every one within its tolerance (docs/how-it-decides.md, section 5)
    gerr = ST.gradient_error(rows, before)
    ev = update_evidence(rows, before, after, distinct, gerr)
    ratio = ev is not None and ev["differs"]
    if not ratio:  # a later update: its measured ratios against the update before (analysis/updates.py)
        shifted = ratio_shift(rows, before, after, distinct, gerr)
        ev, ratio = (shifted | {"differs": True}, True) if shifted is not None else (ev, ratio)
    # every parameter within its tolerance: the weight-decay reading, the more specific one, is tried first
    decay = None if ratio and over else ST.decay_differs(rows, before, after, distinct)
    if decay is None and not ratio:  # a later update: the parameters a decay could move, against the update before
        decay = decay_shift(rows, before, after, params)
    metric = "update_ratio"
    if ev is not None and ratio and (over or decay is None):
        evidence = {k: v for k, v in ev.items() if k != "differs"}
        value = ev["median_ratio"]
        tied = f" ({ev['tied']} more tied)" if ev.get("tied") else ""
        was = f" (the update before: {ev['previous_ratio']:.4g}x)" if ev.get("previous_ratio") is not None else ""
        text = (
            f"{ev['same_way']} of {ev['parameters'] - ev.get('tied', 0)} parameters{tied} moved "
            f"{ev['median_ratio']:.4g}x (median) as far as "
            f"in the reference between steps {before} and {after}{was}, beyond their own spread and their "
            f"gradients' error (log ratio bar {ev['bar']:.2g}): learning rate, clipping or optimizer differs"
        )
    elif decay is not None:
        evidence, value, metric = decay, decay["median_norm_gap"], "norm_gap"
        later = decay.get("previous_norm_gap") is not None  # analysis/updates.py decay_shift
        was = f" (the update before: {decay['previous_norm_gap']:+.3g})" if later else ""
        which = "the parameters a decay moves moved in proportion to themselves" if later else None
        which = which or "every parameter moved in proportion to itself"
        text = (
            f"{decay['same_way']} of {decay['parameters']} parameters' norms moved {decay['median_norm_gap']:+.3g} "
            f"(relative, median) from the reference's between steps {before} and {after}{was}, beyond their own "
            f"spread (bar {decay['bar']:.2g}): {which}, weight decay differs"
        )
    else:
        # (only the rules of steps.py use the table); a parameter within its tolerance can still have changed
        table = ST.table(rows, before, after, params) if params.height else None
        broad = updates_differ(rows, before, params, table) if over else None
        changed = ST.corrupted(table) if broad is None else {}
        # everything the update was fed agrees, as at the update before, which left the parameters agreeing: a
        # parameter changed between the steps is the more specific reading (analysis/updates.py)
        replay = replayed_update(rows, before, after, distinct) if broad is None and not changed else None
        if broad is not None:
            evidence, value, metric = broad, broad["median_update_units"], "update_units"
            times = (  # a later update far beyond its explanation (analysis/updates.py `updates_differ`)
                f" ({broad['over_explanation']:.3g}x that per parameter, median; the update before: "
                f"{broad['previous_over_explanation']:.2g}x)"
                if "over_explanation" in broad
                else ""
            )
            text = (
                f"{broad['unexplained']} of {broad['parameters']} parameters differ from the reference by "
                f"{broad['median_update_units']:.3g} of their own update (median) between steps {before} and "
                f"{after}, where their gradients and earlier differences explain {broad['median_carried_in']:.3g}"
                f"{times}: clipping, learning rate or optimizer differs"
            )
        elif replay is not None:
            evidence, value, metric = replay, replay["differing"] / replay["updated"], "replay"
            text = (
                f"{replay['differing']} of {replay['updated']} parameters updated between steps {before} and "
                f"{after} differ from the reference, where every parameter and its gradient agreed at step {before} "
                f"and the update before left all {replay['previous_updated']} it moved agreeing (chance "
                f"{replay['p']:.2g}): learning rate, weight decay or optimizer differs"
            )
        else:
            return None, changed
    key = order_key(params.row(0, named=True))  # the update comes before the step's first record taking it
    shows = _most_significant(step_rows, params)
    culprit = Finding(
        after,
        shows["rank"],
        shows["_record"],
        shows["name"],
        "optimizer",
        metric=metric,
        value=value,
        detail=text,
        evidence=evidence,
    )
    first = recs.filter((pl.col("step") == after) & pl.col("out_div")).head(1)
    if first.height:
        r = first.row(0, named=True)
        out = step_rows.filter(
            (pl.col("rank") == r["rank"])
            & (pl.col("_record") == r["_record"])
            & (pl.col("status") == "diverged")
            & pl.col("_io").is_in(OUTPUT_IO)
        ).row(0, named=True)
        return ((culprit, key), (_finding(out), order_key(r))), {}
    return ((culprit, key), (replace(culprit, evidence={}), key)), {}


def _most_significant(step_rows: pl.DataFrame, params: pl.DataFrame) -> dict[str, Any]:
    """The parameter leaf of the record taking an updated parameter that `compare` of the step ranks first by any
    of its leaves (analysis/rank.py `significance`: a leaf's error over the error shown before it), the earliest
    on a tie: where the changed update shows most, the row an optimizer finding is placed on so that
    `compare --top N` of its step lists its record."""
    recs = ["rank", "source", "_record"]
    sig = significance(step_rows.select(pl.exclude("significance")).with_row_index("_i")).select("_i", "significance")
    ranked = (
        step_rows.with_row_index("_i")
        .join(params.select(recs).unique(), on=recs, how="semi")
        .join(sig, on="_i", how="left")
        .sort("significance", descending=True, nulls_last=True, maintain_order=True)
    )
    if not ranked.height:
        return params.row(0, named=True)
    top = ranked.row(0, named=True)
    return params.filter(*(pl.col(k) == top[k] for k in recs)).row(0, named=True)


class _Judge:
    """Whether one candidate record (diverged output or differing argument) is the culprit."""

    def __init__(
        self,
        rec: dict,
        leaves: pl.DataFrame,
        t_prod: Producers,
        r_prod: Producers,
        only: dict,
        cmp: Comparison,
        noise: NoiseModel,
        first_step: int,
        changed: dict[int, dict[str, Any]] | None = None,
        parents: dict[str, str] | None = None,
        int_first: dict[tuple, int] | None = None,
        carried: CarriedDtypes | None = None,
        float_first: set[tuple] | None = None,
        history: dict[tuple, list[tuple]] | None = None,
        paired: dict[tuple, str] | None = None,
    ):
        self.history = history or {}  # (rank, source, record) -> [(step, out_err, out_div)] (`_history`)
        self.paired = paired or {}  # (run prefix, rank, source, record) -> the other run's name (_StepView.paired)
        self.carried = carried  # dtype differences a recorded op made, carried to its consumers
        self.float_first = float_first or set()  # (step, rank, source, record, name): float data starting to differ
        self.rec, self.leaves, self.t_prod, self.r_prod, self.only = rec, leaves, t_prod, r_prod, only
        self.cmp, self.noise, self.first_step = cmp, noise, first_step
        self.changed = changed or {}  # parameters changed between steps (analysis/steps.py), by fingerprint
        self.parents = parents or {}
        self.int_first = int_first or {}  # (rank, source, record, name) -> first step an integer input differs
        self.key = order_key(rec)

    def verdict(self) -> tuple[Found, Found] | None:
        if self.rec["arg_diff"]:
            return signature_finding(self.rec, self.leaves, self.key, _finding) or self._argument()
        if self.rec.get("dtype_diff"):
            changed = self._dtype_change()
            if changed is not None:
                return (changed, self.key), (changed, self.key)
            if self.rec.get("lone_low"):  # one call lowered where its siblings keep the dtype (lone_precision.py)
                f = self._lone_precision()
                return (f, self.key), (f, self.key)
        hidden = self._hidden_index()
        if hidden is not None:
            return (hidden, self.key), (hidden, self.key)
        param = self._changed_parameter()
        if param is not None:
            return (param, self.key), (self._first_output() if self.rec["out_div"] else param, self.key)
        data = self._float_data()
        if data is not None:
            return (data, self.key), (data, self.key)
        if not self.rec["out_div"]:
            data = self._discrete_data()
            return None if data is None else ((data, self.key), (data, self.key))
        found = self._numeric()
        if found is None:
            return None
        return (found, self.key), (self._first_output(), self.key)

    def _hidden_index(self) -> Finding | None:
        """An integer input no op produced whose statistics agree, read by an op whose output differs beyond what
        its float inputs explain: the integer values differ (analysis/hidden_index.py)."""
        rec = self.rec
        if not rec.get("idx_hidden") or rec.get("out_dtype") is None:
            return None
        exact = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
        outs = self.leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("kind") == "tensor") & ~exact)
        if not outs.height:
            return None
        out = outs.sort("err", descending=True, nulls_last=True).row(0, named=True)
        ints = self.leaves.filter(integer_input())
        reads = ints.select(pl.coalesce("numel", "ref_numel").max()).item() if ints.height else None
        ev = hidden_index_stands(rec, self.cmp.tolerances.for_dtype(rec["out_dtype"]), out, reads)
        if ev is None:
            return None
        data = [
            r
            for r in ints.iter_rows(named=True)
            if self.t_prod.producer(r) is None
            and self.r_prod.producer(r) is None
            and explained_by_flip(self.noise, self.key, r) is None
        ]
        if not data:
            return None
        leaf = data[0]
        f = _finding(out, "input")
        f.threshold, f.dtype = ev["bar"], rec["out_dtype"]
        if "beyond_rounding" in ev:
            why = (
                f"this op's output differs {out['err']:.3g} ({ev['beyond_rounding']:.3g} beyond {ROUNDINGS:g} "
                "roundings of each of its statistics) where its float inputs' statistics agree exactly: a gather "
                "copies elements, so a copied element moved beyond rounding"
            )
        else:
            why = (
                f"this op's output differs {out['err']:.3g} where its float inputs explain at most {ev['carried']:.3g}"
            )
        return _with_evidence(
            f,
            differing=leaf["name"],
            hidden_by_statistics=True,
            float_inputs_explain=ev["carried"],
            beyond_rounding=ev.get("beyond_rounding"),
            detail=(
                f"{leaf['name']} (an integer input no earlier op produced) has the same max/min in both runs, but "
                f"{why}: its values differ (msprobe's statistics of integers keep only max/min)"
            ),
        )

    def _dtype_change(self) -> Finding | None:
        """A float input of this record in another dtype than the reference's, made by no recorded op in one
        run (a cast msprobe does not record: the upcast a norm's code left out) (analysis/dtype_change.py): the
        op computes in another dtype.  An input made by a record of one run only is named as that record; one
        both runs' recorded ops made in their own dtypes (an autocast policy) is not evidence."""
        changed = self.leaves.filter(changed_dtype() & pl.col("_io").is_in(INPUT_IO))
        for leaf in changed.iter_rows(named=True):
            tp, rp = self.t_prod.producer(leaf), self.r_prod.producer(leaf)
            at = (leaf["step"], leaf["rank"], leaf["source"])
            if (tp and self.only.get(at + (tp,)) == "target_only") or (rp and self.only.get(at + (rp,)) == "ref_only"):
                return self._producer(leaf, leaf)  # made by a record of one run only: named as that (rule 6)
            if tp is not None and rp is not None:
                continue
            made = None if self.carried is None else self.carried.source(leaf)
            if made is not None:  # carried from a recorded op's output (analysis/carried_dtype.py): judged by values
                self.noise.carried_dtypes.append(note(leaf, self.rec["_record"], made))
                continue
            side = "the target" if tp is None else "the reference"
            return Finding(
                leaf["step"],
                leaf["rank"],
                self.rec["_record"],
                leaf["name"],
                "op",
                metric="dtype",
                dtype=leaf["dtype"],
                detail=(
                    f"{leaf['name']} is {leaf['dtype']} in the target, {leaf['ref_dtype']} in the reference, made "
                    f"by no recorded op in {side} (a cast msprobe does not record; the runs compute at the same "
                    "precision elsewhere): the op computes in another dtype"
                ),
                evidence={"dtype": leaf["dtype"], "ref_dtype": leaf["ref_dtype"], "reason": "dtype differs"},
            )
        return None

    def _lone_precision(self) -> Finding:
        """This call's output in a lower-precision dtype than the reference's while its siblings keep the
        reference's (analysis/lone_precision.py): the op computes in another precision."""
        rec = self.rec
        outs = self.leaves.filter(changed_dtype() & pl.col("_io").is_in(OUTPUT_IO))
        leaf = outs.row(0, named=True)
        op = call_record(rec, self.cmp.records)  # a lowered backward: the call, named at its forward record
        return Finding(
            leaf["step"],
            leaf["rank"],
            op,
            leaf["name"],
            "op",
            metric="dtype",
            value=leaf["err"] if leaf.get("err") is not None and math.isfinite(leaf["err"]) else None,
            threshold=rec.get("lone_tol"),
            source=leaf.get("err_source"),
            dtype=leaf["dtype"],
            detail=lone_detail(rec, op),
            evidence={
                "dtype": leaf["dtype"],
                "ref_dtype": leaf["ref_dtype"],
                "reason": "one call lowered",
                "siblings_kept": rec["lone_kept"],
                "siblings_lowered": rec["lone_lowered"],
            },
        )

    def _parameter_finding(self, leaf: dict[str, Any], out: dict[str, Any]) -> Finding | None:
        """A weight changed between the steps beyond what its update explains (analysis/steps.py `corrupted`), at
        this consumer; None for any other weight (later weights carry the optimizer's noise), and for one changed
        by under `X_MIN` of its update where this consumer does not confirm it (`_consumer_confirms`)."""
        changed = self.changed.get(leaf.get("_pkey"))  # type: ignore[arg-type]
        if changed is None:
            return None
        if changed.get("needs_consumer"):
            confirms = self._consumer_confirms(leaf)
            if confirms is None:
                return None
            changed = {k: v for k, v in changed.items() if k != "needs_consumer"} | confirms
        within = "" if leaf["status"] == "diverged" else ", within its tolerance"
        return _with_evidence(
            _finding(out, "parameter"),
            differing=leaf["name"],
            input_err=leaf["err"],
            **changed,
            detail=(
                f"{leaf['name']} differs by {changed['update_units']:.3g} of its own update at this step{within} "
                f"({_peers(changed)}, what its update was fed "
                f"{changed['carried_in'] or 0:.3g}{_step_agrees(changed)}{_holds(changed)}): changed between steps"
                + _confirmation(changed)
            ),
        )

    def _consumer_confirms(self, leaf: dict[str, Any]) -> dict[str, Any] | None:
        """Evidence that a parameter changed by under `X_MIN` of its update (but beyond its siblings and what its
        update explains) made this consumer's output differ: its other tensor inputs agree (within `QUIET` x the
        tolerance) and its local error (beyond what its inputs' measured errors carry: a sign flip keeps the
        parameter's norm, so its statistics bound hides most of the change) stands out as a fresh op's would,
        beyond the fresh ops before it, its siblings (within the prior's reach) and the error the pair carries
        here.  None where it does not."""
        rec = self.rec
        tol = float(rec["tol"] or 0.0)
        others = self.leaves.filter(
            pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor") & (pl.col("name") != leaf["name"])
        )
        worst = others["err"].drop_nulls().max() if others.height else 0.0
        if not rec["out_div"] or worst is None or not float(worst) <= QUIET * tol:  # type: ignore[arg-type]
            return None
        value = rec["local"]  # beyond what its inputs' measured errors, the parameter's included, carry
        bar = self.noise.bar(rec["_direction"], True, self.key)
        if value is None or (bar is not None and value <= bar):
            return None
        if siblings_excuse(rec, value, self.noise.sibling_bar(rec)):
            return None
        level = self.noise.carried(self.key)
        if level is not None and value <= level:
            return None
        return {"consumer_err": value, "consumer_bar": max(bar or 0.0, level or 0.0)}

    def _changed_parameter(self) -> Finding | None:
        """The first consumer of a parameter changed between the steps, whether or not the parameter or the
        output is over its tolerance: the change is measured in units of the parameter's own update, where a
        tolerance on its norm means nothing (a sign flip of some elements keeps the norm)."""
        if not self.changed or self.rec["step"] == self.first_step:
            return None
        ins = self.leaves.with_columns(PC.key_expr(self.leaves.columns)).filter(
            pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor") & pl.col("_pkey").is_in(list(self.changed))
        )
        outs = self.leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("kind") == "tensor"))
        if not ins.height or not outs.height:
            return None
        out = outs.sort(pl.col("status") == "diverged", "err", descending=True, nulls_last=True).row(0, named=True)
        for leaf in ins.iter_rows(named=True):
            if (
                self.t_prod.producer(leaf) is None
                and self.r_prod.producer(leaf) is None
                and (self.t_prod.is_weight(leaf) or _unlisted_scalar(leaf))
            ):
                return self._parameter_finding(leaf, out)
        return None

    def _discrete_data(self) -> Finding | None:
        """Integer data (labels, ids: an integer or boolean input no recorded op produced in either run) that
        differ at this step and agreed at every earlier one, whatever the noise of the record's float inputs and
        whether or not its output leaves its tolerance (two masked-LM labels move a bfloat16-autocast loss by
        0.8 %): integers have no rounding noise, and no recorded op made them, so no float difference before
        this record did (a near-tie flip noted upstream in its step explains them).  An integer input that
        differed at an earlier step already is left to the other rules (no data change starts here)."""
        exact = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
        ints = self.leaves.filter(integer_input() & (pl.col("status") == "diverged"))
        outs = self.leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("kind") == "tensor") & ~exact)
        if not ints.height or not outs.height:
            return None
        out = outs.sort("err", descending=True, nulls_last=True).row(0, named=True)
        for leaf in ints.iter_rows(named=True):
            if self.t_prod.producer(leaf) is not None or self.r_prod.producer(leaf) is not None:
                continue
            first = self.int_first.get((leaf["rank"], leaf["source"], leaf["_record"], leaf["name"]))
            if first is not None and first < leaf["step"]:
                continue  # it differed before: no data change starts at this step
            if explained_by_flip(self.noise, self.key, leaf) is not None:
                continue
            if leaf["err_source"] == "stats" and not (_extreme_differs(leaf) or integer_sum_differs(leaf)):
                continue  # a mean of integers summed in floating point beyond 2^24 can round differently
            float_err = float(self.rec.get("in_float_err") or 0.0)
            agree = "agree" if float_err <= QUIET * float(self.rec["tol"] or 0.0) else "differ by their noise"
            return _with_evidence(
                _finding(out, "input"),
                differing=leaf["name"],
                input_err=leaf["err"],
                float_input_err=self.rec.get("in_float_err"),
                detail=(
                    f"{leaf['name']} (integer data no earlier op produced) differs "
                    f"({_stat_change(leaf)}) while this op's float inputs {agree} "
                    f"({float_err:.3g}): its output moved {out['err']:.3g}"
                ),
            )
        return None

    def _float_data(self) -> Finding | None:
        """Float data (an input no recorded op of either run made, requiring no grad: images, features) that
        agreed within rounding at every earlier compared step and differ beyond it from this step on, where the
        step's noise cannot have reached them: read before any record of the step shows an output error, or after
        such records with no choice before them that the noise could turn (a flip) and an error beyond theirs
        (analysis/float_data.py): changed data, whatever the noise the pair's weights carry after the first step
        and whether or not this record's output leaves its tolerance (a stale image moves the pixels 1.4 % under a
        bfloat16 autocast's 1.6 %)."""
        if not self.float_first:
            return None
        outs = self.leaves.filter(
            pl.col("_io").is_in(OUTPUT_IO) & (pl.col("kind") == "tensor") & ~pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
        )
        if not outs.height:
            return None
        for leaf in self.leaves.filter(float_data_input()).iter_rows(named=True):
            at = (leaf["step"], leaf["rank"], leaf["source"], leaf["_record"], leaf["name"])
            if at not in self.float_first:
                continue
            if self.t_prod.producer(leaf) is not None or self.r_prod.producer(leaf) is not None:
                continue
            if self.t_prod.is_weight(leaf) or self.r_prod.is_weight(leaf) or state_argument(leaf):
                continue
            if leaf.get(fingerprint_column("")) in self.t_prod.params:  # a parameter a module record lists
                continue
            level = step_level(self.noise, self.key, leaf.get("ref_norm"))
            if level and (decision_before(self.noise, self.key) or not (leaf["err"] or 0.0) > level):
                return None  # the step's noise can have reached it: through a choice, or an unrecorded copy
            out = outs.sort("err", descending=True, nulls_last=True).row(0, named=True)
            return _with_evidence(
                _finding(out, "input"),
                differing=leaf["name"],
                input_err=leaf["err"],
                data_changed=True,
                step_noise_before=level,
                detail=(
                    f"{leaf['name']} (float data no recorded op made, requiring no grad) agreed within rounding at "
                    f"every earlier step and differs now ({_stat_change(leaf)}), {_before(level)}: the data changed "
                    f"(input off {leaf['err']:.3g}; this op's output moved {out['err']:.3g})"
                ),
            )
        return None

    def _first_output(self) -> Finding:
        out = self.leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("status") == "diverged"))
        return _finding(out.row(0, named=True))

    def _argument(self) -> tuple[Found, Found]:
        leaves = self.leaves.filter(
            pl.col("_io").is_in(INPUT_IO)
            & (
                (pl.col("kind") == "scalar")
                | (pl.col("ref_kind") == "scalar")
                | pl.col("match").is_in(["target_only", "ref_only"])
            )
        )
        arg = leaves.filter((pl.col("err") > 0) | pl.col("match").is_in(["target_only", "ref_only"])).row(0, named=True)
        if arg["match"] in ("target_only", "ref_only"):
            side = "target" if arg["match"] == "target_only" else "reference"
            value = arg["value"] if side == "target" else arg["ref_value"]
            detail = f"{arg['name'] or arg['ref_name']} only in the {side}: {value}"
        else:
            detail = arg["detail"] or f"value {arg['value']} vs {arg['ref_value']}"
        name = arg["name"] or arg["ref_name"]
        culprit = Finding(
            arg["step"], arg["rank"], self.rec["_record"], name, "scalar", detail=detail, evidence={"scalar": name}
        )
        outs = self.leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("status") == "diverged"))
        if outs.height:
            out = _finding(outs.row(0, named=True), "scalar")
            out.detail, out.evidence = detail, {"scalar": name}
            return (out, self.key), (_finding(outs.row(0, named=True)), self.key)
        culprit.evidence["outputs"] = "within tolerance"
        return (culprit, self.key), (replace(culprit), self.key)

    def _numeric(self) -> Finding | None:
        rec, leaves = self.rec, self.leaves
        out = leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("status") == "diverged")).row(0, named=True)
        bad_in = leaves.filter(
            pl.col("_io").is_in(INPUT_IO) & (pl.col("status") == "diverged") & (pl.col("kind") == "tensor")
        )
        if self._discrete_flip(bad_in):
            return None
        if self.t_prod.producer(out, views=False) is not None and self.r_prod.producer(out, views=False) is not None:
            return None  # the same output was recorded earlier (a module and its last op): judged there
        # fed by a near-tie flip upstream in its step, within what the flip explains (analysis/flipflow.py)
        fed = fed_by_flip(self.noise, self.key, rec, leaves) is not None
        if fed:
            self.noise.explain(self.key)
        # after a near-tie flip upstream the routing changes which tensors flow (another expert's gradient summed
        # in, or none): a producer that changed within what the flip explains is the flip's
        rewired = None if fed else self._rewired(out)
        if rewired is not None:
            return rewired
        if bad_in.height == 0 and rec["fresh"]:
            return None if fed else self._fresh(out)
        for leaf in bad_in.iter_rows(named=True):
            found = self._producer(leaf, out)
            if found is not None:
                return found
        if fed:
            return None
        if bad_in.filter(pl.col("tol_dtype").is_in(DISCRETE_DTYPES)).height:
            return None  # a differing discrete input (indices, a mask) can change any output: carried, no ratio
        amp = rec["amp"]
        if amp is None or not amp >= self.cmp.tolerances.amplification:
            return None
        bar = self.noise.bar(rec["_direction"], False, self.key)
        if bar is not None and amp <= bar:
            return None
        if siblings_excuse(rec, rec["local"], self.noise.sibling_bar(rec)):
            return None  # its siblings make as much error, within the prior's reach: the class's noise
        if rec.get("in_bound"):  # input errors from statistics are lower bounds: amp is an upper bound
            level = self.noise.carried(self.key)
            if level is not None and rec["out_err"] is not None and rec["out_err"] <= level:
                return None  # and the output error is no more than the pair carries here
            hidden = statistics_hidden(rec)  # what its inputs' statistics can hide, passed on (noise.py)
            if hidden is not None and (rec["out_err"] is None or rec["out_err"] > hidden):
                hidden = None
        else:
            hidden = None
        q = "" if bar is None else f"; this pair's p{round(100 * QUANTILE)} before it is {bar / STAND_OUT:.3g}x"
        return _with_evidence(
            _finding(out, "op"),
            input_err=rec["in_err"],
            amplification=amp,
            noise_bar=bar,
            reason="error amplification stands out",
            within_hidden=hidden,  # not a finding on its own: it orders a data suspect before it (`verdict`)
            detail=f"amplification {amp:.3g}x{q}",
        )

    def _discrete_flip(self, bad_in: pl.DataFrame) -> bool:
        """A discrete choice (top-k, argmax, sort indices, a mask) flipped by noise: the integer or boolean outputs
        differ while the float inputs, and any float outputs (the values chosen), differ no more than the
        error the pair carries here.  Equal values chosen at different places are a near tie; the flip is noted
        (`NoiseModel.flips`) as noise, not judged as a culprit."""
        outs = self.leaves.filter(pl.col("_io").is_in(OUTPUT_IO) & (pl.col("status") == "diverged"))
        exact = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
        flipped = outs.filter(exact)
        if not flipped.height:
            return False
        ins = self.leaves.filter(pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor"))
        if ins.filter(exact & (pl.col("status") == "diverged")).height:
            return False  # a discrete input already differs: carried, judged by the other rules
        level = self.noise.carried(self.key)
        bar = max(level or 0.0, float(self.rec["tol"] or 0.0))
        if not ins.filter(~exact).height:
            # only discrete inputs, compared by their statistics (msprobe keeps max/min of integers): a flip
            # upstream (top-k on a near tie) can hide in them while the pair already differs before this op
            hidden = ins.filter(exact & (pl.col("err_source") == "stats")).height
            if not (hidden and (level or 0.0) > 0 and outs.filter(~exact).height == 0):
                return False
            return self._note_flip(
                flipped,
                None,
                bar,
                "discrete output changed; its discrete inputs are "
                "compared by max/min only, where a near-tie flip upstream can hide",
            )
        floats = pl.concat([ins.filter(~exact), outs.filter(~exact)], how="diagonal_relaxed")
        worst = floats["err"].drop_nulls().max()
        if worst is not None and not float(worst) <= bar:  # type: ignore[arg-type]
            return False
        return self._note_flip(
            flipped,
            None if worst is None else float(worst),  # type: ignore[arg-type]
            bar,
            "discrete output changed where the float values agree within noise: a near tie",
        )

    def _note_flip(self, flipped: pl.DataFrame, worst: float | None, bar: float, detail: str) -> bool:
        self.noise.flip_marks.append((self.key, enclosing_modules(self.rec["_record"], self.parents)))
        self.noise.explain(self.key)
        self.noise.flips.append(
            {
                "step": self.rec["step"],
                "rank": self.rec["rank"],
                "op": self.rec["_record"],
                "outputs": flipped["name"].to_list(),
                "float_err": worst,
                "noise_bar": bar,
                "detail": detail,
            }
        )
        return True

    def _fresh(self, out: dict[str, Any]) -> Finding | None:
        """Inputs agree, the output diverges: an op creating error, if more than the pair's fresh ops do."""
        rec = self.rec
        value = rec["out_err"] if rec["out_err"] is not None else out["err"]
        bar = self.noise.bar(rec["_direction"], True, self.key)
        if bar is not None and value is not None and value <= bar:
            return None
        if siblings_excuse(rec, value, self.noise.sibling_bar(rec)):
            return None  # its siblings (other layers) make as much error, within the prior's reach
        hidden = None
        data = data_read(self.leaves, self.t_prod, self.r_prod)  # reads data and weights only (float_data.py)
        if rec.get("in_bound") and value is not None:
            # its inputs agree by their statistics only, which can hide what the pair carries (a softmax's rows
            # sum to one: its statistics barely move): fresh as far as statistics show, not more.  An op reading
            # data and weights only gets what earlier steps carried through its weights alone (their bound below),
            # and its step's noise through unrecorded copies of outputs before it (float_data.py): STAND_OUT x the
            # largest output error before it in its step, where that is less
            level = self.noise.carried(self.key)
            if data and level is not None:
                level = min(level, STAND_OUT * (step_level(self.noise, self.key) or 0.0))
            if level is not None and value <= level:
                return None
            # nor beyond what its inputs' statistics can hide (noise.statistics_hidden): a batch norm's output
            # statistics are pinned by the normalisation whatever error its input carried; as for a carrying op,
            # such a finding only orders a data suspect before it (`_culprit`).  Unconditioned: nothing was
            # measured to reach the op, and a loss's mean over same-signed terms has |x| / |y| large without any
            # cancellation (a changed label read by a CTC loss: 12)
            hidden = statistics_hidden(rec, conditioned=False)
            if hidden is not None and value > hidden:
                hidden = None
        one_sided = self.leaves.filter(
            pl.col("_io").is_in(INPUT_IO) & pl.col("match").is_in(["target_only", "ref_only"])
        )
        args = [
            f"{r['name'] or r['ref_name']} ({'target' if r['match'] == 'target_only' else 'reference'} only"
            f": {r['value'] if r['match'] == 'target_only' else r['ref_value']})"
            for r in one_sided.iter_rows(named=True)
        ]
        q = "" if bar is None else (f"; fresh ops' p{round(100 * QUANTILE)} error before it is {bar / STAND_OUT:.3g}")
        f = _with_evidence(
            _finding(out, "op"),
            input_err=rec["in_err"],
            reason="inputs agree, output diverges",
            noise_bar=bar,
            arguments_in_one_run=args or None,
            within_hidden=hidden,
            detail=None if out["detail"] else f"inputs agree, output diverges{q}",
        )
        unseen = self._unseen_integers()
        if unseen is None and data:
            unseen = self._unseen_data(data)
        return f if unseen is None else _with_evidence(f, **unseen)

    def _unseen_data(self, data: list[str]) -> dict[str, Any] | None:
        """An op reading data and weights only (float_data.py `data_read`) whose inputs agree by their statistics,
        and which agreed at every earlier compared step: an op that computes differently does so at every step,
        data changed at this step in a way that keeps its statistics (a permutation: channels reordered, samples
        shuffled, ids swapped) do not.  Statistics cannot tell the two: the finding stays `op`, and its detail
        and advice say that its data may have changed unseen.  None at the first compared step or where the
        record diverged at an earlier one."""
        rec = self.rec
        if not rec.get("in_bound"):
            return None  # (compared exactly: data that differ show)
        seen = [h for h in self.history.get((rec["rank"], rec["source"], rec["_record"]), []) if h[0] < rec["step"]]
        if not seen or any(h[2] for h in seen):
            return None
        names = ", ".join(data)
        worst = max((h[1] for h in seen if h[1] is not None and math.isfinite(h[1])), default=0.0)
        return {
            "reason": "data may differ unseen",
            "unseen_data_inputs": data,
            "agreed_before": worst,
            "detail": (
                f"its inputs are data ({names}) and weights, which agree by their statistics, and it agreed at every "
                f"earlier step (output off at most {worst:.3g}): an op that computes differently does so at every "
                "step, while data changed in a way that keeps its statistics (a permutation: channels reordered, "
                "samples shuffled) cannot show in them (a tensor dump of its inputs tells which)"
            ),
        }

    def _unseen_integers(self) -> dict[str, Any] | None:
        """Statistics mode: this record's integer or boolean tensor inputs summarised by max and min only
        (msprobe keeps no mean or norm of integers), where every float tensor input agrees: indices chosen
        differently upstream (a top-k on permuted scores keeps every statistic of its values) cannot show in
        them, so the op may compute the same function on other indices.  The evidence names them, and the last
        discrete choice before this record (an op, not a module, of the same step, rank, source and direction
        making an integer or boolean output from a float input), with whether that choice's float leaves
        agree.  None where an integer input is compared by more than its max and min (tensor mode: by value) or
        a float input differs."""
        exact = pl.col("tol_dtype").is_in(DISCRETE_DTYPES)
        ins = self.leaves.filter(pl.col("_io").is_in(INPUT_IO) & (pl.col("kind") == "tensor"))
        ints = ins.filter(integer_input())
        blind = (pl.col("err_source") == "stats") & pl.col("mean").is_null() & pl.col("ref_mean").is_null()
        if (
            not ints.height
            or ints.filter(~blind).height
            or ins.filter(~exact & (pl.col("status") == "diverged")).height
        ):
            return None
        rec = self.rec
        before = self.t_prod.rows.filter(
            (pl.col("rank") == rec["rank"])
            & pl.col("source").eq_missing(rec["source"])
            & (pl.col("_direction") == rec["_direction"])
            & (pl.col("_seq") < rec["_seq"])
            & (pl.col("kind") == "tensor")
            & ~is_module_record_expr(pl.col("_record"))
        )
        made = before.filter(pl.col("_io").is_in(OUTPUT_IO) & exact).select("_record", "_seq").unique("_record")
        read = before.filter(pl.col("_io").is_in(INPUT_IO) & ~exact).select("_record").unique()
        choices = made.join(read, on="_record", how="semi").sort("_seq")
        choice = choices["_record"][-1] if choices.height else None
        agree = None
        if choice is not None:
            floats = before.filter((pl.col("_record") == choice) & ~exact)
            agree = not floats.filter(pl.col("status") == "diverged").height
        names = ", ".join(ints["name"].to_list())
        if choice is None:
            upstream = "indices or a mask chosen differently"
        else:
            values = "whose float values agree" if agree else "whose float values differ"
            upstream = f"indices chosen differently by {choice} (the last discrete choice before it, {values})"
        return {
            "reason": "integer inputs may differ unseen",
            "unseen_integer_inputs": ints["name"].to_list(),
            "choice_upstream": choice,
            "choice_values_agree": agree,
            "detail": (
                f"its output differs where its float inputs agree, and its integer inputs ({names}) may have "
                "changed unseen: statistics keep only their max and min, so "
                f"{upstream} cannot show in them; this op may compute the same function on other indices "
                "(a tensor dump of the choice tells which)"
            ),
        }

    def _rewired(self, out: dict[str, Any]) -> Finding | None:
        """A float tensor input whose values differ (any amount) and that is another record's output in the
        target than in the reference (by `Producers`: the same tensor or the same values through a view), or a
        recorded op's output in one run and no recorded op's in the other: the op reads another tensor (code
        that passes the wrong operand, a mask or constant built by ops msprobe does not record in one run).
        Its input's error says nothing of the op (two tensors of like statistics: a sigmoid and one minus it);
        the reading is the fault, named at this op.  Crossed only: the target's input is not also an output of
        the reference's producer in the target, nor the reference's an output of the target's producer in the
        reference (a result computed twice, equal in one run and a rounding apart in the other, is no
        rewiring); where one run has no producer, there the input is farther than its tolerance from the other
        run's producer's output (`Producers.distance_to`).  Producers in one run only are left to `_producer`
        (missing_op / extra_op)."""
        ins = self.leaves.filter(
            pl.col("_io").is_in(INPUT_IO)
            & (pl.col("kind") == "tensor")
            & (pl.col("ref_kind") == "tensor")
            & pl.col("tol_dtype").is_in(list(FLOAT_DTYPES))
            & ((pl.col("err") > 0).fill_null(False) | pl.col("nonfinite_mismatch").fill_null(False))
        )
        for leaf in ins.iter_rows(named=True):
            tp, rp = self.t_prod.producer(leaf), self.r_prod.producer(leaf)
            where = (leaf["rank"], leaf["source"])
            tp_ref = None if tp is None else self.paired.get(("",) + where + (tp,))
            rp_t = None if rp is None else self.paired.get(("ref_",) + where + (rp,))
            if (tp is None and rp is None) or (tp is not None and tp_ref is None) or (rp is not None and rp_t is None):
                continue  # no recorded producer, or one in one run only (`_producer`)
            if tp == rp_t:
                continue
            if tp is None or rp is None:
                # one run's input may be the other's producer's output after an unrecorded op that rounds (autograd
                # summing a second, small gradient into it in bf16): another tensor only where, in the run without a
                # producer, it is farther than its tolerance from that record's output
                prod, near = (self.t_prod, rp_t) if tp is None else (self.r_prod, tp_ref)
                gap = prod.distance_to(leaf, near) if near is not None else None
                if gap is None or not gap > float(leaf["tol"] or 0.0):
                    continue
            if rp_t is not None and self.t_prod.made_by(leaf, rp_t):
                continue
            if tp_ref is not None and self.r_prod.made_by(leaf, tp_ref):
                continue
            t_what = f"{tp}'s output" if tp else "a tensor no recorded op made"
            r_what = f"{rp}'s output" if rp else "a tensor no recorded op made"
            kind = "op" if tp and rp else "input"
            return _with_evidence(
                _finding(out, kind),
                differing=leaf["name"],
                input_err=leaf["err"],
                reads={"target": tp, "reference": rp},
                reason="reads another tensor",
                detail=f"{leaf['name']} is {t_what} in the target and {r_what} in the reference: the op reads "
                "another tensor",
            )
        return None

    def _producer(self, leaf: dict[str, Any], out: dict[str, Any]) -> Finding | None:
        """A diverged input: produced by an op in one run only, or by no op (a weight or data)."""
        tp, rp = self.t_prod.producer(leaf), self.r_prod.producer(leaf)
        key = (leaf["step"], leaf["rank"], leaf["source"])
        if rp and self.only.get(key + (rp,)) == "ref_only":
            return Finding(
                leaf["step"],
                leaf["rank"],
                _forward_of(rp, key, self.only, "ref_only"),
                None,
                "missing_op",
                detail=f"only in the reference; its output feeds {leaf['name']}",
            )
        if tp and self.only.get(key + (tp,)) == "target_only":
            return Finding(
                leaf["step"],
                leaf["rank"],
                _forward_of(tp, key, self.only, "target_only"),
                None,
                "extra_op",
                detail=f"only in the target; its output feeds {leaf['name']}",
            )
        if tp is None and rp is None:
            kind = "parameter" if self.t_prod.is_weight(leaf) else "input"
            if kind == "parameter" and leaf["step"] != self.first_step:
                # later weights carry the optimizer's noise: named only when changed beyond what the update
                # explains (analysis/steps.py), at their first consumer
                return self._parameter_finding(leaf, out)
            if kind == "input" and leaf["err"] is not None:
                level = step_level(self.noise, self.key, leaf.get("ref_norm"))  # relative and absolute
                bar = max(self.noise.carried(self.key) or 0.0, level or 0.0)
                if bar > 0 and within_estimates(leaf["err"], bar, leaf.get("err_bound")):
                    return None  # within the error the pair carries here: reached through unrecorded ops
                if explained_by_flip(self.noise, self.key, leaf) is not None:
                    self.noise.explain(self.key)
                    return None  # fed by a near-tie flip upstream in its step, within what the flip explains
            return _with_evidence(
                _finding(out, kind),
                differing=leaf["name"],
                input_err=leaf["err"],
                detail=f"{leaf['name']} differs and no earlier op produced it",
            )
        return None


def _history(recs: pl.DataFrame) -> dict[tuple, list[tuple]]:
    """(rank, source, record) -> [(step, out_err, out_div)] over the compared steps."""
    out: dict[tuple, list[tuple]] = {}
    for r in recs.select("rank", "source", "_record", "step", "out_err", "out_div").iter_rows():
        out.setdefault(r[:3], []).append((r[3], r[4], bool(r[5])))
    return out


def _peers(changed: dict[str, Any]) -> str:
    """What a changed parameter was judged against, for its detail."""
    if not changed.get("siblings"):
        return "no other one-element parameter to compare"
    kin = "siblings" if changed["judged_against"] == "siblings" else "other parameters"
    return f"its {kin} at most {changed['siblings_max']:.3g}"


def _unlisted_scalar(leaf: dict[str, Any]) -> bool:
    """A one-element input that requires grad: a parameter no module lists (analysis/steps.py
    `_table_parameters`) where the changed-parameter table keyed it."""
    return bool(leaf.get("requires_grad")) and leaf.get("numel") == 1


def _step_agrees(changed: dict[str, Any]) -> str:
    """Why a parameter within its tolerance and two updates is named: every other parameter of the step is
    within rounding of the reference's (analysis/steps.py `corrupted`); a one-element parameter: its own update
    is off the reference's (and its sign flip) by that much of it."""
    if changed.get("own_update_off") is not None:
        return (
            f", its own update off the reference's and its sign flip by {changed['own_update_off']:.3g} of it "
            "(one element: its statistics are its value)"
        )
    return ", every other parameter of the step within rounding" if changed.get("step_agrees") else ""


def _holds(changed: dict[str, Any]) -> str:
    """The detail's clause for a parameter that holds another's values, and that one its (analysis/param_gaps.py
    `held_values`: a swap)."""
    if changed.get("holds") is None:
        return ""
    return (
        f"; it holds the reference's {changed['holds']} ({changed['holds_gap']:.3g} of its update apart) and that "
        "one its: swapped"
    )


def _confirmation(changed: dict[str, Any]) -> str:
    """The detail's clause for a parameter change under `X_MIN` of an update that its consumer confirmed."""
    if "consumer_err" not in changed:
        return ""
    return (
        f"; under a quarter of an update, confirmed by this op's output, off {changed['consumer_err']:.3g} beyond "
        "what its inputs carry, on agreeing activations, where the pair's fresh ops and carried error reach "
        f"{changed['consumer_bar']:.3g}"
    )


def _extreme_differs(leaf: dict[str, Any]) -> bool:
    """Whether an integer leaf's max or min differs between the runs (values, not the rounding of a mean)."""
    return any(
        leaf.get(s) is not None and leaf.get("ref_" + s) is not None and leaf[s] != leaf["ref_" + s]
        for s in ("max", "min")
    )


def _before(level: float | None) -> str:
    """Where float data were read in their step: before any output differs, or after outputs off by the step's
    noise, which reaches data no recorded op made through no choice before it (`float_data.decision_before`)."""
    if not level:
        return "before any output of this step differs"
    return f"after outputs of this step off at most {level:.3g}, with no flip or other choice before it to carry that"


def _stat_change(leaf: dict[str, Any]) -> str:
    """How an integer leaf's statistics differ: `max 95 vs 88`."""
    parts = [
        f"{s} {leaf[s]:.6g} vs {leaf['ref_' + s]:.6g}"
        for s in ("max", "min", "mean")
        if leaf.get(s) is not None and leaf.get("ref_" + s) is not None and leaf[s] != leaf["ref_" + s]
    ]
    return ", ".join(parts) or "values"


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

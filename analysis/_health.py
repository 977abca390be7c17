"""Single-run health: watchpoints over steps, each finding with its step, rank, tensor, value and threshold.

In the spirit of MindSpore Insight's watchpoints, from one run's dumps alone (no reference).  Default
thresholds (`Thresholds`), all overridable:

  overflow           NaN, +-Inf or +-finfo.max produced by an op from clean inputs (analysis/_overflow.py; a
                     -Inf-only output of a masking op such as masked_fill is not counted, nor an Inf every path
                     from which a where, clamp or integer cast discards, nor parameters_grad records, which have
                     no inputs to call clean)
  grad_explosion     a gradient norm (parameters_grad leaves and backward outputs, per tensor) above
                     `explode_factor` = 10 x the median of the same tensor's norms at the earlier dumped steps
                     (needs one earlier step); 10x is an order of magnitude: step-to-step gradient norms of a
                     healthy run move by well under that (at most 4x in the samples, a 10x lr included)
  grad_vanishing     a gradient norm below `vanish_norm` = 1e-7 (an exactly zero gradient included)
  weight_change      the update ratio ||w_t - w_prev|| / ||w_prev|| between consecutive dumped steps above
                     `update_ratio` = 0.1, for parameters with >= 2 dimensions (weight matrices, embeddings);
                     healthy updates are around 1e-3 of the weight, biases and norm scales start at 0 or 1 and
                     legitimately move by large relative amounts.  The ratio is ESTIMATED: from the statistics
                     it is a lower bound, max(|d norm|, |d mean| sqrt(n), |d max|, |d min|) / ||w_prev||; from
                     the sketches (tensor files at both steps) it is exact up to sqrt(2/M)
  weight_frozen      a parameter whose statistics (and sketch) are identical at consecutive steps
  activation_growth  a forward output whose norm grows by more than `growth` = 20 % from each dumped step to
                     the next, `growth_steps` = 3 times in a row (4 dumped steps, x1.73 or more in total); two
                     growths in a row are normal early in training (the samples' logits: +23 %, +42 %)
  all_zero           a float forward output that is all zero (zero_count == numel, or max == min == 0); zero
                     gradients are reported as grad_vanishing, zero-initialised parameters are not findings
  near_dtype_max     a finite output, parameter or gradient with |x| >= `near_max` = 0.5 x finfo(dtype).max
                     (fp16 32752, bf16/fp32 ~1.7e38); exactly +-finfo.max is overflow (saturation)
  loss_nonfinite     the loss (0-d forward output of a loss op: cross_entropy, nll_loss, mse_loss, ...) is
  loss_spike         NaN/Inf, or above `explode_factor` x the median of the earlier steps' losses (for a
                     negative median the same rise: median + (explode_factor - 1) x |median|)
  kernel             an op's output farther from float64 than its replay standard allows (`dumpstore replay`:
                     the op run again on the CPU from its recorded inputs; docs/replay.md), every failed output
                     in execution order (the first is `divergence`'s KERNEL finding); none for a run not replayed
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from dumpstore.dtypes import FINFO_MAX, FLOAT_DTYPES
from dumpstore.names import parse_record
from dumpstore.query import connect, fetch_arrow
from dumpstore.store import Store
from dumpstore.views import MODULE_PATH as _MODULE_PATH

from ._overflow import OverflowReport, is_overflow, overflow

WATCHPOINTS = (
    "overflow",
    "grad_explosion",
    "grad_vanishing",
    "weight_change",
    "weight_frozen",
    "activation_growth",
    "all_zero",
    "near_dtype_max",
    "loss_nonfinite",
    "loss_spike",
    "kernel",
)


@dataclass(frozen=True)
class Thresholds:
    """The watchpoints' thresholds (see the module docstring for the defaults' reasons)."""

    explode_factor: float = 10.0
    vanish_norm: float = 1e-7
    update_ratio: float = 0.1
    growth: float = 0.2
    growth_steps: int = 3
    near_max: float = 0.5


@dataclass
class HealthFinding:
    """One watchpoint hit: where (step, rank, record, row name, parameter), the value and the threshold."""

    watchpoint: str
    step: int
    rank: int
    op: str
    name: str | None
    value: float | str | None
    threshold: float | str | None
    param: str | None = None
    detail: str | None = None


@dataclass
class HealthReport:
    """All findings of one run in execution order, the loss per step, counts and the rules applied."""

    run: str
    steps: list[int]
    ranks: list[int]
    thresholds: dict[str, float]
    loss: list[dict[str, Any]]
    findings: list[HealthFinding]
    counts: dict[str, int] = field(default_factory=dict)
    rules: dict[str, str] = field(default_factory=dict)
    overflow_ref: str | None = None  # the overflow findings are beyond this run's (the report's scan); None: alone

    def first(self, watchpoint: str) -> HealthFinding | None:
        return next((f for f in self.findings if f.watchpoint == watchpoint), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_HISTORY = (
    "median(CASE WHEN isfinite({col}) THEN {col} END) OVER (PARTITION BY {keys} ORDER BY step "
    "ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)"
)

GRAD_EXPLOSION_SQL = f"""
WITH g AS (SELECT *, {_HISTORY.format(col="norm", keys="rank, source, kind, tensor")} AS history
           FROM grad_norms WHERE run = $run)
SELECT step, rank, source, seq, leaf, kind, tensor, record, name, norm AS value, history FROM g
WHERE history > 0 AND isfinite(norm) AND norm > $factor * history
"""

GRAD_VANISHING_SQL = """
SELECT step, rank, source, seq, leaf, kind, tensor, record, name, norm AS value FROM grad_norms
WHERE run = $run AND isfinite(norm) AND norm < $limit
"""

WEIGHT_CHANGE_SQL = """
SELECT step, prev_step, rank, source, seq, leaf, param, record, name, len(shape) AS ndim,
       coalesce(ratio_sketch, ratio_est) AS value, ratio_sketch IS NOT NULL AS from_sketch,
       unchanged AND coalesce(ratio_sketch, 0) = 0 AS frozen
FROM weight_change WHERE run = $run
"""

GROWTH_SQL = """
WITH a AS (SELECT step, rank, source, seq, leaf, record, name, norm, lag(norm) OVER w AS prev,
                  lag(step) OVER w AS prev_step, row_number() OVER w AS i
           FROM activations WHERE run = $run
           WINDOW w AS (PARTITION BY rank, source, name ORDER BY step))
SELECT *, norm / prev AS ratio FROM a WHERE prev > 0 AND isfinite(norm) AND norm > (1 + $growth) * prev
ORDER BY rank, source, name, step
"""

_FLOATS = ", ".join(f"'{d}'" for d in FLOAT_DTYPES)
ALL_ZERO_SQL = f"""
SELECT step, rank, source, seq, leaf, record, name, 0.0 AS value FROM activations
WHERE run = $run AND dtype IN ({_FLOATS}) AND numel > 0
  AND (zero_count = numel OR (max = 0 AND min = 0))
"""

_FMAX = "CASE dtype " + " ".join(f"WHEN '{d}' THEN {v!r}" for d, v in FINFO_MAX.items()) + " END"
NEAR_MAX_SQL = f"""
WITH t AS (SELECT step, rank, source, seq, leaf, record, name, dtype, {_FMAX} AS fmax,
                  CASE WHEN io = 'parameters' THEN {_MODULE_PATH} || '.' || index_path END AS param,
                  greatest(abs(max), abs(min)) AS value
           FROM tensors
           WHERE run = $run AND kind = 'tensor' AND io IN ('output', 'parameters', 'parameters_grad'))
SELECT step, rank, source, seq, leaf, record, name, param, dtype, value, $frac * fmax AS threshold FROM t
WHERE isfinite(value) AND value >= $frac * fmax AND value < fmax
"""

LOSS_SQL = f"""
SELECT step, rank, source, seq, 0 AS leaf, record, name, value,
       {_HISTORY.format(col="value", keys="rank, source, record")} AS history,
       coalesce(has_nan OR has_posinf OR has_neginf, false) OR NOT isfinite(value) AS nonfinite
FROM loss WHERE run = $run
ORDER BY step, rank, source, seq
"""


def health(
    store: Store,
    run: str,
    *,
    thresholds: Thresholds | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    overflow_report: OverflowReport | None = None,
) -> HealthReport:
    """Every watchpoint over all steps and ranks of `run`, findings in execution order.  `progress(stage, done,
    total)` is called as each watchpoint group starts, and at the end. `overflow_report`: the overflow scan of
    `run` the caller already has (the report's, against its reference): its producers are the overflow findings,
    not scanned again."""
    th = thresholds or Thresholds()
    tell = progress or (lambda stage, done, total: None)
    info = store.run_info(run)
    con = connect(store, runs=[run])
    try:
        tell("loss", 0, 7)
        loss = _df(con, LOSS_SQL, {"run": run})
        groups: list[tuple[str, Callable[[], list]]] = [
            ("gradients", lambda: _grad_findings(con, run, th)),
            ("weights", lambda: _weight_findings(con, run, th)),
            ("activations", lambda: _growth_findings(con, run, th)),
            ("all-zero", lambda: _zero_findings(con, run)),
            ("near max", lambda: _near_max_findings(con, run, th)),
            ("loss", lambda: _loss_findings(loss, th)),
        ]
        found = []
        for i, (name, group) in enumerate(groups, 1):
            tell(name, i, 7)
            found += group()
    finally:
        con.close()
    tell("overflow", 7, 7)
    found += _overflow_findings(overflow_report if overflow_report is not None else overflow(store, run))
    found += _kernel_findings(store, run)
    found.sort(key=lambda x: x[0])
    findings = [f for _, f in found]
    counts = {w: sum(1 for f in findings if f.watchpoint == w) for w in WATCHPOINTS}
    series = [
        {"step": r["step"], "rank": r["rank"], "op": r["record"], "value": r["value"]}
        for r in loss.iter_rows(named=True)
    ]
    ref = overflow_report.ref if overflow_report is not None else None
    rule = rules(th)
    if ref is not None:
        rule["overflow"] += f", beyond what {ref} has at the aligned tensor"
    return HealthReport(run, list(info["steps"]), list(info["ranks"]), asdict(th), series, findings, counts, rule, ref)


def rules(th: Thresholds) -> dict[str, str]:
    """Each watchpoint's rule in words, with its threshold."""
    return {
        "overflow": "NaN, +-Inf or +-finfo.max output from clean inputs (masking -Inf excluded)",
        "grad_explosion": f"gradient norm > {th.explode_factor:g} x median of the earlier steps",
        "grad_vanishing": f"gradient norm < {th.vanish_norm:g}",
        "weight_change": f"estimated update ratio |dw|/|w| > {th.update_ratio:g} (parameters with >= 2 dims)",
        "weight_frozen": "parameter statistics identical at consecutive steps (not updating)",
        "activation_growth": (f"forward output norm up > {th.growth:.0%} per step, {th.growth_steps} times in a row"),
        "all_zero": "float forward output entirely zero",
        "near_dtype_max": f"finite |x| >= {th.near_max:g} x finfo(dtype).max",
        "loss_nonfinite": "loss is NaN or +-Inf",
        "loss_spike": (
            f"loss > {th.explode_factor:g} x median of the earlier steps (a negative median: "
            f"median + {th.explode_factor - 1:g} x |median|)"
        ),
        "kernel": "op output farther from float64 than its replay standard (dumpstore replay)",
    }


_Found = tuple[tuple, HealthFinding]


def _df(con, sql: str, params: dict[str, Any]) -> pl.DataFrame:
    return pl.from_arrow(fetch_arrow(con, sql, params))  # type: ignore[return-value]


def _order(r: dict[str, Any]) -> tuple:
    return (r["step"], r["rank"], r.get("source") or "", r.get("seq") or 0, r.get("leaf") or 0)


def _found(r: dict[str, Any], watchpoint: str, value: Any, threshold: Any, param: str | None, detail: str) -> _Found:
    """A finding at row `r`'s leaf (its step, rank, record and name), in `r`'s execution order."""
    f = HealthFinding(watchpoint, r["step"], r["rank"], r["record"], r["name"], value, threshold, param, detail)
    return _order(r), f


def _grad_findings(con, run: str, th: Thresholds) -> list[_Found]:
    out: list[_Found] = []
    for r in _df(con, GRAD_EXPLOSION_SQL, {"run": run, "factor": th.explode_factor}).iter_rows(named=True):
        out.append(
            _found(
                r,
                "grad_explosion",
                r["value"],
                th.explode_factor * r["history"],
                _param(r),
                f"{r['kind']} gradient norm {r['value']:.4g} > {th.explode_factor:g} x median "
                f"{r['history']:.4g} of the earlier steps",
            )
        )
    for r in _df(con, GRAD_VANISHING_SQL, {"run": run, "limit": th.vanish_norm}).iter_rows(named=True):
        out.append(
            _found(
                r,
                "grad_vanishing",
                r["value"],
                th.vanish_norm,
                _param(r),
                f"{r['kind']} gradient norm {r['value']:.4g} < {th.vanish_norm:g}",
            )
        )
    return out


def _param(r: dict[str, Any]) -> str | None:
    return r["tensor"] if r["kind"] == "parameter" else None


def _weight_findings(con, run: str, th: Thresholds) -> list[_Found]:
    out: list[_Found] = []
    for r in _df(con, WEIGHT_CHANGE_SQL, {"run": run}).iter_rows(named=True):
        how = "from the sketches" if r["from_sketch"] else "estimated from statistics (a lower bound)"
        span = f"between steps {r['prev_step']} and {r['step']}"
        if r["frozen"]:
            f = _found(
                r,
                "weight_frozen",
                0.0,
                0.0,
                r["param"],
                f"{r['param']} unchanged {span} (identical statistics): not updating",
            )
        elif r["ndim"] >= 2 and r["value"] is not None and r["value"] > th.update_ratio:
            f = _found(
                r,
                "weight_change",
                r["value"],
                th.update_ratio,
                r["param"],
                f"{r['param']} update ratio {r['value']:.3g} > {th.update_ratio:g} {span}, {how}",
            )
        else:
            continue
        out.append(f)
    return out


def _growth_findings(con, run: str, th: Thresholds) -> list[_Found]:
    rows = _df(con, GROWTH_SQL, {"run": run, "growth": th.growth})
    out: list[_Found] = []
    for _, g in rows.group_by(["rank", "source", "name"], maintain_order=True):
        hit = _growing_run(g.to_dicts(), th.growth_steps)
        if hit is not None:
            r, total, start = hit
            out.append(
                _found(
                    r,
                    "activation_growth",
                    total,
                    (1 + th.growth) ** th.growth_steps,
                    None,
                    f"norm grew by > {th.growth:.0%} at every step from step {start} to "
                    f"{r['step']} (x{total:.3g} in total)",
                )
            )
    return out


def _growing_run(rows: list[dict[str, Any]], need: int) -> tuple[dict[str, Any], float, int] | None:
    """Where `need` consecutive growth transitions are first reached: (row, total growth, start step)."""
    need = max(need, 1)
    length, total = 0, 1.0
    for k, r in enumerate(rows):
        if length and r["i"] == rows[k - 1]["i"] + 1:
            length, total = length + 1, total * r["ratio"]
        else:
            length, total = 1, r["ratio"]
        if length >= need:
            return r, total, rows[k - length + 1]["prev_step"]
    return None


def _zero_findings(con, run: str) -> list[_Found]:
    out: list[_Found] = []
    for r in _df(con, ALL_ZERO_SQL, {"run": run}).iter_rows(named=True):
        out.append(_found(r, "all_zero", 0.0, None, None, "every element is zero"))
    return out


def _near_max_findings(con, run: str, th: Thresholds) -> list[_Found]:
    out: list[_Found] = []
    for r in _df(con, NEAR_MAX_SQL, {"run": run, "frac": th.near_max}).iter_rows(named=True):
        out.append(
            _found(
                r,
                "near_dtype_max",
                r["value"],
                r["threshold"],
                r["param"],
                f"|x| up to {r['value']:.4g} >= {th.near_max:g} x finfo({r['dtype']}).max",
            )
        )
    return out


def _loss_findings(loss: pl.DataFrame, th: Thresholds) -> list[_Found]:
    out: list[_Found] = []
    for r in loss.iter_rows(named=True):
        if r["nonfinite"]:
            f = _found(
                r,
                "loss_nonfinite",
                r["value"],
                "finite",
                None,
                f"loss is {r['value']}",
            )
        elif r["history"] and r["value"] is not None and r["value"] > spike_threshold(r["history"], th):
            f = _found(
                r,
                "loss_spike",
                r["value"],
                spike_threshold(r["history"], th),
                None,
                _spike_detail(r["value"], r["history"], th),
            )
        else:
            continue
        out.append(f)
    return out


def spike_threshold(median: float, th: Thresholds) -> float:
    """The loss above which a step is a spike: `explode_factor` x the median of the earlier steps for a positive
    median, and the same rise, median + (explode_factor - 1) x |median|, for a negative one (a loss that goes
    from -10 to -2 has come closer to zero, not spiked)."""
    return median + (th.explode_factor - 1) * abs(median)


def _spike_detail(value: float, median: float, th: Thresholds) -> str:
    if median > 0:
        return f"loss {value:.4g} > {th.explode_factor:g} x median {median:.4g} of the earlier steps"
    return (
        f"loss {value:.4g} > median {median:.4g} + {th.explode_factor - 1:g} x |median| of the earlier steps "
        f"= {spike_threshold(median, th):.4g}"
    )


def _overflow_findings(rep: OverflowReport) -> list[_Found]:
    seqs = {(r["step"], r["rank"], r["record"]): r["seq"] for r in rep.tensors.iter_rows(named=True)}
    out: list[_Found] = []
    for p in rep.producers:
        if not is_overflow(p) or parse_record(p["op"]).direction == "parameters_grad":
            continue  # a masking -Inf, or one every path discards; a gradient record has no inputs to call clean
        counts = {k: p[f"{k}_count"] for k in ("nan", "posinf", "neginf", "sat") if p.get(f"{k}_count")}
        detail = "output holds " + p["kind"] + (f" ({counts})" if counts else "") + " from clean inputs"
        f = HealthFinding(
            "overflow", p["step"], p["rank"], p["op"], p["name"], p["kind"], "finite, |x| < finfo.max", None, detail
        )
        out.append(((p["step"], p["rank"], "", seqs.get((p["step"], p["rank"], p["op"]), 0), 0), f))
    return out


def _kernel_findings(store: Store, run: str) -> list[_Found]:
    """Every output of `run`'s replay (`dumpstore replay`) over its standard, in execution order; none when the run
    was not replayed since its last ingest."""
    from dumpstore.replaytable import read_replay

    from .replay.findings import kernel_message

    table = read_replay(store, run)
    if table is None:
        return []
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    df = df.with_row_index("_at").sort(["step", "rank", "seq"], maintain_order=True).filter(pl.col("status") == "fail")
    out: list[_Found] = []
    for r in df.iter_rows(named=True):
        metric = f"{r['metric']}_ratio" if r.get("metric") == "rel_l2" else r.get("metric")
        f = HealthFinding(
            "kernel", int(r["step"]), int(r["rank"]), r["record"], r["name"], r["ratio"], r["threshold"], None,
            f"{metric}: {kernel_message(r)}" if metric else kernel_message(r),
        )  # fmt: skip
        out.append(((r["step"], r["rank"], "", r["seq"] or 0, r["_at"]), f))
    return out

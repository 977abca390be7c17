"""Single-run health over a long run (a log, event files and/or monitor data; no reference).

Checks (status ok / warn / fail, with the step where it starts):
  nonfinite_loss     a NaN/Inf loss (fail; the first step and the count)
  zero_loss          the loss is exactly 0 over 10 steps or more in a row (fail)
  constant_loss      the loss does not change at all over the last 10 % of the run (at least 10 steps; fail)
  not_converging     the mean loss of the last 10 % of the run is not below 98 % of the first 10 % (warn; fail
                     when it is above 110 %)
  loss_spikes        spikes of the loss (curves' rules: 10 x the median of the previous 100, EMA z > 6, a jump of
                     0.1 x the loss's level over the run or more; warn)
  grad_explosion     a grad norm above 10 x the median of the previous 100 steps, or non-finite (warn)
  grad_vanishing     grad norm below 1e-7 for 10 steps in a row, or the last 10 %'s median below 1e-3 x the first
                     10 %'s (warn)
  loss_scale         the loss scale below 1 (fail: fp16 collapse), else 5 or more drops within 100 steps (warn)
  skipped_iterations Megatron's skipped / NaN iteration counters, MindFormers' overflow flag (warn)
  monitor_nan        with monitor data: the first tensor holding NaN, in step then execution order (fail)
  monitor_grad_*     with monitor data: a parameter's gradient norm above 10 x the median of its previous 100
                     monitored steps, or below 1e-7 (warn)
  update_ratio       with monitor param_origin/param_updated: per parameter |d norm| / norm (a lower bound of the
                     update ratio ||w_t+1 - w_t|| / ||w_t||) whose median over the last 10 % is above 10 x the first
                     10 %'s, or above 0.1 (warn)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dumpstore.longrun.store import MONITOR_SCHEMA, monitor_chunks, read, read_parts, run_row
from dumpstore.store import Store

from .curves import find_events, series
from .curves_spikes import SPIKE_FACTOR, SPIKE_WINDOW, _ffill, _previous_median, find_spikes
from .longrun_anomalies import msprobe_flagged


@dataclass
class Finding:
    check: str
    status: str  # ok / warn / fail
    step: int | None
    value: float | None
    detail: str


@dataclass
class LongRunHealth:
    run: str
    summary: str
    findings: list[Finding] = field(default_factory=list)
    msprobe_flagged: dict[str, Any] | None = None  # msprobe monitor's own alarms, beside the findings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _runs_of(mask: np.ndarray, length: int) -> int | None:
    """Index where the first run of `length` True values starts (the first window of `length` all True)."""
    mask = np.asarray(mask, bool)
    if length <= 0 or len(mask) < length:
        return None
    c = np.concatenate([[0], np.cumsum(mask)])
    full = np.flatnonzero(c[length:] - c[:-length] == length)
    return int(full[0]) if len(full) else None


def long_run_health(store: Store, run: str, *, rank: int | None = None) -> LongRunHealth:
    scalars = read(store, "scalars", run, dictionary=["tag"])
    out: list[Finding] = []
    loss = series(scalars, "loss", rank) if scalars.num_rows else None
    summary = "no loss logged"
    if loss is not None and len(loss.v):
        x, v = loss.x, loss.v
        n = len(v)
        fin = np.isfinite(v)
        summary = f"{n} loss points (steps {int(x[0])}..{int(x[-1])})"
        bad = np.flatnonzero(~fin)
        out.append(
            Finding("nonfinite_loss", "fail", int(x[bad[0]]), float(len(bad)), f"{len(bad)} NaN/Inf losses")
            if len(bad)
            else Finding("nonfinite_loss", "ok", None, 0.0, "every loss is finite")
        )
        z = _runs_of(fin & (v == 0), 10)
        if z is not None:
            out.append(Finding("zero_loss", "fail", int(x[z]), 0.0, "the loss is exactly 0 for 10 steps or more"))
        tail = max(10, n // 10)
        if n >= 20:
            last = v[-tail:][np.isfinite(v[-tail:])]
            head = v[:tail][np.isfinite(v[:tail])]
            if len(last) >= 10 and np.all(last == last[0]):
                out.append(
                    Finding(
                        "constant_loss",
                        "fail",
                        int(x[-tail]),
                        float(last[0]),
                        f"the loss is {last[0]:.6g} at every one of the last {tail} steps",
                    )
                )
            if len(last) and len(head):
                ratio = float(last.mean() / head.mean()) if head.mean() else math.inf
                status = "fail" if ratio > 1.1 else "warn" if ratio >= 0.98 else "ok"
                out.append(
                    Finding(
                        "not_converging",
                        status,
                        None,
                        ratio,
                        f"mean loss of the last {tail} steps is {ratio:.3g} x the first {tail} steps' "
                        f"({last.mean():.4g} vs {head.mean():.4g})",
                    )
                )
        spikes = find_spikes(loss, run)
        if spikes:
            steps = ", ".join(str(s.step) for s in spikes[:10])
            out.append(
                Finding("loss_spikes", "warn", spikes[0].step, float(len(spikes)), f"{len(spikes)} spikes at {steps}")
            )
        else:
            out.append(Finding("loss_spikes", "ok", None, 0.0, "no spike"))
    gn = series(scalars, "grad_norm", rank) if scalars.num_rows else None
    if gn is not None and len(gn.v) > 10:
        out.extend(_grad_norm(gn))
    for ev in find_events(scalars, run, rank) if scalars.num_rows else []:
        if ev.kind == "nonfinite_loss":
            continue
        if ev.kind == "loss_scale_drop":
            out.append(_loss_scale(scalars, rank, ev.steps))
        else:
            out.append(
                Finding("skipped_iterations", "warn", ev.steps[0], float(len(ev.steps)), f"{ev.kind}: {ev.detail}")
            )
    n_monitor = run_row(store, run)["n_monitor"] or 0
    if n_monitor:
        frames = _monitor_frames(store, run)
        out.extend(_monitor_nans(frames))
        out.extend(_monitor_grads(frames))
        out.extend(_update_ratio(frames))
        if loss is None:
            summary = f"monitor only: {n_monitor} rows"
    return LongRunHealth(run, summary, out, msprobe_flagged(store, run))


def _grad_norm(gn) -> list[Finding]:
    v = gn.v
    fin = np.isfinite(v)
    out = []
    base = _previous_median(_ffill(v), SPIKE_WINDOW)
    with np.errstate(invalid="ignore"):
        hit = np.flatnonzero((~fin) | ((base > 0) & (v > SPIKE_FACTOR * base)))
    hit = hit[hit >= 10]
    if len(hit):
        i = int(hit[0])
        out.append(
            Finding(
                "grad_explosion",
                "warn",
                int(gn.x[i]),
                float(v[i]),
                f"{len(hit)} steps with a grad norm above 10 x the previous 100 steps' median or non-finite; first "
                f"{v[i]:.4g} (median {base[i]:.4g})",
            )
        )
    else:
        out.append(Finding("grad_explosion", "ok", None, None, "no grad-norm jump of 10x"))
    tiny = _runs_of(fin & (np.abs(v) < 1e-7), 10)
    n = len(v)
    tail = max(10, n // 10)
    head_med = float(np.median(v[:tail][fin[:tail]])) if fin[:tail].any() else math.nan
    last_med = float(np.median(v[-tail:][fin[-tail:]])) if fin[-tail:].any() else math.nan
    if tiny is not None:
        out.append(
            Finding("grad_vanishing", "warn", int(gn.x[tiny]), 0.0, "grad norm below 1e-7 for 10 steps in a row")
        )
    elif head_med > 0 and last_med < 1e-3 * head_med:
        out.append(
            Finding(
                "grad_vanishing",
                "warn",
                int(gn.x[-tail]),
                last_med,
                f"grad norm median fell from {head_med:.3g} to {last_med:.3g}",
            )
        )
    else:
        out.append(Finding("grad_vanishing", "ok", None, last_med, "grad norm does not vanish"))
    return out


def _loss_scale(scalars, rank, drops: list[int]) -> Finding:
    s = series(scalars, "loss_scale", rank)
    assert s is not None
    low = np.flatnonzero(s.v < 1)
    if len(low):
        return Finding(
            "loss_scale",
            "fail",
            int(s.x[low[0]]),
            float(s.v[low[0]]),
            "loss scale below 1: fp16 loss scaling collapsed",
        )
    d = np.asarray(drops)
    for i in range(len(d)):
        j = np.searchsorted(d, d[i] + 100)
        if j - i >= 5:
            return Finding(
                "loss_scale", "warn", int(d[i]), float(j - i), f"{j - i} loss-scale drops within 100 steps from {d[i]}"
            )
    return Finding("loss_scale", "ok", drops[0], float(len(drops)), f"{len(drops)} loss-scale drops, none clustered")


# the monitor columns the checks read (a run is tens of millions of rows: the rest stays on disk)
_MONITOR_COLUMNS = ["rank", "step", "prefix", "name", "param", "seq", "norm", "nans", "missing"]


def _monitor_frames(store: Store, run: str):
    """frames(prefixes): the run's monitor rows (of `prefixes`, or all) as Polars frames, a chunk of series at a
    time (store.monitor_chunks: a rank and prefix), so a check holds the rows it needs, not the run."""
    import polars as pl

    chunks = monitor_chunks(store, [run])

    def frames(prefixes: set[str] | None = None, *, nan_rows: bool = False, columns: list[str] | None = None):
        cols = columns or _MONITOR_COLUMNS
        for key, files in chunks:
            if prefixes is not None and len(key) == 2 and key[1] not in prefixes:
                continue
            if nan_rows and not _any_nan(files[run]):
                continue
            text: list[str] = [c for c in ("prefix", "name", "param") if c in cols]
            df = pl.from_arrow(read_parts(files[run], "monitor", columns=cols, dictionary=text))
            assert isinstance(df, pl.DataFrame)
            if prefixes is not None and len(key) != 2:  # (a chunk of one prefix holds no other: not copied)
                df = df.filter(pl.col("prefix").cast(pl.String).is_in(sorted(prefixes)))
            yield df  # the names as categoricals (sorted by their text, as strings): a code per row, not a copy

    return frames


def _any_nan(files) -> bool:
    """Whether a chunk of monitor rows holds a tensor with NaN (its `nans` > 0 or a NaN norm, the tensor not
    missing): its three numeric columns read first, the rest only where one does."""
    from dumpstore.longrun.arrow import to_numpy

    t = read_parts(files, "monitor", columns=["norm", "nans", "missing"])
    norm = to_numpy(t.column("norm"), np.float64, 0.0)
    nans = to_numpy(t.column("nans"), np.float64, 0.0)
    missing = to_numpy(t.column("missing"), np.int8, 0).astype(bool)
    with np.errstate(invalid="ignore"):
        return bool((~missing & ((nans > 0) | np.isnan(nans) | np.isnan(norm))).any())  # (a superset of the rows)


def _concat(dfs):
    import polars as pl

    dfs = list(dfs)
    if dfs:
        return pl.concat(dfs)
    empty = pl.from_arrow(MONITOR_SCHEMA.empty_table().select(_MONITOR_COLUMNS))  # (no chunk of those prefixes)
    assert isinstance(empty, pl.DataFrame)
    return empty


def _monitor_nans(frames) -> list[Finding]:
    """The first monitored tensor holding NaN (its `nans` count > 0, or a NaN norm where the tensor exists), in
    step then execution order."""
    import polars as pl

    from dumpstore.longrun.monitor import PREFIX_ORDER

    cond = ~pl.col("missing").fill_null(False) & ((pl.col("nans") > 0) | pl.col("norm").is_nan())
    bad = _concat(df.filter(cond) for df in frames(nan_rows=True)).with_columns(
        pl.col("prefix", "name").cast(pl.String)
    )
    if bad.height == 0:
        return [Finding("monitor_nan", "ok", None, 0.0, "no monitored tensor holds NaN")]
    order = (
        pl.col("prefix").cast(pl.String).replace_strict(PREFIX_ORDER, default=len(PREFIX_ORDER), return_dtype=pl.Int64)
    )
    first = bad.with_columns(order.alias("exec")).sort(["step", "exec", "seq"]).row(0, named=True)
    return [
        Finding(
            "monitor_nan",
            "fail",
            int(first["step"]),
            float(bad.height),
            f"{bad.height} monitored tensors hold NaN; first {first['prefix']} {first['name']} (rank {first['rank']})",
        )
    ]


def _monitor_grads(frames) -> list[Finding]:
    """Per parameter gradient norm (grad_reduced, else grad_unreduced): above 10 x the median of its previous 100
    monitored steps (explosion), or below 1e-7 (vanishing)."""
    import polars as pl

    cols = ["rank", "step", "prefix", "param", "norm"]
    prefix = "grad_reduced"
    parts = _grad_jumps(frames({prefix}, columns=cols), prefix)
    if parts is None:
        prefix = "grad_unreduced"
        parts = _grad_jumps(frames({prefix}, columns=cols), prefix)
    if parts is None or not parts[0]:  # no row of either prefix, or none finite
        return []
    jump, tiny = (pl.concat(p).sort(["step", "rank", "param"]) for p in parts)
    out = []
    if jump.height:
        r = jump.row(0, named=True)
        out.append(
            Finding(
                "monitor_grad_explosion",
                "warn",
                int(r["step"]),
                float(r["norm"]),
                f"{jump.height} {prefix} norms above 10 x their previous median; first {r['param']} "
                f"{r['norm']:.4g} (median {r['base']:.4g}, rank {r['rank']})",
            )
        )
    if tiny.height:
        r = tiny.row(0, named=True)
        out.append(
            Finding(
                "monitor_grad_vanishing",
                "warn",
                int(r["step"]),
                float(r["norm"]),
                f"{tiny.height} {prefix} norms below 1e-7; first {r['param']} (rank {r['rank']})",
            )
        )
    if not out:
        out.append(Finding("monitor_grads", "ok", None, None, f"{prefix}: no 10x jump, no vanishing norm"))
    return out


def _grad_jumps(chunks, prefix: str):
    """([rows above 10 x their previous median], [rows below 1e-7]) of the finite `prefix` gradient norms of
    `chunks` (one frame of each per batch: empty lists where no norm is finite), or None when they hold no row of
    `prefix`. Each chunk's parameters are taken a batch of about BATCH_ROWS rows at a
    time (a series is one rank and parameter: it never crosses a batch), so the rolling medians hold a batch, not
    the run."""
    import polars as pl

    jumps, tinies, seen = [], [], False
    for df in chunks:
        g = df.filter(pl.col("prefix") == prefix)
        seen = seen or g.height > 0
        g = g.filter(pl.col("norm").is_finite()).drop("prefix")
        if g.height == 0:
            continue
        for group in _param_batches(g):
            part = g if group is None else g.filter(pl.col("param").is_in(group))
            part = part.sort(["rank", "param", "step"])
            base = pl.col("norm").rolling_median(SPIKE_WINDOW, min_samples=5).shift(1).over(["rank", "param"])
            part = part.with_columns(base.alias("base"))
            jumps.append(part.filter((pl.col("base") > 0) & (pl.col("norm") > SPIKE_FACTOR * pl.col("base"))))
            tinies.append(part.filter(pl.col("norm") < 1e-7))
        del g
    return (jumps, tinies) if seen else None


BATCH_ROWS = 500_000  # rows of parameters whose rolling medians or update ratios are computed at once


def _param_batches(df):
    """The parameters of `df` in batches of about BATCH_ROWS rows (lists of names), or one None: all of them."""
    params = df.get_column("param").unique().sort().to_list()
    k = max(1, min(len(params), -(-df.height // BATCH_ROWS)))
    if k == 1:
        yield None
        return
    for i in range(k):
        yield params[i * len(params) // k : (i + 1) * len(params) // k]


def _update_ratio(frames) -> list[Finding]:
    import polars as pl

    cols = ["rank", "step", "prefix", "param", "norm"]
    keys = ["rank", "param", "step"]
    # each prefix read on its own (a chunk of the other is not read), only the columns the ratio needs
    o = _concat(frames({"param_origin"}, columns=cols)).select(*keys, pl.col("norm").alias("n0"))
    u = _concat(frames({"param_updated"}, columns=cols)).select(*keys, pl.col("norm").alias("n1"))
    if o.height == 0 or u.height == 0:
        return []
    ratio = ((pl.col("n1") - pl.col("n0")).abs() / pl.col("n0")).alias("ratio")
    aggs = []
    for group in _param_batches(o):  # a batch of parameters at a time: the join and sort hold a batch
        oo, uu = (o, u) if group is None else (f.filter(pl.col("param").is_in(group)) for f in (o, u))
        j = oo.join(uu, on=keys).select(*keys, ratio)
        j = j.filter(pl.col("ratio").is_finite()).sort(keys)
        aggs.append(
            j.group_by(["rank", "param"]).agg(
                pl.col("ratio").head(pl.max_horizontal(pl.len() // 10, 3)).median().alias("first"),
                pl.col("ratio").tail(pl.max_horizontal(pl.len() // 10, 3)).median().alias("last"),
                pl.col("step").tail(pl.max_horizontal(pl.len() // 10, 3)).first().alias("from_step"),
            )
        )
    agg = pl.concat(aggs)
    bad = agg.filter((pl.col("last") > 0.1) | ((pl.col("first") > 0) & (pl.col("last") > 10 * pl.col("first"))))
    if bad.height == 0:
        return [Finding("update_ratio", "ok", None, None, f"{agg.height} parameters: no update-ratio drift")]
    out = []
    for r in bad.sort("last", descending=True).head(10).to_dicts():
        out.append(
            Finding(
                "update_ratio",
                "warn",
                int(r["from_step"]),
                float(r["last"]),
                f"{r['param']} (rank {r['rank']}): |d norm|/norm {r['first']:.3g} early, {r['last']:.3g} late",
            )
        )
    return out

"""The page's charts as plotly figure dicts: rel_l2 along execution order, heat maps by step and by rank.

Also the per-op table the charts are drawn from (`per_op`: the worst output leaf of each op, step and rank).
Labels that come from a dump are HTML-escaped (plotly renders them as markup).

Size: one builder per chart of the page (line, heat maps, loss, gradient norms, update ratios), each short;
they share the per-op table, the palette and the step marks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import polars as pl

from dumpstore.names import module_path, parameter_of_grad

from ..order import OUTPUT_IO
from ..verdict import Verdict
from .text import esc, fmt

__all__ = [
    "BACKWARD",
    "MAX_HEAT_COLUMNS",
    "MAX_POINTS",
    "focus",
    "grad_figure",
    "heat_figure",
    "line_figure",
    "loss_figure",
    "per_op",
    "prepared",
]

BACKWARD = ("backward", "parameters_grad")
MAX_POINTS = 2000  # points per chart trace before downsampling (max per bucket)
MAX_HEAT_COLUMNS = 300  # ops per heat map row before grouping ops into layers
MAX_HEAT_BINS = 240  # columns at most: consecutive columns are merged beyond this
MAX_HEAT_LABELS = 60  # columns named under the axis; beyond, names show on hover only


def prepared(rows: pl.DataFrame) -> pl.DataFrame:
    """cmp.rows with each key taken from whichever side has it (_op, _dir, _io, _seq, _name, _module)."""
    return rows.with_columns(
        pl.coalesce("record", "ref_record").alias("_op"),
        pl.coalesce("direction", "ref_direction").alias("_dir"),
        pl.coalesce("io", "ref_io").alias("_io"),
        pl.coalesce("seq", "ref_seq").alias("_seq"),
        pl.coalesce("name", "ref_name").alias("_name"),
        pl.coalesce("module", "ref_module").alias("_module"),
    )


def per_op(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per op (record) and step and rank: the output leaf with the highest severity."""
    outs = rows.filter(pl.col("_io").is_in(OUTPUT_IO))
    by_sev = pl.col("severity").fill_nan(None).fill_null(-1.0)

    def worst(c: str) -> pl.Expr:
        return pl.col(c).sort_by(by_sev, descending=True).first()

    return (
        outs.group_by(["step", "rank", "source", "_op"], maintain_order=True)
        .agg(
            pl.col("_seq").min().alias("seq"),
            pl.col("_dir").first().alias("direction"),
            pl.col("_module").first().alias("module"),
            worst("err").alias("err"),
            worst("tol").alias("tol"),
            worst("tol_dtype").alias("tol_dtype"),
            worst("_name").alias("leaf_name"),
            worst("err_source").alias("err_source"),
            pl.col("severity").max().alias("severity"),
            (pl.col("status") == "diverged").any().alias("diverged"),
            (pl.col("status") == "unmatched").all().alias("unmatched"),
        )
        .rename({"_op": "op"})
        .sort(["step", "rank", "source", "seq"], nulls_last=True)
    )


def focus(verdict: Verdict, per_op: pl.DataFrame) -> tuple[int, int]:
    """The rank and step the charts show: the culprit's (or first divergence's), else the lowest."""
    for f in (verdict.culprit, verdict.first_divergence):
        if f is not None:
            return f.rank, f.step
    ranks = per_op["rank"].to_list()
    steps = per_op["step"].to_list()
    return (min(ranks) if ranks else 0), (min(steps) if steps else 0)


def _bounds(errs: list[float | None], tols: list[float | None]) -> tuple[float, float]:
    """Where 0 and inf are drawn on a log axis: below the smallest, above the largest finite value."""
    vals = [v for v in errs + tols if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (min(vals), max(vals)) if vals else (1e-6, 1.0)
    return lo / 100.0, max(hi, 1.0) * 100.0


def _clamp(v: float | None, floor: float, ceil: float) -> float | None:
    if v is None or math.isnan(v):
        return None
    if v == math.inf or v > ceil:
        return ceil
    return max(v, floor)


def _downsample(idx: list[int], keep: set[int], ys: list[float | None], max_points: int) -> list[int]:
    """Indices to draw: all if few, else the max of each bucket (peaks survive) plus the marked points."""
    if len(idx) <= max_points:
        return idx
    size = math.ceil(len(idx) / max_points)
    out = {i for i in idx if i in keep}
    for s in range(0, len(idx), size):
        bucket = [i for i in idx[s : s + size] if ys[i] is not None]
        if bucket:
            out.add(max(bucket, key=lambda i: ys[i]))  # type: ignore[arg-type,return-value]
    return sorted(out)


def line_figure(
    per_op: pl.DataFrame, verdict: Verdict, rank: int, max_points: int, op_index: dict[str, int] | None = None
) -> dict[str, Any]:
    """rel_l2 per op along execution order (steps in order, dump order within a step), log scale.

    Each point's customdata is [step, index of its op in `op_index`] (the page's table filters on a click).
    """
    ops = per_op.filter(pl.col("rank") == rank).to_dicts()
    errs = [o["err"] for o in ops]
    floor, ceil = _bounds(errs, [o["tol"] for o in ops])
    ys = [ceil if o["unmatched"] else _clamp(e, floor, ceil) for e, o in zip(errs, ops)]
    marks = _marks(verdict, rank)
    keep = {i for i, o in enumerate(ops) if (o["step"], o["op"]) in marks}
    traces, sampled = [], False
    group = [
        "only in one run (at the top)"
        if o["unmatched"]
        else "inf (at the top)"
        if o["err"] == math.inf
        else ZERO
        if o["err"] == 0
        else "backward"
        if o["direction"] in BACKWARD
        else "forward"
        for o in ops
    ]
    for o in ops:
        o["_k"] = (op_index or {}).get(o["op"])
    for label, marker in _LINE_GROUPS.items():
        idx = [i for i, g in enumerate(group) if g == label and ys[i] is not None]
        if not idx and label not in ("forward", "backward"):
            continue
        shown = _downsample(idx, keep, ys, max_points)
        sampled = sampled or len(shown) < len(idx)
        traces.append(_scatter(label, [ops[i] for i in shown], [ys[i] for i in shown], shown, marker))
    tol_idx = list(range(len(ops)))
    if len(tol_idx) > 2 * max_points:
        tol_idx = tol_idx[:: math.ceil(len(tol_idx) / (2 * max_points))]
    traces.insert(
        0,
        {
            "type": "scatter",
            "mode": "lines",
            "name": "tolerance",
            "x": tol_idx,
            "y": [ops[i]["tol"] if ops[i]["tol"] else None for i in tol_idx],
            "line": {"color": "#888", "dash": "dot", "width": 1, "shape": "hvh"},
            "hoverinfo": "skip",
            "connectgaps": True,
        },
    )
    _quiet_around(traces, ops, keep)
    annotations: list[dict[str, Any]] = []
    for (step, op), (label, symbol, color) in marks.items():
        hit = [i for i, o in enumerate(ops) if o["step"] == step and o["op"] == op]
        y = ys[hit[0]] if hit else None
        if y is None:
            continue
        i = hit[0]
        traces.append(
            _scatter(
                label,
                [ops[i]],
                [ys[i]],
                [i],
                {"color": color, "size": 16, "symbol": symbol, "line": {"color": "#000", "width": 1}},
            )
        )
        annotations.append(
            {
                "x": i,
                "y": math.log10(y),
                "text": esc(f"{label}: {op}"),
                "showarrow": True,
                "arrowhead": 2,
                "ax": 40,
                "ay": (40 if y >= ceil / 10 else -40) * (1 + 0.6 * len(annotations)),
                "font": {"color": color},
                "bgcolor": "rgba(255,255,255,0.85)",
            }
        )
    shapes = _step_lines(ops, annotations)
    title = f"Relative L2 error along execution order (rank {rank}; exact zeros as open circles at the bottom)"
    if sampled:
        title += f" — downsampled to the max of each bucket (≤ {max_points} points per trace)"
    layout = {
        "title": {"text": esc(title), "font": {"size": 14}},
        "height": 420,
        "margin": {"l": 70, "r": 20, "t": 50, "b": 50},
        "xaxis": {"title": {"text": "op in execution order"}, "zeroline": False},
        "yaxis": {
            "title": {"text": "relative L2 error"},
            "type": "log",
            "exponentformat": "e",
            "range": [math.log10(floor) - 0.2, math.log10(ceil) + 0.2],
        },
        "legend": {"orientation": "h", "y": -0.18},
        "annotations": annotations,
        "shapes": shapes,
        "hovermode": "closest",
    }
    return {"data": traces, "layout": layout, "rank": rank}


ZERO = "exactly 0 (at the bottom)"
_LINE_GROUPS = {
    "forward": {"color": "#1f77b4", "size": 5},
    "backward": {"color": "#ff7f0e", "size": 5},
    ZERO: {"color": "#2ca02c", "size": 7, "symbol": "circle-open"},
    "inf (at the top)": {"color": "#d62728", "size": 7, "symbol": "triangle-up"},
    "only in one run (at the top)": {"color": "#8c564b", "size": 8, "symbol": "x"},
}


def _marks(verdict: Verdict, rank: int) -> dict[tuple[int, str], tuple[str, str, str]]:
    marks: dict[tuple[int, str], tuple[str, str, str]] = {}
    f, c = verdict.first_divergence, verdict.culprit
    if f is not None and f.rank == rank:
        marks[(f.step, f.op)] = ("first divergence", "diamond", "#9467bd")
    if c is not None and c.rank == rank:
        marks[(c.step, c.op)] = ("culprit", "star", "#d62728")  # wins over the first divergence when the same op
    return marks


def _scatter(name: str, ops: list[dict], ys: list, xs: list[int], marker: dict, mode: str = "markers") -> dict:
    text = [
        esc(f"{o['op']} (step {o['step']})")
        + "<br>"
        + esc(_leaf(o["leaf_name"], o["op"]))
        + " rel_l2 "
        + fmt(o["err"])
        + " ("
        + esc(o["err_source"])
        + "), tol "
        + fmt(o["tol"])
        + " "
        + esc(o["tol_dtype"])
        for o in ops
    ]
    return {
        "type": "scatter",
        "mode": mode,
        "name": name,
        "x": xs,
        "y": ys,
        "text": text,
        "customdata": [[o["step"], o.get("_k")] for o in ops],
        "hovertemplate": "%{text}<extra>" + esc(name) + "</extra>",
        "marker": marker,
    }


CHART_PX = 1300  # about the plot's width in pixels
MARK_PX = 12  # a marked point's radius and margin: points of other ops this close do not take its hover


def _quiet_around(traces: list[dict], ops: list[dict], marked: set[int]) -> None:
    """Points of other ops drawn under a marked point (culprit star, first divergence) do not answer its hover.

    Plotly's 'closest' hover measures a marker's distance minus its radius, at least 1 - 3/radius: a small point
    under the big star is nearer than the star, so hovering the star named a neighbour (many ops share its pixels
    on a long run).  Such neighbours move to a companion trace drawn alike with hoverinfo 'skip' (plotly honours
    'skip' per trace only)."""
    window = len(ops) * MARK_PX // CHART_PX
    if not marked or window == 0:
        return
    near = {i for m in marked for i in range(max(0, m - window), min(len(ops), m + window + 1))}
    own = {ops[m]["op"] for m in marked}
    for t in list(traces):
        xs = t.get("x") or []
        if t.get("mode") != "markers" or not xs:
            continue
        quiet = [k for k, x in enumerate(xs) if x in near and ops[x]["op"] not in own]
        if not quiet:
            continue
        gone = set(quiet)
        keys = [k for k in ("x", "y", "text", "customdata") if k in t]
        traces.append(
            {
                **t,
                **{k: [t[k][q] for q in quiet] for k in keys},
                "hoverinfo": "skip",
                "showlegend": False,
                "legendgroup": t["name"],
            }
        )
        for k in keys:
            t[k] = [v for j, v in enumerate(t[k]) if j not in gone]
        t["legendgroup"] = t["name"]


def _leaf(name: str | None, op: str) -> str:
    """A leaf's name without its op's ('Functional.linear.6.forward.output.0' -> 'output.0')."""
    return (name or "").removeprefix(op + ".")


def _step_lines(ops: list[dict], annotations: list[dict]) -> list[dict]:
    shapes, last = [], None
    for i, o in enumerate(ops):
        if o["step"] != last:
            if last is not None:
                shapes.append(
                    {
                        "type": "line",
                        "xref": "x",
                        "yref": "paper",
                        "x0": i - 0.5,
                        "x1": i - 0.5,
                        "y0": 0,
                        "y1": 1,
                        "line": {"color": "#bbb", "width": 1},
                    }
                )
            annotations.append(
                {
                    "x": i,
                    "y": 1.0,
                    "xref": "x",
                    "yref": "paper",
                    "text": f"step {o['step']}",
                    "showarrow": False,
                    "xanchor": "left",
                    "yanchor": "bottom",
                    "font": {"size": 10, "color": "#666"},
                }
            )
            last = o["step"]
    return shapes


@functools.lru_cache(maxsize=1 << 16)  # called per heat-map cell: the same ops recur at every step and rank
def _layer(module: str | None, op: str, direction: str | None) -> str:
    """A layer label from the parent module: Module.layers.1.fc1.Linear.forward.0 -> 'layers.1 (fwd)'."""
    path = module_path(module)
    parts = path.split(".") if path else ([module] if module else [op.split(".")[0]])
    name = parts[0]
    for i, p in enumerate(parts):
        if p.isdigit():
            name = ".".join(parts[: i + 1])
            break
    return f"{name} ({'bwd' if direction in BACKWARD else 'fwd'})"


def _binned(cols: dict[str, int], col_of) -> tuple[dict[str, int], Any]:
    """At most MAX_HEAT_BINS columns: consecutive columns merged into 'first … last' (max over the merged)."""
    if len(cols) <= MAX_HEAT_BINS:
        return cols, col_of
    names = list(cols)
    size = math.ceil(len(names) / MAX_HEAT_BINS)
    label_of: dict[Any, Any] = {}
    for a in range(0, len(names), size):
        group = names[a : a + size]
        label = group[0] if len(group) == 1 else f"{group[0]} … {group[-1]}"
        label_of.update((n, label) for n in group)
    binned = {label: i for i, label in enumerate(dict.fromkeys(label_of.values()))}
    return binned, (lambda r: label_of[col_of(r)])


MAX_ZERO_MARKS = 60  # exact-zero cells of a heat map drawn as markers; more are left blank (page size)


def heat_figure(ops: pl.DataFrame, axis: str, verdict: Verdict, title: str) -> dict[str, Any] | None:
    """A heat map of log10(rel_l2): rows = steps or ranks, columns = ops (or layers when there are many)."""
    recs = ops.filter(pl.col("err").is_not_null()).to_dicts()
    if not recs:
        return None
    n_ops = len({r["op"] for r in recs})
    by_layer = n_ops > MAX_HEAT_COLUMNS
    col_of = (lambda r: _layer(r["module"], r["op"], r["direction"])) if by_layer else (lambda r: r["op"])
    cols: dict[str, int] = {}
    for r in sorted(recs, key=lambda r: r["seq"] if r["seq"] is not None else 0):
        cols.setdefault(col_of(r), len(cols))
    merged = len(cols) > MAX_HEAT_BINS
    cols, col_of = _binned(cols, col_of)
    rows = sorted({r[axis] for r in recs})
    row_i = {v: i for i, v in enumerate(rows)}
    floor, ceil = _bounds([r["err"] for r in recs], [r["tol"] for r in recs])
    z: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    raw: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    for r in recs:
        i, j = row_i[r[axis]], cols[col_of(r)]
        if raw[i][j] is None or (r["err"] is not None and r["err"] > raw[i][j]):  # type: ignore[operator]
            raw[i][j] = r["err"]
            z[i][j] = math.log10(_clamp(r["err"], floor, ceil))  # type: ignore[arg-type]
    labels = [esc(c) for c in cols]
    zeros = [(i, j) for i, row in enumerate(raw) for j, v in enumerate(row) if v == 0]
    for i, j in zeros:  # exactly 0 has no place on a log scale: drawn apart, so it does not stretch the colours
        z[i][j] = None
    shown = [
        [None if v is None else (fmt(v) if not math.isfinite(v) else float(f"{v:.3g}")) for v in row] for row in raw
    ]
    data: list[dict[str, Any]] = [
        {
            "type": "heatmap",
            "z": [[None if v is None else round(v, 3) for v in row] for row in z],
            "x": labels,
            "y": [f"{axis} {v}" for v in rows],
            "customdata": shown,
            "hovertemplate": "%{y}<br>%{x}<br>rel_l2 %{customdata}<extra></extra>",
            "colorscale": "Viridis",
            "hoverongaps": False,
            "colorbar": {"title": {"text": "log10<br>rel_l2"}, "thickness": 14},
        }
    ]
    if zeros and len(zeros) <= MAX_ZERO_MARKS:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": ZERO,
                "showlegend": False,
                "x": [labels[j] for _, j in zeros],
                "y": [f"{axis} {rows[i]}" for i, _ in zeros],
                "marker": {"symbol": "circle-open", "size": 9, "color": "#2ca02c"},
                "hovertemplate": "%{y}<br>%{x}<br>rel_l2 exactly 0 (off the colour scale)<extra></extra>",
            }
        )
    c = verdict.culprit or verdict.first_divergence
    if c is not None and c.op in cols and (c.step if axis == "step" else c.rank) in row_i:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "culprit",
                "showlegend": False,
                "x": [esc(c.op)],
                "y": [f"{axis} {c.step if axis == 'step' else c.rank}"],
                "marker": {"symbol": "star", "size": 14, "color": "#d62728", "line": {"color": "#fff", "width": 1}},
                "hovertemplate": esc(f"culprit: {c.op}") + "<extra></extra>",
            }
        )
    what = "layer" if by_layer else "op"
    what = f"{what} (consecutive {what}s merged, max)" if merged else what
    few = len(cols) <= MAX_HEAT_LABELS
    title = title.format(cols=what) + ("" if few else "; column names on hover")
    if zeros:
        title += "; exact zeros " + ("as open circles" if len(zeros) <= MAX_ZERO_MARKS else "blank") + ", off the scale"
    layout = {
        "title": {"text": esc(title), "font": {"size": 14}},
        "height": 230 + max(130, 34 * len(rows)),
        "margin": {"l": 70, "r": 20, "t": 50, "b": 160 if few else 30},
        "xaxis": {
            "type": "category",
            "tickangle": -60,
            "tickfont": {"size": 11},
            "automargin": True,
            "showticklabels": few,
        },
        "yaxis": {"type": "category", "autorange": "reversed"},
    }
    return {"data": data, "layout": layout}


_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _curves(
    part: pl.DataFrame, cols: tuple[str, str], names: tuple[str, str], color: str, group: str | None = None
) -> list[dict[str, Any]]:
    """One quantity's curves per step in one colour: the target's (solid) and the reference's (dashed), from `part`'s
    columns `cols` and labelled `names` (target's, reference's); `group` joins them in the legend."""
    return [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": name,
            **({"legendgroup": group} if group is not None else {}),
            "x": part["step"].to_list(),
            "y": part[col].to_list(),
            "line": {"color": color, "dash": dash},
            "marker": {"size": 5},
        }
        for col, name, dash in zip(cols, names, ("solid", "dash"))
    ]


def _steps_layout(title: str, yaxis: dict[str, Any], height: int = 380) -> dict[str, Any]:
    """The layout of a figure of curves per step: `title`, the steps on x, `yaxis`, one hover label per step."""
    return {
        "title": {"text": title, "font": {"size": 14}},
        "height": height,
        "margin": {"l": 70, "r": 20, "t": 50, "b": 40},
        "xaxis": {"title": {"text": "step"}, "dtick": 1},
        "yaxis": yaxis,
        "hovermode": "x unified",
    }


def loss_figure(rows: pl.DataFrame, loss: list[dict[str, Any]], findings: Sequence[Any] = ()) -> dict[str, Any] | None:
    """Loss per step, one colour per rank: the target (solid, from health) and the reference (dashed).

    The reference's value is the aligned output of the same loss op: its dumped mean (a 0-d loss is its mean).
    Health findings on the loss (`loss_spike`, `loss_nonfinite`) are marked on the target's curve.
    """
    if not loss:
        return None
    keys = pl.DataFrame(loss).select("step", "rank", pl.col("op").alias("_op"), pl.col("value").cast(pl.Float64))
    ref = (
        rows.filter(pl.col("_io") == "output")
        .join(keys, on=["step", "rank", "_op"])
        .group_by("step", "rank")
        .agg(pl.col("ref_mean").first())
    )
    both = keys.join(ref, on=["step", "rank"], how="left").sort("rank", "step")
    traces = []
    for i, ((rank,), part) in enumerate(both.group_by("rank", maintain_order=True)):
        color = _PALETTE[i % len(_PALETTE)]
        traces += _curves(part, ("value", "ref_mean"), (f"target, rank {rank}", f"reference, rank {rank}"), color)
    at = {(r, st): v for r, st, v in keys.select("rank", "step", "value").iter_rows()}
    on_loss = [f for f in findings if f.watchpoint.startswith("loss")]
    traces += _finding_marks(on_loss, lambda f: at.get((f.rank, f.step)))
    layout = _steps_layout(
        "Loss per step: target (solid) and reference (dashed), per rank", {"title": {"text": "loss"}}, height=340
    )
    return {"data": traces, "layout": layout}


def grad_figure(rows: pl.DataFrame, rank: int, top: int = 6, findings: Sequence[Any] = ()) -> dict[str, Any] | None:
    """Gradient L2 norm per step of the `top` parameters whose gradients differ most (by significance, as `compare`
    ranks them: a key bias's gradient residue does not lead), target and reference.

    Health findings on those gradients (`grad_explosion`, `grad_vanishing`) are marked on the target's curve.
    """
    grads = rows.filter(
        (pl.col("_io") == "parameters_grad") & (pl.col("rank") == rank) & (pl.coalesce("kind", "ref_kind") == "tensor")
    )
    if grads.height == 0:
        return None
    by = "significance" if "significance" in grads.columns else "err"  # compare's order: residue does not lead
    worst = (
        grads.group_by("_name")
        .agg(pl.col(by).fill_nan(None).max().alias("_worst"), pl.col("_seq").min())
        .sort(["_worst", "_seq"], descending=[True, False], nulls_last=True)
        .head(top)
    )
    traces = []
    for i, name in enumerate(worst["_name"].to_list()):
        part = grads.filter(pl.col("_name") == name).sort("step")
        color = _PALETTE[i % len(_PALETTE)]
        label = esc(_param_label(name))
        traces += _curves(part, ("norm", "ref_norm"), (f"{label} (target)", f"{label} (reference)"), color, label)
    shown = set(worst["_name"].to_list())
    norms = {(n, st): v for n, st, v in grads.select("_name", "step", "norm").iter_rows()}
    traces += _finding_marks(
        [f for f in findings if f.watchpoint.startswith("grad_") and f.rank == rank and f.name in shown],
        lambda f: norms.get((f.name, f.step)),
    )
    layout = _steps_layout(
        f"Gradient norm per step, rank {rank}: the {worst.height} parameters whose gradients differ most (target "
        "solid, reference dashed)",
        {"title": {"text": "‖grad‖₂"}, "type": "log", "exponentformat": "e"},
    )
    return {"data": traces, "layout": layout}


def _finding_marks(findings: list, y_of) -> list[dict[str, Any]]:
    """One marker trace per health watchpoint, at (step, the curve's value there) of each finding."""
    by: dict[str, list] = {}
    for f in findings:
        y = y_of(f)
        if y is not None:
            by.setdefault(f.watchpoint, []).append((f, y))
    return [
        {
            "type": "scatter",
            "mode": "markers",
            "name": f"health: {w}",
            "x": [f.step for f, _ in hits],
            "y": [y for _, y in hits],
            "marker": {"symbol": "x", "size": 12, "color": "#d62728"},
            "text": [
                esc(f"{f.watchpoint} at step {f.step}, rank {f.rank}: {f.detail or f.name or f.op}") for f, _ in hits
            ],
            "hovertemplate": "%{text}<extra></extra>",
        }
        for w, hits in by.items()
    ]


def _param_label(name: str) -> str:
    """'Module.layers.1.fc1.Linear.parameters_grad.weight' -> 'layers.1.fc1.weight'."""
    return parameter_of_grad(name) or name


def update_figure(
    target: pl.DataFrame | None, ref: pl.DataFrame | None, rank: int, top: int = 6
) -> dict[str, Any] | None:
    """Update ratio ‖w_t − w_prev‖ / ‖w_prev‖ per step of the `top` parameters whose ratios differ most.

    `target`, `ref`: rows of the store's weight_change view (step, rank, param, ratio); the ratio is from
    sketches where both steps have one, else the bound from the statistics (views.WEIGHT_CHANGE).
    """
    if target is None or ref is None or target.height == 0:
        return None
    both = (
        target.filter(pl.col("rank") == rank)
        .join(
            ref.filter(pl.col("rank") == rank).rename({"ratio": "ref_ratio"}), on=["step", "rank", "param"], how="left"
        )
        .sort("step")
    )
    if both.height == 0:
        return None
    gap = (pl.col("ratio") - pl.col("ref_ratio")).abs().fill_nan(None)
    worst = (
        both.group_by("param")
        .agg(gap.max().alias("_gap"), pl.col("ratio").max().alias("_top"))
        .sort(["_gap", "_top", "param"], descending=[True, True, False], nulls_last=True)
        .head(top)
    )
    traces = []
    for i, name in enumerate(worst["param"].to_list()):
        part = both.filter(pl.col("param") == name)
        color = _PALETTE[i % len(_PALETTE)]
        label = esc(name)
        traces += _curves(part, ("ratio", "ref_ratio"), (f"{label} (target)", f"{label} (reference)"), color, label)
    layout = _steps_layout(
        f"Update ratio ‖w − w_prev‖ / ‖w_prev‖ per step, rank {rank}: the {worst.height} parameters whose updates "
        "differ most (target solid, reference dashed)",
        {"title": {"text": "update ratio"}, "type": "log", "exponentformat": "e"},
    )
    return {"data": traces, "layout": layout}

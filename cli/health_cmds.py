"""`dumpstore checklist | health`: render the checklist of a run pair and the watchpoints of one run."""

from __future__ import annotations

import math

import click

from .options import store_option
from .output import format_table, to_json

_STORE = store_option


@click.command()
@click.option("--target", required=True, help="Target run name.")
@click.option("--ref", required=True, help="Reference run name.")
@_STORE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, one key per check.")
def checklist(target, ref, store, as_json):
    """First questions: same data, initial weights, structure, scalar arguments, precision, steps, ranks?"""
    from dumpstore.analysis.checklist import checklist as run_checklist
    from dumpstore.store import open_store

    cl = run_checklist(open_store(store), target, ref)
    if as_json:
        click.echo(to_json(cl.to_dict()))
        return
    click.echo(f"checklist: target {target} vs reference {ref}")
    cells = [[c.title, c.status, c.evidence] for c in cl.checks]
    click.echo(format_table(["check", "status", "evidence"], cells, max_width=240))


@click.command()
@click.option("--run", "run", required=True, help="Run to watch.")
@_STORE
@click.option("--top", type=int, default=20, show_default=True,
              help="Findings listed per watchpoint (0: all).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def health(run, store, top, as_json):
    """Watchpoints over steps: overflow, gradient explosion/vanishing, weight change, activations, loss."""
    from dumpstore.analysis.health import health as run_health
    from dumpstore.store import open_store

    rep = run_health(open_store(store), run)
    if as_json:
        click.echo(to_json(rep.to_dict()))
        return
    click.echo(health_text(rep, top))


def _fmt(v) -> str:
    if isinstance(v, float):
        return str(v) if math.isnan(v) or math.isinf(v) else f"{v:.4g}"
    return "-" if v is None else str(v)


def health_text(rep, top: int) -> str:
    lines = [f"health of run {rep.run}: steps {rep.steps}, ranks {rep.ranks}"]
    for rank in rep.ranks:
        series = [s for s in rep.loss if s["rank"] == rank]
        if series:
            vals = ", ".join(f"step {s['step']} {_fmt(s['value'])}" for s in series)
            lines.append(f"loss (rank {rank}, {series[0]['op']}): {vals}")
    if not rep.loss:
        lines.append("loss: no loss op (cross_entropy, nll_loss, mse_loss, ...) with a 0-d output")
    summary = []
    for w, rule in rep.rules.items():
        f = rep.first(w)
        first = f"step {f.step} rank {f.rank}  {f.name or f.op}  {_fmt(f.value)}" if f else "-"
        summary.append([w, str(rep.counts.get(w, 0)), rule, first])
    lines.append(format_table(["watchpoint", "findings", "rule", "first"], summary, max_width=120))
    for w in rep.rules:
        found = [f for f in rep.findings if f.watchpoint == w]
        if not found:
            continue
        shown = found if top <= 0 else found[:top]
        more = f" (first {len(shown)})" if len(shown) < len(found) else ""
        lines.append(f"\n{w}: {len(found)} findings{more}")
        cells = [[str(f.step), str(f.rank), f.param or f.name or f.op, _fmt(f.value), _fmt(f.threshold),
                  f.detail or ""] for f in shown]
        cols = ["step", "rank", "tensor", "value", "threshold", "detail"]
        lines.append(format_table(cols, cells, max_width=100))
    return "\n".join(lines)

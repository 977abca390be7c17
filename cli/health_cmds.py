"""`dumpstore checklist | health`: render the checklist of a run pair and the watchpoints of one run."""

from __future__ import annotations

import click

from .options import store_option
from .render import Stages, contract, format_table, num, output_options, rows_out, text, to_json

_STORE = store_option


@click.command()
@click.option("--target", required=True, help="Target run name.")
@click.option("--ref", required=True, help="Reference run name.")
@_STORE
@output_options
def checklist(target, ref, store, fmt):
    """First questions: same data, initial weights, structure, scalar arguments, precision, steps, ranks?

    --json prints one object, one key per check; --csv one row per check."""
    from dumpstore.analysis._checklist import checklist as run_checklist
    from dumpstore.store import open_store

    with Stages("checklist") as progress:
        cl = run_checklist(open_store(store), target, ref, progress=progress)
    if fmt == "json":
        click.echo(to_json(contract("checklist", store, cl.to_dict(), target=target, ref=ref)))
        return
    rows = [{"check": c.key, "title": c.title, "status": c.status, "evidence": c.evidence} for c in cl.checks]
    if fmt == "csv":
        click.echo(rows_out(["check", "title", "status", "evidence"], rows, "csv"))
        return
    click.echo(f"checklist: target {text(target)} vs reference {text(ref)}")
    cells = [[c.title, c.status, c.evidence] for c in cl.checks]
    click.echo(format_table(["check", "status", "evidence"], cells, max_width=240))


FINDING_COLUMNS = ["watchpoint", "step", "rank", "op", "name", "param", "value", "threshold", "detail"]


@click.command()
@click.option("--run", "run", required=True, help="Run to watch.")
@_STORE
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Findings listed per watchpoint (0: all; --json and --csv list all).",
)
@output_options
def health(run, store, top, fmt):
    """Watchpoints over steps: overflow, gradient explosion/vanishing, weight change, activations, loss.

    --json prints one object; --csv one row per finding."""
    from dataclasses import asdict

    from dumpstore.analysis._health import health as run_health
    from dumpstore.store import open_store

    with Stages("health") as progress:
        rep = run_health(open_store(store), run, progress=progress)
    if fmt == "json":
        body = rep.to_dict()
        click.echo(to_json(contract("health", store, body, run=body.pop("run"))))
    elif fmt == "csv":
        click.echo(rows_out(FINDING_COLUMNS, [asdict(f) for f in rep.findings], "csv"))
    else:
        click.echo(health_text(rep, top))


def health_text(rep, top: int) -> str:
    lines = [f"health of run {text(rep.run)}: steps {rep.steps}, ranks {rep.ranks}"]
    for rank in rep.ranks:
        series = [s for s in rep.loss if s["rank"] == rank]
        if series:
            vals = ", ".join(f"step {s['step']} {num(s['value'])}" for s in series)
            lines.append(f"loss (rank {rank}, {text(series[0]['op'])}): {vals}")
    if not rep.loss:
        lines.append("loss: no loss op (cross_entropy, nll_loss, mse_loss, ...) with a 0-d output")
    summary = []
    for w, rule in rep.rules.items():
        f = rep.first(w)
        first = f"step {f.step} rank {f.rank}  {f.name or f.op}  {num(f.value)}" if f else "-"
        summary.append([w, str(rep.counts.get(w, 0)), rule, first])
    lines.append(format_table(["watchpoint", "findings", "rule", "first"], summary, max_width=120))
    for w in rep.rules:
        found = [f for f in rep.findings if f.watchpoint == w]
        if not found:
            continue
        shown = found if top <= 0 else found[:top]
        more = f" (first {len(shown)})" if len(shown) < len(found) else ""
        lines.append(f"\n{w}: {len(found)} findings{more}")
        cells = [
            [str(f.step), str(f.rank), f.param or f.name or f.op, num(f.value), num(f.threshold), f.detail or ""]
            for f in shown
        ]
        cols = ["step", "rank", "tensor", "value", "threshold", "detail"]
        lines.append(format_table(cols, cells, max_width=100))
    return "\n".join(lines)

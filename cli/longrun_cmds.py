"""`dumpstore longrun-ingest | longruns | curves`: training logs, TensorBoard events, msprobe monitor output."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .options import store_option
from .render import contract, num, output_options, render, rows_out, text, to_json


@click.command("longrun-ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="PATH...")
@click.option("--run", required=True, help="Name of the long run in the store (re-ingest replaces it).")
@store_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["megatron", "mindformers", "hf"]),
    default=None,
    help="Log family (default: detected from the lines).",
)
@click.option("--pattern", default=None, help="Regex for other logs: a named group `step` and one per value.")
@click.option("--rank", type=int, default=None, help="Rank of the log (default: `rankN` in its name, else 0).")
@click.option("--logging-steps", type=click.IntRange(min=1), default=1, help="HF Trainer log lines: steps per line.")
@click.option("--json", "as_json", is_flag=True, help="Print the catalog row as JSON.")
def longrun_ingest(paths, run, store, fmt, pattern, rank, logging_steps, as_json):
    """Ingest a long run: training logs, TensorBoard event files and msprobe monitor output (files or folders).

    Logs: Megatron/MindSpeed `iteration N/ M | ...`, MindFormers `{ Epoch:[..], step:[..], ... }`, HF Trainer
    `{'loss': ...}` or trainer_state.json, or --pattern. Monitor: TrainerMon and monitor_v2 CSV, every rank."""
    from dumpstore.longrun.ingest import ingest_longrun

    row = ingest_longrun(
        list(paths), run, store=store, fmt=fmt, pattern=pattern, rank=rank, logging_steps=logging_steps
    )
    if as_json:
        click.echo(to_json(contract("longrun-ingest", store, row, run=row.pop("run"))))
        return
    click.echo(
        f"long run {text(run)}: {row['n_scalars']} scalar rows ({', '.join(row['tags']) or '-'}), "
        f"{row['n_monitor']} monitor rows; steps {row['first_step']}..{row['last_step']}, ranks "
        f"{','.join(str(r) for r in row['ranks'])}; read {', '.join(row['formats'])}"
    )


@click.command("longruns")
@store_option
@output_options
def longruns(store, fmt):
    """List the long runs in the store (logs, event files, monitor output)."""
    from dumpstore.longrun.store import catalog
    from dumpstore.store import open_store

    table = catalog(open_store(store))
    if fmt == "table":
        table = table.select(["run", "formats", "first_step", "last_step", "ranks", "n_scalars", "n_monitor"])
    click.echo(render(table, fmt))


@click.command("curves")
@click.option("--target", default=None, help="Target long run.")
@click.option("--ref", default=None, help="Reference long run.")
@click.option("--ref2", default=None, help="A rerun of the reference: the noise band from their difference.")
@click.option("--run", "run", default=None, help="With --health: the long run to watch.")
@click.option("--health", "health_only", is_flag=True, help="Single-run health of --run (no reference).")
@click.option("--by", type=click.Choice(["iteration", "samples"]), default="iteration", show_default=True)
@click.option("--tag", default="loss", show_default=True, help="Scalar to compare (loss, grad_norm, lr, ...).")
@click.option("--rank", type=int, default=None, help="Rank of the curves (default: the lowest logged).")
@click.option("--dump-target", default=None, help="A dump run of the flagged steps (target): its verdict is shown.")
@click.option("--dump-ref", default=None, help="The reference dump run of the flagged steps.")
@click.option(
    "--html",
    "html_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write a self-contained page: both curves, the difference against the band, marks; zoomable.",
)
@store_option
@output_options
def curves(target, ref, ref2, run, health_only, by, tag, rank, dump_target, dump_ref, html_path, store, fmt):
    """Compare two long runs' curves: alignment, noise band, Huawei's criteria, divergence step, spikes, NaN and
    skipped iterations, loss-scale drops, lr schedule; with monitor data, the first module to move and the
    msprobe config for the dump. `--run R --health`: one run's health.

    --json prints one object; --csv one row per aligned point (or per finding with --health)."""
    from dumpstore.store import open_store

    st = open_store(store)
    if health_only or run is not None:
        if run is None:
            raise click.UsageError("--health needs --run RUN")
        return _health(st, run, rank, fmt)
    if target is None or ref is None:
        raise click.UsageError("give --target and --ref (or --run RUN --health)")
    from dumpstore.analysis.longrun_culprit import compare_long_runs

    rep = compare_long_runs(st, target, ref, ref2, tag=tag, by=by, rank=rank)
    if (dump_target is None) != (dump_ref is None):
        raise click.UsageError("give both --dump-target and --dump-ref (the dump pair of the flagged steps)")
    if dump_target is not None:
        from dumpstore.analysis.longrun_culprit import dump_verdict

        rep.dump_verdict = dump_verdict(st, dump_target, dump_ref)
    if html_path is not None:
        from dumpstore.analysis.curves_html import write as write_html

        size = write_html(rep, curves_text(rep), html_path)
        click.echo(f"wrote {text(str(html_path))} ({size / 1e6:.1f} MB)", err=True)
    if fmt == "json":
        body = rep.to_dict()
        click.echo(to_json(contract("curves", store, body, target=body.pop("target"), ref=body.pop("ref"))))
    elif fmt == "csv":
        rows = rep.rows()
        click.echo(rows_out(list(rows[0]) if rows else [], rows, "csv"))
    else:
        click.echo(curves_text(rep))


def flagged_lines(f, text, num):
    from dumpstore.analysis.longrun_anomalies import flagged_lines as lines

    return lines(f, text, num)


def curves_text(rep) -> str:
    if rep.n_points == 0:  # monitor data only
        lines = [f"curves: target {text(rep.target)} vs reference {text(rep.ref)}: {rep.band_source}"]
        if rep.culprit is not None:
            lines.extend(culprit_lines(rep.culprit))
        for f in rep.msprobe_flagged:
            lines.extend(flagged_lines(f, text, num))
        return "\n".join(lines)
    lines = [
        f"curves: target {text(rep.target)} vs reference {text(rep.ref)}, {text(rep.tag)} by {rep.by}: "
        f"{rep.n_points} points ({rep.first_x}..{rep.last_x}); mean |diff| {num(rep.mean_abs_diff)}, "
        f"max |diff| {num(rep.max_abs_diff)}",
    ]
    cov = rep.coverage
    if cov is not None and cov.note is not None:
        lines.append(f"coverage: {text(cov.note)}: compared over {cov.unit} {cov.compared[0]}..{cov.compared[1]} only")
    lines += [f"noise band: {rep.band_source}; window {rep.window} points", "criteria (Huawei, long run):"]
    for c in rep.criteria:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[c.passed]
        lines.append(f"  {mark} {c.name}: {text(c.value)}  [{c.rule}]")
    d = rep.divergence
    if d.step is None:
        if cov is not None and cov.note is not None:  # never an all-clear about points one run lacks
            lines.append(
                f"divergence: none over {cov.unit} {cov.compared[0]}..{cov.compared[1]}, the points both runs have; "
                f"not compared after them ({text(cov.note)})"
            )
        else:
            lines.append("divergence: none; the difference stays inside the noise band")
    else:
        lines.append(
            f"divergence: from step {d.step} the difference leaves the band and stays out (out from {d.crossed}); "
            f"{'an offset' if d.kind == 'offset' else 'noise around zero'}: mean diff {num(d.mean_diff)}, "
            f"std {num(d.std_diff)}, noise sigma before {num(d.sigma)}"
        )
    lr = rep.lr_mismatch
    if lr is not None:
        lines.append(
            f"lr schedule mismatch: from step {lr.step} target lr {num(lr.target_lr)} vs reference "
            f"{num(lr.ref_lr)} (x{num(lr.ratio)}; median x{num(lr.ratio_after)} after, "
            f"{lr.share_after:.0%} of the later steps differ)"
        )
    for sp in rep.spikes[:20]:
        rule = "10x rule" if sp.rule == "factor10" else "EMA z-score"
        lines.append(
            f"spike: run {text(sp.run)} step {sp.step}: {num(sp.value)} ({rule}: {num(sp.score)}"
            f"{'x' if sp.rule == 'factor10' else ' sigma'} over {num(sp.baseline)})"
        )
    if len(rep.spikes) > 20:
        lines.append(f"... {len(rep.spikes) - 20} more spikes (--json lists all)")
    for ev in rep.events:
        steps = ", ".join(str(s) for s in ev.steps[:10]) + (" ..." if len(ev.steps) > 10 else "")
        lines.append(f"{ev.kind}: run {text(ev.run)}: {text(ev.detail)}; steps {steps}")
    if rep.culprit is not None:
        lines.extend(culprit_lines(rep.culprit))
    for f in rep.msprobe_flagged:
        lines.extend(flagged_lines(f, text, num))
    if rep.dump_verdict is not None:
        lines.extend(verdict_lines(rep.dump_verdict))
    return "\n".join(lines)


def verdict_lines(v: dict) -> list[str]:
    head = f"dump verdict ({text(v['target'])} vs {text(v['ref'])}):"
    out = []
    for key, label in (("first_divergence", "first divergence"), ("culprit", "culprit")):
        f = v.get(key)
        if f is None:
            out.append(f"  {label}: none")
        else:
            out.append(
                f"  {label} ({text(f['kind'])}): step {f['step']} rank {f['rank']}  {text(f['op'])}"
                + (f"  {text(f['name'])}" if f.get("name") else "")
            )
    return [head, *out]


def culprit_lines(c: dict) -> list[str]:
    lines = [f"monitor: {c['n_series']} series compared ({c['band']})"]
    if c.get("n_differ_from_start"):
        lines.append(
            f"monitor: {c['n_differ_from_start']} of them differ from their first steps and are not judged "
            "(runs that differ from the start drift apart; pass --ref2, a rerun of the reference, to judge them)"
        )
    first = c.get("first")
    note, steps = c.get("steps_note"), c.get("steps") or {}
    if note is not None:
        lines.append(f"monitor: {note}: steps only one run has are not compared")
    if first is None:
        if note is not None and "target" in steps and "ref" in steps:  # no all-clear about steps one run lacks
            lo, hi = max(steps["target"][0], steps["ref"][0]), min(steps["target"][1], steps["ref"][1])
            lines.append(
                f"monitor: no module or parameter statistic leaves its band over monitor steps {lo}..{hi} only"
            )
        else:
            lines.append("monitor: no module or parameter statistic leaves its band")
        return lines
    lines.append(
        f"first to move: {text(first['prefix'])} {text(first['name'])} ({first['stat']}) at monitor step "
        f"{first['step']}, rank {first['rank']}: target {first['target']:.7g} vs reference {first['ref']:.7g} "
        f"(rel diff {num(first['rel_diff'])})"
    )
    loss = c.get("loss_step")
    if loss is not None:
        rel = "before" if first["step"] < loss else "not before"
        lines.append(f"  {rel} the loss, which leaves its band at monitor step {loss}")
    else:
        lines.append("  the loss stays inside its band (or was not compared by iteration)")
    for o in c.get("next", [])[:5]:
        lines.append(f"  then: {text(o['prefix'])} {text(o['name'])} ({o['stat']}) at step {o['step']}")
    h = c["handoff"]
    lines.append(f"dump next: steps {h['steps']}, scope {text(h['module'])}; msprobe config.json:")
    lines.append(json.dumps(h["config"]))
    lines.append(
        "then, with both runs dumped with it: dumpstore ingest TARGET_DUMP REF_DUMP --run t_dump --run r_dump && "
        "dumpstore divergence --target t_dump --ref r_dump"
    )
    return lines


def _health(st, run, rank, fmt):
    from dataclasses import asdict

    from dumpstore.analysis.longrun_health import long_run_health

    rep = long_run_health(st, run, rank=rank)
    if fmt == "json":
        body = rep.to_dict()
        click.echo(to_json(contract("curves", st.root, body, run=body.pop("run"))))
    elif fmt == "csv":
        cols = ["check", "status", "step", "value", "detail"]
        click.echo(rows_out(cols, [asdict(f) for f in rep.findings], "csv"))
    else:
        lines = [f"health of long run {text(run)}: {rep.summary}"]
        for f in rep.findings:
            at = f" at step {f.step}" if f.step is not None else ""
            lines.append(f"  {f.status.upper():5s} {f.check}{at}: {text(f.detail)}")
        if rep.msprobe_flagged is not None:
            lines.extend(flagged_lines(rep.msprobe_flagged, text, num))
        click.echo("\n".join(lines))


def register(main: click.Group) -> None:
    for cmd in (longrun_ingest, longruns, curves):
        main.add_command(cmd)

"""`dumpstore longrun-ingest | longruns | curves`: training logs, TensorBoard events, msprobe monitor output."""

from __future__ import annotations

from pathlib import Path

import click

from .options import store_option
from .render import output_options, render, text, to_json


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
        click.echo(to_json(row))
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


def register(main: click.Group) -> None:
    for cmd in (longrun_ingest, longruns):
        main.add_command(cmd)

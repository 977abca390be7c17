"""`dumpstore replay`: recompute each recorded op on the CPU in float64 and judge the run's own output."""

from __future__ import annotations

from pathlib import Path

import click

from .options import store_option
from .render import finding_line, format_table, num, output_options, rows_out, text, to_json

COLUMNS = ["step", "rank", "record", "output", "dtype", "status", "metric", "err", "cpu_err", "ratio", "threshold"]
REF_COLUMNS = ["ref_err", "ref_ratio", "ref_status"]


@click.command()
@click.option("--run", "run", required=True, help="Run to replay (a tensor-mode dump).")
@click.option("--ref", default=None, help="Also replay this run and show its local errors beside the run's.")
@click.option("--step", "steps", type=int, multiple=True, help="Only this step (repeatable).")
@click.option("--op-type", "op_types", multiple=True, help="Only this API, e.g. gelu or Functional.gelu (repeatable).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option(
    "--acc-csv",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the run's results as msprobe acc_check's result CSV (FILE) and details CSV (beside it).",
)
@click.option("--all", "show_all", is_flag=True, help="List every output, not only those that failed or errored.")
@store_option
@output_options
def replay(run, ref, steps, op_types, jobs, acc_csv, show_all, store, fmt):
    """Replay each recorded API call of a tensor dump on the CPU, in float64 and in the recorded dtype, and judge
    the run's recorded output by msprobe's precision standards (docs/replay.md); needs `dumpstore[replay]` (torch).

    The first op over its standard is the culprit of kind `kernel`; no reference run is needed. Results go into the
    store (view `replay`). Statistics-mode dumps are refused."""
    from dumpstore.analysis.replay import kernel_finding, replay_run, side_by_side, write_acc_check_csv
    from dumpstore.store import open_store

    s = open_store(store)
    kw = {"steps": list(steps) or None, "op_types": list(op_types) or None, "jobs": jobs}
    df = replay_run(s, run, **kw)
    if ref is not None:
        replay_run(s, ref, **kw)
    written = write_acc_check_csv(df, acc_csv) if acc_csv is not None else None
    finding = kernel_finding(s, run, ref=ref)
    rows = df.to_dicts()
    if ref is not None:  # the reference's error, ratio and status beside each output of the target
        key = lambda r: (r["step"], r["rank"], r["record"], r["output"])  # noqa: E731
        refs = {key(r): r for r in side_by_side(s, run, ref).to_dicts()}
        rows = [{**r, **{k: v for k, v in refs.get(key(r), {}).items() if k.startswith("ref_")}} for r in rows]
    counts = _counts(df)
    if fmt == "json":
        out = {"run": run, "ref": ref, "counts": counts, "kernel": None if finding is None else finding.__dict__}
        click.echo(to_json({**out, "rows": rows}))  # with --ref: the ref_* columns beside each output
        return
    cols = COLUMNS + (REF_COLUMNS if ref is not None else []) + ["reason"]
    if fmt == "csv":
        click.echo(rows_out(cols + ["name", "standard", "api_level", "same_as"], rows, "csv"))
        return
    click.echo(f"replay of run {text(run)}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    click.echo(finding_line("kernel", None if finding is None else _finding_dict(finding)))
    shown = [r for r in rows if show_all or r.get("status") in ("fail", "error")]
    if shown:
        click.echo(format_table(cols, [[_cell(r.get(c)) for c in cols] for r in shown], max_width=90))
    if written is not None:
        click.echo(f"acc_check-shaped CSVs: {text(written[0])}, {text(written[1])}", err=True)


def _finding_dict(f) -> dict:
    return {
        k: getattr(f, k)
        for k in ("step", "rank", "op", "name", "kind", "metric", "value", "threshold", "source", "dtype", "detail")
    }


def _cell(v) -> str:
    return num(v) if isinstance(v, float) else "" if v is None else text(v)


def _counts(df) -> dict[str, int]:
    """Outputs by status, and the calls not replayed."""
    outs = df.filter(df["output"].is_not_null())
    counts = {s: int((outs["status"] == s).sum()) for s in ("pass", "fail", "error", "no_standard")}
    counts["skipped_calls"] = int((df["status"] == "skipped").sum())
    counts["unreplayable_calls"] = int(((df["status"] == "error") & df["output"].is_null()).sum())
    return counts

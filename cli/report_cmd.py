"""`dumpstore report`: write the comparison as CSV (msprobe's columns plus dumpstore's) and/or one HTML page."""

from __future__ import annotations

from pathlib import Path

import click

from .compare_cmds import _common
from .render import Stages, finding_line, text


def _report(
    store: Path | None,
    target: str,
    ref: str,
    exact: bool,
    steps: tuple[int, ...],
    ranks: tuple[int, ...],
    tol: tuple[str, ...],
    maps: tuple[str, ...],
    html_path: Path | None,
    csv_path: Path | None,
    only_differing: bool,
) -> None:
    """Write a shareable report of TARGET against REF: --html (one self-contained page) and/or --csv."""
    if html_path is None and csv_path is None:
        raise click.UsageError(
            "nothing to write: give --html PATH, --csv PATH or both (e.g. --html report.html --csv report.csv)"
        )
    from dumpstore.analysis.report import analyze, plotly_js, write_csv, write_report_html
    from dumpstore.store import open_store

    if html_path is not None:
        plotly_js()  # fail before the comparison when the page's plotly.js is missing
    st = open_store(store)
    from dumpstore.analysis.tolerance import Tolerances

    if csv_path is not None and not exact:  # msprobe's tensor-mode cells are computed from the files
        exact = all(st.run_info(run).get("dump_mode") == "tensor" for run in (target, ref))

    with Stages("report") as progress:
        data = analyze(
            st,
            target,
            ref,
            steps=list(steps) or None,
            ranks=list(ranks) or None,
            tolerances=Tolerances.parse(tol),
            exact=exact,
            maps=tuple(maps),
            progress=progress,
        )
    v = data.verdict.to_dict()
    from dumpstore.analysis.explain import explain_findings, run_modes

    from .compare_cmds import _warn_modes, explanation_lines

    notes = _warn_modes(run_modes(st, target, ref), target, ref, exact)
    explained = explain_findings(st, data.verdict)
    click.echo(finding_line("FIRST DIVERGENCE", v["first_divergence"]))
    if v["first_divergence"] is not None:
        click.echo(finding_line("CULPRIT", v["culprit"]))
        said = explained.get("culprit")
        if said is not None:
            for line in explanation_lines({"explanation": said.to_dict()}, config=False):
                click.echo(text(line))
    from .compare_cmds import kernel_of

    kernel = kernel_of(store, target, ref)
    if kernel is not None:  # the target was replayed (dumpstore replay) and an op's own output is off its standard
        click.echo(finding_line("KERNEL", kernel))
    if csv_path is not None:
        with Stages("report") as progress:
            n = write_csv(data.cmp, csv_path, store=st, progress=progress, only_differing=only_differing)
        click.echo(f"wrote {csv_path} ({n} rows)")
    if html_path is not None:
        with Stages("report") as progress:
            size = write_report_html(
                data, st, html_path, progress=progress, only_differing=only_differing, explained=explained, notes=notes
            )
        click.echo(f"wrote {html_path} ({size / 1e6:.1f} MB, self-contained)")


_html = click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write one self-contained HTML page (verdict, charts, training curves, every compared row, stack, runs).",
)
_csv = click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write one CSV row per aligned leaf: msprobe's column names plus dumpstore's.",
)

_only = click.option(
    "--only-differing",
    is_flag=True,
    help="Write only the rows that differ (status not pass) to the CSV and the page's table (the charts keep all).",
)

report = click.command(name="report")(_common(_only(_csv(_html(_report)))))

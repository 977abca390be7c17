"""`dumpstore compare | divergence | overflow`: render the analysis library's answers."""

from __future__ import annotations

import click

from .options import engine_options, noise_ref_option, store_option
from .render import contract, finding_line, num, output_options, render, rows_out, text, to_json


def _common(fn):
    fn = click.option(
        "--map",
        "maps",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False),
        help="msprobe-style mapping YAML (-dm data rows, -cm module or -am API renames, or an "
        "-lm layer mapping), repeatable.",
    )(fn)
    fn = click.option(
        "--tol",
        "tol",
        multiple=True,
        metavar="[DTYPE=]VALUE",
        callback=checked_tol,
        help="Relative-L2 tolerance, for all dtypes or one (repeatable), e.g. --tol bfloat16=2e-2 (bf16, fp16, "
        "fp32, half, float, ... accepted).",
    )(fn)
    fn = click.option("--rank", "ranks", type=int, multiple=True, help="Only this rank (repeatable).")(fn)
    fn = click.option("--step", "steps", type=int, multiple=True, help="Only this step (repeatable).")(fn)
    fn = click.option("--exact", is_flag=True, help="Read both runs' tensor files for exact (msprobe) metrics.")(fn)
    fn = click.option("--ref", required=True, help="Reference run name.")(fn)
    fn = click.option("--target", required=True, help="Target run name.")(fn)
    return store_option(fn)


def checked_tol(ctx, param, value):
    """--tol checked when parsed: an unknown dtype name or a bad number is a usage error (exit 2)."""
    from dumpstore.analysis.tolerance import ToleranceError, Tolerances

    try:
        Tolerances.parse(value)
    except ToleranceError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def compare_options(steps, ranks, tol, exact, maps, noise_ref=None) -> dict:
    """The options shared by compare, divergence and report, as keyword arguments of the library."""
    from dumpstore.analysis.mapping import load_mapping
    from dumpstore.analysis.tolerance import Tolerances

    return {
        "steps": list(steps) or None,
        "ranks": list(ranks) or None,
        "tolerances": Tolerances.parse(tol),
        "exact": exact,
        "mapping": load_mapping(maps),
        **({"noise_ref": noise_ref} if noise_ref else {}),
    }


def run_compare(store, target, ref, steps, ranks, tol, exact, maps=(), noise_ref=None):
    from dumpstore.analysis.compare import compare_runs
    from dumpstore.store import open_store

    options = compare_options(steps, ranks, tol, exact, maps, noise_ref)
    return compare_runs(open_store(store), target, ref, **options)


@click.command()
@_common
@click.option("--top", type=click.IntRange(min=0), default=20, show_default=True, help="Rows to show (0: all).")
@click.option(
    "--by",
    default="significance",
    show_default=True,
    type=click.Choice(["significance", "severity", "rel_l2", "max_abs_err", "max_rel_err", "cosine"]),
    help="Sort metric (significance: error over the noise the pair carries there; see analysis/rank.py).",
)
@click.option("--direction", type=click.Choice(["forward", "backward", "parameters_grad"]), default=None)
@click.option("--module", default=None, help="Only records in modules whose name contains this.")
@click.option("--op-type", default=None, help="Only ops whose type contains this (linear, softmax, ...).")
@click.option("--io", default=None, type=click.Choice(["input", "output", "parameters", "parameters_grad"]))
@click.option(
    "--culprit-first/--no-culprit-first",
    default=True,
    show_default=True,
    help="By significance: the divergence verdict's culprit (over all steps, memoized in the store) comes first.",
)
@noise_ref_option
@output_options
@engine_options
def compare(
    store,
    target,
    ref,
    exact,
    steps,
    ranks,
    tol,
    maps,
    noise_ref,
    top,
    by,
    direction,
    module,
    op_type,
    io,
    culprit_first,
    fmt,
    engine,
    address,
    batch,
):
    """Rank aligned tensors by mismatch (worst first), with the threshold each verdict used."""
    from dumpstore.analysis.rank import rank_rows

    ranking = {"by": by, "top": top or None, "direction": direction, "module": module, "op_type": op_type, "io": io}
    if engine == "ray":
        from dumpstore.analysis.distributed import ranked
        from dumpstore.store import open_store

        if culprit_first and by == "significance":  # the Ray engine's verdict, as the local engine's below
            cluster = {"address": address, "batch": batch}
            ranking["culprit"] = _culprit(store, None, target, ref, steps, ranks, tol, exact, maps, noise_ref, cluster)
        table = ranked(
            open_store(store),
            target,
            ref,
            rank_options=ranking,
            address=address,
            batch=batch,
            **compare_options(steps, ranks, tol, exact, maps, noise_ref),
        )
    else:
        from dumpstore.analysis.rank import check_filters

        cmp = run_compare(store, target, ref, steps, ranks, tol, exact, maps, noise_ref)
        check_filters(cmp, module=module, op_type=op_type)
        if culprit_first and by == "significance":
            ranking["culprit"] = _culprit(store, cmp, target, ref, steps, ranks, tol, exact, maps, noise_ref)
        table = rank_rows(cmp, **ranking)
    from dumpstore.analysis.explain import run_modes

    _warn_modes(run_modes(store, target, ref), target, ref, exact)
    if fmt == "json":
        rows = table.to_dicts()
        click.echo(to_json(contract("compare", store, {"by": by, "rows": rows}, target=target, ref=ref)))
        return
    click.echo(render(table.to_arrow(), fmt))


def _culprit(store, cmp, target, ref, steps, ranks, tol, exact, maps, noise_ref, cluster=None):
    """The culprit of `dumpstore divergence` over every step of the selected ranks (memoized in the store: after
    a divergence run no second verdict is computed); taken from `cmp` when it holds every step; `cluster`: the
    Ray engine's options (address, batch) to reach it there."""
    from dumpstore.analysis.verdict import answer

    q = question(target, ref, (), ranks, tol, exact, maps, noise_ref)
    return answer(store, q, comparison=None if steps else cmp, cluster=cluster).culprit


@click.command()
@_common
@output_options
@click.option("--check", is_flag=True, help="Exit 3 when the runs diverge.")
@click.option(
    "--no-cache",
    is_flag=True,
    help="Recompute even when the store holds this verdict for the same ingests (see README, memo).",
)
@noise_ref_option
@engine_options
def divergence(
    store, target, ref, exact, steps, ranks, tol, maps, fmt, check, no_cache, noise_ref, engine, address, batch
):
    """The verdict: first divergence, culprit, per-step timeline, ranks, unmatched ops.

    --json prints one object; --csv one row per finding (first divergence, culprit, and the kernel replay found
    when the target was replayed)."""
    cluster = {"address": address, "batch": batch} if engine == "ray" else None
    v = verdict(
        store, target, ref, steps, ranks, tol, exact, maps, use_memo=not no_cache, cluster=cluster, noise_ref=noise_ref
    )
    with_explanations(store, question(target, ref, steps, ranks, tol, exact, maps, noise_ref), v, use_memo=not no_cache)
    v["modes"]["notes"] = _warn_modes(v["modes"], target, ref, exact)
    v["kernel"] = kernel_of(store, target, ref)
    click.echo(verdict_out(v, fmt, store))
    if check and v["first_divergence"] is not None:
        raise SystemExit(3)
    missing = (v.get("not_judged") or {}).get("exact_unavailable")
    if check and missing:  # no divergence among what was compared, but --exact could not compare everything
        click.echo(
            f"Error: --check: {missing} tensor pairs were not compared (--exact); the runs are not shown to agree",
            err=True,
        )
        raise SystemExit(1)


FINDING_COLUMNS = [
    "finding",
    "step",
    "rank",
    "op",
    "name",
    "kind",
    "metric",
    "value",
    "threshold",
    "source",
    "dtype",
    "severity",
    "detail",
    "module",
    "module_class",
    "parameter",
    "argument",
    "target_value",
    "ref_value",
    "source_line",
    "advice",
]


REPLAY_DIR = "replay"  # dumpstore.replaytable.REPLAY_DIR (which imports pyarrow; tests/test_replay.py holds them equal)


def kernel_of(store, target: str, ref: str | None) -> dict | None:
    """The target's first op over its replay standard (culprit kind `kernel`, docs/replay.md) when the target was
    replayed (`dumpstore replay`), with the reference's local error beside it when that was replayed too; None
    otherwise (nothing is imported or read for a run never replayed)."""
    from pathlib import Path

    from dumpstore.store import default_store_path  # a light module: no pyarrow

    root = Path(store) if store is not None else default_store_path()
    if not (root / REPLAY_DIR / f"run={target}").is_dir():  # a path test: a memoised answer imports nothing
        return None
    from dataclasses import asdict

    from dumpstore.analysis.replay.findings import kernel_finding
    from dumpstore.store import open_store

    f = kernel_finding(open_store(store), target, ref=ref)  # None where the live ingest was not replayed
    return asdict(f) if f is not None else None


def with_explanations(store, q, v: dict, *, use_memo: bool = True) -> dict:
    """Each finding of the verdict dict gets its `explanation` (analysis/explain.py): module, parameter,
    argument, source line, advice and the msprobe config for the next dump."""
    from dumpstore.analysis.explain import explain_answer

    said = explain_answer(store, q, v, use_memo=use_memo)
    for key in ("first_divergence", "culprit"):
        if v.get(key) is not None:
            v[key]["explanation"] = said.get(key)
    v["modes"] = dict(said.get("modes") or {})
    return v


def _warn_modes(modes: dict | None, target: str, ref: str, exact: bool) -> list[str]:
    """Mixed dump modes and an --exact that fell back: one `warning:` line each on stderr; returned for the
    verdict's header and JSON."""
    from dumpstore.analysis.explain import mode_notes

    notes = mode_notes(modes, target, ref, exact)
    for n in notes:
        click.echo(f"warning: {text(n)}", err=True)
    return notes


def _csv_finding(label: str, f: dict) -> dict:
    """One CSV row of a finding: its fields, then its explanation flattened."""
    from dumpstore.analysis.explain import source_text

    ex = f.get("explanation") or {}
    arg, par = ex.get("argument") or {}, ex.get("parameter") or {}
    return {
        "finding": label,
        **{k: v for k, v in f.items() if k not in ("evidence", "explanation")},
        "module": ex.get("module"),
        "module_class": ex.get("module_class"),
        "parameter": par.get("name"),
        "argument": arg.get("name"),
        "target_value": arg.get("target"),
        "ref_value": arg.get("ref"),
        "source_line": source_text(ex["source"]) if ex.get("source") else None,
        "advice": ex.get("advice"),
    }


def explanation_lines(f: dict | None, *, config: bool) -> list[str]:
    """The lines under a verdict line: where, parameter, argument, fix, and (`config`) the next dump's
    msprobe config.json on one line."""
    import json

    from dumpstore.analysis.explain import Explanation

    ex = (f or {}).get("explanation")
    if not ex:
        return []
    e = Explanation(**ex)
    out = [f"  {label}: {body}" for label, body in e.lines()]
    if config and e.next_dump:
        out.append(f"  next: dump it at tensor level with this msprobe config.json: {json.dumps(e.next_dump)}")
    return out


def verdict_out(v: dict, fmt: str, store=None) -> str:
    """The verdict as text (the default), one JSON object, or CSV with one row per finding."""
    if fmt == "json":
        return to_json(verdict_json(v, store))
    if fmt == "csv":
        rows = [
            _csv_finding(label, f)
            for label, f in (
                ("first_divergence", v["first_divergence"]),
                ("culprit", v["culprit"]),
                ("kernel", v.get("kernel")),
            )
            if f is not None
        ]
        return rows_out(FINDING_COLUMNS, rows, "csv")
    return verdict_text(v)


def verdict_json(v: dict, store) -> dict:
    """`divergence --json`: the verdict with the contract's keys; the largest error of a step or rank is
    `max_rel_l2` (the relative L2 error is `rel_l2` in every output)."""
    body = {k: x for k, x in v.items() if k not in ("target", "ref")}
    for key in ("steps", "ranks"):
        body[key] = [{("max_rel_l2" if k == "max_err" else k): x for k, x in s.items()} for s in v.get(key, [])]
    return contract("divergence", store, body, target=v["target"], ref=v["ref"])


def question(target, ref, steps, ranks, tol, exact, maps, noise_ref=None):
    from dumpstore.analysis.tolerance import Tolerances
    from dumpstore.analysis.verdict import Question

    return Question(
        target, ref, tuple(steps) or None, tuple(ranks) or None, Tolerances.parse(tol), tuple(maps), exact, noise_ref
    )


def verdict(
    store,
    target,
    ref,
    steps,
    ranks,
    tol,
    exact,
    maps,
    *,
    use_memo: bool = True,
    cluster: dict | None = None,
    noise_ref: str | None = None,
) -> dict:
    """The divergence verdict as a dict (the library's memoized answer; `cluster`: screened on Ray)."""
    from dumpstore.analysis.verdict import answer

    q = question(target, ref, steps, ranks, tol, exact, maps, noise_ref)
    return answer(store, q, use_memo=use_memo, cluster=cluster).to_dict()


def noise_line(v: dict) -> str:
    """A quiet verdict says so: the runs agree within the noise measured from the pair itself."""
    n, over = v.get("noise") or {}, v["counts"].get("diverged", 0)
    line = "AGREE within the measured noise"
    if v["counts"].get("unknown"):
        line += " (on what could be judged: see NOT JUDGED)"
    if over:
        line += f": {over} tensors over their tolerance, none standing out"
    flips = [f for f in n.get("discrete_flips") or [] if not f.get("possible")]
    if flips:
        f = flips[0]
        line += (
            f"; {len(flips)} discrete outputs changed on near ties, noise (first: step {f['step']} rank {f['rank']}"
            f" {f['op']})"
        )
    for f in [f for f in n.get("discrete_flips") or [] if f.get("possible")]:
        line += f"; step {f['step']} rank {f['rank']}: {f['detail']}"
    carried = n.get("carried_dtypes") or []
    if carried:
        c = carried[0]
        line += (
            f"; {len(carried)} inputs differ in dtype, carried from a recorded op's output (first: step "
            f"{c['step']} rank {c['rank']} {c['input']} {c['dtype']}/{c['ref_dtype']} from {c['from']})"
        )
    if n.get("largest_amplification") is not None:
        line += (
            f"; largest amplification {num(n['largest_amplification'])}x at step {n['step']} rank {n['rank']}"
            f" {n['op']} (p{round(100 * n['quantile'])} {num(n['amplification_quantile'])}x)"
        )
    return line


def not_judged_lines(v: dict) -> list[str]:
    """What the verdict could not judge, said (never a silent pass): pairs --exact could not read again, and the other
    `unknown` pairs (NaN/Inf in both runs hiding their finite values, no statistics to compare)."""
    nj = v.get("not_judged") or {}
    exact = int(nj.get("exact_unavailable") or 0)
    other = int(v["counts"].get("unknown", 0)) - exact
    lines = []
    if exact:
        lines.append(f"NOT JUDGED: {exact} tensor pairs --exact could not compare, left unknown ({nj.get('first')})")
    if other > 0:
        lines.append(
            f"NOT JUDGED: {other} tensor pairs unknown (NaN/Inf in both runs hiding their finite values, or nothing "
            f"comparable dumped); `dumpstore compare --target {v['target']} --ref {v['ref']}` lists them"
        )
    return lines


def verdict_text(v: dict) -> str:
    """The verdict for the terminal: coverage and precision, the two verdict lines, the timeline, ranks, unmatched
    records; every line terminal-safe."""
    p, c = v["precision"], v["coverage"]
    lines = [
        f"target {v['target']} vs reference {v['ref']}: steps {c['common_steps']}, ranks {c['common_ranks']}; "
        f"compute precision {p['target']} vs {p['ref']} (judged at {p['floor']})"
    ]
    for note in (v.get("modes") or {}).get("notes") or []:
        lines.append(f"modes: {note}")
    if p["target"] != p["ref"]:
        lines.append(
            f"mixed precision: the runs compute in {p['target']} and {p['ref']}; every tensor is judged "
            f"at the {p['floor']} tolerance"
        )
    if p.get("note"):
        lines.append(p["note"])
    if p.get("noise_ref"):
        lines.append(f"noise band per tensor: 3x its error in {p['noise_ref']} against {v['ref']}")
    for side in ("target", "ref"):
        extra = sorted(set(c[f"{side}_steps"]) - set(c["common_steps"]))
        if extra:
            lines.append(f"steps only in the {side}: {extra} (not compared)")
    first, culprit = v["first_divergence"], v["culprit"]
    lines.append(finding_line("FIRST DIVERGENCE", first))
    if not (culprit and first and culprit.get("op") == first.get("op")):
        lines += [x for x in explanation_lines(first, config=False) if not x.startswith("  fix:")]
    lines.append(finding_line("CULPRIT", culprit))
    lines += explanation_lines(culprit, config=True)
    if v.get("kernel"):  # the target was replayed (dumpstore replay) and an op's own output is off its standard
        lines.append(finding_line("KERNEL", v["kernel"]))
    if v["first_divergence"] is None and v["culprit"] is None:
        lines.append(noise_line(v))
    lines.extend(not_judged_lines(v))
    for s in v["steps"]:
        lines.append(
            f"  step {s['step']}: {s['compared']} compared, {s['diverged']} diverged, "
            f"{s['unmatched']} unmatched, max rel_l2 {num(s['max_err'])}, "
            f"first {s['first_divergence'] or '-'}"
        )
    if len(v["ranks"]) > 1:
        for r in v["ranks"]:
            flag = "  <- disagrees with its peers" if r["disagrees_with_peers"] else ""
            first = r["first_divergence"] or "-"
            lines.append(f"  rank {r['rank']}: {r['diverged']} diverged, first {first}{flag}")
    if v["unmatched"]:
        first = v["unmatched"][0]
        lines.append(
            f"unmatched: {len(v['unmatched'])} records in one run only (first: step {first['step']} "
            f"rank {first['rank']} {first['op']}, only in the {first['side']})"
        )
    return "\n".join(text(line) for line in lines)


@click.command()
@click.option("--run", "run", required=True, help="Run to scan.")
@click.option("--ref", default=None, help="Reference run: what it also has is not overflow.")
@click.option("--step", "steps", type=int, multiple=True, help="Only this step (repeatable).")
@click.option("--rank", "ranks", type=int, multiple=True, help="Only this rank (repeatable).")
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Dirty tensors listed (0: all; --json and --csv list all).",
)
@store_option
@output_options
@engine_options
def overflow(run, ref, steps, ranks, top, store, fmt, engine, address, batch):
    """NaN, +-Inf and saturated (+-finfo.max) values and the op that produced them first.

    --json prints one object; --csv one row per dirty tensor."""
    from dumpstore.analysis._overflow import overflow as scan
    from dumpstore.store import open_store

    cluster = {}
    if engine == "ray":
        from dumpstore.analysis.distributed import overflow as scan  # noqa: F811

        cluster = {"address": address, "batch": batch}
    rep = scan(open_store(store), run, ref=ref, steps=list(steps) or None, ranks=list(ranks) or None, **cluster)
    if fmt == "json":
        body = rep.to_dict()
        click.echo(to_json(contract("overflow", store, body, run=body.pop("run"), ref=body.pop("ref"))))
    elif fmt == "csv":
        click.echo(render(rep.tensors.to_arrow(), "csv"))
    else:
        click.echo(overflow_text(rep, top))


def overflow_text(rep, top: int) -> str:
    """The first overflow (the verdict line), the counts, and the first `top` dirty tensors (0: all)."""
    head = finding_line("FIRST OVERFLOW", rep.first_overflow)
    lines = [
        head + (f"  (beyond reference {text(rep.ref)})" if rep.ref else ""),
        f"{len(rep.producers)} producers (clean inputs, dirty output); {rep.tensors.height} dirty tensors",
    ]
    masked = [p for p in rep.producers if p.get("masked")]
    if masked:
        p = masked[0]
        lines.append(
            f"MASKED: {len(masked)} producers whose NaN/Inf every path discards, not overflow (first: step "
            f"{p['step']} rank {p['rank']} {text(p['op'])}, ended by {text(p['masked_by'])})"
        )
    if rep.tensors.height:
        shown = rep.tensors if top == 0 else rep.tensors.head(top)
        lines.append(render(shown.to_arrow(), "table"))
    return "\n".join(lines)

"""`dumpstore compare | divergence | overflow`: render the analysis library's answers."""

from __future__ import annotations

import math
from pathlib import Path

import click

from .options import engine_options, store_option
from .output import output_options, render, to_json


def _common(fn):
    fn = click.option("--map", "maps", multiple=True, type=click.Path(exists=True, dir_okay=False),
                      help="msprobe-style mapping YAML (data rows, module or API renames), repeatable.")(fn)
    fn = click.option("--tol", "tol", multiple=True, metavar="[DTYPE=]VALUE",
                      help="Relative-L2 tolerance, for all dtypes or one (repeatable), e.g. --tol bfloat16=2e-2.")(fn)
    fn = click.option("--rank", "ranks", type=int, multiple=True, help="Only this rank (repeatable).")(fn)
    fn = click.option("--step", "steps", type=int, multiple=True, help="Only this step (repeatable).")(fn)
    fn = click.option("--exact", is_flag=True, help="Read both runs' tensor files for exact (msprobe) metrics.")(fn)
    fn = click.option("--ref", required=True, help="Reference run name.")(fn)
    fn = click.option("--target", required=True, help="Target run name.")(fn)
    return store_option(fn)


def compare_options(steps, ranks, tol, exact, maps) -> dict:
    """The options shared by compare, divergence and report, as keyword arguments of the library."""
    from dumpstore.analysis.mapping import load_mapping
    from dumpstore.analysis.tolerance import Tolerances

    return {"steps": list(steps) or None, "ranks": list(ranks) or None, "tolerances": Tolerances.parse(tol),
            "exact": exact, "mapping": load_mapping(maps)}


def run_compare(store, target, ref, steps, ranks, tol, exact, maps=()):
    from dumpstore.analysis.compare import compare_runs
    from dumpstore.store import open_store

    return compare_runs(open_store(store), target, ref, **compare_options(steps, ranks, tol, exact, maps))


@click.command()
@_common
@click.option("--top", type=int, default=20, show_default=True, help="Rows to show (0: all).")
@click.option("--by", default="severity", show_default=True,
              type=click.Choice(["severity", "err", "max_abs_err", "max_rel_err", "cosine"]), help="Sort metric.")
@click.option("--direction", type=click.Choice(["forward", "backward", "parameters_grad"]), default=None)
@click.option("--module", default=None, help="Only records in modules whose name contains this.")
@click.option("--op-type", default=None, help="Only ops whose type contains this (linear, softmax, ...).")
@click.option("--io", default=None, type=click.Choice(["input", "output", "parameters", "parameters_grad"]))
@output_options
@engine_options
def compare(store, target, ref, exact, steps, ranks, tol, maps, top, by, direction, module, op_type, io, fmt,
            engine, address, batch):
    """Rank aligned tensors by mismatch (worst first), with the threshold each verdict used."""
    from dumpstore.analysis.rank import rank_rows

    ranking = {"by": by, "top": top or None, "direction": direction, "module": module, "op_type": op_type, "io": io}
    if engine == "ray":
        from dumpstore.analysis.distributed import ranked
        from dumpstore.store import open_store

        table = ranked(open_store(store), target, ref, rank_options=ranking, address=address, batch=batch,
                       **compare_options(steps, ranks, tol, exact, maps))
    else:
        table = rank_rows(run_compare(store, target, ref, steps, ranks, tol, exact, maps), **ranking)
    click.echo(render(table.to_arrow(), fmt))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.3g}"
    return str(v)


def finding_line(label: str, f: dict | None) -> str:
    if f is None:
        return f"{label}: none"
    op, name = f["op"], f["name"]
    where = f"step {f['step']} rank {f['rank']}  {op}"
    leaf = f"  {name.removeprefix(op + '.')}" if name and op and name.startswith(op) else ""
    cmp = ""
    if f["value"] is not None and f["threshold"] is not None:
        rel = ">" if (f["value"] > f["threshold"]) else "<="
        cmp = f"  {f['metric']}={_fmt(f['value'])} {rel} tol={_fmt(f['threshold'])} ({f['dtype']}, {f['source']})"
    detail = f"  [{f['detail']}]" if f["detail"] else ""
    return f"{label} ({f['kind']}): {where}{leaf}{cmp}{detail}"


@click.command()
@_common
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--check", is_flag=True, help="Exit 3 when the runs diverge.")
@click.option("--no-cache", is_flag=True,
              help="Recompute even when the store holds this verdict for the same ingests (see README, memo).")
@engine_options
def divergence(store, target, ref, exact, steps, ranks, tol, maps, as_json, check, no_cache, engine, address, batch):
    """The verdict: first divergence, culprit, per-step timeline, ranks, unmatched ops."""
    cluster = {"address": address, "batch": batch} if engine == "ray" else None
    v = verdict(store, target, ref, steps, ranks, tol, exact, maps, use_memo=not no_cache, cluster=cluster)
    click.echo(to_json(v) if as_json else verdict_text(v))
    if check and v["first_divergence"] is not None:
        raise SystemExit(3)


def verdict(store, target, ref, steps, ranks, tol, exact, maps, *, use_memo: bool = True,
            cluster: dict | None = None) -> dict:
    """The divergence verdict as a dict: from the store's memo when it holds this question for the live ingests
    of both runs (no heavy import at all), else computed and memoized."""
    from dumpstore.analysis import memo
    from dumpstore.store import default_store_path, open_store

    options = compare_options(steps, ranks, tol, exact, maps)
    tols = options["tolerances"]
    question = {"command": "divergence", "target": target, "ref": ref, "steps": sorted(set(steps)) or None,
                "ranks": sorted(set(ranks)) or None, "exact": exact, "maps": [memo.file_digest(m) for m in maps],
                "tol": [tols.rel_l2, tols.all_dtypes, tols.amplification]}
    key = memo.key(question)
    root = Path(store) if store is not None else default_store_path()
    if use_memo:
        hit = memo.lookup(root, key, lambda: _live_ids(open_store(root), target, ref))
        if hit is not None:
            return hit
    from dumpstore.analysis.divergence import divergence_by_steps

    st = open_store(store)
    before = memo.catalog_signature(st.root)
    if cluster is not None:  # --engine ray: the same verdict, screened on the cluster
        from dumpstore.analysis.distributed import divergence_by_steps
    v = divergence_by_steps(st, target, ref, **options, **(cluster or {})).to_dict()
    memo.save(st.root, key, _live_ids(st, target, ref), before, v)
    return v


def _live_ids(st, target: str, ref: str) -> dict[str, str | None]:
    """The live ingest id of each run (None for a run not in the catalog), from one catalog read."""
    live = {row["run"]: row["ingest_id"] for row in st.runs().to_pylist()}
    return {run: live.get(run) for run in (target, ref)}


def verdict_text(v: dict) -> str:
    p, c = v["precision"], v["coverage"]
    lines = [f"target {v['target']} vs reference {v['ref']}: steps {c['common_steps']}, ranks {c['common_ranks']}; "
             f"compute precision {p['target']} vs {p['ref']} (judged at {p['floor']})"]
    if p["target"] != p["ref"]:
        lines.append(f"mixed precision: the runs compute in {p['target']} and {p['ref']}; every tensor is judged "
                     f"at the {p['floor']} tolerance")
    for side in ("target", "ref"):
        extra = sorted(set(c[f"{side}_steps"]) - set(c["common_steps"]))
        if extra:
            lines.append(f"steps only in the {side}: {extra} (not compared)")
    lines.append(finding_line("FIRST DIVERGENCE", v["first_divergence"]))
    lines.append(finding_line("CULPRIT", v["culprit"]))
    for s in v["steps"]:
        lines.append(f"  step {s['step']}: {s['compared']} compared, {s['diverged']} diverged, "
                     f"{s['unmatched']} unmatched, max rel_l2 {_fmt(s['max_err'])}, "
                     f"first {s['first_divergence'] or '-'}")
    if len(v["ranks"]) > 1:
        for r in v["ranks"]:
            flag = "  <- disagrees with its peers" if r["disagrees_with_peers"] else ""
            lines.append(f"  rank {r['rank']}: {r['diverged']} diverged, first {r['first_divergence'] or '-'}{flag}")
    if v["unmatched"]:
        first = v["unmatched"][0]
        lines.append(f"unmatched: {len(v['unmatched'])} records in one run only (first: step {first['step']} "
                     f"rank {first['rank']} {first['op']}, only in the {first['side']})")
    return "\n".join(lines)


@click.command()
@click.option("--run", "run", required=True, help="Run to scan.")
@click.option("--ref", default=None, help="Reference run: what it also has is not overflow.")
@click.option("--step", "steps", type=int, multiple=True)
@click.option("--rank", "ranks", type=int, multiple=True)
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@engine_options
def overflow(run, ref, steps, ranks, store, as_json, engine, address, batch):
    """NaN, +-Inf and saturated (+-finfo.max) values and the op that produced them first."""
    from dumpstore.analysis.overflow import overflow as scan
    from dumpstore.store import open_store

    cluster = {}
    if engine == "ray":
        from dumpstore.analysis.distributed import overflow as scan  # noqa: F811
        cluster = {"address": address, "batch": batch}
    rep = scan(open_store(store), run, ref=ref, steps=list(steps) or None, ranks=list(ranks) or None, **cluster)
    if as_json:
        click.echo(to_json(rep.to_dict()))
        return
    f = rep.first_overflow
    head = (f"FIRST OVERFLOW ({f['kind']}): step {f['step']} rank {f['rank']}  {f['op']}  {f['name']}"
            if f else "FIRST OVERFLOW: none")
    click.echo(head + (f"  (beyond reference {ref})" if ref else ""))
    click.echo(f"{len(rep.producers)} producers (clean inputs, dirty output); {rep.tensors.height} dirty tensors")
    if rep.tensors.height:
        click.echo(render(rep.tensors.head(20).to_arrow(), "table"))

"""The HTML page's sections as markup: verdict cards, charts' frames, top rows, stacks, checklist, health, runs.

Every string that comes from a dump (names, paths, stack lines) is HTML-escaped here (`esc`).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dumpstore.errors import DumpstoreError

from .._checklist import Checklist
from .._health import HealthReport
from .._overflow import OverflowReport
from ..compare import Comparison
from ..explain import Explanation
from ..verdict import Finding, Verdict
from .culprit import culprit_words
from .data import fetch
from .rows import STATUS_ORDER
from .text import counts_text, esc, finding_metric, fmt, summary_line

MAX_TABLE_ROWS = 500  # rows per page of the all-rows table
STACK_SQL = "SELECT frames FROM stacks WHERE run = $run AND step = $step AND rank = $rank AND stack_id = $sid"


def _explanation_html(ex: Explanation | None, config: bool) -> str:
    """The card's 'where / parameter / argument / fix' lines and the next dump's msprobe config.json."""
    if ex is None:
        return ""
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in ex.lines())
    out = f'<table class="kv explain">{rows}</table>' if rows else ""
    if config and ex.next_dump:
        out += (
            "<p>Next: dump it at tensor level with this msprobe <code>config.json</code>, then compare with "
            f'<code>--exact</code>:</p><pre class="next-dump">{esc(_compact_json(ex.next_dump))}</pre>'
        )
    return out


def _compact_json(obj: dict) -> str:
    """One key a line, each value on its line (a config.json short enough to read and copy)."""
    import json

    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in obj.items()) + "\n}"


def _finding_html(
    label: str,
    f: Finding | None,
    none_text: str,
    words: str | None = None,
    ex: Explanation | None = None,
    config: bool = False,
) -> str:
    if f is None:
        return f'<div class="finding none"><h3>{esc(label)}</h3><p>{esc(none_text)}</p></div>'
    metric, threshold = (
        (f.metric, fmt(f.threshold))
        if f.metric is not None
        else ("record alignment (exact name, backward renumbering)", "the record exists in both runs")
    )
    cells = [
        ("op", f.op),
        ("step / rank", f"step {f.step}, rank {f.rank}"),
        ("kind", f.kind),
        ("leaf", f.name),
        ("metric", metric),
        ("value", fmt(f.value) if f.value is not None else None),
        ("threshold", threshold),
        ("dtype", f.dtype),
        ("from", f.source),
        ("severity (value / threshold)", fmt(f.severity) if f.severity is not None else None),
        ("detail", f.detail),
    ]
    cells += [(f"evidence: {k}", fmt(v) if isinstance(v, float) else v) for k, v in (f.evidence or {}).items()]
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in cells if v is not None)
    head = f'{esc(label)}: <code class="op">{esc(f.op)}</code>'
    link = (
        f' <a class="show-rows" href="#mismatches" data-op="{esc(f.op)}" data-step="{esc(f.step)}" '
        f'data-rank="{esc(f.rank)}">show its rows</a>'
    )
    said = f'<p class="words" id="culprit-words">{esc(words)}</p>' if words else ""
    return (
        f'<div class="finding"><h3>{head}{link}</h3>{said}<p class="metric">{esc(finding_metric(f))}</p>'
        f'{_explanation_html(ex, config)}<table class="kv">{rows}</table></div>'
    )


def _overflow_html(ovf: OverflowReport | None) -> str:
    label = "First overflow"
    rule = (
        "metric: NaN / +Inf / -Inf / ±finfo.max element counts of output tensors; threshold: any such value "
        "that the reference does not also have at the aligned tensor (producer = op with clean inputs)"
    )
    if ovf is None:
        return f'<div class="finding none"><h3>{label}</h3><p>not scanned</p></div>'
    f = ovf.first_overflow
    if f is None:
        masked = sum(1 for p in ovf.producers if p.get("masked"))
        more = f" ({len(ovf.producers)} masking-like producers ignored" if ovf.producers else ""
        more += f", {masked} of them masked downstream)" if masked else (")" if ovf.producers else "")
        return (
            f'<div class="finding none"><h3>{label}</h3><p>none: no NaN/Inf/saturated value beyond the '
            f'reference{esc(more)}</p><p class="rule">{esc(rule)}</p></div>'
        )
    cells = [
        ("op", f.get("op")),
        ("step / rank", f"step {f.get('step')}, rank {f.get('rank')}"),
        ("kind", f.get("kind")),
        ("leaf", f.get("name")),
    ]
    cells += [(k, f.get(k)) for k in ("nan_count", "posinf_count", "neginf_count", "sat_count") if f.get(k) is not None]
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in cells)
    extra = f"<p>{len(ovf.producers)} producer op(s) in all.</p>" if len(ovf.producers) > 1 else ""
    return (
        f'<div class="finding bad"><h3>{label}: <code class="op">{esc(f.get("op"))}</code></h3>'
        f'<p class="rule">{esc(rule)}</p><table class="kv">{rows}</table>{extra}</div>'
    )


def _unmatched_html(verdict: Verdict, limit: int = 30) -> str:
    un = verdict.unmatched
    rule = "metric: record alignment (exact name, backward renumbering); threshold: a record present in one run only"
    if not un:
        return (
            f'<div class="finding none"><h3>Unmatched ops</h3><p>none: every record has a partner</p>'
            f'<p class="rule">{esc(rule)}</p></div>'
        )
    items = "".join(
        f"<tr><td>{esc(u['step'])}</td><td>{esc(u['rank'])}</td><td>{esc(u['side'])}</td>"
        f"<td><code>{esc(u['op'])}</code></td></tr>"
        for u in un[:limit]
    )
    more = f"<p>… and {len(un) - limit} more.</p>" if len(un) > limit else ""
    return (
        f'<div class="finding bad"><h3>Unmatched ops: {len(un)}</h3><p class="rule">{esc(rule)}</p>'
        f'<table class="grid"><tr><th>step</th><th>rank</th><th>only in</th><th>op</th></tr>{items}</table>'
        f"{more}</div>"
    )


def verdict_section(
    cmp: Comparison,
    verdict: Verdict,
    ovf: OverflowReport | None,
    rows: pl.DataFrame,
    explained: dict[str, Explanation | None] | None = None,
    notes: list[str] | None = None,
    kernel: tuple[bool, Finding | None] = (False, None),
) -> str:
    """The verdict line, the four cards (first divergence, culprit in words, overflow, unmatched), by step;
    `notes`: what the dump modes mean for this verdict (analysis/explain.py mode_notes); `kernel`: (whether the
    target was replayed, its kernel finding): a fifth card when it was (`dumpstore replay`, docs/replay.md)."""
    f = verdict.first_divergence
    words = culprit_words(rows, verdict.culprit) if verdict.culprit is not None else None
    ex = explained or {}
    modes = "".join(f'<p class="warn modes-note">modes: {esc(n)}</p>' for n in notes or [])
    said = ex.get("culprit")
    if said is not None and said.argument and verdict.culprit is not None:
        a = said.argument
        words = (
            f"The argument {a['name']} of {verdict.culprit.op} differs between the runs: "
            f"{a['target'] if a['target'] is not None else 'not given'} in the target, "
            f"{a['ref'] if a['ref'] is not None else 'not given'} in the reference."
        )
    status = "diverged" if f is not None else "pass"
    head = esc(summary_line(verdict))
    steps = "".join(
        f"<tr><td>{esc(s['step'])}</td><td>{esc(s['compared'])}</td><td>{esc(s['diverged'])}</td>"
        f"<td>{esc(s['unmatched'])}</td><td>{esc(fmt(s['max_err']))}</td><td><code>{esc(s['first_divergence'])}"
        f"</code></td></tr>"
        for s in verdict.steps
    )
    tol = cmp.tolerances
    tol_text = (
        f"all dtypes {tol.all_dtypes:g}"
        if tol.all_dtypes is not None
        else ", ".join(f"{k} {v:.2e}" for k, v in tol.rel_l2.items())
    )
    return f"""
<section id="verdict" class="{status}">
<h2>Verdict</h2>
<p class="headline" id="verdict-line">{head}</p>
<p class="rule">Primary metric: relative L2 error ‖target − ref‖ / ‖ref‖ per leaf, judged against a tolerance per
dtype ({esc(tol_text)}; a pair is judged at the less precise of its dtypes and the run's compute precision
{esc(verdict.precision.get("floor"))}). Leaf counts: {esc(counts_text(verdict.counts))}.</p>{_coverage_html(cmp)}{modes}
<div class="findings">
{_finding_html("First divergence", f, "none: every compared output is within tolerance", ex=ex.get("first_divergence"))}
{_finding_html("Culprit", verdict.culprit, "none found" if f is not None else "none", words, ex.get("culprit"), True)}
{_overflow_html(ovf)}
{_unmatched_html(verdict)}
{_kernel_html(*kernel)}
</div>
<h3>By step</h3>
<table class="grid" id="steps-table"><tr><th>step</th><th>compared</th><th>diverged</th><th>unmatched</th>
<th>max rel_l2</th><th>first divergence</th></tr>{steps}</table>
</section>"""


def _kernel_html(replayed: bool, f: Finding | None) -> str:
    """The replay's card: the target's first op over its standard; nothing for a target never replayed."""
    if not replayed and f is None:
        return ""
    card = _finding_html("Kernel (replay)", f, "none: every replayed output within its standard")
    return card.replace('<div class="finding', '<div id="kernel-card" class="finding kernel', 1)


def _coverage_html(cmp: Comparison) -> str:
    cov = getattr(cmp, "coverage", None) or {}
    notes = []
    for side, label in (("target", "target"), ("ref", "reference")):
        for what in ("steps", "ranks"):
            extra = sorted(set(cov.get(f"{side}_{what}", [])) - set(cov.get(f"common_{what}", [])))
            if extra:
                notes.append(f"{what} only in the {label}, not compared: {', '.join(map(str, extra))}")
    if not notes:
        return ""
    return '<p class="warn">' + "; ".join(esc(n) for n in notes) + "</p>"


def _picker(chart: str, pickers: dict[str, tuple[str, list, Any]]) -> str:
    """A <select> of the rank or step that a chart shows, when it has more than one to show."""
    if chart not in pickers:
        return ""
    axis, values, current = pickers[chart]
    opts = "".join(
        f'<option value="{esc(v)}"{" selected" if v == current else ""}>{esc(axis)} {esc(v)}</option>' for v in values
    )
    return f'<p class="controls">show <select class="picker" data-chart="{esc(chart)}">{opts}</select></p>'


def chart_section(
    figs: dict,
    rank: int,
    n_steps: int,
    n_ranks: int,
    verdict: Verdict,
    pickers: dict[str, tuple[str, list, Any]] | None = None,
) -> str:
    """The error charts' frames (drawn by assets/main.js), their rank/step pickers and the ranks table."""
    pickers = pickers or {}
    parts = [
        '<section id="charts"><h2>Error along the run</h2>',
        _picker("line", pickers),
        '<div class="chart" id="chart-line"></div>',
    ]
    if figs.get("steps") is not None:
        parts.append(
            "<h3>Error by step</h3>" + _picker("steps", pickers) + '<div class="chart" id="chart-steps"></div>'
        )
    elif n_steps > 1:
        parts.append("<p>No step has a comparable output.</p>")
    if n_ranks > 1:
        parts.append("<h3>Error by rank</h3>")
        if figs.get("ranks") is not None:
            parts.append(_picker("ranks", pickers) + '<div class="chart" id="chart-ranks"></div>')
        rows = "".join(
            f"<tr><td>{esc(r['rank'])}</td><td>{esc(r['diverged'])}</td><td>{esc(fmt(r['max_err']))}</td>"
            f"<td><code>{esc(r['first_divergence'])}</code></td><td>{esc(r['first_step'])}</td>"
            f"<td>{'yes' if r['disagrees_with_peers'] else 'no'}</td></tr>"
            for r in verdict.ranks
        )
        parts.append(
            '<table class="grid" id="ranks-table"><tr><th>rank</th><th>diverged leaves</th>'
            "<th>max rel_l2</th><th>first divergence</th><th>at step</th><th>disagrees with peers</th>"
            f"</tr>{rows}</table>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def curves_section(figs: dict) -> str:
    """Training curves: loss per step of both runs, gradient norms of the parameters that differ most."""
    if all(figs.get(k) is None for k in ("loss", "grads", "updates")):
        return ""
    parts = ['<section id="curves"><h2>Training curves</h2>']
    if figs.get("loss") is not None:
        parts.append('<div class="chart" id="chart-loss"></div>')
    if figs.get("grads") is not None:
        parts.append('<div class="chart" id="chart-grads"></div>')
    if figs.get("updates") is not None:
        parts.append('<div class="chart" id="chart-updates"></div>')
    parts.append("</section>")
    return "\n".join(parts)


def toc(ids: list[tuple[str, str]]) -> str:
    """The page's table of contents."""
    links = " · ".join(f'<a href="#{esc(i)}">{esc(label)}</a>' for i, label in ids)
    return f'<nav id="toc">{links}</nav>'


_TABLE_HEAD = (
    ("step", "n", "step"),
    ("rank", "n", "rank"),
    ("op", "s", "op (record)"),
    ("leaf", "s", "leaf"),
    ("type", "s", "op type"),
    ("dtype", "s", "dtype"),
    ("shape", "s", "shape"),
    ("err", "n", "rel_l2"),
    ("tol", "n", "tol"),
    ("sev", "n", "severity"),
    ("src", "s", "from"),
    ("cos", "n", "cosine"),
    ("mae", "n", "max abs err"),
    ("t_max", "n", "target max"),
    ("t_min", "n", "min"),
    ("t_mean", "n", "mean"),
    ("t_norm", "n", "norm"),
    ("r_max", "n", "ref max"),
    ("r_min", "n", "min"),
    ("r_mean", "n", "mean"),
    ("r_norm", "n", "norm"),
    ("status", "s", "status"),
    ("detail", "s", "detail"),
)


def table_section(table: dict, page_rows: int) -> str:
    """The frame of the all-rows table; assets/main.js fills it from the page's data (filtered, sorted, paged)."""
    n_bad = sum(
        1
        for c in table["cols"]["status"]
        if c is not None and table["dicts"]["status"][c] in ("diverged", "error", "unmatched")
    )
    head = "".join(
        f'<th data-c="{c}" data-k="{k}" title="click to sort">{esc(label)}</th>' for c, k, label in _TABLE_HEAD
    )
    statuses = "".join(f'<option value="{s}">{s}</option>' for s in STATUS_ORDER)
    which = (
        "the compared leaves that differ: --only-differing" if table.get("only_differing") else "every compared leaf"
    )
    return f"""
<section id="mismatches">
<h2>All compared rows</h2>
<p>{table["n"]} rows ({which}), {n_bad} of them diverged, failed or unmatched; the verdict's culprit first,
then by significance (error over the noise the pair showed there), as <code>dumpstore compare</code> ranks them.
Filter by name, step, rank, op type and status; click a header to sort; click a chart
point to show its rows. rel_l2 "≥" is a lower bound from the dumped statistics, "±" the error bound of a sketch
estimate; cosine and max abs err from statistics or sketches are estimates too (column "from").</p>
<div class="controls"><input id="filter" type="search" placeholder="name contains…" size="36">
<select id="step-filter"><option value="">any step</option></select>
<select id="rank-filter"><option value="">any rank</option></select>
<select id="type-filter"><option value="">any op type</option></select>
<select id="status-filter"><option value="">any status</option>{statuses}</select>
<span id="shown-count"></span>
<button id="page-prev" type="button">◀</button> <span id="page-no"></span>
<button id="page-next" type="button">▶</button>
</div>
<div class="scroll"><table class="grid sortable" id="top-table" data-page-rows="{int(page_rows)}">
<thead><tr>{head}</tr></thead><tbody></tbody></table></div>
</section>"""


def _stack_of(cmp: Comparison, store, f: Finding) -> tuple[str, list[str]] | None:
    """The call stack of a finding's op, from the target run (or the reference, for an op only there)."""
    r = cmp.rows.filter(
        (pl.col("step") == f.step)
        & (pl.col("rank") == f.rank)
        & ((pl.col("record") == f.op) | (pl.col("ref_record") == f.op))
    )
    if f.name:
        named = r.filter((pl.col("name") == f.name) | (pl.col("ref_name") == f.name))
        r = named if named.height else r
    for run, col, rec in ((cmp.target, "stack_id", "record"), (cmp.ref, "ref_stack_id", "ref_record")):
        hit = r.filter((pl.col(rec) == f.op) & pl.col(col).is_not_null())
        if hit.height:
            df = fetch(store, run, STACK_SQL, {"run": run, "step": f.step, "rank": f.rank, "sid": int(hit[col][0])})
            if df is not None and df.height:
                frames = df.row(0, named=True)["frames"]
                return run, list(frames or [])
    return None


def _frames_html(frames: list[str]) -> str:
    out = []
    for fr in frames:
        loc, _, code = str(fr).partition(", \n")
        code_html = f"<br><code>{esc(code.strip())}</code>" if code else ""
        out.append(f'<li><span class="loc">{esc(loc)}</span>{code_html}</li>')
    return '<ol class="stack">' + "".join(out) + "</ol>"


def checklist_section(cl: Checklist | None) -> str:
    if cl is None:
        return ""
    rows = "".join(
        f'<tr class="st-{esc(c.status)}"><th>{esc(c.title)}</th><td>{esc(c.status)}</td><td>{esc(c.evidence)}</td></tr>'
        for c in cl.checks
    )
    return (
        '<section id="checklist"><h2>Checklist</h2><p>Are the two runs fed the same thing?</p>'
        f"<table><thead><tr><th>check</th><th>status</th><th>evidence</th></tr></thead><tbody>{rows}"
        "</tbody></table></section>"
    )


def health_section(hr: HealthReport | None, limit: int = 50) -> str:
    if hr is None:
        return ""
    counts = ", ".join(f"{esc(k)} ×{esc(v)}" for k, v in hr.counts.items() if v) or "no findings"
    loss = "".join(
        f"<tr><td>{esc(x.get('step'))}</td><td>{esc(x.get('rank'))}</td><td>{esc(fmt(x.get('value')))}</td></tr>"
        for x in hr.loss
    )
    found = "".join(
        f"<tr><td>{esc(f.watchpoint)}</td><td>{esc(f.step)}</td><td>{esc(f.rank)}</td>"
        f"<td><code>{esc(f.op)}</code></td><td>{esc(f.name or '')}</td><td>{esc(fmt(f.value))}</td>"
        f"<td>{esc(fmt(f.threshold))}</td><td>{esc(f.detail or '')}</td></tr>"
        for f in hr.findings[:limit]
    )
    extra = len(hr.findings) - limit
    more = f"<p>… and {extra} more (dumpstore health --run …).</p>" if extra > 0 else ""
    parts = [f'<section id="health"><h2>Health of {esc(hr.run)}</h2><p>Single-run watchpoints: {counts}.</p>']
    if hr.overflow_ref is not None:
        parts.append(
            f"<p>Overflow findings: the First overflow card's scan, NaN/Inf/saturated values beyond what "
            f"{esc(hr.overflow_ref)} has (dumpstore overflow --run {esc(hr.run)} --ref {esc(hr.overflow_ref)}).</p>"
        )
    if loss:
        parts.append(
            "<h3>Loss per step</h3><table><thead><tr><th>step</th><th>rank</th><th>loss</th></tr></thead>"
            f"<tbody>{loss}</tbody></table>"
        )
    if found:
        parts.append(
            "<table><thead><tr><th>watchpoint</th><th>step</th><th>rank</th><th>op</th><th>tensor</th>"
            f"<th>value</th><th>threshold</th><th>detail</th></tr></thead><tbody>{found}</tbody></table>{more}"
        )
    parts.append("</section>")
    return "".join(parts)


def stack_section(cmp: Comparison, verdict: Verdict, store) -> str:
    parts = ['<section id="stack"><h2>Call stack</h2>']
    shown = set()
    for label, f in (("Culprit", verdict.culprit), ("First divergence", verdict.first_divergence)):
        if f is None or (f.step, f.rank, f.op) in shown:
            continue
        shown.add((f.step, f.rank, f.op))
        got = _stack_of(cmp, store, f) if store is not None else None
        if got is None:
            parts.append(
                f"<h3>{esc(label)}: <code>{esc(f.op)}</code></h3><p>no stack recorded (stack.json "
                f"missing, or not in the store)</p>"
            )
            continue
        run, frames = got
        parts.append(
            f"<h3>{esc(label)}: <code>{esc(f.op)}</code> <small>(run {esc(run)}, step {esc(f.step)}, rank "
            f"{esc(f.rank)}; innermost frame first)</small></h3>{_frames_html(frames)}"
        )
    if not shown:
        parts.append("<p>No divergence, so no stack to show.</p>")
    parts.append("</section>")
    return "\n".join(parts)


_META_FIELDS = (
    "source_path",
    "framework",
    "task",
    "level",
    "dump_mode",
    "generation",
    "steps",
    "ranks",
    "n_files",
    "n_records",
    "n_rows",
    "n_tensors",
    "n_tensor_files",
    "n_errors",
    "sample_k",
    "sketch_m",
    "created_at",
    "dumpstore_version",
)


def _dtype_counts(rows: pl.DataFrame, col: str, kind_col: str) -> str:
    t = rows.filter(pl.col(kind_col) == "tensor").group_by(col).len().sort("len", descending=True)
    return ", ".join(f"{d} ×{n}" for d, n in t.iter_rows() if d is not None) or "—"


def meta_section(cmp: Comparison, verdict: Verdict, store, multi_rank: bool) -> str:
    info: dict[str, dict[str, Any]] = {}
    for run in (cmp.target, cmp.ref):
        try:
            info[run] = store.run_info(run) if store is not None else {}
        except DumpstoreError:
            info[run] = {}
    t, r = info[cmp.target], info[cmp.ref]
    rows: list[tuple[str, Any, Any]] = [("run", cmp.target, cmp.ref)]
    rows += [(k, t.get(k), r.get(k)) for k in _META_FIELDS if k in t or k in r]
    rows.append(
        (
            "tensor dtypes compared",
            _dtype_counts(cmp.rows, "dtype", "kind"),
            _dtype_counts(cmp.rows, "ref_dtype", "ref_kind"),
        )
    )
    rows.append(("compute precision", verdict.precision.get("target"), verdict.precision.get("ref")))
    exact = "msprobe_cosine" in cmp.rows.columns
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(_list(a))}</td><td>{esc(_list(b))}</td></tr>" for k, a, b in rows)
    extra = (
        f"<p>Compared rows: {cmp.rows.height}; aligned records: {cmp.records.height}; exact tensor "
        f"metrics: {'yes' if exact else 'no (statistics / sketches)'}; amplification threshold "
        f"{cmp.tolerances.amplification:g}.</p>"
    )
    return (
        f'<section id="meta"><h2>Runs</h2><table class="grid meta"><tr><th></th><th>target</th>'
        f"<th>reference</th></tr>{body}</table>{extra}</section>"
    )


def _list(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    return None if v == "" else v

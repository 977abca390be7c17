"""Is a fault's culprit among the first rows of `dumpstore compare` of its step?  Shared by the scorers
(``validation/score.py --compare-top N``, ``sample_dumps/measure_noise.py --compare-top N``); they load this file
by its path (neither folder is put on ``sys.path``).

For a fault pair: ``dumpstore compare --step S --top 0 --json`` (every row of the key's step, in compare's order),
and the rank (1 = first row) of the first row of any of the accepted records (a row's name is its record's name,
a dot, then the leaf: ``Functional.linear.3.forward.input.0``); ``in_top`` is that rank <= N.
For a clean pair: ``dumpstore compare --top 1 --json`` over all steps: what tops the list and its significance
(a clean pair whose first row reads 1e4 looks like a fault to whoever reads the table).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path


def _dumpstore() -> str:
    local = Path(sys.executable).parent / "dumpstore"
    return str(local) if local.exists() else (shutil.which("dumpstore") or "dumpstore")


def compare_rows(
    store: str, target: str, ref: str, *, step: int | None = None, top: int = 0, plain: bool = False
) -> list[dict]:
    """The rows of `dumpstore compare` (its default order), all of them with top 0; `plain`: without the verdict's
    culprit first (`--no-culprit-first`: significance alone)."""
    args = [_dumpstore(), "compare", "--target", target, "--ref", ref, "--store", str(store), "--top", str(top)]
    args += ["--step", str(step)] if step is not None else []
    args += ["--no-culprit-first"] if plain else []
    proc = subprocess.run([*args, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError("dumpstore compare: exit %d: %s" % (proc.returncode, proc.stderr.strip()[-500:]))
    out = json.loads(proc.stdout)
    return out["rows"] if isinstance(out, dict) else out


def rank_of(rows: list[dict], records: list[str]) -> tuple[int, dict] | None:
    """(1-based rank, row) of the first row that belongs to one of `records`, or None."""
    heads = tuple(r + "." for r in records if r)
    for i, row in enumerate(rows, 1):
        if heads and (row.get("name") or "").startswith(heads):
            return i, row
    return None


def _num(v) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _row_brief(row: dict) -> dict:
    return {
        "step": row.get("step"),
        "name": row.get("name"),
        "significance": _num(row.get("significance")),
        "rel_l2": _num(row.get("rel_l2")),
        "tol": _num(row.get("tol")),
    }


def fault_top(store: str, target: str, ref: str, step: int, records: list[str], n: int) -> dict:
    """Where the culprit's record ranks among `compare --step STEP` rows: rank, in_top (rank <= n), the culprit's
    row and the row that tops the list; `rank_plain`: its rank by significance alone (`--no-culprit-first`)."""
    rows = compare_rows(store, target, ref, step=step)
    found = rank_of(rows, records)
    plain = rank_of(compare_rows(store, target, ref, step=step, plain=True), records)
    return {
        "rank_plain": plain[0] if plain else None,
        "n": n,
        "step": step,
        "records": records,
        "rank": found[0] if found else None,
        "in_top": bool(found and found[0] <= n),
        "row": _row_brief(found[1]) if found else None,
        "first": _row_brief(rows[0]) if rows else None,
        "rows": len(rows),
    }


def clean_top(store: str, target: str, ref: str, n: int) -> dict:
    """What tops `compare` of a clean pair (all steps): the first row and its significance."""
    rows = compare_rows(store, target, ref, top=1)
    return {"n": n, "first": _row_brief(rows[0]) if rows else None}


def fmt_sig(v: float | None) -> str:
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else "%.3g" % v


def cell(top: dict | None) -> str:
    """One table cell: a fault's rank (`3 yes`, `41 NO`, `absent NO`), a clean pair's first row and significance."""
    if not top:
        return "-"
    if "rank" in top:
        if top["rank"] is None:
            return "absent NO" if top["records"] else "- (no record)"
        plain = top.get("rank_plain")
        return "%d %s (alone: %s)" % (top["rank"], "yes" if top["in_top"] else "NO", "-" if plain is None else plain)
    first = top.get("first")
    return (
        "top: none"
        if not first
        else "top: sig %s %s@%s" % (fmt_sig(first["significance"]), first["name"], first["step"])
    )


def summary(tops: list[dict | None], n: int) -> str:
    """`culprit in compare --top N of its step: A of F (measurable M); clean pairs' top significance: max X`."""
    faults = [t for t in tops if t and "rank" in t]
    measurable = [t for t in faults if t["records"]]
    clean = [t for t in tops if t and "rank" not in t and t.get("first")]
    sigs = [t["first"]["significance"] for t in clean if t["first"]["significance"] is not None]
    line = "culprit in compare --top %d of its step: %d of %d" % (n, sum(t["in_top"] for t in faults), len(faults))
    alone = [t for t in faults if "rank_plain" in t]
    if alone:
        line += " (by significance alone, --no-culprit-first: %d)" % sum(
            t["rank_plain"] is not None and t["rank_plain"] <= n for t in alone
        )
    if len(measurable) != len(faults):
        line += " (%d with no record to look for)" % (len(faults) - len(measurable))
    if clean:
        line += "; clean pairs' first row significance: max %s, median %s" % (
            fmt_sig(max(sigs)) if sigs else "-",
            fmt_sig(sorted(sigs)[len(sigs) // 2]) if sigs else "-",
        )
    return line

"""What msprobe monitor itself flagged in a long run (its `anomaly_detected/rank<r>/anomaly.json`), summed up to
be shown beside dumpstore's answer, never as it: msprobe's rule (AnomalyTurbulence: |x| > (1 + t) x the running
mean of |x|, per tensor, no reference run) fires on ordinary training dynamics too.

Per run: the number of alarms, per rule and per prefix, the steps they span, the first in msprobe's own order
(step, micro step, forward / backward / optimizer, call id), and, when dumpstore named a culprit series
(prefix and name), the first step msprobe flagged that tensor (any prefix) and that series.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa

from dumpstore.longrun.store import read
from dumpstore.store import Store

NOTE = "msprobe monitor's own alarms (its rule, no reference run), shown beside this verdict, not part of it"


def msprobe_flagged(store: Store, run: str, focus: tuple[str, str] | None = None) -> dict[str, Any] | None:
    """The summary of run `run`'s msprobe alarms (None: it has none); `focus` = (prefix, name) of a series."""
    return summarize(read(store, "monitor_anomalies", run), run, focus)


def summarize(table: pa.Table, run: str, focus: tuple[str, str] | None = None) -> dict[str, Any] | None:
    if table.num_rows == 0:
        return None
    rows = table.select(["rank", "step", "prefix", "name", "stat", "rule", "value", "history"]).to_pylist()
    first = rows[0]  # the table is in msprobe's order
    out: dict[str, Any] = {
        "run": run,
        "n": len(rows),
        "rules": dict(Counter(r["rule"] or "unknown" for r in rows).most_common()),
        "prefixes": dict(Counter(r["prefix"] or "unknown" for r in rows).most_common()),
        "first_step": min(r["step"] for r in rows),
        "last_step": max(r["step"] for r in rows),
        "first": first,
        "focus": None,
        "note": NOTE,
    }
    if focus is not None:
        prefix, name = focus
        tensor = [r for r in rows if r["name"] == name]
        series = [r for r in tensor if r["prefix"] == prefix]
        out["focus"] = {
            "prefix": prefix,
            "name": name,
            "n": len(tensor),
            "first": tensor[0] if tensor else None,
            "first_of_series": series[0] if series else None,
        }
    return out


def flagged_lines(f: dict[str, Any], text=str, num=str) -> list[str]:
    """Text lines of one run's summary (`text`, `num`: the CLI's escaping and number formats)."""
    rules = ", ".join(f"{text(k)} {v}" for k, v in f["rules"].items())
    prefixes = ", ".join(f"{text(k)} {v}" for k, v in list(f["prefixes"].items())[:6])
    a = f["first"]
    lines = [
        f"msprobe flagged (its own alarms, not this verdict): run {text(f['run'])}: {f['n']} alarms ({rules}) over "
        f"steps {f['first_step']}..{f['last_step']}; by prefix: {prefixes}",
        f"  msprobe's first: step {a['step']} rank {a['rank']} {text(a['prefix'])} {text(a['name'])} "
        f"({text(a['stat'])}): {num(a['value'])} vs its running mean {num(a['history'])}",
    ]
    fo = f.get("focus")
    if fo is not None:
        if fo["first"] is None:
            lines.append(f"  msprobe never flagged {text(fo['name'])}")
        else:
            s = fo["first_of_series"]
            lines.append(
                f"  msprobe flagged {text(fo['name'])} {fo['n']} times, first at step {fo['first']['step']} "
                f"({text(fo['first']['prefix'])} {text(fo['first']['stat'])})"
                + (
                    f"; its {text(fo['prefix'])} first at step {s['step']}"
                    if s is not None
                    else f"; never its {text(fo['prefix'])}"
                )
            )
    return lines

"""Render tables for the terminal, JSON and CSV: one switch for every read command."""

from __future__ import annotations

import csv
import io
import json
import math
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import pyarrow as pa


def output_options(fn):
    fn = click.option("--csv", "fmt", flag_value="csv", help="Output CSV.")(fn)
    fn = click.option("--json", "fmt", flag_value="json", help="Output JSON.")(fn)
    fn = click.option("--table", "fmt", flag_value="table", default=True, help="Output an aligned table (default).")(fn)
    return fn


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    return str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def to_json(obj: Any) -> str:
    return json.dumps(_jsonable(obj), indent=2, default=str)


def render(table: pa.Table, fmt: str, *, max_width: int = 60) -> str:
    rows = table.to_pylist()
    cols = table.column_names
    if fmt == "json":
        return to_json(rows)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if r[c] is None else (json.dumps(r[c]) if isinstance(r[c], list) else r[c]) for c in cols])
        return buf.getvalue().rstrip("\n")
    return format_table(cols, [[_cell(r[c]) for c in cols] for r in rows], max_width=max_width)


def format_table(cols: list[str], cells: list[list[str]], *, max_width: int = 60) -> str:
    cells = [[c if len(c) <= max_width else c[: max_width - 1] + "…" for c in row] for row in cells]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(cols)]
    line = "  ".join(h.ljust(w) for h, w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join([line.rstrip(), sep] + body)

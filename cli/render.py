"""How the CLI shows an answer: one number format, one verdict line, one --table / --json / --csv switch.

Every read command takes `output_options` and hands its rows here.  Text for the terminal has its control
characters escaped (an op name holding ESC or a newline cannot move the cursor or forge a line); JSON and CSV
are structured already, and every CSV cell goes through the one formula-neutraliser (dumpstore/csvsafe.py).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from dumpstore.csvsafe import to_csv

if TYPE_CHECKING:
    import pyarrow as pa


DEFAULT_DIGITS = 3
DIGITS = DEFAULT_DIGITS  # significant digits of the terminal's numbers (--digits; reset by every command)
COSINE_DECIMALS = 6  # msprobe compare: float('{:.12f}'), then round(x, 6) above its 0.9999 threshold


def _set_digits(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    global DIGITS
    DIGITS = value if value is not None else DEFAULT_DIGITS


def digits_option(fn):
    """--digits N: significant digits of the numbers in text output (JSON and CSV carry full precision)."""
    return click.option(
        "--digits",
        type=click.IntRange(1, 17),
        default=None,
        expose_value=False,
        is_eager=True,
        callback=_set_digits,
        metavar="N",
        help="Significant digits of numbers in text output (default 3; cosine: msprobe's 6 decimals, or N if more).",
    )(fn)


def output_options(fn):
    """--table (the default), --json, --csv: one `fmt` argument; and --digits."""
    fn = digits_option(fn)
    fn = click.option("--csv", "fmt", flag_value="csv", help="Output CSV.")(fn)
    fn = click.option("--json", "fmt", flag_value="json", help="Output JSON.")(fn)
    fn = click.option("--table", "fmt", flag_value="table", default=True, help="Output text and tables (default).")(fn)
    return fn


def num(v: Any) -> str:
    """The one number format of the terminal: DIGITS significant digits (3, or --digits); None is '-'."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return str(v) if math.isnan(v) or math.isinf(v) else f"{v:.{DIGITS}g}"
    return str(v)


def cosine(v: Any) -> str:
    """A cosine similarity as msprobe compare prints it: 6 decimals (0.999995 for 0.99999473; more with --digits
    above 6); one closer to 1 than that as `1 - 3e-08`, so a column of cosines near 1 stays apart."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return num(v)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    decimals = max(COSINE_DECIMALS, DIGITS)
    shown = f"{v:.{decimals}f}"
    if v != 1.0 and float(shown) == 1.0:  # closer to 1 than the decimals show: say how close
        return f"1 - {1.0 - v:.2g}" if v < 1.0 else f"1 + {v - 1.0:.2g}"
    return shown


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def text(v: Any) -> str:
    """`v` as terminal-safe text: control, line-separator and bidi characters shown as escapes (`\\x1b`, `\\n`)."""
    return _CONTROL.sub(_escape, str(v))


def _escape(m: re.Match) -> str:
    ch = m.group(0)
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch) or (
        f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
    )


COSINE_COLUMNS = frozenset({"cosine", "Cosine", "ref_cosine"})


def cell(v: Any, column: str | None = None) -> str:
    """One table cell: numbers as `num` (a cosine as `cosine`), lists bracketed, text made terminal-safe; None is
    empty."""
    if v is None:
        return ""
    if column in COSINE_COLUMNS and isinstance(v, float):
        return cosine(v)
    if isinstance(v, (int, float)):
        return num(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(cell(x) for x in v) + "]"
    return text(v)


SCHEMA_VERSION = 1  # of every command's --json (dumpstore/schemas/<command>.json); bumped on a breaking change


def _nonfinite(v: Any) -> str | None:
    """'inf', '-inf' or 'nan' for a non-finite float, else None."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return None


def _jsonable(v: Any) -> Any:
    """Numbers stay numbers: a non-finite float becomes null, and in an object its key gets a sibling
    `<key>_nonfinite` holding "inf", "-inf" or "nan" (in a list it is null alone)."""
    if isinstance(v, float):
        return None if _nonfinite(v) else v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        out: dict[Any, Any] = {}
        for k, x in v.items():
            out[k] = _jsonable(x)
            flag = _nonfinite(x)
            if flag is not None:
                out[f"{k}_nonfinite"] = flag
        return out
    return v


def contract(command: str, store: Any, body: dict[str, Any], **names: Any) -> dict[str, Any]:
    """A command's --json object: `schema_version`, `command`, `store` (the folder), the runs it reads
    (`target`/`ref`, or `run`), then its own keys."""
    from pathlib import Path

    from dumpstore.store import default_store_path

    root = Path(store) if store is not None else default_store_path()
    return {"schema_version": SCHEMA_VERSION, "command": command, "store": str(root), **names, **body}


def to_json(obj: Any) -> str:
    return json.dumps(_jsonable(obj), indent=2, default=str, allow_nan=False)


def _csv_value(v: Any) -> Any:
    if isinstance(v, (list, dict)):
        return json.dumps(_jsonable(v), default=str)
    return v


def rows_out(columns: Sequence[str], rows: list[dict[str, Any]], fmt: str, *, max_width: int = 60) -> str:
    """Rows (dicts) as an aligned table, a JSON list or CSV, by `fmt`."""
    cols = list(columns)
    if fmt == "json":
        return to_json([{c: r.get(c) for c in cols} for r in rows])
    if fmt == "csv":
        return to_csv(cols, ([_csv_value(r.get(c)) for c in cols] for r in rows)).rstrip("\n")
    return format_table(cols, [[cell(r.get(c), c) for c in cols] for r in rows], max_width=max_width)


def render(table: pa.Table, fmt: str, *, max_width: int = 60) -> str:
    """An Arrow table as `rows_out` shows it."""
    return rows_out(table.column_names, table.to_pylist(), fmt, max_width=max_width)


def format_table(cols: list[str], cells: list[list[str]], *, max_width: int = 60) -> str:
    """Aligned columns under a header and a rule, every cell terminal-safe; cells longer than `max_width` end
    in '…'."""
    cols = [text(h) for h in cols]
    cells = [[c if len(c) <= max_width else c[: max_width - 1] + "…" for c in map(text, row)] for row in cells]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(cols)]
    line = "  ".join(h.ljust(w) for h, w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join([line.rstrip(), sep] + body)


def finding_line(label: str, f: dict[str, Any] | None) -> str:
    """The one verdict line: `LABEL (kind): step S rank R  op  leaf  metric=V > tol=T (dtype, source)  [detail]`,
    or `LABEL: none`, terminal-safe.  Used for the first divergence, the culprit and the first overflow."""
    if f is None:
        return f"{label}: none"
    op, name = f.get("op") or "", f.get("name") or ""
    where = f"step {f['step']} rank {f['rank']}  {op}"
    leaf = f"  {name.removeprefix(op + '.')}" if name and op and name.startswith(op) else ""
    cmp = ""
    if f.get("value") is not None and f.get("threshold") is not None:
        rel = ">" if f["value"] > f["threshold"] else "<="
        cmp = f"  {f['metric']}={num(f['value'])} {rel} tol={num(f['threshold'])} ({f['dtype']}, {f['source']})"
    detail = f"  [{f['detail']}]" if f.get("detail") else ""
    return text(f"{label} ({f['kind']}): {where}{leaf}{cmp}{detail}")


class Stages:
    """Progress on stderr: one line redrawn on a terminal, else a line when a stage runs past EVERY seconds."""

    EVERY = 5.0

    def __init__(self, command: str) -> None:
        self.command = command
        self.t0 = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.drawn = False

    def __enter__(self) -> Stages:
        return self

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        text = f"{self.command}: {stage} {done}/{total} ({now - self.t0:.0f} s)"
        if self.tty:
            click.echo(f"\r{text:<60}", nl=False, err=True)
            self.drawn = True
        elif now - self.last >= self.EVERY:
            click.echo(text, err=True)
            self.last = now

    def __exit__(self, *exc: object) -> None:
        if self.drawn:
            click.echo(f"\r{'':<60}\r", nl=False, err=True)

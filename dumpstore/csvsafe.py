"""The one formula-neutraliser for every CSV dumpstore writes: text a spreadsheet would run stays text.

A cell is dangerous when it starts with a formula character, or when a `;` (a field separator in some locales)
is followed by one: msprobe's black list (`CSV_BLACK_LIST` in msprobe/core/common/const.py,
`^[＋－＝％＠\\+\\-=%@]|;[＋－＝％＠\\+\\-=%@]`, the full-width forms included), plus a leading tab or carriage
return (OWASP).  Such text gets a `'` before the cell and after each such `;`; the value is otherwise kept.
Numbers stay numbers: ints, floats and text that reads as one number (`-1`, `-inf`, `1e-3`) are not touched.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from typing import Any

_FORMULA_CHARS = "=+\\-@%＝＋－＠％"
BLACK_LIST = re.compile(f"^[{_FORMULA_CHARS}\t\r]|;[{_FORMULA_CHARS}]")
_AFTER_SEMICOLON = re.compile(f";(?=[{_FORMULA_CHARS}])")


def cell(value: Any) -> Any:
    """`value` made safe for a spreadsheet: None -> '', numbers as they are, dangerous text quoted."""
    if value is None:
        return ""
    if isinstance(value, (bool, int, float)):
        return value
    text = str(value)
    if not BLACK_LIST.search(text) or _is_number(text):
        return text
    text = _AFTER_SEMICOLON.sub(";'", text)
    return "'" + text if BLACK_LIST.match(text) else text


def _is_number(text: str) -> bool:
    if text != text.strip():
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


def row(values: Iterable[Any]) -> list[Any]:
    """Every cell of one row through `cell`."""
    return [cell(v) for v in values]


def to_csv(columns: list[str], rows: Iterable[Iterable[Any]]) -> str:
    """A whole CSV text (header and rows, `\\n` line ends), every cell neutralised."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(row(columns))
    for r in rows:
        w.writerow(row(r))
    return buf.getvalue()

"""Record names that a dump.json holds twice: JSON parsers keep the last of each, so the others would be lost
without a word (issue 24). Checked cheaply on the text: msprobe writes records one a line at two spaces
(`json.dump(..., indent=1)`), so the record lines are counted (one C-speed scan) and only when they outnumber the
parsed records are their names read; text laid out otherwise (small files) is parsed once more, keeping pairs."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

_RECORD_LINE = b'\n  "'
_RECORD_NAME = re.compile(rb'\n  "((?:[^"\\\n]|\\.)*)"\s*:')
_REPARSE_MAX = 32 << 20  # other layouts: parsed again (pure Python, keeping pairs) up to this size


def record_lines(raw: bytes) -> int:
    """Lines that start a record in msprobe's layout (0 for other layouts)."""
    return raw.count(_RECORD_LINE)


def duplicate_records(raw: bytes, data: dict[str, Any]) -> dict[str, int]:
    """Record names of the "data" object that the text holds more than once, with their counts."""
    lines = record_lines(raw)
    if lines > len(data):
        names = Counter(_name(m.group(1)) for m in _RECORD_NAME.finditer(raw))
        return {name: n for name, n in names.items() if n > 1 and name in data}
    if lines or len(raw) > _REPARSE_MAX or not data:
        return {}
    seen: dict[str, int] = {}

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items) and any(k in data for k, _ in items):
            for name, n in Counter(k for k, _ in items).items():
                if n > 1 and name in data:
                    seen[name] = n
        return out

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return {}
    return seen


def _name(text: bytes) -> str:
    try:
        return str(json.loads(b'"' + text + b'"'))
    except ValueError:
        return text.decode("utf-8", "replace")


def duplicate_warning(path: Any, dups: dict[str, int]) -> str:
    first, n = next(iter(dups.items()))
    more = f" (and {len(dups) - 1} more names)" if len(dups) > 1 else ""
    return (
        f"{path}: record {first!r} appears {n} times{more}; JSON keeps only the last of them, the others are not "
        "in the store: fix the dump (each record name once)"
    )

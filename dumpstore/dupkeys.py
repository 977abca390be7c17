"""Record names that a dump.json holds twice: JSON parsers keep the last of each, so the others would be lost
without a word (issue 24). Checked cheaply on the text: msprobe writes records one a line at two spaces
(`json.dump(..., indent=1)`), so the record lines are counted (one C-speed scan); only when they do not match the
parsed records are the object keys of the text counted (one regex scan)."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

_RECORD_LINE = b'\n  "'
_OBJECT_OPEN = re.compile(rb'"\s*:\s*\{')  # the end of a key whose value is an object


def record_lines(raw: bytes) -> int:
    """Lines that start a record in msprobe's layout (0 for other layouts)."""
    return raw.count(_RECORD_LINE)


def duplicate_records(raw: bytes, data: dict[str, Any], whole: Any = None) -> dict[str, int]:
    """Record names of the "data" object that the text holds more than once, with their counts (`whole`: the
    whole parsed document, when `data` is part of it).

    msprobe's layout with as many record lines as records holds none twice (one count of the text); so does a text
    with as many `": {` as the parsed document has object-valued keys (JSON merges a repeated key: one fewer). Else
    the object keys of the text are read (a regex scan): a record name among them more than once is held twice (a
    record's own object keys, `input_kwargs`, `parameters` and their names, are never record names)."""
    if not data or record_lines(raw) == len(data):
        return {}
    if whole is not None and raw.count(b'": {') + raw.count(b'":{') == _object_valued_keys(whole):
        return {}
    counts = Counter(_object_keys(raw))
    out = {}
    for key, n in counts.items():
        if n > 1:
            name = _name(key) if b"\\" in key else key.decode("utf-8", "replace")
            if name in data:
                out[name] = n
    return out


def _object_valued_keys(doc: Any) -> int:
    """How many keys of the parsed document (at any depth) hold an object."""
    n = 0
    stack = [doc]
    while stack:
        x = stack.pop()
        values = x.values() if type(x) is dict else x
        for v in values:
            t = type(v)
            if t is dict:
                n += 1 if type(x) is dict else 0
                stack.append(v)
            elif t is list:
                stack.append(v)
    return n


def _object_keys(raw: bytes):
    """The keys (raw bytes, escapes kept) whose values are objects: each `": {` found by the regex (a literal-led
    pattern: C speed), its key's opening quote by a backward search."""
    for m in _OBJECT_OPEN.finditer(raw):
        end = m.start()
        start = raw.rfind(b'"', 0, end)
        while start > 0 and raw[start - 1] == 0x5C:  # an escaped quote inside the key
            start = raw.rfind(b'"', 0, start - 1)
        if start >= 0:
            yield raw[start + 1 : end]


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

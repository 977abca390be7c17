"""A dump.json cut as text into documents that parse to its records, so that several processes parse one dump.

msprobe writes dump.json with `json.dump(..., indent=1)`: the records are the members of the top-level `"data"`
object, one a line at two spaces, and every record but the last ends with a line `  },`.  The text is cut after
such lines into parts that parse on their own:

    part 0            text[:cut] + '\\n }\\n}'          the document with the first records
    parts 1 .. n-2    '[{' + text[cut + 1:next cut] + '}]'  a list of one object: more records
    part n-1          '[{' + text[cut + 1:last brace] + ']'  the last records, the document's last brace a ']'

A JSON string cannot hold a raw line break, so a cut is never inside a string; that it falls between two records
of "data" is proven by parsing, not assumed from the layout: part 0 must be an object whose last member is a
"data" object (so the parser stands inside "data", after a member, at the cut), and each later part must be a
list of exactly one object (so it continues there with whole members and, for the last part, ends "data" and the
document with nothing after "data").  Parsed that way the parts hold, in order, exactly the records of the whole
text; a record name in two parts (a duplicate key, which the whole text would merge) is the caller's to refuse.
Text laid out otherwise is not cut (`cuts` is None), and a part that does not parse as required gives None from
`records_of`: the caller then parses the whole text, which gives the errors their usual wording.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_DATA_LINE = b'\n "data": {\n'
_RECORD_END = b'\n  },\n  "'
_BLANK = b" \t\r\n"


@dataclass(frozen=True)
class Cuts:
    data_at: int  # where the line of the "data" member starts
    ends: tuple[int, ...]  # just after the '}' that ends each part's last record, for every part but the last
    last: int  # the document's closing '}'

    @property
    def parts(self) -> int:
        return len(self.ends) + 1


def cuts(text: bytes, parts: int) -> Cuts | None:
    """Where to cut `text` into up to `parts` parts of about equal size; None when it is not laid out as msprobe
    writes it (or too small to cut)."""
    at = text.find(_DATA_LINE)
    last = len(text) - 1
    while last >= 0 and text[last] in _BLANK:
        last -= 1
    if at < 0 or parts < 2 or last < 0 or text[last] != ord("}"):
        return None
    ends: list[int] = []
    for i in range(1, parts):
        found = text.find(_RECORD_END, max(len(text) * i // parts, at, ends[-1] if ends else 0))
        if found < 0 or found + 5 >= last:
            break
        ends.append(found + 4)  # after "\n  }"
    return Cuts(at + 1, tuple(ends), last) if ends else None


def preamble(text: bytes, cut: Cuts) -> bytes:
    """The document's members before "data", with "data" empty: the task, level and framework, parsed cheaply."""
    return text[: cut.data_at] + b' "data": {}\n}'


def part(text: bytes, cut: Cuts, i: int) -> bytes:
    """The text of part `i` (see the module's docstring)."""
    if i == 0:
        return text[: cut.ends[0]] + b"\n }\n}"
    start = cut.ends[i - 1] + 1  # after the comma that follows the record
    if i == cut.parts - 1:
        return b"[{" + text[start : cut.last] + b"]"
    return b"[{" + text[start : cut.ends[i]] + b"}]"


def records_of(doc: Any, i: int) -> dict | None:
    """The records of parsed part `i`, or None where the part is not what the cut requires."""
    if i == 0:
        if isinstance(doc, dict) and doc and next(reversed(doc)) == "data" and isinstance(doc["data"], dict):
            return doc["data"]
        return None
    if isinstance(doc, list) and len(doc) == 1 and isinstance(doc[0], dict):
        return doc[0]
    return None

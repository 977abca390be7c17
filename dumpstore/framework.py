"""The framework of a dump without a `framework` field, detected from its leaves as msprobe does.

msprobe (`detect_framework_by_dump_json`) takes the `framework` field when it says pytorch or mindspore, else the
first `"type": "mindspore…"` or `"type": "torch…"` in the file; a document walked depth-first in key order meets
the same value first, since the file is that document written out in order.
"""

from __future__ import annotations

from typing import Any

KNOWN = ("pytorch", "mindspore")
_BY_TYPE = (("mindspore", "mindspore"), ("torch", "pytorch"))


def detect_framework(doc: Any) -> str | None:
    """'pytorch' or 'mindspore' from the `framework` field, else from the first framework-typed value; None."""
    if isinstance(doc, dict) and doc.get("framework") in KNOWN:
        return doc["framework"]
    stack = [doc]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            vtype = value.get("type")
            if isinstance(vtype, str):
                for head, framework in _BY_TYPE:
                    if vtype.startswith(head):
                        return framework
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, list):
            stack.extend(reversed(value))
    return None

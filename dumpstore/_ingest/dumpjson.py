"""Reading a dump's JSON files: dump.json (or debug.json) within its size limit, and construct.json and
stack.json beside it, each error one line."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import ujson

from ..dupkeys import duplicate_records, duplicate_warning
from ..errors import DumpFormatError
from ..framework import detect_framework
from ..layout import Unit
from .model import UnitResult

MAX_DUMP_JSON_BYTES = 4 << 30


def read_json(path: Path) -> Any:
    """Parse a dump JSON file (bare NaN/Infinity allowed), or raise a one-line DumpFormatError."""
    return _decode_json(path, _read_bytes(path))


def _read_bytes(path: Path) -> bytes:
    """A dump JSON file's bytes (a regular file within the size limit), or a one-line DumpFormatError."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise DumpFormatError(f"{path}: not a regular file; expected msprobe's JSON")
        size = info.st_size
        if size > MAX_DUMP_JSON_BYTES:
            raise DumpFormatError(f"{path}: {size} bytes is larger than the {MAX_DUMP_JSON_BYTES} byte limit")
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot read ({exc.strerror})") from None


def _decode_json(path: Path, data: bytes) -> Any:
    """The JSON text `data` of `path` parsed (see parse_json), or a one-line DumpFormatError."""
    try:
        return parse_json(data)
    except json.JSONDecodeError as exc:
        raise DumpFormatError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); "
            "the file may be truncated: copy it again or re-run the dump"
        ) from None
    except UnicodeDecodeError:
        raise DumpFormatError(f"{path}: not UTF-8 text; expected msprobe's JSON") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's digit limit
        raise DumpFormatError(f"{path}: invalid JSON ({' '.join(str(exc).split())[:200]})") from None
    except RecursionError:
        raise DumpFormatError(f"{path}: JSON nested too deeply") from None


def parse_json(data: bytes) -> Any:
    """JSON text (bare NaN / Infinity / -Infinity allowed) as Python values: ujson (C, 1.4x faster than json on a
    dump.json), or json where ujson refuses the text, so that json's error (with its line and column) is raised."""
    try:
        return ujson.loads(data)
    except (ujson.JSONDecodeError, ValueError, OverflowError, TypeError):
        return json.loads(data)


def _aux_json(path: Path, res: UnitResult, lost: str) -> Any:
    """A dump's construct.json or stack.json, parsed; None where there is none, or it is a link or unreadable (a
    warning for the unit's result saying what the rows go without: `lost`)."""
    if path.is_symlink():
        res.meta.setdefault("warnings", []).append(f"{path}: a link; not read (copy the file instead); {lost}")
        return None
    if not path.is_file():
        if path.exists():  # a FIFO, a folder, a device: not read, and said so
            res.meta.setdefault("warnings", []).append(f"{path}: not a regular file; not read; {lost}")
        return None
    try:
        return read_json(path)
    except DumpFormatError as exc:
        res.meta.setdefault("warnings", []).append(f"{exc}; {lost}")
        return None


def _tensor_task(doc: dict) -> bool:
    return doc.get("task") not in ("statistics", "md5", "overflow_check")


def _open_dump(unit: Unit, res: UnitResult, raw: bytes) -> tuple[dict, dict, dict[str, int], list[list[str]]]:
    """The unit's dump.json (its bytes `raw`; checked to hold a 'data' object), construct.json and stack.json."""
    doc = whole = _decode_json(unit.path, raw)
    if unit.path.name == "debug.json" and isinstance(doc, dict) and "data" not in doc:
        doc = {"data": doc, "level": "debug"}
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise DumpFormatError(
            f"{unit.path}: expected an object with a 'data' object of records "
            "(msprobe dump.json); is this the right file?"
        )
    _set_meta(res, doc)
    if dups := duplicate_records(raw, doc["data"], whole):  # never silent: JSON keeps one of each
        res.meta.setdefault("warnings", []).append(duplicate_warning(unit.path, dups))
    return (doc, *_aux_files(unit, res))


def _set_meta(res: UnitResult, doc: Any) -> None:
    res.files = 1
    res.meta.update({k: doc.get(k) for k in ("task", "level", "framework") if isinstance(doc.get(k), str)})
    if "framework" not in res.meta and (found := detect_framework(doc)):
        res.meta["framework"] = found


def _aux_files(unit: Unit, res: UnitResult) -> tuple[dict, dict[str, int], list[list[str]]]:
    """construct.json (a dict), and stack.json as stack ids by record and the stacks."""
    construct = _aux_json(unit.path.parent / "construct.json", res, "ingested without module parents")
    stack_ids, stacks = _stack_index(_aux_json(unit.path.parent / "stack.json", res, "ingested without call stacks"))
    return construct if isinstance(construct, dict) else {}, stack_ids, stacks


def _parsed(text: bytes) -> Any:
    """`text` parsed by ujson alone (as parse_json would, were ujson to accept the whole file), or None."""
    try:
        return ujson.loads(text)
    except (ujson.JSONDecodeError, ValueError, OverflowError, TypeError, RecursionError):
        return None


def _stack_index(doc: Any) -> tuple[dict[str, int], list[list[str]]]:
    ids: dict[str, int] = {}
    stacks: list[list[str]] = []
    if not isinstance(doc, dict):
        return ids, stacks
    for key, value in doc.items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list) and isinstance(value[1], list):
            names, frames = value  # 8.3.3 / 26.x: {"0": [[record keys], [frames]]}
        else:
            names, frames = [key], value if isinstance(value, list) else []  # 1.x: {record: [frames]}
        stacks.append([str(f) for f in frames])
        for n in names:
            ids[str(n)] = len(stacks) - 1
    return ids, stacks


def _parent(construct: dict, key: str) -> str | None:
    parent = construct.get(key)
    if isinstance(parent, list):
        parent = parent[0] if parent else None
    return parent if isinstance(parent, str) else None

"""Parse msprobe record keys: Functional.linear.0.forward, Module.fc1.Linear.forward.0, ...parameters_grad.0.

The one home of msprobe's name patterns (tests/test_one_home.py greps the other modules for copies); the SQL
views use `MODULE_PATH_SQL`."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import polars as pl

MODULE_PREFIXES = ("Module", "Cell")
MODULE_RECORD_PREFIXES = tuple(p + "." for p in MODULE_PREFIXES)  # how module and cell record names start
_API = re.compile(r"^(?P<prefix>[A-Za-z_][\w]*)\.(?P<api>.+)\.(?P<call>\d+)\.(?P<dir>forward|backward)$")
_MODULE = re.compile(r"^(?P<prefix>Module|Cell)\.(?P<api>.+)\.(?P<dir>forward|backward)\.(?P<call>\d+)$")
_PGRAD = re.compile(r"^(?P<prefix>Module|Cell)\.(?P<api>.+)\.parameters_grad(?:\.(?P<call>\d+))?$")
_MAX_CALL_DIGITS = 4000  # int() refuses strings past 4300 digits
_DEBUG = re.compile(r"^(?P<api>.+)\.(?P<call>\d+)\.debug$")
# a module record key's path without its class (Module.layers.0.fc1.Linear.forward.0 -> layers.0.fc1)
_MODULE_PATH = re.compile(r"^(?:Module|Cell)\.(.+?)\.[A-Za-z_]\w*\.(?:forward|backward)\.\d+$")
# the same for DuckDB's regexp_extract (group 1; the class is any run of non-dots)
MODULE_PATH_SQL = r"'^(?:Module|Cell)\.(.+)\.[^.]+\.(?:forward|backward)\.\d+$'"
# a module record key, its call counter optional: path and class (body), direction
_MODULE_RECORD = re.compile(r"^(?P<kind>Module|Cell)\.(?P<body>.+)\.(?P<dir>forward|backward)(?:\.(?P<n>\d+))?$")
# for Polars' str.extract: msprobe compare's split of a key into op, call and direction (acc_compare.py
# split_data_name_components; any prefix): `{op}.{n}.{direction}` (an API call) and `{op}.{direction}.{n}` (a module)
CALL_DIRECTION_SQL = r"^(.+)\.(\d+)\.(forward|backward)$"
DIRECTION_CALL_SQL = r"^(.+)\.(forward|backward)\.(\d+)$"
# for Polars: a module record key (any direction), and a forward one
MODULE_KEY_SQL = r"^(?:Module|Cell)\."
MODULE_FORWARD_SQL = r"^(?:Module|Cell)\..+\.forward\.\d+$"
# a module record key's call counter (`...forward.1`), for Polars' str.replace too (Python's `$` also matches
# before a final line break, Polars' does not: as the two places that stripped it did)
MODULE_CALL_SQL = r"\.\d+$"
_MODULE_CALL = re.compile(MODULE_CALL_SQL)
_DIRECTION_CALL_TAIL = re.compile(r"\.(forward|backward)\.(\d+)$")
_DIRECTION_TAIL = re.compile(r"\.(forward|backward)$")
# a parameter gradient's leaf name: module path, class, parameters_grad[.call], parameter
_PGRAD_LEAF = re.compile(r"^(?:Module|Cell)\.(.+?)\.[A-Za-z_]\w*\.parameters_grad(?:\.\d+)?\.(.+)$")


class RecordName(NamedTuple):
    """A record key's parts (a named tuple: the ingest builds one per record, and tuples are quick to build)."""

    prefix: str
    api: str
    op_type: str
    call: int | None
    direction: str


def parse_record(key: str) -> RecordName:
    """Split a record key into prefix, api, op type, call counter and direction (never fails)."""
    # only an API call's key ends in forward/backward ('$' also matches before a final line break)
    if (key[:-1] if key.endswith("\n") else key).endswith(("forward", "backward")):
        m = _API.match(key)
        return _named(m, m["dir"], module=False) if m else _unparsed(key)
    m = _MODULE.match(key)
    if m:
        return _named(m, m["dir"], module=True)
    m = _PGRAD.match(key)
    if m:
        return _named(m, "parameters_grad", module=True)
    m = _DEBUG.match(key)
    if m:
        return RecordName("debug", m["api"], m["api"], _call(m["call"]), "debug")
    return _unparsed(key)


def _unparsed(key: str) -> RecordName:
    return RecordName(key.split(".", 1)[0], key, key, None, "unknown")


def _named(m: re.Match, direction: str, *, module: bool) -> RecordName:
    api = m["api"]
    op_type = api.rsplit(".", 1)[-1] if module else api
    return RecordName(m["prefix"], api, op_type, _call(m["call"]), direction)


def _call(digits: str | None) -> int | None:
    """The call counter; None when absent or longer than Python converts (the key keeps the digits)."""
    return int(digits) if digits is not None and len(digits) <= _MAX_CALL_DIGITS else None


def module_path(key: str | None) -> str | None:
    """The module path of a module record key without its class (`Module.layers.1.fc1.Linear.forward.0` ->
    'layers.1.fc1'); None for another key."""
    m = _MODULE_PATH.match(key or "")
    return m.group(1) if m else None


def module_of(module_record: str | None) -> tuple[str | None, str | None]:
    """(path, class) of a module record: `Module.layers.0.ln2.LayerNorm.forward.0` -> (`layers.0.ln2`,
    `LayerNorm`); a top-level module (`Module.TinyNet.forward.0`) has the path ''; (None, None) for another key."""
    m = _MODULE_RECORD.match(module_record or "")
    if not m:
        return None, None
    path, _, cls = m["body"].rpartition(".")
    return path, cls


def without_direction_and_call(key: str) -> str:
    """A module record key without its `.forward.N` / `.backward.N` tail (`Module.a.Linear.forward.0` ->
    `Module.a.Linear`); another key as it is."""
    return _DIRECTION_CALL_TAIL.sub("", key)


def without_module_call(key: str) -> str:
    """A module record key without its call counter (`Module.fc1.Linear.forward.1` -> `Module.fc1.Linear.forward`,
    `...parameters_grad.0` -> `...parameters_grad`): every call of a module (micro-batches, a shared layer) reads
    one parameter tensor; another key (an API call's) as it is."""
    return _MODULE_CALL.sub("", key) if key.startswith(MODULE_RECORD_PREFIXES) else key


def is_module_record_expr(key: pl.Expr) -> pl.Expr:
    """Polars: whether a record name is a module's or a cell's (`MODULE_RECORD_PREFIXES`)."""
    return key.str.contains(MODULE_KEY_SQL)


def without_module_call_expr(key: pl.Expr) -> pl.Expr:
    """`without_module_call` of a string column, in Polars (null stays null)."""
    import polars as pl

    return pl.when(is_module_record_expr(key)).then(key.str.replace(MODULE_CALL_SQL, "")).otherwise(key)


def without_direction(key: str) -> str:
    """An API record key without its `.forward` / `.backward` tail (`Functional.linear.0.forward` ->
    `Functional.linear.0`); another key as it is."""
    return _DIRECTION_TAIL.sub("", key)


def parameter_of_grad(name: str) -> str | None:
    """The parameter a gradient leaf belongs to (`Module.layers.1.fc1.Linear.parameters_grad.weight` ->
    'layers.1.fc1.weight'); None for another name."""
    m = _PGRAD_LEAF.match(name)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def strip_call(key: str) -> str:
    """Record key without its call counter (used to align calls of the same API)."""
    r = parse_record(key)
    if r.direction in ("forward", "backward"):  # an API call's or a module's: the counter is all that goes
        return f"{r.prefix}.{r.api}.{r.direction}"
    return key

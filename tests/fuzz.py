"""A deterministic mutation fuzzer for msprobe dump trees (driven by tests/test_fuzz.py).

`make_template(dest)` copies a small real dump once: ``dump/step0/rank0`` (task tensor, a few records of
sample_dumps/ref_tensor with their .pt files, stack.json, construct.json) and ``dump/step1/rank0`` (task
statistics, a few records of sample_dumps/ref_stats), plus ``canary/`` beside the dump: files the mutations
point at (through ``../`` and absolute data_names, symlinks, a linked dump.json …). Every canary tensor is
valid, has the shape and dtype of the dump file it stands in for, and holds only :data:`CANARY` — a store
that contains that value has read outside the dump.

`cases(n, seed)` yields :class:`Case` objects; ``case.build(template, dest)`` copies the template to `dest`
and applies one to three mutations chosen by a seeded RNG (the same seed gives the same trees), returning a
:class:`Built` with the path to ingest, a description of what was done and whether a one-line error (exit 1)
is an acceptable outcome (``fatal_ok``) or the run must be ingested with per-leaf errors.

:func:`expected_rows` counts the rows an ingest must store for one dump.json, independently of dumpstore.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import re
import shutil
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dumpstore._ingest import parse_json

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"
TENSOR_SRC = SAMPLES / "ref_tensor" / "step0" / "rank0"
STATS_SRC = SAMPLES / "ref_stats" / "step0" / "rank0"
TENSOR_RECORDS = (
    "Functional.embedding.0.forward",
    "Functional.layer_norm.0.forward",
    "Module.layers.0.qkv.Linear.forward.0",
    "Functional.layer_norm.0.backward",
    "Module.head.Linear.parameters_grad.0",
    "Tensor.add_.0.forward",
)
STATS_RECORDS = (
    "Functional.embedding.0.forward",
    "Module.emb.Embedding.forward.0",
    "Functional.layer_norm.0.forward",
    "Functional.linear.0.forward",
    "Functional.linear.8.backward",
    "Module.head.Linear.parameters_grad.0",
)
CANARY = 12345.0
TENSOR_UNIT = Path("step0") / "rank0"
STATS_UNIT = Path("step1") / "rank0"
CANARY_TENSORS = "canary_tensors"  # copied into a case's canary/dump_tensor_data by the mutations that need it
BOM = b"\xef\xbb\xbf"

WEIRD_STRINGS = [
    "",
    " ",
    "x",
    "NaN",
    "1.0",
    "-inf",
    "<script>alert(1)</script>",
    "a\x00b",
    "line\nbreak",
    "tab\tcr\r",
    "\udcff",
    "\ud800",
    "é✓漢",
    "../../etc/passwd",
    "%s%n",
    "x" * 10000,
]
JSON_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    10**30,
    -(10**30),
    10**400,
    1.5,
    -0.0,
    1e308,
    5e-324,
    math.nan,
    math.inf,
    -math.inf,
    [],
    [1, 2],
    [None],
    [[[]]],
    {},
    {"a": 1},
    {"type": "int", "value": 1},
    {"type": [1]},
    *WEIRD_STRINGS,
]


# ------------------------------------------------------------------------------------------ .pt files


def _long(n: int) -> bytes:
    raw = pickle.encode_long(n)
    return b"\x8a" + bytes([len(raw)]) + raw


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


_STORAGES = {
    "float16": "HalfStorage",
    "float32": "FloatStorage",
    "float64": "DoubleStorage",
    "int8": "CharStorage",
    "int16": "ShortStorage",
    "int32": "IntStorage",
    "int64": "LongStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
}


def tensor_pickle(storage: str, numel: int, size: list[int], stride: list[int], offset: int = 0) -> bytes:
    """data.pkl of torch.save(tensor), written opcode by opcode (any size/stride/offset, no torch needed)."""
    pid = _tuple([_text("storage"), b"ctorch\n" + storage.encode() + b"\n", _text("0"), _text("cpu"), _long(numel)])
    return (
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n("
        + pid
        + b"Q"
        + _long(offset)
        + _tuple([_long(d) for d in size])
        + _tuple([_long(d) for d in stride])
        + b"\x89ccollections\nOrderedDict\n)RtR."
    )


def write_pt_zip(path: Path, pkl: bytes, data: bytes) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/data/0", data)
        z.writestr("archive/version", b"3\n")


def write_pt(path: Path, arr: np.ndarray) -> None:
    """A .pt file as torch.save(torch.from_numpy(arr)) writes it (contiguous, little-endian)."""
    arr = np.array(arr, order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)
    strides = [s // arr.itemsize for s in arr.strides] if arr.size else [1] * arr.ndim
    pkl = tensor_pickle(_STORAGES[arr.dtype.name], arr.size, list(arr.shape), strides)
    write_pt_zip(path, pkl, arr.astype(arr.dtype.newbyteorder("<")).tobytes())


def canary_array(shape: Any, dtype: str = "float32") -> np.ndarray:
    ok_shape = isinstance(shape, list) and all(type(d) is int and 0 <= d < 4096 for d in shape)
    dims = tuple(shape) if ok_shape and math.prod(shape) <= 1 << 16 else (4,)
    np_dtype = dtype if dtype in ("float16", "float32", "float64", "int32", "int64") else "float32"
    return np.full(dims, CANARY, np_dtype)


# ---------------------------------------------------------------------------------------- the template


def make_template(dest: Path) -> Path:
    """Copy the small real dump and its canary folder into `dest` once; cases copy `dest`."""
    from dumpstore.ptfile import read_pt

    root, canary = dest / "dump", dest / "canary"
    tensor_dir = root / TENSOR_UNIT
    _copy_unit(TENSOR_SRC, tensor_dir, TENSOR_RECORDS, with_files=True)
    _copy_unit(STATS_SRC, root / STATS_UNIT, STATS_RECORDS, with_files=False)
    (dest / CANARY_TENSORS).mkdir(parents=True)
    canary.mkdir()
    for pt in sorted((tensor_dir / "dump_tensor_data").iterdir()):
        arr, _ = read_pt(pt)
        write_pt(dest / CANARY_TENSORS / pt.name, np.full(arr.shape, CANARY, arr.dtype))
    write_pt(canary / "secret.pt", canary_array([4]))
    np.save(canary / "secret.npy", canary_array([4]))
    leaf = {
        "type": "torch.Tensor",
        "dtype": "torch.float32",
        "shape": [4],
        "Max": CANARY,
        "Min": CANARY,
        "Mean": CANARY,
        "Norm": CANARY,
        "requires_grad": False,
        "data_name": "secret.pt",
    }
    (canary / "dump.json").write_text(
        json.dumps(
            {
                "task": "tensor",
                "level": "L1",
                "framework": "pytorch",
                "dump_data_dir": None,
                "data": {"Functional.canary.0.forward": {"input_args": [leaf], "output": [leaf]}},
            },
            indent=1,
        )
    )
    (canary / "stack.json").write_text(json.dumps({"0": [["Functional.canary.0.forward"], ["CANARY"]]}))
    (canary / "construct.json").write_text(json.dumps({"Functional.embedding.0.forward": "CANARY"}))
    return dest


def _copy_unit(src: Path, dst: Path, records: tuple[str, ...], *, with_files: bool) -> None:
    doc = json.loads((src / "dump.json").read_text())
    doc["data"] = {k: doc["data"][k] for k in records}
    dst.mkdir(parents=True)
    if with_files:
        (dst / "dump_tensor_data").mkdir()
    (dst / "dump.json").write_text(json.dumps(doc, indent=1))
    stack = json.loads((src / "stack.json").read_text())
    kept = {k: [[n for n in v[0] if n in records], v[1]] for k, v in stack.items()}
    (dst / "stack.json").write_text(json.dumps({k: v for k, v in kept.items() if v[0]}, indent=1))
    construct = json.loads((src / "construct.json").read_text())
    (dst / "construct.json").write_text(json.dumps({k: v for k, v in construct.items() if k in records}))
    if with_files:
        for name in sorted(_data_names(doc)):
            shutil.copy2(src / "dump_tensor_data" / name, dst / "dump_tensor_data" / name)


def _data_names(doc: Any) -> set[str]:
    return {leaf["data_name"] for leaf in iter_dicts(doc) if isinstance(leaf.get("data_name"), str)}


def iter_dicts(value: Any) -> Iterator[dict]:
    """Every dict inside `value` (iterative: deep nesting is part of the fuzzing)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            yield v
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


# ------------------------------------------------------------------------------------ the leaf counter


def _is_leaf(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and "type" in v and not isinstance(v["type"], (dict, list)))


MAX_DEPTH = 400  # msprobe caps nesting at 400 levels (format §3); anything deeper is one error row
FORWARD = ("input_args", "input_kwargs", "output", "parameters")
BACKWARD = ("input", "output")


def count_values(value: Any, depth: int = 0) -> int:
    """Rows below `value` at nesting level `depth`: one per leaf (null, an object with a scalar 'type', any
    non-container value) or per container nested deeper than MAX_DEPTH; an empty container holds none.
    Iterative: the fuzzer nests far deeper than Python's recursion limit."""
    total, stack = 0, [(value, depth)]
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH or _is_leaf(v) or not isinstance(v, (dict, list)):
            total += 1
        else:
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return total


def _section_rows(value: Any) -> int:
    """A known section: its positions (args) or names (kwargs) are level 0."""
    if isinstance(value, list) or (isinstance(value, dict) and not _is_leaf(value)):
        return sum(count_values(c) for c in (value.values() if isinstance(value, dict) else value))
    return count_values(value)


def _record_kind(key: str) -> str:
    """Record kinds by key (format §2.1), tried in this order: module, parameters_grad, debug, API."""
    module = re.match(r"^(Module|Cell)\..+\.(forward|backward)\.\d+$", key)
    if module:
        return module[2]
    if re.match(r"^(Module|Cell)\..+\.parameters_grad(\.\d+)?$", key):
        return "parameters_grad"
    if re.match(r"^.+\.\d+\.debug$", key):
        return "debug"
    api = re.match(r"^[A-Za-z_]\w*\..+\.\d+\.(forward|backward)$", key)
    return api[1] if api else "forward"


def _record_rows(key: str, record: Any) -> int:
    if not isinstance(record, dict):
        return 1  # a record that is not an object is one error row
    kind = _record_kind(key)
    if kind == "debug":
        return count_values(record)
    if kind == "parameters_grad":  # {param: [leaf]}: the one-element list adds no level
        return sum(count_values(v[0] if isinstance(v, list) and len(v) == 1 else v) for v in record.values())
    known = BACKWARD if kind == "backward" else FORWARD
    return sum(
        _section_rows(v) if k in known else count_values(v) for k, v in record.items() if k != "is_recompute"
    )  # is_recompute is a flag of the record, not a leaf


def expected_rows(doc: Any) -> int:
    """Rows an ingest of this dump.json must store: one per leaf of every record (format §2-3)."""
    return sum(_record_rows(str(key), record) for key, record in doc["data"].items())


def unit_doc(path: Path) -> Any:
    doc = parse_json(path.read_bytes())  # the ingest's parser: ujson takes nesting (up to 1024) that json cannot
    if path.name == "debug.json" and isinstance(doc, dict) and "data" not in doc:
        doc = {"data": doc}
    return doc


# ------------------------------------------------------------------------------------------- the tree

NEST_DEPTHS = (50, 399, 400, 401, 402, 500, 700)
VALUE_DEPTHS = (100, 400, 700, 850)
TEXT_DEPTHS = (990, 3000, 100000)
ENCODINGS = ("bom", "utf16", "utf32", "latin1-byte", "cesu-surrogate", "empty", "whitespace", "trailing", "nul")
JSON_FILE_KINDS = (
    "fifo",
    "dir",
    "missing",
    "sparse-5GiB",
    "link-passwd",
    "link-canary",
    "link-dangling",
    "link-loop",
    "link-relative-canary",
    "dev-zero",
)
PT_DAMAGE = ("truncate", "zero", "random", "bitflip", "zeros", "append", "head-only")
PT_FILE_KINDS = (
    "missing",
    "dir",
    "fifo",
    "link-canary",
    "link-relative-canary",
    "link-dev-zero",
    "link-dangling",
    "link-loop",
    "link-sibling",
)
PT_CONTENTS = (
    "npy-in-pt",
    "other-file",
    "float64",
    "bool",
    "int8",
    "0-d",
    "empty",
    "nan-inf",
    "huge-claim",
    "stride0-bomb",
    "negative-stride",
    "offset-past-end",
    "pickle-dict",
    "pickle-exec",
    "pickle-list",
    "legacy",
    "two-archives",
)
NPY_KINDS = (
    "renamed-pt",
    "renamed-keep-name",
    "float64",
    "object",
    "string",
    "structured",
    "fortran",
    "big-endian",
    "0-d",
    "huge-header",
    "truncated",
    "bad-header",
    "v3-header",
    "complex",
    "bool",
    "float16",
)
TENSOR_DIR_KINDS = ("file", "missing", "link-canary", "link-relative-canary", "empty", "link-self", "nested")
DIR_NAMES = (
    "proc4242",
    "proc1",
    "rank99999999999999999999",
    "rank9223372036854775808",
    "rank2147483648",
    "rank-1",
    "rank1\n",
    "rank\u0663",
    "rank 1",
    "RANK1",
    "rank\udcff",
    "step99999999999999999999",
    "step9223372036854775807",
    "step2147483648",
    "step1\n",
    "graph",
    "pynative",
    "dump_tensor_data",
    "\udcff\udcfe",
)
MOVES = ("graph-pynative", "nested-step", "under-nonutf8", "under-newline", "deep")
STRAYS = (
    "pt-in-root",
    "pt-in-step",
    "nonutf8-plain-folder",
    "nonutf8-in-tensor-dir",
    "link-to-canary-dir",
    "link-step-to-canary",
    "empty-step",
    "empty-rank",
    "fifo-in-rank",
    "debug-json",
    "debug-json-bare",
    "plain-folder-links",
)


class Tree:
    """A copied template being mutated: JSON documents stay parsed until a file-level mutation needs them."""

    def __init__(self, base: Path, rng: random.Random, force: Any = None, template: Path | None = None):
        self.base, self.rng, self.force, self.template = base, rng, force, template or base
        self.root, self.canary = base / "dump", base / "canary"
        self.ingest_path = self.root
        self.docs: dict[Path, Any] = {p: json.loads(p.read_text()) for p in sorted(self.root.rglob("*.json"))}

    def choose(self, variants: tuple) -> Any:
        """One of a mutation's variants: the forced one (a case that covers each variant once), else random."""
        return self.force if self.force is not None and self.force in variants else self.rng.choice(variants)

    # -- documents --------------------------------------------------------------------------------
    def dump_docs(self) -> list[tuple[Path, dict]]:
        return [
            (p, d)
            for p, d in self.docs.items()
            if p.name == "dump.json" and isinstance(d, dict) and isinstance(d.get("data"), dict)
        ]

    def pick_dump(self, tensor_first: bool = False) -> tuple[Path, dict] | None:
        docs = self.dump_docs()
        if tensor_first:
            docs = [x for x in docs if x[0].parent == self.root / TENSOR_UNIT] or docs
        return self.rng.choice(docs) if docs else None

    def pick_record(self) -> tuple[dict, str] | None:
        found = self.pick_dump()
        if not found or not found[1]["data"]:
            return None
        data = found[1]["data"]
        return data, self.rng.choice(list(data))

    def tensor_leaves(self, with_file: bool = False) -> list[dict]:
        found = self.pick_dump(tensor_first=with_file)
        if not found:
            return []
        return [
            d
            for d in iter_dicts(found[1]["data"])
            if "dtype" in d and "shape" in d and (not with_file or isinstance(d.get("data_name"), str))
        ]

    def pick_leaf(self, with_file: bool = False) -> dict | None:
        leaves = self.tensor_leaves(with_file)
        return self.rng.choice(leaves) if leaves else None

    def leaf_copy(self) -> dict | None:
        leaf = self.pick_leaf()
        return json.loads(json.dumps(leaf)) if leaf is not None else None

    def containers(self) -> list[tuple[Any, Any]]:
        """(container, key) slots holding a leaf or section inside a dump's records."""
        found = self.pick_dump()
        if not found:
            return []
        slots: list[tuple[Any, Any]] = []
        for record in found[1]["data"].values():
            stack = [record]
            while stack:
                v = stack.pop()
                items = list(v.items()) if isinstance(v, dict) else list(enumerate(v)) if isinstance(v, list) else []
                for k, child in items:
                    slots.append((v, k))
                    if not _is_leaf(child):
                        stack.append(child)
        return slots

    def load(self, path: Path) -> Any:
        """Parse a JSON file again (after phase 0) so that a later mutation can edit it; None if unreadable."""
        try:
            if not path.is_symlink() and path.is_file():
                self.docs[path] = json.loads(path.read_bytes())
                return self.docs[path]
        except (ValueError, RecursionError):
            pass
        return None

    def flush(self, path: Path) -> None:
        """Write a parsed document to disk now (before a file-level mutation of it)."""
        if path in self.docs:
            path.write_text(json.dumps(self.docs.pop(path)))  # (indent would use the slow Python encoder)

    def flush_all(self) -> None:
        for path in list(self.docs):
            self.flush(path)

    def pick_json(self, dump_weight: int = 3) -> Path | None:
        files = sorted(p for p in self.root.rglob("*.json") if p.is_file() and not p.is_symlink())
        weighted = [p for p in files for _ in range(dump_weight if p.name == "dump.json" else 1)]
        return self.rng.choice(weighted) if weighted else None

    # -- files ------------------------------------------------------------------------------------
    def tensor_dir(self) -> Path:
        return self.root / TENSOR_UNIT / "dump_tensor_data"

    def tensor_files(self) -> list[Path]:
        d = self.tensor_dir()
        if not d.is_dir() or d.is_symlink():
            return []
        return sorted(p for p in d.iterdir() if p.is_file() and not p.is_symlink())

    def pick_file(self) -> Path | None:
        files = self.tensor_files()
        return self.rng.choice(files) if files else None

    def canary_for(self, leaf: dict, name: str) -> Path:
        """A canary tensor shaped like `leaf` (so only the refusal to read it keeps it out of the store)."""
        from dumpstore.dtypes import canonical

        path = self.canary / name
        arr = canary_array(leaf.get("shape"), canonical(leaf.get("dtype")))
        if name.endswith(".npy"):
            np.save(path, arr)
        else:
            write_pt(path, arr)
        return path

    def canary_tensors(self) -> Path:
        """canary/dump_tensor_data: a canary for every tensor file of the dump, same name, shape and dtype."""
        d = self.canary / "dump_tensor_data"
        if not d.exists():
            shutil.copytree(self.template / CANARY_TENSORS, d)
        return d

    def unit_dirs(self) -> list[Path]:
        return sorted(p for p in (self.root / TENSOR_UNIT, self.root / STATS_UNIT) if p.is_dir())


# ---------------------------------------------------------------------------------------- mutations

Apply = Callable[[Tree], str]


@dataclass(frozen=True)
class Mutation:
    name: str
    phase: int  # 0 documents, 1 JSON files as bytes, 2 tensor files, 3 layout (applied in this order)
    fatal_ok: bool  # the ingest may end in a one-line error instead of a run with per-leaf errors
    apply: Apply
    variants: tuple = ()  # what Tree.choose picks from; each gets a case of its own


MUTATIONS: dict[str, Mutation] = {}


def mutation(phase: int, fatal_ok: bool = False, variants: tuple = ()) -> Callable[[Apply], Apply]:
    def register(fn: Apply) -> Apply:
        name = fn.__name__.lstrip("_")
        MUTATIONS[name] = Mutation(name, phase, fatal_ok, fn, variants)
        return fn

    return register


def _val(t: Tree) -> Any:
    return t.rng.choice(JSON_VALUES)


def _short(value: Any) -> str:
    return repr(value)[:60]


# -- phase 0: parsed documents ------------------------------------------------------------------------


@mutation(0, fatal_ok=True)
def _top_wrong_type(t: Tree) -> str:
    found = t.pick_dump()
    if not found:
        return "no dump left"
    value = t.rng.choice([[], [found[1]], "dump", 1, None, True])
    t.docs[found[0]] = value
    return f"{found[0].name} is {_short(value)}"


@mutation(0, fatal_ok=True)
def _data_wrong_type(t: Tree) -> str:
    found = t.pick_dump()
    if not found:
        return "no dump left"
    value = t.rng.choice([v for v in JSON_VALUES if not isinstance(v, dict)] + [list(found[1]["data"].values())])
    found[1]["data"] = value
    return f"data is {_short(value)}"


@mutation(0, fatal_ok=True)
def _data_missing(t: Tree) -> str:
    found = t.pick_dump()
    if not found:
        return "no dump left"
    del found[1]["data"]
    return "no 'data' key"


@mutation(0)
def _data_empty(t: Tree) -> str:
    found = t.pick_dump()
    if found:
        found[1]["data"] = {}
    return "data is {}"


@mutation(0)
def _meta_fields(t: Tree) -> str:
    found = t.pick_dump()
    if not found:
        return "no dump left"
    out = []
    for key in t.rng.sample(["task", "level", "framework", "dump_data_dir"], t.rng.randint(1, 4)):
        if t.rng.random() < 0.3:
            found[1].pop(key, None)
            out.append(f"-{key}")
        else:
            found[1][key] = t.rng.choice([*JSON_VALUES, str(t.canary), "tensor", "statistics", "debug"])
            out.append(f"{key}={_short(found[1][key])}")
    return ", ".join(out)


@mutation(0)
def _top_extra_keys(t: Tree) -> str:
    found = t.pick_dump()
    if not found:
        return "no dump left"
    keys = [t.rng.choice(WEIRD_STRINGS) + str(i) for i in range(t.rng.randint(1, 4))]
    for k in keys:
        found[1][k] = _val(t)
    return f"extra top-level keys {_short(keys)}"


@mutation(0)
def _record_value_type(t: Tree) -> str:
    found = t.pick_record()
    if not found:
        return "no record"
    data, key = found
    data[key] = t.rng.choice([v for v in JSON_VALUES if not isinstance(v, dict)] + [[data[key]]])
    return f"record {key} is {_short(data[key])}"


@mutation(0)
def _record_key_weird(t: Tree) -> str:
    found = t.pick_record()
    if not found:
        return "no record"
    data, key = found
    new = t.rng.choice(
        [
            *WEIRD_STRINGS,
            "Functional.linear.99999999999999999999.forward",
            "Module.a.B.forward.99999999999999999999",
            "Module.a.parameters_grad.99999999999",
            "Module.a.B.parameters_grad",
            "x.0.debug",
            "my\nvar.3.debug",
            "Module..forward.0",
            ".forward",
            "Functional.linear.-1.forward",
            "Functional.linear.\u0663.forward",
            "Functional.linear." + "9" * 5000 + ".forward",
            "Module.a.B.forward." + "9" * 5000,
            "x." + "9" * 5000 + ".debug",
            "Module.a.parameters_grad." + "9" * 5000,
            "Functional." + "0." * 20000 + "forward",
            "Module." + "a." * 20000 + "backward.x",
            key + "\x00",
            key + ".backward",
            "Module." + key,
        ]
    )
    record = data.pop(key)
    data[new] = record
    return f"record {key} renamed {_short(new)}"


@mutation(0)
def _record_sections(t: Tree) -> str:
    found = t.pick_record()
    if not found or not isinstance(found[0][found[1]], dict):
        return "no record"
    record = found[0][found[1]]
    out = []
    for _ in range(t.rng.randint(1, 3)):
        op = t.rng.choice(["drop", "retype", "extra", "recompute"])
        if op == "drop" and record:
            k = t.rng.choice(list(record))
            del record[k]
            out.append(f"-{k}")
        elif op == "retype" and record:
            k = t.rng.choice(list(record))
            record[k] = _val(t)
            out.append(f"{k}={_short(record[k])}")
        elif op == "recompute":
            record["is_recompute"] = _val(t)
            out.append(f"is_recompute={_short(record['is_recompute'])}")
        else:
            k = t.rng.choice(["input", "output", "parameters", "input_kwargs", "grad", *WEIRD_STRINGS])
            record[k] = t.rng.choice([_val(t), [_val(t), None], {"w": t.leaf_copy()}])
            out.append(f"+{_short(k)}")
    return f"record {found[1]}: {', '.join(out)}"


@mutation(0)
def _record_duplicate(t: Tree) -> str:
    found = t.pick_record()
    if not found:
        return "no record"
    data, key = found
    for i in range(t.rng.randint(1, 3)):
        data[f"{key}.dup{i}"] = json.loads(json.dumps(data[key]))
    return f"record {key} copied (same data_names)"


@mutation(0)
def _records_many(t: Tree) -> str:
    found = t.pick_dump()
    if not found:
        return "no dump left"
    n = t.rng.choice([300, 1000])
    for i in range(n):
        record = {"input_args": [{"type": "int", "value": i}], "output": [None]}
        found[1]["data"][f"Functional.relu.{i}.forward"] = record
    return f"{n} extra small records"


@mutation(0, variants=NEST_DEPTHS)
def _deep_nesting(t: Tree) -> str:
    slots = t.containers()
    if not slots:
        return "no slot"
    parent, k = t.rng.choice(slots)
    depth = t.choose(NEST_DEPTHS)
    value = parent[k]
    for i in range(depth):
        value = [value] if t.rng.random() < 0.5 else {f"k{i}": value}
    parent[k] = value
    return f"leaf wrapped {depth} levels deep"


@mutation(0, variants=VALUE_DEPTHS)
def _deep_scalar_value(t: Tree) -> str:
    slots = t.containers()
    if not slots:
        return "no slot"
    parent, k = t.rng.choice(slots)
    depth = t.choose(VALUE_DEPTHS)
    value: Any = 1
    for _ in range(depth):
        value = [value]
    parent[k] = {"type": "int", "value": value}
    return f"scalar leaf with a value nested {depth} deep"


@mutation(0)
def _leaf_field(t: Tree) -> str:
    leaf = t.pick_leaf()
    if leaf is None:
        return "no tensor leaf"
    out = []
    for key in t.rng.sample(
        ["type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad", "md5", "data_name"],
        t.rng.randint(1, 3),
    ):
        leaf[key] = _val(t)
        out.append(f"{key}={_short(leaf[key])}")
    return ", ".join(out)


@mutation(0)
def _leaf_missing_keys(t: Tree) -> str:
    leaf = t.pick_leaf()
    if leaf is None:
        return "no tensor leaf"
    gone = t.rng.sample(sorted(leaf), t.rng.randint(1, len(leaf)))
    for k in gone:
        del leaf[k]
    return f"leaf without {gone}"


@mutation(0)
def _leaf_extra_keys(t: Tree) -> str:
    leaf = t.pick_leaf()
    if leaf is None:
        return "no tensor leaf"
    keys = [
        t.rng.choice([*WEIRD_STRINGS, "value", "class_type", "tensor", "placements", "is_nan"])
        for _ in range(t.rng.randint(1, 3))
    ]
    for k in keys:
        leaf[k] = _val(t)
    return f"leaf with extra keys {_short(keys)}"


@mutation(0)
def _leaf_dtype(t: Tree) -> str:
    leaf = t.pick_leaf()
    if leaf is None:
        return "no tensor leaf"
    leaf["dtype"] = t.rng.choice(
        [
            "unknown",
            "torch.int64",
            "torch.int8",
            "torch.bfloat16",
            "torch.float16",
            "torch.float64",
            "Float32",
            "BFloat16",
            "int",
            "float",
            "torch.bool",
            "torch.complex64",
            "torch.float8_e4m3fn",
            "torch_npu.HiFloat8Tensor",
            None,
            5,
            "",
            "<class 'numpy.float32'>",
        ]
    )
    return f"dtype={_short(leaf['dtype'])}"


@mutation(0)
def _leaf_shape(t: Tree) -> str:
    leaf = t.pick_leaf()
    if leaf is None:
        return "no tensor leaf"
    shape = leaf.get("shape") if isinstance(leaf.get("shape"), list) else [1]
    leaf["shape"] = t.rng.choice(
        [
            [-1],
            [2, -8],
            [1.5],
            [2.0, 8.0],
            [10**8, 10**7],
            [10**15],
            [2**62, 4],
            [2**63],
            [2**64],
            [],
            [0],
            [1, 0, 3],
            "2,8",
            [[2]],
            [True, 2],
            [None],
            10**20,
            list(reversed(shape)),
            shape + [1],
            shape[1:],
            [math.prod(d for d in shape if isinstance(d, int))],
        ]
    )
    return f"shape={_short(leaf['shape'])}"


@mutation(0)
def _leaf_stats(t: Tree) -> str:
    leaf = t.pick_leaf()
    if leaf is None:
        return "no tensor leaf"
    out = []
    for key in t.rng.sample(["Max", "Min", "Mean", "Norm"], t.rng.randint(1, 4)):
        leaf[key] = t.rng.choice(
            [
                math.nan,
                math.inf,
                -math.inf,
                "1.0",
                "NaN",
                "inf",
                1e308,
                -1e308,
                -0.0,
                10**400,
                -(10**400),
                True,
                None,
                [1.0],
                {"v": 1},
            ]
        )
        out.append(f"{key}={_short(leaf[key])}")
    return ", ".join(out)


@mutation(0)
def _leaf_md5(t: Tree) -> str:
    leaf = t.pick_leaf()
    if leaf is None:
        return "no tensor leaf"
    leaf["md5"] = t.rng.choice(
        [12345678, "", "0x", "0x" + "f" * 100, "zzzz", None, ["ab"], {"a": 1}, 1.5, "\udcff", "6fe579d0"]
    )
    return f"md5={_short(leaf['md5'])}"


@mutation(0)
def _scalar_leaves(t: Tree) -> str:
    slots = t.containers()
    if not slots:
        return "no slot"
    out = []
    for _ in range(t.rng.randint(1, 3)):
        parent, k = t.rng.choice(slots)
        kind = t.rng.choice(
            [
                "int",
                "float",
                "bool",
                "str",
                "slice",
                "ellipsis",
                "torch.Size",
                "torch.dtype",
                "torch.device",
                "torch.ProcessGroup",
                "float64",
                "",
                "torch.Tensor",
                None,
                5,
            ]
        )
        leaf: dict[str, Any] = {"type": kind, "value": _val(t)}
        if t.rng.random() < 0.3:
            leaf = {
                "class_type": "torch.distributed.P2POp",
                "tensor": t.leaf_copy(),
                "op": _val(t),
                "peer": _val(t),
                "tag": 0,
                "group_id": "1",
            }
        elif t.rng.random() < 0.3:
            leaf = {"type": "torch.ProcessGroup", "group_ranks": _val(t), "group_id": _val(t)}
        parent[k] = leaf
        out.append(_short(leaf))
    return "; ".join(out)


@mutation(0)
def _replace_with_value(t: Tree) -> str:
    slots = t.containers()
    if not slots:
        return "no slot"
    parent, k = t.rng.choice(slots)
    parent[k] = _val(t)
    return f"a leaf or section replaced by {_short(parent[k])}"


@mutation(0)
def _weird_index_keys(t: Tree) -> str:
    found = t.pick_record()
    if not found or not isinstance(found[0][found[1]], dict):
        return "no record"
    record = found[0][found[1]]
    keys = {t.rng.choice(WEIRD_STRINGS) + str(i): t.rng.choice([t.leaf_copy(), _val(t)]) for i in range(3)}
    record["input_kwargs"] = keys
    return f"input_kwargs keys {_short(list(keys))}"


_ESCAPES = [
    "../../../../canary/{c}",
    "../../../canary/{c}",
    "../canary/{c}",
    "{abs}",
    "dump_tensor_data/../../../../canary/{c}",
    "./{c}",
    "sub/{c}",
    "..\\..\\..\\..\\canary\\{c}",
    "~/{c}",
    "%2e%2e/%2e%2e/canary/{c}",
    "file://{abs}",
    "/etc/passwd",
    "/dev/zero",
    "/proc/self/environ",
    "..",
    ".",
    "",
    "a\x00b.pt",
    "x" * 300 + ".pt",
    "x" * 5000,
    "{c}\n",
    "\udcff\udcfe.pt",
    "\ud800.pt",
    "secret.txt",
    "CON",
    "dump.json",
    "../dump.json",
    "../stack.json",
]


@mutation(0, variants=_ESCAPES)
def _data_name_escape(t: Tree) -> str:
    leaf = t.pick_leaf(with_file=True)
    if leaf is None:
        return "no leaf with a file"
    name = "secret-%d.pt" % t.rng.randrange(10**6)
    target = t.canary_for(leaf, name)
    leaf["data_name"] = t.choose(_ESCAPES).format(c=name, abs=target)
    if t.rng.random() < 0.3:  # a canary inside the rank folder, outside dump_tensor_data
        write_pt(t.root / TENSOR_UNIT / name, canary_array(leaf.get("shape")))
        leaf["data_name"] = "../" + name
    return f"data_name={_short(leaf['data_name'])}"


@mutation(0)
def _data_name_other(t: Tree) -> str:
    leaf = t.pick_leaf(with_file=True)
    files = t.tensor_files()
    if leaf is None or not files:
        return "no leaf with a file"
    leaf["data_name"] = t.rng.choice(
        [p.name for p in files] + ["missing.pt", "missing.npy", "x.PT", "x.NPY", "x.pth", "noext"]
    )
    return f"data_name={_short(leaf['data_name'])} (another or no file)"


@mutation(0)
def _data_name_nonutf8(t: Tree) -> str:
    """A data_name with lone surrogates naming a file whose name is not UTF-8."""
    leaf = t.pick_leaf(with_file=True)
    if leaf is None:
        return "no leaf with a file"
    src = t.tensor_dir() / leaf["data_name"]
    name = t.rng.choice(["\udcff\udcfe.pt", "a\udce9.pt", "\udc80.npy"])
    dst = t.tensor_dir() / name
    if src.is_file():
        shutil.copyfile(src, dst)
    leaf["data_name"] = name
    return f"data_name={os.fsencode(name)!r} (file name not UTF-8)"


# -- phase 1: JSON files as bytes -------------------------------------------------------------------------


def _json_bytes(t: Tree) -> tuple[Path | None, bytes]:
    path = t.pick_json()
    if path is None:
        return None, b""
    t.flush(path)
    return path, path.read_bytes()


@mutation(1, fatal_ok=True)
def _json_truncate(t: Tree) -> str:
    path, raw = _json_bytes(t)
    if path is None:
        return "no JSON"
    cut = t.rng.randrange(len(raw) or 1)
    path.write_bytes(raw[:cut])
    return f"{path.name} cut to {cut} of {len(raw)} bytes"


@mutation(1, fatal_ok=True)
def _json_garbage(t: Tree) -> str:
    path, raw = _json_bytes(t)
    if path is None:
        return "no JSON"
    junk = t.rng.choice(
        [
            b"{",
            b"}",
            b",",
            b"\x00",
            b"\xff\xfe",
            b"]]",
            b'"',
            b"NaN",
            b"Infinity",
            b"-",
            b"\n}\n{",
            b"//c",
            b"'x'",
            b"\\u12",
        ]
    )
    at = t.rng.randrange(len(raw) + 1)
    path.write_bytes(raw[:at] + junk + raw[at:])
    return f"{path.name}: {junk!r} inserted at {at}"


@mutation(1, fatal_ok=True, variants=ENCODINGS)
def _json_encoding(t: Tree) -> str:
    path, raw = _json_bytes(t)
    if path is None:
        return "no JSON"
    how = t.choose(ENCODINGS)
    text = raw.decode()
    new = {
        "bom": lambda: BOM + raw,
        "utf16": lambda: text.encode("utf-16"),
        "utf32": lambda: text.encode("utf-32"),
        "latin1-byte": lambda: raw.replace(b'"', b'"\xe9', 1),
        "cesu-surrogate": lambda: raw.replace(b'"', b'"\xed\xa0\x80', 1),
        "empty": lambda: b"",
        "whitespace": lambda: b" \n\t ",
        "trailing": lambda: raw + b"\n{}\n",
        "nul": lambda: raw + b"\x00",
    }[how]()
    path.write_bytes(new)
    return f"{path.name}: {how}"


@mutation(1, fatal_ok=True)
def _json_numbers(t: Tree) -> str:
    path, raw = _json_bytes(t)
    if path is None:
        return "no JSON"
    token = t.rng.choice(
        [
            b"NaN",
            b"Infinity",
            b"-Infinity",
            b"1e999",
            b"-1e999",
            b"9" * 5000,
            b"9" * 400,
            b"1e-999",
            b"-0",
            b"0.0000000000000000000000000001",
            b"123456789012345678901234567890",
        ]
    )
    new = raw.replace(b'"Max": ', b'"Max": ' + token + b', "_was": ', 1)
    path.write_bytes(new)
    return f"{path.name}: Max={token[:20]!r}"


@mutation(1)
def _json_duplicate_keys(t: Tree) -> str:
    path, raw = _json_bytes(t)
    if path is None:
        return "no JSON"
    new = raw.replace(b'"dtype": ', b'"dtype": "torch.int8", "shape": "dup", "dtype": ', 1)
    dup = b'"Functional.dup.0.forward": 1, "Functional.dup.0.forward": {"output": [null]}'
    if b'"data": {}' in new:
        new = new.replace(b'"data": {}', b'"data": {' + dup + b"}", 1)
    else:
        new = new.replace(b'"data": {"', b'"data": {' + dup + b', "', 1)
    path.write_bytes(new)
    return f"{path.name}: duplicate keys in data and in a leaf"


@mutation(1, fatal_ok=True, variants=TEXT_DEPTHS)
def _json_deep_text(t: Tree) -> str:
    path, raw = _json_bytes(t)
    if path is None:
        return "no JSON"
    depth = t.choose(TEXT_DEPTHS)
    inner = b"[" * depth + b"null" + b"]" * depth
    path.write_bytes(b'{"data": {"Functional.deep.0.forward": {"input_args": ' + inner + b"}}}")
    return f"{path.name}: {depth} nested lists as text"


@mutation(1, fatal_ok=True, variants=JSON_FILE_KINDS)
def _json_special_file(t: Tree) -> str:
    path = t.pick_json()
    if path is None:
        return "no JSON"
    t.flush(path)
    how = t.choose(JSON_FILE_KINDS)
    path.unlink()
    canary = t.canary / path.name
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        path.mkdir()
    elif how == "sparse-5GiB":
        with open(path, "wb") as fh:
            fh.truncate(5 << 30)
    elif how == "link-passwd":
        path.symlink_to("/etc/passwd")
    elif how == "link-canary":
        path.symlink_to(canary)
    elif how == "link-relative-canary":
        path.symlink_to(os.path.relpath(canary, path.parent))
    elif how == "link-dangling":
        path.symlink_to(path.parent / "nowhere.json")
    elif how == "link-loop":
        path.symlink_to(path)
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")
    return f"{path.relative_to(t.root)} is {how}"


@mutation(1)
def _aux_json_content(t: Tree) -> str:
    units = t.unit_dirs()
    if not units:
        return "no unit"
    path = t.rng.choice(units) / t.rng.choice(["stack.json", "construct.json"])
    key = "Functional.embedding.0.forward"
    value = t.rng.choice(
        [
            [],
            "x",
            1,
            None,
            {"0": 5},
            {"0": [[1, 2], [3]]},
            {"0": [[key], "frames"]},
            {"0": [[{"a": 1}], [None]]},
            {"0": [[key], [{"f": 1}, ["x"], "\udcff"]]},
            {key: ["File \udcff, line 1"]},
            {"0": [[key, key], ["a\nb"] * 3]},
            {key: 5},
            {key: [1, 2]},
            {key: []},
            {key: {"a": "b"}},
            {key: "\udcff"},
            {key: "a\x00\nb"},
            {key: key},
            {"x" * 5000: "y" * 5000},
        ]
    )
    t.docs.pop(path, None)
    path.write_text(json.dumps(value))
    return f"{path.relative_to(t.root)} = {_short(value)}"


# -- phase 2: tensor files ------------------------------------------------------------------------------


@mutation(2, variants=PT_DAMAGE)
def _pt_damage(t: Tree) -> str:
    path = t.pick_file()
    if path is None:
        return "no tensor file"
    raw = path.read_bytes()
    how = t.choose(PT_DAMAGE)
    if how == "truncate":
        raw = raw[: t.rng.randrange(len(raw))]
    elif how == "zero":
        raw = b""
    elif how == "random":
        raw = t.rng.randbytes(t.rng.choice([1, 64, 700, len(raw)]))
    elif how == "bitflip":
        buf = bytearray(raw)
        for _ in range(t.rng.randint(1, 8)):
            i = t.rng.randrange(len(buf))
            buf[i] ^= 1 << t.rng.randrange(8)
        raw = bytes(buf)
    elif how == "zeros":
        raw = bytes(len(raw))
    elif how == "append":
        raw = raw + t.rng.randbytes(100)
    else:
        raw = raw[:30]
    path.write_bytes(raw)
    return f"{path.name}: {how}"


@mutation(2, variants=PT_FILE_KINDS)
def _pt_special_file(t: Tree) -> str:
    path = t.pick_file()
    if path is None:
        return "no tensor file"
    how = t.choose(PT_FILE_KINDS)
    sibling = t.rng.choice(t.tensor_files())
    path.unlink()
    canary = t.canary_tensors() / path.name
    if how == "dir":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "link-canary":
        path.symlink_to(canary)
    elif how == "link-relative-canary":
        path.symlink_to(os.path.relpath(canary, path.parent))
    elif how == "link-dev-zero":
        path.symlink_to("/dev/zero")
    elif how == "link-dangling":
        path.symlink_to("nowhere.pt")
    elif how == "link-loop":
        path.symlink_to(path.name)
    elif how == "link-sibling":
        path.symlink_to(sibling.name if sibling != path else "nowhere.pt")
    return f"{path.name} is {how}"


class _Exec:
    """Unpickling runs `code` (a .pt that a safe reader must refuse)."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self) -> Any:
        return exec, (self.code,)


@mutation(2, variants=PT_CONTENTS)
def _pt_content(t: Tree) -> str:
    """Valid files whose contents disagree with dump.json, or that the reader must refuse."""
    path = t.pick_file()
    if path is None:
        return "no tensor file"
    how = t.choose(PT_CONTENTS)
    rng = np.random.default_rng(t.rng.randrange(1 << 30))
    if how == "npy-in-pt":
        np.save(path.with_suffix(".tmp.npy"), rng.standard_normal(4).astype(np.float32))
        os.replace(path.with_suffix(".tmp.npy"), path)
    elif how == "other-file":
        others = [p for p in t.tensor_files() if p != path]
        if others:
            shutil.copyfile(t.rng.choice(others), path)
    elif how in ("float64", "bool", "int8"):
        write_pt(path, (rng.standard_normal((2, 3)) * 3).astype(how))
    elif how == "0-d":
        write_pt(path, np.array(3.5, np.float32))
    elif how == "empty":
        write_pt(path, np.zeros((0, 4), np.float32))
    elif how == "nan-inf":
        write_pt(path, np.array([np.nan, np.inf, -np.inf, 3.4e38], np.float32))
    elif how == "huge-claim":
        write_pt_zip(path, tensor_pickle("FloatStorage", 10**15, [10**8, 10**7], [10**7, 1]), bytes(16))
    elif how == "stride0-bomb":  # 4 bytes on disk, 4 GiB once expanded
        write_pt_zip(path, tensor_pickle("FloatStorage", 1, [1 << 30], [0]), bytes(4))
    elif how == "negative-stride":
        write_pt_zip(path, tensor_pickle("FloatStorage", 4, [4], [-1], 3), bytes(16))
    elif how == "offset-past-end":
        write_pt_zip(path, tensor_pickle("FloatStorage", 4, [4], [1], 1 << 40), bytes(16))
    elif how == "pickle-dict":
        write_pt_zip(path, pickle.dumps({"t": 1}, protocol=2), b"")
    elif how == "pickle-list":
        write_pt_zip(path, pickle.dumps([1.0, 2.0], protocol=2), b"")
    elif how == "pickle-exec":
        write_pt_zip(path, pickle.dumps(_Exec(f"open({str(t.canary / 'pwned')!r}, 'w').close()"), protocol=2), b"")
    elif how == "legacy":
        path.write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    else:
        with zipfile.ZipFile(path, "a") as z:
            z.writestr("other/data.pkl", b"\x80\x02N.")
    return f"{path.name}: {how}"


@mutation(2, variants=NPY_KINDS)
def _npy_files(t: Tree) -> str:
    """A leaf switched to a .npy file of some kind (the .pt renamed, or numpy content of every sort)."""
    doc = t.load(t.root / TENSOR_UNIT / "dump.json")
    leaves = [d for d in iter_dicts(doc) if isinstance(d.get("data_name"), str)] if doc is not None else []
    if not leaves:
        t.docs.pop(t.root / TENSOR_UNIT / "dump.json", None)
        return "no leaf with a file"
    leaf = t.rng.choice(leaves)
    name = str(leaf["data_name"]).rsplit(".", 1)[0] + ".npy"
    if "/" in name or "\x00" in name or len(name) > 200:
        t.docs.pop(t.root / TENSOR_UNIT / "dump.json")
        return "odd data_name"
    path = t.tensor_dir() / name
    src = t.tensor_dir() / str(leaf["data_name"])
    how = t.choose(NPY_KINDS)
    rng = np.random.default_rng(t.rng.randrange(1 << 30))
    shape = (
        tuple(leaf["shape"])
        if isinstance(leaf.get("shape"), list) and all(type(d) is int and 0 <= d < 100 for d in leaf["shape"])
        else (3,)
    )
    leaf["data_name"] = name
    try:
        if how in ("renamed-pt", "renamed-keep-name"):
            if not src.is_file() or src.is_symlink():
                return f"{name}: no file to rename"
            if how == "renamed-keep-name":
                leaf["data_name"] = src.name
                os.replace(src, src.with_name(src.name + ".npy"))
                return f"{src.name} renamed .npy, data_name kept"
            os.replace(src, path)
        elif how == "object":
            with open(path, "wb") as fh:
                np.lib.format.write_array(fh, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
        elif how == "string":
            np.save(path, np.array(["a", "bc"]))
        elif how == "structured":
            np.save(path, np.zeros(3, dtype=[("a", "<f4"), ("b", "<i8")]))
        elif how == "fortran":
            np.save(path, np.asfortranarray(rng.standard_normal(shape).astype(np.float32)))
        elif how == "big-endian":
            np.save(path, rng.standard_normal(shape).astype(">f4"))
        elif how == "0-d":
            np.save(path, np.float32(2.5))
        elif how == "huge-header":
            with open(path, "wb") as fh:
                np.lib.format.write_array_header_1_0(
                    fh, {"descr": "<f4", "fortran_order": False, "shape": t.rng.choice([(10**12,), (1 << 31, 4)])}
                )
                fh.write(bytes(16))
        elif how == "truncated":
            np.save(path, rng.standard_normal(shape).astype(np.float32))
            path.write_bytes(path.read_bytes()[: t.rng.randrange(1, 140)])
        elif how == "bad-header":
            path.write_bytes(b"\x93NUMPY\x01\x00\x20\x00{'descr': __import__('os'), }    \n")
        elif how == "v3-header":
            header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }".ljust(63) + b"\n"
            path.write_bytes(b"\x93NUMPY\x03\x00" + struct.pack("<I", len(header)) + header + bytes(8))
        else:
            np.save(
                path,
                rng.standard_normal(shape).astype(
                    {"complex": np.complex64, "bool": np.bool_, "float16": np.float16, "float64": np.float64}[how]
                ),
            )
    finally:
        t.flush_all()
    return f"{name}: {how}"


@mutation(2, variants=TENSOR_DIR_KINDS)
def _tensor_dir(t: Tree) -> str:
    d = t.tensor_dir()
    if not d.is_dir() or d.is_symlink():
        return "no tensor folder"
    how = t.choose(TENSOR_DIR_KINDS)
    if how == "nested":
        shutil.copytree(d, d / "dump_tensor_data")
        return "dump_tensor_data/dump_tensor_data copy"
    shutil.rmtree(d)
    if how == "file":
        d.write_bytes(b"not a folder")
    elif how == "link-canary":
        d.symlink_to(t.canary_tensors(), target_is_directory=True)
    elif how == "link-relative-canary":
        d.symlink_to(os.path.relpath(t.canary_tensors(), d.parent), target_is_directory=True)
    elif how == "empty":
        d.mkdir()
    elif how == "link-self":
        d.symlink_to(".", target_is_directory=True)
    return f"dump_tensor_data is {how}"


# -- phase 3: layout ---------------------------------------------------------------------------------------


@mutation(3, fatal_ok=True)
def _duplicate_step(t: Tree) -> str:
    steps = sorted(p for p in t.root.iterdir() if p.is_dir() and p.name[:4] == "step" and p.name[4:].isdigit())
    if not steps:
        return "no step folder"
    src = t.rng.choice(steps)
    dst = t.root / ("step0" + src.name[4:])
    if dst.exists():
        return "no free name"
    if t.rng.random() < 0.5:
        shutil.copytree(src, dst, symlinks=True)
        return f"{src.name} copied to {dst.name}"
    os.rename(src, dst)
    return f"{src.name} renamed {dst.name}"


@mutation(3, fatal_ok=True)
def _duplicate_rank(t: Tree) -> str:
    units = t.unit_dirs()
    if not units:
        return "no unit"
    src = t.rng.choice(units)
    dst = src.parent / t.rng.choice(["rank00", "rank000", "proc77"])
    if dst.exists():
        return "no free name"
    shutil.copytree(src, dst, symlinks=True)
    return f"{src.relative_to(t.root)} copied to {dst.name}"


@mutation(3, fatal_ok=True, variants=DIR_NAMES)
def _rename_dirs(t: Tree) -> str:
    units = t.unit_dirs()
    if not units:
        return "no unit"
    unit = t.rng.choice(units)
    new = t.choose(DIR_NAMES)
    which = "step" if new.startswith("step") else t.rng.choice(["rank", "step"])
    src = unit if which == "rank" else unit.parent
    dst = src.parent / new
    if dst.exists() or (which == "step" and src == t.root):
        return "no free name"
    os.rename(src, dst)
    return f"{src.relative_to(t.root)} renamed {os.fsencode(new)!r}"


@mutation(3, fatal_ok=True, variants=MOVES)
def _move_tree(t: Tree) -> str:
    how = t.choose(MOVES)
    steps = sorted(p for p in t.root.iterdir() if p.name.startswith("step"))
    if how == "graph-pynative":
        for split in ("graph", "pynative"):
            for s in steps:
                shutil.copytree(s, t.root / split / s.name, symlinks=True)
        for s in steps:
            shutil.rmtree(s)
    elif how == "nested-step" and len(steps) == 2:
        os.rename(steps[1], steps[0] / steps[1].name)
    else:
        sub = {"under-nonutf8": "\udcff\udcfe", "under-newline": "new\nline", "deep": "/".join(["d"] * 60)}.get(how)
        if sub is None:
            return "nothing moved"
        inner = t.root / sub
        inner.mkdir(parents=True)
        for s in steps:
            os.rename(s, inner / s.name)
    return f"tree moved: {how}"


@mutation(3, fatal_ok=True, variants=STRAYS)
def _stray_files(t: Tree) -> str:
    how = t.choose(STRAYS)
    steps = sorted(p for p in t.root.iterdir() if p.name.startswith("step"))
    if how == "pt-in-root":
        write_pt(t.root / "loose.pt", np.arange(4, dtype=np.float32))
    elif how == "pt-in-step" and steps:
        write_pt(steps[-1] / "loose.pt", np.arange(4, dtype=np.float32))
    elif how == "nonutf8-plain-folder":
        folder = t.root / "step7" / "rank0"
        folder.mkdir(parents=True)
        write_pt(folder / "\udcff\udcfe.pt", np.arange(3, dtype=np.float32))
        np.save(folder / "ok.npy", np.arange(3, dtype=np.float32))
        (folder / "bad\udce9.npy").write_bytes(b"junk")
    elif how == "nonutf8-in-tensor-dir" and t.tensor_dir().is_dir():
        (t.tensor_dir() / "\udcff.pt").write_bytes(b"junk")
        (t.tensor_dir().parent / "\udcfe.json").write_bytes(b"{")
    elif how == "link-to-canary-dir":
        (t.root / "step5").symlink_to(t.canary, target_is_directory=True)
    elif how == "link-step-to-canary":
        (t.root / "step6").mkdir()
        (t.root / "step6" / "rank0").symlink_to(t.canary, target_is_directory=True)
    elif how == "empty-step":
        (t.root / "step8").mkdir()
    elif how == "empty-rank":
        (t.root / "step0" / "rank3").mkdir(parents=True, exist_ok=True)
        (t.root / "step0" / "rank3" / "stack.json").write_text("{}")
    elif how == "fifo-in-rank":
        folder = t.root / "step9" / "rank0"
        folder.mkdir(parents=True)
        os.mkfifo(folder / "blocked.npy")
        np.save(folder / "ok.npy", np.arange(3, dtype=np.float32))
    elif how in ("debug-json", "debug-json-bare"):  # debug.json holds {record: ...} without 'data'
        for unit in t.unit_dirs()[:1]:
            doc = t.load(unit / "dump.json")
            if how == "debug-json-bare" and isinstance(doc, dict) and isinstance(doc.get("data"), dict):
                t.docs[unit / "dump.json"] = doc["data"]
            t.flush(unit / "dump.json")
            if (unit / "dump.json").is_file() and not (unit / "dump.json").is_symlink():
                os.rename(unit / "dump.json", unit / "debug.json")
    elif how == "plain-folder-links":
        folder = t.root / "step9" / "rank1"
        folder.mkdir(parents=True)
        (folder / "canary.pt").symlink_to(t.canary / "secret.pt")
        (folder / "canary.npy").symlink_to(t.canary / "secret.npy")
        (folder / "dir.npy").symlink_to(t.canary, target_is_directory=True)
        np.save(folder / "ok.npy", np.arange(3, dtype=np.float32))
    return f"stray: {how}"


@mutation(3, fatal_ok=True)
def _ingest_path(t: Tree) -> str:
    units = t.unit_dirs()
    if not units:
        return "root"
    unit = t.rng.choice(units)
    t.ingest_path = t.rng.choice(
        [unit, unit.parent, unit / "dump.json", unit / "dump_tensor_data", unit / "stack.json"]
    )
    return f"ingest {t.ingest_path.relative_to(t.base)}"


# ------------------------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Built:
    ingest_path: Path
    description: str
    fatal_ok: bool
    canary: Path
    dump: Path


@dataclass(frozen=True)
class Case:
    name: str
    seed: str
    mutations: tuple[str, ...]
    force: Any = None  # the variant a single-mutation case covers

    def build(self, template: Path, dest: Path) -> Built:
        """Copy the template to `dest` and apply this case's mutations (deterministic for a seed)."""
        shutil.copytree(
            template, dest, symlinks=True, ignore=lambda d, _: [CANARY_TENSORS] if d == str(template) else []
        )
        tree = Tree(dest, random.Random(self.seed), self.force, template)
        muts = sorted((MUTATIONS[m] for m in self.mutations), key=lambda m: m.phase)
        done = []
        for m in muts:
            if m.phase >= 1:
                tree.flush_all()
            done.append(f"{m.name}: {m.apply(tree)}")
        tree.flush_all()
        return Built(tree.ingest_path, "; ".join(done), any(m.fatal_ok for m in muts), tree.canary, tree.root)


def single_cases() -> list[tuple[str, Any]]:
    """(mutation, variant) for every mutation, and for every variant of the mutations that have some."""
    return [(m.name, v) for m in sorted(MUTATIONS.values(), key=lambda m: m.name) for v in m.variants or (None,)]


def _label(variant: Any) -> str:
    return "" if variant is None else "-" + (re.sub(r"[^A-Za-z0-9._]+", "_", str(variant))[:20].strip("_") or "x")


def cases(n: int, seed: int = 0) -> list[Case]:
    """`n` cases; with seed 0 each mutation and each variant alone first, then random combinations of one to
    three mutations (the same `n` and `seed` give the same cases and the same trees)."""
    names = sorted(MUTATIONS)
    singles = single_cases() if seed == 0 else []
    rng = random.Random(seed)
    out: list[Case] = []
    for i in range(n):
        if i < len(singles):
            name, variant = singles[i]
            out.append(Case(f"{i:04d}-{name}{_label(variant)}", f"{seed}-{i}", (name,), variant))
            continue
        chosen = tuple(sorted(set(rng.choices(names, k=rng.choice([1, 1, 2, 2, 3])))))
        out.append(Case(f"{i:04d}-{'+'.join(chosen)}", f"{seed}-{i}", chosen))
    return out

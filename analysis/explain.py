"""From a verdict's finding to the fix: where in the model it is, what differs, and what to dump next.

For each finding (first divergence, culprit) the store's partition files of its step and rank are read:
  module      the enclosing module's path and class, from msprobe's module records (`module` column, built from
              construct.json): `Module.layers.0.ln2.LayerNorm.forward.0` -> `layers.0.ln2`, `LayerNorm`;
  parameter   for a `parameter` culprit, the module parameter whose target statistics equal the differing input's
              (`layers.1.fc1.weight`), with both runs' norms;
  argument    for a `scalar` culprit, the argument by name: as msprobe recorded it (a keyword: `approximate`), or
              by its position in the op's signature (torch's, `SIGNATURES`), with the value in each run;
  source      the user's source line from stack.json: the first frame outside the frameworks (torch, torch_npu,
              transformers, msprobe, mindspore, ...) and the Python standard library;
  advice      one line per culprit kind: what to check;
  next_dump   the msprobe config.json that dumps exactly that module (or op) at tensor level, at that step and
              rank, for `--exact` on the next run.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from dumpstore.names import MODULE_RECORD_PREFIXES, module_of, without_direction, without_direction_and_call

from .arguments import SIGNATURES, argument_name

__all__ = [
    "SIGNATURES",
    "Explanation",
    "explain",
    "explain_answer",
    "explain_findings",
    "mode_notes",
    "next_dump_config",
    "run_modes",
    "user_frame",
]


MEMO = "memo/explain"  # where under the store explanations are kept, next to the verdicts (analysis/memo.py)

# Path components of frames that are not the user's code.
FRAMEWORKS = frozenset(
    {
        "torch",
        "torch_npu",
        "transformers",
        "msprobe",
        "mindspore",
        "accelerate",
        "deepspeed",
        "megatron",
        "mindspeed",
        "apex",
        "peft",
        "trl",
    }
)
_STDLIB = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\](?!.*(site|dist)-packages)")
_FRAME = re.compile(
    r"^\s*File\s+(?P<file>.*?),\s+line\s+(?P<line>\d+),\s+in\s+(?P<func>[^,\n]*),?\s*(?P<code>.*)$", re.S
)

ADVICE = {
    "parameter": "Check how each run initialises, loads (checkpoint) or converts {parameter}: the two runs start "
    "from different weights.",
    "parameter_changed": "{parameter} agrees before this step and differs after it by more than its update "
    "explains: check what writes to it between the steps (an in-place edit, a checkpoint reload, a broadcast of "
    "parameters across ranks, a master copy copied back).",
    "input": "The runs are fed different data: check the data pipeline, its seed and the preprocessing of {what}.",
    "scalar": "Make both runs call {op} with the same {argument}: check the model config or the layer's "
    "constructor arguments{where}.",
    "signature": "Make both runs call {op} with the same arguments: {argument} is given in one run only; check "
    "the layer's constructor (bias=...) or the kernel or patch that replaces the call{where}.",
    "optimizer": "The weights agree before this step and move differently: check the learning rate, its schedule, "
    "the optimizer and its hyper-parameters (betas, eps, weight decay) and gradient clipping.",
    "op": "The op itself computes differently: dump it at tensor level (the config below), compare with --exact, "
    "and check its kernel, dtype and compute precision on the target device.",
    "op_unseen_indices": "Its integer inputs may have changed unseen (statistics keep only their max and min): "
    "dump {choice} and this op at tensor level (the config below) and compare with --exact. If the indices "
    "differ, look at what {choice} chose from (the order of its scores: the weights that make them); if they "
    "agree, the op itself computes differently.",
    "op_unseen_data": "Its data input {what} may have changed in a way its statistics keep (a permutation: "
    "channels reordered, samples shuffled): dump this op at tensor level (the config below) and compare with "
    "--exact. If its inputs differ, check the data pipeline of both runs (decoding, channel order, preprocessing, "
    "shuffling); if they agree, the op itself computes differently.",
    "missing_op": "The target never runs {op}; the reference does{where}. Check the code path or flag that "
    "calls it (a mask, a dropout, a fused kernel replacing it).",
    "extra_op": "The target runs {op}; the reference does not{where}. Check the code path or flag that calls "
    "it (a fused kernel, an extra cast, a patch).",
    "nonfinite": "A NaN or Inf appears here in one run only: run `dumpstore overflow` for its first producer.",
}


@dataclass
class Explanation:
    """One finding in the user's terms."""

    op: str
    run: str  # the run whose records name the place (the target; the reference for an op only there)
    module: str | None = None  # layers.0.ln2
    module_class: str | None = None  # LayerNorm
    module_record: str | None = None  # Module.layers.0.ln2.LayerNorm.forward.0
    parameter: dict[str, Any] | None = None  # name, target_norm, ref_norm
    argument: dict[str, Any] | None = None  # name, position, named_by, target, ref
    source: dict[str, Any] | None = None  # file, line, function, code
    advice: str | None = None
    next_dump: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def where(self) -> str | None:
        """'layers.0.ln2 (LayerNorm), called at generate.py:148 in forward: x = self.ln2(x)'."""
        parts = []
        if self.module:
            parts.append(f"{self.module} ({self.module_class})" if self.module_class else self.module)
        elif self.module_class:  # the top-level module: msprobe names it by its class alone
            parts.append(f"the model itself ({self.module_class})")
        if self.source:
            parts.append(f"called at {source_text(self.source)}")
        return ", ".join(parts) or None

    def lines(self) -> list[tuple[str, str]]:
        """(label, text) pairs shown under a verdict line, in the text output, the CSV and the report's card."""
        out = []
        where = self.where()
        if where:
            out.append(("where", where))
        if self.parameter:
            p = self.parameter
            norms = ""
            if p.get("target_norm") is not None and p.get("ref_norm") is not None:
                norms = f" (norm {_short(p['target_norm'])} in the target vs {_short(p['ref_norm'])})"
            out.append(("parameter", f"{p['name']}{norms}"))
        if self.argument:
            a = self.argument
            out.append(
                ("argument", f"{a['name']} = {_val(a.get('target'))} (target) vs {_val(a.get('ref'))} (reference)")
            )
        if self.advice:
            out.append(("fix", self.advice))
        return out


def source_text(src: dict[str, Any]) -> str:
    name = re.split(r"[/\\]", src["file"])[-1]
    code = f": {src['code']}" if src.get("code") else ""
    return f"{name}:{src['line']} in {src['function']}{code}"


def _short(v: float) -> str:
    return f"{v:.6g}"


def _val(v: Any) -> str:
    return "not given (the default)" if v is None else str(v)


def user_frame(frames: list[str] | None) -> dict[str, Any] | None:
    """The innermost frame of a msprobe stack that is the user's code: outside the frameworks and the standard
    library; None when there is none."""
    for fr in frames or []:
        m = _FRAME.match(str(fr))
        if not m:
            continue
        path = m["file"].strip()
        if path.startswith("<") or _STDLIB.search(path):
            continue
        parts = set(re.split(r"[/\\]", path))
        if parts & FRAMEWORKS:
            continue
        return {"file": path, "line": int(m["line"]), "function": m["func"].strip(), "code": m["code"].strip()}
    return None


def next_dump_config(op: str, module_record: str | None, step: int, rank: int) -> dict[str, Any]:
    """The msprobe config.json dumping exactly one module (level mix, its forward and backward) or, without a
    module, one API (level L1), at tensor level, at one step and rank."""
    if module_record:
        base = without_direction_and_call(module_record)
        n = re.search(r"\.(\d+)$", module_record)
        k = n.group(1) if n else "0"
        names, level = [f"{base}.forward.{k}", f"{base}.backward.{k}"], "mix"
    else:
        base = without_direction(op)
        names, level = [f"{base}.forward", f"{base}.backward"], "L1"
    return {
        "task": "tensor",
        "dump_path": "./dump_tensor",
        "rank": [rank],
        "step": [step],
        "level": level,
        "async_dump": False,
        "tensor": {"scope": [], "list": names, "data_mode": ["all"]},
    }


_COLS = (
    "record",
    "module",
    "io",
    "index_path",
    "name",
    "kind",
    "value",
    "op_type",
    "api",
    "stack_id",
    "max",
    "min",
    "mean",
    "norm",
    "seq",
)
_STACK_COLS = ("step", "rank", "stack_id", "frames")


# A partition file of up to this many rows is read whole, once per verdict (its 15 columns: ~20-40 MB of Arrow and
# Python strings); a larger one is read a row group at a time for each question, its memory bounded by a group
# (a step and rank of hundreds of thousands of leaves, where reading it whole for a few records would cost more
# memory than a DuckDB scan did)
_WHOLE_ROWS = 1 << 18


class _Lookup:
    """The store's rows of one (run, step, rank) at a time, read from that partition's files only (a verdict
    over thousands of files asks a handful of them), through pyarrow's Parquet reader, rows picked in Python (a
    DuckDB connection cost a statistics verdict 70-90 ms of import and set-up)."""

    def __init__(self, store: Any, target: str, ref: str) -> None:
        from dumpstore.store import Store, open_store

        self.store = store if isinstance(store, Store) else open_store(store)
        catalog = self.store.runs()
        self.tensors = {r: self.store.tensor_files([r], catalog) for r in (target, ref)}
        live = {row["run"]: row["ingest_id"] for row in catalog.to_pylist()}
        self.stacks = {
            r: [f for f in self.store.stack_files(catalog) if f"part-{live.get(r)}" in f] for r in (target, ref)
        }
        self.target, self.ref = target, ref
        self._whole: dict[tuple[str, tuple[str, ...]], tuple[Any, dict[str, list]]] = {}
        self._readers: dict[str, Any] = {}

    def close(self) -> None:
        self._whole.clear()
        self._readers.clear()

    def _reader(self, path: str) -> Any:
        """The file's open reader (its footer parsed once per verdict: the schema check and the reads share it)."""
        from dumpstore.parquetio import Reader

        reader = self._readers.get(path)
        if reader is None:
            reader = self._readers[path] = Reader(path)
        return reader

    def _groups(
        self, path: str, names: tuple[str, ...], keys: tuple[str, ...]
    ) -> Iterator[tuple[Callable[[], Any], dict[str, list]]]:
        """For the whole file (up to _WHOLE_ROWS rows: read once per verdict) or else each of its row groups: a
        function giving its columns `names` that it has (a table), and its columns `keys` as lists."""
        whole = self._whole.get((path, names))
        if whole is None:
            reader = self._reader(path)
            if reader.num_rows > _WHOLE_ROWS:
                for g in range(reader.num_row_groups):
                    yield partial(reader.read, list(names), g), _lists(reader.read(list(keys), g), keys)
                return
            read = reader.read(list(names))
            whole = self._whole[(path, names)] = read, _lists(read, keys)
        table, lists = whole
        yield (lambda: table), lists

    def rows(self, run: str, step: int, rank: int, records: list[str]) -> list[dict[str, Any]]:
        files = [
            str(Path(g).parent.parent.parent / f"step={int(step)}" / f"rank={int(rank)}" / Path(g).name)
            for g in self.tensors.get(run, [])
        ]
        files = [f for pattern in files for f in sorted(glob.glob(pattern))]
        if not records or not files:
            return []
        try:
            return self._rows(run, files, set(records))
        except Exception:  # a file gone or unreadable: nothing to explain from it
            return []

    def _rows(self, run: str, files: list[str], records: set[str]) -> list[dict[str, Any]]:
        """The rows of `records` in `files` (a column that some files lack is null in their rows; one that all
        lack: none), in record order (seq), each with its run."""
        if not {c for f in files for c in self._reader(f).columns}.issuperset(_COLS):  # a store of an older schema
            return []
        out = []
        for path in files:
            for table, lists in self._groups(path, _COLS, ("record",)):
                hits = _runs(sorted(i for r in records for i in _where(lists["record"], r)))
                if not hits:
                    continue
                rows = table()
                for lo, hi in hits:
                    out += [
                        {"run": run, **{c: row.get(c) for c in _COLS}} for row in rows.slice(lo, hi - lo).to_pylist()
                    ]
        return sorted(out, key=lambda r: (r["seq"] is None, r["seq"] or 0))

    def frames(self, run: str, step: int, rank: int, stack_id: int) -> list[str] | None:
        files = [f for pattern in self.stacks.get(run, []) for f in sorted(glob.glob(pattern))]
        if not files:
            return None
        want = (int(step), int(rank), int(stack_id))
        try:
            for path in files:
                for table, lists in self._groups(path, _STACK_COLS, _STACK_COLS[:3]):
                    if len(lists) < 3:
                        return None  # a store of an older schema
                    hit = next((i for i, k in enumerate(zip(*lists.values())) if k == want), None)
                    if hit is not None:
                        frames = table()
                        if "frames" not in frames.column_names:
                            return None
                        return list(frames.column("frames")[hit].as_py() or [])
        except Exception:  # a file gone or unreadable
            return None
        return None


def _lists(table: Any, keys: tuple[str, ...]) -> dict[str, list]:
    """The columns `keys` of `table` that it has, as lists, in the order of `keys`."""
    return {k: table.column(k).to_pylist() for k in keys if k in table.column_names}


def _where(names: list[str], record: str) -> Iterator[int]:
    """The row numbers of `record` in `names` (each found by list.index: a scan in C, not a loop in Python)."""
    i = -1
    while True:
        try:
            i = names.index(record, i + 1)
        except ValueError:
            return
        yield i


def _runs(index: list[int]) -> list[tuple[int, int]]:
    """Sorted row numbers as [lo, hi) runs of consecutive ones (a record's leaves are consecutive rows)."""
    out: list[tuple[int, int]] = []
    for i in index:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def explain_findings(store: Any, verdict: Any) -> dict[str, Explanation | None]:
    """{'first_divergence': Explanation | None, 'culprit': ...} of a Verdict (or its dict) over `store`."""
    v = verdict if isinstance(verdict, dict) else verdict.to_dict()
    found = {k: v.get(k) for k in ("first_divergence", "culprit")}
    if not any(found.values()):
        return {k: None for k in found}
    look = _Lookup(store, v["target"], v["ref"])
    try:
        return {k: (explain(look, f) if f else None) for k, f in found.items()}
    finally:
        look.close()


def explain_answer(
    store: Any, question: Any, verdict: dict[str, Any], *, use_memo: bool = True
) -> dict[str, dict[str, Any] | None]:
    """`explain_findings` of the verdict of `question` (analysis.verdict.Question) as dicts, kept in the store's
    memo next to the verdict: asking again costs no DuckDB or pyarrow import."""
    from pathlib import Path

    from dumpstore.store import Store, default_store_path

    from . import memo
    from .verdict import _opened, live_ingests

    root = Path(store.root) if isinstance(store, Store) else Path(store) if store is not None else default_store_path()
    key = memo.key({"explain": question.key()})
    if use_memo:
        hit = memo.lookup(root, key, lambda: live_ingests(_opened(store, root), question), folder=MEMO)
        if isinstance(hit, dict):
            return hit
    st = _opened(store, root)
    before = memo.catalog_signature(st.root)
    out: dict[str, Any] = {
        k: (e.to_dict() if e is not None else None) for k, e in explain_findings(st, verdict).items()
    }
    out["modes"] = run_modes(st, question.target, question.ref)
    memo.save(st.root, key, live_ingests(st, question), before, out, folder=MEMO)
    return out


def run_modes(store: Any, target: str, ref: str) -> dict[str, Any]:
    """Each run's dump mode (statistics, tensor, md5, ...) and tensor-file count, from the catalog."""
    from dumpstore.store import Store, open_store

    st = store if isinstance(store, Store) else open_store(store)
    rows = {r["run"]: r for r in st.runs().to_pylist()}
    out: dict[str, Any] = {}
    for side, run in (("target", target), ("ref", ref)):
        r = rows.get(run) or {}
        out[side] = r.get("dump_mode") or r.get("task")
        out[f"{side}_tensor_files"] = int(r.get("n_tensor_files") or 0)
    out["mixed"] = out["target"] != out["ref"]
    return out


def mode_notes(modes: dict[str, Any] | None, target: str, ref: str, exact: bool) -> list[str]:
    """What the user should know about the pair's dump modes: runs dumped in different modes are judged from
    what both have; --exact without both runs' tensor files falls back to the statistics."""
    if not modes:
        return []
    notes = []
    if modes.get("mixed"):
        notes.append(
            f"the runs were dumped in different modes: target {target} in {modes['target']} mode, reference {ref} "
            f"in {modes['ref']} mode; tensors are judged from what both have (the statistics: rel_l2 is a lower bound)"
        )
    if exact:
        lacking = [
            f"{label} {run} has none ({modes[side]} mode)"
            for side, label, run in (("target", "target", target), ("ref", "reference", ref))
            if not modes.get(f"{side}_tensor_files")
        ]
        if lacking:
            notes.append(
                "--exact needs the tensor files of both runs and "
                + " and ".join(lacking)
                + ": judged from the dumped statistics instead (rel_l2 a lower bound), not exactly"
            )
    return notes


def explain(look: _Lookup, f: dict[str, Any]) -> Explanation:
    """One finding (a Finding's dict) in the user's terms."""
    kind, op, step, rank = f["kind"], f["op"], f["step"], f["rank"]
    ev = f.get("evidence") or {}
    only_ref = kind == "missing_op"
    run = look.ref if only_ref else look.target
    rows = look.rows(run, step, rank, [op])
    ex = Explanation(op=op, run=run)
    mod = next((r["module"] for r in rows if r.get("module")), None)
    if op.startswith(MODULE_RECORD_PREFIXES):
        mod = op if re.search(r"\.\d+$", op) else mod
    ex.module_record = mod
    ex.module, ex.module_class = module_of(mod)
    leaf = f.get("name")
    pick = [r for r in rows if r["name"] == leaf] or rows
    sid = next((r["stack_id"] for r in pick if r.get("stack_id") is not None), None)
    if sid is not None:
        ex.source = user_frame(look.frames(run, step, rank, sid))
    if kind == "parameter" and ev.get("differing"):
        ex.parameter = _parameter(look, f, ev["differing"], rows, mod)
    if kind in ("scalar", "signature") and ev.get("scalar"):
        ex.argument = _argument(look, f, ev["scalar"], rows)
    ex.advice = _advice(kind, ex, f)
    ex.next_dump = next_dump_config(op, mod, step, rank)
    choice = ev.get("choice_upstream")
    if kind == "op" and choice:  # integer inputs statistics cannot show (culprit.py `_unseen_integers`)
        at = next((r["module"] for r in look.rows(run, step, rank, [choice]) if r.get("module")), None)
        more = next_dump_config(choice, at, step, rank)
        listed = ex.next_dump["tensor"]["list"]
        listed += [n for n in more["tensor"]["list"] if n not in listed]
        if more["level"] != ex.next_dump["level"]:
            ex.next_dump["level"] = "mix"  # modules and APIs both
    return ex


def _parameter(look: _Lookup, f: dict[str, Any], leaf: str, rows: list[dict], mod: str | None) -> dict | None:
    """The module parameter that the input `leaf` is: equal target statistics among the module's parameters."""
    src = next((r for r in rows if r["name"] == leaf), None)
    if src is None:
        return {"name": leaf, "target_norm": None, "ref_norm": None}
    stats = ("max", "min", "mean", "norm")
    cand = [src] if src["io"] == "parameters" else []
    if not cand and mod and all(src.get(s) is not None for s in stats):
        params = [r for r in look.rows(look.target, f["step"], f["rank"], [mod]) if r["io"] == "parameters"]
        cand = [r for r in params if all(r[s] == src[s] for s in stats)]
    if len(cand) != 1:
        return {"name": leaf, "target_norm": src.get("norm"), "ref_norm": _ref_norm(look, f, src)}
    p = cand[0]
    path, _ = module_of(p["record"])
    name = f"{path}.{p['index_path']}" if path else f"{p['index_path']}"
    return {"name": name, "target_norm": p.get("norm"), "ref_norm": _ref_norm(look, f, p)}


def _ref_norm(look: _Lookup, f: dict[str, Any], row: dict[str, Any]) -> float | None:
    ref = look.rows(look.ref, f["step"], f["rank"], [row["record"]])
    hit = next((r for r in ref if r["name"] == row["name"]), None)
    return hit.get("norm") if hit else None


def _argument(look: _Lookup, f: dict[str, Any], leaf: str, rows: list[dict]) -> dict[str, Any]:
    """The differing argument by name, with its value in each run (None: not given in that run)."""
    t = next((r for r in rows if r["name"] == leaf), None)
    ref_rows = look.rows(look.ref, f["step"], f["rank"], [f["op"]])
    r = next((x for x in ref_rows if x["name"] == leaf), None)
    known = t or r
    if known is None:
        return {"name": leaf, "position": None, "named_by": None, "target": None, "ref": None}
    name, how = argument_name(known)
    return {
        "name": name,
        "position": known.get("index_path"),
        "named_by": how,
        "target": _arg_value(t),
        "ref": _arg_value(r),
    }


def _arg_value(row: dict[str, Any] | None) -> Any:
    """An argument's value as shown: a scalar's value, or `a tensor` (analysis/signature.py's arguments)."""
    if row is None:
        return None
    return "a tensor" if row.get("kind") == "tensor" else row.get("value")


def _advice(kind: str, ex: Explanation, f: dict[str, Any]) -> str | None:
    if kind == "parameter" and "update_units" in (f.get("evidence") or {}):  # changed between steps (steps.py)
        kind = "parameter_changed"
    if kind == "op" and "unseen_integer_inputs" in (f.get("evidence") or {}):  # culprit.py `_unseen_integers`
        kind = "op_unseen_indices"
    if kind == "op" and "unseen_data_inputs" in (f.get("evidence") or {}):  # culprit.py `_unseen_data`
        kind = "op_unseen_data"
    template = ADVICE.get(kind)
    if template is None:
        return None
    where = f" (at {source_text(ex.source)})" if ex.source else ""
    ev = f.get("evidence") or {}
    what = ev.get("differing") or ev.get("differing_unrecorded") or f.get("name") or f["op"]
    if kind == "op_unseen_data":
        what = ", ".join(ev["unseen_data_inputs"])
    return template.format(
        parameter=(ex.parameter or {}).get("name") or "this parameter",
        what=what,
        op=f["op"],
        argument=(ex.argument or {}).get("name") or "arguments",
        where=where,
        choice=ev.get("choice_upstream") or "the op that chose them",
    )

"""Record pairs from an msprobe `-lm` layer mapping: both runs' records placed in a layer tree, target scopes renamed.

msprobe's layer-mapping compare (`core/compare/layer_mapping/`), written anew here.  The YAML maps, per layer
class, a child name of the target to the reference's (`ParallelAttention: {flash_attention_score:
core_attention_flash.npu_fusion_attention}`; a dotted key spans several levels; `Cell` means the top layer).
Each record gets a scope:
  module record  its path without the class (`Cell.a.b.Embedding.forward.0` -> `Cell.a.b`);
  API record     its parent module's path (construct.json), then the framework function that called it (the
                 last framework frame between msprobe's `…Template` frame and the user's code; not for
                 Primitive/Jit), then the API name;
  backward       the scope of its forward record.
Records are filed in a tree by scope (the node takes the record's class or API name as its type) and, per
node, by state (forward, backward, parameters_grad) in dump order.  A target record's scope is rewritten
level by level with the rules of the node it passes through, and it pairs with the reference record at the
same position of the same state of the node reached; no node or no record there: unmatched.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from dumpstore.names import MODULE_PREFIXES

TOP = "TopLayer"
_LAYERS = MODULE_PREFIXES  # Cell (MindSpore), Module (PyTorch)
_NO_STACK = ("Primitive", "Jit")
_FRAMEWORK_FILES = ("site-packages/torch", "package/torch", "site-packages/mindspore", "package/mindspore")
_SKIP_FILES = ("msprobe", "MindSpeed")
_SKIP_FUNCS = ("construct", "__call__")
_STACK_END = {"mindspore": "construct", "pytorch": r"in (for|back)ward,"}
Rules = dict[str, dict[str, list[tuple[str, str, int]]]]


@dataclass
class Item:
    """One record placed in the layer tree."""

    key: str
    state: str
    type_name: str
    scope: str = ""
    layer_scope: str = ""


@dataclass
class _Node:
    type_name: str
    items: dict[str, list[Item]] = field(default_factory=dict)
    children: dict[str, _Node] = field(default_factory=dict)


def is_layer_mapping(doc) -> bool:
    """A YAML document in the `-lm` shape: class -> {child: reference child}, nothing else."""
    return (
        isinstance(doc, dict)
        and bool(doc)
        and not set(doc) <= {"data", "module", "api"}
        and all(isinstance(v, dict) for v in doc.values())
    )


def layer_rules(doc: dict) -> Rules:
    """The rules per class and first child name, longest first (`Cell` stands for the top layer)."""
    rules: Rules = {}
    for cls, table in doc.items():
        per = rules.setdefault(TOP if cls == "Cell" else str(cls), {})
        for key, value in table.items():
            key, value = str(key), str(value).split("(")[0]
            per.setdefault(key.split(".")[0], []).append((key, value, len(key.split("."))))
    for per in rules.values():
        for options in per.values():
            options.sort(key=lambda o: -o[2])
    return rules


def _item(key: str, parent: str | None, frames: list[str] | None, framework: str) -> Item | None:
    parts = key.split(".")
    if len(parts) < 4:
        return None
    if parts[-1] == "parameters_grad" or (parts[-2] == "parameters_grad" and parts[-1].isdigit()):
        k = 0 if parts[-1] == "parameters_grad" else 1
        api, item = parts[-3 - k], Item(key, "parameters_grad", parts[-2 - k])
        item.layer_scope = ".".join(parts[:-3])
    elif parts[0] in _LAYERS:
        api, item = parts[-4], Item(key, parts[-2], parts[-3])
        item.layer_scope = ".".join(parts[:-4])
    else:
        api, item = parts[-3], Item(key, parts[-1], parts[-3])
        item.layer_scope = ".".join(parent.split(".")[:-3]) if parent else TOP
        item.layer_scope = item.layer_scope or TOP
    func = None if parts[0] in _LAYERS or parts[0] in _NO_STACK else _caller(frames, framework)
    item.scope = ".".join(p for p in (item.layer_scope, func, api) if p)
    return item


def _caller(frames: list[str] | None, framework: str) -> str | None:
    """The framework function through which user code reached the API, from its stack (msprobe's rule)."""
    if not frames:
        return None
    start, end = -1, len(frames)
    for i, line in enumerate(frames):
        if "Template" in line:
            start = i
        elif start >= 0 and re.search(_STACK_END.get(framework, _STACK_END["pytorch"]), line):
            end = i
            break
    last = None
    for line in frames[start + 1 : end]:
        if not any(f in line.split(",")[0] for f in _FRAMEWORK_FILES):
            break
        last = line
    if last is None or any(f in last.split(",")[0] for f in _SKIP_FILES):
        return None
    fields = last.split(",")
    func = fields[2] if len(fields) > 2 else ""
    if any(f in func for f in _SKIP_FUNCS) or len(func.split()) < 2:
        return None
    return func.split()[1]


def _backward_scopes(items: list[Item]) -> None:
    by_key = {it.key: it for it in items}
    for it in items:
        parts = it.key.split(".")
        if "backward" in parts[-2:]:
            fwd = by_key.get(".".join(parts[:-2] + [p.replace("backward", "forward") for p in parts[-2:]]))
            if fwd is not None:
                it.scope, it.layer_scope = fwd.scope, fwd.layer_scope


def _renumber(items: list[Item], type_name: str = "ParallelTransformer", child: str = "layers") -> None:
    """Layer indices under `type_name.child` counted from the smallest present (pipeline stages number
    their layers globally in MindSpore, locally in PyTorch)."""
    for prefix in {f"{it.scope}.{child}" for it in items if it.type_name == type_name}:
        pattern = re.compile(rf"^{re.escape(prefix)}\.(\S+?)(?:\.|$)")
        numbers = {id(it): _last_number(pattern, it.scope) for it in items}
        low = min(numbers.values(), default=math.inf)
        for it in items:
            n = numbers[id(it)]
            if n != math.inf and low != math.inf:
                head = pattern.match(it.scope)
                assert head is not None  # the scope was matched by this pattern when collected
                it.scope = f"{prefix}.{n - low}" + it.scope[head.end(1) :]


def _last_number(pattern: re.Pattern, scope: str) -> float:
    m = pattern.match(scope)
    digits = re.findall(r"\d+", m.group(1)) if m else []
    return int(digits[-1]) if digits else math.inf


def _tree(items: list[Item]) -> _Node:
    root = _Node(TOP)
    for it in items:
        node = root
        for name in it.scope.split(".")[1:]:
            node = node.children.setdefault(name, _Node(name))
        node.items.setdefault(it.state, []).append(it)
        node.type_name = it.type_name
    return root


def _renamed(root: _Node, it: Item, rules: Rules) -> tuple[str, int]:
    """The target item's scope in the reference's names, and its position among its node's items."""
    parts, new, node, i = it.scope.split("."), [TOP], root, 0
    while i < len(parts) - 1:
        step = 1
        for origin, target, level in rules.get(node.type_name, {}).get(parts[i + 1], []):
            if ".".join(parts[i + 1 : i + 1 + level]) == origin:
                new.append(target)
                step = level
                break
        else:
            new.append(parts[i + 1])
        for _ in range(step):
            node = node.children[parts[i + 1]]
            i += 1
    peers = node.items.get(it.state, [])
    return ".".join(new), next(n for n, p in enumerate(peers) if p.key == it.key)


def _find(root: _Node, scope: str, state: str, index: int) -> str | None:
    node = root
    for name in scope.split(".")[1:]:
        child = node.children.get(name)
        if child is None:
            return None
        node = child
    peers = node.items.get(state, [])
    return peers[index].key if index < len(peers) else None


def _items(records: list[tuple[str, str | None, list[str] | None]], framework: str) -> list[Item]:
    items = [it for key, parent, frames in records if (it := _item(key, parent, frames, framework))]
    _backward_scopes(items)
    _renumber(items)
    return items


def pair_records(
    target: list[tuple[str, str | None, list[str] | None]],
    t_framework: str,
    ref: list[tuple[str, str | None, list[str] | None]],
    r_framework: str,
    rules: Rules,
) -> dict[str, str | None]:
    """Target record key -> reference record key (None: unmatched), for records given in dump order as
    (key, construct.json parent, stack frames)."""
    t_items = _items(target, t_framework)
    t_root, r_root = _tree(t_items), _tree(_items(ref, r_framework))
    out: dict[str, str | None] = {key: None for key, _, _ in target}
    for it in t_items:
        scope, index = _renamed(t_root, it, rules)
        out[it.key] = _find(r_root, scope, it.state, index)
    return out


def layer_records(store, runs: tuple[str, str], rows: tuple, frameworks: tuple[str, str], rules: Rules):
    """Record pairs (step, rank, source, t_record, r_record, how) of the target and reference rows (Polars,
    as loaded for a comparison) by the layer mapping; unmatched records keep one side null."""
    import polars as pl

    group = ["step", "rank", "source"]
    frames = [_stacks(store, run) for run in runs]
    recs = [
        df.unique(group + ["seq"], keep="first", maintain_order=True)
        .select(group + ["seq", "record", "module", "stack_id"])
        .sort(group + ["seq"])
        for df in rows
    ]
    out: list[tuple] = []
    keys = sorted(set(recs[0].select(group).unique().iter_rows()) | set(recs[1].select(group).unique().iter_rows()))
    for key in keys:
        sides = []
        for df, fr in zip(recs, frames):
            part = df.filter(*[pl.col(c) == v for c, v in zip(group, key)])
            sides.append(
                [
                    (k, m, fr.get((key[0], key[1], s)))
                    for k, m, s in part.select("record", "module", "stack_id").iter_rows()
                ]
            )
        pairs = pair_records(sides[0], frameworks[0], sides[1], frameworks[1], rules)
        out += [(*key, t, r, "layer_mapping" if r else "target_only") for t, r in pairs.items()]
        taken = {r for r in pairs.values() if r}
        out += [(*key, None, k, "ref_only") for k, _, _ in sides[1] if k not in taken]
    schema = {
        "step": pl.Int64,
        "rank": pl.Int64,
        "source": pl.String,
        "t_record": pl.String,
        "r_record": pl.String,
        "how": pl.String,
    }
    return pl.DataFrame(out, schema=schema, orient="row")


def _stacks(store, run: str) -> dict[tuple[int, int, int], list[str]]:
    """(step, rank, stack_id) -> frames of the run's live ingest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    info = store.run_info(run)
    files = sorted((store.root / "stacks" / f"run={run}").glob(f"part-{info['ingest_id']}*.parquet"))
    if not files:
        return {}
    t = pa.concat_tables([pq.read_table(f, columns=["step", "rank", "stack_id", "frames"]) for f in files])
    return {
        (s, k, i): f for s, k, i, f in zip(*(t.column(c).to_pylist() for c in ("step", "rank", "stack_id", "frames")))
    }

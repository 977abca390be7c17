"""A MindSpore graph-mode (kernel-level) run against an msprobe module-level run (L0 or mix, PyTorch or PyNative):
both seen as module outputs, paired by module path and call order.

A graph dump has no module records, but every kernel's full name carries its cell path
(`Default/network-WithLossCell/_backbone-Net/b1-Block/fc1-Dense/BiasAdd-op0`: segments `{attribute}-{Class}`), and
an msprobe module record names the same attribute path (`Module.b1.fc1.Linear.forward.0`).  `module_view` turns
both runs' rows into the module outputs both have:

  * the graph's forward kernels (`Kernel.*`, not `Gradients/`) are walked in execution order; the leading scope
    segments that name wrappers (`Default`, `network-WithLossCell`, `_backbone-Net`) are dropped: the depth that
    makes the most scopes name a module path of the other run;
  * instances of one class that share a compiled body share its scope (the second block's GELU may carry
    `b0-Block/act-GELU`): a kernel whose scope names a module instance already left, while the kernel before it
    is inside a sibling instance of the same class, belongs to that sibling;
  * a module's call `n` is its `n`-th run of consecutive kernels (kernels outside the network's scope do not break
    a run); its output is the output 0 of the run's last kernel, its input the first kernel's input of the shape
    of the msprobe record's input 0 (a non-weight first);
  * the msprobe run keeps its forward module records' `input.0` and `output.0` rows; both runs keep the rows both
    have, named and ordered as the msprobe record (`Module.b1.fc1.Linear.forward.0.output.0`, its `seq`), the
    graph's rows holding its kernel's values (statistics, tensor file).

Modules one framework has and the other lacks (the loss cell, a functional call), parameters, backward and the
optimizer are left out: the comparison is of the module outputs both runs name.
"""

from __future__ import annotations

from collections import defaultdict

import polars as pl

from dumpstore.names import MODULE_FORWARD_SQL, MODULE_KEY_SQL, module_of, without_direction_and_call

_NAMING = ("source", "record", "prefix", "api", "op_type", "direction", "module", "io", "index_path", "name", "seq")
_UNIT = ["step", "rank"]


def is_graph(rows: pl.DataFrame, info: dict) -> bool:
    """A kernel-level run (readers/msgraph.py): level L2 and `Kernel.` records."""
    return info.get("level") == "L2" and rows.height > 0 and bool(rows["record"].str.starts_with("Kernel.").any())


def is_modules(rows: pl.DataFrame, info: dict) -> bool:
    """An msprobe run with module records (level L0 or mix; `Module.` for PyTorch, `Cell.` for MindSpore)."""
    if info.get("level") not in ("L0", "mix") or rows.height == 0:
        return False
    return bool(rows["record"].str.contains(MODULE_KEY_SQL).any())


def applies(t: pl.DataFrame, r: pl.DataFrame, t_info: dict, r_info: dict) -> bool:
    """One run is a graph dump and the other an msprobe dump with module records."""
    return (is_graph(t, t_info) and is_modules(r, r_info)) or (is_graph(r, r_info) and is_modules(t, t_info))


def module_view(t: pl.DataFrame, r: pl.DataFrame, t_info: dict, r_info: dict) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Both runs as the module outputs both have (see the module docstring); the runs unchanged where it does not
    apply."""
    if not applies(t, r, t_info, r_info):
        return t, r
    graph_is_target = is_graph(t, t_info)
    graph, modules = (t, r) if graph_is_target else (r, t)
    mods = _module_outputs(modules)
    kern = _graph_outputs(graph, mods)
    keys = [*_UNIT, "name"]
    both = kern.join(mods.select(keys), on=keys, how="semi")
    mods = mods.join(both.select(keys), on=keys, how="semi")
    return (both, mods) if graph_is_target else (mods, both)


def _module_outputs(rows: pl.DataFrame) -> pl.DataFrame:
    """The msprobe run's forward module records' input 0 and output 0 rows (`Module.` for PyTorch, `Cell.` for
    MindSpore)."""
    rec = pl.col("record")
    return rows.filter(
        rec.str.contains(MODULE_FORWARD_SQL)
        & (
            (pl.col("name") == pl.concat_str([rec, pl.lit(".output.0")]))
            | (pl.col("name") == pl.concat_str([rec, pl.lit(".input.0")]))
        )
    )


def _paths(mods: pl.DataFrame) -> dict[str, str]:
    """{module path: its records' name before `.forward.{n}`} of the msprobe run's module records
    (`Module.b1.fc1.Linear.forward.0` -> b1.fc1: Module.b1.fc1.Linear; MindSpore PyNative's `Cell.` records alike)."""
    out = {}
    for record in mods["record"].unique().to_list():
        path, _cls = module_of(record)
        if path:
            out[path] = without_direction_and_call(record)
    return out


def _segments(scope: str) -> list[tuple[str, str]]:
    """`a-A/b-B/Op-op0` scope -> [(a, A), (b, B)] (a segment without a class keeps '' as its class)."""
    out = []
    for part in scope.split("/"):
        name, _, cls = part.partition("-")
        out.append((name, cls))
    return out


def _strip_depth(scopes: list[list[tuple[str, str]]], paths: dict[str, str]) -> int:
    """The number of leading segments to drop so that the most scopes name (a prefix naming) a module path."""
    best, best_k = -1, 0
    depth = max((len(s) for s in scopes), default=0)
    for k in range(depth):
        hits = sum(any(".".join(n for n, _ in s[k:j]) in paths for j in range(k + 1, len(s) + 1)) for s in scopes)
        if hits > best:
            best, best_k = hits, k
    return best_k


def _graph_outputs(graph: pl.DataFrame, mods: pl.DataFrame) -> pl.DataFrame:
    """The graph run's module inputs and outputs named as the msprobe run's records (see the module docstring)."""
    paths = _paths(mods)
    kernel = pl.col("record").str.starts_with("Kernel.") & (pl.col("direction") == "forward")
    kernels = graph.filter(
        kernel
        & pl.col("module").is_not_null()
        & (pl.col("io") == "output")
        & (pl.col("name") == pl.concat_str([pl.col("record"), pl.lit(".output.0")]))
    ).sort([*_UNIT, "seq"])
    if kernels.height == 0 or not paths:
        return graph.clear()
    scopes = [_segments(m) for m in kernels["module"].to_list()]
    k = _strip_depth(scopes, paths)
    picked: dict[tuple, tuple[int, int]] = {}  # (step, rank, module record) -> rows of its first and last kernel
    units = kernels.select(_UNIT).rows()
    start = 0
    while start < len(units):
        end = start
        while end < len(units) and units[end] == units[start]:
            end += 1
        for record, (first, last) in _unit_modules(scopes[start:end], k, paths).items():
            picked[(*units[start], record)] = (start + first, start + last)
        start = end
    if not picked:
        return graph.clear()
    records = list(picked)
    outs = kernels[[last for _, last in picked.values()]].with_columns(
        pl.Series("name", [f"{key[-1]}.output.0" for key in records])
    )
    # a module's input: the first kernel's input of the shape of the msprobe record's input 0, a non-weight first
    # (a graph's own inputs are parameters to it: the network's data may carry requires_grad)
    firsts = pl.DataFrame(
        {
            "step": [key[0] for key in records],
            "rank": [key[1] for key in records],
            "record": [kernels["record"][first] for first, _ in picked.values()],
            "_name": [f"{key[-1]}.input.0" for key in records],
        },
        schema_overrides={"step": graph.schema["step"], "rank": graph.schema["rank"]},
    )
    shapes = mods.select(*_UNIT, pl.col("name").alias("_name"), pl.col("shape").alias("_shape"))
    ins = (
        graph.filter(kernel & (pl.col("io") == "input") & (pl.col("kind") == "tensor"))
        .join(firsts, on=[*_UNIT, "record"], how="inner")
        .join(shapes, on=[*_UNIT, "_name"], how="inner")
        .filter(pl.col("shape") == pl.col("_shape"))
        .sort([*_UNIT, pl.col("requires_grad").fill_null(False), "leaf"])
        .unique([*_UNIT, "_name"], keep="first", maintain_order=True)
        .with_columns(pl.col("_name").alias("name"))
        .drop("_name", "_shape")
    )
    naming = mods.select([*_UNIT, *_NAMING])
    values = pl.concat([outs, ins.select(outs.columns)]).drop([c for c in _NAMING if c != "name"])
    return values.join(naming, on=[*_UNIT, "name"], how="inner").select(graph.columns).sort([*_UNIT, "seq", "io"])


def _unit_modules(scopes: list[list[tuple[str, str]]], k: int, paths: dict[str, str]) -> dict[str, tuple[int, int]]:
    """{msprobe record name: indexes of the first and last kernel of that call} for one step and rank's forward
    kernels."""
    closed: set[tuple] = set()  # module instances (segment prefixes) entered and left
    prev: list[tuple[str, str]] | None = None
    calls: dict[str, int] = defaultdict(int)  # module path -> calls so far
    current: dict[tuple, str] = {}  # open instance (prefix) -> its record name
    found: dict[str, tuple[int, int]] = {}
    for i, full in enumerate(scopes):
        seg = list(full[k:])
        if not seg or ".".join(n for n, _ in seg[:1]) not in {p.split(".")[0] for p in paths}:
            continue  # outside the network: neither a module of its own nor the end of one
        if prev is not None:
            for d in range(min(len(seg), len(prev))):
                if seg[:d] != prev[:d]:
                    break
                shared = tuple(seg[: d + 1]) in closed and prev[d] != seg[d] and prev[d][1] == seg[d][1]
                if shared:  # a shared compiled body: the kernel runs in the sibling instance open before it
                    seg[d] = prev[d]
            for j in range(1, len(prev) + 1):
                if tuple(prev[:j]) != tuple(seg[:j]):
                    closed.add(tuple(prev[:j]))
                    current.pop(tuple(prev[:j]), None)
        for j in range(1, len(seg) + 1):
            key = tuple(seg[:j])
            path = ".".join(n for n, _ in key)
            if path not in paths:
                continue
            if key not in current:
                current[key] = f"{paths[path]}.forward.{calls[path]}"
                calls[path] += 1
                closed.discard(key)
            record = current[key]
            found[record] = (found[record][0] if record in found else i, i)
        prev = seg
    return found

"""MindSpore graph-mode and kernel-level dumps (MINDSPORE_DUMP_CONFIG, msprobe static-graph L2, CANN adump).

Layout (one tree per run):

    {path}/rank_{r}/{net}/{graph_id}/{iteration}/
        {op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}.{input|output}.{slot}.{format}[.{dtype}].npy
        statistic.csv            statistics instead of (or beside) the .npy files
        mapping.csv              file names shortened by the dumper -> the long name
    {path}/rank_{r}/execution_order/ms_execution_order_graph_{graph_id}.csv   kernels' full names, in order
    {path}/rank_{r}/graphs/ms_output_trace_code_graph_{graph_id}.ir          full names and source lines

`op_name` is the kernel's full name with scope, `/` written as `_` (`Default/network-WithLossCell/_backbone-Net/
b0-Block/act-GELU/Add-op0`); the execution-order CSV gives the full name back.  Each iteration folder is one
ingest unit (step = iteration, rank = r; `source` '' for graph 0, `graph_{id}` for the others); each kernel is
one record:

    record     Kernel.{full name without -opN}.{n}.{forward|backward}   (`Gradients/...` is backward)
    call n     the kernel's ordinal among kernels of the same scope and type, in execution order
    module     the scope (the cell path); op_type the kernel type (Add, MatMul, ...)
    rows       {record}.{input|output}.{slot}, one per tensor

so two runs pair by scope and execution order (the `-opN` numbers of ops outside a network scope shift when one
is removed; the ordinal does too, in the same way as msprobe's call counters).  `Parameter.{name}` files are
records `Parameter.{name}.0.forward` (the weights after the iteration's update); a graph's `constants/` folder is a
unit of its own (step 0, source `constants_{graph}`), its files records `Constant.{name}.0.forward`.  Records follow
the execution order, then the timestamp for kernels it does not list.  `statistic.csv` rows give the dumper's
statistics (Max/Min/Avg/L2Norm Value, NaN and Inf counts where present; both MindSpore's header and CANN adump's
with `Format` and `Input/Output`).  Tensor files are read as the msprobe reader's files are (bf16 is saved as
float32 by MindSpore; the name's dtype is the one recorded).  Source lines come from the traced graph (`.ir`).
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..dtypes import canonical
from ..errors import DumpFormatError
from . import Claim

NAME = "msgraph"
ORDER = 5  # before the plain .npy folders: an iteration folder of kernel files is one of this format's units
ROWS_OPTIONS = True  # rows(unit, res, opts, stacks): tensor files read as the ingest's options ask; source lines
_RANK_DIR = re.compile(r"^rank_(\d+)$")
_FILE = re.compile(
    r"^(?P<type>[^.]+)\.(?P<name>.+)\.(?P<task>\d+)\.(?P<stream>\d+)\.(?P<ts>\d+)\.(?P<io>input|output)\."
    r"(?P<slot>\d+)\.(?P<fmt>[A-Za-z0-9_]+)(?:\.(?P<dtype>[A-Za-z0-9_]+))?\.npy$"
)
_OP_NUMBER = re.compile(r"-op\d+$")
_IR_NAME = re.compile(r"#\s*Fullname with scope:\s*\((?P<name>[^)]*)\)")
_IR_FILE = re.compile(r"#\s*In file (?P<path>.+?):(?P<line>\d+)(?:~\d+)?,\s*[\d~]+/(?P<code>.*)/\s*$")
_STATISTIC = "statistic.csv"
_CONSTANTS = "constants"
_MAPPING = "mapping.csv"
_MAX_CSV_BYTES = 1 << 30


def claim(folder: Path, filenames: list[str]) -> Claim | None:
    """An iteration folder `rank_{r}/{net}/{graph}/{iteration}` holding kernel files or statistic.csv, or a graph's
    `constants` folder beside its iterations."""
    if len(folder.parents) < 3 or not folder.parent.name.isdigit() or not _RANK_DIR.match(folder.parents[2].name):
        return None
    if not folder.name.isdigit() and folder.name != _CONSTANTS:
        return None
    if _STATISTIC in filenames or any(_FILE.match(f) for f in filenames if f.endswith(".npy")):
        return Claim(folder, NAME, whole=True)
    if _MAPPING in filenames and any(f.endswith(".npy") for f in filenames):
        return Claim(folder, NAME, whole=True)
    return None


def place(path: Path) -> tuple[int, int, str, str]:
    """(step, rank, rank folder, source) of an iteration folder: its iteration, rank_{r}, and the graph."""
    rank_dir = path.parents[2]
    graph, rank = int(path.parent.name), int(rank_dir.name.removeprefix("rank_"))
    if path.name == _CONSTANTS:  # the graph's constants: one unit of their own at step 0
        return 0, rank, rank_dir.name, f"{_CONSTANTS}_{graph}"
    return int(path.name), rank, rank_dir.name, "" if graph == 0 else f"graph_{graph}"


# ---------------------------------------------------------------- one unit: the rows


def rows(unit, res, opts, stacks: list[list[str]]) -> Iterator[dict[str, Any]]:
    """The leaf rows of one iteration folder (`unit.path`), its tensor files read as `opts` asks; the source lines
    its rows' stack_id point at are appended to `stacks`; the run's metadata goes into `res.meta`."""
    folder: Path = unit.path
    rank_dir, graph = folder.parents[2], int(folder.parent.name)
    order = {graph: _execution_order(rank_dir, graph)}
    traced = _traced(rank_dir, [graph])
    leaves: list[dict[str, Any]] = []
    mapping = _mapping(folder)
    for entry in sorted(os.listdir(folder)):
        if entry.endswith(".npy"):
            leaf = _file_leaf(folder, entry, mapping.get(entry, entry), graph)
            if leaf is not None and folder.name == _CONSTANTS:
                leaf["op_type"] = "Constant"  # dumped as Parameter.{name}: a constant of the graph, not a weight
            if leaf is not None:
                leaves.append(leaf)
    has_files = bool(leaves)
    stats = folder / _STATISTIC
    if stats.is_file() and not stats.is_symlink():
        leaves += list(_statistic_leaves(stats, graph))
    if has_files and len(leaves) > sum(1 for lf in leaves if lf["path"] is not None):
        leaves = _merge_stats(leaves)  # statistics beside the files: keep the files, add the dumper's numbers
    res.meta = {"task": "tensor" if has_files else "statistics", "level": "L2", "framework": "mindspore"}
    seen: set[int] = set()
    for row in _records(leaves, order, traced, stacks):
        if row["seq"] not in seen:
            seen.add(row["seq"])
            res.records += 1
        path = row.pop("path")
        if path is None:
            row["file_status"] = "none"
            row.setdefault("stats_source", "none")
        else:
            res.files += 1
            if opts.load_tensors:
                _read_file(row, path, opts, res)
            else:
                row.update(file_status="none", stats_source="none")
        yield row


# MindSpore saves bf16 tensors as float32 and int4 as int8: the name's dtype is kept
_SAVED_AS = {"float32": ("bfloat16",), "int8": ("Int4", "int4")}


def _read_file(row: dict[str, Any], path: Path, opts, res) -> None:
    """Load one kernel file into its row (an error row when it cannot be read), as the ingest reads tensor files."""
    from .._ingest.tensors import load_file_into
    from .npy import load

    load_file_into(row, path, load, opts, res, _SAVED_AS)


def _file_leaf(folder: Path, entry: str, long_name: str, graph: int) -> dict[str, Any] | None:
    m = _FILE.match(long_name)
    if m is None:
        return None
    return {
        "graph": graph,
        "op_type": m["type"],
        "op_name": m["name"],
        "ts": int(m["ts"]),
        "io": m["io"],
        "slot": int(m["slot"]),
        "dtype_raw": m["dtype"],
        "path": folder / entry,
        "data_name": entry,  # in the unit's folder
    }


def _mapping(folder: Path) -> dict[str, str]:
    """mapping.csv: the shortened file name -> the long one."""
    path = folder / _MAPPING
    if not path.is_file() or path.is_symlink():
        return {}
    out = {}
    for row in _csv_rows(path)[1:]:
        if len(row) >= 2:
            out[row[0].strip()] = row[1].strip()
    return out


def _csv_rows(path: Path) -> list[list[str]]:
    if path.stat().st_size > _MAX_CSV_BYTES:
        raise DumpFormatError(f"{path}: larger than 1 GiB; not a dump's CSV")
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            return list(csv.reader(fh))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DumpFormatError(f"{path}: not a CSV file ({exc}); expected the dumper's {path.name}") from None


_STAT_COLUMNS = {
    "Max Value": "dump_max",
    "Min Value": "dump_min",
    "Avg Value": "dump_mean",
    "L2Norm Value": "dump_norm",
    "NaN Count": "nan_count",
    "Positive Inf Count": "posinf_count",
    "Negative Inf Count": "neginf_count",
    "Zero Count": "zero_count",
}


def _statistic_leaves(path: Path, graph: int) -> Iterator[dict[str, Any]]:
    """The rows of a statistic.csv (MindSpore's header, or CANN adump's with Format and Input/Output)."""
    table = _csv_rows(path)
    if not table:
        return
    header = [h.strip() for h in table[0]]
    col = {h: i for i, h in enumerate(header)}
    io_col = col["IO"] if "IO" in col else col.get("Input/Output", -1)
    need = ("Op Type", "Op Name", "Timestamp", "Slot", "Data Type", "Shape")
    missing = [h for h in need if h not in col] + ([] if io_col >= 0 else ["IO"])
    if missing:
        raise DumpFormatError(
            f"{path}: header lacks {', '.join(missing)}; expected MindSpore's or CANN adump's statistic.csv header"
        )
    for n, row in enumerate(table[1:], start=2):
        if not row:
            continue
        if len(row) < len(header):
            raise DumpFormatError(f"{path}: line {n} has {len(row)} fields, the header {len(header)}")
        io = row[io_col].strip().lower()
        io = "input" if io.startswith("in") else "output"
        leaf: dict[str, Any] = {
            "graph": graph,
            "op_type": row[col["Op Type"]].strip(),
            "op_name": row[col["Op Name"]].strip(),
            "ts": _int(row[col["Timestamp"]]),
            "io": io,
            "slot": _int(row[col["Slot"]]),
            "dtype_raw": _stat_dtype(row[col["Data Type"]]),
            "shape": _shape(row[col["Shape"]]),
            "path": None,
            "data_name": None,
        }
        for name, key in _STAT_COLUMNS.items():
            if name in col:
                leaf[key] = _float(row[col[name]])
        yield leaf


_CANN_DTYPES = {"DT_FLOAT": "float32", "DT_FLOAT16": "float16", "DT_BF16": "bfloat16", "DT_DOUBLE": "float64"}


def _stat_dtype(text: str) -> str:
    """A statistic.csv Data Type as the name the files use: MindSpore's (float32, Float32) or CANN's (DT_FLOAT)."""
    t = text.strip()
    if t.upper().startswith("DT_"):
        return _CANN_DTYPES.get(t.upper(), t[3:].lower())
    return t


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        return 0


def _float(text: str) -> float | None:
    t = text.strip()
    if not t or t.lower() == "null":
        return None
    try:
        return float(t)
    except ValueError:
        return None


def _shape(text: str) -> list[int] | None:
    digits = re.findall(r"\d+", text)
    return [int(d) for d in digits] if text.strip() else None


def _merge_stats(leaves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stats = {(lf["graph"], lf["op_name"], lf["io"], lf["slot"]): lf for lf in leaves if lf["path"] is None}
    out = []
    for lf in leaves:
        if lf["path"] is None:
            continue
        s = stats.pop((lf["graph"], lf["op_name"].replace("/", "_"), lf["io"], lf["slot"]), None)
        if s is not None:
            lf.update({k: s[k] for k in _STAT_COLUMNS.values() if k in s})
        out.append(lf)
    return out + list(stats.values())


def _execution_order(rank_dir: Path, graph: int) -> list[str]:
    path = rank_dir / "execution_order" / f"ms_execution_order_graph_{graph}.csv"
    if not path.is_file() or path.is_symlink():
        return []
    table = _csv_rows(path)
    return [r[0].strip() for r in table[1:] if r and r[0].strip()]


_IR_NODE = re.compile(r"^\s*%(?P<id>[\w.]+)(?:\([^)]*\))?\s*=\s*(?P<prim>[\w.]+)\((?P<args>.*)$")
_IR_PARAM = re.compile(r"^%para\d+_(?P<name>.+)$")


class _Traced:
    """What the traced graph (.ir) says of each kernel, by full name: its source lines and which input slots are
    parameters (an input `%paraN_name`, or a `Load` of one)."""

    def __init__(self) -> None:
        self.frames: dict[str, list[str]] = {}
        self.params: dict[str, dict[int, str]] = {}


def _traced(rank_dir: Path, graphs: list[int]) -> _Traced:
    out = _Traced()
    for g in graphs:
        path = rank_dir / "graphs" / f"ms_output_trace_code_graph_{g}.ir"
        if not path.is_file() or path.is_symlink() or path.stat().st_size > _MAX_CSV_BYTES:
            continue
        loads: dict[str, str] = {}  # node id -> the parameter it loads
        args: list[str] = []
        current: list[str] | None = None
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if m := _IR_NODE.match(line):
                    args = _ir_args(m["args"])
                    if m["prim"] == "Load" and args and (p := _IR_PARAM.match(args[0])):
                        loads[m["id"]] = p["name"]
                    current = None
                elif m := _IR_NAME.search(line):
                    current = out.frames.setdefault(m["name"], [])
                    current.clear()
                    params = {}
                    for slot, arg in enumerate(args):
                        p = _IR_PARAM.match(arg)
                        name = p["name"] if p else loads.get(arg[1:]) if arg.startswith("%") else None
                        if name:
                            params[slot] = name
                    out.params[m["name"]] = params
                    args = []
                elif current is not None and (m := _IR_FILE.search(line)):
                    current.append(f"File {m['path']}, line {m['line']}, in graph, \n {m['code'].strip()}")
                elif current is not None and not line.lstrip().startswith("#"):
                    current = None
    return out


def _ir_args(text: str) -> list[str]:
    """The top-level arguments of a node's call (`%17, %18, Bool(0), Bool(1)) {...`), stripped."""
    out: list[str] = []
    depth, cur = 0, list[str]()
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    last = "".join(cur).strip()
    return out + ([last] if last else [])


def _records(
    leaves: list[dict[str, Any]], order: dict[int, list[str]], traced: _Traced, stacks: list[list[str]]
) -> Iterator[dict[str, Any]]:
    """The leaves as store rows, records in execution order."""
    full: dict[tuple[int, str], tuple[int, str]] = {}  # (graph, file op name) -> (position, full name)
    for g, names in order.items():
        for i, name in enumerate(names):
            full[(g, name.replace("/", "_"))] = (i, name)
            full.setdefault((g, name), (i, name))
    by_op: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for lf in leaves:
        by_op.setdefault((lf["graph"], lf["op_type"], lf["op_name"]), []).append(lf)

    def position(key: tuple[int, str, str]) -> tuple:
        g, op_type, op_name = key
        first_ts = min(lf["ts"] for lf in by_op[key])
        if op_type == "Parameter":
            return (1, g, 0, first_ts, op_name)
        at = full.get((g, op_name))
        return (0, g, at[0] if at else len(order.get(g, [])), first_ts, op_name)

    ordinal: dict[tuple[str, str], int] = {}
    stack_ids: dict[str, int] = {}
    leaf_no = 0
    for seq, key in enumerate(sorted(by_op, key=position)):
        g, op_type, op_name = key
        if op_type in ("Parameter", "Constant"):
            record, api, module, direction, call = f"{op_type}.{op_name}.0.forward", op_name, None, "forward", 0
            name = op_name
        else:
            name = full.get((g, op_name), (0, op_name))[1]
            api = _OP_NUMBER.sub("", name)
            direction = "backward" if name.startswith("Gradients") else "forward"
            call = ordinal.get((api, direction), 0)
            ordinal[(api, direction)] = call + 1
            record = f"Kernel.{api}.{call}.{direction}"
            module = api.rsplit("/", 1)[0] if "/" in api else None
        sid = None
        if traced.frames.get(name):
            sid = stack_ids.get(name)
            if sid is None:
                sid = stack_ids[name] = len(stacks)
                stacks.append(traced.frames[name])
        for lf in sorted(by_op[key], key=lambda x: (x["io"] != "input", x["slot"])):
            row = _row(lf)
            if op_type == "Parameter" or (lf["io"] == "input" and lf["slot"] in traced.params.get(name, {})):
                row["requires_grad"] = True  # a weight (the traced graph's parameter input): not data
            row.update(
                seq=seq,
                leaf=leaf_no,
                record=record,
                prefix=op_type if op_type in ("Parameter", "Constant") else "Kernel",
                api=api,
                op_type=op_type,
                call=call,
                direction=direction,
                module=module,
                stack_id=sid,
                io=lf["io"],
                index_path=str(lf["slot"]),
                name=f"{record}.{lf['io']}.{lf['slot']}",
            )
            leaf_no += 1
            yield row


def _row(lf: dict[str, Any]) -> dict[str, Any]:
    raw = lf.get("dtype_raw")
    row: dict[str, Any] = {
        "kind": "tensor",
        "value_type": "mindspore.Tensor",
        "dtype": canonical(raw) if raw else None,
        "dtype_raw": raw,
        "shape": lf.get("shape"),
        "data_name": lf["data_name"],
        "path": lf["path"],
    }
    stats = {k: lf[k] for k in _STAT_COLUMNS.values() if lf.get(k) is not None}
    if stats:
        row.update(stats)
        for k in ("max", "min", "mean", "norm"):
            row[k] = lf.get(f"dump_{k}")
        row["stats_source"] = "dump"
        mx, mn = lf.get("dump_max"), lf.get("dump_min")
        if "nan_count" in stats or mx is not None:
            row["has_nan"] = bool(stats.get("nan_count")) or (mx is not None and mx != mx)
            row["has_posinf"] = bool(stats.get("posinf_count")) or mx == float("inf")
            row["has_neginf"] = bool(stats.get("neginf_count")) or mn == float("-inf")
    if row["shape"] is not None:
        n = 1
        for d in row["shape"]:
            n *= d
        row["numel"] = n
    return row

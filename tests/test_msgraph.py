"""MindSpore graph-mode / kernel-level dumps (dumpstore.readers.msgraph): real dumps made with MindSpore 2.10 on CPU in
graph mode (tests/msgraph/generate.py, made once per session; skipped without mindspore), and hand-written
statistic.csv dumps in MindSpore's header and CANN adump's (with Format and Input/Output).

- ingest: one unit per rank and iteration, records in execution order, source lines from the traced graph;
- a clean pair is quiet; a fault pair (the second block's GELU made exact) names a GELU kernel of the second
  instance first; a 1 % weight change names the second block's fc1 MatMul;
- parity with msprobe's `ms_graph_compare` (`msprobe compare --rank 0`) on the kernels both pair alike: the six
  tensor metrics agree (one-element tensors aside: ms_graph_compare does not squeeze them, msprobe compare does);
- mapping.csv long names; overflow and report run on such runs;
- a graph-mode run against a PyTorch msprobe dump of the same network (tests/msgraph/generate_torch.py: the same
  weights, L0 statistics and mix tensor) at module granularity (analysis/graph_modules.py): the clean pair is
  quiet both ways, the GELU fault names `Module.b1.act.GELU.forward.0`, the weight fault
  `Module.b1.fc1.Linear.forward.0`.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis import overflow
from dumpstore.analysis._divergence import divergence
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.report import write_csv
from dumpstore.layout import find_units
from dumpstore.query import run_query
from dumpstore.store import open_store
from helpers import msprobe_command

GENERATE = Path(__file__).resolve().parent / "msgraph" / "generate.py"
RUNS = {"ref": None, "clean": None, "gelu": "gelu", "weight": "weight"}


@pytest.fixture(scope="session")
def graph_dumps(tmp_path_factory):
    """The four real dumps (made in parallel, one MindSpore process each) ingested into one store."""
    if importlib.util.find_spec("mindspore") is None:
        pytest.skip("mindspore is not installed (pip install mindspore==2.10.0)")
    base = tmp_path_factory.mktemp("msgraph")
    procs = []
    for run, fault in RUNS.items():
        cmd = [sys.executable, str(GENERATE), str(base / run)] + (["--fault", fault] if fault else [])
        procs.append((run, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    for _run, p in procs:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, out.decode(errors="replace")[-2000:]
    for run in RUNS:
        ingest(base / run, run, store=base / "store", jobs=1)
    return base


GENERATE_TORCH = Path(__file__).resolve().parent / "msgraph" / "generate_torch.py"
TORCH_RUNS = {"pt_L0": ("L0", "statistics"), "pt_mix": ("mix", "tensor")}


@pytest.fixture(scope="session")
def torch_dumps(graph_dumps):
    """The PyTorch side: the same network dumped by msprobe (L0 statistics, mix tensor), in graph_dumps' store."""
    if importlib.util.find_spec("torch") is None or msprobe_command() is None:
        pytest.skip("torch and mindstudio-probe are needed for the PyTorch side")
    procs = []
    for run, (level, task) in TORCH_RUNS.items():
        cmd = [sys.executable, str(GENERATE_TORCH), str(graph_dumps / run), "--level", level, "--task", task]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, out.decode(errors="replace")[-2000:]
    for run in TORCH_RUNS:
        ingest(graph_dumps / run, run, store=graph_dumps / "store", jobs=1)
    return graph_dumps


def _verdict(st, target: str, ref: str, exact: bool = False) -> dict:
    return divergence(compare_runs(st, target, ref, exact=exact)).to_dict()


def _store(base: Path):
    return open_store(base / "store")


@pytest.mark.msgraph
def test_ingest_units_records_and_source_lines(graph_dumps):
    units = find_units(graph_dumps / "ref")
    assert [(u.kind, u.step, u.rank, u.rank_dir) for u in units] == [
        ("msgraph", 0, 0, "rank_0"),
        ("msgraph", 1, 0, "rank_0"),
    ]
    st = _store(graph_dumps)
    info = st.run_info("ref")
    assert (info["framework"], info["task"], info["level"], info["dump_mode"]) == (
        "mindspore",
        "tensor",
        "L2",
        "tensor",
    )
    assert info["n_errors"] == 0 and info["n_tensor_files"] == info["n_tensors"] > 500
    rows = compare_runs(st, "clean", "ref").rows
    first = rows.sort("seq").row(0, named=True)
    assert (
        first["record"] == "Kernel.Default/network-WithLossCell/_backbone-Net/b0-Block/ln-LayerNorm/LayerNorm.0.forward"
    )
    assert first["name"].endswith(".input.0") and first["op_type"] == "LayerNorm"
    grads = rows.filter(rows["record"].str.starts_with("Kernel.Gradients/"))
    assert grads.height and set(grads["direction"]) == {"backward"}
    assert rows.filter(rows["record"].str.starts_with("Parameter.b1_fc1_weight.")).height == 2  # one per step
    frames = run_query(st, "SELECT frames FROM stacks WHERE run = 'ref' LIMIT 1").to_pylist()[0]["frames"]
    assert any("line" in f and "construct" in f for f in frames), frames


@pytest.mark.msgraph
def test_clean_pair_is_quiet(graph_dumps):
    v = _verdict(_store(graph_dumps), "clean", "ref")
    assert v["first_divergence"] is None and v["culprit"] is None


@pytest.mark.msgraph
def test_gelu_fault_names_the_second_gelu(graph_dumps):
    st = _store(graph_dumps)
    first = _verdict(st, "gelu", "ref")["first_divergence"]
    assert first["step"] == 0 and "/act-GELU/" in first["op"], first
    # MindSpore may give the second block's GELU kernels the first block's scope: the kernel runs after b1's fc1
    rows = compare_runs(st, "gelu", "ref").rows.filter(pl.col("step") == 0)
    seq = dict(zip(rows["record"], rows["seq"]))
    assert (
        seq[first["op"]] > seq["Kernel.Default/network-WithLossCell/_backbone-Net/b1-Block/fc1-Dense/MatMul.0.forward"]
    )


@pytest.mark.msgraph
def test_weight_fault_names_the_second_fc1(graph_dumps):
    v = _verdict(_store(graph_dumps), "weight", "ref")
    assert v["first_divergence"]["step"] == 0
    assert "b1-Block/fc1-Dense/MatMul" in v["first_divergence"]["op"], v["first_divergence"]
    # the traced graph says the MatMul's input 1 is the parameter b1.fc1.weight: a weight, not data
    assert v["culprit"]["kind"] == "parameter" and v["culprit"]["op"] == v["first_divergence"]["op"], v["culprit"]


@pytest.mark.msgraph
def test_overflow_and_report(graph_dumps, tmp_path):
    st = _store(graph_dumps)
    assert overflow(st, "gelu", ref="ref").first_overflow is None
    n = write_csv(compare_runs(st, "weight", "ref", exact=True), tmp_path / "r.csv", store=st)
    with open(tmp_path / "r.csv", newline="") as fh:
        got = list(csv.DictReader(fh))
    assert n == len(got) > 500 and {r["Result"] for r in got} <= {"pass", "warning", "error"}


@pytest.mark.msgraph
def test_mapping_csv_long_names(graph_dumps, tmp_path):
    """A dumper that shortens a long file name writes mapping.csv (short -> long): the record keeps the long name."""
    dump = tmp_path / "mapped"
    shutil.copytree(graph_dumps / "ref", dump)
    folder = dump / "rank_0" / "Net" / "0" / "0"
    long_names = sorted(n for n in os.listdir(folder) if n.startswith("MatMul."))[:2]
    with open(folder / "mapping.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["File Name", "Original Name"])
        for i, name in enumerate(long_names):
            (folder / name).rename(folder / f"{i}.npy")
            w.writerow([f"{i}.npy", name])
    ingest(dump, "mapped", store=tmp_path / "store", jobs=1)
    ingest(graph_dumps / "ref", "ref", store=tmp_path / "store", jobs=1)
    st = open_store(tmp_path / "store")
    rows = compare_runs(st, "mapped", "ref").rows
    assert rows.filter(rows["status"] != "pass").height == 0
    assert set(rows.filter(rows["data_name"] == "0.npy")["op_type"]) == {"MatMul"}


@pytest.mark.msgraph
@pytest.mark.msprobe
@pytest.mark.parametrize("target", ["clean", "weight"])
def test_ms_graph_compare_parity(graph_dumps, target, tmp_path):
    cmd = msprobe_command()
    if cmd is None:
        pytest.skip("mindstudio-probe (msprobe) is not installed")
    args = ["compare", "-tp", str(graph_dumps / target), "-gp", str(graph_dumps / "ref"), "--rank", "0"]
    done = subprocess.run([*cmd, *args, "-o", str(tmp_path)], capture_output=True, timeout=600)
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-2000:]
    rows = compare_runs(_store(graph_dumps), target, "ref", exact=True).rows
    ours = {
        (r["step"], os.path.basename(r["data_name"]), os.path.basename(r["ref_data_name"])): r
        for r in rows.iter_rows(named=True)
        if r["data_name"] and r["ref_data_name"]
    }
    cells = {
        "Cosine": "msprobe_cosine",
        "EucDist": "msprobe_euc_dist",
        "MaxAbsErr": "msprobe_max_abs_err",
        "MaxRelativeErr": "msprobe_max_rel_err",
        "One Thousandth Err Ratio": "msprobe_one_thousandth",
        "Five Thousandths Err Ratio": "msprobe_five_thousandth",
    }
    compared, bad = 0, []
    for path in sorted(tmp_path.glob("compare_result_0_*.csv")):
        step = int(path.stem.split("_")[3])
        with open(path, newline="") as fh:
            for m in csv.DictReader(fh):
                o = ours.get((step, os.path.basename(m["NPU Name"]), os.path.basename(m["Bench Name"])))
                if o is None or math.prod(o["shape"] or [1]) == 1:
                    continue
                compared += 1
                bad += [(m["NPU Name"], c, m[c], o[oc]) for c, oc in cells.items() if not _same(m[c], o[oc])]
    assert compared > 400
    assert not bad, bad[:5]


def _same(theirs: str, ours: str | None) -> bool:
    if theirs == "":
        return True  # ms_graph_compare leaves the metrics of scalars empty
    try:
        a, b = float(theirs), float(ours or "nan")
    except ValueError:
        return theirs == ours
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# ---------------------------------------------------------------- statistic.csv, both header variants

_MS_HEADER = (
    "Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,"
    "Max Value,Min Value,Avg Value,L2Norm Value,Count"
)
_ADUMP_HEADER = (
    "Op Type,Op Name,Task ID,Stream ID,Timestamp,Input/Output,Slot,Data Size,Data Type,Format,Shape,"
    "Max Value,Min Value,Avg Value,L2Norm Value"
)
_OPS = [  # full name, type, inputs' and outputs' (max, min, mean, norm)
    (
        "Default/net-Net/fc1-Dense/MatMul-op0",
        "MatMul",
        [(1.0, -1.0, 0.1, 3.0), (0.5, -0.5, 0.0, 2.0)],
        [(2.0, -2.0, 0.2, 5.0)],
    ),
    ("Default/net-Net/act-GELU/GeLU-op0", "GeLU", [(2.0, -2.0, 0.2, 5.0)], [(1.9, -0.1, 0.4, 4.0)]),
    (
        "Default/net-Net/fc2-Dense/MatMul-op1",
        "MatMul",
        [(1.9, -0.1, 0.4, 4.0), (0.5, -0.5, 0.0, 2.0)],
        [(3.0, -1.0, 0.5, 6.0)],
    ),
]


def _write_stats(root: Path, adump: bool, fault: bool) -> Path:
    folder = root / "rank_0" / "Net" / "0" / "0"
    folder.mkdir(parents=True)
    (root / "rank_0" / "execution_order").mkdir()
    with open(root / "rank_0" / "execution_order" / "ms_execution_order_graph_0.csv", "w") as fh:
        fh.write("NodeExecutionOrder-FullNameWithScope\n" + "".join(f"{n}\n" for n, *_ in _OPS))
    lines, ts = [_ADUMP_HEADER if adump else _MS_HEADER], 1000
    for i, (name, op_type, ins, outs) in enumerate(_OPS):
        for io, stats in (("input", ins), ("output", outs)):
            for slot, (mx, mn, mean, norm) in enumerate(stats):
                if fault and i >= 1 and io == "output":
                    mx, norm = mx * 1.5, norm * 1.5  # the GELU's output and what follows from it
                if fault and i == 2 and slot == 0:
                    mx, norm = mx * 1.5, norm * 1.5
                ts += 1
                dtype, shape = ("DT_FLOAT", '"[2,16]"') if adump else ("float32", '"(2,16)"')
                fmt = ",ND" if adump else ""
                op = name.replace("/", "_")
                lines.append(
                    f"{op_type},{op},0,0,{ts},{io},{slot},128,{dtype}{fmt},{shape},{mx},{mn},{mean},{norm}"
                    + ("" if adump else ",32")
                )
    (folder / "statistic.csv").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("adump", [False, True], ids=["mindspore_header", "adump_header"])
def test_statistic_csv_pair(tmp_path, adump):
    for run, fault in (("ref", False), ("tgt", True), ("clean", False)):
        ingest(_write_stats(tmp_path / run, adump, fault), run, store=tmp_path / "store", jobs=1)
    st = open_store(tmp_path / "store")
    info = st.run_info("tgt")
    assert (info["task"], info["dump_mode"], info["n_rows"], info["n_errors"]) == ("statistics", "statistics", 8, 0)
    rows = compare_runs(st, "tgt", "ref").rows.sort("seq")
    assert rows["record"].to_list()[:3] == ["Kernel.Default/net-Net/fc1-Dense/MatMul.0.forward"] * 3
    assert rows.row(0, named=True)["dtype"] == "float32" and rows.row(0, named=True)["shape"] == [2, 16]
    v = _verdict(st, "tgt", "ref")
    assert v["first_divergence"]["op"] == "Kernel.Default/net-Net/act-GELU/GeLU.0.forward"
    assert _verdict(st, "clean", "ref")["first_divergence"] is None


def test_statistic_csv_bad_header(tmp_path):
    root = _write_stats(tmp_path / "bad", False, False)
    path = root / "rank_0" / "Net" / "0" / "0" / "statistic.csv"
    path.write_text("Op Type,Op Name\nAdd,x\n")
    from dumpstore.errors import DumpstoreError

    with pytest.raises(DumpstoreError, match="statistic.csv: header lacks"):
        ingest(root, "bad", store=tmp_path / "store", jobs=1)


def test_kernel_files_dtypes_ranks_and_graphs(tmp_path):
    """Files written the way MindSpore writes them, without MindSpore: bf16 saved as float32 and int4 as int8 keep
    the name's dtype; rank_1 is rank 1; graph 1's iteration folder is its own unit (source graph_1); a file whose
    name is not a kernel file's is left out; a graph's constants/ folder is a unit of its own; a .npy that is not
    numeric is an error row naming the file; without the execution-order CSV a kernel keeps the file's form of its
    name."""
    import numpy as np

    def put(rank: int, graph: int, it: int, name: str, arr) -> None:
        folder = tmp_path / "d" / f"rank_{rank}" / "Net" / str(graph) / str(it)
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / name, arr)

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for rank in (0, 1):
        put(rank, 0, 0, "Cast.Default_Cast-op0.0.0.10.output.0.DefaultFormat.BFloat16.npy", x)
        put(rank, 0, 0, "Quant.Default_Quant-op0.0.0.11.output.0.DefaultFormat.Int4.npy", x.astype(np.int8))
        put(rank, 1, 0, "Add.Default_Add-op0.0.0.12.input.0.DefaultFormat.Float32.npy", x)
    put(0, 0, 0, "notes.npy", x)
    const = tmp_path / "d" / "rank_0" / "Net" / "0" / "constants"
    const.mkdir()
    np.save(const / "Parameter.data-1.0.0.5.output.0.DefaultFormat.Float32.npy", np.float32(1e-5))
    bad = (
        tmp_path / "d" / "rank_0" / "Net" / "0" / "0" / "Mul.Default_Mul-op0.0.0.13.output.0.DefaultFormat.Float32.npy"
    )
    np.save(bad, np.array(["a", "b"]))
    units = find_units(tmp_path / "d")
    assert [(u.kind, u.step, u.rank, u.source) for u in units] == [
        ("msgraph", 0, 0, ""),
        ("msgraph", 0, 1, ""),
        ("msgraph", 0, 0, "constants_0"),
        ("msgraph", 0, 0, "graph_1"),
        ("msgraph", 0, 1, "graph_1"),
    ]
    ingest(tmp_path / "d", "k", store=tmp_path / "store", jobs=1)
    got = run_query(
        open_store(tmp_path / "store"),
        "SELECT rank, source, record, dtype, dtype_raw, max, file_status, error FROM tensors WHERE run = 'k' "
        "ORDER BY source, rank, seq",
    ).to_pylist()
    by = {(r["rank"], r["source"], r["record"]): r for r in got}
    cast = by[(1, "", "Kernel.Default_Cast.0.forward")]
    assert (cast["dtype"], cast["dtype_raw"], cast["max"]) == ("bfloat16", "BFloat16", 5.0)
    assert by[(0, "", "Kernel.Default_Quant.0.forward")]["dtype_raw"] == "Int4"
    assert by[(0, "graph_1", "Kernel.Default_Add.0.forward")]["file_status"] == "loaded"
    mul = by[(0, "", "Kernel.Default_Mul.0.forward")]
    assert (
        mul["file_status"] == "error"
        and "Mul.Default_Mul-op0" in mul["error"]
        and "not a numeric array" in mul["error"]
    )
    assert not any("notes" in r["record"] for r in got)
    assert by[(0, "constants_0", "Constant.data-1.0.forward")]["max"] == pytest.approx(1e-5)


MODULES = [
    f"Module.{path}.forward.0"
    for block in ("b0", "b1")
    for path in (
        f"{block}.ln.LayerNorm",
        f"{block}.fc1.Linear",
        f"{block}.act.GELU",
        f"{block}.fc2.Linear",
        f"{block}.Block",
    )
] + ["Module.head.Linear.forward.0"]


@pytest.mark.msgraph
@pytest.mark.parametrize("torch_run", sorted(TORCH_RUNS))
def test_graph_against_pytorch_modules(torch_dumps, torch_run):
    """Module outputs pair by path and call: b1's GELU and residual Add run under b0's scope (a shared compiled body)
    and still pair with b1's modules; a clean pair is quiet within fp32 noise, either way round."""
    st, exact = _store(torch_dumps), TORCH_RUNS[torch_run][1] == "tensor"
    rows = compare_runs(st, "ref", torch_run, exact=exact).rows
    assert rows.filter(pl.col("step") == 0)["record"].unique(maintain_order=True).to_list() == MODULES
    assert rows.filter(pl.col("step") == 0)["io"].to_list() == ["input", "output"] * len(MODULES)
    assert rows["status"].to_list() == ["pass"] * 4 * len(MODULES)  # two steps, input 0 and output 0
    assert rows["err"].max() < 1e-6
    assert _verdict(st, torch_run, "ref", exact)["first_divergence"] is None


@pytest.mark.msgraph
@pytest.mark.parametrize("torch_run", sorted(TORCH_RUNS))
def test_graph_against_pytorch_names_the_faulty_module(torch_dumps, torch_run):
    st, exact = _store(torch_dumps), TORCH_RUNS[torch_run][1] == "tensor"
    for target, module in (("gelu", "Module.b1.act.GELU.forward.0"), ("weight", "Module.b1.fc1.Linear.forward.0")):
        v = _verdict(st, target, torch_run, exact)
        assert (v["first_divergence"]["step"], v["first_divergence"]["op"]) == (0, module), v["first_divergence"]
        assert v["culprit"]["op"] == module, v["culprit"]

"""Test helpers shared by several test files: paths, independent leaf counting, dump.json leaf builders, the msprobe
CLI runner and bench/synth.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
MSPROBE = DATA / "msprobe"
SAMPLES = ROOT / "sample_dumps"


def count_leaves(doc: dict) -> int:
    """Leaves of a dump.json counted independently of dumpstore: null, or an object with a 'type'."""

    def walk(v) -> int:
        if v is None:
            return 1
        if isinstance(v, dict):
            if "type" in v:
                return 1
            return sum(walk(x) for x in v.values())
        if isinstance(v, list):
            return sum(walk(x) for x in v)
        return 1

    total = 0
    for key, rec in doc["data"].items():
        if key.endswith(".debug"):
            total += walk(rec)
            continue
        for sec, val in rec.items():
            if sec == "is_recompute":
                continue
            total += walk(val)
    return total


def dump_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json") if p.name in ("dump.json", "debug.json"))


def msprobe_datasets() -> list[Path]:
    return sorted(p for p in MSPROBE.iterdir() if p.is_dir())


def sample_cases() -> list[dict]:
    cat = SAMPLES / "catalog.json"
    if not cat.exists():
        return []
    doc = json.loads(cat.read_text())
    return doc["cases"] if isinstance(doc, dict) else doc


def child_processes() -> set[int]:
    """Processes (zombies included) whose parent is this one."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            out.add(int(stat.parent.name))
    return out


class ExactLoads:
    """Counts the tensor files `--exact` reads (all pairs compared in this process: no worker pool)."""

    def __init__(self, monkeypatch):
        from dumpstore.analysis import exact

        self.n = 0
        monkeypatch.setattr(exact, "_PARALLEL_MIN", 1 << 30)
        real = exact._load

        def counted(*args):
            self.n += 1
            return real(*args)

        monkeypatch.setattr(exact, "_load", counted)


STAT_KEYS = ("Max", "Min", "Mean", "Norm")


def leaf(
    arr: np.ndarray,
    *,
    requires_grad: bool = False,
    stats: Sequence[str] = STAT_KEYS,
    data_name: str | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """An msprobe tensor leaf of `arr` for a dump.json: its dtype (`dtype`: another torch dtype name), shape, the
    `stats` of STAT_KEYS computed (float64; the others, and all of an empty array's, null), requires_grad and the
    tensor file's name when given."""
    a = arr.astype(np.float64)
    values = {"Max": a.max, "Min": a.min, "Mean": a.mean, "Norm": lambda: np.linalg.norm(a)}
    out: dict[str, Any] = {
        "type": "torch.Tensor",
        "dtype": f"torch.{dtype or arr.dtype.name}",
        "shape": list(arr.shape),
        **{k: float(values[k]()) if arr.size and k in stats else None for k in STAT_KEYS},
        "requires_grad": requires_grad,
    }
    if data_name:
        out["data_name"] = data_name
    return out


def stats_verdict(dump_writer, store_dir: Path, ref: list[dict], target: list[dict]):
    """Two runs written step by step in statistics mode by the `dump_writer` fixture (`ref`, `target`: the records of
    each step), ingested into `store_dir` as `ref` and `target`: the verdict of target against ref."""
    from dumpstore import ingest, open_store
    from dumpstore.analysis import compare_runs, divergence

    for name, steps in (("ref", ref), ("target", target)):
        w = dump_writer(name, "statistics")
        for i, recs in enumerate(steps):
            w.write(recs, step=i)
        ingest(w.root, name, store=store_dir, jobs=1)
    return divergence(compare_runs(open_store(store_dir), "target", "ref"))


def leaves(obj: Any) -> Iterator[dict]:
    """The leaves of a dump.json record (or any part of one): objects with a `type` or `class_type`."""
    if isinstance(obj, dict) and ("type" in obj or "class_type" in obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from leaves(v)


def msprobe_cli() -> str | None:
    """The `msprobe` command of mindstudio-probe (beside this interpreter, else on PATH), or None without it."""
    if importlib.util.find_spec("msprobe") is None:  # importorskip would import torch: seconds
        return None
    beside = Path(sys.executable).parent / "msprobe"
    return str(beside) if beside.is_file() else shutil.which("msprobe")


def start_msprobe_compare(cli: str, target: Path, ref: Path, out: Path, log: Path, cwd: Path) -> subprocess.Popen:
    """`msprobe compare -tp target -gp ref -o out` started in the background, its output to `log`."""
    with open(log, "wb") as fh:  # the child keeps its own copy of the descriptor
        cmd = [cli, "compare", "-tp", str(target), "-gp", str(ref), "-o", str(out)]
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)


def synth():
    """bench/synth.py, importable by name (its worker processes unpickle functions of module `synth`)."""
    if "synth" not in sys.modules:
        spec = importlib.util.spec_from_file_location("synth", ROOT / "bench" / "synth.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["synth"] = mod
        spec.loader.exec_module(mod)
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    return sys.modules["synth"]


def load_script(name: str, path: Path):
    """A script of validation/ loaded by path as module ``name`` (validation/ is not a package and is not put on
    sys.path: no clash between the sets' devices modules), not registered in sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_registered(name: str, path: Path):
    """A script of validation/ loaded by path as module ``name`` and registered in sys.modules (once: a second call
    returns the first module), for sets whose modules look each other up by that name (the harness's ``_load``)."""
    if name in sys.modules:
        return sys.modules[name]
    mod = sys.modules[name] = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    mod.__spec__.loader.exec_module(mod)
    return mod


def score_validation(data: Path, tmp_path: Path) -> tuple[list[dict], subprocess.CompletedProcess]:
    """validation/score.py over the pairs and key in ``data`` (dumpstore's CLI on every pair): its rows (--json)
    and the finished process, which exited 0."""
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "validation" / "score.py"), "--data", str(data), "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc


def rel_l2(a, b) -> float:
    """The relative L2 difference of tensor ``a`` from ``b``, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def randn(*shape, seed: int = 0, scale: float = 1.0):
    """torch.randn of ``shape`` from a generator seeded ``seed``, times ``scale``."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def msprobe_command() -> list[str] | None:
    """The installed `msprobe` CLI as a command list (the script beside this python, on PATH, or run through this
    python when only the package is installed); None without mindstudio-probe."""
    import importlib.util
    import shutil
    import sys

    if importlib.util.find_spec("msprobe") is None:
        return None
    beside = Path(sys.executable).parent / "msprobe"
    found = str(beside) if beside.is_file() else shutil.which("msprobe")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from msprobe.msprobe import main; sys.argv[0] = 'msprobe'; main()"]


def replay_table(rows: list[dict]):
    """A replay table (dumpstore/replaytable.py) with `rows`' columns set and the others null, as `dumpstore
    replay` writes it: each row one output of an op, judged against float64."""
    import pyarrow as pa

    from dumpstore.replaytable import REPLAY_SCHEMA

    return pa.Table.from_pylist(rows, schema=REPLAY_SCHEMA)


def replay_row(step: int, seq: int, record: str, status: str, ratio: float | None) -> dict:
    api = record.split(".")[1]
    return {
        "step": step, "rank": 0, "seq": seq, "record": record, "prefix": "Functional", "api": api,
        "direction": "forward", "output": "0", "name": f"{record}.output.0", "dtype": "float32", "shape": [2, 3],
        "status": status, "standard": "benchmark", "api_level": "L1", "metric": "rel_l2",
        "err": None if ratio is None else ratio * 1e-7, "cpu_err": 1e-7, "ratio": ratio, "threshold": 2.0,
        "msprobe_status": "error" if status == "fail" else "pass",
    }  # fmt: skip

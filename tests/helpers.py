"""Test helpers shared by several test files (paths, independent leaf counting)."""

from __future__ import annotations

import json
import os
from pathlib import Path

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

"""Shared fixtures: a factory that writes real msprobe-style dump folders from numpy arrays, and paths.

The tensor samples' tensor files are unpacked from sample_dumps/tensor_data/ once, before the tests are collected
(idempotent: a session after the first finds them there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import SAMPLES, leaf


def pytest_configure(config: pytest.Config) -> None:
    sys.path.insert(0, str(SAMPLES))
    try:
        import fixtures  # sample_dumps/fixtures.py
    finally:
        sys.path.remove(str(SAMPLES))
    fixtures.unpack_all()


class DumpWriter:
    """Writes `<root>/step<S>/rank<R>/dump.json` with .npy tensor files, msprobe-style."""

    def __init__(self, root: Path, task: str = "tensor"):
        self.root = root
        self.task = task

    def write(
        self, records: dict[str, dict[str, list]], *, step: int = 0, rank: int = 0, construct: dict | None = None
    ) -> Path:
        d = self.root / f"step{step}" / f"rank{rank}"
        (d / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
        data = {
            key: {sec: self._section(key, sec, vals, d) for sec, vals in rec.items()} for key, rec in records.items()
        }
        doc = {"task": self.task, "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data}
        (d / "dump.json").write_text(json.dumps(doc, indent=1))
        (d / "construct.json").write_text(json.dumps(construct or {}))
        return d / "dump.json"

    def _section(self, key: str, sec: str, vals: list, d: Path) -> list:
        io = {"input_args": "input", "output": "output", "input": "input"}.get(sec, sec)
        out = []
        for i, v in enumerate(vals):
            if isinstance(v, np.ndarray):
                name = f"{key}.{io}.{i}.npy" if self.task == "tensor" else None
                if name:
                    np.save(d / "dump_tensor_data" / name, v)
                out.append(leaf(v, data_name=name))
            else:
                out.append(v)
        return out


@pytest.fixture
def dump_writer(tmp_path: Path):
    def make(name: str = "dump", task: str = "tensor") -> DumpWriter:
        return DumpWriter(tmp_path / name, task)

    return make


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch):
    monkeypatch.delenv("DUMPSTORE_STORE", raising=False)


@pytest.fixture(scope="session")
def sample_store(tmp_path_factory):
    """Every case of sample_dumps/catalog.json ingested once, as run <case name>; tests only read it."""
    from dumpstore._ingest import ingest
    from dumpstore.store import open_store
    from helpers import SAMPLES, sample_cases

    root = tmp_path_factory.mktemp("sample_store")
    for case in sample_cases():
        ingest(SAMPLES / case["path"], case["name"], store=root, jobs=1)
    return open_store(root)

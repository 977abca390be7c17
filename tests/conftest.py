"""Shared fixtures: a factory that writes real msprobe-style dump folders from numpy arrays, and paths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _leaf(arr: np.ndarray, data_name: str | None, dtype: str | None = None) -> dict[str, Any]:
    a64 = arr.astype(np.float64)
    leaf: dict[str, Any] = {
        "type": "torch.Tensor",
        "dtype": dtype or f"torch.{arr.dtype.name}",
        "shape": list(arr.shape),
    }
    if arr.size:
        leaf.update(
            Max=float(a64.max()), Min=float(a64.min()), Mean=float(a64.mean()), Norm=float(np.sqrt((a64 * a64).sum()))
        )
    else:
        leaf.update(Max=None, Min=None, Mean=None, Norm=None)
    leaf["requires_grad"] = False
    if data_name:
        leaf["data_name"] = data_name
    return leaf


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
                out.append(_leaf(v, name))
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

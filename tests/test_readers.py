"""The readers' registry (dumpstore.readers): one module per input format, detection in one place."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from dumpstore import readers
from dumpstore._ingest import ingest
from dumpstore.errors import DumpFormatError
from dumpstore.layout import find_units
from dumpstore.query import run_query
from dumpstore.store import open_store
from helpers import DATA, SAMPLES, dump_files, msprobe_datasets


def test_every_reader_module_is_registered_in_claiming_order():
    names = [r.NAME for r in readers.READERS]
    files = sorted(p.stem for p in Path(readers.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert sorted(names) == files  # a module added to the package is a reader, nothing else to register
    assert names[:1] == ["msprobe"]  # a dump.json claims its folder before the tensor-file formats
    assert readers.tensor_suffixes() == (".pt", ".npy")
    for r in readers.READERS:
        assert isinstance(r.NAME, str) and isinstance(r.ORDER, int) and callable(r.claim)


@pytest.mark.parametrize(
    "path, name",
    [
        (SAMPLES / "ref_stats", "msprobe"),
        (SAMPLES / "ref_stats" / "step0" / "rank0" / "dump.json", "msprobe"),
        (SAMPLES / "ref_tensor", "msprobe"),  # its .pt files belong to the dump.json beside them
        (DATA / "pt", "pt"),
    ],
)
def test_detect_names_the_format(path, name):
    assert readers.detect(path) == name


def test_detect_of_a_folder_of_npy_files_and_of_nothing(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(3, dtype=np.float32))
    assert readers.detect(tmp_path) == "npy"
    (tmp_path / "a.npy").unlink()
    (tmp_path / "notes.txt").write_text("x")
    assert readers.detect(tmp_path) is None
    assert readers.detect(tmp_path / "notes.txt") is None


def test_a_tensor_file_is_read_by_the_reader_of_its_suffix(tmp_path):
    with open(tmp_path / "a.NPY", "wb") as fh:  # np.save would add .npy to the name
        np.save(fh, np.arange(4, dtype=np.int16))
    arr, dtype = readers.load_tensor(tmp_path / "a.NPY")
    assert dtype == "int16" and arr.tolist() == [0, 1, 2, 3]
    assert readers.tensor_reader(tmp_path / "x.pt").NAME == "pt"
    (tmp_path / "b.bin").write_bytes(b"\0")
    with pytest.raises(DumpFormatError, match=r"b\.bin: unknown tensor file type; expected \.pt or \.npy$"):
        readers.load_tensor(tmp_path / "b.bin")


def test_dump_tensor_data_is_never_a_folder_of_its_own(tmp_path):
    d = tmp_path / "dump_tensor_data"
    d.mkdir()
    np.save(d / "a.npy", np.zeros(2))
    assert readers.claim(d, ["a.npy"]) is None
    assert readers.claim(tmp_path, ["a.pt"])[1] == readers.Claim(tmp_path, "files")


@pytest.mark.parametrize("dataset", msprobe_datasets(), ids=lambda p: p.name)
def test_each_dump_file_of_the_real_dumps_is_a_unit(dataset):
    units = find_units(dataset)
    assert [u.kind for u in units] == ["dump"] * len(units)
    assert sorted(u.path.parent for u in units) == sorted({p.parent for p in dump_files(dataset)})


def _toy_reader() -> types.ModuleType:
    """A format with rows of its own: `*.vals` files of `name value` lines, one row per line."""
    toy = types.ModuleType("toy")
    toy.NAME, toy.ORDER = "toy", 20

    def claim(folder: Path, filenames: list[str]):
        return readers.Claim(folder, "toy") if any(f.endswith(".vals") for f in filenames) else None

    def rows(unit, res):
        for path in sorted(unit.path.glob("*.vals")):
            res.files += 1
            for seq, line in enumerate(path.read_text().splitlines()):
                name, value = line.split()
                res.records += 1
                yield {
                    "seq": seq,
                    "leaf": seq,
                    "record": name,
                    "prefix": "toy",
                    "api": name,
                    "op_type": name,
                    "direction": "forward",
                    "io": "output",
                    "index_path": "0",
                    "name": name,
                    "kind": "scalar",
                    "scalar_value": float(value),
                }

    toy.claim, toy.rows = claim, rows
    return toy


def test_a_new_reader_is_a_module_the_ingest_uses(tmp_path, monkeypatch):
    """What adding a format takes: a module with NAME, ORDER, claim and rows; the layout and ingest use it."""
    known = readers._modules()
    monkeypatch.setattr(readers, "_modules", lambda: (*known, _toy_reader()))
    src = tmp_path / "run" / "step3" / "rank1"
    src.mkdir(parents=True)
    (src / "a.vals").write_text("loss 2.5\nlr 0.125\n")
    assert readers.detect(tmp_path / "run") == "toy"
    [unit] = find_units(tmp_path / "run")
    assert (unit.kind, unit.step, unit.rank) == ("toy", 3, 1)
    res = ingest(tmp_path / "run", "t", store=tmp_path / "s", jobs=1)
    assert (res.records, res.rows, res.steps, res.ranks) == (2, 2, [3], [1])
    got = run_query(open_store(tmp_path / "s"), "SELECT name, scalar_value FROM tensors WHERE run = 't' ORDER BY seq")
    assert got.to_pylist() == [{"name": "loss", "scalar_value": 2.5}, {"name": "lr", "scalar_value": 0.125}]

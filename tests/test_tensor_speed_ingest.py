"""Tensor files read ahead by the worker pool (chunks submitted while the rows are built) give the serial rows."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from dumpstore import tensorfile
from dumpstore._ingest import batches, ingest, tensors
from dumpstore.errors import DumpFormatError
from dumpstore.query import run_query
from dumpstore.store import open_store
from dumpstore.tensorfile import MissingFile, load_leaf

SAMPLES = Path(__file__).resolve().parent.parent / "sample_dumps"


def _rows(store_dir: Path, run: str) -> list[dict]:
    sql = f"select * exclude (ingest_id, run) from tensors where run='{run}' order by step, rank, leaf"
    return run_query(open_store(store_dir), sql).to_pylist()


def _damaged_copy(tmp_path: Path) -> Path:
    """ref_tensor with one .pt missing, one truncated and one replaced by a link to a sibling."""
    ds = tmp_path / "ref_tensor"
    shutil.copytree(SAMPLES / "ref_tensor", ds)
    files = sorted((ds / "step0" / "rank0" / "dump_tensor_data").iterdir())
    files[10].unlink()
    files[20].write_bytes(files[20].read_bytes()[:100])
    files[30].unlink()
    files[30].symlink_to(files[31].name)
    return ds


@pytest.mark.parametrize("chunk, ahead, batch, loaded", [(3, 2, 50, 1), (1, 1, 7, 1 << 30), (64, 2, 4096, 50_000)])
def test_read_ahead_gives_the_serial_rows(store_dir, tmp_path, monkeypatch, chunk, ahead, batch, loaded):
    ds = _damaged_copy(tmp_path)
    serial = ingest(ds, "serial", store=store_dir, jobs=1)
    monkeypatch.setattr(tensors, "_CHUNK_FILES", chunk)
    monkeypatch.setattr(tensors, "_AHEAD_BATCHES", ahead)
    monkeypatch.setattr(batches, "_BATCH_ROWS", batch)
    monkeypatch.setattr(tensorfile, "LOADED_BYTES", loaded)  # summarise after every file, after all, in between
    pooled = ingest(ds, "pooled", store=store_dir, jobs=2)  # one dump file: its tensor files go to the pool
    assert (serial.rows, serial.tensor_files, serial.errors, serial.first_error) == (
        pooled.rows,
        pooled.tensor_files,
        pooled.errors,
        pooled.first_error,
    )
    assert serial.tensor_files == 400 - 3 and serial.errors == 3
    a, b = _rows(store_dir, "serial"), _rows(store_dir, "pooled")
    assert repr(a) == repr(b)  # repr: NaN equals NaN, -0.0 differs from 0.0
    assert Counter(r["file_status"] for r in a if r["data_name"]) == {"loaded": 397, "error": 2, "missing": 1}
    links = [r for r in a if r["file_status"] == "error" and "is a link" in r["error"]]
    assert len(links) == 1 and links[0]["sample"] is None


def test_load_leaf_refuses_links_and_reports_missing_files(tmp_path):
    ds = _damaged_copy(tmp_path) / "step0" / "rank0"
    names = sorted(p.name for p in (SAMPLES / "ref_tensor" / "step0" / "rank0" / "dump_tensor_data").iterdir())
    with pytest.raises(MissingFile, match=r"tensor file .* is missing"):
        load_leaf(ds, names[10])
    with pytest.raises(DumpFormatError, match="is a link or lies outside"):
        load_leaf(ds, names[30])
    with pytest.raises(DumpFormatError, match="is not a plain file name"):
        load_leaf(ds, "../" + names[31])
    arr, dtype, (size, mtime_ns) = load_leaf(ds, names[31])
    assert dtype == "float32" and arr.flags.writeable and arr.size > 0
    info = (ds / "dump_tensor_data" / names[31]).stat()
    assert (size, mtime_ns) == (info.st_size, info.st_mtime_ns)

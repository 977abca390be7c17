"""The report CSV written by columns (analysis/report/csvcols.py) is byte for byte the row-by-row writer's file.

The row path (`csvfile.iter_csv_rows`, one dict per row through csv.writer) is the reference: every pair here is
written both ways (the whole file, and `--only-differing` for some), and the bytes compared.  Pairs: statistics
samples (overflow's inf/NaN statistics; two ranks), a statistics run against a tensor run (no common dump mode),
the tensor samples and a hand-made tensor-mode dump (files read as `report --csv` reads them, and not),
and a hand-made dump with what the columns must write exactly as Python does: tiny and huge floats, -0.0 against
0.0, NaN and infinities, bool and int tensors, arguments that differ, null leaves, names with quotes, commas and
spreadsheet formula characters, leaves on one side only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.report import csvcols, write_csv
from dumpstore.store import open_store

PAIRS = [  # (target, reference, also --only-differing)
    ("overflow_stats", "ref_stats", True),
    ("rank1_fault_stats", "ref_2rank_stats", True),
    ("weight_1pct_stats", "ref_tensor", False),
]


def _both(cmp, store, tmp: Path, only_differing: bool, monkeypatch) -> tuple[bytes, bytes, int]:
    n = write_csv(cmp, tmp / "cols.csv", store=store, only_differing=only_differing)
    with monkeypatch.context() as m:
        m.setattr(csvcols, "frames", lambda *a, **k: None)  # the row-by-row path
        n_rows = write_csv(cmp, tmp / "rows.csv", store=store, only_differing=only_differing)
    assert n == n_rows
    return (tmp / "cols.csv").read_bytes(), (tmp / "rows.csv").read_bytes(), n


@pytest.mark.parametrize(("target", "ref", "only_differing"), PAIRS)
def test_columns_write_the_row_writers_bytes(sample_store, target, ref, only_differing, tmp_path, monkeypatch) -> None:
    cmp = compare_runs(sample_store, target, ref)
    for only in (False, True) if only_differing else (False,):
        cols, rows, n = _both(cmp, sample_store, tmp_path, only, monkeypatch)
        assert n > 0 and cols.count(b"\n") >= n + 1
        assert cols == rows


def _tensor(dtype: str, mx, mn, mean, norm, shape=(2, 3), **extra) -> dict:
    return {"type": "torch.Tensor", "dtype": dtype, "shape": list(shape), "Max": mx, "Min": mn, "Mean": mean,
            "Norm": norm, "requires_grad": extra.pop("requires_grad", False), **extra}  # fmt: skip


def _odd_dump(root: Path, target: bool) -> None:
    """A statistics dump.json whose cells exercise every text rule of the CSV."""
    f32 = "torch.float32"
    k = 1.5 if target else 1.0
    data = {
        "Functional.linear.0.forward": {
            "input_args": [
                _tensor(f32, 1e-5 * k, -1.5e-7, 0.0 if target else -0.0, 1e16 * k),
                _tensor(f32, 9999999999999998.0, -0.0001, 1.0000000000000002, 123456.789),
                _tensor("torch.int64", 7, 0, 3.5, 12.0),
                _tensor("torch.bool", True, target, 0.5, 1.0),
            ],
            "input_kwargs": {
                "alpha": {"type": "float", "value": 0.5 * k},
                "mode": {"type": "str", "value": "=SUM(A1)"},
            },
            "output": [
                _tensor(f32, "inf" if target else 2.0, "-inf", "nan" if target else 0.5, None),
                _tensor(f32, 3.0, 1.0, 2.0, 4.0, requires_grad=target),
                None,
            ],
        },
        'Functional.we,ird"na-me.0.forward': {
            "input_args": [_tensor(f32, 1.0, -1.0, 0.0, 2.0)],
            "input_kwargs": {},
            "output": [_tensor(f32, 2.0 * k, -2.0, 0.1, 1e-300 * k)],
        },
        "Tensor.__add__.0.forward": {
            "input_args": [_tensor(f32, -3.0, -4.0, -3.5, 7.0), {"type": "int", "value": 1}],
            "input_kwargs": {},
            "output": [_tensor("torch.float16", -2.0 * k, -3.0, -2.5, 5.0, shape=(2, 3) if target else (3, 2))],
        },
    }
    if target:
        data["Functional.only_target.0.forward"] = {"input_args": [_tensor(f32, 1.0, 0.0, 0.5, 1.0)], "output": []}
    else:
        data["Functional.only_ref.0.forward"] = {"input_args": [_tensor(f32, 1.0, 0.0, 0.5, 1.0)], "output": []}
    root.mkdir(parents=True)
    doc = {"task": "statistics", "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data}
    (root / "dump.json").write_text(json.dumps(doc).replace('"inf"', "Infinity").replace('"-inf"', "-Infinity")
                                    .replace('"nan"', "NaN"))  # fmt: skip


def test_columns_write_the_row_writers_bytes_on_odd_cells(tmp_path, monkeypatch) -> None:
    _odd_dump(tmp_path / "t", target=True)
    _odd_dump(tmp_path / "r", target=False)
    for side in ("t", "r"):
        ingest(tmp_path / side, side, store=tmp_path / "store", jobs=1)
    st = open_store(tmp_path / "store")
    cmp = compare_runs(st, "t", "r")
    assert csvcols.frame(cmp, st, "statistics", ("NPU Name",)) is not None  # the columnar path is taken
    texts = []
    for only in (False, True):
        cols, rows, _ = _both(cmp, st, tmp_path, only, monkeypatch)
        assert cols == rows
        texts.append(cols.decode())
    text = texts[0]
    assert "1e-05" in text and "1e+16" in text and '"Functional.we,ird""na-me.0.forward.output.0"' in text
    assert "'=SUM(A1)" in text  # the formula is neutralised


def test_md5_mode_by_columns(tmp_path, monkeypatch) -> None:
    """md5 mode (msprobe 26.2.0 dumps, two steps of one run as two runs): NPU MD5 / BENCH MD5 and the CRC-32 rule."""
    from helpers import MSPROBE

    for side, step in (("t", "step1"), ("r", "step0")):
        (tmp_path / side).mkdir()
        for f in next((MSPROBE / "v26_md5" / step).glob("proc*")).glob("*.json"):
            (tmp_path / side / f.name).write_bytes(f.read_bytes())
        ingest(tmp_path / side, side, store=tmp_path / "store", jobs=1)
    st = open_store(tmp_path / "store")
    cmp = compare_runs(st, "t", "r")
    assert csvcols.frame(cmp, st, "md5", ("NPU Name",)) is not None
    cols, rows, n = _both(cmp, st, tmp_path, False, monkeypatch)
    assert cols == rows and b"The CRC-32 value of NPU differs from that of the bench." in cols


def test_chunks_of_whole_ops_write_the_same_bytes(sample_store, tmp_path, monkeypatch) -> None:
    """Cells built a few ops at a time (CHUNK_ROWS small): the same file, a stack held from one chunk to the next
    for --only-differing."""
    cmp = compare_runs(sample_store, "rank1_fault_stats", "ref_2rank_stats")
    whole = []
    for only in (False, True):  # one chunk (the other tests hold it to the row writer's bytes)
        write_csv(cmp, tmp_path / "whole.csv", store=sample_store, only_differing=only)
        whole.append((tmp_path / "whole.csv").read_bytes())
    monkeypatch.setattr(csvcols, "CHUNK_ROWS", 600)
    parts = list(csvcols.frames(cmp, sample_store, "statistics", ("NPU Name", "op")))
    assert len(parts) > 3 and sum(p.height for p in parts) == cmp.rows.height
    for p, q in zip(parts, parts[1:]):  # a chunk ends where an op ends
        assert p["op"][-1] != q["op"][0] or p["NPU Name"][-1].split(".")[-2:] != q["NPU Name"][0].split(".")[-2:]
    for only, want in zip((False, True), whole):
        write_csv(cmp, tmp_path / "chunked.csv", store=sample_store, only_differing=only)
        assert (tmp_path / "chunked.csv").read_bytes() == want


def _tensor_dump(root: Path, target: bool) -> None:
    """A tensor-mode dump (.npy files) whose ops exercise msprobe's tensor-mode rules: an output that flips sign
    while its inputs are equal (One Thousandth Err Ratio error and the Cosine warning on the op's first output), one
    a little off, a NaN in an input, a scalar argument (unsupported), a null output, an int tensor."""
    import numpy as np

    files = root / "dump_tensor_data"
    files.mkdir(parents=True)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    y = x @ w
    nan_in = x.copy()
    nan_in[0, 0] = np.nan

    def leaf(name: str, a: np.ndarray, requires_grad: bool = False) -> dict:
        np.save(files / f"{name}.npy", a)
        f = a.astype(np.float64)
        ok = bool(np.isfinite(f).all())
        nan = float("nan")
        return {"type": "torch.Tensor", "dtype": f"torch.{a.dtype}", "shape": list(a.shape),
                "Max": float(np.max(f)) if ok else nan, "Min": float(np.min(f)) if ok else nan,
                "Mean": float(np.mean(f)), "Norm": float(np.linalg.norm(f)), "requires_grad": requires_grad,
                "data_name": f"{name}.npy"}  # fmt: skip

    def op(name: str, inputs: list, outputs: list, **kwargs) -> tuple[str, dict]:
        args = [leaf(f"{name}.input.{i}", a, i == 1) for i, a in enumerate(inputs)]
        outs = [None if a is None else leaf(f"{name}.output.{i}", a) for i, a in enumerate(outputs)]
        return name, {"input_args": args, "input_kwargs": kwargs, "output": outs}

    ops = dict(
        [
            op(
                "Functional.linear.0.forward",
                [x, w],
                [-y if target else y, None],
                alpha={"type": "float", "value": 0.5},
            ),
            op("Functional.relu.0.forward", [y], [np.maximum(y, 0) * (1.001 if target else 1.0)]),
            op("Tensor.__add__.0.forward", [nan_in, x], [nan_in + x]),
            op("Functional.argmax.0.forward", [y], [np.argmax(y, axis=1) + (1 if target else 0)]),
        ]
    )
    doc = {"task": "tensor", "level": "mix", "framework": "pytorch", "dump_data_dir": str(files), "data": ops}
    (root / "dump.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("exact", [True, False])
def test_tensor_mode_by_columns(tmp_path, monkeypatch, exact) -> None:
    """Tensor mode by columns (the metric cells, `unsupported`, the exact cells read from the files, msprobe's
    tensor-mode rules per op) writes the row writer's bytes, with the files read (as `report --csv` reads tensor
    dumps) and without."""
    for side in ("t", "r"):
        _tensor_dump(tmp_path / side, target=side == "t")
        ingest(tmp_path / side, side, store=tmp_path / "store", jobs=1)
    st = open_store(tmp_path / "store")
    cmp = compare_runs(st, "t", "r", exact=exact)
    assert csvcols.frame(cmp, st, "tensor", ("NPU Name",)) is not None  # the columnar path is taken
    for only in (False, True):
        cols, rows, n = _both(cmp, st, tmp_path, only, monkeypatch)
        assert cols == rows
    text = _both(cmp, st, tmp_path, False, monkeypatch)[0].decode()
    assert "unsupported" in text
    if exact:  # msprobe's op-level rules of tensor mode fire on the sign flip
        assert "One Thousandth Err Ratio > 0.9 while the output < 0.6." in text
        assert "The input/parameters of Cosine > 0.9, and input/parameters - output > 0.1" in text


@pytest.mark.parametrize("target", ["weight_1pct_tensor", "bf16_tensor", "gelu_tanh_tensor"])
def test_tensor_samples_by_columns(sample_store, target, tmp_path, monkeypatch) -> None:
    """The tensor samples, their files read as `report --csv` reads them: written by columns, the row writer's
    bytes (the --only-differing file too)."""
    cmp = compare_runs(sample_store, target, "ref_tensor", exact=True)
    assert csvcols.frame(cmp, sample_store, "tensor", ("NPU Name",)) is not None
    for only in (False, True):
        cols, rows, n = _both(cmp, sample_store, tmp_path, only, monkeypatch)
        assert cols == rows and (only or n > 400)

"""Statistics that msprobe writes as strings ("Max": "inf", "-inf", "nan") are numbers everywhere: overflow,
health and comparison find them.  Dumps shaped like the ones msprobe's own NaN analyser tests build (written
here, not copied): per rank, compute records `Torch.operator.{n}.forward` and communication records
`Distributed.{name}.{n}.forward`; an anomalous leaf has Max 'inf', Min '-inf', Mean and Norm 'nan'.  msprobe's
tests expect the first anomaly of rank 0 at `Torch.operator.0.forward` (the first record's output) and, in the
second layout, at `Torch.operator.5.forward`.

Also: a masking op whose fill argument is the dtype's extreme (`torch.where(mask, x, finfo.min)`,
`masked_fill(mask, -inf)`) is a mask, not an overflow, with or without a reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dumpstore._ingest import ingest
from dumpstore.analysis import overflow
from dumpstore.analysis._health import health
from dumpstore.analysis.compare import compare_runs
from dumpstore.query import run_query
from dumpstore.store import open_store

FMIN = -3.4028234663852886e38


def _leaf(normal: bool, dtype: str = "torch.float32", mx=2.0, mn=1.0) -> dict:
    return {
        "type": "torch.Tensor",
        "dtype": dtype,
        "shape": [2, 1024],
        "Max": mx if normal else "inf",
        "Min": mn if normal else "-inf",
        "Mean": 1.5 if normal else "nan",
        "Norm": 2.236 if normal else "nan",
        "requires_grad": False,
    }


def _write(root: Path, ranks: dict[int, list[tuple[str, bool, bool]]]) -> Path:
    """ranks: rank -> [(name, input normal, output normal)]; name 'compute' or a communication op."""
    for rank, ops in ranks.items():
        data, counts = {}, {}
        for name, inp, out in ops:
            n = counts.get(name, 0)
            counts[name] = n + 1
            key = f"Torch.operator.{n}.forward" if name == "compute" else f"Distributed.{name}.{n}.forward"
            data[key] = {"input_args": [_leaf(inp)], "input_kwargs": {}, "output": [_leaf(out)]}
        folder = root / "step0" / f"rank{rank}"
        folder.mkdir(parents=True)
        doc = {"task": "statistics", "level": "mix", "dump_data_dir": None, "data": data}
        (folder / "dump.json").write_text(json.dumps(doc))
    return root


def _store(tmp_path: Path, runs: dict[str, Path]):
    for run, path in runs.items():
        ingest(path, run, store=tmp_path / "store", jobs=1)
    return open_store(tmp_path / "store")


def test_first_record_anomaly(tmp_path):
    ok = ("compute", True, True)
    dump = _write(
        tmp_path / "d",
        {0: [("compute", True, False)] + [ok] * 4, 1: [ok, ("compute", True, False)] + [ok] * 3},
    )
    st = _store(tmp_path, {"t": dump})
    rep = overflow(st, "t")
    assert rep.first_overflow["op"] == "Torch.operator.0.forward" and rep.first_overflow["rank"] == 0
    assert rep.first_overflow["kind"] == "inf"  # Max inf, Min -inf: NaN only in Mean and Norm (inf - inf)
    assert [(p["rank"], p["op"]) for p in rep.producers] == [
        (0, "Torch.operator.0.forward"),
        (1, "Torch.operator.1.forward"),
    ]
    row = run_query(
        st,
        "SELECT max, min, mean, norm, has_nan FROM tensors WHERE run = 't' AND rank = 0 "
        "AND name = 'Torch.operator.0.forward.output.0'",
    ).to_pylist()[0]
    assert (row["max"], row["min"], row["has_nan"]) == (math.inf, -math.inf, False)
    assert math.isnan(row["mean"]) and math.isnan(row["norm"])


def test_anomaly_after_communication(tmp_path):
    ok = ("compute", True, True)
    rank0 = [ok] * 5 + [
        ("send", True, True),
        ("recv", True, True),
        ("compute", True, False),
        ("broadcast", False, False),
    ]
    dump = _write(tmp_path / "d", {0: rank0 + [("compute", False, False)]})
    st = _store(tmp_path, {"t": dump})
    assert overflow(st, "t").first_overflow["op"] == "Torch.operator.5.forward"
    assert health(st, "t").first("overflow").op == "Torch.operator.5.forward"


def test_string_statistics_compare_as_numbers(tmp_path):
    ok = ("compute", True, True)
    tgt = _write(tmp_path / "t", {0: [ok, ("compute", True, False), ok]})
    ref = _write(tmp_path / "r", {0: [ok] * 3})
    st = _store(tmp_path, {"t": tgt, "r": ref})
    rows = compare_runs(st, "t", "r").rows
    bad = rows.filter(rows["name"] == "Torch.operator.1.forward.output.0").row(0, named=True)
    assert bad["status"] == "diverged" and bad["has_posinf"] and not bad["ref_has_posinf"]
    assert rows.filter(rows["status"] == "diverged")["record"].unique().to_list() == ["Torch.operator.1.forward"]


def _mask_dump(root: Path) -> Path:
    def t(mx, mn, dtype="torch.float32"):
        return {
            "type": "torch.Tensor",
            "dtype": dtype,
            "shape": [2, 4],
            "Max": mx,
            "Min": mn,
            "Mean": 0.0,
            "Norm": 1.0,
            "requires_grad": False,
        }

    mask = t(True, False, "torch.bool")
    data = {
        "Functional.linear.0.forward": {"input_args": [t(1.0, -1.0)], "input_kwargs": {}, "output": [t(2.0, -2.0)]},
        "Torch.where.0.forward": {
            "input_args": [mask, t(2.0, -2.0), {"type": "float", "value": FMIN}],
            "input_kwargs": {},
            "output": [t(2.0, FMIN)],
        },
        "Tensor.masked_fill.0.forward": {
            "input_args": [t(2.0, -2.0), mask, {"type": "float", "value": "-inf"}],
            "input_kwargs": {},
            "output": [t(2.0, "-inf")],
        },
        "Functional.softmax.0.forward": {"input_args": [t(2.0, FMIN)], "input_kwargs": {}, "output": [t(1.0, 0.0)]},
        "Tensor.__mul__.0.forward": {
            "input_args": [t(2.0, -2.0), {"type": "float", "value": 1e38}],
            "input_kwargs": {},
            "output": [t(2e38, FMIN)],
        },
    }
    folder = root / "step0" / "rank0"
    folder.mkdir(parents=True)
    (folder / "dump.json").write_text(
        json.dumps({"task": "statistics", "level": "L1", "dump_data_dir": None, "data": data})
    )
    return root


def test_fill_with_the_dtype_extreme_is_a_mask(tmp_path):
    st = _store(tmp_path, {"t": _mask_dump(tmp_path / "t"), "r": _mask_dump(tmp_path / "r")})
    rep = overflow(st, "t")
    masks = {p["op"]: p["likely_mask"] for p in rep.producers}
    assert masks == {
        "Torch.where.0.forward": True,
        "Tensor.masked_fill.0.forward": True,
        "Tensor.__mul__.0.forward": False,
    }
    assert rep.first_overflow["op"] == "Tensor.__mul__.0.forward"  # a multiply that saturates is overflow
    assert overflow(st, "t", ref="r").first_overflow is None  # the reference saturates the same way

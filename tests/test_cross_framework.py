"""MindSpore vs PyTorch pairs: records of one framework only are expected structure, and a keyword one run
leaves at the API's default is no differing argument (analysis/defaults.py).

Hand-made msprobe 26.x statistics dumps of the same two-GELU network in both frameworks, leaves as each writes
them (MindSpore: `mindspore.Tensor`, `Float32`, `approximate` recorded as a keyword; PyTorch: `torch.Tensor`,
`torch.float32`, no keyword).  The MindSpore run also has the framework's own records (`Primitive.get_shp.Shape`,
an extra `Tensor.__add__` whose result feeds nothing that differs).  The fault: the second GELU is the tanh
approximation in the MindSpore port.
"""

from __future__ import annotations

import json
from pathlib import Path

from dumpstore._ingest import ingest
from dumpstore.analysis._checklist import checklist
from dumpstore.analysis._divergence import divergence
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.defaults import default_of, is_default
from dumpstore.store import open_store


def _leaf(ms: bool, mx: float, mn: float, mean: float, norm: float) -> dict:
    leaf = {
        "type": "mindspore.Tensor" if ms else "torch.Tensor",
        "dtype": "Float32" if ms else "torch.float32",
        "shape": [4, 8],
        "Max": mx,
        "Min": mn,
        "Mean": mean,
        "Norm": norm,
    }
    if not ms:
        leaf["requires_grad"] = True
    return leaf


X0 = (2.0, -2.0, 0.1, 8.0)
G0 = (1.95, -0.17, 0.6, 5.0)
X1 = (1.5, -1.7, 0.05, 7.0)
G1 = (1.4, -0.17, 0.5, 4.5)
G1_TANH = (1.41, -0.169, 0.52, 4.62)  # the tanh approximation's output: relative changes ~1e-2


def _dump(root: Path, ms: bool, fault: bool) -> Path:
    data: dict = {}
    if ms:
        data["Primitive.get_shp.Shape.0.forward"] = {
            "input_args": [_leaf(ms, *X0)],
            "input_kwargs": {},
            "output": [{"type": "tuple", "value": [4, 8]}],
        }
    kw = {"approximate": {"type": "str", "value": "none"}} if ms else {}
    data["Functional.gelu.0.forward"] = {"input_args": [_leaf(ms, *X0)], "input_kwargs": kw, "output": [_leaf(ms, *G0)]}
    if ms:
        data["Tensor.__add__.0.forward"] = {
            "input_args": [_leaf(ms, *G0), {"type": "int", "value": 0}],
            "input_kwargs": {},
            "output": [_leaf(ms, *G0)],
        }
    data["Functional.linear.0.forward"] = {
        "input_args": [_leaf(ms, *G0)],
        "input_kwargs": {},
        "output": [_leaf(ms, *X1)],
    }
    kw1 = {"approximate": {"type": "str", "value": "tanh" if fault else "none"}} if ms else {}
    out1 = G1_TANH if fault else G1
    data["Functional.gelu.1.forward"] = {
        "input_args": [_leaf(ms, *X1)],
        "input_kwargs": kw1,
        "output": [_leaf(ms, *out1)],
    }
    folder = root / "step0" / "rank0"
    folder.mkdir(parents=True)
    doc = {"task": "statistics", "level": "L1", "framework": "mindspore" if ms else "pytorch", "dump_data_dir": None}
    (folder / "dump.json").write_text(json.dumps({**doc, "data": data}))
    return root


def _verdict(tmp_path: Path, fault: bool) -> dict:
    ingest(_dump(tmp_path / "ms", True, fault), "ms", store=tmp_path / "store", jobs=1)
    ingest(_dump(tmp_path / "pt", False, False), "pt", store=tmp_path / "store", jobs=1)
    return divergence(compare_runs(open_store(tmp_path / "store"), "ms", "pt")).to_dict()


def test_faulty_gelu_named_not_a_default_keyword_or_a_framework_record(tmp_path):
    v = _verdict(tmp_path, fault=True)
    assert v["first_divergence"]["op"] == "Functional.gelu.1.forward", v["first_divergence"]
    assert v["culprit"]["op"] == "Functional.gelu.1.forward" and v["culprit"]["kind"] == "scalar", v["culprit"]
    assert {u["op"] for u in v["unmatched"]} >= {"Primitive.get_shp.Shape.0.forward", "Tensor.__add__.0.forward"}


def test_clean_port_is_quiet(tmp_path):
    v = _verdict(tmp_path, fault=False)
    assert v["first_divergence"] is None and v["culprit"] is None, v
    assert len(v["unmatched"]) == 2  # listed, not a verdict
    scalars = checklist(open_store(tmp_path / "store"), "ms", "pt")["scalars"]
    assert scalars.status != "differs", scalars.evidence  # approximate="none" is PyTorch's default too


def test_checklist_lists_a_non_default_keyword(tmp_path):
    _verdict(tmp_path, fault=True)
    scalars = checklist(open_store(tmp_path / "store"), "ms", "pt")["scalars"]
    assert scalars.status == "differs" and [i["arg"] for i in scalars.items] == ["input.approximate"]


def test_default_table():
    assert default_of("pytorch", "Functional", "gelu", "approximate") == "none"
    assert default_of("mindspore", "Functional", "gelu", "approximate") == "none"
    assert default_of("pytorch", "Functional", "layer_norm", "eps") == 1e-05
    assert is_default("pytorch", "Functional", "gelu", "approximate", '"none"')
    assert not is_default("pytorch", "Functional", "gelu", "approximate", '"tanh"')
    assert is_default("pytorch", "Mint", "gelu", "approximate", '"none"')  # by name across prefixes
    assert not is_default("pytorch", "Functional", "gelu", "0", '"none"')  # positional: not a keyword
    assert not is_default(None, "Functional", "gelu", "approximate", '"none"')

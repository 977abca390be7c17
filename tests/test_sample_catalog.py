"""Consistency of sample_dumps/catalog.json with the bundled msprobe dumps.

Imports no dumpstore, torch or msprobe.
"""

import json
import math
import os

import pytest

from helpers import leaves

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "sample_dumps")
CATALOG_PATH = os.path.join(ROOT, "catalog.json")

MODES = {"statistics", "tensor"}
CULPRIT_KINDS = {"op", "parameter", "input", "scalar", "missing_or_extra"}
OVERFLOW_KINDS = {"nan", "inf", "saturated"}


def _catalog():
    with open(CATALOG_PATH) as f:
        return json.load(f)


CASES = _catalog()["cases"]
BY_NAME = {c["name"]: c for c in CASES}
IDS = [c["name"] for c in CASES]


def _rank_dir(case, step, rank):
    return os.path.join(ROOT, case["path"], "step%d" % step, "rank%d" % rank)


_DUMPS = {}


def _dump(case, step, rank):
    key = (case["name"], step, rank)
    if key not in _DUMPS:
        with open(os.path.join(_rank_dir(case, step, rank), "dump.json")) as f:
            _DUMPS[key] = json.load(f)  # NaN / Infinity tokens are accepted by Python's json
    return _DUMPS[key]


def test_catalog_names_unique_and_refs_known():
    assert len(IDS) == len(set(IDS))
    for c in CASES:
        assert c["mode"] in MODES
        if c["ref"] is not None:
            ref = BY_NAME[c["ref"]]
            assert ref["ref"] is None
            assert ref["mode"] == c["mode"]
            assert ref["steps"] == c["steps"] and ref["ranks"] == c["ranks"]


@pytest.mark.parametrize("name", IDS)
def test_paths_exist(name):
    c = BY_NAME[name]
    assert os.path.isdir(os.path.join(ROOT, c["path"]))
    for step in c["steps"]:
        for rank in c["ranks"]:
            d = _rank_dir(c, step, rank)
            for fn in ("dump.json", "stack.json", "construct.json"):
                assert os.path.isfile(os.path.join(d, fn)), os.path.join(d, fn)


@pytest.mark.parametrize("name", IDS)
def test_dump_json_parses(name):
    c = BY_NAME[name]
    for step in c["steps"]:
        for rank in c["ranks"]:
            dump = _dump(c, step, rank)
            assert dump["task"] == c["mode"]
            assert dump["level"] == "mix"
            assert dump["framework"] == "pytorch"
            assert isinstance(dump["data"], dict) and dump["data"]
            for fn in ("stack.json", "construct.json"):
                with open(os.path.join(_rank_dir(c, step, rank), fn)) as f:
                    json.load(f)


def test_overflow_cases_contain_non_finite_tokens():
    for name in ("overflow_stats", "saturation_stats"):
        c = BY_NAME[name]
        with open(os.path.join(_rank_dir(c, 0, 0), "dump.json")) as f:
            text = f.read()
        assert "NaN" in text and "Infinity" in text
        stats = [l.get("Max") for l in leaves(_dump(c, 0, 0)["data"])]
        assert any(isinstance(v, float) and (math.isnan(v) or math.isinf(v)) for v in stats)


@pytest.mark.parametrize("name", IDS)
def test_ref_cases_have_no_expectations(name):
    c = BY_NAME[name]
    if c["ref"] is None:
        assert c["expected"] is None
    else:
        assert isinstance(c["expected"], dict)
        assert c["expected"]["first_divergence"] is not None


def _check_op(c, where, side_case=None):
    case = side_case or c
    assert where["step"] in case["steps"] and where["rank"] in case["ranks"]
    data = _dump(case, where["step"], where["rank"])["data"]
    assert where["op"] in data, (case["name"], where)


@pytest.mark.parametrize("name", [n for n in IDS if BY_NAME[n]["ref"] is not None])
def test_expected_ops_are_dump_keys(name):
    c = BY_NAME[name]
    ref = BY_NAME[c["ref"]]
    e = c["expected"]
    _check_op(c, e["first_divergence"])
    cul = e.get("culprit")
    if cul is not None:
        assert cul["kind"] in CULPRIT_KINDS
        _check_op(c, cul, ref if cul.get("side") == "ref" else None)
    ov = e.get("first_overflow")
    if ov is not None:
        assert ov["kind"] in OVERFLOW_KINDS
        _check_op(c, ov)
    if "first_model_divergence" in e:
        _check_op(c, e["first_model_divergence"])
    sa = e.get("scalar_argument")
    if sa is not None:
        step = cul["step"] if cul else 0
        rank = cul["rank"] if cul else 0
        assert sa["op"] in _dump(c, step, rank)["data"]
        assert sa["name"].startswith(sa["op"] + ".input.")
    for key in e.get("missing_in_target", []):
        assert key in _dump(ref, 0, 0)["data"]
        assert key not in _dump(c, 0, 0)["data"]


@pytest.mark.parametrize("name", [n for n in IDS if BY_NAME[n]["mode"] == "tensor"])
def test_tensor_cases_have_pt_files(name):
    c = BY_NAME[name]
    for step in c["steps"]:
        for rank in c["ranks"]:
            d = _rank_dir(c, step, rank)
            names = [
                l["data_name"] for l in leaves(_dump(c, step, rank)["data"]) if isinstance(l, dict) and "data_name" in l
            ]
            assert names, d
            for n in names:
                assert n.endswith(".pt")
                assert os.path.isfile(os.path.join(d, "dump_tensor_data", n)), n


@pytest.mark.parametrize("name", [n for n in IDS if BY_NAME[n]["mode"] == "statistics"])
def test_statistics_cases_have_no_tensor_files(name):
    c = BY_NAME[name]
    for step in c["steps"]:
        for rank in c["ranks"]:
            assert not os.path.exists(os.path.join(_rank_dir(c, step, rank), "dump_tensor_data"))

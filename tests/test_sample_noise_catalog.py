"""Consistency of catalog.json's device_noise_cases (issue 11) with their bundled msprobe dumps.

No dumpstore, torch or msprobe import.  The verdicts themselves are tested elsewhere; this checks that every
declared answer points at something that exists: cases, steps, records, arguments, tensor files.
"""

import json
import os

import pytest

from helpers import leaves

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "sample_dumps")
with open(os.path.join(ROOT, "catalog.json")) as _f:
    CASES = json.load(_f).get("device_noise_cases", [])
BY_NAME = {c["name"]: c for c in CASES}
PAIRS = [c["name"] for c in CASES if c["ref"]]
CULPRIT_KINDS = {"parameter", "scalar", "missing_or_extra", "optimizer"}
_DUMPS = {}


def _dir(case, step, rank=0):
    return os.path.join(ROOT, case["path"], "step%d" % step, "rank%d" % rank)


def _data(case, step, rank=0):
    key = (case["name"], step, rank)
    if key not in _DUMPS:
        with open(os.path.join(_dir(case, step, rank), "dump.json")) as f:
            _DUMPS[key] = json.load(f)
    return _DUMPS[key]["data"]


def test_cases_present_in_both_modes():
    assert {c["mode"] for c in CASES} == {"statistics", "tensor"}
    stats = {c["name"][: -len("_stats")] for c in CASES if c["mode"] == "statistics"}
    assert {
        "xdev_ref",
        "xdev_clean",
        "xdev_clean2",
        "xdev_weight5pct",
        "xdev_no_mask",
        "xdev_ln_eps",
        "xdev_gelu_tanh",
        "xdev_lr",
    } == stats
    assert len(BY_NAME) == len(CASES)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_refs_and_steps(name):
    c = BY_NAME[name]
    assert c["steps"] == list(range(len(c["steps"]))) and c["ranks"] == [0]
    if c["ref"] is None:
        assert c["expected"] is None and c["kernels"] is None
        return
    ref = BY_NAME[c["ref"]]
    assert ref["ref"] is None and ref["mode"] == c["mode"] and ref["steps"] == c["steps"]
    assert set(c["kernels"]) == {"chunk", "reverse"}
    for step in c["steps"]:
        dump = _data(c, step)
        assert dump and all(
            os.path.isfile(os.path.join(_dir(c, step), fn)) for fn in ("dump.json", "stack.json", "construct.json")
        )
    assert not os.path.exists(os.path.join(_dir(c, len(c["steps"])), "dump.json"))


@pytest.mark.parametrize("name", PAIRS)
def test_same_records_as_the_ref(name):
    """Device B's kernels change no record: same names in the same order, but for the declared missing ones."""
    c = BY_NAME[name]
    ref = BY_NAME[c["ref"]]
    missing = c["expected"].get("missing_in_target", [])
    for step in c["steps"]:
        assert list(_data(c, step)) == [k for k in _data(ref, step) if k not in missing]


@pytest.mark.parametrize("name", PAIRS)
def test_expected_ops_exist(name):
    c = BY_NAME[name]
    ref = BY_NAME[c["ref"]]
    e = c["expected"]
    fd = e["first_divergence"]
    assert fd["step"] in c["steps"] and fd["op"] in _data(c, fd["step"])
    cul = e["culprit"]
    if "clean" in name:
        assert cul is None
        return
    assert cul["kind"] in CULPRIT_KINDS and cul["step"] in c["steps"] and cul["rank"] == 0
    side = ref if cul.get("side") == "ref" else c
    assert cul["op"] in _data(side, cul["step"])
    if cul.get("side") == "ref":
        assert cul["op"] not in _data(c, cul["step"])
    assert e["against_clean"]["case"] in BY_NAME
    assert e["against_clean"]["first_difference"]["op"] in _data(c, e["against_clean"]["first_difference"]["step"])


@pytest.mark.parametrize("name", [n for n in PAIRS if BY_NAME[n]["expected"].get("scalar_argument")])
def test_scalar_arguments_are_in_the_dumps(name):
    c = BY_NAME[name]
    sa = c["expected"]["scalar_argument"]
    assert sa["op"] == c["expected"]["culprit"]["op"]
    arg = sa["name"][len(sa["op"] + ".input.") :]
    rec, ref_rec = _data(c, 0)[sa["op"]], _data(BY_NAME[c["ref"]], 0)[sa["op"]]
    if arg.isdigit():
        assert rec["input_args"][int(arg)]["value"] == sa["value"]
        assert ref_rec["input_args"][int(arg)]["value"] == sa["ref_value"]
    else:
        assert rec["input_kwargs"][arg]["value"] == sa["value"]
        assert arg not in ref_rec["input_kwargs"] and sa["ref_value"] is None


def test_optimizer_case_agrees_at_step_zero_with_the_clean_run():
    for mode in ("stats", "tensor"):
        lr, clean = BY_NAME["xdev_lr_" + mode], BY_NAME["xdev_clean_" + mode]
        assert lr["expected"]["culprit"]["kind"] == "optimizer" and lr["expected"]["culprit"]["step"] == 1
        assert _data(lr, 0) == _data(clean, 0)
        assert _data(lr, 1) != _data(clean, 1)


@pytest.mark.parametrize("name", [n for n in BY_NAME if BY_NAME[n]["mode"] == "tensor"])
def test_tensor_cases_have_pt_files(name):
    c = BY_NAME[name]
    for step in c["steps"]:
        names = [leaf["data_name"] for leaf in leaves(_data(c, step)) if "data_name" in leaf]
        assert names
        for n in names:
            assert os.path.isfile(os.path.join(_dir(c, step), "dump_tensor_data", n)), n

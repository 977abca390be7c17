"""msprobe's own test data (tests/data/mstt, see its README): every dump is ingested exactly or refused as msprobe
refuses it; record shapes of a real debug.json; framework detection; md5 fields as msprobe prints them."""

from __future__ import annotations

import json

import pytest

from dumpstore._ingest import ingest
from dumpstore.errors import DumpFormatError
from dumpstore.framework import detect_framework
from dumpstore.query import run_query
from dumpstore.store import open_store
from helpers import DATA, count_leaves

MSTT = DATA / "mstt"
_NO_DATA = "expected an object with a 'data' object of records"

# folder -> how it must come out: "exact" (rows = leaves counted independently, no error),
# ("refused", text of the one-line error; msprobe 26.2.0 compare refuses these too: "Missing 'data' in
# dump.json"), or ("error_rows", n): records that are not objects kept as n error rows, named, so nothing is lost
# silently (msprobe refuses the whole file: "Task for npu is empty"; dumpstore keeps a bad record as an error row,
# as for any dump, see test_bad_input.py).
EXPECTED: dict[str, object] = {
    "layer_mapping_ut/mindspore_data": "exact",
    "layer_mapping_ut/pytorch_data": "exact",
    "layer_mapping_res/mindspore": "exact",
    "layer_mapping_res/pytorch": "exact",
    "generated/debug_save": "exact",
    "code_built/ms_compare_npu": "exact",
    "code_built/ms_compare_bench": "exact",
    "code_built/ms_compare_empty": "exact",
    "code_built/acc_compare_md5_int": "exact",
    "code_built/acc_compare_stats": ("missing_file", 1),  # statistics leaf naming a .pt the test never wrote
    "visualization/input_format_correct": "exact",
    "visualization/input/step0/rank0": "exact",
    "common/test_backward": ("error_rows", 2),
    "common/test_no_fb_data": ("error_rows", 1),
    "common/test_no_dump_data": ("refused", _NO_DATA),
    "no_framework/ms": ("refused", _NO_DATA),
    "no_framework/pt": ("refused", _NO_DATA),
    "no_framework/neither": ("refused", _NO_DATA),
    "visualization/builder": ("refused", _NO_DATA),
    "visualization/input/step0/rank1": ("refused", _NO_DATA),
    "visualization/input/step1": ("refused", "appears twice"),  # step1/rank0 and step1/step1 are both rank 0
}


def _dump_jsons(folder):
    return sorted(p for p in folder.rglob("*.json") if p.name in ("dump.json", "debug.json"))


def test_every_fixture_is_classified():
    covered = set()
    for rel in EXPECTED:
        covered |= set(_dump_jsons(MSTT / rel))
    assert set(_dump_jsons(MSTT)) == covered


@pytest.mark.parametrize("rel", sorted(EXPECTED), ids=str)
def test_fixture_ingested_exactly_or_refused(rel, store_dir):
    folder, want = MSTT / rel, EXPECTED[rel]
    if isinstance(want, tuple) and want[0] == "refused":
        with pytest.raises(DumpFormatError) as err:
            ingest(folder, "r", store=store_dir, jobs=1)
        assert want[1] in str(err.value) and "\n" not in str(err.value)
        return
    res = ingest(folder, "r", store=store_dir, jobs=1)
    rows = run_query(open_store(store_dir), "select kind, error from tensors where run='r'").to_pylist()
    assert res.rows == len(rows)
    if want == "exact" or want[0] == "missing_file":
        assert res.rows == sum(count_leaves(json.loads(p.read_text())) for p in _dump_jsons(folder))
        assert res.errors == (0 if want == "exact" else want[1])
        if want != "exact":
            assert "is missing" in res.first_error
    else:  # error rows: one per record that is not an object
        assert res.errors == res.rows == want[1]
        assert all(r["kind"] == "error" and "expected an object" in r["error"] for r in rows)


def test_debug_json_list_bare_and_null_records(store_dir):
    """A real 26.2.0 debug.json: save(list) writes a list record, save(tensor) a bare leaf, its grad null."""
    ingest(MSTT / "generated/debug_save", "d", store=store_dir, jobs=1)
    got = run_query(open_store(store_dir), "select name, kind, shape from tensors where run='d' order by leaf")
    rows = [(r["name"], r["kind"], r["shape"]) for r in got.to_pylist()]
    assert rows[:4] == [
        ("pair_list.0.debug.0", "tensor", [5, 2]),
        ("pair_list.0.debug.1", "tensor", []),
        ("pair_list_grad.0.debug.0", "null", None),
        ("pair_list_grad.0.debug.1", "null", None),
    ]
    assert [r[0] for r in rows[4:9]] == [
        "nested.0.debug.x.0",
        "nested.0.debug.x.1.k",
        "nested.0.debug.s",
        "nested.0.debug.t.0",
        "nested.0.debug.t.1",
    ]
    assert rows[-2:] == [("bare.0.debug", "tensor", []), ("bare_grad.0.debug", "null", None)]


@pytest.mark.parametrize(
    "rel, framework", [("no_framework/ms", "mindspore"), ("no_framework/pt", "pytorch"), ("no_framework/neither", None)]
)
def test_detect_framework_as_msprobe(rel, framework):
    """msprobe's own expectations (core_ut/common/test_utils.py): ms, pt, and an error (None here)."""
    assert detect_framework(json.loads((MSTT / rel / "dump.json").read_text())) == framework


def test_framework_field_wins_and_leaves_decide_without_it():
    assert detect_framework({"framework": "pytorch", "data": {"a": {"type": "mindspore.Tensor"}}}) == "pytorch"
    assert (
        detect_framework(
            {"data": {"a": {"input_args": [{"type": "int", "value": 1}, {"type": "torch.Size", "value": [2]}]}}}
        )
        == "pytorch"
    )


def test_catalog_framework_detected_from_leaves(store_dir):
    """ms_compare_npu has no framework field; its leaves are mindspore.Tensor."""
    ingest(MSTT / "code_built/ms_compare_npu", "m", store=store_dir, jobs=1)
    ingest(MSTT / "code_built/ms_compare_bench", "p", store=store_dir, jobs=1)
    got = run_query(open_store(store_dir), "select run, framework from runs order by run").to_pylist()
    assert got == [{"run": "m", "framework": "mindspore"}, {"run": "p", "framework": "pytorch"}]


def test_md5_integer_kept_and_empty_md5_not_a_checksum(store_dir):
    ingest(MSTT / "code_built/acc_compare_md5_int", "i", store=store_dir, jobs=1)
    ingest(MSTT / "code_built/ms_compare_npu", "e", store=store_dir, jobs=1)
    got = run_query(open_store(store_dir), "select run, checksum, checksum_kind from tensors order by run, leaf")
    assert got.to_pylist() == [{"run": "e", "checksum": None, "checksum_kind": None}] * 2 + [
        {"run": "i", "checksum": "123456", "checksum_kind": "crc32"}
    ]

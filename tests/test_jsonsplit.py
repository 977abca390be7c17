"""A dump.json cut as text (dumpstore/jsonsplit.py), and the ingest that parses the parts in several processes.

The parts of a cut must parse to exactly the whole file's records, in order; text that is not laid out as msprobe
writes it, or that a cut would change (members after "data", a record name in two parts), is parsed whole, and
the ingest's rows are those of the one-process build in every case.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ujson

from dumpstore import jsonsplit
from dumpstore._ingest import ingest
from dumpstore.errors import DumpFormatError
from dumpstore.framework import detect_framework
from dumpstore.store import open_store
from helpers import SAMPLES, child_processes

split = importlib.import_module("dumpstore._ingest.split")  # modules of the package (dumpstore.ingest: the function)
unit = importlib.import_module("dumpstore._ingest.unit")
DUMP = SAMPLES / "ref_stats" / "step0" / "rank0" / "dump.json"


def _records(text: bytes, parts: int) -> list | None:
    """The records of every part of a cut, in order (None where a part does not parse as required)."""
    cut = jsonsplit.cuts(text, parts)
    assert cut is not None
    out = []
    for i in range(cut.parts):
        got = jsonsplit.records_of(ujson.loads(jsonsplit.part(text, cut, i)), i)
        if got is None:
            return None
        out += list(got.items())
    return out


@pytest.mark.parametrize("parts", [2, 3, 5, 16])
def test_parts_hold_the_records_of_the_whole_file_in_order(parts):
    text = DUMP.read_bytes()
    doc = json.loads(text)
    cut = jsonsplit.cuts(text, parts)
    assert cut is not None and 2 <= cut.parts <= parts
    assert repr(_records(text, parts)) == repr(list(doc["data"].items()))
    preamble = json.loads(jsonsplit.preamble(text, cut))
    assert preamble == {k: v for k, v in doc.items() if k != "data"} | {"data": {}}


def test_text_laid_out_otherwise_is_not_cut():
    doc = json.loads(DUMP.read_bytes())
    for text in (json.dumps(doc), json.dumps(doc, indent=4), json.dumps(doc, indent=1) + "\n,", "{}", ""):
        assert jsonsplit.cuts(text.encode(), 2) is None
    assert jsonsplit.cuts(json.dumps(doc, indent=1).encode(), 1) is None


def test_a_line_break_in_a_string_cannot_fake_a_record_end():
    doc = json.loads(DUMP.read_bytes())
    fake = '\n  },\n  "Functional.fake.0.forward": {\n'
    for record in list(doc["data"].values())[::3]:
        record["note"] = fake  # written escaped ("\\n"): no raw line break inside a string
    text = json.dumps(doc, indent=1).encode()
    assert repr(_records(text, 4)) == repr(list(doc["data"].items()))


def test_a_cut_outside_data_is_refused():
    """Members after "data" (msprobe writes none) that look like records: the cut is found but proven wrong."""
    doc = json.loads(DUMP.read_bytes())
    doc["after"] = {f"k{i}": {"v": i} for i in range(100 * len(doc["data"]))}  # most of the text
    text = json.dumps(doc, indent=1).encode()
    cut = jsonsplit.cuts(text, 2)
    assert cut is not None and cut.ends[0] > text.index(b'\n "after"')
    assert jsonsplit.records_of(ujson.loads(jsonsplit.part(text, cut, 0)), 0) is None


def test_members_after_data_fail_the_last_part():
    doc = json.loads(DUMP.read_bytes())
    doc["more"] = 1
    text = json.dumps(doc, indent=1).encode()
    with pytest.raises(ValueError):
        ujson.loads(jsonsplit.part(text, jsonsplit.cuts(text, 2), 1))


# ---------------------------------------------------------------------------------------------------- the ingest
def _dump_folder(tmp_path: Path, text: bytes | str) -> Path:
    folder = tmp_path / "dump" / "step0" / "rank0"
    shutil.copytree(DUMP.parent, folder)
    (folder / "dump.json").write_bytes(text.encode() if isinstance(text, str) else text)
    return folder


def _rows(store: Path) -> str:
    [path] = sorted((store / "tensors").rglob("*.parquet"))
    return repr(pq.read_table(path).drop(["ingest_id"]).to_pylist())  # repr: NaN statistics compare equal


def _split_ingest(src: Path, store: Path, monkeypatch, jobs: int = 2):
    """Ingest `src` with the text split on for any size; (result, whether the text split built the rows)."""
    monkeypatch.setattr(unit, "_SPLIT_MIN_BYTES", 1)
    monkeypatch.setattr(unit, "_SPLIT_MIN_RECORDS", 10**9)  # no split of parsed records instead
    used = []
    real = unit._text_split
    monkeypatch.setattr(unit, "_text_split", lambda *a: used.append(real(*a)) or used[-1])
    res = ingest(src, "r", store=store, jobs=jobs)
    return res, [u is not None for u in used]


def _same_as_one_process(src: Path, tmp_path: Path, monkeypatch, jobs: int = 2) -> list[bool]:
    one = ingest(src, "r", store=tmp_path / "one", jobs=1)
    two, used = _split_ingest(src, tmp_path / "two", monkeypatch, jobs)
    drop = ("ingest_id",)
    assert {k: v for k, v in vars(one).items() if k not in drop} == {
        k: v for k, v in vars(two).items() if k not in drop
    }
    assert _rows(tmp_path / "one") == _rows(tmp_path / "two")
    catalogs = [open_store(tmp_path / s).run_info("r") for s in ("one", "two")]
    assert [{k: v for k, v in c.items() if k not in ("ingest_id", "created_at")} for c in catalogs] == [
        {k: v for k, v in catalogs[0].items() if k not in ("ingest_id", "created_at")}
    ] * 2  # framework, task, level, generation ...
    return used


@pytest.mark.parametrize("name", ["ref_stats", "overflow_stats", "xdev_ref_stats"])
def test_a_dump_parsed_in_parts_gives_the_same_rows(tmp_path, monkeypatch, name):
    assert _same_as_one_process(SAMPLES / name / "step0" / "rank0", tmp_path, monkeypatch) == [True]


def test_a_dump_parsed_in_many_parts_gives_the_same_rows(tmp_path, monkeypatch):
    src = SAMPLES / "ref_stats" / "step0" / "rank0"
    assert _same_as_one_process(src, tmp_path, monkeypatch, jobs=5) == [True]
    assert len(jsonsplit.cuts(DUMP.read_bytes(), 5).ends) == 4


def test_a_record_name_in_two_parts_is_parsed_whole(tmp_path, monkeypatch):
    """A duplicate key: the whole file keeps the first place and the last value; the parts would keep both."""
    text = DUMP.read_text()
    first = next(iter(json.loads(text)["data"]))
    last_start = text.rindex('\n  "')
    text = text[:last_start] + f'\n  "{first}"' + text[text.index('"', last_start + 4) + 1 :]
    assert len(json.loads(text)["data"]) == len(json.loads(DUMP.read_text())["data"]) - 1
    assert _same_as_one_process(_dump_folder(tmp_path, text), tmp_path, monkeypatch) == [False]


def test_members_after_data_are_parsed_whole(tmp_path, monkeypatch):
    """The task written again after "data" (the whole file takes the last value): the last part does not parse."""
    doc = json.loads(DUMP.read_bytes())
    text = json.dumps(doc, indent=1)[:-2] + ',\n "task": "tensor"\n}'
    assert json.loads(text)["task"] == "tensor"
    assert _same_as_one_process(_dump_folder(tmp_path, text), tmp_path, monkeypatch) == [False]


def test_the_framework_found_in_a_later_part(tmp_path, monkeypatch):
    """A dump without a framework member whose first records have no typed value: the framework is the first
    framework-typed value of the file, found by a later part."""
    doc = json.loads(DUMP.read_bytes())
    del doc["framework"]
    names = list(doc["data"])
    for name in names[: len(names) // 4]:  # most of the text: the cut falls after them
        doc["data"][name] = {"input_args": [None] * 400, "output": [None]}
    text = json.dumps(doc, indent=1)
    cut = jsonsplit.cuts(text.encode(), 2)
    assert detect_framework(json.loads(jsonsplit.part(text.encode(), cut, 0))) is None
    assert _same_as_one_process(_dump_folder(tmp_path, text), tmp_path, monkeypatch) == [True]
    assert open_store(tmp_path / "two").run_info("r")["framework"] == "pytorch"


def test_a_broken_file_has_the_whole_file_error(tmp_path, monkeypatch):
    text = DUMP.read_text()
    cut = len(text) * 3 // 4
    src = _dump_folder(tmp_path, text[:cut])  # truncated: the last part does not parse
    with pytest.raises(DumpFormatError) as one:
        ingest(src, "r", store=tmp_path / "one", jobs=1)
    with pytest.raises(DumpFormatError) as two:
        _split_ingest(src, tmp_path / "two", monkeypatch)
    assert str(two.value) == str(one.value) and "invalid JSON at line" in str(one.value)


@pytest.mark.parametrize("in_child", [False, True])
def test_a_failing_part_fails_the_ingest_and_leaves_no_child(tmp_path, monkeypatch, in_child):
    parent = os.getpid()
    table = split._Slices.table

    def broken(self, part, parts):
        if (os.getpid() != parent) == in_child:
            raise DumpFormatError("this part is broken")
        return table(self, part, parts)

    monkeypatch.setattr(split._Slices, "table", broken)
    before = child_processes()
    with pytest.raises(DumpFormatError, match="^this part is broken$"):
        _split_ingest(DUMP.parent, tmp_path / "s", monkeypatch)
    assert not list((tmp_path / "s").rglob("part-*.parquet"))
    assert child_processes() == before

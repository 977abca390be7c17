"""Malformed input through the CLI: a one-line `Error: ...` naming the file and exit 1, or, where the run can
still be ingested, every leaf stored (the bad ones with an error and file_status) and a warning."""

from __future__ import annotations

import json
import os
import pickle
import signal
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from dumpstore._ingest import ingest
from dumpstore.cli.main import main
from dumpstore.errors import DumpstoreWarning, StoreError
from helpers import count_leaves

LINEAR = "Functional.linear.0.forward"
RELU = "Functional.relu.0.forward"


# ----------------------------------------------------------------------------------------------- helpers


def cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_error(result: Result, *needles: object) -> str:
    """Exit 1 with exactly one line `Error: ...` that names each needle; no traceback, no crash."""
    out = result.output
    assert result.exit_code == 1, out
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in out
    assert out.startswith("Error: "), out
    assert out.rstrip("\n").count("\n") == 0, out
    for needle in needles:
        assert str(needle) in out, (needle, out)
    return out


def good_dump(dump_writer) -> Path:
    """A valid tensor dump with 5 leaves (4 tensors with .npy files, 1 int); returns its dump.json."""
    w = dump_writer()
    return w.write(
        {
            LINEAR: {
                "input_args": [np.arange(6, dtype=np.float32).reshape(2, 3), {"type": "int", "value": 3}],
                "output": [np.ones(3, np.float32)],
            },
            RELU: {"input_args": [np.array([-1.0, 2.0], np.float32)], "output": [np.array([0.0, 2.0], np.float32)]},
        }
    )


def mutate(dump_json: Path, fn: Callable[[dict], Any]) -> dict:
    doc = json.loads(dump_json.read_text())
    fn(doc)
    dump_json.write_text(json.dumps(doc, indent=1))
    return doc


def relu_in(doc: dict) -> dict:
    return doc["data"][RELU]["input_args"][0]


def tensor_dir(dump_json: Path) -> Path:
    return dump_json.parent / "dump_tensor_data"


def q(store: Path, sql: str) -> list[dict]:
    res = cli("query", sql, "--store", store, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def run_info(store: Path, run: str) -> dict:
    res = cli("runs", "--store", store, "--json")
    assert res.exit_code == 0, res.output
    return next(r for r in json.loads(res.stdout) if r["run"] == run)


def ingest_with_errors(path: Path, store: Path, n_leaves: int, n_bad: int, run: str = "r") -> list[dict]:
    """Ingest succeeds with a warning; all leaves stored; n_errors counts the bad ones. Returns the error rows."""
    res = cli("ingest", path, "--run", run, "--store", store, "-j", "1")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    assert f"warning: {n_bad} leaves could not be read fully" in res.stderr
    assert q(store, f"select count(*) n from tensors where run='{run}'") == [{"n": n_leaves}]
    info = run_info(store, run)
    assert (info["n_rows"], info["n_errors"]) == (n_leaves, n_bad)
    bad = q(store, f"select * from tensors where run='{run}' and error is not null order by leaf")
    assert len(bad) == n_bad
    for row in bad:
        assert "\n" not in row["error"]
    return bad


def save_npy_file(path: Path, values: np.ndarray) -> Path:
    np.save(path, values)
    return path


# --------------------------------------------------------------------------------- fatal: whole-file errors


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(None, id="truncated"),
        pytest.param("{nope", id="invalid-json"),
        pytest.param("[1, 2, 3]", id="json-list"),
        pytest.param('{"task": "tensor", "data": [1]}', id="data-not-object"),
        pytest.param('{"task": "tensor", "data": "x"}', id="data-string"),
        pytest.param('{"task": "tensor", "level": "L1"}', id="no-data"),
        pytest.param('{"data": {"Functional.a.0.forward": {"input_args": [' + "9" * 5000 + "]}}}", id="int-too-long"),
        pytest.param("", id="empty-file"),
    ],
)
def test_unreadable_dump_json(dump_writer, store_dir, text):
    dump_json = good_dump(dump_writer)
    full = dump_json.read_text()
    dump_json.write_text(full[: len(full) // 2] if text is None else text)
    assert_error(cli("ingest", dump_json.parent.parent.parent, "--run", "r", "--store", store_dir), dump_json)


def test_not_utf8_dump_json(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    dump_json.write_bytes(b'{"data": {"\xff\xfe": 1}}')
    assert_error(cli("ingest", dump_json, "--run", "r", "--store", store_dir), dump_json, "UTF-8")


def test_bad_rank_in_parallel_ingest_keeps_earlier_run(dump_writer, store_dir):
    """One broken rank of two fails the ingest (also from worker processes); the live run is untouched."""
    w = dump_writer()
    ok = w.write({LINEAR: {"input_args": [np.ones(3, np.float32)]}}, rank=0)
    bad = w.write({LINEAR: {"input_args": [np.ones(3, np.float32)]}}, rank=1)
    assert cli("ingest", w.root, "--run", "r", "--store", store_dir, "-j", "2").exit_code == 0
    bad.write_text(bad.read_text()[:40])
    assert_error(cli("ingest", w.root, "--run", "r", "--store", store_dir, "-j", "2"), bad)
    assert q(store_dir, "select rank, count(*) n from tensors where run='r' group by rank order by rank") == [
        {"rank": 0, "n": 1},
        {"rank": 1, "n": 1},
    ]
    assert ok.exists()


def test_empty_folder(tmp_path, store_dir):
    (tmp_path / "empty").mkdir()
    assert_error(cli("ingest", tmp_path / "empty", "--run", "r", "--store", store_dir), tmp_path / "empty")


def test_non_dump_file_as_path(tmp_path, store_dir):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    assert_error(cli("ingest", f, "--run", "r", "--store", store_dir), f, "not a dump file")


def test_nonexistent_path(tmp_path, store_dir):
    assert_error(cli("ingest", tmp_path / "nope", "--run", "r", "--store", store_dir), tmp_path / "nope")


@pytest.mark.parametrize("run", ["a/b", "..", "../escape", "/abs", "x" * 200, "", "a b"])
def test_bad_run_name(dump_writer, store_dir, tmp_path, run):
    dump_json = good_dump(dump_writer)
    assert_error(cli("ingest", dump_json, "--run", run, "--store", store_dir), "run name", repr(run))
    assert not store_dir.exists()  # refused before anything is written
    assert not (tmp_path / "escape").exists()


def test_store_is_a_file_library(dump_writer, tmp_path):
    f = tmp_path / "store_file"
    f.write_text("x")
    with pytest.raises(StoreError, match=str(f)):
        ingest(good_dump(dump_writer), "r", store=f)


def test_store_is_a_file_cli(dump_writer, tmp_path):
    f = tmp_path / "store_file"
    f.write_text("x")
    assert_error(cli("ingest", good_dump(dump_writer), "--run", "r", "--store", f), f)


def test_query_store_that_does_not_exist(tmp_path):
    assert_error(cli("query", "select 1", "--store", tmp_path / "nostore"), tmp_path / "nostore")
    assert not (tmp_path / "nostore").exists()


@pytest.mark.parametrize(
    "sql", ["selec 1", "select * from no_such_table", "select 1; select 2", "select 'unterminated"]
)
def test_invalid_sql(dump_writer, store_dir, sql):
    assert cli("ingest", good_dump(dump_writer), "--run", "r", "--store", store_dir).exit_code == 0
    assert_error(cli("query", sql, "--store", store_dir))


# ------------------------------------------------------------------ run still ingested: rows with an error


def test_record_that_is_a_string(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    doc = mutate(dump_json, lambda d: d["data"].__setitem__("Functional.gelu.0.forward", "not a record"))
    good = count_leaves({"data": {k: v for k, v in doc["data"].items() if isinstance(v, dict)}})
    [bad] = ingest_with_errors(dump_json, store_dir, good + 1, 1)
    assert (bad["record"], bad["kind"], bad["file_status"]) == ("Functional.gelu.0.forward", "error", "none")
    assert "record is str" in bad["error"]


def test_leaf_with_bad_shape(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("shape", "abc"))
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    assert bad["name"] == f"{RELU}.input.0" and bad["kind"] == "tensor" and bad["file_status"] is not None
    assert "invalid shape 'abc'" in bad["error"] and bad["shape"] is None


def test_json_numbers_out_of_column_range(dump_writer, store_dir):
    """Huge call counters, statistics and dims are stored (null / inf / error row), not a crash."""
    dump_json = good_dump(dump_writer)
    huge = "Functional.linear.99999999999999.forward"

    def edit(d: dict) -> None:
        d["data"][huge] = d["data"].pop(LINEAR)
        relu_in(d)["Max"] = 10**400
        d["data"][RELU]["output"][0]["shape"] = [2**40, 2**40]
        d["data"][huge]["input_args"][1]["value"] = -(10**400)

    doc = mutate(dump_json, edit)
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    assert bad["name"] == f"{RELU}.output.0" and "does not fit in int64" in bad["error"]
    rows = {r["name"]: r for r in q(store_dir, "select name, call, dump_max, scalar_value from tensors")}
    assert rows[f"{huge}.input.0"]["call"] is None
    relu, arg = rows[f"{RELU}.input.0"], rows[f"{huge}.input.1"]  # JSON: a non-finite number is null + its status
    assert (relu["dump_max"], relu["dump_max_nonfinite"]) == (None, "inf")
    assert (arg["scalar_value"], arg["scalar_value_nonfinite"]) == (None, "-inf")


@pytest.mark.parametrize("data_name", ["../outside.npy", "/ABS/outside.npy", "sub/../../outside.npy", "..", ""])
def test_data_name_leaving_the_folder_is_not_read(dump_writer, store_dir, tmp_path, data_name):
    dump_json = good_dump(dump_writer)
    outside = save_npy_file(dump_json.parent / "outside.npy", np.array([1e6, 1e6], np.float32))
    name = data_name.replace("/ABS/outside.npy", str(outside))
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("data_name", name))
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    if not name:  # an empty data_name names no file: an error row (issue 13), keeping the dumper's statistics
        assert bad["file_status"] == "error" and bad["error"].startswith('data_name "" is not a file name')
        assert bad["stats_source"] == "dump" and bad["max"] == 2.0
        return
    assert bad["name"] == f"{RELU}.input.0" and bad["file_status"] == "error"
    assert repr(name) in bad["error"] and "not a plain file name" in bad["error"]
    assert bad["stats_source"] == "dump" and bad["max"] == 2.0  # the dumper's Max, not 1e6 from outside


def test_symlink_in_tensor_dir_is_not_read(dump_writer, store_dir, tmp_path):
    dump_json = good_dump(dump_writer)
    outside = save_npy_file(tmp_path / "secret.npy", np.array([1e6, 1e6], np.float32))
    link = tensor_dir(dump_json) / f"{RELU}.input.0.npy"
    link.unlink()
    link.symlink_to(outside)
    doc = json.loads(dump_json.read_text())
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    assert bad["file_status"] == "error" and str(link) in bad["error"] and "link" in bad["error"]
    assert bad["stats_source"] == "dump" and bad["max"] == 2.0


def test_linked_tensor_dir_leading_outside_is_not_read(dump_writer, store_dir, tmp_path):
    dump_json = good_dump(dump_writer)
    elsewhere = tmp_path / "elsewhere"
    tensor_dir(dump_json).rename(elsewhere)
    tensor_dir(dump_json).symlink_to(elsewhere, target_is_directory=True)
    doc = json.loads(dump_json.read_text())
    bad = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 4)
    assert {r["file_status"] for r in bad} == {"error"} and all("outside" in r["error"] for r in bad)


def test_missing_tensor_file(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    gone = tensor_dir(dump_json) / f"{RELU}.input.0.npy"
    gone.unlink()
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(json.loads(dump_json.read_text())), 1)
    assert bad["file_status"] == "missing" and str(gone) in bad["error"]


def test_corrupt_pt_and_truncated_npy(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    npy = tensor_dir(dump_json) / f"{RELU}.output.0.npy"
    npy.write_bytes(npy.read_bytes()[:-3])
    pt = tensor_dir(dump_json) / f"{RELU}.input.0.pt"
    pt.write_bytes(np.random.default_rng(0).bytes(500))
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("data_name", pt.name))
    bad = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 2)
    assert [r["name"] for r in bad] == [f"{RELU}.input.0", f"{RELU}.output.0"]
    assert [r["file_status"] for r in bad] == ["error", "error"]
    assert str(pt) in bad[0]["error"] and str(npy) in bad[1]["error"]


@pytest.mark.parametrize("cut", [0, 5, 60, 127, 128, 130])
def test_npy_cut_anywhere_is_an_error_row(dump_writer, store_dir, cut):
    dump_json = good_dump(dump_writer)
    npy = tensor_dir(dump_json) / f"{RELU}.output.0.npy"
    npy.write_bytes(npy.read_bytes()[:cut])
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(json.loads(dump_json.read_text())), 1)
    assert bad["file_status"] == "error" and str(npy) in bad["error"]


def test_tensor_file_shape_disagrees(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    doc = mutate(dump_json, lambda d: d["data"][LINEAR]["input_args"][0].__setitem__("shape", [3, 2]))
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    assert bad["name"] == f"{LINEAR}.input.0" and bad["file_status"] == "error"
    assert "shape [2, 3] but dump.json says [3, 2]" in bad["error"] and f"{LINEAR}.input.0.npy" in bad["error"]


def test_fifo_tensor_file_does_not_hang(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    fifo = tensor_dir(dump_json) / f"{RELU}.input.0.npy"
    fifo.unlink()
    os.mkfifo(fifo)

    def alarm(*_: object) -> None:
        raise TimeoutError("ingest blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    try:
        [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(json.loads(dump_json.read_text())), 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert bad["file_status"] == "error" and "not a regular file" in bad["error"]


class _Evil:
    """Unpickling calls exec(), which creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _evil_zip(path: Path, marker: Path) -> None:
    """A torch.save-shaped zip whose data.pkl runs code when unpickled."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Evil(marker), protocol=2))
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


def _evil_torch(path: Path, marker: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({"t": torch.ones(2), "payload": _Evil(marker)}, path)


@pytest.mark.parametrize("make", [_evil_zip, _evil_torch], ids=["zip", "torch.save"])
def test_malicious_pickle_is_not_run(dump_writer, store_dir, tmp_path, make):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Evil(control), protocol=2))
    assert control.exists()  # the payload is live
    dump_json = good_dump(dump_writer)
    marker = tmp_path / "pwned"
    pt = tensor_dir(dump_json) / f"{RELU}.input.0.pt"
    make(pt, marker)
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("data_name", pt.name))
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    assert not marker.exists()
    assert bad["file_status"] == "error" and str(pt) in bad["error"] and "refused" in bad["error"]


# ------------------------------------------------------------------------------- plain folders of tensors


def test_plain_folder_bad_files_become_rows(tmp_path, store_dir):
    folder = tmp_path / "tensors"
    folder.mkdir()
    np.save(folder / "good.npy", np.arange(4.0))
    (folder / "corrupt.pt").write_bytes(np.random.default_rng(1).bytes(300))
    np.save(folder / "cut.npy", np.arange(10.0))
    (folder / "cut.npy").write_bytes((folder / "cut.npy").read_bytes()[:140])
    secret = save_npy_file(tmp_path / "secret.npy", np.array([7.0]))
    (folder / "link.npy").symlink_to(secret)
    bad = ingest_with_errors(folder, store_dir, 4, 3)
    by_name = {r["name"]: r for r in bad}
    assert set(by_name) == {"corrupt", "cut", "link"}
    for name, row in by_name.items():
        assert row["file_status"] == "error" and str(folder / row["data_name"]) in row["error"], name
    assert by_name["link"]["sample"] in (None, [])  # the linked file was not read


# ----------------------------------------------------------- found by the fuzzer (tests/fuzz.py, test_fuzz.py)


def test_lone_surrogates_in_json_strings_are_stored_escaped(dump_writer, store_dir):
    """JSON escapes of lone surrogates (\\udcff) in keys, values, stacks, parents and task are stored as text."""
    dump_json = good_dump(dump_writer)
    key = "Functional.x\ud800.0.forward"

    def edit(d: dict) -> None:
        d["task"] = "tensor\udcff"
        d["data"][key] = {"input_args": [{"type": "str", "value": "\udcff"}], "input_kwargs": {"k\udcfe": None}}

    doc = mutate(dump_json, edit)
    (dump_json.parent / "stack.json").write_text(json.dumps({"0": [[RELU], ["File \udcff, line 1"]]}))
    (dump_json.parent / "construct.json").write_text(json.dumps({RELU: "Module.\udcff.forward.0"}))
    res = cli("ingest", dump_json, "--run", "r", "--store", store_dir, "-j", "1")
    assert res.exit_code == 0 and "warning" not in res.output, res.output
    assert q(store_dir, "select count(*) n from tensors") == [{"n": count_leaves(doc)}]
    rows = q(store_dir, "select name from tensors where record like 'Functional.x%' order by leaf")
    # bytes of a non-UTF-8 file name (\udc80-\udcff alone) read \xNN, any other lone surrogate \uXXXX
    assert [r["name"] for r in rows] == [
        "Functional.x\\ud800.0.forward.input.0",
        "Functional.x\\ud800.0.forward.input.k\\udcfe",
    ]
    assert {r["module"] for r in q(store_dir, f"select module from tensors where record = '{RELU}'")} == {
        "Module.\\xff.forward.0"
    }
    assert q(store_dir, "select frames from stacks") == [{"frames": ["File \\xff, line 1"]}]


def test_file_names_that_are_not_utf8(dump_writer, tmp_path, store_dir):
    """A plain folder with non-UTF-8 file names, and a data_name naming such a file: rows, not a crash."""
    folder = tmp_path / "tensors"
    folder.mkdir()
    np.save(folder / "ok.npy", np.arange(3.0))
    np.save(os.fsdecode(os.fsencode(folder) + b"/\xff\xfe.npy"), np.arange(4.0))
    res = cli("ingest", folder, "--run", "plain", "--store", store_dir, "-j", "1")
    assert res.exit_code == 0, res.output
    assert q(store_dir, "select name, numel from tensors order by name") == [
        {"name": "\\xff\\xfe", "numel": 4},
        {"name": "ok", "numel": 3},
    ]
    dump_json = good_dump(dump_writer)
    os.rename(tensor_dir(dump_json) / f"{RELU}.input.0.npy", tensor_dir(dump_json) / "\udce9.npy")
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("data_name", "\udce9.npy"))
    res = cli("ingest", dump_json, "--run", "r", "--store", store_dir, "-j", "1")
    assert res.exit_code == 0 and "warning" not in res.output, res.output
    assert q(store_dir, f"select data_name, file_status from tensors where name = '{RELU}.input.0'") == [
        {"data_name": "\\xe9.npy", "file_status": "loaded"}
    ]
    assert q(store_dir, "select count(*) n from tensors where run = 'r'") == [{"n": count_leaves(doc)}]


@pytest.mark.parametrize("folder", ["step" + "9" * 20, "rank9223372036854775808"])
def test_step_or_rank_number_beyond_int64(dump_writer, store_dir, folder):
    dump_json = good_dump(dump_writer)
    level = dump_json.parent if folder.startswith("rank") else dump_json.parent.parent
    moved = level.rename(level.parent / folder)
    assert_error(
        cli(
            "ingest",
            dump_json.parent.parent.parent if folder.startswith("rank") else moved.parent,
            "--run",
            "r",
            "--store",
            store_dir,
        ),
        folder,
        "int64",
    )


@pytest.mark.parametrize("target", ["/etc/passwd", "outside"])
def test_linked_dump_json_is_not_read(dump_writer, store_dir, tmp_path, target):
    dump_json = good_dump(dump_writer)
    outside = tmp_path / "outside.json"
    outside.write_text(dump_json.read_text().replace('"Max": 2.0', '"Max": 12345.0'))  # a valid dump elsewhere
    dump_json.unlink()
    dump_json.symlink_to(target if target.startswith("/") else outside)
    assert_error(
        cli("ingest", dump_json.parent.parent.parent, "--run", "r", "--store", store_dir), dump_json, "is a link"
    )


def test_linked_stack_and_construct_json_are_not_read(dump_writer, store_dir, tmp_path):
    dump_json = good_dump(dump_writer)
    for name, content in (("stack.json", {"0": [[RELU], ["outside"]]}), ("construct.json", {RELU: "Module.x"})):
        (tmp_path / name).write_text(json.dumps(content))
        (dump_json.parent / name).unlink(missing_ok=True)
        (dump_json.parent / name).symlink_to(tmp_path / name)
    res = cli("ingest", dump_json, "--run", "r", "--store", store_dir, "-j", "1")
    assert res.exit_code == 0, res.output
    assert q(store_dir, "select count(*) n from stacks") == [{"n": 0}]
    assert q(store_dir, "select count(module) m, count(stack_id) s from tensors") == [{"m": 0, "s": 0}]
    for name, lost in (("construct.json", "module parents"), ("stack.json", "call stacks")):  # said, not silent
        line = f"warning: {dump_json.parent / name}: a link; not read (copy the file instead); ingested without {lost}"
        assert line in res.output.splitlines(), res.output


@pytest.mark.parametrize("jobs", [1, 2])
def test_unreadable_construct_json_is_a_warning_from_any_process(dump_writer, store_dir, jobs):
    """A broken construct.json costs the rows their module parents, not the ingest, and the user is told, also
    when the unit was ingested by a worker process (two units, two workers)."""
    w = dump_writer()
    records = {RELU: {"input_args": [np.array([-1.0, 2.0], np.float32)], "output": [np.array([0.0, 2.0], np.float32)]}}
    for rank in (0, 1):
        w.write(records, rank=rank, construct={RELU: "Module.x"})
    broken = w.root / "step0" / "rank1" / "construct.json"
    broken.write_text('{"Functional.relu.0.forward": ')
    with pytest.warns(DumpstoreWarning) as caught:
        res = ingest(w.root, "r", store=store_dir, jobs=jobs)
    assert res.errors == 0 and res.units == 2
    [message] = [str(c.message) for c in caught]
    assert message.startswith(f"{broken}: ") and message.endswith("; ingested without module parents"), message
    assert q(store_dir, "select rank, count(module) m from tensors group by rank order by rank") == [
        {"rank": 0, "m": 2},
        {"rank": 1, "m": 0},
    ]


def test_data_name_too_long_for_the_file_system(dump_writer, store_dir):
    dump_json = good_dump(dump_writer)
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("data_name", "x" * 300 + ".npy"))
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    assert bad["file_status"] == "error" and "File name too long" in bad["error"]


def test_npy_header_claiming_more_than_the_file_holds(dump_writer, store_dir):
    """numpy would allocate the claimed 4 TB before noticing the file is short (MemoryError)."""
    dump_json = good_dump(dump_writer)
    npy = tensor_dir(dump_json) / f"{RELU}.output.0.npy"
    with open(npy, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
        fh.write(bytes(16))
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(json.loads(dump_json.read_text())), 1)
    assert bad["file_status"] == "error" and "claims shape [1000000000000]" in bad["error"]


def test_tiny_pt_that_expands_to_gigabytes_is_refused(dump_writer, store_dir):
    """4 bytes on disk with stride 0 claim 4 GiB: refused before reading, as more than dump.json's shape needs."""
    from fuzz import tensor_pickle, write_pt_zip

    dump_json = good_dump(dump_writer)
    pt = tensor_dir(dump_json) / f"{RELU}.input.0.pt"
    write_pt_zip(pt, tensor_pickle("FloatStorage", 1, [1 << 30], [0]), bytes(4))
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("data_name", pt.name))
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("expanded the tensor")))
    signal.alarm(5)
    try:
        [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert bad["file_status"] == "error" and str(pt) in bad["error"] and "[1073741824]" in bad["error"]


def test_line_breaks_in_names_keep_errors_on_one_line(dump_writer, store_dir):
    w = dump_writer("new\nline")
    dump_json = w.write({RELU: {"input_args": [np.array([-1.0, 2.0], np.float32)]}})
    doc = mutate(dump_json, lambda d: relu_in(d).__setitem__("data_name", "gone\n.npy"))
    [bad] = ingest_with_errors(dump_json, store_dir, count_leaves(doc), 1)  # no line break in the row's error
    assert bad["file_status"] == "missing" and "gone\\n.npy" in bad["error"]
    dump_json.write_text("{")
    assert_error(cli("ingest", w.root, "--run", "r", "--store", store_dir), "new\\nline", "invalid JSON")


def test_call_counter_too_long_for_python(dump_writer, store_dir):
    """A 5000-digit call counter (int() refuses more than 4300 digits): stored with call null."""
    dump_json = good_dump(dump_writer)
    key = "Functional.linear." + "9" * 5000 + ".forward"
    doc = mutate(dump_json, lambda d: d["data"].__setitem__(key, d["data"].pop(LINEAR)))
    res = cli("ingest", dump_json, "--run", "r", "--store", store_dir, "-j", "1")
    assert res.exit_code == 0 and "warning" not in res.output, res.output
    assert q(store_dir, "select count(*) n, count(call) c from tensors where length(record) > 5000") == [
        {"n": count_leaves({"data": {key: doc["data"][key]}}), "c": 0}
    ]


def test_tensor_folder_swapped_for_a_link_between_ingests(dump_writer, tmp_path, store_dir):
    """The folder check of resolve() is cached per ingest, never across ingests."""
    import shutil

    from dumpstore._ingest import ingest
    from dumpstore.query import run_query
    from dumpstore.store import open_store

    w = dump_writer("swap")
    arr = np.arange(6, dtype=np.float32)
    dump = w.write({"Functional.relu.0.forward": {"input_args": [arr], "output": [arr]}})
    ingest(dump.parent, "a", store=store_dir, jobs=1)
    outside = tmp_path / "outside"
    shutil.copytree(dump.parent / "dump_tensor_data", outside)
    for f in outside.iterdir():
        np.save(f, np.full(6, 12345.0, dtype=np.float32))
    shutil.rmtree(dump.parent / "dump_tensor_data")
    (dump.parent / "dump_tensor_data").symlink_to(outside)
    ingest(dump.parent, "b", store=store_dir, jobs=1)
    sql = "select max, error from tensors where run='b' and kind='tensor'"
    rows = run_query(open_store(store_dir), sql).to_pylist()
    assert rows and all(r["max"] != 12345.0 and "refusing to read it" in r["error"] for r in rows)

"""dumpstore replay: arguments rebuilt from records, skip reasons, verdicts, the store's view, the CSV, the CLI, and
the samples made with real msprobe (tests/replay_samples.py): each faulty kernel found without a reference, the
clean runs quiet."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dumpstore._ingest import ingest
from dumpstore.analysis.replay import (
    ACC_CHECK_COLUMNS,
    RESULT_COLUMNS,
    ReplayError,
    kernel_finding,
    replay_run,
    side_by_side,
    write_acc_check_csv,
)
from dumpstore.cli.main import main
from dumpstore.query import connect
from dumpstore.store import open_store

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import replay_samples  # noqa: E402

SAMPLES = ROOT / "out" / "replay_samples"  # git-ignored (/out/)


@pytest.fixture(scope="session")
def replayed(tmp_path_factory):
    """The replay samples made once (kept in out/replay_samples), ingested and replayed: (store, {case: table})."""
    pytest.importorskip("msprobe")
    cases = replay_samples.generate(SAMPLES)
    root = tmp_path_factory.mktemp("replay_store")
    for name, path in cases.items():
        ingest(path, name, store=root, jobs=1)
    store = open_store(root)
    return store, {name: replay_run(store, name) for name in cases}


def test_importing_dumpstore_imports_no_torch():
    code = (
        "import sys, dumpstore, dumpstore.analysis, dumpstore.cli.main, dumpstore.analysis.replay; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.msprobe
@pytest.mark.parametrize("case", sorted(replay_samples.EXPECTED))
def test_faulty_kernel_found_without_reference(replayed, case):
    store, _ = replayed
    f = kernel_finding(store, case)
    assert f is not None and f.kind == "kernel" and f.source == "replay"
    assert f.op == replay_samples.EXPECTED[case]
    assert f.name == f.op + ".output.0" and f.value > f.threshold == 2.0


@pytest.mark.msprobe
@pytest.mark.parametrize("case", ["clean_fp32", "clean_bf16", "clean_fp16", "autocast_ln_bf16"])
def test_clean_runs_are_quiet(replayed, case):
    store, tables = replayed
    df = tables[case]
    assert kernel_finding(store, case) is None
    assert set(df["status"]) == {"pass"}
    # every forward API output and every gradient judged
    assert (
        df.filter(df["direction"] == "forward").height == 25 and df.filter(df["direction"] == "backward").height == 45
    )


@pytest.mark.msprobe
def test_gelu_tanh_rows(replayed):
    _, tables = replayed
    df = tables["gelu_tanh"]
    fails = df.filter(df["status"] == "fail")
    assert fails["record"].to_list() == ["Functional.gelu.0.forward", "Functional.gelu.1.forward"]
    row = fails.row(0, named=True)
    assert row["standard"] == "benchmark" and row["metric"] == "rel_l2" and row["dtype"] == "float32"
    assert row["ratio"] > 100 and row["msprobe_status"] == "error"
    assert row["reason"].startswith("rel_l2 ") and row["reason"].endswith("> 2")
    # backward records: the forward recomputed and differentiated through the hook msprobe uses (the autograd node
    # of the first output): composites too (linear: addmm after a transpose; cross_entropy: nll_loss of log_softmax)
    back = df.filter(df["direction"] == "backward")
    assert set(back["status"]) == {"pass"} and back["record"].n_unique() == 25
    linear = back.filter(back["record"] == "Functional.linear.8.backward")
    assert linear["shape"].to_list() == [[32], [2, 32], [32, 32]]  # addmm's slots: bias, input, weight.T


@pytest.mark.msprobe
def test_replay_view_and_acc_check_csv(replayed, tmp_path):
    store, tables = replayed
    con = connect(store)
    sql = (
        "SELECT run, record, count(*) FROM replay WHERE status = 'fail' GROUP BY run, step, seq, record "
        "ORDER BY run, step, seq"
    )
    got = con.execute(sql).fetchall()
    assert got == [
        ("attn_noscale", "Functional.scaled_dot_product_attention.1.forward", 1),
        # its backward recomputed from the unscaled forward's saved results: wrong too (q, k, v gradients)
        ("attn_noscale", "Functional.scaled_dot_product_attention.1.backward", 3),
        ("autocast_mean_bf16", "Tensor.mean.0.forward", 1),
        ("gelu_tanh", "Functional.gelu.0.forward", 1),
        ("gelu_tanh", "Functional.gelu.1.forward", 1),
        ("mean_bf16", "Tensor.mean.0.forward", 1),
    ]
    result, details = write_acc_check_csv(tables["mean_bf16"], tmp_path / "accuracy_checking_result_1.csv")
    assert details == str(tmp_path / "accuracy_checking_details_1.csv")
    calls = list(csv.reader(open(result, encoding="utf-8")))
    assert calls[0] == RESULT_COLUMNS and len(calls) == 1 + 25
    mean_call = next(r for r in calls if r[0] == "Tensor.mean.0")
    assert mean_call[1:3] == ["error", "pass"] and mean_call[3].startswith("rel_l2 ")
    rows = list(csv.reader(open(details, encoding="utf-8")))
    assert rows[0] == ACC_CHECK_COLUMNS and len(rows) == 1 + 25 + 45  # forward outputs, replayed gradients
    mean = next(r for r in rows if r[0] == "Tensor.mean.0.forward.output.0")
    assert mean[1:4] == ["torch.float64", "torch.float32", "(2, 32)"] and mean[-2] == "error"


def _copy_step(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest / "step0")
    return dest


@pytest.mark.msprobe
def test_ref_side_by_side(replayed, tmp_path):
    """Two runs of the same step: the target's gelu far from float64, the reference's not."""
    store, _ = replayed
    target = _copy_step(SAMPLES / "dump" / "step3", tmp_path / "t")
    ref = _copy_step(SAMPLES / "dump" / "step0", tmp_path / "r")
    root = tmp_path / "store"
    ingest(target, "t", store=root, jobs=1)
    ingest(ref, "r", store=root, jobs=1)
    result = CliRunner().invoke(main, ["replay", "--run", "t", "--ref", "r", "--store", str(root), "--op-type", "gelu"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "replay of run t: pass 2, fail 2, error 0, no_standard 0, skipped_calls 0, unreplayable_calls 0"
    assert lines[1].startswith("kernel (kernel): step 0 rank 0  Functional.gelu.0.forward  output.0  rel_l2_ratio=")
    assert "than the CPU's float32 gelu" in lines[1] and "; the reference's is 1×" in lines[1]
    sbs = side_by_side(open_store(root), "t", "r")
    assert sbs["record"].to_list() == [
        f"Functional.gelu.{i}.{d}" for d, i in (("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0))
    ]
    assert sbs["status"].to_list() == ["fail", "fail", "pass", "pass"]  # the gelu gradients are right
    assert sbs["ref_status"].to_list() == ["pass", "pass", "pass", "pass"]


@pytest.mark.msprobe
def test_divergence_shows_the_kernel_finding(replayed, tmp_path):
    """`divergence` carries the replay's kernel finding of a replayed target (text line, --json key, --csv row);
    none before the replay."""
    target = _copy_step(SAMPLES / "dump" / "step3", tmp_path / "t")
    ref = _copy_step(SAMPLES / "dump" / "step0", tmp_path / "r")
    root = tmp_path / "store"
    ingest(target, "t", store=root, jobs=1)
    ingest(ref, "r", store=root, jobs=1)
    base = ["divergence", "--target", "t", "--ref", "r", "--store", str(root)]
    from dumpstore.cli import compare_cmds
    from dumpstore.replaytable import REPLAY_DIR

    assert compare_cmds.REPLAY_DIR == REPLAY_DIR
    before = CliRunner().invoke(main, [*base, "--json"])
    assert before.exit_code == 0, before.output
    assert json.loads(before.output)["kernel"] is None
    for run in ("t", "r"):
        assert (
            CliRunner().invoke(main, ["replay", "--run", run, "--store", str(root), "--op-type", "gelu"]).exit_code == 0
        )
    res = CliRunner().invoke(main, base)
    kernel = [x for x in res.output.splitlines() if x.startswith("KERNEL")]
    assert kernel and kernel[0].startswith("KERNEL (kernel): step 0 rank 0  Functional.gelu.0.forward  output.0  ")
    assert "; the reference's is 1×" in kernel[0]
    got = json.loads(CliRunner().invoke(main, [*base, "--json", "--no-cache"]).output)["kernel"]
    assert got["op"] == "Functional.gelu.0.forward" and got["kind"] == "kernel" and got["source"] == "replay"
    rows = list(csv.DictReader(CliRunner().invoke(main, [*base, "--csv"]).output.splitlines()))
    assert [r["op"] for r in rows if r["finding"] == "kernel"] == ["Functional.gelu.0.forward"]


def test_statistics_dump_refused(tmp_path):
    ingest(ROOT / "sample_dumps" / "ref_stats", "s", store=tmp_path, jobs=1)
    with pytest.raises(ReplayError) as e:
        replay_run(open_store(tmp_path), "s")
    assert str(e.value).startswith("run 's' is a statistics-mode dump: replay needs the recorded tensors")
    result = CliRunner().invoke(main, ["replay", "--run", "s", "--store", str(tmp_path)])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and result.output.startswith("Error: run 's'")


def _records() -> dict:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    w, b = np.ones(8, np.float32), np.zeros(8, np.float32)
    mu, sd = x.mean(-1, keepdims=True), x.std(-1, keepdims=True)
    ln = ((x - mu) / np.sqrt(sd**2 + 1e-5)).astype(np.float32)
    return {
        "Torch.add.0.forward": {
            "input_args": [x, y],
            "output": [(x + 2 * y).astype(np.float32)],
        },
        "Torch.add.1.forward": {  # the same call again: replayed once
            "input_args": [x, y],
            "output": [(x + 2 * y).astype(np.float32)],
        },
        "Functional.layer_norm.0.forward": {
            "input_args": [x, [{"type": "int", "value": 8}], w, b, {"type": "float", "value": 1e-5}],
            "output": [ln],
        },
        "Tensor.sum.0.forward": {  # written 10% too large: wrong
            "input_args": [x, {"type": "int", "value": -1}],
            "output": [(x.sum(-1) * 1.1).astype(np.float32)],
        },
        "Tensor.argmax.0.forward": {"input_args": [x], "output": [np.array(x.argmax())]},
        "Tensor.__getitem__.0.forward": {  # x[:2, 1]: a tuple index, recorded as a list
            "input_args": [x, [{"type": "slice", "value": [None, 2, None]}, {"type": "int", "value": 1}]],
            "output": [x[:2, 1]],
        },
        "Tensor.__getitem__.1.forward": {  # x[0, 1]
            "input_args": [x, [{"type": "int", "value": 0}, {"type": "int", "value": 1}]],
            "output": [np.array(x[0, 1])],
        },
        "Tensor.__getitem__.2.forward": {  # x[[0, 1]]
            "input_args": [x, [{"type": "int", "value": 0}, {"type": "int", "value": 1}]],
            "output": [x[[0, 1]]],
        },
        "Torch.empty_like.0.forward": {"input_args": [x], "output": [x]},
        "Torch.max.0.forward": {  # a named tuple (values, indices): two outputs, two standards
            "input_args": [x, {"type": "int", "value": 1}],
            "output": [x.max(1), x.argmax(1)],
        },
        "Aten.mm.default.0.forward": {"input_args": [x, np.ascontiguousarray(y.T)], "output": [x @ y.T]},
        "Tensor.add_.0.forward": {"input_args": [x, y], "output": [x + y]},
        "Functional.dropout.0.forward": {"input_args": [x], "output": [x]},
        "Distributed.all_reduce.0.forward": {"input_args": [x], "output": [x]},
        "NPU.npu_rms_norm.0.forward": {"input_args": [x], "output": [x]},
        "Functional.relu.0.forward": {"input_args": [x]},
    }


def _hand_dump(dump_writer) -> Path:
    """The records above, with keyword arguments (the writer puts only lists) added to dump.json."""
    w = dump_writer("hand")
    path = w.write(_records())
    doc = json.loads(path.read_text())
    for key in ("Torch.add.0.forward", "Torch.add.1.forward"):
        doc["data"][key]["input_kwargs"] = {"alpha": {"type": "int", "value": 2}}
    sdpa = {"input_kwargs": {"dropout_p": {"type": "float", "value": 0.1}}}
    sdpa.update(input_args=[], output=doc["data"]["Torch.add.0.forward"]["output"])
    doc["data"]["Functional.scaled_dot_product_attention.0.forward"] = sdpa
    path.write_text(json.dumps(doc))
    return w.root


def test_arguments_rebuilt_and_calls_skipped(dump_writer, tmp_path):
    root = _hand_dump(dump_writer)
    ingest(root, "h", store=tmp_path / "s", jobs=1)
    store = open_store(tmp_path / "s")
    df = replay_run(store, "h")
    by = {r["record"]: r for r in df.to_dicts()}
    assert by["Torch.add.0.forward"]["status"] == "pass" and by["Torch.add.0.forward"]["same_as"] is None
    assert by["Torch.add.1.forward"]["same_as"] == "Torch.add.0.forward"
    assert by["Torch.add.1.forward"]["name"] == "Torch.add.1.forward.output.0"
    assert by["Functional.layer_norm.0.forward"]["status"] == "pass"
    assert by["Tensor.sum.0.forward"]["status"] == "fail"
    assert by["Tensor.argmax.0.forward"]["standard"] == "binary" and by["Tensor.argmax.0.forward"]["status"] == "pass"
    assert [by[f"Tensor.__getitem__.{i}.forward"]["status"] for i in range(3)] == ["pass"] * 3
    maxes = df.filter(df["record"] == "Torch.max.0.forward")
    assert maxes.select("output", "dtype", "standard", "status").rows() == [
        ("0", "float32", "benchmark", "pass"),
        ("1", "int64", "binary", "pass"),
    ]
    assert by["Aten.mm.default.0.forward"]["status"] == "pass" and by["Aten.mm.default.0.forward"]["api_level"] == "L2"
    reasons = {k: v["reason"] for k, v in by.items() if v["status"] == "skipped"}
    assert reasons == {
        "Tensor.add_.0.forward": "in-place: the recorded input was overwritten by the call",
        "Functional.dropout.0.forward": "random: its output depends on the generator's state",
        "Distributed.all_reduce.0.forward": "communication: its result depends on the other ranks",
        "NPU.npu_rms_norm.0.forward": "NPU API: no CPU implementation to replay it with",
        "Functional.relu.0.forward": "no tensor output to judge",
        "Torch.empty_like.0.forward": "uninitialised memory: its output is whatever was there",
        "Functional.scaled_dot_product_attention.0.forward": "random: dropout_p > 0",
    }
    f = kernel_finding(store, "h")
    assert f is not None and f.op == "Tensor.sum.0.forward"


def test_module_only_dump_refused(dump_writer, tmp_path):
    w = dump_writer("l0")
    x = np.ones((2, 2), np.float32)
    w.write({"Module.fc.Linear.forward.0": {"input_args": [x], "output": [x]}})
    ingest(w.root, "m", store=tmp_path / "s", jobs=1)
    with pytest.raises(ReplayError, match=r"^run 'm' has no API records \(a level L0 dump records modules only\)"):
        replay_run(open_store(tmp_path / "s"), "m")


def test_parallel_replay_gives_the_same_table(dump_writer, tmp_path, monkeypatch):
    from dumpstore.analysis.replay import run as replay_module

    monkeypatch.setattr(replay_module, "MIN_CALLS_PER_WORKER", 1)  # workers even for these few calls
    monkeypatch.setattr(replay_module, "BATCH", 2)
    root = _hand_dump(dump_writer)
    ingest(root, "h", store=tmp_path / "s", jobs=1)
    store = open_store(tmp_path / "s")
    one = replay_run(store, "h", write=False)
    two = replay_run(store, "h", jobs=2, write=False)
    assert one.equals(two)


def test_partial_replay_updates_only_its_calls(dump_writer, tmp_path):
    from dumpstore.replaytable import read_replay

    root = _hand_dump(dump_writer)
    ingest(root, "h", store=tmp_path / "s", jobs=1)
    store = open_store(tmp_path / "s")
    full = replay_run(store, "h")
    part = replay_run(store, "h", op_types=["add"])
    assert part["record"].to_list() == ["Torch.add.0.forward", "Torch.add.1.forward"]
    stored = read_replay(store, "h")
    assert stored is not None and stored.column("record").to_pylist() == full["record"].to_list()


def test_malformed_arguments_are_error_rows(dump_writer, tmp_path):
    x = np.ones((2, 2), np.float32)
    w = dump_writer("bad")
    path = w.write({"Tensor.__getitem__.0.forward": {"input_args": [x, x], "output": [x]}})
    doc = json.loads(path.read_text())
    doc["data"]["Tensor.__getitem__.0.forward"]["input_args"][1] = {"type": "torch.Size", "value": 5}
    path.write_text(json.dumps(doc))
    ingest(w.root, "b", store=tmp_path / "s", jobs=1)
    (row,) = replay_run(open_store(tmp_path / "s"), "b").to_dicts()
    assert row["status"] == "error"
    assert row["reason"].startswith("not replayable: malformed argument in the record (TypeError: ")


@pytest.mark.msprobe
def test_missing_step_refused(replayed):
    store, _ = replayed
    with pytest.raises(ReplayError, match=r"^run 'gelu_tanh' has no step 7; its steps: \[3\]$"):
        replay_run(store, "gelu_tanh", steps=[7])


def test_public_api():
    import dumpstore.analysis.replay as replay

    assert sorted(replay.__all__) == [
        "ACC_CHECK_COLUMNS",
        "KERNEL",
        "RESULT_COLUMNS",
        "ReplayError",
        "kernel_finding",
        "kernel_message",
        "replay_run",
        "side_by_side",
        "write_acc_check_csv",
    ]
    assert issubclass(replay.ReplayError, __import__("dumpstore").errors.DumpstoreError)


def test_without_torch_one_line(dump_writer, tmp_path, monkeypatch):
    from dumpstore.analysis.replay import run as replay_module

    root = _hand_dump(dump_writer)
    ingest(root, "h", store=tmp_path / "s", jobs=1)
    monkeypatch.setattr(replay_module, "have_torch", lambda: False)
    result = CliRunner().invoke(main, ["replay", "--run", "h", "--store", str(tmp_path / "s")])
    assert result.exit_code == 1
    assert result.output == (
        "Error: dumpstore replay needs torch (the CPU build is enough): pip install 'dumpstore[replay]'\n"
    )

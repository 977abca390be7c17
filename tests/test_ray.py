"""The Ray engine on a local Ray instance: the same store and the same answers as the local engine.

One `ray.init` for the module (a few seconds).  The 100-rank job runs by default, the 1,000-rank one with -m slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import synth

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from click.testing import CliRunner  # noqa: E402

from dumpstore._ingest import ingest  # noqa: E402
from dumpstore.analysis import distributed, divergence_by_steps, overflow, rank_rows  # noqa: E402
from dumpstore.analysis.compare import compare_runs  # noqa: E402
from dumpstore.cli.main import main  # noqa: E402
from dumpstore.engine_ray import EngineError  # noqa: E402
from dumpstore.query import run_query  # noqa: E402
from dumpstore.store import open_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_dumps"
# every stored column of a leaf that ingest computes, hashed per row and combined order-free per run
CHECKSUM = (
    "select run, count(*) as n, bit_xor(hash(step, rank, source, seq, leaf, record, name, io, index_path, "
    "kind, dtype, shape, numel, min, max, mean, norm, nan_count, stats_source, error, stack_id, module)) "
    "as h from tensors group by run order by run"
)
_SAME = (
    "run",
    "framework",
    "task",
    "level",
    "dump_mode",
    "generation",
    "steps",
    "ranks",
    "n_files",
    "n_records",
    "n_rows",
    "n_tensors",
    "n_tensor_files",
    "n_errors",
    "sample_k",
    "sketch_m",
    "source_path",
)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def _job(root: Path, ranks: int) -> dict:
    """A synthetic statistics job: 2 layers, 2 steps, a fault on one rank at step 1."""
    return synth().generate(
        root / "dumps",
        layers=2,
        steps=2,
        ranks=ranks,
        fault_step=1,
        fault_rank=ranks * 3 // 8,
        fault_layer=1,
        jobs=1,
        log=lambda *a: None,
    )


def _stores(root: Path) -> tuple:
    local, on_ray = open_store(root / "local", create=True), open_store(root / "ray", create=True)
    for side in ("ref", "target"):
        ingest(root / "dumps" / side, side, store=local.root, jobs=1)
        ingest(root / "dumps" / side, side, store=on_ray.root, engine="ray")
    return local, on_ray


def _catalog(st) -> list[dict]:
    return [{k: r[k] for k in _SAME} for r in st.runs().to_pylist()]


def _checksums(st) -> list[tuple]:
    return [tuple(r.values()) for r in run_query(st, CHECKSUM).to_pylist()]


@pytest.fixture(scope="module")
def job100(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray100")
    man = _job(root, 100)
    return (man, *_stores(root))


def _check_same(man: dict, local, on_ray) -> None:
    assert _catalog(on_ray) == _catalog(local)
    assert [r["n_rows"] for r in on_ray.runs().to_pylist()] == [man["rows_per_side"]] * 2
    assert _checksums(on_ray) == _checksums(local)
    assert [n for _, n, _ in _checksums(on_ray)] == [man["rows_per_side"]] * 2
    v_local = divergence_by_steps(local, "target", "ref").to_dict()
    v_ray = distributed.divergence_by_steps(on_ray, "target", "ref", batch=7).to_dict()
    assert v_ray == v_local
    first, exp = v_ray["first_divergence"], man["expected"]
    assert (first["step"], first["rank"], first["op"], first["name"]) == (
        exp["step"],
        exp["rank"],
        exp["first_divergence_op"],
        exp["first_divergence_name"],
    )
    assert v_ray["culprit"]["kind"] == exp["culprit_kind"] and v_ray["culprit"]["op"] == exp["first_divergence_op"]


def test_ray_ingest_and_verdict_equal_local_100_ranks(job100):
    _check_same(*job100)


@pytest.mark.slow
def test_ray_ingest_and_verdict_equal_local_1000_ranks(tmp_path):
    man = _job(tmp_path, 1000)
    assert man["ranks"] == 1000 and man["expected"]["rank"] == 375
    _check_same(man, *_stores(tmp_path))


def test_compare_on_ray_ranks_the_same_rows(job100):
    man, local, on_ray = job100
    opts = {"by": "severity", "top": 25, "direction": "forward", "module": None, "op_type": None, "io": None}
    want = rank_rows(compare_runs(local, "target", "ref"), **opts)
    got = distributed.ranked(on_ray, "target", "ref", rank_options=opts, batch=13)
    assert got.height == 25
    key = ["severity", "step", "rank", "seq", "name"]
    assert got.sort(key).to_dicts() == want.sort(key).to_dicts()
    assert got.row(0, named=True)["rank"] == man["expected"]["rank"]


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    st = open_store(tmp_path_factory.mktemp("samples") / "store", create=True)
    for name in ("ref_stats", "overflow_stats", "ref_2rank_stats", "rank1_fault_stats"):
        ingest(SAMPLES / name, name, store=st.root, jobs=1)
    return st


def test_overflow_on_ray_equals_local(samples):
    for ref in (None, "ref_stats"):
        want = overflow(samples, "overflow_stats", ref=ref)
        got = distributed.overflow(samples, "overflow_stats", ref=ref, batch=1)
        assert got.first_overflow == want.first_overflow and got.first_overflow is not None
        assert got.producers == want.producers
        assert got.tensors.to_dicts() == want.tensors.to_dicts()


def test_two_rank_verdict_on_ray_equals_local(samples):
    want = divergence_by_steps(samples, "rank1_fault_stats", "ref_2rank_stats").to_dict()
    got = distributed.divergence_by_steps(samples, "rank1_fault_stats", "ref_2rank_stats", batch=1).to_dict()
    assert got == want and got["first_divergence"]["rank"] == 1


def test_cli_engine_ray(tmp_path, samples):
    store = str(tmp_path / "s")
    runner = CliRunner()
    for path, run in (("ref_2rank_stats", "ref"), ("rank1_fault_stats", "t")):
        res = runner.invoke(
            main, ["ingest", str(SAMPLES / path), "--run", run, "--store", store, "--engine", "ray", "--batch", "1"]
        )
        assert res.exit_code == 0, res.output
    args = ["--target", "t", "--ref", "ref", "--store", store, "--no-cache"]
    on_ray = runner.invoke(main, ["divergence", *args, "--engine", "ray"])
    local = runner.invoke(main, ["divergence", *args])
    assert on_ray.exit_code == 0 and on_ray.output == local.output and "FIRST DIVERGENCE" in local.output
    over = [
        runner.invoke(main, ["overflow", "--run", "t", "--store", store, "--json", *e])
        for e in ([], ["--engine", "ray"])
    ]
    assert over[0].exit_code == over[1].exit_code == 0 and over[0].output == over[1].output


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(Exception, match="^engine 'Ray' is not known; use 'local' or 'ray'$") as err:
        ingest(SAMPLES / "ref_stats", "x", store=tmp_path / "s", engine="Ray")
    assert type(err.value).__name__ == "StoreError"


def test_nothing_imports_ray_unless_asked():
    code = (
        "import sys, dumpstore._ingest, dumpstore.cli.main, dumpstore.analysis._divergence, "
        "dumpstore.analysis._overflow\nassert 'ray' not in sys.modules, 'ray imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------- failures
def _kill_ingest_workers(stop: threading.Event, times: int, killed: list) -> None:
    """Kill -9 a Ray worker while it runs an ingest task, `times` times."""
    import psutil

    while not stop.is_set() and len(killed) < times:
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd and cmd[0].startswith("ray::_ingest_batch") and p.pid not in killed:
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
                break
        time.sleep(0.005)


def _ingest_while_killing(dumps: Path, store: Path, times: int, retries: int):
    stop, killed = threading.Event(), []
    t = threading.Thread(target=_kill_ingest_workers, args=(stop, times, killed))
    t.start()
    try:
        return ingest(
            dumps, "target", store=store, engine="ray", engine_options={"batch": 4, "retries": retries}
        ), killed
    finally:
        stop.set()
        t.join()


def test_killed_worker_is_retried_with_the_same_files(job100, tmp_path):
    man, local, on_ray = job100
    store = tmp_path / "store"
    res, killed = _ingest_while_killing(on_ray.root.parent / "dumps" / "target", store, times=1, retries=2)
    assert len(killed) == 1
    st = open_store(store)
    assert res.rows == man["rows_per_side"]
    assert _checksums(st) == [c for c in _checksums(local) if c[0] == "target"]
    parts = sorted(p.name for p in (store / "tensors" / "run=target").rglob("*.parquet"))
    assert len(parts) == 200 and all(p == f"part-{res.ingest_id}.parquet" for p in parts)


def test_worker_killed_for_good_leaves_the_catalog_unchanged(job100, tmp_path):
    man, local, on_ray = job100
    dumps = on_ray.root.parent / "dumps" / "target"
    store = tmp_path / "store"
    first = ingest(dumps, "target", store=store, engine="ray")
    catalog = (store / "runs.parquet").read_bytes()
    with pytest.raises(EngineError) as err:
        _ingest_while_killing(dumps, store, times=1, retries=0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("ingest of run 'target' on Ray failed at step ")
    assert "nothing was published (the catalog is unchanged)" in msg
    assert (store / "runs.parquet").read_bytes() == catalog
    parts = {p.name for p in (store / "tensors" / "run=target").rglob("*.parquet")}
    assert parts == {f"part-{first.ingest_id}.parquet"}
    assert _checksums(open_store(store)) == [c for c in _checksums(local) if c[0] == "target"]


def test_bad_unit_fails_in_one_line_and_publishes_nothing(tmp_path):
    dumps = tmp_path / "d"
    for rank in range(3):
        d = dumps / "step0" / f"rank{rank}"
        d.mkdir(parents=True)
        (d / "dump.json").write_text('{"task": "statistics", "data": {}}' if rank != 1 else '{"task": ')
    with pytest.raises(Exception) as err:
        ingest(dumps, "x", store=tmp_path / "s", engine="ray", engine_options={"batch": 1})
    assert type(err.value).__name__ == "DumpFormatError"
    assert str(err.value).startswith(f"{dumps / 'step0' / 'rank1' / 'dump.json'}: invalid JSON")
    assert not (tmp_path / "s" / "runs.parquet").exists()
    assert not list((tmp_path / "s").rglob("part-*.parquet"))


def test_compare_on_ray_puts_the_verdicts_culprit_first(tmp_path, dump_writer):
    """As the local engine: the verdict's culprit (a weight 1 % off at the first op) tops `compare`, above a later
    op whose output differs far more (first by significance alone)."""
    import numpy as np

    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    store = str(tmp_path / "s")
    for run, scale, act in (("ref", 1.0, 0.5), ("t", 1.01, 2.5)):
        y = x @ (w * scale).T
        d = dump_writer(run, task="statistics")
        d.write(
            {
                "Functional.linear.0.forward": {"input_args": [x, w * scale], "output": [y]},
                "Functional.gelu.0.forward": {"input_args": [y], "output": [y * act]},
            }
        )
        ingest(d.root, run, store=store, jobs=1)
    runner = CliRunner()
    args = ["compare", "--target", "t", "--ref", "ref", "--store", store, "--json", "--top", "3"]
    rows = {
        e: json.loads(runner.invoke(main, [*args, *extra], catch_exceptions=False).output)["rows"]
        for e, extra in (("local", []), ("ray", ["--engine", "ray", "--batch", "1"]), ("alone", ["--no-culprit-first"]))
    }
    assert rows["alone"][0]["name"] == "Functional.gelu.0.forward.output.0"
    assert rows["ray"] == rows["local"]
    assert rows["ray"][0]["name"] == "Functional.linear.0.forward.input.1"
    assert rows["ray"][0]["detail"].startswith("the verdict's culprit")

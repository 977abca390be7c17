"""One line, never a traceback or a silent skip (issue 24): option ranges, skipped step folders, record names twice,
filters that match nothing, SIGINT/SIGTERM (exit 130), report leftovers, stale staging of dead ingests, the lock's
wait message, Ray's connection timeout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from dumpstore import lock
from dumpstore._ingest import ingest
from dumpstore.cli.main import main
from dumpstore.store import open_store
from helpers import SAMPLES

CLI = [sys.executable, "-m", "dumpstore.cli.main"]


def _invoke(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize(
    "option, words",
    [
        (["--sketch-m", "100"], "power of two"),
        (["--sketch-m", "0"], "power of two"),
        (["--sketch-m", "131072"], "power of two"),
        (["--sketch-m", "x"], "not an integer"),
        (["--sample-k", "-1"], "-1 is not in the range"),
        (["--jobs", "-3"], "-3 is not in the range"),
        (["--jobs", "0"], "0 is not in the range"),
    ],
)
def test_option_ranges_are_usage_errors(tmp_path, option, words):
    res = _invoke("ingest", SAMPLES / "ref_stats", "--run", "x", "--store", tmp_path / "s", *option)
    assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "s").exists()


def test_sample_k_zero_and_sketch_m_one_are_kept(tmp_path):
    res = _invoke("ingest", SAMPLES / "ref_stats", "--run", "x", "--store", tmp_path / "s", "--sample-k", "0")
    assert res.exit_code == 0, res.output
    assert open_store(tmp_path / "s").run_info("x")["sample_k"] == 0  # 0 given, 0 kept (not the default 64)


def test_skipped_step_folders_are_warnings(tmp_path):
    root = tmp_path / "dump"
    shutil.copytree(SAMPLES / "ref_stats", root)
    (root / "step7").mkdir()  # empty
    (root / "step8" / "rank0").mkdir(parents=True)  # no dump.json
    (root / "step8" / "rank0" / "notes.txt").write_text("x")
    (root / "step9").symlink_to(root / "step0", target_is_directory=True)  # a link: not followed
    res = _invoke("ingest", root, "--run", "x", "--store", tmp_path / "s")
    assert res.exit_code == 0, res.output
    warned = sorted(line for line in res.output.splitlines() if line.startswith("warning: "))
    assert warned == [
        f"warning: {root / 'step7'}: is empty; skipped",
        f"warning: {root / 'step8' / 'rank0'}: holds no dump.json, debug.json or tensor files; skipped",
        f"warning: {root / 'step9'}: is a link (not followed); skipped",
    ]


@pytest.mark.parametrize("layout", ["msprobe", "compact"])
def test_a_record_name_twice_is_a_warning(tmp_path, layout):
    root = tmp_path / "dump"
    shutil.copytree(SAMPLES / "ref_stats" / "step0", root)
    path = root / "rank0" / "dump.json"
    doc = json.loads(path.read_text())
    first, second = list(doc["data"])[:2]
    text = json.dumps(doc, indent=1) if layout == "msprobe" else json.dumps(doc)
    old, new = (
        (f'\n  "{second}": {{', f'\n  "{first}": {{') if layout == "msprobe" else (f'"{second}": {{', f'"{first}": {{')
    )
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    res = _invoke("ingest", root, "--run", "x", "--store", tmp_path / "s")
    assert res.exit_code == 0, res.output
    assert f"warning: {path}: record {first!r} appears 2 times; JSON keeps only the last" in res.output
    clean = _invoke("ingest", SAMPLES / "ref_stats", "--run", "y", "--store", tmp_path / "s")
    assert "appears" not in clean.output


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair") / "s"
    ingest(SAMPLES / "ref_stats", "ref", store=root, jobs=1)
    ingest(SAMPLES / "weight_1pct_stats", "target", store=root, jobs=1)
    return root


@pytest.mark.parametrize(
    "flag, value, listed", [("--module", "no.such", "Module.emb"), ("--op-type", "nosuch", "linear")]
)
def test_filters_that_match_nothing_list_what_exists(pair, flag, value, listed):
    res = _invoke("compare", "--target", "target", "--ref", "ref", "--store", pair, flag, value)
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert res.output.startswith(f"Error: {flag} {value!r} matches nothing") and listed in res.output
    ok = _invoke("compare", "--target", "target", "--ref", "ref", "--store", pair, flag, listed, "--top", "1")
    assert ok.exit_code == 0


def _interrupt(args: list[str], delay: float, sig: int) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    time.sleep(delay)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.processes
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_report_interrupted_leaves_no_part_file_and_one_line(pair, tmp_path, sig):
    out = tmp_path / "out"
    args = ["report", "--target", "target", "--ref", "ref", "--store", str(pair)]
    args += ["--csv", str(out / "r.csv"), "--html", str(out / "r.html")]
    for delay in (0.8, 1.6, 2.4):
        res = _interrupt(args, delay, sig)
        if res.returncode == 0:
            continue  # finished before the signal
        assert res.returncode == 130, res.stderr
        assert res.stderr.splitlines()[-1] == "Error: interrupted; the store is as it was before this command"
        assert "Traceback" not in res.stderr
        assert not list(out.glob("*.part")) if out.exists() else True


def test_ingest_interrupted_exits_130_and_leaves_nothing(tmp_path):
    store = tmp_path / "s"
    ingest(SAMPLES / "ref_stats", "good", store=store, jobs=1)
    for delay in (0.5, 1.0, 1.5):
        res = _interrupt(
            ["ingest", str(SAMPLES / "ref_tensor"), "--run", "new", "--store", str(store), "-j", "2"],
            delay,
            signal.SIGINT,
        )
        if res.returncode == 0:
            break
        assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
        assert open_store(store).run_names() == ["good"]
        assert not (store / ".ingests" / "run=new").exists() or not any((store / ".ingests" / "run=new").iterdir())


def test_stale_staging_of_a_dead_ingest_is_swept_by_the_next_lock(tmp_path):
    store = tmp_path / "s"
    ingest(SAMPLES / "ref_stats", "a", store=store, jobs=1)
    ghost = store / ".ingests" / "run=ghost" / "0123456789ab" / "tensors" / "step=0" / "rank=0"
    ghost.mkdir(parents=True)
    (ghost / "part-0123456789ab.parquet").write_bytes(b"half")  # an ingest of a new run killed mid-way
    ingest(SAMPLES / "ref_stats", "b", store=store, jobs=1)  # another run's ingest takes the locks
    assert not (store / ".ingests" / "run=ghost").exists()
    assert sorted(d.name for d in (store / ".ingests").iterdir()) == ["run=a", "run=b"]


def test_a_live_lock_is_never_described_as_left_without_record(tmp_path):
    path = tmp_path / "x.lock"
    with lock.hold(path, "test"):
        os.truncate(path, 0)  # the moment between taking the lock and writing the record
        assert lock._wait_message(path, "ingest") == "waiting: ingest: held by another process"


def test_ray_connect_timeout_is_one_line():
    pytest.importorskip("ray")
    res = subprocess.run(
        CLI
        + ["ingest", str(SAMPLES / "ref_stats"), "--run", "r", "--store", "/nonexistent/s", "--engine", "ray"]
        + ["--address", "127.0.0.1:1", "--connect-timeout", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1].startswith("Error: cannot reach Ray at 127.0.0.1:1 within 5 s")
    bad = _invoke("divergence", "--target", "a", "--ref", "b", "--engine", "ray", "--connect-timeout", "0")
    assert bad.exit_code == 2


def test_an_unreadable_stack_json_is_a_warning_not_a_hang(tmp_path):
    root = tmp_path / "dump"
    shutil.copytree(SAMPLES / "ref_stats" / "step0", root)
    (root / "rank0" / "stack.json").unlink()
    os.mkfifo(root / "rank0" / "stack.json")  # would block whoever opens it
    res = subprocess.run(
        CLI + ["ingest", str(root), "--run", "x", "--store", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert (
        res.stderr
        == f"warning: {root / 'rank0' / 'stack.json'}: not a regular file; not read; ingested without call stacks\n"
    )


@pytest.mark.ray
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_driver_leaves_no_ray_process_behind(tmp_path):
    """The local Ray a driver started ends with it, SIGKILL included (a reaper waits on a pipe only the driver
    writes to)."""
    pytest.importorskip("ray")
    script = tmp_path / "driver.py"
    script.write_text(
        "import json, os, time\n"
        "from dumpstore import engine_ray\n"
        "with engine_ray.session(None):\n"
        "    print(json.dumps([p for p, _ in engine_ray._descendants(os.getpid())]), flush=True)\n"
        "    time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert pids  # gcs_server, raylet, ...

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)]


def test_an_interrupt_duckdb_wrapped_is_an_interruption():
    """A KeyboardInterrupt raised while DuckDB runs Python code (a registered object's schema read, a UDF) comes
    out as DuckDB's own error with its name in the message (seen once in `report` under SIGINT: a traceback): the
    command takes it for the interruption it is (one line, exit 130); another DuckDB error is not one."""
    import duckdb

    from dumpstore.cli.main import _interrupted

    con = duckdb.connect()

    def stop(x: int) -> int:
        raise KeyboardInterrupt

    con.create_function("stop", stop, ["BIGINT"], "BIGINT")
    with pytest.raises(duckdb.Error) as wrapped:
        con.sql("select stop(1)").fetchall()
    assert "KeyboardInterrupt" in str(wrapped.value) and _interrupted(wrapped.value)
    with pytest.raises(duckdb.Error) as other:
        con.sql("select * from no_such_table").fetchall()
    assert not _interrupted(other.value)


def test_a_signal_in_polars_python_code_is_put_off():
    """Polars' Rust code panics on an exception raised in the Python it calls (a dtype's __init__): the handler
    tells such a frame from the command's own, so SIGTERM is raised again a moment later, outside it."""
    import polars

    from dumpstore.cli.main import _in_polars_callback

    inside = compile(
        "frame = sys._getframe()", os.path.join(os.path.dirname(polars.__file__), "datatypes", "x.py"), "exec"
    )
    scope: dict = {"sys": sys}
    exec(inside, scope)
    assert _in_polars_callback(scope["frame"]) is True
    assert _in_polars_callback(sys._getframe()) is False
    assert _in_polars_callback(None) is False

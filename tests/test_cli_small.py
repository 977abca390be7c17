"""Small CLI contracts: `runs` on a folder that is not a store is an error, -h works on every command,
`python -m dumpstore` is the command, and a side-by-side ingest says nothing about locks it waits a moment for."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings

import pytest
from click.testing import CliRunner

from dumpstore import lock
from dumpstore.cli.main import main
from dumpstore.errors import DumpstoreWarning
from helpers import SAMPLES


def test_runs_on_a_folder_that_is_not_a_store(tmp_path):
    res = CliRunner().invoke(main, ["runs", "--store", str(SAMPLES / "ref_stats")])
    assert res.exit_code == 1
    assert res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"Error: {SAMPLES / 'ref_stats'}: not a dumpstore store (no runs.parquet); ")


@pytest.mark.parametrize("command", [None, *sorted(main.commands)])
def test_dash_h_is_help(command):
    args = [command] if command else []
    short, long = CliRunner().invoke(main, [*args, "-h"]), CliRunner().invoke(main, [*args, "--help"])
    assert short.exit_code == 0 and short.output == long.output and short.output.startswith("Usage: ")


def test_python_m_dumpstore():
    proc = subprocess.run([sys.executable, "-m", "dumpstore", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("python -m dumpstore, version ")
    proc = subprocess.run([sys.executable, "-m", "dumpstore", "-h"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith("Usage: python -m dumpstore [OPTIONS] COMMAND [ARGS]...")


def _held_for(path, seconds: float) -> threading.Thread:
    ready = threading.Event()

    def hold():
        with lock.hold(path, "test lock"):
            ready.set()
            time.sleep(seconds)

    t = threading.Thread(target=hold)
    t.start()
    ready.wait(5)
    return t


@pytest.mark.parametrize("seconds,told", [(0.5, 0), (lock._QUIET + 0.6, 1)])
def test_a_short_wait_for_a_lock_is_not_announced(tmp_path, seconds, told):
    path = tmp_path / "lock"
    t = _held_for(path, seconds)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", DumpstoreWarning)
        with lock.hold(path, "test lock"):
            pass
    t.join()
    waits = [str(w.message) for w in got if "waiting" in str(w.message)]
    assert len(waits) == told, waits


def test_side_by_side_ingest_prints_no_lock_message(tmp_path):
    args = [str(SAMPLES / "ref_stats"), str(SAMPLES / "lr_stats"), str(SAMPLES / "ln_eps_stats")]
    runs = ["--run", "a", "--run", "b", "--run", "c"]
    res = CliRunner().invoke(main, ["ingest", *args, *runs, "--store", str(tmp_path / "s"), "-j", "3"])
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
    assert [line.split(":")[0] for line in res.stdout.splitlines()] == ["run a", "run b", "run c"]

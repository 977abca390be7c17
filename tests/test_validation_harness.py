"""The validation generators' output lock (``validation/harness.py``'s ``output_lock``): one generation at a time
writes an output folder; a second one stops with one line, before it removes or writes anything. Every set's
generator is run as a script against a folder this test holds (no torch run: each stops at the lock, seconds)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("validation_harness", ROOT / "validation" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

# every set's generator (sets 3 to 6 through harness.main), with the arguments of a small generation
GENERATORS = {
    "set1": ["validation/make_pairs.py", "--only", "llama_clean", "--modes", "stats"],
    "set2": ["validation/v2/make_pairs.py", "--only", "gemma_clean", "--modes", "stats"],
    "set6": ["validation/v6/make_pairs.py", "--only", "rwkv_clean", "--modes", "stats"],
    "cross": ["validation/cross/make_pairs.py", "--modes", "stats"],
    "longrun": ["validation/longrun/make_runs.py"],
}


def _held(out: Path, pid: int) -> str:
    return (
        "Error: %s is being written by another generation (pid %d, lock %s/.lock); wait for it to finish or pass "
        "another --out" % (out, pid, out)
    )


def test_a_second_lock_on_a_held_folder_stops_with_one_line(tmp_path):
    out = tmp_path / "new" / "data"
    with harness.output_lock(out) as path:
        assert path == out / ".lock" and path.read_text() == "%d\n" % os.getpid()
        with pytest.raises(SystemExit) as err, harness.output_lock(out):
            pass
        assert str(err.value) == _held(out, os.getpid())
    with harness.output_lock(out):  # released at the end of the block: taken again
        pass


def test_a_dead_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d\\n' % os.getpid()); print('held', flush=True); "
         "time.sleep(60)", str(tmp_path / ".lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as err, harness.output_lock(tmp_path):
            pass
        assert str(err.value) == _held(tmp_path, holder.pid)
    finally:
        holder.kill()
        holder.wait()
    with harness.output_lock(tmp_path):
        pass


@pytest.mark.parametrize("generator", sorted(GENERATORS))
def test_every_generator_stops_on_a_folder_another_generation_holds(tmp_path, generator):
    out = tmp_path / "data"
    kept = out / "stats" / "a_run" / "step0" / "rank0" / "dump.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    script, *args = GENERATORS[generator]
    with harness.output_lock(out):
        p = subprocess.run(
            [sys.executable, str(ROOT / script), "--out", str(out), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert (p.returncode, p.stdout, p.stderr) == (1, "", _held(out, os.getpid()) + "\n")
    assert sorted(str(f.relative_to(out)) for f in out.rglob("*")) == [
        ".lock",
        "stats",
        "stats/a_run",
        "stats/a_run/step0",
        "stats/a_run/step0/rank0",
        "stats/a_run/step0/rank0/dump.json",
    ]

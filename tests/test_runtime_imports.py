"""The runtime package needs no framework: with torch, torch_npu, msprobe and mindspore made unimportable, every
module imports and the commands run end to end on a tensor dump (.pt files read by dumpstore's own reader)."""

from __future__ import annotations

import subprocess
import sys

from helpers import SAMPLES

_PROBE = r"""
import importlib, pkgutil, sys

BLOCKED = ("torch", "torch_npu", "msprobe", "mindspore")


class Blocker:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
skip = {
    "dumpstore.engine_ray",  # the ray extra
    "dumpstore.analysis.distributed",
    "dumpstore.analysis.replay.preload",  # replay runs the recorded calls with torch, in the device's environment
}
for name in ("dumpstore", "dumpstore.analysis", "dumpstore.cli"):
    pkg = importlib.import_module(name)
    for m in pkgutil.walk_packages(pkg.__path__, name + "."):
        if m.name not in skip and not m.name.endswith("__main__"):
            importlib.import_module(m.name)

from dumpstore.cli.main import main

store, ref, target, out = sys.argv[1:5]
for args in (
    ["ingest", ref, target, "--run", "ref", "--run", "target", "--store", store, "-j", "1"],
    ["divergence", "--target", "target", "--ref", "ref", "--exact", "--store", store],
    ["report", "--target", "target", "--ref", "ref", "--csv", out, "--store", store],
):
    try:
        main(args, standalone_mode=False)
    except SystemExit as exc:
        assert not exc.code, (args, exc.code)
print("LOADED", ",".join(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)))
"""


def test_runtime_imports_no_framework(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _PROBE,
            str(tmp_path / "store"),
            str(SAMPLES / "ref_tensor"),
            str(SAMPLES / "weight_1pct_tensor"),
            str(tmp_path / "report.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CULPRIT (parameter)" in proc.stdout
    assert proc.stdout.rstrip().endswith("LOADED"), proc.stdout[-500:]
    assert (tmp_path / "report.csv").stat().st_size > 0

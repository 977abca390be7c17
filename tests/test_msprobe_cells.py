"""Every msprobe-named column of `dumpstore report --csv` equals what the installed `msprobe compare` 26.2.0
writes for the same pair, cell for cell, in the three dump modes (statistics, tensor, md5): the summary cells
(`None`, `True`/`False`, `Nan`, ` inf`), the statistics diffs and relative errors, the six tensor metrics
(`unsupported` for non-tensor and null leaves), `Result` / `Err_message` by msprobe's own rules, `Data_name`,
`Requires_grad Consistent`.  Numbers agree within 1e-6 relative; text exactly.  Pairs: real 26.2.0 dumps
(sample_dumps, tests/data/msprobe) and one md5 pair with a record removed from the bench (made here).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.report import write_csv
from dumpstore.store import open_store
from helpers import MSPROBE, SAMPLES, msprobe_command

pytestmark = pytest.mark.msprobe


def _md5(step: str) -> Path:
    return next((MSPROBE / "v26_md5" / step).glob("proc*")) / "dump.json"


def _proc(case: str, step: str) -> Path:
    return next((MSPROBE / case / step).glob("proc*")) / "dump.json"


def _stats(case: str) -> Path:
    return SAMPLES / case / "step0/rank0/dump.json"


# pair -> (target dump.json, reference dump.json); "md5_unmatched" is made by the fixture
PAIRS = {
    "stats_weight_1pct": (_stats("weight_1pct_stats"), _stats("ref_stats")),
    "stats_overflow": (_stats("overflow_stats"), _stats("ref_stats")),
    "stats_bf16": (_stats("bf16_stats"), _stats("ref_stats")),
    "tensor_weight_1pct": (_stats("weight_1pct_tensor"), _stats("ref_tensor")),
    "tensor_gelu_tanh": (_stats("gelu_tanh_tensor"), _stats("ref_tensor")),
    "md5_step1_vs_step0": (_md5("step1"), _md5("step0")),
    "md5_unmatched": (_md5("step1"), None),
    # MindSpore (msprobe compare imports mindspore for these): `mindspore.dtype` arguments print as <class 'str'>
    "stats_mindspore": (_proc("ms_statistics", "step1"), _proc("ms_statistics", "step0")),
}
NEEDS_MINDSPORE = {"stats_mindspore"}


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for name in ("dump.json", "stack.json", "construct.json"):
        if (src.parent / name).exists():
            shutil.copy(src.parent / name, dst / name)
    if (src.parent / "dump_tensor_data").is_dir():
        shutil.copytree(src.parent / "dump_tensor_data", dst / "dump_tensor_data")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Each pair copied into plain folders t/ and r/ (step 0, rank 0 both sides) and `msprobe compare` run on
    them, all in parallel; returns the base folder."""
    cmd = msprobe_command()
    if cmd is None:
        pytest.skip("mindstudio-probe (msprobe) is not installed")
    base = tmp_path_factory.mktemp("msprobe_cells")
    procs = {}
    for pair, (tgt, ref) in PAIRS.items():
        if pair in NEEDS_MINDSPORE and importlib.util.find_spec("mindspore") is None:
            continue
        _copy(tgt, base / pair / "t")
        if ref is None:  # the reference without the first gelu record: its rows are unmatched in the target
            _copy(tgt.parent.parent.parent / "step0" / tgt.parent.name / "dump.json", base / pair / "r")
            doc = json.loads((base / pair / "r/dump.json").read_text())
            del doc["data"][next(k for k in doc["data"] if ".gelu." in k)]
            (base / pair / "r/dump.json").write_text(json.dumps(doc, indent=1))
        else:
            _copy(ref, base / pair / "r")
        log = open(base / pair / "log", "wb")  # noqa: SIM115 - closed after wait
        args = ["compare", "-tp", str(base / pair / "t/dump.json"), "-gp", str(base / pair / "r/dump.json")]
        procs[pair] = (subprocess.Popen([*cmd, *args, "-o", str(base / pair / "ms")], stdout=log, stderr=log), log)
    for pair, (p, log) in procs.items():
        code = p.wait(timeout=300)
        log.close()
        assert code == 0, (base / pair / "log").read_text(errors="replace")[-2000:]
    return base


def _read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _same(ours: str, theirs: str) -> bool:
    if ours == theirs:
        return True
    try:
        a, b = float(ours.rstrip("%")), float(theirs.rstrip("%"))
    except ValueError:
        return False
    if ours.endswith("%") != theirs.endswith("%"):
        return False
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_every_msprobe_cell(pair, pairs):
    base = pairs / pair
    if not base.exists():
        pytest.skip("mindspore is not installed: msprobe compare cannot read MindSpore dumps")
    for side in ("t", "r"):
        ingest(base / side, side, store=base / "store", jobs=1)
    st = open_store(base / "store")
    tensor = pair.startswith("tensor")
    write_csv(compare_runs(st, "t", "r", exact=tensor), base / "ours.csv", store=st)
    [found] = list((base / "ms").glob("compare_result_*.csv"))
    theirs, ours = _read(found), {r["NPU Name"]: r for r in _read(base / "ours.csv")}
    assert len(theirs) > 300
    assert {r["NPU Name"] for r in theirs} <= set(ours)
    bad = [
        (r["NPU Name"], col, ours[r["NPU Name"]][col], cell)
        for r in theirs
        for col, cell in r.items()
        if not _same(ours[r["NPU Name"]][col], cell)
    ]
    assert not bad, f"{len(bad)} cells differ (row, column, dumpstore, msprobe), first {bad[:5]}"
    if pair == "md5_unmatched":
        assert any(r["Bench Name"] == "N/A" for r in theirs)

"""Every msprobe-named column of `dumpstore report --csv` equals what the installed `msprobe compare` 26.2.0
writes for the same pair, cell for cell, in the three dump modes (statistics, tensor, md5): the summary cells
(`None`, `True`/`False`, `Nan`, ` inf`), the statistics diffs and relative errors, the six tensor metrics
(`unsupported` for non-tensor and null leaves), `Result` / `Err_message` by msprobe's own rules, `Data_name`,
`Requires_grad Consistent`.  Numbers agree within 1e-6 relative; text exactly.  Pairs: real 26.2.0 dumps
(sample_dumps, tests/data/msprobe), one md5 pair with a record removed from the bench (made here), and the
matrix of tests/msprobe_matrix.py: one small network dumped by msprobe on CPU under L0, L1 and mix, statistics,
md5 and tensor mode, forward-only and backward-only, API and module lists, a scope range, with a changed weight,
an extra call and a missing call (made once into tests/.data/msprobe_matrix/, git-ignored, with msprobe's own
compare results; marker slow: `pytest -m slow tests/test_msprobe_cells.py`).  Where an extra or missing call
makes dumpstore pair rows otherwise than msprobe (msprobe pairs by name, backward calls renumbered by their
backward order), msprobe's columns follow msprobe's pairing and `dumpstore_paired_with` names dumpstore's.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.report import write_csv
from dumpstore.store import open_store
from helpers import MSPROBE, ROOT, SAMPLES, msprobe_command

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
    # an extra gelu call / a missing masked_fill: dumpstore pairs the later calls by sequence, msprobe by name
    "stats_extra_gelu": (_stats("extra_gelu_stats"), _stats("ref_stats")),
    "stats_no_mask": (_stats("no_mask_stats"), _stats("ref_stats")),
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


def _diff(base: Path, tdir: Path, rdir: Path, found: Path, tensor: bool) -> list[dict[str, str]]:
    """Our CSV for tdir/ against rdir/ (ingested into base/store) diffed with msprobe's `found`, cell for cell in
    msprobe's columns; returns our rows."""
    for side, folder in (("t", tdir), ("r", rdir)):
        ingest(folder, side, store=base / "store", jobs=1)
    st = open_store(base / "store")
    write_csv(compare_runs(st, "t", "r", exact=tensor), base / "ours.csv", store=st)
    theirs, mine = _read(found), _read(base / "ours.csv")
    ours = {r["NPU Name"]: r for r in mine}
    assert theirs
    assert {r["NPU Name"] for r in theirs} <= set(ours)
    bad = [
        (r["NPU Name"], col, ours[r["NPU Name"]][col], cell)
        for r in theirs
        for col, cell in r.items()
        if not _same(ours[r["NPU Name"]][col], cell)
    ]
    assert not bad, f"{len(bad)} cells differ (row, column, dumpstore, msprobe), first {bad[:5]}"
    return mine


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_every_msprobe_cell(pair, pairs):
    base = pairs / pair
    if not base.exists():
        pytest.skip("mindspore is not installed: msprobe compare cannot read MindSpore dumps")
    [found] = list((base / "ms").glob("compare_result_*.csv"))
    ours = _diff(base, base / "t", base / "r", found, pair.startswith("tensor"))
    assert len(_read(found)) > 300
    if pair == "md5_unmatched":
        assert any(r["Bench Name"] == "N/A" for r in _read(found))
    if pair == "stats_extra_gelu":  # the second gelu: msprobe pairs it by name, dumpstore with the reference's first
        row = next(r for r in ours if r["NPU Name"] == "Functional.gelu.1.forward.output.0")
        assert (row["Bench Name"], row["dumpstore_paired_with"]) == (
            "Functional.gelu.1.forward.output.0",
            "Functional.gelu.0.forward.output.0",
        )
        assert row["dumpstore_status"] == "pass"


# ---------------------------------------------------------------------------------------------------------------
# the matrix: tests/msprobe_matrix.py's real dumps under many configurations, with msprobe's own compare results
# ---------------------------------------------------------------------------------------------------------------
MATRIX_SCRIPT = ROOT / "tests" / "msprobe_matrix.py"


def _matrix_module():
    spec = importlib.util.spec_from_file_location("msprobe_matrix", MATRIX_SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MATRIX = _matrix_module()


@pytest.fixture(scope="session")
def matrix():
    """The matrix's dumps and `msprobe compare` results, made once into tests/.data/msprobe_matrix/{hash of the
    generator and msprobe's version}/ (runs: two at a time; compares: four at a time)."""
    cmd = msprobe_command()
    if cmd is None or importlib.util.find_spec("torch") is None:
        pytest.skip("mindstudio-probe (msprobe) and torch are needed to make the dumps")
    version = importlib.metadata.version("mindstudio-probe")
    stamp = hashlib.sha256(MATRIX_SCRIPT.read_bytes() + version.encode()).hexdigest()[:12]
    out = ROOT / "tests" / ".data" / "msprobe_matrix" / stamp
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        MATRIX.generate(out / "runs", MATRIX.runs(), jobs=2)

        def compare(pair: str) -> None:
            dest = out / "compare" / pair
            if list(dest.glob("compare_result_*.csv")):
                return
            tgt, ref = (MATRIX.dump_json(out / "runs", run) for run in MATRIX.PAIRS[pair])
            args = [*cmd, "compare", "-tp", str(tgt), "-gp", str(ref), "-o", str(dest)]
            done = subprocess.run(args, capture_output=True, timeout=600)
            assert done.returncode == 0, done.stdout.decode(errors="replace")[-2000:]

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(compare, MATRIX.PAIRS))
    return out


@pytest.mark.slow  # made fresh: 37 msprobe runs and 23 compares, about 12 minutes on 2 busy cores; cached: 1.5
@pytest.mark.parametrize("pair", sorted(MATRIX.PAIRS))
def test_matrix_cells(pair, matrix, tmp_path):
    tgt, ref = (MATRIX.dump_json(matrix / "runs", run).parent for run in MATRIX.PAIRS[pair])
    [found] = list((matrix / "compare" / pair).glob("compare_result_*.csv"))
    ours = _diff(tmp_path, tgt, ref, found, pair.startswith("tensor"))
    if pair in REPAIRED:  # the calls after the extra / missing one renumber: the two pairings differ there
        assert any(r["Bench Name"] != r["dumpstore_paired_with"] for r in ours if r["NPU Name"] != "N/A")


# matrix pairs where msprobe pairs some rows otherwise than dumpstore (an extra or missing forward gelu)
REPAIRED = {"stats_mix_extra", "stats_L1_missing", "md5_mix_extra", "tensor_mix_extra", "stats_list_extra"}

"""The report CSV's mode columns equal msprobe's: statistics-mode Max/Min/Mean/NormRelativeErr and md5-mode
NPU MD5 / BENCH MD5 / Result, cell by cell, on real 26.2.0 pairs:
- against tests/data/msprobe_csv_expected.json (msprobe's cells, written by
  `DUMPSTORE_REGEN=1 pytest tests/test_msprobe_csv.py -k regenerate`), checked anywhere;
- against the installed `msprobe compare` run now on the same files (skipped without mindstudio-probe).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.msprobe_csv import columns, stat_relative_error
from dumpstore.analysis.report import CSV_COLUMNS, write_csv
from dumpstore.store import open_store
from helpers import DATA, MSPROBE, SAMPLES, msprobe_cli, start_msprobe_compare

EXPECTED = DATA / "msprobe_csv_expected.json"
PAIR_DATA = DATA / "msprobe_csv_pairs"
STATS = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")
MD5 = ("NPU MD5", "BENCH MD5", "Result")


def _md5_dump(step: str) -> Path:
    return next((MSPROBE / "v26_md5" / step).glob("proc*")) / "dump.json"


# pair -> (target dump.json, reference dump.json, the columns checked)
PAIRS = {
    "weight_1pct_stats": (
        SAMPLES / "weight_1pct_stats/step0/rank0/dump.json",
        SAMPLES / "ref_stats/step0/rank0/dump.json",
        STATS,
    ),
    "overflow_stats": (
        SAMPLES / "overflow_stats/step0/rank0/dump.json",
        SAMPLES / "ref_stats/step0/rank0/dump.json",
        STATS,
    ),
    "md5_step1_vs_step0": (_md5_dump("step1"), _md5_dump("step0"), MD5),
    # hand-made: a null Mean against 1.0, bool Min True against False, a null Norm (msprobe: 'Diff')
    "null_bool_stats": (PAIR_DATA / "null_bool/t/dump.json", PAIR_DATA / "null_bool/r/dump.json", STATS),
}


def _ours(pair: str, tmp: Path) -> dict[str, list[str]]:
    """Our CSV cells per NPU Name; each dump.json copied into a plain folder (step 0, rank 0 on both sides)."""
    tgt, ref, cols = PAIRS[pair]
    for side, src in (("t", tgt), ("r", ref)):
        (tmp / side).mkdir(parents=True)
        for name in ("dump.json", "stack.json", "construct.json"):
            if (src.parent / name).exists():
                shutil.copy(src.parent / name, tmp / side / name)
        ingest(tmp / side, side, store=tmp / "store", jobs=1)
    st = open_store(tmp / "store")
    write_csv(compare_runs(st, "t", "r"), tmp / "out.csv", store=st)
    with open(tmp / "out.csv", newline="") as fh:
        return {r["NPU Name"]: [r[c] for c in cols] for r in csv.DictReader(fh) if r["NPU Name"] != "N/A"}


def _msprobe_cells(pair: str, out: Path) -> dict[str, list[str]]:
    tgt, ref, cols = PAIRS[pair]
    [found] = list(out.glob("compare_result_*.csv"))
    with open(found, newline="") as fh:
        return {r["NPU Name"]: [r[c] for c in cols] for r in csv.DictReader(fh)}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_mode_cells_match_checked_in_msprobe(pair, tmp_path):
    expected = json.loads(EXPECTED.read_text())["pairs"][pair]
    ours = _ours(pair, tmp_path)
    assert len(expected) > (1 if pair == "null_bool_stats" else 300)
    bad = [(n, ours.get(n), exp) for n, exp in expected.items() if ours.get(n) != exp]
    assert not bad, f"{len(bad)} rows differ, first {bad[:5]}"


@pytest.fixture(scope="module")
def msprobe_runs(tmp_path_factory):
    cli = msprobe_cli()
    if cli is None:
        pytest.skip("mindstudio-probe (msprobe) is not installed")
    base = tmp_path_factory.mktemp("msprobe_csv")
    procs = {}
    for pair, (tgt, ref, _) in PAIRS.items():
        (base / pair).mkdir()
        procs[pair] = start_msprobe_compare(cli, tgt, ref, base / pair, base / pair / "log", base)
    for pair, p in procs.items():
        assert p.wait(timeout=300) == 0, (base / pair / "log").read_text(errors="replace")[-2000:]
    return base


@pytest.mark.msprobe
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_mode_cells_match_msprobe_now(pair, msprobe_runs, tmp_path):
    expected = _msprobe_cells(pair, msprobe_runs / pair)
    ours = _ours(pair, tmp_path)
    bad = [(n, ours.get(n), exp) for n, exp in expected.items() if ours.get(n) != exp]
    assert not bad, f"{len(bad)} rows differ, first {bad[:5]}"


@pytest.mark.msprobe
@pytest.mark.skipif(not os.environ.get("DUMPSTORE_REGEN"), reason="set DUMPSTORE_REGEN=1 to rewrite the file")
def test_regenerate_expected(msprobe_runs):
    from importlib import metadata

    doc = {
        "msprobe": metadata.version("mindstudio-probe"),
        "command": "msprobe compare -tp <target dump.json> -gp <reference dump.json>",
        "pairs": {pair: _msprobe_cells(pair, msprobe_runs / pair) for pair in sorted(PAIRS)},
    }
    EXPECTED.write_text(json.dumps(doc, sort_keys=True) + "\n")


def test_columns_per_mode():
    stats, md5 = columns(CSV_COLUMNS, "statistics"), columns(CSV_COLUMNS, "md5")
    at = stats.index("MaxRelativeErr")
    assert stats[at : at + 4] == STATS
    assert md5[md5.index("Requires_grad Consistent") - 2 : md5.index("Requires_grad Consistent")] == MD5[:2]
    assert columns(CSV_COLUMNS, "tensor") == CSV_COLUMNS


@pytest.mark.parametrize(
    "npu, bench, cell",
    [
        (1.0, 1.0, "0"),
        (None, None, "0"),
        (float("nan"), float("nan"), "0"),
        (1.5, 0, "inf"),
        (1.0, 0.5, "100.0%"),
        (None, 1.0, "Diff"),
        (float("nan"), 1.0, "Nan"),
        (float("inf"), 1.0, "inf"),
        (1.0, float("inf"), "-inf"),
        (float("-inf"), 2.0, "-inf"),
        (1.0, float("-inf"), "inf"),
        (True, False, "Diff"),
        ("cpu:0", "npu:0", "N/A"),
        ("cpu:0", 3, "Diff"),
        (2.0, 4.0, "50.0%"),
    ],
)
def test_stat_relative_error_cases(npu, bench, cell):
    """msprobe 26.x CalcStatsDiff, case by case (MSPROBE_FORMAT.md 5.5)."""
    assert stat_relative_error(npu, bench) == cell

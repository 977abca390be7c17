"""Tests for dumpstore.analysis.exact: exact metrics from the tensor files (`compare_runs(..., exact=True)`).

Three layers, on the bundled msprobe 26.2.0 sample dumps (sample_dumps/*_tensor):
- the real `msprobe compare` on the same step folders, cell by cell (skipped without mindstudio-probe);
- tests/data/exact_msprobe_compare_expected.json, msprobe's cells for weight_1pct_tensor vs ref_tensor step 0,
  written by `DUMPSTORE_REGEN=1 pytest tests/test_exact.py -k regenerate` (needs msprobe), checked anywhere;
- the sketch estimate of rel_l2 (compare without exact) against the exact value, within its stated error bar.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from dumpstore._ingest import IngestOptions, ingest
from dumpstore.analysis import metrics
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.exact import MSPROBE_COLUMNS, NEW_SCHEMA
from dumpstore.store import open_store
from helpers import msprobe_cli, start_msprobe_compare

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_dumps"
EXPECTED = Path(__file__).resolve().parent / "data" / "exact_msprobe_compare_expected.json"
REF = "ref_tensor"
TARGETS = ("weight_1pct_tensor", "bf16_tensor", "gelu_tanh_tensor")
EXPECTED_TARGET = "weight_1pct_tensor"
SKETCH_TARGETS = ("weight_1pct_tensor", "bf16_tensor")
SMALL_M = 64  # a second store with a small sketch, so that most tensors are estimated, not exact
REL_TOL, ABS_TOL = 1e-6, 1e-9
KEYS = ["step", "rank", "source", "name"]
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


# ---------------------------------------------------------------- msprobe, started early in the background


def _start_msprobe(cli: str, target: str, out: Path) -> subprocess.Popen:
    """`msprobe compare` of step 0: it pairs the rank folders of two step folders (a rank folder is refused)."""
    out.mkdir(parents=True, exist_ok=True)
    step0 = SAMPLES / target / "step0", SAMPLES / REF / "step0"
    return start_msprobe_compare(cli, *step0, out / "result", out / "msprobe.log", out)


class MsprobeRuns:
    """Background `msprobe compare` runs, one per target, collected on first use."""

    def __init__(self, cli: str | None, targets: list[str], base: Path):
        self.cli, self.base = cli, base
        self.procs = {t: _start_msprobe(cli, t, base / t) for t in targets} if cli else {}

    def csv_rows(self, target: str) -> dict[str, dict]:
        if self.cli is None:
            pytest.skip("mindstudio-probe (msprobe) is not installed")
        proc = self.procs.get(target) or _start_msprobe(self.cli, target, self.base / target)
        self.procs[target] = proc
        rc = proc.wait(timeout=300)
        log = (self.base / target / "msprobe.log").read_text(errors="replace")
        found = sorted((self.base / target / "result").glob("compare_result_rank0_*.csv"))
        assert rc == 0 and len(found) == 1, f"msprobe compare failed (rc {rc}):\n{log[-3000:]}"
        return _read_msprobe_csv(found[0])

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _read_msprobe_csv(path: Path) -> dict[str, dict]:
    """{NPU Name: {"files": both sides had a tensor file, "cells": the six metric cells as written}}."""
    import pandas as pd

    df = pd.read_csv(path, keep_default_na=False, dtype=str)
    rows: dict[str, dict] = {}
    for rec in df.to_dict("records"):
        names = ast.literal_eval(rec["Data_name"])
        rows[rec["NPU Name"]] = {
            "files": all(n != "-1" for n in names),
            "cells": [rec[c] for c in metrics.TENSOR_COLUMNS],
        }
    assert len(rows) == len(df), f"{path}: NPU Name is not unique"
    return rows


@pytest.fixture(scope="module")
def msprobe_runs(request, tmp_path_factory):
    wanted = [
        t
        for t in TARGETS
        if any(
            it.get_closest_marker("msprobe") and it.module is request.module and t in it.name
            for it in request.session.items
        )
    ]
    runs = MsprobeRuns(msprobe_cli(), wanted, tmp_path_factory.mktemp("msprobe"))
    yield runs
    runs.close()


# ---------------------------------------------------------------- stores and comparisons


@pytest.fixture(scope="module")
def store(msprobe_runs, tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    for run in (REF, *TARGETS):
        ingest(SAMPLES / run, run, store=path)
    return open_store(path)


@pytest.fixture(scope="module")
def exact_cmp(store) -> dict[str, pl.DataFrame]:
    return {t: compare_runs(store, t, REF, exact=True).rows for t in TARGETS}


@pytest.fixture(scope="module")
def sketch_cmp(store) -> dict[str, pl.DataFrame]:
    return {t: compare_runs(store, t, REF).rows for t in SKETCH_TARGETS}


def _candidates(rows: pl.DataFrame) -> pl.Expr:
    return (
        (pl.col("kind") == "tensor")
        & (pl.col("ref_kind") == "tensor")
        & pl.col("data_name").is_not_null()
        & pl.col("ref_data_name").is_not_null()
        & (pl.col("file_status") == "loaded")
        & (pl.col("ref_file_status") == "loaded")
    )


def _step0(rows: pl.DataFrame) -> pl.DataFrame:
    return rows.filter((pl.col("step") == 0) & (pl.col("rank") == 0) & (pl.col("source") == ""))


# ---------------------------------------------------------------- cell comparison


def _number(cell: str) -> float | None:
    return float(cell) if _NUMBER.fullmatch(cell.strip()) else None


def _check_cells(rows: pl.DataFrame, expected: dict[str, dict], label: str) -> float:
    """Our msprobe_* cells against msprobe's; returns the worst relative difference of numeric cells."""
    ours = {
        r["name"]: [r[c] for c in MSPROBE_COLUMNS.values()]
        for r in _step0(rows).select(["name", *MSPROBE_COLUMNS.values()]).iter_rows(named=True)
    }
    problems, worst, checked = [], 0.0, 0
    for name, exp in expected.items():
        got = ours.get(name)
        if got is None or got[0] is None:
            if exp["files"]:
                problems.append(f"{name}: msprobe compared two tensor files, dumpstore has no exact cells")
            continue
        for col, g, e in zip(metrics.TENSOR_COLUMNS, got, exp["cells"]):
            gn, en = _number(g), _number(e)
            if gn is not None and en is not None:
                if not math.isclose(gn, en, rel_tol=REL_TOL, abs_tol=ABS_TOL):
                    problems.append(f"{name} {col}: dumpstore {g} vs msprobe {e}")
                if gn != en:
                    worst = max(worst, abs(gn - en) / max(abs(en), 1e-300))
            elif g != e:
                problems.append(f"{name} {col}: dumpstore {g!r} vs msprobe {e!r}")
        checked += 1
    extra = [n for n, g in ours.items() if g[0] is not None and n not in expected]
    problems += [f"{n}: dumpstore has exact cells for a row msprobe does not list" for n in extra]
    assert not problems, f"{label}: {len(problems)} differences:\n" + "\n".join(problems[:30])
    assert checked >= 100, f"{label}: only {checked} rows compared"
    return worst


@pytest.mark.msprobe
@pytest.mark.parametrize("target", TARGETS)
def test_cells_match_msprobe(target, exact_cmp, msprobe_runs) -> None:
    expected = msprobe_runs.csv_rows(target)
    _check_cells(exact_cmp[target], expected, f"{target} vs {REF}")


def _fingerprint(target: str) -> dict[str, str]:
    return {
        side: hashlib.sha256((SAMPLES / run / "step0" / "rank0" / "dump.json").read_bytes()).hexdigest()
        for side, run in (("target", target), ("golden", REF))
    }


def test_cells_match_checked_in_expected(exact_cmp) -> None:
    if not EXPECTED.exists():
        pytest.fail(f"{EXPECTED} missing; write it with DUMPSTORE_REGEN=1 pytest tests/test_exact.py -k regenerate")
    data = json.loads(EXPECTED.read_text())
    assert data["target"] == EXPECTED_TARGET and data["golden"] == REF
    assert data["columns"] == list(metrics.TENSOR_COLUMNS)
    if data["dump_json_sha256"] != _fingerprint(EXPECTED_TARGET):
        pytest.fail(
            f"sample_dumps/{EXPECTED_TARGET} or {REF} changed since {EXPECTED.name} was written; "
            "regenerate it: DUMPSTORE_REGEN=1 pytest tests/test_exact.py -k regenerate"
        )
    _check_cells(exact_cmp[EXPECTED_TARGET], data["rows"], f"{EXPECTED.name}")


@pytest.mark.msprobe
@pytest.mark.skipif(os.environ.get("DUMPSTORE_REGEN") != "1", reason="set DUMPSTORE_REGEN=1 to regenerate")
def test_regenerate_expected_weight_1pct_tensor(msprobe_runs) -> None:
    rows = msprobe_runs.csv_rows(EXPECTED_TARGET)
    data = {
        "generator": "DUMPSTORE_REGEN=1 pytest tests/test_exact.py -k regenerate",
        "msprobe": metadata.version("mindstudio-probe"),
        "command": f"msprobe compare -tp sample_dumps/{EXPECTED_TARGET}/step0 -gp sample_dumps/{REF}/step0",
        "target": EXPECTED_TARGET,
        "golden": REF,
        "dump_json_sha256": _fingerprint(EXPECTED_TARGET),
        "columns": list(metrics.TENSOR_COLUMNS),
    }
    lines = [json.dumps(data, indent=1)[:-2] + ',\n "rows": {']
    lines.append(",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in rows.items()))
    EXPECTED.parent.mkdir(parents=True, exist_ok=True)
    EXPECTED.write_text("\n".join(lines) + "\n }\n}\n")


# ---------------------------------------------------------------- the columns exact=True sets


@pytest.mark.parametrize("target", SKETCH_TARGETS)
def test_exact_rows_and_untouched_rows(target, exact_cmp, sketch_cmp) -> None:
    ex, sk = exact_cmp[target], sketch_cmp[target]
    assert [c for c in ex.columns if c not in NEW_SCHEMA] == sk.columns and set(NEW_SCHEMA) <= set(ex.columns)
    assert ex.height == sk.height
    cand = _candidates(ex)
    hit, rest = ex.filter(cand), ex.filter(~cand)
    assert hit.height >= 300 and rest.height > 0
    # rows without two tensor files: unchanged, new columns null
    order = [*KEYS, "ref_name"]
    assert_frame_equal(
        rest.select(sk.columns).sort(order, nulls_last=True),
        sk.filter(~_candidates(sk)).sort(order, nulls_last=True),
        check_exact=True,
    )
    assert rest.select(pl.all_horizontal([pl.col(c).is_null() for c in NEW_SCHEMA]).all()).item()
    # rows with two files: exact values and a fresh verdict
    assert set(hit["err_source"]) == {"exact"} and set(hit["err_bound"]) == {0.0}
    assert hit.select(
        pl.all_horizontal(
            [pl.col(c).is_not_null() for c in ("msprobe_cosine", "msprobe_message", "err", "severity")]
        ).all()
    ).item()
    for r in hit.iter_rows(named=True):
        if r["tol"] > 0:
            assert r["severity"] == pytest.approx(r["err"] / r["tol"], rel=1e-12)
        else:  # integer tensors: any difference diverges
            assert r["severity"] == (0.0 if r["err"] == 0 else math.inf)
        diverged = r["err"] > r["tol"] or r["nonfinite_mismatch"]
        assert r["status"] == ("diverged" if diverged else "pass"), r["name"]
        if r["euc_dist"] is not None:
            assert float(r["msprobe_euc_dist"]) == r["euc_dist"]
        for col in ("max_abs_err", "max_rel_err", "one_thousandth", "five_thousandth"):
            cell = r[f"msprobe_{col}"]
            if _number(cell) is not None:
                assert float(cell) == pytest.approx(r[col], rel=1e-9, abs=1e-12), (r["name"], col)


def test_masked_fill_output_compares_finite_part(exact_cmp) -> None:
    """The causal mask's -inf sits at the same positions in both runs: no mismatch, finite part compared."""
    rows = exact_cmp["weight_1pct_tensor"].filter(
        pl.col("name").str.starts_with("Tensor.masked_fill.") & pl.col("name").str.contains(r"forward\.output\.0$")
    )
    assert rows.height >= 1
    for r in rows.iter_rows(named=True):
        assert r["has_neginf"] and r["err_source"] == "exact" and not r["nonfinite_mismatch"]
        assert math.isfinite(r["err"]) and _number(r["msprobe_cosine"]) is not None


# ---------------------------------------------------------------- sketch estimate vs exact


@pytest.fixture(scope="module")
def small_sketch_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("store_m64")
    with warnings.catch_warnings():
        # the causal mask's +inf and -inf share sketch buckets at small M (nan buckets); such a tensor's
        # non-finite norm keeps compare from using its sketch anyway
        warnings.simplefilter("ignore", RuntimeWarning)
        for run in (REF, *SKETCH_TARGETS):
            ingest(SAMPLES / run, run, store=path, options=IngestOptions(sketch_m=SMALL_M))
    return open_store(path)


def _sketch_vs_exact(sk: pl.DataFrame, ex: pl.DataFrame, m: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    a = sk.filter(pl.col("err_source") == "sketch").select([*KEYS, "numel", "err", "err_bound"])
    b = ex.filter(pl.col("err_source") == "exact").select([*KEYS, pl.col("err").alias("exact")])
    assert a.select(KEYS).is_unique().all() and b.select(KEYS).is_unique().all()
    j = a.join(b, on=KEYS, how="inner")
    return j.filter(pl.col("numel") > m), j.filter(pl.col("numel") <= m)


def _check_sketch(sk: pl.DataFrame, ex: pl.DataFrame, m: int, label: str) -> float:
    big, small = _sketch_vs_exact(sk, ex, m)
    # numel <= M: the sketch is the signed tensor itself, so the estimate is exact
    assert small.height > 0 and set(small["err_bound"]) == {0.0}
    bad = small.filter((pl.col("err") - pl.col("exact")).abs() > 1e-9 * pl.col("exact"))
    assert bad.height == 0, f"{label}: exact-size sketches differ from exact rel_l2:\n{bad}"
    # numel > M: an estimate with relative error bar err_bound = sqrt(2/M)
    # (tensors holding NaN/Inf: from the buckets finite in both runs, sqrt(2/buckets); issue 24)
    assert big.height >= 10 and big["err_bound"].min() == math.sqrt(2.0 / m)
    dev = (big["err"] - big["exact"]).abs().to_numpy()
    bar = (big["err_bound"] * big["exact"]).to_numpy()
    within4 = dev <= 4 * bar + 1e-12
    within6 = dev <= 6 * bar + 1e-12
    assert within4.mean() >= 0.99, f"{label}: only {within4.mean():.1%} of {big.height} estimates within 4 bars"
    assert within6.all(), f"{label}: estimates beyond 6 bars:\n{big.filter(~pl.Series(within6))}"
    nonzero = bar > 0
    return float(np.max(dev[nonzero] / bar[nonzero], initial=0.0))


@pytest.mark.parametrize("target", SKETCH_TARGETS)
def test_sketch_estimate_within_error_bar(target, store, exact_cmp, sketch_cmp, small_sketch_store) -> None:
    m = store.run_info(target)["sketch_m"]
    _check_sketch(sketch_cmp[target], exact_cmp[target], m, f"{target} M={m}")
    sk = compare_runs(small_sketch_store, target, REF).rows
    ex = compare_runs(small_sketch_store, target, REF, exact=True).rows
    _check_sketch(sk, ex, SMALL_M, f"{target} M={SMALL_M}")


# ---------------------------------------------------------------- files that cannot be read again


def test_unreadable_files_are_unknown_not_sketched(tmp_path) -> None:
    for run in (REF, EXPECTED_TARGET):
        shutil.copytree(SAMPLES / run, tmp_path / run)
    st = tmp_path / "store"
    for run in (REF, EXPECTED_TARGET):
        ingest(tmp_path / run, run, store=st)
    before = compare_runs(open_store(st), EXPECTED_TARGET, REF).rows
    cand = before.filter(_candidates(before) & (pl.col("numel") > 16))
    gone, broken, reshaped = cand["data_name"].to_list()[:3]
    tensors = tmp_path / EXPECTED_TARGET / "step0" / "rank0" / "dump_tensor_data"
    (tensors / gone).unlink()
    (tensors / broken).write_bytes(b"not a torch file")
    shutil.copyfile(
        SAMPLES
        / REF
        / "step0"
        / "rank0"
        / "dump_tensor_data"
        / before.filter(_candidates(before) & (pl.col("numel") == 16))["ref_data_name"][0],
        tensors / reshaped,
    )
    rows = compare_runs(open_store(st), EXPECTED_TARGET, REF, exact=True).rows
    for name, why in ((gone, "missing"), (broken, ""), (reshaped, "changed since ingest")):
        r = rows.filter(pl.col("data_name") == name).row(0, named=True)
        old = before.filter(pl.col("data_name") == name).row(0, named=True)
        # never the sketch's answer in place of the exact one (issue 24): unknown, and why
        assert old["err_source"] == "sketch" and (r["err_source"], r["err"], r["status"]) == ("none", None, "unknown")
        assert r["msprobe_cosine"] is None
        assert "exact metrics unavailable" in r["detail"] and why in r["detail"], r["detail"]
    others = rows.filter(_candidates(rows) & ~pl.col("data_name").is_in([gone, broken, reshaped]))
    assert set(others["err_source"]) == {"exact"}
    # the whole dump folder moved away: every such row is unknown and says why; the others keep their values
    (tmp_path / EXPECTED_TARGET).rename(tmp_path / "moved")
    rows = compare_runs(open_store(st), EXPECTED_TARGET, REF, exact=True).rows
    assert "exact" not in set(rows["err_source"])
    hit = rows.filter(_candidates(rows))
    assert hit["detail"].str.contains("cannot be read again").all() and set(hit["status"]) == {"unknown"}
    rest = ~_candidates(rows)
    assert_frame_equal(
        rows.filter(rest).select(before.columns).drop("detail"), before.filter(~_candidates(before)).drop("detail")
    )


def test_plain_tensor_folders(tmp_path) -> None:
    """Plain folders of .npy files (no dump.json) are found again too."""
    rng = np.random.default_rng(7)
    a = {
        "x": rng.standard_normal((4, 300)).astype(np.float32),
        "y": rng.standard_normal(5).astype(np.float32),
        "z": np.array([2.5], np.float32),
    }
    b = {"x": a["x"] * np.float32(1.001), "y": a["y"].copy(), "z": np.array([2.0], np.float32)}
    for run, arrays in (("t", a), ("r", b)):
        (tmp_path / run).mkdir()
        for k, v in arrays.items():
            np.save(tmp_path / run / f"{k}.npy", v)
        ingest(tmp_path / run, run, store=tmp_path / "store")
    rows = compare_runs(open_store(tmp_path / "store"), "t", "r", exact=True).rows
    assert rows.height == 3 and set(rows["err_source"]) == {"exact"}
    for r in rows.iter_rows(named=True):
        tm = metrics.tensor_metrics(a[r["name"]], b[r["name"]])
        assert r["err"] == tm.rel_l2
        assert [r[c] for c in MSPROBE_COLUMNS.values()] == [str(tm.msprobe[c]) for c in MSPROBE_COLUMNS]
    z = rows.filter(pl.col("name") == "z").row(0, named=True)
    assert z["msprobe_cosine"] == "unsupported" and z["cosine"] == 1.0  # one element: dumpstore's own cosine


def test_worker_processes_give_the_same_rows(store, exact_cmp, monkeypatch) -> None:
    """The pairs are compared in worker processes when there are many: same rows, same order."""
    import importlib

    exact = importlib.import_module("dumpstore.analysis.exact")
    target = next(iter(exact_cmp))
    sketch = compare_runs(store, target, REF)
    serial = exact.add_exact_metrics(store, target, REF, sketch.rows, None, "float32", jobs=1)
    monkeypatch.setattr(exact, "_PARALLEL_MIN", 16)
    parallel = exact.add_exact_metrics(store, target, REF, sketch.rows, None, "float32", jobs=2)
    assert_frame_equal(parallel, serial)
    from dumpstore.analysis.rules import apply_small_values

    # (the sketch rows carry their own small-value notes in `detail`)
    assert_frame_equal(
        apply_small_values(serial).drop("detail"), exact_cmp[target].drop("detail"), check_column_order=False
    )

"""No silent AGREE (issue 24): every comparison path compares what it can and says what it could not.

Each class is held by a randomised test over many records at once (one ingest per run, one comparison):
md5 checksums before the statistics bound; NaN/Inf in both runs (positions and the finite part); complex tensors
(both parts); `--tol` dtype names; `--exact` on tensor files changed or removed since ingest.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import DumpWriter

from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.tolerance import ToleranceError, Tolerances, tol_dtype_name
from dumpstore.cli.main import main
from dumpstore.store import open_store

INF, NAN = np.inf, np.nan


def _nonfinite_cases(seed: int, n: int) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """(reference, target, whether they differ): tensors holding NaN/Inf in both runs, the same counts of each;
    half of them changed in a finite value or by a moved NaN/Inf."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = int(rng.choice([3, 7, 40, 300, 2000]))
        ref = rng.standard_normal(size).astype(np.float32)
        k = int(rng.integers(1, max(2, size // 10) + 1))
        where = rng.choice(size, k, replace=False)
        ref[where] = rng.choice(np.array([INF, -INF, NAN], np.float32), k)
        tgt = ref.copy()
        change = i % 2 == 1
        if change:
            finite = np.flatnonzero(np.isfinite(ref))
            if i % 4 == 1 or finite.size == 0:
                j = int(rng.choice(finite)) if finite.size else 0
                tgt[j] = tgt[j] + 1.0 + abs(tgt[j])  # one finite value off by more than itself
            else:
                a, b = int(where[0]), int(rng.choice(finite))  # a NaN/Inf moves to another position
                tgt[a], tgt[b] = tgt[b], tgt[a]
        out.append((ref, tgt, change))
    return out


def _write_pair(root, cases, task: str) -> None:
    for side, pick in (("ref", 0), ("tgt", 1)):
        recs = {f"Functional.op{i}.0.forward": {"output": [case[pick]]} for i, case in enumerate(cases)}
        DumpWriter(root / f"{side}_{task}", task).write(recs)


@pytest.mark.parametrize("task", ["tensor", "statistics"])
def test_nonfinite_in_both_runs_is_never_a_silent_pass(tmp_path, task):
    cases = _nonfinite_cases(24, 60)
    _write_pair(tmp_path, cases, task)
    store = tmp_path / "store"
    for side in ("ref", "tgt"):
        ingest(tmp_path / f"{side}_{task}", side, store=store, jobs=1)
    rows = compare_runs(open_store(store), "tgt", "ref").rows.sort("seq")
    assert rows.height == len(cases)
    for (ref, _, change), status, detail in zip(cases, rows["status"], rows["detail"]):
        if change:  # a difference is found, or said not judged: never a pass
            assert status in ("diverged", "unknown"), (ref.size, status, detail)
        else:
            assert status in ("pass", "unknown"), (ref.size, status, detail)
        if status == "unknown":
            assert "not judged" in detail
    if task == "tensor":  # sketches hold every element up to 512: those are judged, and rightly
        small = [(c, s) for c, s in zip(cases, rows["status"]) if c[0].size <= 512]
        assert all(s == ("diverged" if c[2] else "pass") for c, s in small)
    else:  # statistics alone cannot see the finite part: unknown, and the verdict says so
        res = CliRunner().invoke(main, ["divergence", "--target", "tgt", "--ref", "ref", "--store", str(store)])
        assert "NOT JUDGED:" in res.output, res.output


def test_inf_example_of_the_issue(tmp_path):
    """[1, 2, inf] vs [1, 3, inf]: diverged from the sketch; NOT JUDGED from statistics; a NaN that moves diverges."""
    cases = [
        (np.array([1, 2, INF], np.float32), np.array([1, 3, INF], np.float32), True),
        (np.array([NAN, 2, 3], np.float32), np.array([2, NAN, 3], np.float32), True),
    ]
    _write_pair(tmp_path, cases, "tensor")
    _write_pair(tmp_path, cases, "statistics")
    store = tmp_path / "store"
    for name in ("ref_tensor", "tgt_tensor", "ref_statistics", "tgt_statistics"):
        ingest(tmp_path / name, name, store=store, jobs=1)
    st = open_store(store)
    t = compare_runs(st, "tgt_tensor", "ref_tensor").rows.sort("seq")
    assert t["status"].to_list() == ["diverged", "diverged"]
    assert t["err"][0] == pytest.approx(1 / np.sqrt(5))  # ||(0, 1)|| / ||(1, 2)||: the finite part
    assert t["detail"][1] == "NaN/Inf positions differ (sketch)"
    s = compare_runs(st, "tgt_statistics", "ref_statistics").rows.sort("seq")
    assert s["status"].to_list() == ["unknown", "unknown"]
    runner = CliRunner()
    args = ["divergence", "--target", "tgt_statistics", "--ref", "ref_statistics", "--store", str(store)]
    out = runner.invoke(main, args).output
    assert "AGREE within the measured noise (on what could be judged: see NOT JUDGED)" in out
    assert "NOT JUDGED: 2 tensor pairs unknown" in out
    args = ["divergence", "--target", "tgt_tensor", "--ref", "ref_tensor", "--store", str(store), "--check"]
    assert runner.invoke(main, args).exit_code == 3


def test_md5_checksum_decides_before_equal_statistics(tmp_path):
    """md5 mode: equal statistics and different checksums diverge (the statistics bound, 0, is only a lower bound)."""
    rng = random.Random(24)
    n = 40
    arrays = [np.array([rng.uniform(-2, 2) for _ in range(5)], np.float32) for _ in range(n)]
    changed = {i for i in range(n) if rng.random() < 0.3}
    for side in ("ref", "tgt"):
        d = DumpWriter(tmp_path / side, "statistics").write(
            {f"Functional.op{i}.0.forward": {"output": [a]} for i, a in enumerate(arrays)}
        )
        doc = json.loads(d.read_text())
        for i, rec in enumerate(doc["data"].values()):
            rec["output"][0]["md5"] = f"{(i * 7919 + (1 if side == 'tgt' and i in changed else 0)):08x}"
        d.write_text(json.dumps(doc))
        ingest(tmp_path / side, side, store=tmp_path / "store", jobs=1)
    rows = compare_runs(open_store(tmp_path / "store"), "tgt", "ref").rows.sort("seq")
    assert rows["err_source"].unique().to_list() == ["checksum"]
    assert {i for i, s in enumerate(rows["status"]) if s == "diverged"} == changed
    res = CliRunner().invoke(
        main, ["divergence", "--target", "tgt", "--ref", "ref", "--store", str(tmp_path / "store")]
    )
    assert ("FIRST DIVERGENCE (checksum)" in res.output) == bool(changed)


@pytest.mark.parametrize("task", ["tensor"])
def test_complex_tensors_compare_both_parts(tmp_path, task):
    rng = np.random.default_rng(7)
    cases = []
    for i, size in enumerate([2, 5, 300, 1500]):
        z = (rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(np.complex64)
        cases.append((z, np.conj(z) if i % 2 == 0 else z * np.complex64(1j), True))
        cases.append((z, z.copy(), False))
    _write_pair(tmp_path, cases, task)
    store = tmp_path / "store"
    for side in ("ref", "tgt"):
        ingest(tmp_path / f"{side}_{task}", side, store=store, jobs=1)
    st = open_store(store)
    for exact in (False, True):
        rows = compare_runs(st, "tgt", "ref", exact=exact).rows.sort("seq")
        got = [s == "diverged" for s in rows["status"]]
        assert got == [c[2] for c in cases], (exact, rows.select("err", "err_source", "status"))
    exact_rows = compare_runs(st, "tgt", "ref", exact=True).rows.sort("seq")
    z, conj = cases[0][0], cases[0][1]
    want = np.linalg.norm(z - conj) / np.linalg.norm(z)
    assert exact_rows["err"][0] == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("torch.float32", "float32"),
        ("double", "float64"),
        ("fp64", "float64"),
        ("bfloat16", "bfloat16"),
        ("int64", "int64"),
    ],
)
def test_tol_dtype_aliases(name, dtype):
    assert tol_dtype_name(name) == dtype
    assert Tolerances.parse([f"{name}=1e-9"]).for_dtype(dtype) == 1e-9


@pytest.mark.parametrize("spec", ["flaot32=1e-3", "fp33=1", "=1e-3", "bf16=", "bf16=-1", "bf16=abc", "nan", "inf"])
def test_tol_unknown_dtype_or_bad_value_is_a_usage_error(spec, tmp_path):
    with pytest.raises(ToleranceError):
        Tolerances.parse([spec])
    res = CliRunner().invoke(
        main, ["divergence", "--target", "a", "--ref", "b", "--store", str(tmp_path), "--tol", spec]
    )
    assert res.exit_code == 2 and "--tol" in res.output and "Traceback" not in res.output


def _exact_pair(tmp_path):
    rng = np.random.default_rng(3)
    recs = {f"Functional.op{i}.0.forward": {"output": [rng.standard_normal(64).astype(np.float32)]} for i in range(6)}
    DumpWriter(tmp_path / "ref", "tensor").write(recs)
    shutil.copytree(tmp_path / "ref", tmp_path / "tgt")
    store = tmp_path / "store"
    for side in ("ref", "tgt"):
        ingest(tmp_path / side, side, store=store, jobs=1)
    return store


def _edit_keeping_stamps(path):
    st = os.stat(path)
    a = np.load(path)
    a[3] += 1.0
    np.save(path, a)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("side", ["tgt", "ref"])
@pytest.mark.parametrize("how", ["edit", "delete"])
def test_exact_never_answers_from_stale_files(tmp_path, side, how):
    """A memoised --exact verdict is not reused after a tensor file changed; a changed (size and mtime put back)
    or deleted file is an unknown row and a NOT JUDGED line (exit 1 with --check), never the sketch's AGREE."""
    store = _exact_pair(tmp_path)
    runner = CliRunner()
    args = ["divergence", "--target", "tgt", "--ref", "ref", "--store", str(store), "--exact", "--check"]
    first = runner.invoke(main, args)
    assert first.exit_code == 0 and "AGREE" in first.output and "NOT JUDGED" not in first.output
    victim = next((tmp_path / side).rglob("Functional.op2.0.forward.output.0.npy"))
    if how == "edit":
        _edit_keeping_stamps(victim)
    else:
        victim.unlink()
    for extra in ([], ["--no-cache"]):
        res = runner.invoke(main, args + extra)
        assert res.exit_code == 1, res.output
        assert "NOT JUDGED: 1 tensor pairs --exact could not compare" in res.output
        assert ("contents changed since ingest" if how == "edit" else "missing") in res.output
    rows = compare_runs(open_store(store), "tgt", "ref", exact=True).rows.sort("seq")
    assert rows["status"].to_list() == ["pass"] * 2 + ["unknown"] + ["pass"] * 3
    assert rows["err"][2] is None and rows["err_source"][2] == "none"

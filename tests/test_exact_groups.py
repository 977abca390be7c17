"""`--exact`'s content groups: which rows share one read (hashes and exact statistics, compared as their reprs
are), and a file changed, replaced by a link or deleted inside a group is never given the group's values."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis import exact, metrics
from dumpstore.analysis.compare import compare_runs
from dumpstore.store import open_store
from helpers import ExactLoads

STATS = [*exact._STATS, *(f"ref_{s}" for s in exact._STATS)]
NAN_PAYLOAD = np.array([0x7FF8000000000123], np.int64).view(np.float64)[0]  # a NaN of another bit pattern


def _frame(rows: list[dict]) -> pl.DataFrame:
    """Candidate rows of hashes and statistics: every statistic 1.0 (nan_count 0) unless the row says otherwise."""
    full = [{**dict.fromkeys(STATS, 1.0), "nan_count": 0, "ref_nan_count": 0, **r} for r in rows]
    schema = {
        "content_hash": pl.Binary,
        "ref_content_hash": pl.Binary,
        **{s: pl.Int64 if s.endswith("nan_count") else pl.Float64 for s in STATS},
    }
    return pl.DataFrame(full, schema=schema)


def _repr_groups(frame: pl.DataFrame) -> list[tuple[list[int], bool]]:
    """The grouping by the statistics' reprs (what `_content_groups` must equal)."""
    groups: list[tuple[list[int], bool]] = []
    seen: dict[tuple, list[int]] = {}
    for i, row in enumerate(frame.iter_rows(named=True)):
        t, r = row["content_hash"], row["ref_content_hash"]
        if t is None or r is None:
            groups.append(([i], False))
            continue
        key = (t, r, repr([row[s] for s in exact._STATS]), repr([row[f"ref_{s}"] for s in exact._STATS]))
        if key not in seen:
            seen[key] = []
            groups.append((seen[key], t == r and key[2] == key[3]))
        seen[key].append(i)
    return groups


def test_groups_split_signed_zeros_and_join_nans():
    a, b = b"a" * 16, b"b" * 16
    frame = _frame(
        [
            {"content_hash": a, "ref_content_hash": a},  # 0
            {"content_hash": a, "ref_content_hash": a, "min": -0.0},  # 1: -0.0 is not 0.0
            {"content_hash": a, "ref_content_hash": a, "min": 0.0},  # 2
            {"content_hash": a, "ref_content_hash": a, "min": 0.0},  # 3: with 2
            {"content_hash": a, "ref_content_hash": b, "mean": math.nan},  # 4
            {"content_hash": a, "ref_content_hash": b, "mean": NAN_PAYLOAD},  # 5: NaN equals NaN, with 4
            {"content_hash": a, "ref_content_hash": b, "mean": None},  # 6: null is not NaN
            {"content_hash": a, "ref_content_hash": b, "mean": None},  # 7: with 6
            {"content_hash": None, "ref_content_hash": a},  # 8: no hash: alone
            {"content_hash": None, "ref_content_hash": a},  # 9: alone too
            {"content_hash": a, "ref_content_hash": a, "ref_norm": 2.0},  # 10: statistics differ: not equal
            {"content_hash": a, "ref_content_hash": a, "nan_count": None, "ref_nan_count": None},  # 11: equal
            {"content_hash": a, "ref_content_hash": a, "min": -0.0, "ref_min": 0.0},  # 12: not equal
            {"content_hash": a, "ref_content_hash": a, "max": math.nan, "ref_max": NAN_PAYLOAD},  # 13: equal
        ]
    )
    groups = exact._content_groups(frame)
    assert groups == [
        ([0], True),
        ([1], False),
        ([2, 3], False),
        ([4, 5], False),
        ([6, 7], False),
        ([8], False),
        ([9], False),
        ([10], False),
        ([11], True),
        ([12], False),
        ([13], True),
    ]
    assert groups == _repr_groups(frame)


def test_groups_of_random_statistics_match_the_repr_grouping():
    rng = np.random.default_rng(11)
    hashes = [b"x" * 16, b"y" * 16, None]
    values = [0.0, -0.0, 1.5, math.nan, NAN_PAYLOAD, math.inf, -math.inf, None]
    rows = [
        {
            "content_hash": hashes[rng.integers(3)],
            "ref_content_hash": hashes[rng.integers(3)],
            **{s: values[rng.integers(len(values))] for s in ("min", "ref_min", "norm", "ref_norm")},
        }
        for _ in range(400)
    ]
    frame = _frame(rows)
    assert exact._content_groups(frame) == _repr_groups(frame)


# ------------------------------------------------------------------------------------- files changed in a group


@pytest.fixture
def linear4(dump_writer, tmp_path):
    """Four leaves of one equal input pair and four of one differing output pair, ingested as runs t and r; the
    target's tensor folder."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal(40).astype(np.float32)
    other = base * np.float32(1.01)
    recs_t = {f"Functional.linear.{i}.forward": {"input_args": [base], "output": [other]} for i in range(4)}
    recs_r = {f"Functional.linear.{i}.forward": {"input_args": [base], "output": [base]} for i in range(4)}
    t_json = dump_writer("t").write(recs_t)
    ingest(t_json.parent.parent.parent, "t", store=tmp_path / "store", jobs=1)
    ingest(dump_writer("r").write(recs_r).parent.parent.parent, "r", store=tmp_path / "store", jobs=1)
    return tmp_path / "store", t_json.parent / "dump_tensor_data", base, other


def _by_name(store: Path) -> dict[str, dict]:
    rows = compare_runs(open_store(store), "t", "r", exact=True).rows
    return {r["name"]: r for r in rows.iter_rows(named=True)}


METRIC_COLUMNS = ["err", "cosine", "max_abs_err", "max_rel_err", "euc_dist", *exact.MSPROBE_COLUMNS.values()]


def _metrics(row: dict) -> list:
    return [row[c] for c in METRIC_COLUMNS]


def _same_values(a: dict, b: dict) -> bool:
    """The same exact metrics and source. (The tolerance a row is judged at may move: the matmul prior infers the
    pair's precision from the fresh records it can judge, and a row left unknown is no evidence.)"""
    return _metrics(a) == _metrics(b) and a["err_source"] == b["err_source"] == "exact"


def _replace(path: Path, source: Path) -> None:
    """`path` now holds `source`'s contents (same size), with an mtime later than at ingest."""
    shutil.copyfile(source, path)
    info = path.stat()
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 2_000_000_000))


def test_changed_file_in_a_group_gets_its_own_values(linear4, monkeypatch):
    store, tensors, base, other = linear4
    loads = ExactLoads(monkeypatch)
    before = _by_name(store)
    assert loads.n == 1 + 2  # one read of the equal inputs (one file), one of the differing outputs (two)
    name = "Functional.linear.{}.forward.{}.0"
    _replace(tensors / f"{name.format(2, 'input')}.npy", tensors / f"{name.format(0, 'output')}.npy")
    _replace(tensors / f"{name.format(1, 'output')}.npy", tensors / f"{name.format(0, 'input')}.npy")
    loads.n = 0
    after = _by_name(store)
    # the unchanged rows of each group share one read; each changed row is read alone, and refused: its file no
    # longer holds what was ingested (content hash), so it is unknown, never compared (issue 24)
    assert loads.n == 1 + 2 + 1 + 1
    tm = metrics.tensor_metrics(other, base)
    for i in (0, 1, 3):
        assert _same_values(after[name.format(i, "input")], before[name.format(i, "input")])
        assert after[name.format(i, "input")]["err"] == 0.0
    for i in (0, 2, 3):
        assert _same_values(after[name.format(i, "output")], before[name.format(i, "output")])
        assert after[name.format(i, "output")]["err"] == tm.rel_l2 > 0
    for changed in (name.format(2, "input"), name.format(1, "output")):
        row = after[changed]
        assert (row["err"], row["status"], row["err_source"]) == (None, "unknown", "none")
        assert row["detail"].endswith("contents changed since ingest; re-ingest the run"), row["detail"]


def test_linked_or_deleted_file_in_a_group_is_unknown(linear4, monkeypatch):
    store, tensors, _base, _other = linear4
    before = _by_name(store)
    name = "Functional.linear.{}.forward.input.0"
    linked = tensors / f"{name.format(1)}.npy"
    linked.unlink()
    linked.symlink_to(tensors / f"{name.format(0)}.npy")  # the same contents, through a link
    (tensors / f"{name.format(2)}.npy").unlink()
    loads = ExactLoads(monkeypatch)
    after = _by_name(store)
    assert loads.n == 1 + 1 + 1 + 2  # the shared read, the link refused, the missing file, the outputs
    sketch = compare_runs(open_store(store), "t", "r").rows
    for i, why in ((1, "link"), (2, "missing")):
        row, old = after[name.format(i)], before[name.format(i)]
        assert old["err_source"] == "exact" and row["err_source"] != "exact" and row["msprobe_cosine"] is None
        assert "exact metrics unavailable" in row["detail"] and why in row["detail"], row["detail"]
        kept = sketch.filter(pl.col("name") == name.format(i)).row(0, named=True)
        assert kept["status"] == "pass" and (row["err"], row["status"]) == (None, "unknown")  # never the sketch's
    for i in (0, 3):
        assert _same_values(after[name.format(i)], before[name.format(i)])


def test_unchanged_looks_at_each_file(linear4):
    store, tensors, _base, _other = linear4
    files = exact._RunFiles(open_store(store), "t")
    name = "Functional.linear.0.forward.input.0.npy"
    info = (tensors / name).stat()
    unit = (0, 0, None, None)
    stamp = (info.st_size, info.st_mtime_ns)
    (tensors / "link.npy").symlink_to(tensors / name)
    asked = [
        (unit, name, *stamp),  # as at ingest
        (unit, name, info.st_size, info.st_mtime_ns + 1),  # another mtime
        (unit, name, info.st_size + 1, info.st_mtime_ns),  # another size
        (unit, name, None, None),  # no stamp in the store
        (unit, "link.npy", *stamp),  # a link
        (unit, "gone.npy", *stamp),  # missing
        (unit, f"../dump_tensor_data/{name}", *stamp),  # not a plain name
        (unit, "a\x00b", *stamp),  # a NUL
        ((0, 1, None, None), name, *stamp),  # no such unit
        (unit, name, *stamp),
    ]
    assert files.unchanged(asked) == [True, False, False, False, False, False, False, False, False, True]


def test_reshaped_file_in_a_group_says_so(linear4, monkeypatch):
    store, tensors, base, _other = linear4
    name = "Functional.linear.3.forward.input.0"
    reshaped = tensors / f"{name}.npy"
    np.save(reshaped, base.reshape(2, 20))
    after = _by_name(store)
    row = after[name]
    assert row["err_source"] != "exact" and row["msprobe_cosine"] is None
    assert row["detail"].endswith(
        f"exact metrics unavailable: {reshaped}: has shape [2, 20] but had [40] at ingest (changed since ingest); "
        "re-ingest the run"
    ), row["detail"]
    assert after["Functional.linear.0.forward.input.0"]["err"] == 0.0


def test_workers_give_the_rows_one_process_gives(linear4, monkeypatch):
    """Groups split into chunks for worker processes (a changed file among them): the same rows, in order."""
    store, tensors, _base, _other = linear4
    name = "Functional.linear.{}.forward.{}.0"
    _replace(tensors / f"{name.format(2, 'input')}.npy", tensors / f"{name.format(0, 'output')}.npy")
    sketch = compare_runs(open_store(store), "t", "r").rows
    serial = exact.add_exact_metrics(open_store(store), "t", "r", sketch, None, "float32", jobs=1)
    monkeypatch.setattr(exact, "_PARALLEL_MIN", 2)
    parallel = exact.add_exact_metrics(open_store(store), "t", "r", sketch, None, "float32", jobs=2)
    assert parallel.columns == serial.columns and parallel.height == serial.height == 8
    for c in serial.columns:
        assert repr(parallel[c].to_list()) == repr(serial[c].to_list()), c
    assert set(serial["err_source"]) == {"exact", "none"}  # the changed file: unknown, not compared

"""A store whose older runs lack the columns added later (content_hash, file_size, file_mtime_ns) still answers."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from dumpstore._ingest import ingest
from dumpstore.analysis import verdict
from dumpstore.query import run_query
from dumpstore.schema import TENSOR_FILE_COLUMNS
from dumpstore.store import open_store
from helpers import SAMPLES


def _as_before_the_columns(store: Path, run: str) -> None:
    """Rewrite `run`'s files as an ingest from before TENSOR_FILE_COLUMNS existed wrote them."""
    for f in store.rglob(f"*{run}*/**/part-*.parquet"):
        table = pq.read_table(f)
        if "tensors" in f.parts and "content_hash" in table.column_names:  # (a hard link may be done already)
            pq.write_table(table.drop(list(TENSOR_FILE_COLUMNS)), f)


def test_query_and_exact_verdict_over_runs_with_and_without_the_file_columns(tmp_path):
    store = tmp_path / "s"
    ingest(SAMPLES / "ref_tensor", "old", store=store)
    ingest(SAMPLES / "weight_1pct_tensor", "new", store=store)
    _as_before_the_columns(store, "run=old")
    st = open_store(store)
    counts = run_query(st, "select run, count(*) n, count(content_hash) h from tensors group by run order by run")
    assert counts.to_pylist() == [{"run": "new", "n": 453, "h": 400}, {"run": "old", "n": 453, "h": 0}]
    exact = verdict.answer(st, verdict.Question(target="new", ref="old", exact=True), use_memo=False)
    assert (exact.first_divergence.op, exact.first_divergence.source) == ("Functional.linear.6.forward", "exact")


def test_a_content_hash_collision_does_not_make_different_tensors_equal(tmp_path):
    """content_hash is XXH3 (not cryptographic): a forged collision (every ref hash set to its target's) must not
    turn a differing pair into an identical one; the ingest's exact statistics must agree as well."""
    store = tmp_path / "s"
    ingest(SAMPLES / "ref_tensor", "ref", store=store)
    ingest(SAMPLES / "weight_1pct_tensor", "target", store=store)
    st = open_store(store)
    honest = verdict.answer(st, verdict.Question(target="target", ref="ref", exact=True), use_memo=False)
    target_files = [f for f in store.rglob("run=target/**/part-*.parquet") if "tensors" in f.parts]
    hashes = pq.read_table(target_files[0]).select(["leaf", "content_hash"])
    for f in store.rglob("run=ref/**/part-*.parquet"):
        table = pq.read_table(f)
        if "tensors" in f.parts and "content_hash" in table.column_names:
            assert table["leaf"].equals(hashes["leaf"])  # same records, same leaves in both runs
            i = table.column_names.index("content_hash")
            pq.write_table(table.set_column(i, table.schema.field(i), hashes["content_hash"]), f)
    forged = verdict.answer(open_store(store), verdict.Question(target="target", ref="ref", exact=True), use_memo=False)
    # the files no longer hold what the (forged) store says they held: those pairs are not compared at all (issue
    # 24: a file whose contents differ from the ingest's hash is refused), and the verdict says so
    assert forged.not_judged["exact_unavailable"] > 0
    assert "contents changed since ingest" in forged.not_judged["first"]
    assert honest.first_divergence.op == "Functional.linear.6.forward" and not honest.not_judged

"""Runs ingested with different sketch/sample sizes still compare: sketches fold to the smaller size."""

from __future__ import annotations

import polars as pl

from dumpstore._ingest import IngestOptions, ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.store import open_store
from helpers import SAMPLES


def test_different_sketch_sizes_compare_on_the_smaller(store_dir):
    ingest(SAMPLES / "ref_tensor", "ref64", store=store_dir, jobs=1, options=IngestOptions(sketch_m=64))
    ingest(SAMPLES / "weight_1pct_tensor", "t64", store=store_dir, jobs=1, options=IngestOptions(sketch_m=64))
    ingest(
        SAMPLES / "weight_1pct_tensor",
        "t512",
        store=store_dir,
        jobs=1,
        options=IngestOptions(sketch_m=512, sample_k=16),
    )
    st = open_store(store_dir)
    same = compare_runs(st, "t64", "ref64").rows
    mixed = compare_runs(st, "t512", "ref64").rows
    cols = ["name", "err", "err_source", "err_bound", "status"]
    assert mixed.select(cols).equals(same.select(cols))
    assert (same["err_source"] == "sketch").sum() > 100
    # samples of different sizes sit at different positions: no sample-based bound then
    sketched = mixed.filter(pl.col("err_source") == "sketch")
    assert sketched["max_abs_err"].null_count() == sketched.height

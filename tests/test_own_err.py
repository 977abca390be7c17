"""A gradient judged as a sum of K terms (rules.py `small_value_err`: a bias whose terms cancel) explains its
parameter's update gap by its relative error in its own norm (analysis/steps.py `_own_err`), not by the error on
the terms' scale its op was judged on: set 9's ELECTRA (Adamax) moved an attention key bias, whose gradient is
zero in exact arithmetic, by 0.9 of its update on a clean pair, and that gradient read 2.3e-7 on the terms' scale."""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.steps import _own_err

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("VALIDATION_V9_DATA", ROOT / "validation" / "v9" / ".data"))


def test_a_sum_judged_on_its_terms_scale_is_read_back_in_its_own_norm():
    rows = pl.DataFrame(
        {
            "err": [0.5, 0.5, 0.5, 0.5],
            "judged_norm": [2.0, None, 8.0, 1.0],
            "ref_norm": [4.0, 4.0, 2.0, 0.0],
        }
    )
    got = rows.select(_own_err(rows).alias("g")).to_series().to_list()
    assert got == [0.25, 0.5, 2.0, float("inf")]
    assert rows.drop("judged_norm").select(_own_err(rows.drop("judged_norm"))).to_series().to_list() == [0.5] * 4


@pytest.mark.validation
@pytest.mark.skipif(not (DATA / "key.json").exists(), reason="set 9 not generated (make validate-v9)")
@pytest.mark.parametrize("case", ["electra_clean_stats", "electra_noisyref_stats", "electra_flip_stats"])
def test_clean_electra_pairs_under_adamax_stay_quiet(case, tmp_path):
    c = json.loads((DATA / "key.json").read_text())["cases"][case]
    store = tmp_path / "store"
    ingest(DATA / c["ref"], "ref", store=store, jobs=1)
    ingest(DATA / c["target"], "target", store=store, jobs=1)
    assert divergence(compare_runs(open_store(store), "target", "ref")).culprit is None

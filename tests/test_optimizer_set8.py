"""Two optimizer faults of validation set 8 (statistics mode) that the rules of docs/how-it-decides.md, section 5,
find from the second update on, on the set's real msprobe dumps (``VALIDATION_V8_DATA``, else
``validation/v8/.data``: `make validate-v8`; skipped where the set is not generated), and their clean pairs quiet:

- `fnet_eps_step2`: FNet in fp32 under centered RMSprop with momentum, eps 1e-5 for 1e-8 from the second update on:
  every parameter moved a few thousandths of an update otherwise than the reference's (under UPDATE_X_MIN), each
  far beyond what its gradients, the gap carried in and one rounding explain, where the update before moved them
  within it (analysis/updates.py `updates_differ`, UNEXPLAINED);
- `stablelm_lr_step2`: StableLM in bf16 with fp32 master weights under NAdam, lr x1.05 from the second update on:
  the update-size ratios that a bf16 statistic measures to +-MEASURED_HALF read 1.044 (median) against 1 at the
  update before (`ratio_shift`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.updates import MEASURED_HALF, UNEXPLAINED

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("VALIDATION_V8_DATA", ROOT / "validation" / "v8" / ".data"))

pytestmark = [
    pytest.mark.validation,
    pytest.mark.skipif(not (DATA / "key.json").exists(), reason="set 8 not generated (make validate-v8)"),
]


def _verdict(case: str, tmp_path: Path):
    c = json.loads((DATA / "key.json").read_text())["cases"][case]
    store = tmp_path / "store"
    ingest(DATA / c["ref"], "ref", store=store, jobs=1)
    ingest(DATA / c["target"], "target", store=store, jobs=1)
    return divergence(compare_runs(open_store(store), "target", "ref"))


def test_rmsprop_eps_from_the_second_update_is_every_parameter_far_beyond_its_explanation(tmp_path):
    c = _verdict("fnet_eps_step2_stats", tmp_path).culprit
    assert c is not None and (c.kind, c.step, c.metric) == ("optimizer", 2, "update_units")
    ev = c.evidence
    assert (ev["parameters"], ev["unexplained"]) == (29, 29)
    assert ev["median_update_units"] == pytest.approx(0.0061962, rel=1e-4)
    assert ev["floor"] == 0.0625  # UPDATE_X_MIN: ten times over the median gap
    assert ev["over_explanation"] == pytest.approx(137.98, rel=1e-4)
    assert ev["previous_over_explanation"] == pytest.approx(0.0048781, rel=1e-4)
    assert ev["explanation_bar"] == UNEXPLAINED == 16
    assert "29 of 29 parameters differ from the reference by 0.0062 of their own update" in c.detail
    assert "(138x that per parameter, median; the update before: 0.0049x)" in c.detail


def test_a_learning_rate_on_fp32_masters_of_bf16_parameters_is_found_from_the_measured_ratios(tmp_path):
    c = _verdict("stablelm_lr_step2_stats", tmp_path).culprit
    assert c is not None and (c.kind, c.step, c.metric) == ("optimizer", 2, "update_ratio")
    ev = c.evidence
    assert (ev["parameters"], ev["previous_parameters"], ev["same_way"]) == (17, 19, 14)
    assert ev["median_ratio"] == pytest.approx(1.0441989, rel=1e-6) and ev["previous_ratio"] == 1.0
    assert ev["bar"] == pytest.approx(0.0242002, rel=1e-4)
    assert MEASURED_HALF == 0.25
    assert "14 of 17 parameters moved 1.044x (median)" in c.detail


@pytest.mark.parametrize("case", ["fnet_clean_stats", "stablelm_clean_stats", "stablelm_wide_clean_stats"])
def test_their_clean_pairs_stay_quiet(case, tmp_path):
    assert _verdict(case, tmp_path).culprit is None

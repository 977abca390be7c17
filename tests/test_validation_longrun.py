"""The held-out long runs (docs/longrun.md, "Held-out long runs"): the scoring rule, and (marker ``validation``)
`dumpstore curves` on them.

The marked test makes the runs (minutes: 17 small models trained on CPU under msprobe's TrainerMon) into
``validation/longrun/.data`` unless its key is already there, then scores every case through dumpstore's CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "validation" / "longrun"


score = load_script("validation_longrun_score", HERE / "score.py")
make_runs = load_script("validation_longrun_make_runs", HERE / "make_runs.py")

FAULT = {
    "case": "x_gradscale",
    "target": "x_gradscale",
    "ref": "x_ref",
    "kind": "grad_divergence",
    "expect": "fault",
    "log": "megatron",
    "fault_step": 100,
    "loss_onset": 102,
    "monitor_onset": 100,
    "module": "model.layers.1.mlp",
    "window": 20,
}
CLEAN = {"case": "x_seed", "target": "x_seed", "ref": "x_ref", "kind": "clean", "expect": "clean", "log": "hf"}


def curves(div=None, lr=None, first=None):
    return {
        "divergence": {"step": div},
        "lr_mismatch": None if lr is None else {"step": lr},
        "culprit": {"first": first} if first is not None else {"first": None},
        "spikes": [],
        "events": [],
    }


def first(step, param="model.layers.1.mlp.down.weight", module="model.layers.1.mlp.down"):
    return {"prefix": "grad_reduced", "name": param, "param": param, "module": module, "step": step}


def test_the_committed_key_is_the_one_make_runs_writes():
    assert json.loads((HERE / "key.json").read_text()) == make_runs.key()


def test_window_is_20_steps_or_5_percent():
    assert make_runs.window(300) == 20
    assert make_runs.window(400) == 20
    assert make_runs.window(1000) == 50


def test_fault_found_in_the_window_and_module_inside_the_layer():
    r = score.score_case(FAULT, curves(div=110, first=first(100)), {})
    assert r["ok"], r
    # the window's edges: the expected step and expected + W; never before
    assert score.score_case(FAULT, curves(div=122, first=first(120)), {})["ok"]
    assert not score.score_case(FAULT, curves(div=101, first=first(100)), {})["ok"]
    assert not score.score_case(FAULT, curves(div=123, first=first(100)), {})["ok"]
    assert not score.score_case(FAULT, curves(div=110, first=first(99)), {})["ok"]
    # another layer, or a layer whose name only starts like it
    assert not score.score_case(
        FAULT, curves(div=110, first=first(100, "model.layers.0.mlp.w", "model.layers.0.mlp")), {}
    )["ok"]
    assert not score.score_case(
        FAULT, curves(div=110, first=first(100, "model.layers.1.mlpx.w", "model.layers.1.mlpx")), {}
    )["ok"]
    assert not score.score_case(FAULT, curves(div=None, first=first(100)), {})["ok"]


def test_a_loss_change_below_the_printed_precision_may_go_unseen():
    few = {"first_diff": 150, "n_diff": 20, "n": 200}  # 20 of the 99 points from 102 on differ as printed
    many = {"first_diff": 102, "n_diff": 90, "n": 200}
    assert score.score_case(FAULT, curves(div=None, first=first(100)), {}, few)["ok"]
    assert score.score_case(FAULT, curves(div=105, first=first(100)), {}, few)["ok"]
    assert not score.score_case(FAULT, curves(div=90, first=first(100)), {}, few)["ok"]
    assert not score.score_case(FAULT, curves(div=None, first=first(100)), {}, many)["ok"]


def test_clean_pair_is_right_only_when_quiet():
    assert score.score_case(CLEAN, curves(), {})["ok"]
    assert not score.score_case(CLEAN, curves(div=50), {})["ok"]
    assert not score.score_case(CLEAN, curves(lr=3), {})["ok"]
    assert not score.score_case(CLEAN, curves(first=first(7)), {})["ok"]
    assert not score.score_case(CLEAN, None, {})["ok"]


def test_spike_is_the_target_s_own_and_the_collapse_has_no_loss_item():
    spike = {**FAULT, "kind": "spike", "module": None}
    cur = curves(div=101, first=first(100))
    cur["spikes"] = [{"run": "x_gradscale", "step": 102}, {"run": "x_ref", "step": 105}]
    spike["loss_onset"] = 101
    assert score.score_case(spike, cur, {})["items"]["spike"]["ok"]  # the reference's own spike elsewhere
    cur["spikes"].append({"run": "x_ref", "step": 102})
    assert not score.score_case(spike, cur, {})["items"]["spike"]["ok"]  # the same spike in both runs
    collapse = {**FAULT, "kind": "loss_scale_collapse", "module": None}
    cur = curves(first=first(100))
    cur["events"] = [{"run": "x_gradscale", "kind": "loss_scale_drop", "steps": [101, 102]}]
    r = score.score_case(collapse, cur, {})
    assert "loss" not in r["items"] and r["items"]["events"]["ok"]


@pytest.mark.validation
def test_every_held_out_long_run_case_is_right():
    data = HERE / ".data"
    if not (data / "key.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_runs.py"), "--out", str(data)], check=True)
    p = subprocess.run(
        [sys.executable, str(HERE / "score.py"), "--data", str(data), "--json"], capture_output=True, text=True
    )
    out = json.loads(p.stdout)
    assert out["errors"] == []
    wrong = {r["case"]: {k: v for k, v in r["items"].items() if not v["ok"]} for r in out["cases"] if not r["ok"]}
    assert wrong == {}
    assert all(r["ok"] for r in out["ref_health"])

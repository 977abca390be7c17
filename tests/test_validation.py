"""The held-out validation set (docs/validation.md): its scoring rule, and (marker ``validation``) the verdict on it.

The marked tests make the pairs (minutes: 36 msprobe runs of four transformers models) into
``validation/.data`` unless a key is already there, then score every pair through dumpstore's CLI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import score_validation

ROOT = Path(__file__).resolve().parents[1]
# loaded under its own name: validation/ is not put on sys.path (no clash with another module called score)
_spec = importlib.util.spec_from_file_location("validation_score", ROOT / "validation" / "score.py")
score = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(score)

OPT = {"step": 2, "ops": [], "optimizer": True}
OP = {
    "step": 1,
    "ops": ["Functional.linear.3.forward", "Functional.linear.4.forward"],
    "modules": ["Module.model.layers.0.self_attn.v_proj.Linear.forward.0"],
}


def culprit(kind, step, op):
    return {"kind": kind, "step": step, "op": op}


def test_clean_pair_counts_only_without_culprit():
    assert score.judge({"clean": True}, None)
    assert not score.judge({"clean": True}, culprit("op", 0, "Functional.linear.0.forward"))


def test_fault_needs_its_step_and_one_of_its_ops():
    assert score.judge(OP, culprit("parameter", 1, "Functional.linear.4.forward"))
    assert score.judge(OP, culprit("op", 1, "Functional.linear.3.forward"))
    assert score.judge(OP, culprit("op", 1, "Module.model.layers.0.self_attn.v_proj.Linear.forward.0"))
    assert not score.judge(OP, culprit("op", 1, "Module.model.layers.0.self_attn.LlamaAttention.forward.0"))
    assert not score.judge(OP, culprit("op", 0, "Functional.linear.3.forward"))  # right op, wrong step
    assert not score.judge(OP, culprit("op", 1, "Functional.linear.5.forward"))
    assert not score.judge(OP, None)


def test_optimizer_fault_needs_the_optimizer_kind_at_the_first_changed_step():
    assert score.judge(OPT, culprit("optimizer", 2, "Functional.embedding.0.forward"))
    assert not score.judge(OPT, culprit("optimizer", 1, "Functional.embedding.0.forward"))
    assert not score.judge(OPT, culprit("parameter", 2, "Functional.embedding.0.forward"))


def test_msprobe_row_names_are_cut_to_the_record():
    assert score._record("Functional.linear.3.forward.input.0") == "Functional.linear.3.forward"
    assert score._record("Module.model.layers.0.input_layernorm.RMSNorm.forward.0.input.0") == (
        "Module.model.layers.0.input_layernorm.RMSNorm.forward.0"
    )
    assert score._record("Tensor.__add__.3.backward.output.1") == "Tensor.__add__.3.backward"
    assert not score.judge_msprobe(OPT, {"step": 2, "op": "Functional.linear.0.forward"})


DATA = Path(os.environ.get("VALIDATION_DATA", ROOT / "validation" / ".data"))


@pytest.fixture(scope="session")
def key() -> dict:
    path = DATA / "key.json"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "validation" / "make_pairs.py"), "--out", str(DATA)], check=True)
    return json.loads(path.read_text())


@pytest.mark.validation
def test_the_set_is_as_documented(key):
    cases = key["cases"].values()
    assert {c["family"] for c in cases} == {"llama", "moe", "neox", "gpt2"}
    assert {c["device"] for c in cases} == {"A", "B", "C", "D"}
    assert {c["mode"] for c in cases} == {"stats", "tensor"}
    assert sum(c["expect"].get("clean", False) for c in cases if c["mode"] == "stats") == 5
    assert sum(not c["expect"].get("clean", False) for c in cases if c["mode"] == "stats") == 13
    flip = key["cases"]["moe_flip_stats"]
    assert [(f["step"], f["token"]) for f in flip["flips"]] == [(2, flip["crafted"]["token"])]
    assert key["steps"] == 3


@pytest.mark.validation
def test_the_verdict_on_the_validation_set(key, tmp_path):
    rows, proc = score_validation(DATA, tmp_path)
    assert len(rows) == len(key["cases"])
    wrong = [r["name"] for r in rows if not r["ok"]]
    assert not wrong, proc.stdout

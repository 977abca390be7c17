"""The clean combinations (docs/validation.md, "Clean combinations"): every set's families on other sets' devices.

The unmarked tests check the plan (each family on a device of another set, a reference per setup, both dump
modes). The marked test (``validation``) makes the pairs (about 50 msprobe runs, minutes) into
``validation/cross/.data`` unless a key is already there (``VALIDATION_CROSS_DATA`` names another folder), then
scores every pair through dumpstore's CLI with ``validation/score.py``: every pair must be quiet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


cross = _load("validation_cross_make_pairs", ROOT / "validation" / "cross" / "make_pairs.py")


def test_every_pair_runs_a_family_on_another_sets_device():
    assert 14 <= len(cross.PAIRS) <= 20
    for family, device, dtype, _batch, modes in cross.PAIRS.values():
        assert cross.FAMILY_SET[family] != cross.DEVICE_SET[device]
        assert "stats" in modes
        assert dtype == cross.NATIVE[family] or (cross.NATIVE[family], dtype) in {
            ("bf16", "fp32"),
            ("fp32", "bf16-autocast"),
            ("bf16-autocast", "fp16-autocast"),
        }
    tensor = sum("tensor" in modes for *_, modes in cross.PAIRS.values())
    assert len(cross.PAIRS) // 4 <= tensor <= len(cross.PAIRS) // 2
    assert {cross.FAMILY_SET[f] for f, *_ in cross.PAIRS.values()} == {1, 2, 3}
    assert {cross.DEVICE_SET[d] for _, d, *_ in cross.PAIRS.values()} == {1, 2, 3}
    # another dtype setup for at least one family of each kind the sets have
    assert {dtype for _, _, dtype, *_ in cross.PAIRS.values()} == {"fp32", "bf16", "bf16-autocast", "fp16-autocast"}


def test_the_plan_shares_one_reference_per_family_setup_and_mode(tmp_path):
    pairs = {k: cross.PAIRS[k] for k in ("qwen2_A", "qwen2_K", "llama_E")}
    jobs = cross.plan(pairs, tmp_path)
    assert [(j["name"], j["role"]) for j in jobs] == [
        ("qwen2_bf16_b3_ref_stats", "ref"),
        ("qwen2_A_target_stats", "target"),
        ("qwen2_K_target_stats", "target"),
        ("llama_bf16_b2_ref_stats", "ref"),
        ("llama_E_target_stats", "target"),
        ("llama_bf16_b2_ref_tensor", "ref"),
        ("llama_E_target_tensor", "target"),
    ]
    assert {j["device"] for j in jobs if j["family"] == "qwen2"} == {"A", "K"}
    assert all(j["fault"] is None and j["variant"] == "base" for j in jobs)
    assert jobs[0]["dump_dir"] == str(tmp_path / "stats" / "qwen2_bf16_b3_ref_stats")


DATA = Path(os.environ.get("VALIDATION_CROSS_DATA", ROOT / "validation" / "cross" / ".data"))


@pytest.fixture(scope="session")
def key() -> dict:
    path = DATA / "key.json"
    if not path.exists():
        subprocess.run(
            [sys.executable, str(ROOT / "validation" / "cross" / "make_pairs.py"), "--out", str(DATA)], check=True
        )
    return json.loads(path.read_text())


@pytest.mark.validation
def test_the_cross_set_is_as_planned(key):
    made = {(c["case"], c["mode"]) for c in key["cases"].values()}
    dropped = set(key["dropped"])
    planned = {(p, m) for p, (*_, modes) in cross.PAIRS.items() for m in modes}
    assert {"%s_%s" % pm for pm in made} | dropped == {"%s_%s" % pm for pm in planned}
    assert all(c["expect"] == {"clean": True} for c in key["cases"].values())


@pytest.mark.validation
def test_the_verdict_is_quiet_on_every_clean_combination(key, tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "validation" / "score.py"), "--data", str(DATA), "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == len(key["cases"])
    loud = [r["name"] for r in rows if not r["ok"]]
    assert not loud, proc.stdout

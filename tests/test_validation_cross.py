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
    assert 40 <= len(cross.PAIRS) <= 48
    for family, device, dtype, _batch, modes in cross.PAIRS.values():
        assert cross.FAMILY_SET[family] != cross.DEVICE_SET[device]
        assert "stats" in modes
        assert dtype == cross.NATIVE[family] or (cross.NATIVE[family], dtype) in {
            ("bf16", "fp32"),
            ("fp32", "bf16-autocast"),
            ("fp32", "fp16-autocast"),
            ("bf16-autocast", "fp16-autocast"),
            ("bf16-autocast", "fp32"),
            ("fp16-autocast", "bf16-autocast"),
            ("fp16-autocast", "fp32"),
        }
    tensor = sum("tensor" in modes for *_, modes in cross.PAIRS.values())
    assert len(cross.PAIRS) // 4 <= tensor <= len(cross.PAIRS) // 2
    assert {cross.FAMILY_SET[f] for f, *_ in cross.PAIRS.values()} == {1, 2, 3, 4}
    assert {cross.DEVICE_SET[d] for _, d, *_ in cross.PAIRS.values()} == {1, 2, 3, 4}
    # another dtype setup for at least one family of each kind the sets have
    assert {dtype for _, _, dtype, *_ in cross.PAIRS.values()} == {"fp32", "bf16", "bf16-autocast", "fp16-autocast"}


def test_set_4_meets_sets_1_to_3_both_ways():
    """Every family of set 4 on devices of sets 1-3, and set 4's devices whose kernels the transformer families
    call (O, P, Q: N's convolutions and BatchNorm, and the reference rerun R, touch none of them) under families
    of each of sets 1-3; the reference rerun devices (M, R) are no device of their own."""
    set4 = {k: v for k, v in cross.PAIRS.items() if 4 in (cross.FAMILY_SET[v[0]], cross.DEVICE_SET[v[1]])}
    assert len(set4) == 24
    assert {f for f, *_ in set4.values() if cross.FAMILY_SET[f] == 4} == {"t5", "resnet", "mamba", "gptj"}
    on4 = [(f, d) for f, d, *_ in set4.values() if cross.DEVICE_SET[d] == 4]
    assert {d for _, d in on4} == {"O", "P", "Q"}
    assert {cross.FAMILY_SET[f] for f, _ in on4} == {1, 2, 3}
    assert "M" not in cross.DEVICE_SET and "R" not in cross.DEVICE_SET


def test_draw_1_keeps_the_first_twenty_pairs():
    """The pairs made before set 4 existed come first and unchanged (their dumps stay byte-identical)."""
    first = dict(list(cross.PAIRS.items())[:20])
    assert first["llama_E"] == ("llama", "E", "bf16", 2, ("stats", "tensor"))
    assert first["phi_D"] == ("phi", "D", "fp16-autocast", 2, ("stats",))
    assert {cross.FAMILY_SET[f] for f, *_ in first.values()} == {1, 2, 3}


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


def test_a_set_4_job_runs_its_family_on_the_foreign_device_batch_and_dtype(monkeypatch):
    import copy

    s4, dev4 = cross.SET4, cross.DEV4
    for name in ("AUTOCAST", "FAMILIES"):
        monkeypatch.setattr(s4, name, copy.deepcopy(getattr(s4, name)))
    for name in ("DATA_SEED", "IMAGES", "BATCH"):
        monkeypatch.setattr(s4, name, getattr(s4, name))
    monkeypatch.setattr(dev4, "DEVICES", dict(dev4.DEVICES))
    seed, data_seed, batch = s4.FAMILIES["t5"]["seed"], s4.DATA_SEED, s4.BATCH
    cross._apply({"family": "resnet", "device": "F", "dtype": "bf16-autocast", "batch": 6, "draw": 1})
    assert (s4.IMAGES, s4.BATCH) == (6, batch)  # an image classifier's batch is its images
    assert s4.AUTOCAST["resnet"] == "bfloat16"
    assert s4.FAMILIES["resnet"]["device"] == "X" and dev4.DEVICES["X"] is cross.DEV2.DEVICES["F"]
    assert s4.DATA_SEED == data_seed + cross.DATA_SEED_SHIFT
    cross._apply({"family": "t5", "device": "I", "dtype": "fp32", "batch": 3, "draw": 2})
    assert "t5" not in s4.AUTOCAST  # fp32 weights without autocast
    assert s4.BATCH == 3 and s4.FAMILIES["t5"]["seed"] == seed + 2 * cross.SEED_SHIFT

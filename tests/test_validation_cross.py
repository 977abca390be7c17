"""The clean combinations (docs/validation.md, "Clean combinations"): every set's families on other sets' devices.

The unmarked tests check the plan (each family on a device of another set, a reference per setup, both dump
modes). The marked test (``validation``) makes the pairs (about 50 msprobe runs, minutes) into
``validation/cross/.data`` unless a key is already there (``VALIDATION_CROSS_DATA`` names another folder), then
scores every pair through dumpstore's CLI with ``validation/score.py``: every pair must be quiet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_registered, score_validation

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


cross = load_registered("validation_cross_make_pairs", ROOT / "validation" / "cross" / "make_pairs.py")


def test_every_pair_runs_a_family_on_another_sets_device():
    assert 70 <= len(cross.PAIRS) <= 80
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
    assert len(cross.PAIRS) // 5 <= tensor <= len(cross.PAIRS) // 2
    assert {cross.FAMILY_SET[f] for f, *_ in cross.PAIRS.values()} == {1, 2, 3, 4, 5}
    assert {cross.DEVICE_SET[d] for _, d, *_ in cross.PAIRS.values()} == {1, 2, 3, 4, 5}
    # another dtype setup for at least one family of each kind the sets have
    assert {dtype for _, _, dtype, *_ in cross.PAIRS.values()} == {"fp32", "bf16", "bf16-autocast", "fp16-autocast"}


def test_set_4_meets_sets_1_to_3_both_ways():
    """Every family of set 4 on devices of sets 1-3, and set 4's devices whose kernels the transformer families
    call (O, P, Q: N's convolutions and BatchNorm, and the reference rerun R, touch none of them) under families
    of each of sets 1-3; the reference rerun devices (M, R) are no device of their own."""
    set4 = {
        k: v for k, v in cross.select(sets=[4]).items() if 5 not in (cross.FAMILY_SET[v[0]], cross.DEVICE_SET[v[1]])
    }
    assert len(set4) == 24
    assert {f for f, *_ in set4.values() if cross.FAMILY_SET[f] == 4} == {"t5", "resnet", "mamba", "gptj"}
    on4 = [(f, d) for f, d, *_ in set4.values() if cross.DEVICE_SET[d] == 4]
    assert {d for _, d in on4} == {"O", "P", "Q"}
    assert {cross.FAMILY_SET[f] for f, _ in on4} == {1, 2, 3}
    assert "M" not in cross.DEVICE_SET and "R" not in cross.DEVICE_SET


def test_set_5_meets_sets_1_to_4_both_ways():
    """Every family of set 5 on devices of sets 1-4, in its own dtype setup and another; families of sets 1-4 on
    each of set 5's devices but its reference rerun X; the 44 pairs made before set 5 stay first and unchanged."""
    assert list(cross.PAIRS)[:44] == list(cross.select(sets=[1, 2, 3, 4]))[:44]
    set5 = cross.select(sets=[5])
    assert len(set5) == 30 and list(set5) == list(cross.PAIRS)[44:]
    assert {k for k, v in cross.PAIRS.items() if 5 in (cross.FAMILY_SET[v[0]], cross.DEVICE_SET[v[1]])} == set(set5)
    fam5 = [(f, d, dt) for f, d, dt, *_ in set5.values() if cross.FAMILY_SET[f] == 5]
    assert {f for f, *_ in fam5} == {"vit", "wav2vec2", "bart", "granite"}
    for family in ("vit", "wav2vec2", "bart", "granite"):
        setups = {dt for f, _, dt in fam5 if f == family}
        assert cross.NATIVE[family] in setups and len(setups) >= 2
    assert {cross.DEVICE_SET[d] for _, d, _ in fam5} == {1, 2, 3, 4}
    on5 = [(f, d) for f, d, *_ in set5.values() if cross.DEVICE_SET[d] == 5]
    assert {d for _, d in on5} == {"S", "T", "U", "V", "W"}
    assert {cross.FAMILY_SET[f] for f, _ in on5} == {1, 2, 3, 4}
    assert "X" not in cross.DEVICE_SET and cross.POLICY_DEVICES == {"T"}
    # tensor mode for one pair each way (data size)
    assert [k for k, v in set5.items() if "tensor" in v[4]] == ["granite_A", "bert_S"]


def test_select_takes_the_pairs_of_a_set_and_names():
    assert list(cross.select(["vit_C", "llama_E", "opt_V"])) == ["llama_E", "vit_C", "opt_V"]
    assert list(cross.select(["vit_C", "llama_E"], [5])) == ["vit_C"]
    assert set(cross.select(sets=[4])) == {
        k for k, (f, d, *_) in cross.PAIRS.items() if 4 in (cross.FAMILY_SET[f], cross.DEVICE_SET[d])
    }


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
    rows, proc = score_validation(DATA, tmp_path)
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


def test_a_set_5_job_runs_its_family_on_the_foreign_device_batch_and_dtype(monkeypatch):
    import copy

    import torch

    s5, dev5 = cross.SET5, cross.DEV5
    for name in ("AUTOCAST", "FAMILIES"):
        monkeypatch.setattr(s5, name, copy.deepcopy(getattr(s5, name)))
    for name in ("DATA_SEED", "IMAGES", "BATCH", "build_model"):
        monkeypatch.setattr(s5, name, getattr(s5, name))
    devices = dict(dev5.DEVICES)  # set 5's harness reads its devices' table: the same dict
    monkeypatch.setattr(dev5, "DEVICES", devices)
    monkeypatch.setattr(s5, "DEVICES", devices)
    images, data_seed = s5.IMAGES, s5.DATA_SEED
    cross._apply({"family": "wav2vec2", "device": "C", "dtype": "bf16-autocast", "batch": 3, "draw": 1})
    assert (s5.IMAGES, s5.BATCH) == (images, 3)  # the argmax family of set 5 is no image classifier
    assert s5.AUTOCAST["wav2vec2"] == "bfloat16"
    assert s5.FAMILIES["wav2vec2"]["device"] == "X" and dev5.DEVICES["X"] is cross.DEV1.DEVICES["C"]
    assert s5.DATA_SEED == data_seed + cross.DATA_SEED_SHIFT
    cross._apply({"family": "vit", "device": "L", "dtype": "fp16-autocast", "batch": 6, "draw": 1})
    assert (s5.IMAGES, s5.BATCH) == (6, 3) and s5.AUTOCAST["vit"] == "float16"
    cross._apply({"family": "bart", "device": "I", "dtype": "fp32", "batch": 2, "draw": 1})
    assert "bart" not in s5.AUTOCAST
    cross._apply({"family": "granite", "device": "B", "dtype": "fp32", "batch": 2, "draw": 1})
    assert s5.run_device("granite", "base", True) is cross.DEV1.DEVICES["B"]
    assert s5.run_device("granite", "base", False) is None
    monkeypatch.setattr(s5, "FAMILIES", {**s5.FAMILIES, "granite": {**s5.FAMILIES["granite"]}})
    model = s5.build_model("granite")  # the pure bf16 model, cast to fp32
    assert {p.dtype for p in model.parameters()} == {torch.float32}

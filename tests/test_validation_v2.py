"""Validation set 2 (docs/validation.md, "Validation set 2"): its simulated devices stay within rounding, and
(marker ``validation``) the verdict on its pairs.

The unmarked tests run the devices of ``validation/v2/devices.py`` on small random inputs (torch CPU, about a
second). The marked tests make the pairs (35 msprobe runs of four transformers models, minutes) into
``validation/v2/.data`` unless a key is already there (``VALIDATION_V2_DATA`` names another folder), then score
every pair through dumpstore's CLI with ``validation/score.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# loaded under their own names: validation/ is not put on sys.path (no clash with set 1's devices and score)
devices = _load("validation_v2_devices", ROOT / "validation" / "v2" / "devices.py")


def test_round_half_away_differs_from_half_even_only_on_ties():
    # 1 + 2^-8 lies halfway between the bf16 neighbours 1 and 1 + 2^-7: half-even gives 1, half-away 1 + 2^-7
    x = torch.tensor([1.0 + 2.0**-8, -(1.0 + 2.0**-8), 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-9, 3.0, float("inf")])
    got = devices.round_half_away_bf16(x).float().tolist()
    assert got == [1.0 + 2.0**-7, -(1.0 + 2.0**-7), 1.0 + 2 * 2.0**-7, 1.0, 3.0, float("inf")]
    assert x.to(torch.bfloat16).float().tolist()[:2] == [1.0, -1.0]
    # a float64 value just off the tie, whose fp32 rounding is the tie, is rounded once, to its own side
    near = torch.tensor(
        [1.0 + 2.0**-8 - 2.0**-40, 1.0 + 2.0**-8 + 2.0**-40, -(1.0 + 2.0**-8 - 2.0**-40)], dtype=torch.float64
    )
    assert devices.round_half_away_bf16(near).float().tolist() == [1.0, 1.0 + 2.0**-7, -1.0]


def test_bf16x3_is_an_fp32_matmul_at_about_16_bits():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 40, generator=g), torch.randn(40, 24, generator=g)
    exact = a.double() @ b.double()
    err = (devices.bf16x3_matmul(a, b).double() - exact).abs().max().item()
    scale = (a.double().abs() @ b.double().abs()).max().item()
    assert 0 < err < 2.0**-15 * scale
    hi, lo = devices.split_bf16(a)
    assert torch.equal(hi, hi.to(torch.bfloat16).float()) and torch.equal(lo, lo.to(torch.bfloat16).float())


def test_fp16_chunk_accumulation_rounds_inside_each_chunk():
    # 2048 + 1 + 1 + 1 + 1 in fp16 chunks of 4: 2048 + 1 rounds to 2048 (half-even) three times, then +1 in fp32
    a = torch.tensor([[2048.0, 1.0, 1.0, 1.0, 1.0]])
    b = torch.ones(5, 1)
    assert devices.fp16_chunk_matmul(a, b).item() == 2049.0
    assert (a @ b).item() == 2052.0


@pytest.mark.parametrize("fn,dtype", [("silu", torch.bfloat16), ("gelu_tanh", torch.bfloat16), ("silu", torch.float32)])
def test_activation_table_within_about_one_unit_of_the_dtype(fn, dtype):
    x = torch.linspace(-20, 20, 20001)
    exact = devices._FNS[fn](x.double())
    got = devices.lut_activation(x, fn, devices.lut_step(dtype)).double()
    unit = torch.finfo(dtype).eps  # one unit at |f| ~ 1
    assert ((got - exact).abs() / exact.abs().clamp_min(1.0)).max().item() <= unit


def test_welford_layer_norm_and_blocked_cross_entropy_match_stock_to_fp32_rounding():
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(8, 48, generator=g) + 3.0, torch.randn(48, generator=g), torch.randn(48, generator=g)
    stock = torch.nn.functional.layer_norm(x, (48,), w, b, 1e-5)
    assert devices.rel_l2(devices.welford_layer_norm(x, (48,), w, b, 1e-5), stock) < 1e-6
    logits, target = torch.randn(32, 96, generator=g), torch.randint(0, 96, (32,), generator=g)
    target[3] = -100
    for red in ("mean", "sum", "none"):
        stock = torch.nn.functional.cross_entropy(logits, target, reduction=red)
        assert devices.rel_l2(devices.cross_entropy_blocked(logits, target, reduction=red), stock) < 1e-6


def test_every_device_stays_within_its_guard_forward_and_backward():
    rows = devices.measure(seed=7)
    assert {r["device"] for r in rows} == {"E", "F", "G", "H"}
    for r in rows:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(r["dtype"].split()[0], torch.float32)
        guard = devices.GUARD["bf16x3" if r["device"] == "H" and r["op"] in ("linear", "matmul") else dtype]
        assert r["device_vs_stock"] <= guard, r
        assert r.get("grad_device_vs_stock", 0.0) <= guard, r
    # each device changes values somewhere (none is the stock kernel in disguise)
    for dev in ("E", "F", "G", "H"):
        assert max(r["device_vs_stock"] for r in rows if r["device"] == dev) > 0


def test_a_device_installs_and_uninstalls_with_autograd_through_its_kernels():
    dev = devices.DEVICES["G"]
    g = torch.Generator().manual_seed(9)
    w = torch.randn(24, 16, generator=g).requires_grad_()
    x = torch.randn(4, 16, generator=g).requires_grad_()
    stock_fn = torch.nn.functional.linear
    dev.install()
    try:
        assert torch.nn.functional.linear is not stock_fn
        with torch.autocast("cpu", dtype=torch.float16):
            y = torch.nn.functional.linear(x, w)
        y.float().sum().backward()
    finally:
        dev.uninstall()
    assert torch.nn.functional.linear is stock_fn
    assert y.dtype == torch.float16 and x.grad is not None and w.grad is not None
    with torch.autocast("cpu", dtype=torch.float16):
        ref = stock_fn(x.detach(), w.detach())
    assert devices.rel_l2(y, ref) <= devices.GUARD[torch.float16]


# ------------------------------------------------------------------------------------------------------------
# the set itself (marker validation: minutes)
# ------------------------------------------------------------------------------------------------------------
DATA = Path(os.environ.get("VALIDATION_V2_DATA", ROOT / "validation" / "v2" / ".data"))


@pytest.fixture(scope="session")
def key() -> dict:
    path = DATA / "key.json"
    if not path.exists():
        subprocess.run(
            [sys.executable, str(ROOT / "validation" / "v2" / "make_pairs.py"), "--out", str(DATA)], check=True
        )
    return json.loads(path.read_text())


@pytest.mark.validation
def test_the_set_is_as_documented(key):
    cases = list(key["cases"].values())
    assert key["set"] == 2 and key["steps"] == 3
    assert {c["family"] for c in cases} == {"qwen2", "gemma", "opt", "qmoe"}
    assert {c["device"] for c in cases} == {"E", "F", "G", "H"}
    stats = [c for c in cases if c["mode"] == "stats"]
    tensor = [c for c in cases if c["mode"] == "tensor"]
    assert sum(c["expect"].get("clean", False) for c in stats) == 5
    assert sum(not c["expect"].get("clean", False) for c in stats) == 12
    assert sum(c["expect"].get("clean", False) for c in tensor) == 4
    assert sum(not c["expect"].get("clean", False) for c in tensor) == 5
    assert sum(bool(c["expect"].get("optimizer")) for c in stats) == 2
    for mode in ("stats", "tensor"):
        flip = key["cases"]["qmoe_flip_%s" % mode]
        assert [(f["step"], f["token"]) for f in flip["flips"]] == [(2, flip["crafted"]["token"])]
    for c in cases:  # every fault's key names msprobe records (or the optimizer) at its step
        e = c["expect"]
        assert e.get("clean") or e.get("optimizer") or (e["ops"] and all(op.endswith(".forward") for op in e["ops"]))


@pytest.mark.validation
def test_the_verdict_on_validation_set_2(key, tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "validation" / "score.py"), "--data", str(DATA), "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == len(key["cases"])
    wrong = [r["name"] for r in rows if not r["ok"]]
    assert not wrong, proc.stdout

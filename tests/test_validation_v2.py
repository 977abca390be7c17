"""Validation sets 2 to 9 (docs/validation.md, "Validation set 2" to "Validation set 9"): the simulated devices of
sets 2 to 4 stay within rounding, and (marker ``validation``) the verdict on every set's pairs.

The unmarked tests run the devices of ``validation/v2/devices.py``, ``validation/v3/devices.py`` and
``validation/v4/devices.py`` on small random inputs (torch CPU, seconds; set 5's to set 9's are in
``tests/test_validation_v5.py`` to ``tests/test_validation_v9.py``). The marked
tests, one per set, make the set's pairs (35 to 56 msprobe runs of four or five models, minutes) into
``validation/vN/.data`` unless a key is already there
(``VALIDATION_V2_DATA`` ... ``VALIDATION_V9_DATA`` name other folders), then score every pair through dumpstore's
CLI with ``validation/score.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script, score_validation

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


# loaded under their own names: validation/ is not put on sys.path (no clash with set 1's devices and score)
devices = load_script("validation_v2_devices", ROOT / "validation" / "v2" / "devices.py")
devices3 = load_script("validation_v3_devices", ROOT / "validation" / "v3" / "devices.py")


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
# set 3's devices
# ------------------------------------------------------------------------------------------------------------
def test_nofma_rounds_each_product_before_the_lanes_add_them():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: rounded to fp32 the 2^-24 is lost (half-even), an FMA keeps it
    a = torch.tensor([[1.0 + 2.0**-12, 1.0, 1.0, 1.0, -1.0]])
    b = torch.tensor([[1.0 + 2.0**-12], [0.0], [0.0], [0.0], [-1.0]])
    assert devices3.nofma_matmul(a, b).item() == 2.0 + 2.0**-11
    assert (a.double() @ b.double()).item() == 2.0 + 2.0**-11 + 2.0**-24
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(8, 37, generator=g), torch.randn(37, 5, generator=g)
    assert 0 < devices3.rel_l2(devices3.nofma_matmul(x, w), x @ w) < 1e-6


def test_polynomial_exp_and_tanh_within_a_few_fp32_ulps():
    x = torch.linspace(-87, 88, 200001)  # results in fp32's normal range
    exact = torch.exp(x.double())
    rel = ((devices3.poly_exp(x).double() - exact).abs() / exact).max().item()
    assert 0 < rel < 4 * 2.0**-23  # a few units in the last place (stock exp: 1 to 2)
    special = torch.tensor([float("-inf"), -1e30, -200.0, 100.0, float("inf")])
    assert devices3.poly_exp(special).tolist() == [0.0, 0.0, 0.0, float("inf"), float("inf")]
    t = torch.linspace(-12, 12, 100001)
    err = (devices3.poly_tanh(t).double() - torch.tanh(t.double())).abs().max().item()
    assert err < 4 * 2.0**-24


def test_kahan_layer_norm_and_the_reordered_embedding_gradient_match_stock_to_fp32_rounding():
    g = torch.Generator().manual_seed(12)
    x, w, b = torch.randn(8, 48, generator=g) + 3.0, torch.randn(48, generator=g), torch.randn(48, generator=g)
    stock = torch.nn.functional.layer_norm(x, (48,), w, b, 1e-5)
    assert devices3.rel_l2(devices3.kahan_layer_norm(x, (48,), w, b, 1e-5), stock) < 1e-6
    assert devices3.kahan_sum(torch.tensor([[1.0, 2.0**-24, 2.0**-24, 2.0**-24, 2.0**-24]])).item() == 1.0 + 2.0**-22
    ids = torch.tensor([[3, 3, 3, 1], [3, 0, 3, 1]])
    grad = torch.randn(2, 4, 6, generator=g)
    exact = torch.zeros(5, 6, dtype=torch.float64).index_add_(0, ids.reshape(-1), grad.reshape(-1, 6).double())
    for order in ("reverse", "random"):
        got = devices3.scatter_rows(grad, ids, 5, order, seed=4)
        assert (got.double() - exact).abs().max().item() < 1e-6
        assert got[2].abs().sum().item() == 0.0 and got[4].abs().sum().item() == 0.0


def test_ftz_flushes_fp16_subnormals_only_and_allreduce_rounds_twice():
    x = torch.tensor([2.0**-15, -(2.0**-16), 2.0**-14, 1.0, -3.0], dtype=torch.float16)
    assert devices3.ftz16(x).tolist() == [0.0, 0.0, 2.0**-14, 1.0, -3.0]
    assert devices3.ftz16(x.float()).tolist() == x.float().tolist()  # other dtypes as they are
    g = torch.Generator().manual_seed(13)
    gy, xx = torch.randn(32, 24, generator=g), torch.randn(32, 16, generator=g)
    one = (gy.t() @ xx).to(torch.bfloat16).float()
    two = devices3.allreduce_grad(gy, xx, 2, torch.bfloat16)
    assert 0 < devices3.rel_l2(two, one) < 2 * 2.0**-8
    assert torch.equal(two, two.to(torch.bfloat16).float())


def test_every_set3_device_stays_within_its_guard_and_changes_something():
    rows = devices3.measure(seed=7)
    assert {r["device"] for r in rows} == {"I", "J", "K", "L", "M"}
    for r in rows:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(r["dtype"].split()[0], torch.float32)
        for col in ("device_vs_stock", "grad_device_vs_stock", "wgrad_device_vs_stock"):
            assert r.get(col, 0.0) <= devices3.GUARD[dtype], r
    for dev in ("I", "J", "K", "L", "M"):
        mine = [r for r in rows if r["device"] == dev]
        assert max(max(r["device_vs_stock"], r.get("grad_device_vs_stock", 0), r.get("wgrad_device_vs_stock", 0))
                   for r in mine) > 0, dev  # fmt: skip


def test_a_set3_device_installs_and_uninstalls_with_autograd_through_its_kernels():
    dev = devices3.DEVICES["J"]
    g = torch.Generator().manual_seed(14)
    w = torch.randn(24, 16, generator=g).requires_grad_()
    x = torch.randn(4, 16, generator=g)
    emb = torch.randn(10, 16, generator=g).requires_grad_()
    ids = torch.tensor([[1, 1, 1, 2]])
    stock_fn, stock_emb = torch.nn.functional.linear, torch.nn.functional.embedding
    dev.install()
    try:
        assert torch.nn.functional.linear is not stock_fn and torch.nn.functional.embedding is not stock_emb
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x + torch.nn.functional.embedding(ids, emb)[0], w)
        y.float().sum().backward()
    finally:
        dev.uninstall()
    assert torch.nn.functional.linear is stock_fn and torch.nn.functional.embedding is stock_emb
    assert y.dtype == torch.bfloat16 and w.grad is not None and emb.grad is not None
    assert emb.grad[0].abs().sum().item() == 0.0 and emb.grad[1].abs().sum().item() > 0


# ------------------------------------------------------------------------------------------------------------
# the sets themselves (marker validation: minutes)
# ------------------------------------------------------------------------------------------------------------
SETS = {
    "v2": {
        "set": 2,
        "families": {"qwen2", "gemma", "opt", "qmoe"},
        "devices": {"E", "F", "G", "H"},
        "counts": {("stats", True): 5, ("stats", False): 12, ("tensor", True): 4, ("tensor", False): 5},
        "optimizer": 2,
        "flip": "qmoe_flip",
    },
    "v3": {
        "set": 3,
        "families": {"falcon", "bloom", "bert", "phi"},
        "devices": {"I", "J", "K", "L", "J+M"},
        "counts": {("stats", True): 6, ("stats", False): 14, ("tensor", True): 4, ("tensor", False): 4},
        "optimizer": 3,
        "flip": "falcon_flip",
    },
    "v4": {
        "set": 4,
        "families": {"t5", "resnet", "mamba", "gptj"},
        "devices": {"N", "O", "P", "Q", "N+R"},
        "counts": {("stats", True): 6, ("stats", False): 15, ("tensor", True): 4, ("tensor", False): 5},
        "optimizer": 3,
        "flip": "resnet_flip",
    },
    "v5": {
        "set": 5,
        "families": {"vit", "wav2vec2", "bart", "granite", "granite_wide"},
        "devices": {"S", "T", "U", "V", "W", "S+X"},
        "counts": {("stats", True): 8, ("stats", False): 19, ("tensor", True): 4, ("tensor", False): 6},
        "optimizer": 6,
        "flip": "wav2vec2_flip",
        "flip_modes": ("stats",),  # tensor mode: 4 clean pairs without the flip (the data kept under 300 MB)
    },
    "v6": {
        "set": 6,
        "families": {"convnext", "clip", "rwkv", "deberta", "deberta_wide"},
        "devices": {"Y", "Z", "AA", "AB", "AC", "Z+AD"},
        "counts": {("stats", True): 8, ("stats", False): 19, ("tensor", True): 4, ("tensor", False): 6},
        "optimizer": 7,
        "flip": "convnext_flip",
        "flip_modes": ("stats",),
    },
    "v7": {
        "set": 7,
        "families": {"swin", "whisper", "olmoe", "olmoe_wide", "siglip"},
        "devices": {"AE", "AF", "AG", "AH", "AI", "AF+AJ"},
        "counts": {("stats", True): 8, ("stats", False): 19, ("tensor", True): 4, ("tensor", False): 6},
        "optimizer": 7,
        "flip": "swin_flip",
        "flip_modes": ("stats",),
    },
    "v8": {
        "set": 8,
        "families": {"mobilenet", "fnet", "stablelm", "stablelm_wide", "patchtst"},
        "devices": {"AK", "AL", "AM", "AN", "AO", "AK+AQ", "AL+AP"},
        "counts": {("stats", True): 9, ("stats", False): 24, ("tensor", True): 4, ("tensor", False): 6},
        "optimizer": 8,
        "flip": "fnet_flip",
        "flip_modes": ("stats",),
    },
    "v9": {
        "set": 9,
        "families": {"electra", "electra_wide", "regnet", "regnet_wide", "cohere", "cohere_wide", "marian"},
        "devices": {"BA", "BB", "BC", "BD", "BE", "BA+BF", "BB+BF", "BC+BF", "BD+BF"},
        "counts": {("stats", True): 13, ("stats", False): 27, ("tensor", True): 3, ("tensor", False): 6},
        "optimizer": 9,
        "flip": "electra_flip",
        "flip_modes": ("stats",),
    },
}


def _data(name: str) -> Path:
    return Path(os.environ.get("VALIDATION_%s_DATA" % name.upper(), ROOT / "validation" / name / ".data"))


_KEYS: dict = {}


@pytest.fixture(scope="session", params=sorted(SETS))
def validation_set(request) -> tuple[str, dict]:
    name = request.param
    if name not in _KEYS:
        path = _data(name) / "key.json"
        if not path.exists():
            make = ROOT / "validation" / name / "make_pairs.py"
            subprocess.run([sys.executable, str(make), "--out", str(_data(name))], check=True)
        _KEYS[name] = json.loads(path.read_text())
    return name, _KEYS[name]


@pytest.mark.validation
def test_the_set_is_as_documented(validation_set):
    name, key = validation_set
    want = SETS[name]
    cases = list(key["cases"].values())
    assert key["set"] == want["set"] and key["steps"] == 3
    assert {c["family"] for c in cases} == want["families"]
    assert {c["device"] for c in cases} == want["devices"]
    for (mode, clean), n in want["counts"].items():
        assert sum(c["expect"].get("clean", False) == clean for c in cases if c["mode"] == mode) == n, (mode, clean)
    assert sum(bool(c["expect"].get("optimizer")) for c in cases if c["mode"] == "stats") == want["optimizer"]
    for mode in want.get("flip_modes", ("stats", "tensor")):
        flip = key["cases"]["%s_%s" % (want["flip"], mode)]
        assert [(f["step"], f["token"]) for f in flip["flips"]] == [(2, flip["crafted"]["token"])]
    for c in cases:  # every fault's key names msprobe records (or the optimizer) at its step
        e = c["expect"]
        assert e.get("clean") or e.get("optimizer") or (e["ops"] and all(op.endswith(".forward") for op in e["ops"]))


@pytest.mark.validation
def test_the_verdict_on_the_validation_set(validation_set, tmp_path):
    name, key = validation_set
    rows, proc = score_validation(_data(name), tmp_path)
    assert len(rows) == len(key["cases"])
    wrong = [r["name"] for r in rows if not r["ok"]]
    assert not wrong, proc.stdout


def test_set3_batches_change_only_what_each_data_fault_says():
    make3 = load_script("validation_v3_make_pairs", ROOT / "validation" / "v3" / "make_pairs.py")
    for family, kind, step in (("falcon", "ids", 2), ("bert", "token_type", 1), ("bert", "labels", 2)):
        clean = make3.batches(family, None)
        bad = make3.batches(family, {"kind": kind, "step": step})
        field = {"ids": "input_ids", "token_type": "token_type_ids", "labels": "labels"}[kind]
        for s in range(3):
            for a, b in zip(clean[s], bad[s]):
                for name in a:
                    want = (1 if kind == "ids" else 2) if (s, name) == (step, field) else 0
                    assert int((a[name] != b[name]).sum()) == want, (family, kind, s, name)
    phi = make3.batches("phi", None)
    assert [len(s) for s in phi] == [2, 2, 2] and not torch.equal(phi[0][0]["input_ids"], phi[0][1]["input_ids"])
    bert = make3.batches("bert", None)[0][0]
    masked = bert["labels"] >= 0
    assert masked[:, 3].all() and (bert["input_ids"][masked] == make3.MASK_ID).all()
    assert (bert["token_type_ids"][:, 8:] == 1).all() and (bert["token_type_ids"][:, :8] == 0).all()


# ------------------------------------------------------------------------------------------------------------
# set 4's devices
# ------------------------------------------------------------------------------------------------------------
devices4 = load_script("validation_v4_devices", ROOT / "validation" / "v4" / "devices.py")


def test_taps_convolution_adds_the_taps_in_its_order_and_matches_stock_to_fp32_rounding():
    # one channel, a 1x3 filter of ones over [1, 2^-24, 2^-24]: in tap order each 2^-24 is lost to 1 (half-even),
    # in reverse order the two small terms add to 2^-23 first, which 1 keeps
    x = torch.tensor([[[[1.0, 2.0**-24, 2.0**-24]]]])
    w = torch.ones(1, 1, 1, 3)
    assert devices4.taps_conv2d(x, w).item() == 1.0
    assert devices4.taps_conv2d(x, w, order="reverse").item() == 1.0 + 2.0**-23
    g = torch.Generator().manual_seed(21)
    x, w, b = torch.randn(2, 6, 9, 9, generator=g), torch.randn(8, 3, 3, 3, generator=g), torch.randn(8, generator=g)
    for kw in ({"stride": 2, "padding": 1, "groups": 2}, {"padding": 0, "dilation": 2, "groups": 1}):
        if kw["groups"] == 1:
            w = torch.randn(8, 6, 3, 3, generator=g)
        stock = torch.nn.functional.conv2d(x, w, b, **kw)
        got = devices4.taps_conv2d(x, w, b, **kw)
        assert 0 < devices4.rel_l2(got, stock) < 1e-6
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = torch.randn(stock.shape, generator=g)
        (torch.nn.functional.conv2d(xs, ws, b, **kw) * r).sum().backward()
        gx, gw = devices4.taps_conv2d_grads(r, x, w, **kw)
        assert devices4.rel_l2(gx, xs.grad) < 1e-6 and devices4.rel_l2(gw, ws.grad) < 1e-6


def test_one_pass_batch_statistics_cancel_where_two_passes_do_not():
    # E[x^2] = 1e8 + 1 is not an fp32 number (its spacing there is 8): the one-pass variance of 1e4 +- 1 is 0
    x = torch.tensor([1e4 + 1, 1e4 - 1]).view(2, 1)
    mean, var = devices4.one_pass_batch_stats(x)
    assert mean.tolist() == [1e4] and var.tolist() == [0.0]
    assert x.var(0, unbiased=False).tolist() == [1.0]
    g = torch.Generator().manual_seed(22)
    y = torch.randn(4, 16, 5, 5, generator=g) * 0.7 + 0.3
    mean, var = devices4.one_pass_batch_stats(y)
    assert 0 < devices4.rel_l2(var, y.var((0, 2, 3), unbiased=False)) < 1e-6


def test_blocked_sum_adds_blocks_of_eight_then_a_tree():
    # block 1: 1 then seven 2^-24, each lost (half-even); block 2: eight 2^-24 = 2^-21 exactly; the tree keeps it
    x = torch.tensor([1.0] + [2.0**-24] * 15)
    assert devices4.blocked_sum(x).item() == 1.0 + 2.0**-21
    g = torch.Generator().manual_seed(23)
    y = torch.randn(3, 5, 37, generator=g)
    assert 0 < devices4.rel_l2(devices4.blocked_mean(y, 1, keepdim=True), y.mean(1, keepdim=True)) < 1e-6
    assert devices4.blocked_mean(y, -1).shape == (3, 5)
    w, b = torch.randn(37, generator=g), torch.randn(37, generator=g)
    stock = torch.nn.functional.layer_norm(y, (37,), w, b, 1e-5)
    assert devices4.rel_l2(devices4.blocked_layer_norm(y, (37,), w, b, 1e-5), stock) < 1e-6


def test_pow_sincos_softplus_and_the_reciprocal_within_a_few_fp32_ulps():
    assert devices4.pow_exp2(torch.tensor([2.0, -2.0, 4.0, 0.0, -0.5]), 3.0).tolist() == [8.0, -8.0, 64.0, 0.0, -0.125]
    assert devices4.pow_exp2(torch.tensor([-3.0, 3.0]), 2.0).tolist() == [9.0, 9.0]
    assert math.isnan(devices4.pow_exp2(torch.tensor([-2.0]), 0.5).item())
    x = torch.linspace(-8, 8, 20001)
    x = x[x != 0]
    for e in (2.0, 3.0):  # within CUDA's bound for its fast-math __powf: 2 + 1.16 |e log2 x| ulps (and rounding)
        exact = x.double() ** e
        rel = (devices4.pow_exp2(x, e).double() - exact).abs() / exact.abs()
        bound = (3 + 1.16 * (e * torch.log2(x.double().abs())).abs()) * 2.0**-23
        assert rel.max().item() > 0 and bool((rel <= bound).all())
    t = torch.linspace(-64, 64, 100001)
    assert (devices4.fast_sin(t).double() - torch.sin(t.double())).abs().max().item() < 4 * 2.0**-24
    assert (devices4.fast_cos(t).double() - torch.cos(t.double())).abs().max().item() < 4 * 2.0**-24
    assert devices4.fast_sin(torch.zeros(1)).item() == 0.0 and devices4.fast_cos(torch.zeros(1)).item() == 1.0
    s = torch.linspace(-30, 30, 20001)
    exact = torch.nn.functional.softplus(s.double())
    assert ((devices4.stable_softplus(s).double() - exact).abs() / exact).max().item() < 4 * 2.0**-24
    assert devices4.rcp(torch.tensor([2.0, 0.25, -4.0])).tolist() == [0.5, 4.0, -0.25]  # powers of two: exact
    d = torch.linspace(1, 2, 10001)
    assert ((devices4.rcp(d).double() - 1 / d.double()).abs() * d.double()).max().item() < 8 * 2.0**-24
    assert not torch.equal(devices4.rcp(d), 1 / d)


def test_every_set4_device_stays_within_its_guard_and_changes_something():
    rows = devices4.measure(seed=7)
    assert {r["device"] for r in rows} == {"N", "O", "P", "Q", "R"}
    for r in rows:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(r["dtype"], torch.float32)
        for col in ("device_vs_stock", "grad_device_vs_stock", "wgrad_device_vs_stock"):
            assert r.get(col, 0.0) <= devices4.GUARD[dtype], r
    for dev in ("N", "O", "P", "Q", "R"):
        assert max(r["device_vs_stock"] for r in rows if r["device"] == dev) > 0, dev


def test_a_set4_device_installs_and_uninstalls_with_autograd_through_its_kernels():
    F = torch.nn.functional
    dev = devices4.DEVICES["N"]
    g = torch.Generator().manual_seed(24)
    x = torch.randn(2, 3, 6, 6, generator=g).requires_grad_()
    w = torch.randn(4, 3, 3, 3, generator=g).requires_grad_()
    rm, rv = torch.zeros(4), torch.ones(4)
    r = torch.randn(2, 4, 6, 6, generator=g)
    stock = {k: getattr(m, a) for k, (m, a) in devices4._TARGETS.items()}
    dev.install()
    try:
        assert F.conv2d is not stock["conv2d"] and F.batch_norm is not stock["batch_norm"]
        y = F.batch_norm(F.conv2d(x, w, None, 1, 1), rm, rv, None, None, True, 0.1, 1e-5)
        (y * r).sum().backward()
    finally:
        dev.uninstall()
    assert {k: getattr(m, a) for k, (m, a) in devices4._TARGETS.items()} == stock
    assert x.grad is not None and w.grad is not None and rm.abs().sum().item() > 0
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ys = F.batch_norm(F.conv2d(xs, ws, None, 1, 1), torch.zeros(4), torch.ones(4), None, None, True, 0.1, 1e-5)
    (ys * r).sum().backward()
    assert 0 < devices4.rel_l2(y, ys) < 1e-5 and 0 < devices4.rel_l2(w.grad, ws.grad) < 1e-4
    mamba = devices4.DEVICES["O"]
    h = torch.randn(2, 8, 16, generator=g, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(8, 1, 4, generator=g, dtype=torch.bfloat16).requires_grad_()
    mamba.install()
    try:
        out = F.silu(F.conv1d(h, k, None, 1, 3, 1, 8)[..., :16])
        z = F.softplus(out.float()).pow(2).mean(-1, keepdim=True)
        z.sum().backward()
    finally:
        mamba.uninstall()
    assert {k_: getattr(m, a) for k_, (m, a) in devices4._TARGETS.items()} == stock
    assert h.grad is not None and k.grad is not None and h.grad.dtype == torch.bfloat16


def test_set4_batches_change_only_what_each_data_fault_says():
    make4 = load_script("validation_v4_make_pairs", ROOT / "validation" / "v4" / "make_pairs.py")
    for family, kind, step in (("mamba", "ids", 1), ("t5", "ids", 2), ("resnet", "labels", 2)):
        clean = make4.batches(family, None)
        bad = make4.batches(family, {"kind": kind, "step": step})
        field = {"ids": "input_ids", "labels": "labels"}[kind]
        for s in range(3):
            for m, (a, b) in enumerate(zip(clean[s], bad[s])):
                for name in a:
                    want = (1 if kind == "ids" else 2) if (s, m, name) == (step, 0, field) else 0
                    assert int((a[name] != b[name]).sum()) == want, (family, kind, s, m, name)
    t5 = make4.batches("t5", None)
    assert [len(s) for s in t5] == [2, 2, 2] and t5[0][0]["labels"].shape == (2, 8)
    img = make4.batches("resnet", None)[0][0]
    assert (
        img["pixel_values"].shape == (8, 3, 16, 16) and 0 <= img["pixel_values"].min() < img["pixel_values"].max() < 1
    )

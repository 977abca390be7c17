"""Validation set 6's simulated devices (docs/validation.md, "Validation set 6"): each mechanism on small inputs
(exact values where they exist), every device within its guard and changing something, devices installing and
uninstalling with autograd through them, the generator's optimizers and data faults. torch CPU, seconds. The set's
pairs and their score are the marked tests of ``tests/test_validation_v2.py`` (``[v6]``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers import load_script, randn, rel_l2

torch = pytest.importorskip("torch")
F = torch.nn.functional

ROOT = Path(__file__).resolve().parents[1]


dev6 = load_script("validation_v6_devices", ROOT / "validation" / "v6" / "devices.py")


# ------------------------------------------------------------------------------------------------------------
# mechanisms
# ------------------------------------------------------------------------------------------------------------
def test_rational_erf_is_odd_clamped_and_within_a_few_fp32_ulps():
    x = torch.linspace(-6.0, 6.0, 4001)
    got = dev6.rational_erf(x)
    assert dev6.rational_erf(torch.zeros(1)).item() == 0.0
    assert torch.equal(dev6.rational_erf(-x), -got)  # odd: x P(x^2) / Q(x^2)
    assert torch.equal(got[x >= 4.0], got[x >= 4.0][:1].expand(int((x >= 4.0).sum())))  # clamped at 4
    assert abs(got[-1].item() - 1.0) < 1e-7
    err = (got.double() - torch.erf(x.double())).abs().max().item()
    assert 0 < err < 5e-7


def test_rational_gelu_and_its_gradient_match_the_exact_gelu():
    assert dev6.rational_gelu(torch.tensor([0.0, 10.0])).tolist() == [0.0, 10.0]
    x = randn(4096, scale=3.0)
    assert 0 < rel_l2(dev6.rational_gelu(x), F.gelu(x)) < 2e-6
    xd = x.double().requires_grad_()
    F.gelu(xd).sum().backward()
    assert rel_l2(dev6.rational_gelu_grad(x), xd.grad) < 1e-6


def test_fma_layer_norm_folds_rstd_into_the_weight_and_rounds_once():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    y = dev6.fma_layer_norm(x, (4,), None, None, 0.0)
    want = (torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=torch.float64) / math.sqrt(1.25)).float()
    assert (y - want).abs().max().item() <= 1.2e-7
    x, w, b = (
        randn(64, 32, scale=0.5) + 0.2,
        randn(32, seed=1, scale=0.1) + 1.0,
        randn(32, seed=2, scale=0.1),
    )
    got = dev6.fma_layer_norm(x, (32,), w, b, 1e-5)
    stock = F.layer_norm(x, (32,), w, b, 1e-5)
    assert 0 < rel_l2(got, stock) < 1e-6
    # the epilogue: one fused multiply-add of the centred value and the folded scale
    d = x - x.mean(-1, keepdim=True)
    scale = w * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(got, (d.double() * scale.double() + b.double()).float())


def test_scaled_norm_is_exact_on_pythagorean_rows_and_does_not_overflow():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [3e30, 4e30]])
    assert dev6.scaled_norm(x, -1).tolist() == [5.0, 0.0, pytest.approx(5e30, rel=1e-6)]
    assert dev6.scaled_norm(x, -1, keepdim=True).shape == (3, 1)
    h = randn(4, 8, 8, 64)
    got, stock = dev6.scaled_norm(h, (1, 2), True), torch.norm(h, p=2, dim=(1, 2), keepdim=True)
    assert got.shape == stock.shape and 0 < rel_l2(got, stock) < 1e-6


def test_log1p_cross_entropy_and_its_gradient_match_stock():
    loss, _ = dev6.log1p_ce(torch.zeros(2, 4), torch.tensor([1, 3]))
    assert abs(loss.item() - math.log(4.0)) < 1e-7
    x, t = randn(64, 96, scale=2.0), torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(1))
    t[:5] = -100
    for eps in (0.0, 0.1):
        loss, grad = dev6.log1p_ce(x, t, eps)
        xd = x.double().requires_grad_()
        want = F.cross_entropy(xd, t, label_smoothing=eps)
        want.backward()
        assert abs(loss.item() - want.item()) / want.item() < 1e-6
        assert grad[:5].abs().max().item() == 0.0 and rel_l2(grad, xd.grad) < 1e-6


def test_two_sided_sigmoid_is_symmetric_and_within_fp32_rounding():
    assert dev6.sym_sigmoid(torch.tensor([0.0])).item() == 0.5
    x = randn(4096, scale=4.0)
    y = dev6.sym_sigmoid(x)
    assert (y + dev6.sym_sigmoid(-x) - 1).abs().max().item() < 1.2e-7
    assert 0 < rel_l2(y, torch.sigmoid(x)) < 1e-6
    assert dev6.sym_sigmoid(torch.tensor([-100.0])).item() == pytest.approx(math.exp(-100), rel=1e-5)


def test_table_driven_exp_is_exact_at_zero_and_within_two_fp32_ulps():
    special = torch.tensor([0.0, -math.inf, math.inf, math.nan, 100.0, -200.0, -1e38])
    got = dev6.tang_exp(special)
    assert got[:3].tolist() == [1.0, 0.0, math.inf] and math.isnan(got[3].item())
    assert got[4:].tolist() == [math.inf, 0.0, 0.0]
    x = torch.linspace(-80.0, 80.0, 20001)
    got, stock = dev6.tang_exp(x), torch.exp(x)
    assert ((got.double() - torch.exp(x.double())) / torch.exp(x.double())).abs().max().item() < 2.5e-7
    assert (got != stock).any()
    assert torch.equal(dev6.tang_exp(torch.arange(-10.0, 11.0) * dev6.LN2_32 * 32), 2.0 ** torch.arange(-10.0, 11.0))


def test_stochastic_rounding_picks_a_neighbour_without_bias():
    gen = torch.Generator().manual_seed(0)
    exact = torch.tensor([1.0, -2.5, 0.0, 3.0e38])
    assert torch.equal(dev6.stochastic_round_bf16(exact, gen).float(), exact.to(torch.bfloat16).float())
    v = torch.full((4096,), 1.0 + 2.0**-9)  # a quarter of a bf16 ulp above 1
    got = dev6.stochastic_round_bf16(v, gen).float()
    assert set(got.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert 0.2 < (got > 1).float().mean().item() < 0.3
    neg = dev6.stochastic_round_bf16(-v, gen).float()
    assert set(neg.unique().tolist()) == {-1.0, -1.0 - 2.0**-7}


def test_the_store_rounds_to_nearest_unless_the_device_rounds_stochastically():
    value = torch.full((256,), 1.0 + 2.0**-9)
    p = torch.zeros(256, dtype=torch.bfloat16)
    dev6.store(p, value)
    assert (p.float() == 1.0).all()
    device = dev6.DEVICES["AA"]
    runs = []
    for _ in range(2):
        device.install()
        try:
            dev6.store(p, value)
            runs.append(p.clone())
        finally:
            device.uninstall()
    assert torch.equal(runs[0], runs[1]) and (runs[0].float() > 1).any()  # seeded at install: the same each run
    p32 = torch.zeros(4)
    device.install()
    try:
        dev6.store(p32, torch.full((4,), 1.0 + 2.0**-9))  # fp32 parameters: a plain copy
    finally:
        device.uninstall()
    assert (p32 == 1.0 + 2.0**-9).all()


def test_the_fp32_softmax_policy_changes_the_autocast_output_dtype_only():
    device = dev6.DEVICES["AC"]
    s = randn(4, 8, 8).to(torch.bfloat16)
    device.install()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = F.softmax(s, dim=-1)
        plain = F.softmax(s, dim=-1)
    finally:
        device.uninstall()
    assert got.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert torch.equal(got, F.softmax(s.float(), dim=-1)) and 0 < rel_l2(got, plain.float()) < 1e-2


# ------------------------------------------------------------------------------------------------------------
# devices: within the guard, changing something, installing and uninstalling with autograd through them
# ------------------------------------------------------------------------------------------------------------
def test_every_device_stays_within_its_guard_and_changes_something():
    rows = dev6.measure(0)
    assert {r["device"] for r in rows} == set(dev6.DEVICES)
    changed = {r["device"] for r in rows if r["device_vs_stock"] > 0}
    assert changed == set(dev6.DEVICES)
    for r in rows:
        if r["op"] == "softmax":
            assert 0 < r["device_vs_stock"] < dev6.GUARD[torch.bfloat16], r  # fp32 against the bf16 output
            continue
        bound = 1e-2 if r["op"].startswith("store") else 1e-3 if r["dtype"] in ("bfloat16", "float16") else 1e-6
        assert r["device_vs_stock"] < bound, r
        if "grad_device_vs_stock" in r:
            assert 0 < r["grad_device_vs_stock"] < 2e-5, r


def test_devices_install_and_uninstall_with_autograd_through_them():
    stock = {k: getattr(m, a) for k, (m, a) in dev6._TARGETS.items()}
    x = randn(4, 8, 16).requires_grad_()
    w = (randn(16, seed=1) + 1.0).requires_grad_()
    for name, device in dev6.DEVICES.items():
        device.install()
        try:
            assert dev6.installed() is device
            h = F.gelu(F.layer_norm(x, (16,), w, None))
            g = torch.norm(h, p=2, dim=(1, 2), keepdim=True)
            h = h * torch.sigmoid(h) / (g + 1.0) + h.exp().mean()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                p = F.softmax(torch.matmul(h, h.transpose(-1, -2)), dim=-1)
            ce = F.cross_entropy(h.reshape(-1, 16), torch.zeros(32, dtype=torch.long), label_smoothing=0.1)
            (p.float().sum() + ce + torch.exp(h).mean()).backward()
        finally:
            device.uninstall()
        assert dev6.installed() is None
        assert {k: getattr(m, a) for k, (m, a) in dev6._TARGETS.items()} == stock, name
        assert x.grad is not None and torch.isfinite(x.grad).all() and w.grad is not None, name
        x.grad, w.grad = None, None


def test_a_replacement_outside_the_guard_raises():
    device = dev6.DEVICES["Z"]
    saved = dev6.tang_exp
    dev6.tang_exp = lambda x: saved(x) * 1.01
    device.install()
    try:
        with pytest.raises(AssertionError, match="exp"):
            randn(8).exp()
    finally:
        device.uninstall()
        dev6.tang_exp = saved


# ------------------------------------------------------------------------------------------------------------
# the generator: its optimizers and data faults
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def make6():
    return load_script("validation_v6_make_pairs", ROOT / "validation" / "v6" / "make_pairs.py")


def test_the_handwritten_optimizers(make6):
    LAMB, Lion = make6._optim_classes()
    assert [LAMB.factor(t, 2, 8) for t in (1, 2, 8)] == [0.5, 1.0, pytest.approx(0.1)]
    p = torch.nn.Parameter(torch.tensor([1.0, -0.5, 0.25]).to(torch.bfloat16))
    p.grad = torch.tensor([0.5, 0.0, -1.0]).to(torch.bfloat16)
    Lion([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1).step()
    want = torch.tensor([1.0, -0.5, 0.25]) * (1 - 1e-3) - 1e-2 * torch.tensor([1.0, 0.0, -1.0])
    assert torch.equal(p.detach(), want.to(torch.bfloat16))
    q = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    q.grad = torch.tensor([1.0, 1.0])
    LAMB([q], lr=0.1, eps=0.0).step()  # update (1, 1): trust ratio 5 / sqrt 2, half the rate in warmup
    assert q.detach().tolist() == pytest.approx([3.0 - 0.05 * 5 / math.sqrt(2)] + [4.0 - 0.05 * 5 / math.sqrt(2)])


def test_set6_batches_change_only_what_each_data_fault_says(make6):
    for family, fault, field, want in (
        ("convnext", {"kind": "bgr", "step": 2, "micro": 1}, "pixel_values", None),
        ("clip", {"kind": "ids", "step": 1}, "input_ids", 1),
        ("deberta", {"kind": "labels", "step": 2}, "labels", 2),
    ):
        clean, bad = make6.batches(family, None), make6.batches(family, fault)
        for s in range(3):
            for m, (a, b) in enumerate(zip(clean[s], bad[s])):
                for name in a:
                    hit = (s, m, name) == (fault["step"], fault.get("micro", 0), field)
                    n = int((a[name] != b[name]).sum())
                    if hit and want is None:
                        assert torch.equal(b[name], a[name].flip(1)) and n > 0
                    else:
                        assert n == (want if hit else 0), (family, s, m, name)
    conv = make6.batches("convnext", None)
    assert [len(s) for s in conv] == [3, 3, 3] and conv[0][0]["pixel_values"].shape == (2, 3, 12, 12)
    clip = make6.batches("clip", {"kind": "ids", "step": 1})[1][0]["input_ids"]
    assert (clip[:, -1] == make6.VOCAB - 1).all() and (clip[:, :-1] < make6.VOCAB - 1).all()  # one end of text
    deb = make6.batches("deberta", None)[0][0]
    masked = deb["labels"] >= 0
    assert (masked.sum(1) == make6.N_MASKED).all() and (deb["input_ids"][masked] == make6.MASK_ID).all()

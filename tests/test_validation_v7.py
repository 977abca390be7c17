"""Validation set 7's simulated devices (docs/validation.md, "Validation set 7"): each mechanism on small inputs
(exact values where they exist), every device within its guard and changing something, a replacement outside the
guard raising, devices installing and uninstalling with autograd through them, the generator's optimizers and data
faults. torch CPU, seconds. The set's pairs and their score are the marked tests of ``tests/test_validation_v2.py``
(``[v7]``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers import load_registered

torch = pytest.importorskip("torch")
F = torch.nn.functional

ROOT = Path(__file__).resolve().parents[1]


dev7 = load_registered("validation_v7_devices", ROOT / "validation" / "v7" / "devices.py")


def _make7():
    return load_registered("validation_v7_make_pairs", ROOT / "validation" / "v7" / "make_pairs.py")


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _ints(*shape, seed=0, lo=-4, hi=5):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).float()


# ------------------------------------------------------------------------------------------------------------
# mechanisms
# ------------------------------------------------------------------------------------------------------------
def test_strassen_is_exact_on_small_integers_and_within_fp32_rounding_elsewhere():
    a, b = _ints(3, 4, 6, seed=1), _ints(3, 6, 8, seed=2)
    assert torch.equal(dev7.strassen(a, b), a @ b)  # every block sum and product exact
    a, b = _randn(2, 16, 8, seed=3), _randn(2, 8, 16, seed=4)
    got = dev7.strassen(a, b)
    assert got.dtype == torch.float32 and got.shape == (2, 16, 16)
    assert 0 < _rel(got, a @ b) < 1e-6
    assert dev7.strassen_fits(a, b)
    assert not dev7.strassen_fits(_randn(3, 4), _randn(4, 4))  # an odd size
    assert not dev7.strassen_fits(_randn(2, 4, 4), _randn(4, 4))  # broadcast leading dimensions
    assert not dev7.strassen_fits(_randn(4), _randn(4, 2))


def test_base2_cross_entropy_matches_the_stock_loss_and_gradient():
    x = torch.zeros(2, 8)  # uniform rows: lse2 = log2(8) = 3 exactly, the loss 3 ln 2
    loss, grad = dev7.base2_ce(x, torch.tensor([1, 5]))
    assert loss.item() == pytest.approx(3 * math.log(2.0), rel=1e-7)
    want = torch.full((2, 8), 1 / 8)
    want[0, 1] -= 1
    want[1, 5] -= 1
    assert torch.allclose(grad, want / 2, atol=1e-8)
    x, t = _randn(64, 96, seed=5, scale=2.0), torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(6))
    t[:3] = -100  # ignored rows
    leaf = x.clone().requires_grad_()
    stock = F.cross_entropy(leaf, t, label_smoothing=0.1)
    stock.backward()
    loss, grad = dev7.base2_ce(x, t, 0.1)
    assert loss.item() == pytest.approx(stock.item(), rel=1e-6)
    assert _rel(grad, leaf.grad) < 1e-6
    assert grad[:3].abs().sum().item() == 0.0


def test_winograd_conv1d_is_exact_on_small_integers_and_keeps_the_stock_shape():
    x, w, b = _ints(2, 3, 7, seed=7), _ints(4, 3, 3, seed=8), _ints(4, seed=9)
    for pad in (0, 1, 2):  # odd and even output lengths: the last tile cropped
        assert torch.equal(dev7.winograd_conv1d(x, w, b, pad), F.conv1d(x, w, b, 1, pad))
    x, w = _randn(2, 16, 32, seed=10), _randn(32, 16, 3, seed=11, scale=0.2)
    got = dev7.winograd_conv1d(x, w, None, 1)
    assert 0 < _rel(got, F.conv1d(x, w, None, 1, 1)) < 1e-6


def test_truncation_rounds_toward_zero():
    one_up = 1.0 + 2.0**-30  # between 1 and the next fp32 number: nearest and toward zero give 1
    s = torch.tensor([one_up, 1.0 + 2.0**-23 - 2.0**-30, -(1.0 + 2.0**-23 - 2.0**-30), 3.0], dtype=torch.float64)
    got = dev7._truncate(s)
    assert got.tolist() == [1.0, 1.0, -1.0, 3.0]  # nearest would give 1 + 2^-23 for the 2nd and 3rd


def test_mma_linear_is_exact_on_small_integers_and_within_the_16bit_rounding():
    x, w, b = _ints(5, 9, seed=12), _ints(6, 9, seed=13), _ints(6, seed=14)
    for dtype in (torch.float16, torch.bfloat16):
        got = dev7.mma_linear(x.to(dtype), w.to(dtype), b.to(dtype), dtype)  # K = 9: a partial last block
        assert got.dtype == dtype and torch.equal(got.float(), F.linear(x, w, b))
    x, w = _randn(32, 64, seed=15), _randn(96, 64, seed=16, scale=0.1)
    got = dev7.mma_linear(x, w, None, torch.float16)
    stock = F.linear(x.half(), w.half())
    assert _rel(got, stock) < 4e-3
    acc = x.half().double() @ w.half().double().T  # exact: the accumulator only truncates below it
    assert (got.double() - acc).abs().max().item() <= (stock.double() - acc).abs().max().item() * 2 + 1e-3


def test_segment_sums_round_once_where_the_stock_kernel_rounds_per_token():
    ids = torch.tensor([2, 0, 2, 2, 1, 2])
    g = torch.tensor([[1.0], [4.0], [2.0**-9], [2.0**-9], [3.0], [2.0**-9]]).to(torch.bfloat16)
    got = dev7.seg_embed_grad(ids, g, 4, torch.bfloat16, padding_idx=1)
    want = torch.tensor([[4.0], [0.0], [1.0 + 3 * 2.0**-9], [0.0]]).to(torch.bfloat16)  # padding row 1 zero
    assert torch.equal(got, want)
    w = torch.zeros(4, 1, dtype=torch.bfloat16, requires_grad=True)
    F.embedding(ids, w).backward(g)  # the stock CPU kernel: 1 + 2^-9 rounds back to 1 three times
    assert w.grad[2].item() == 1.0 and got[2].item() == 1.0078125


def test_layer_norm_gradient_from_the_output_matches_the_stock_one():
    x = _randn(64, 32, seed=27, scale=0.5) + 0.2
    w, b = _randn(32, seed=28, scale=0.1) + 1.0, _randn(32, seed=29, scale=0.1)
    g = _randn(64, 32, seed=30)
    leaf = x.double().requires_grad_()
    F.layer_norm(leaf, (32,), w.double(), b.double(), 1e-5).backward(g.double())
    y = F.layer_norm(x, (32,), w, b, 1e-5)
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    got = dev7.ln_grad_from_output(y, g, (32,), w, b, rstd)
    assert got.dtype == torch.float32 and _rel(got, leaf.grad) < 1e-6
    stock = x.clone().requires_grad_()
    F.layer_norm(stock, (32,), w, b, 1e-5).backward(g)
    assert 0 < _rel(got, stock.grad) < 1e-6  # another rounding than the kernel that saves the input
    y1 = F.layer_norm(x, (32,), torch.ones(32), None, 1e-5)  # weight 1, no bias: x^ is the output itself
    want = rstd * (g - g.mean(-1, keepdim=True) - y1 * (g * y1).mean(-1, keepdim=True))
    assert torch.equal(dev7.ln_grad_from_output(y1, g, (32,), torch.ones(32), None, rstd), want)


# ------------------------------------------------------------------------------------------------------------
# devices
# ------------------------------------------------------------------------------------------------------------
def test_every_device_changes_something_within_its_guard():
    rows = dev7.measure(0)
    by_dev: dict = {}
    for r in rows:
        by_dev.setdefault(r["device"], []).append(r)
        assert r["device_vs_stock"] <= 4e-3 if "float16" in r["dtype"] else r["device_vs_stock"] <= 2.1e-2
        if r["dtype"] == "float32":
            assert r["device_vs_stock"] < 2e-5
    assert set(by_dev) == set(dev7.DEVICES)
    for name, dev_rows in by_dev.items():
        assert any(r["device_vs_stock"] > 0 or r.get("grad_device_vs_stock", 0) > 0 for r in dev_rows), name


def test_a_replacement_outside_the_guard_raises(monkeypatch):
    dev = dev7.DEVICES["AE"]
    a, b = _randn(2, 4, 4, seed=17), _randn(2, 4, 4, seed=18)
    monkeypatch.setattr(dev7, "strassen", lambda a, b: (a @ b) * 1.001)
    with pytest.raises(AssertionError, match="rel_l2"):
        dev.matmul_fn(a, b)


def test_devices_install_and_uninstall_with_autograd_through_them():
    stock = {k: getattr(mod, attr) for k, (mod, attr) in dev7._TARGETS.items()}
    for name, dev in dev7.DEVICES.items():
        dev.install()
        try:
            for key in dev.replacements():
                mod, attr = dev7._TARGETS[key]
                assert getattr(mod, attr) is not stock[key], (name, key)
            x = _randn(4, 8, 8, seed=19).requires_grad_()
            w = _randn(8, 8, seed=20, scale=0.3).requires_grad_()
            emb = _randn(12, 8, seed=21).to(torch.bfloat16).requires_grad_()
            conv = _randn(8, 8, 3, seed=22, scale=0.3).requires_grad_()
            auto = {"AF": torch.float16, "AH": torch.bfloat16, "AI": torch.bfloat16}.get(name)
            with torch.autocast("cpu", dtype=auto or torch.bfloat16, enabled=auto is not None):
                h = torch.matmul(x, x.transpose(-1, -2)) + F.conv1d(x, conv, None, 1, 1)
                h = F.linear(h, w) if name != "AG" else F.linear(h.to(torch.bfloat16), w.to(torch.bfloat16))
                h = h + F.embedding(torch.tensor([[1, 2, 1, 3]]), emb).transpose(0, 1).to(h.dtype)
                h = h / h.norm(p=2, dim=-1, keepdim=True)
                h = F.layer_norm(h, (8,), w[0] + 1.0, None)
                loss = F.cross_entropy(h.float().reshape(-1, 8), torch.arange(32) % 8)
            loss.backward()
            assert x.grad is not None and w.grad is not None and emb.grad is not None and conv.grad is not None
            assert torch.isfinite(x.grad).all() and torch.isfinite(emb.grad.float()).all()
        finally:
            dev.uninstall()
        for key, (mod, attr) in dev7._TARGETS.items():
            assert getattr(mod, attr) is stock[key], (name, key)


def test_the_fp32_norm_policy_changes_the_dtype_under_autocast_only():
    dev = dev7.DEVICES["AI"]
    x = _randn(4, 16, seed=23).to(torch.bfloat16)
    dev.install()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = x.norm(p=2, dim=-1, keepdim=True)
        plain = x.norm(p=2, dim=-1, keepdim=True)
    finally:
        dev.uninstall()
    assert got.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert torch.equal(got, x.float().norm(p=2, dim=-1, keepdim=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert x.norm(p=2, dim=-1, keepdim=True).dtype == torch.bfloat16  # stock CPU autocast


def test_device_strassen_gradients_match_the_stock_ones():
    dev = dev7.DEVICES["AE"]
    a, b = _randn(2, 4, 8, seed=24).requires_grad_(), _randn(2, 8, 6, seed=25).requires_grad_()
    r = _randn(2, 4, 6, seed=26)
    (torch.matmul(a, b) * r).sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    dev.install()
    try:
        (torch.matmul(a, b) * r).sum().backward()
    finally:
        dev.uninstall()
    assert 0 < _rel(a.grad, ga) < 1e-6 and 0 < _rel(b.grad, gb) < 1e-6


# ------------------------------------------------------------------------------------------------------------
# the generator's optimizers and data faults
# ------------------------------------------------------------------------------------------------------------
def test_the_hand_written_optimizers_first_updates():
    PolySGD, Adan, AdaBelief = _make7()._optim_classes()
    g = torch.tensor([0.5, -2.0, 1e-3])

    p = torch.nn.Parameter(torch.zeros(3))
    opt = PolySGD([p], lr=0.1, momentum=0.0, weight_decay=0.0, total=10, power=2.0)
    for factor in (1.0, 0.81, 0.64):  # (1 - (t - 1) / 10)^2
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        assert torch.allclose(p.detach(), before - 0.1 * factor * g, atol=1e-7)
        assert opt.param_groups[0]["lr"] == 0.1  # the peak rate kept

    p = torch.nn.Parameter(torch.ones(3))
    opt = Adan([p], lr=0.01, weight_decay=0.1, eps=1e-8)
    p.grad = g.clone()
    opt.step()  # first update: m^ = g, v = 0, n^ = g^2: the step is lr sign(g)
    assert torch.allclose(p.detach(), (1 - 0.01 * 0.1) - 0.01 * g / (g.abs() + 1e-8), atol=1e-6)

    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = AdaBelief([p], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    p.grad = g.to(torch.bfloat16)
    opt.step()  # first update: m^ = g, s = 0.001 (0.9 g)^2 + eps: about lr sign(g) / 0.9 where g is not tiny
    assert p.dtype == torch.bfloat16
    gb = g.to(torch.bfloat16).float()
    s = 0.001 * (gb - 0.1 * gb) ** 2 + 1e-8
    want = (1 - 0.01 * gb / ((s / 0.001).sqrt() + 1e-8)).to(torch.bfloat16)
    assert torch.equal(p.detach(), want)
    for got, sign in zip(p[:2].tolist(), (1.0, -1.0)):
        assert abs(got - (1 - 0.01 / 0.9 * sign)) <= 2.0**-8  # within a bf16 rounding of lr sign(g) / 0.9


def test_batches_change_only_what_each_data_fault_says():
    make7 = _make7()
    swin = make7.batches("swin", None)
    bad = make7.batches("swin", {"kind": "transposed", "step": 2, "micro": 1})
    for s in range(3):
        for mb in range(2):
            same = torch.equal(swin[s][mb]["pixel_values"], bad[s][mb]["pixel_values"])
            assert same == ((s, mb) != (2, 1))
            assert torch.equal(swin[s][mb]["labels"], bad[s][mb]["labels"])
    assert torch.equal(bad[2][1]["pixel_values"], swin[2][1]["pixel_values"].transpose(2, 3))

    wh = make7.batches("whisper", None)
    feats = make7.batches("whisper", {"kind": "features", "step": 1})
    labels = make7.batches("whisper", {"kind": "labels", "step": 2})
    for s in range(3):
        a, f, lb = wh[s][0], feats[s][0], labels[s][0]
        diff = (a["input_features"] != f["input_features"]).any(dim=(1, 2)).tolist()
        assert diff == ([False, True] if s == 1 else [False, False])
        assert torch.equal(a["input_features"], lb["input_features"])
        assert int((a["labels"] != lb["labels"]).sum()) == (2 if s == 2 else 0)
    assert torch.equal(labels[2][0]["decoder_input_ids"], make7._shift_right(wh[2][0]["labels"]))

    sig = make7.batches("siglip", None)
    stale = make7.batches("siglip", {"kind": "stale_image", "step": 2})
    for s in range(3):
        rows = (sig[s][0]["pixel_values"] != stale[s][0]["pixel_values"]).any(dim=(1, 2, 3)).tolist()
        assert rows == ([True, False, False, False] if s == 2 else [False] * 4)
        assert torch.equal(sig[s][0]["input_ids"], stale[s][0]["input_ids"])
    assert torch.equal(stale[2][0]["pixel_values"][0], sig[1][0]["pixel_values"][0])


def test_the_set_has_what_the_brief_asks():
    make7 = _make7()
    cases = make7.CASES
    clean = [c for c in cases.values() if c[2] is None]
    faults = [c for c in cases.values() if c[2] is not None]
    assert len(clean) >= 8 and len(faults) >= 18
    assert sum("tensor" in c[3] for c in clean) >= 4 and sum("tensor" in c[3] for c in faults) >= 6
    assert all("stats" in c[3] for c in cases.values())
    assert {c[1] for c in clean} == {"base", "flip", "noisyref", "amp"}
    for fam, *_ in faults:  # every family with a fault has its clean pair (the generator's change check)
        assert "%s_clean" % fam in cases

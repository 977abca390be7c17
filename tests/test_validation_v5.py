"""Validation set 5's simulated devices (docs/validation.md, "Validation set 5"): each mechanism on small inputs
(exact values where they exist), every device within its guard and changing something, devices installing and
uninstalling with autograd through them, and the generator's data faults. torch CPU, seconds. The set's pairs and
their score are the marked tests of ``tests/test_validation_v2.py`` (``[v5]``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers import load_script, randn, rel_l2

torch = pytest.importorskip("torch")
F = torch.nn.functional

ROOT = Path(__file__).resolve().parents[1]


dev5 = load_script("validation_v5_devices", ROOT / "validation" / "v5" / "devices.py")


# ------------------------------------------------------------------------------------------------------------
# mechanisms
# ------------------------------------------------------------------------------------------------------------
def test_lse_softmax_is_exact_on_ties_and_within_fp32_rounding_elsewhere():
    assert dev5.lse_softmax(torch.zeros(2, 4), -1).tolist() == [[0.25] * 4] * 2
    x = torch.tensor([[0.0, math.log(3.0), -math.inf]])
    got = dev5.lse_softmax(x, -1)
    assert got[0, 2].item() == 0.0 and abs(got[0, 0].item() - 0.25) < 1e-7 and abs(got[0, 1].item() - 0.75) < 1e-7
    s = randn(4, 17, 17, scale=3.0)
    got, stock = dev5.lse_softmax(s, -1), F.softmax(s, -1)
    exact = F.softmax(s.double(), -1)
    assert 0 < rel_l2(got, stock) < 1e-6 and rel_l2(got, exact) < 1e-6
    assert (got.sum(-1) - 1).abs().max().item() < 1e-5


def test_normcdf_gelu_and_its_gradient_match_the_erf_form():
    x = torch.tensor([0.0, 40.0, -40.0, 1.0])
    y = dev5.normcdf_gelu(x)
    assert y[:3].tolist() == [0.0, 40.0, -0.0]  # erfc(-inf-ish) = 2, erfc(+large) = 0: exact at both ends
    assert abs(y[3].item() - 0.8413447460685429) < 1e-7
    x = randn(4096, scale=3.0)
    assert 0 < rel_l2(dev5.normcdf_gelu(x), F.gelu(x)) < 2e-6
    leaf = x.clone().requires_grad_()
    F.gelu(leaf).sum().backward()
    assert rel_l2(dev5.normcdf_gelu_grad(x), leaf.grad) < 2e-6
    assert dev5.normcdf_gelu_grad(torch.tensor([0.0])).item() == 0.5


def test_fused_cross_entropy_is_lse_minus_the_smoothed_target_and_its_gradient_softmax_minus_q():
    x = torch.zeros(3, 4)  # uniform logits: the loss is log C whatever the smoothing, the gradient (1/C - q) / n
    t = torch.tensor([0, 1, -100])
    loss, grad = dev5.fused_ce(x, t, 0.2)
    assert abs(loss.item() - math.log(4.0)) < 1e-7
    q_hit, q_miss = 0.8 + 0.05, 0.05
    assert grad[2].abs().sum().item() == 0.0  # the ignored row
    assert abs(grad[0, 0].item() - (0.25 - q_hit) / 2) < 3e-8 and abs(grad[0, 1].item() - (0.25 - q_miss) / 2) < 3e-8
    x, t = randn(64, 96, scale=2.0), torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(1))
    leaf = x.clone().requires_grad_()
    stock = F.cross_entropy(leaf, t, label_smoothing=0.1)
    stock.backward()
    loss, grad = dev5.fused_ce(x, t, 0.1)
    assert abs(loss.item() - stock.item()) < 1e-6 * stock.item()
    assert rel_l2(grad, leaf.grad) < 1e-6


def test_fft_conv1d_correlates_and_matches_stock_with_stride_padding_and_groups():
    x = torch.zeros(1, 1, 8)
    x[0, 0, 3] = 1.0  # an impulse: a correlation gives the kernel reversed around it
    w = torch.tensor([[[1.0, 2.0, 3.0]]])
    got = dev5.fft_conv1d(x, w)
    assert (got - torch.tensor([[[0.0, 3.0, 2.0, 1.0, 0.0, 0.0]]])).abs().max().item() < 1e-6
    x, b = randn(2, 8, 39), randn(8, seed=2)
    for args in ((1, 2, 4), (2, 0, 1), (3, 1, 2)):
        stride, pad, groups = args
        ww = randn(8, 8 // groups, 5, seed=1, scale=0.3)
        stock = F.conv1d(x, ww, b, stride, pad, 1, groups)
        got = dev5.fft_conv1d(x, ww, b, stride, pad, groups)
        assert got.shape == stock.shape and 0 < rel_l2(got, stock) < 2e-6, args


def test_scaled_ctc_is_the_ctc_likelihood():
    # T = 2 frames, 2 symbols (blank 0) uniform, target [1]: paths 11, 01, 10 -> probability 3/4
    lp = torch.full((2, 1, 2), math.log(0.5))
    got = dev5.scaled_ctc(lp, torch.tensor([[1]]), [2], [1])
    assert abs(got.item() + math.log(0.75)) < 1e-7
    # a repeated symbol needs a blank between: T = 3, target [1, 1]: only 1 0 1
    lp = torch.full((3, 1, 2), math.log(0.5))
    assert abs(dev5.scaled_ctc(lp, torch.tensor([[1, 1]]), [3], [2], reduction="sum").item() + math.log(0.125)) < 1e-6
    lp = randn(39, 2, 12, scale=2.0).log_softmax(-1)
    tg = torch.randint(1, 12, (2, 6), generator=torch.Generator().manual_seed(3))
    n = torch.full((2,), 39)
    m = torch.full((2,), 6)
    for reduction in ("mean", "sum", "none"):
        stock = F.ctc_loss(lp.double(), tg, n, m, 0, reduction)
        got = dev5.scaled_ctc(lp, tg, n, m, 0, reduction)
        assert rel_l2(got, stock) < 1e-6, reduction
    flat = dev5.scaled_ctc(lp, tg.reshape(-1), n, m, 0, "none")  # concatenated targets
    assert torch.equal(flat, dev5.scaled_ctc(lp, tg, n, m, 0, "none"))


def test_shifted_layer_norm_keeps_its_accuracy_on_a_large_offset():
    x = 1000.0 + randn(16, 32, scale=0.01)  # E[x^2] - E[x]^2 unshifted would lose every digit here
    exact = F.layer_norm(x.double(), (32,))
    got = dev5.shifted_layer_norm(x, (32,), None, None, 1e-5)
    assert rel_l2(got, exact) < 1e-3
    x, w, b = randn(64, 32) + 3.0, randn(32, seed=1), randn(32, seed=2)
    stock = F.layer_norm(x, (32,), w, b)
    assert 0 < rel_l2(dev5.shifted_layer_norm(x, (32,), w, b, 1e-5), stock) < 2e-6


def test_the_fused_optimizer_is_checked_against_the_stock_update():
    for cls, dtype, kw in (
        (torch.optim.Adagrad, torch.bfloat16, {"lr": 1e-2}),
        (torch.optim.AdamW, torch.float32, {"lr": 1e-3, "amsgrad": True, "weight_decay": 0.05}),
    ):
        res = []
        for fused in (False, True):
            ps = [randn(64, 32, seed=i).to(dtype).requires_grad_() for i in range(2)]
            opt = dev5.fused_optimizer(cls, ps, **kw) if fused else cls(ps, **kw)
            for step in range(3):
                for i, p in enumerate(ps):
                    p.grad = randn(64, 32, seed=10 * step + i, scale=0.1).to(dtype)
                opt.step()
            res.append(torch.cat([p.detach().double().flatten() for p in ps]))
        err = rel_l2(res[1], res[0])
        assert err < (1e-9 if dtype == torch.float32 else 1e-3), cls
        # bf16 rounds the fused update otherwise; in fp32 the fused kernel equals the per-parameter loop bit for bit
        # on some CPUs (a Xeon with AVX-512 and AMX), where the device then changes nothing
        assert err > 0 or dtype == torch.float32, cls
    p0 = torch.tensor([1.0, 1.0])
    ref = torch.tensor([1.01, 1.0])
    assert dev5.update_close(ref, ref, p0)
    assert not dev5.update_close(ref + 1e-5, ref, p0)  # 80 fp32 ulps of the parameter off


def test_the_fp32_matmul_policy_changes_the_autocast_output_dtype_only():
    a, b = randn(2, 5, 8), randn(2, 8, 5, seed=1)
    t = dev5.DEVICES["T"]
    t.install()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16))
        outside = torch.matmul(a, b)
    finally:
        t.uninstall()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16))
    assert stock.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert 0 < rel_l2(got, stock.float()) < 1e-2 and torch.equal(outside, a @ b)


# ------------------------------------------------------------------------------------------------------------
# devices: within the guard, changing something, installing and uninstalling with autograd through them
# ------------------------------------------------------------------------------------------------------------
def test_every_device_stays_within_its_guard_and_changes_something():
    rows = dev5.measure(0)
    assert {r["device"] for r in rows} == set(dev5.DEVICES)
    for r in rows:
        # the fused fp32 optimizer step equals the stock one bit for bit on some CPUs (above)
        assert r["device_vs_stock"] > 0 or (r["op"].endswith(".step") and r["dtype"] == "float32"), r
        if r["op"] == "matmul":
            continue  # the autocast policy: an fp32 product against the bf16 one
        bound = 1e-3 if r["dtype"] in ("bfloat16", "float16") or r["op"].endswith(".step") else 1e-6
        assert r["device_vs_stock"] < bound, r
        if "grad_device_vs_stock" in r:
            assert 0 < r["grad_device_vs_stock"] < 2e-5, r


def test_devices_install_and_uninstall_with_autograd_through_them():
    stock = {k: getattr(m, a) for k, (m, a) in dev5._TARGETS.items()}
    x = randn(4, 8, 16).requires_grad_()
    w = (randn(8, 2, 3, seed=1) * 0.3).requires_grad_()
    for name, device in dev5.DEVICES.items():
        device.install()
        try:
            assert dev5.installed() is device
            h = F.conv1d(x, w, None, 1, 1, 1, 4)
            h = F.gelu(F.layer_norm(h, (16,)))
            p = F.softmax(torch.matmul(h, h.transpose(-1, -2)), dim=-1)
            lp = F.log_softmax(h[:2, :3, :4].permute(2, 0, 1), -1)  # 4 frames, 2 utterances, 3 symbols
            ctc = F.ctc_loss(lp, torch.tensor([[1], [2]]), torch.tensor([4, 4]), torch.tensor([1, 1]))
            ce = F.cross_entropy(h.reshape(-1, 16), torch.zeros(32, dtype=torch.long), label_smoothing=0.1)
            (p.sum() + ce + ctc).backward()
        finally:
            device.uninstall()
        assert dev5.installed() is None
        assert {k: getattr(m, a) for k, (m, a) in dev5._TARGETS.items()} == stock, name
        assert x.grad is not None and torch.isfinite(x.grad).all() and w.grad is not None, name
        x.grad, w.grad = None, None


def test_a_replacement_outside_the_guard_raises():
    s = dev5.DEVICES["S"]
    saved = dev5.lse_softmax
    dev5.lse_softmax = lambda x, dim: saved(x, dim) * 1.01
    s.install()
    try:
        with pytest.raises(AssertionError, match="softmax"):
            F.softmax(randn(4, 8), dim=-1)
    finally:
        s.uninstall()
        dev5.lse_softmax = saved


# ------------------------------------------------------------------------------------------------------------
# the generator's data faults
# ------------------------------------------------------------------------------------------------------------
def test_set5_batches_change_only_what_each_data_fault_says():
    make5 = load_script("validation_v5_make_pairs", ROOT / "validation" / "v5" / "make_pairs.py")
    for family, fault, field, want in (
        ("granite", {"kind": "ids", "step": 2}, "input_ids", 1),
        ("wav2vec2", {"kind": "labels", "step": 2}, "labels", 2),
        ("wav2vec2", {"kind": "gain", "step": 1, "micro": 1}, "input_values", 2 * make5.SAMPLES),
    ):
        clean, bad = make5.batches(family, None), make5.batches(family, fault)
        for s in range(3):
            for m, (a, b) in enumerate(zip(clean[s], bad[s])):
                for name in a:
                    hit = (s, m, name) == (fault["step"], fault.get("micro", 0), field)
                    assert int((a[name] != b[name]).sum()) == (want if hit else 0), (family, s, m, name)
    wav = make5.batches("wav2vec2", None)
    assert [len(s) for s in wav] == [2, 2, 2] and wav[0][0]["input_values"].shape == (2, make5.SAMPLES)
    assert 0.02 < wav[0][0]["input_values"].abs().mean().item() < 0.5  # raw audio, not normalised
    lab = wav[0][0]["labels"]
    assert lab.shape == (2, make5.TRANSCRIPT) and lab.min() >= 1 and lab.max() < make5.CTC_VOCAB  # 0 is the blank

"""Validation set 9's simulated devices (docs/validation.md, "Validation set 9"): each mechanism on small inputs
(exact values where they exist), every device's replacements within their guard and changing something, devices
installing and uninstalling with autograd through them, the autocast policy's dtype, the group-freezing optimizer,
the data faults and the cases the set must have. torch CPU, seconds. The set is held out: its pairs are made by
``validation/v9/make_pairs.py`` and scored once by ``validation/score.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import load_script

torch = pytest.importorskip("torch")
F = torch.nn.functional

mp = load_script("validation_v9_make_pairs", Path(__file__).resolve().parents[1] / "validation/v9/make_pairs.py")
dev9 = mp.devices9  # (loaded by the generator under its own name)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _ints(*shape, seed=0):
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


# ------------------------------------------------------------------------------------------------------------
# mechanisms
# ------------------------------------------------------------------------------------------------------------
def test_the_tree_and_the_left_to_right_sums_round_differently():
    parts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert dev9.combine(parts, "tree4").item() == 0.0  # (1e8 + 1) + (-1e8 + 1): each 1 lost to the ulp of 1e8
    assert dev9.combine(parts, "halves2").item() == 1.0  # ((1e8 + 1) - 1e8) + 1
    assert dev9.splits_of("tree4") == 4 and dev9.splits_of("halves2") == 2


def test_splitk_is_the_product_exactly_on_integers_and_close_otherwise():
    a, b = _ints(5, 12, seed=1), _ints(12, 7, seed=2)
    for how in ("tree4", "halves2"):
        assert torch.equal(dev9.splitk_mm(a, b, how), a @ b)
    a, b = _randn(8, 64, seed=3), _randn(64, 16, seed=4)
    assert 0 < _rel(dev9.splitk_mm(a, b, "tree4"), a.double() @ b.double()) < 1e-6


def test_the_online_softmax_is_the_softmax_and_handles_masked_blocks():
    x = _randn(3, 5, 20, seed=5, scale=4.0)
    for dim in (-1, 1):
        assert _rel(dev9.online_softmax(x, dim), torch.softmax(x.double(), dim)) < 1e-6
    masked = torch.tensor([[float("-inf")] * 9 + [0.0, 0.0, float("-inf")]])  # the first block all masked
    got = dev9.online_softmax(masked, -1, block=8)
    assert got.tolist() == [[0.0] * 9 + [0.5, 0.5, 0.0]]


def test_the_layer_norm_by_a_division():
    assert dev9.ln_div(torch.tensor([[1.0, -1.0, 1.0, -1.0]]), (4,), None, None, 0.0).tolist() == [[1, -1, 1, -1]]
    x, w, b = _randn(6, 32, seed=6, scale=3.0) + 1, _randn(32, seed=7), _randn(32, seed=8)
    got = dev9.ln_div(x, (32,), w, b, 1e-5)
    assert 0 < _rel(got, F.layer_norm(x.double(), (32,), w.double(), b.double(), 1e-5)) < 1e-6


def test_the_split_k_convolution_is_the_convolution_exactly_on_integers():
    x, w = _ints(2, 8, 6, 6, seed=9), _ints(4, 4, 3, 3, seed=10)  # 2 groups of 4 input channels
    for splits in (2, 4):
        got = dev9.conv_splitk(x, w, (1, 1), (1, 1), (1, 1), 2, splits)
        assert torch.equal(got, F.conv2d(x, w, None, 1, 1, 1, 2))
    x, w = _randn(2, 8, 6, 6, seed=11), _randn(4, 8, 3, 3, seed=12)
    assert 0 < _rel(dev9.conv_splitk(x, w, 1, 1, 1, 1, 2), F.conv2d(x.double(), w.double(), None, 1, 1)) < 1e-6


def test_chan_merged_statistics_are_the_batch_statistics():
    x = torch.stack([torch.full((1, 2, 2), 1.0), torch.full((1, 2, 2), 3.0)])  # per image constant: 1 and 3
    mean, var = dev9.chan_stats(x)
    assert mean.tolist() == [2.0] and var.tolist() == [1.0]
    x = _randn(3, 4, 5, 5, seed=13, scale=2.0) + 1
    mean, var = dev9.chan_stats(x)
    assert _rel(mean, x.double().mean((0, 2, 3))) < 1e-6
    assert _rel(var, x.double().var((0, 2, 3), unbiased=False)) < 1e-6
    y = dev9.bn_apply(x, mean, var, None, None, 1e-5)
    assert 0 < _rel(y, F.batch_norm(x.double(), None, None, training=True, eps=1e-5)) < 1e-6


def test_sigmoid_through_tanh_gelu_with_an_exact_erf_and_pooling_by_rows():
    assert dev9.sigmoid_tanh(torch.tensor([0.0, 100.0, -100.0])).tolist() == [0.5, 1.0, 0.0]
    x = _randn(4096, seed=14, scale=3.0)
    assert 0 < _rel(dev9.sigmoid_tanh(x), torch.sigmoid(x.double())) < 1e-6
    assert dev9.gelu_f64erf(torch.tensor([0.0, 10.0])).tolist() == [0.0, 10.0]
    got = dev9.gelu_f64erf(x)
    assert 0 < _rel(got, F.gelu(x.double())) < 1e-6 and not torch.equal(got, F.gelu(x))
    ints = _ints(2, 3, 4, 4, seed=15)
    assert torch.equal(dev9.pool_rows(ints), ints.sum((-2, -1), keepdim=True) / 16)


def test_the_16_bit_workspace_rounds_each_partial():
    a = torch.tensor([[1.0, 2.0**-9, 1.0, 2.0**-9]])
    b = torch.ones(4, 1)
    assert dev9.lowk_mm(a, b, 2).item() == 2.0 + 2.0**-8  # fp32 operands: fp32 partials, exact here
    assert dev9.lowk_mm(a.bfloat16(), b.bfloat16(), 2).item() == 2.0  # each 1 + 2^-9 rounded to 1 in bf16
    x, y = _ints(2, 3, 5, 40, seed=16), _ints(2, 3, 40, 6, seed=17)
    assert torch.equal(dev9.lowk_mm(x, y), x @ y)  # reversed blocks, exact on small integers


# ------------------------------------------------------------------------------------------------------------
# devices
# ------------------------------------------------------------------------------------------------------------
def test_every_device_changes_something_within_its_guard():
    for row in dev9.measure():
        assert row["device_vs_stock"] < {"float32": 2e-5}.get(row["dtype"], 4e-3), row
        assert row["elements_differing"] > 0, row
        assert row["device_vs_f64"] < 10 * row["stock_vs_f64"] + 1e-6, row


def test_devices_install_uninstall_and_train_through():
    stock = (F.linear, F.softmax, F.layer_norm, F.conv2d, F.batch_norm, torch.sigmoid, torch.matmul, F.gelu,
             F.adaptive_avg_pool2d)  # fmt: skip
    lin = torch.nn.Linear(16, 8)
    for name in ("BA", "BC", "BD", "BF"):
        dev = dev9.DEVICES[name]
        dev.install()
        try:
            x = _randn(4, 16, seed=18).requires_grad_()
            low = torch.bfloat16 if name == "BC" else torch.float32
            m = torch.nn.Linear(16, 8).to(low)
            m.load_state_dict(lin.state_dict())
            y = F.softmax(torch.matmul(m(x.to(low)), m(x.to(low)).t()).float(), -1)
            F.layer_norm(y, (4,)).sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all() and m.weight.grad is not None
        finally:
            dev.uninstall()
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=2)
    dev = dev9.DEVICES["BB"]
    dev.install()
    try:
        x = _randn(2, 4, 6, 6, seed=19).requires_grad_()
        h = F.batch_norm(conv(x), None, None, training=True)
        (torch.sigmoid(h) * F.adaptive_avg_pool2d(h, 1)).sum().backward()
        assert torch.isfinite(x.grad).all() and conv.weight.grad is not None
    finally:
        dev.uninstall()
    assert (F.linear, F.softmax, F.layer_norm, F.conv2d, F.batch_norm, torch.sigmoid, torch.matmul, F.gelu,
            F.adaptive_avg_pool2d) == stock  # fmt: skip


def test_the_layer_norm_policy_changes_the_dtype_under_autocast_only():
    dev = dev9.DEVICES["BE"]
    x, w = _randn(4, 16, seed=20).half(), torch.ones(16)
    dev.install()
    try:
        assert F.layer_norm(x, (16,), w, None).dtype == torch.float16  # outside autocast: stock dtype
        with torch.autocast("cpu", dtype=torch.float16):
            y = F.layer_norm(x, (16,), w, None)
        assert y.dtype == torch.float32
        assert _rel(y, F.layer_norm(x.double(), (16,), w.double())) < 1e-6
    finally:
        dev.uninstall()


# ------------------------------------------------------------------------------------------------------------
# the generator
# ------------------------------------------------------------------------------------------------------------
def test_a_frozen_group_is_not_updated_and_the_other_is():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = mp.GroupFreeze(torch.optim.Adamax([{"params": [a], "name": "decay"}, {"params": [b], "name": "no_decay"}],
                                            lr=0.1))  # fmt: skip
    for group in opt.param_groups:
        group["frozen"] = "no_decay"
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    opt.step()
    assert b.tolist() == [1.0, 1.0] and a.tolist() == pytest.approx([0.9, 0.9])
    opt.zero_grad()
    assert a.grad is None and b.grad is None


def test_batches_change_only_what_each_data_fault_says():
    for family, kind, step, key in [
        ("regnet", "flip_rows", 1, "pixel_values"),
        ("cohere", "tokens", 1, "input_ids"),
        ("electra", "labels", 2, "labels"),
        ("marian", "src_tokens", 2, "input_ids"),
        ("marian", "labels", 1, "labels"),
    ]:
        clean, bad = mp.batches(family, None), mp.batches(family, {"kind": kind, "step": step})
        for s in range(mp.STEPS):
            for m in range(len(clean[s])):
                for k in clean[s][m]:
                    same = torch.equal(clean[s][m][k], bad[s][m][k])
                    assert same == (s != step or k != key or m != 0), (family, s, m, k)
    clean, bad = mp.batches("regnet", None), mp.batches("regnet", {"kind": "flip_rows", "step": 1})
    px, flipped = clean[1][0]["pixel_values"], bad[1][0]["pixel_values"]
    assert torch.equal(flipped[:, :, 0], px[:, :, -1]) and torch.equal(
        flipped.flatten().sort().values, px.flatten().sort().values
    )
    clean, bad = mp.batches("electra", None), mp.batches("electra", {"kind": "labels", "step": 2})
    assert int((clean[2][0]["labels"] != bad[2][0]["labels"]).sum()) == 2


def test_the_set_has_what_the_brief_asks():
    cases = mp.CASES
    clean = [k for k, (_, _, fault, _) in cases.items() if fault is None]
    faults = [k for k, (_, _, fault, _) in cases.items() if fault is not None]
    tensor = sum("tensor" in modes for _, _, _, modes in cases.values())
    assert len(cases) >= 40 and tensor >= 9 and len(clean) >= 13 and len(faults) >= 26
    assert {cases[k][1] for k in clean} == {"base", "flip", "noisyref", "amp"}
    kinds = {cases[k][2]["kind"] for k in faults}
    assert {"lr", "weight_decay", "betas", "dampening", "eps", "clip", "frozen", "weight", "mask"} <= kinds
    assert len({f["device"] for f in mp.FAMILIES.values()}) == 4
    assert set(mp.DEVICES) == set(dev9.DEVICES) and mp.NOISY_REF in mp.DEVICES and mp.AMP_DEVICE in mp.DEVICES

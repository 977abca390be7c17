"""Simulated device kernels of validation set 5: eight more ways an accelerator computes the same function.

Independent of the development set and of sets 1 to 4 (``validation/devices.py``, ``validation/v2/devices.py``,
``validation/v3/devices.py``, ``validation/v4/devices.py``): none of these mechanisms is used there. Each changes
values at the rounding level:

* ``lse``: softmax as exp(x - logsumexp(x)) (one exponential per element and no division, the log-sum-exp from the
  row's maximum and one log), in fp32: how a flash-attention kernel's backward recomputes the probabilities from the
  saved log-sum-exp;
* ``normcdf``: exact GELU as x * normcdf(x) with normcdf(x) = erfc(-x / sqrt 2) / 2 (CUDA's ``normcdff``), the
  gradient normcdf(x) + x * exp(-x^2 / 2) / sqrt(2 pi) the same way (stock: erf);
* ``fused_ce``: cross-entropy with label smoothing in one fused kernel: per row lse - (1 - e) x_y - (e / C) sum x
  (no log-softmax tensor), the input gradient (softmax - q) / n with q the smoothed target, fp32;
* ``fft``: conv1d's forward by FFT (cuDNN's FFT algorithm: per input-output channel pair the correlation as
  irfft(rfft(x) conj(rfft(w))), channels summed in the frequency domain, then strided), fp32; the backward stock
  (the autotuner picks the backward algorithms separately);
* ``scaled_ctc``: the CTC loss by the probability-domain forward recursion with per-frame rescaling (Rabiner's
  scaled alpha, as cuDNN's CTC does) instead of the log-space recursion; log-likelihood = sum of the log scale
  factors; fp32, forward values (the backward stock);
* ``shifted_ln``: LayerNorm's statistics in one pass over shifted data (K = the row's first element: mean and
  variance from sums of x - K and (x - K)^2), fp32;
* ``fused_opt``: the optimizer's update by torch's fused CPU kernel (``fused=True``: one vectorised kernel per
  parameter with its own operation order) instead of the per-parameter loop, each update checked against the stock
  update;
* ``fp32_matmul``: an autocast policy whose lower-precision list has linear and convolution but not ``matmul``:
  under bf16 autocast the attention products run in fp32 (the output fp32 where the reference's is bf16: a real
  cross-device difference of dtypes, in the records of those ops).

Installed as in sets 2 to 4 (``validation/common_devices.py``: the guard, the gradient plumbing and installing).
``python validation/v5/devices.py`` prints the measured magnitudes (docs/validation.md, "Validation set 5").
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent


common = sys.modules.get("validation_common_devices")
if common is None:  # the guard, the gradient plumbing, installing, the tables: loaded once, by path
    _spec = importlib.util.spec_from_file_location("validation_common_devices", _HERE.parent / "common_devices.py")
    common = sys.modules["validation_common_devices"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(common)
rel_l2 = common.rel_l2

# the stock functions, captured before anyone (this module or msprobe) replaces them
_TARGETS = {
    "softmax": (F, "softmax"),
    "gelu": (F, "gelu"),
    "cross_entropy": (F, "cross_entropy"),
    "conv1d": (F, "conv1d"),
    "ctc_loss": (F, "ctc_loss"),
    "layer_norm": (F, "layer_norm"),
    "matmul": (torch, "matmul"),
}
_STOCK = {key: getattr(mod, attr) for key, (mod, attr) in _TARGETS.items()}
GUARD, _guard, _replace = common.GUARD, common.guard, common.replace
SQRT1_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# ---------------------------------------------------------------------------------------------------------------
# mechanisms (values only; fp32 arithmetic)
# ---------------------------------------------------------------------------------------------------------------
def lse_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax along ``dim`` as exp(x - lse), lse = max + log(sum(exp(x - max))) (fp32)."""
    x = x.float()
    m = x.amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = m + torch.log(torch.exp(x - m).sum(dim, keepdim=True))
    return torch.exp(x - lse)


def normcdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(-x * SQRT1_2)


def normcdf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU as x * erfc(-x / sqrt 2) / 2 (fp32)."""
    x = x.float()
    return x * normcdf(x)


def normcdf_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx x normcdf(x) = normcdf(x) + x exp(-x^2 / 2) / sqrt(2 pi) (fp32)."""
    x = x.float()
    return normcdf(x) + x * torch.exp(-0.5 * x * x) * INV_SQRT_2PI


def fused_ce(x: torch.Tensor, target: torch.Tensor, smoothing: float, ignore_index: int = -100):
    """Mean label-smoothed cross-entropy of rows ``x`` (N, C) and its input gradient, fused (fp32): per row
    lse - (1 - e) x_y - (e / C) sum_j x_j; the gradient (softmax - q) / n, q = (1 - e) onehot + e / C, rows of
    ``ignore_index`` zero. Returns (loss, grad)."""
    x = x.float()
    n_cls = x.shape[-1]
    keep = target != ignore_index
    tgt = torch.where(keep, target, torch.zeros_like(target))
    m = x.amax(-1, keepdim=True)
    lse = (m + torch.log(torch.exp(x - m).sum(-1, keepdim=True))).squeeze(-1)
    x_y = x.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    row = lse - (1.0 - smoothing) * x_y - (smoothing / n_cls) * x.sum(-1)
    n = keep.sum().clamp_min(1).float()
    loss = torch.where(keep, row, torch.zeros_like(row)).sum() / n
    q = torch.full_like(x, smoothing / n_cls)
    q.scatter_add_(-1, tgt.unsqueeze(-1), torch.full_like(x_y, 1.0 - smoothing).unsqueeze(-1))
    grad = (torch.exp(x - lse.unsqueeze(-1)) - q) * (keep.float() / n).unsqueeze(-1)
    return loss, grad


def _single(v) -> int:
    return int(v[0]) if isinstance(v, (tuple, list)) else int(v)


def fft_conv1d(x, w, b=None, stride=1, padding=0, groups=1) -> torch.Tensor:
    """conv1d (fp32, dilation 1) by FFT: per (input, output) channel pair the cross-correlation as
    irfft(rfft(x) * conj(rfft(w))) over n >= the padded length, the channels of a group summed in the frequency
    domain, the valid positions taken every ``stride``."""
    x, w = x.float(), w.float()
    stride, padding = _single(stride), _single(padding)
    if padding:
        x = F.pad(x, (padding, padding))
    n_b, c_in, length = x.shape
    c_out, c_g, k = w.shape
    n = 1 << max(1, (length - 1).bit_length())  # a power of two >= length: no wrap-around of the valid lags
    xf = torch.fft.rfft(x, n=n).view(n_b, groups, c_g, -1)
    wf = torch.fft.rfft(w, n=n).view(groups, c_out // groups, c_g, -1)
    yf = torch.einsum("bgcf,gocf->bgof", xf, wf.conj())
    y = torch.fft.irfft(yf, n=n)[..., : length - k + 1 : stride].reshape(n_b, c_out, -1)
    if b is not None:
        y = y + b.float().view(1, -1, 1)
    return y


def scaled_ctc(log_probs, targets, input_lengths, target_lengths, blank: int = 0, reduction: str = "mean"):
    """CTC loss (fp32) by the scaled forward recursion in the probability domain: alpha over the blank-extended
    target, renormalised to sum 1 at every frame; -log-likelihood = -(sum of the log scale factors + log of the
    last two states). ``log_probs`` (T, N, C); ``targets`` (N, S) padded or 1-D concatenated."""
    lp = log_probs.float()
    n_b = lp.shape[1]
    in_len = [int(v) for v in torch.as_tensor(input_lengths).reshape(-1).tolist()]
    tg_len = [int(v) for v in torch.as_tensor(target_lengths).reshape(-1).tolist()]
    losses = []
    offset = 0
    for b in range(n_b):
        if targets.dim() == 2:
            lab = targets[b, : tg_len[b]]
        else:
            lab = targets[offset : offset + tg_len[b]]
            offset += tg_len[b]
        ext = torch.full((2 * len(lab) + 1,), blank, dtype=torch.long)
        ext[1::2] = lab.long()
        s_len = ext.numel()
        skip = torch.zeros(s_len, dtype=torch.bool)
        if s_len > 2:
            skip[2:] = (ext[2:] != blank) & (ext[2:] != ext[:-2])
        probs = torch.exp(lp[: in_len[b], b, :]).index_select(-1, ext)  # (T, S)
        alpha = torch.zeros(s_len)
        alpha[0] = probs[0, 0]
        if s_len > 1:
            alpha[1] = probs[0, 1]
        c = alpha.sum()
        alpha = alpha / c
        loglik = torch.log(c)
        for t in range(1, in_len[b]):
            prev1 = F.pad(alpha[:-1], (1, 0))
            prev2 = torch.where(skip, F.pad(alpha[:-2], (2, 0)), torch.zeros_like(alpha))
            alpha = (alpha + prev1 + prev2) * probs[t]
            c = alpha.sum()
            alpha = alpha / c
            loglik = loglik + torch.log(c)
        end = alpha[-1] + (alpha[-2] if s_len > 1 else 0.0)
        losses.append(-(loglik + torch.log(end)))
    loss = torch.stack(losses)
    if reduction == "mean":
        return (loss / torch.tensor(tg_len, dtype=torch.float32).clamp_min(1)).mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def shifted_layer_norm(x, normalized_shape, weight, bias, eps):
    """LayerNorm (fp32) with the row's mean and variance from one pass over x - K, K the row's first element."""
    nd = len(normalized_shape)
    x = x.float().flatten(-nd)
    n = x.shape[-1]
    d = x - x[..., :1]
    s1 = d.sum(-1, keepdim=True) / n
    var = ((d * d).sum(-1, keepdim=True) / n - s1 * s1).clamp_min(0.0)
    return common.normalized(d - s1, var, eps, normalized_shape, weight, bias)


# ---------------------------------------------------------------------------------------------------------------
# the fused optimizer (a device's update kernel, checked against the stock update on every step)
# ---------------------------------------------------------------------------------------------------------------
# how far a fused update may move a parameter from the stock update's: a few roundings of the parameter's dtype
# (at the parameter's and at the update's magnitude: the stock loop rounds its intermediates) plus 1e-5 of the update
OPT_ULPS = 2


def update_close(dev: torch.Tensor, ref: torch.Tensor, before: torch.Tensor) -> bool:
    """The fused update's new parameter ``dev`` is within OPT_ULPS roundings of the parameter's dtype (at the
    parameter's and the update's magnitude, and 1e-5 of the update) of the stock update's ``ref``."""
    eps = torch.finfo(ref.dtype).eps
    a, b, p0 = dev.double(), ref.double(), before.double()
    bound = OPT_ULPS * eps * (b.abs() + (b - p0).abs()) + 1e-5 * (b - p0).abs() + torch.finfo(ref.dtype).tiny
    return bool(((a - b).abs() <= bound).all())


def fused_optimizer(cls, params, **kwargs):
    """An optimizer of class ``cls`` with ``fused=True`` whose every step is checked: the stock (per-parameter
    loop) step from the same state and gradients gives parameters within ``update_close`` of the fused ones."""

    class Fused(cls):  # type: ignore[misc, valid-type]
        def step(self, closure=None):
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            before = [p.detach().clone() for p in params]
            grads = [p.grad.detach().clone() for p in params]
            state = copy.deepcopy(self.state_dict())
            out = super().step(closure)
            with torch.no_grad():
                shadow = [b.clone().requires_grad_(True) for b in before]
                for p, g in zip(shadow, grads):
                    p.grad = g
                groups = []
                it = iter(shadow)
                for group in self.param_groups:
                    ps = [next(it) for p in group["params"] if p.grad is not None]
                    groups.append({k: v for k, v in group.items() if k != "params"} | {"params": ps})
            stock = cls(groups)
            if all(len(g["params"]) == len(sg["params"]) for g, sg in zip(self.param_groups, groups)):
                stock.load_state_dict(state)
            for group in stock.param_groups:
                group["fused"], group["foreach"] = False, False
            stock.step()
            with torch.no_grad():
                for p, b, s in zip(params, before, shadow):
                    if not update_close(p.detach(), s.detach(), b):
                        err = ((p.detach().double() - s.detach().double()).abs() / s.detach().double().abs()).max()
                        raise AssertionError(
                            "device fused %s: the update %.3g from the stock one" % (cls.__name__, err)
                        )
            return out

    Fused.__name__ = cls.__name__
    return Fused(params, fused=True, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
_INSTALLED: list = []


def installed():
    """The device installed now (None: stock)."""
    return _INSTALLED[-1] if _INSTALLED else None


class Device(common.Installed):
    """One simulated device: a set of the mechanisms above."""

    TARGETS = _TARGETS
    STACK = _INSTALLED

    def __init__(self, name, text, lse=False, normcdf=False, fused_ce=False, fft=False, scaled_ctc=False,
                 shifted_ln=False, fused_opt=False, fp32_matmul=False):  # fmt: skip
        self.name, self.text = name, text
        self.lse, self.normcdf, self.fused_ce, self.fft = lse, normcdf, fused_ce, fft
        self.scaled_ctc, self.shifted_ln, self.fused_opt, self.fp32_matmul = (
            scaled_ctc,
            shifted_ln,
            fused_opt,
            fp32_matmul,
        )
        self._saved: dict = {}

    # -- softmax, GELU, cross-entropy ------------------------------------------------------------------------------
    def softmax_fn(self, input, dim=None, _stacklevel=3, dtype=None):
        out = _STOCK["softmax"](input, dim, _stacklevel, dtype)
        if dim is None or not out.is_floating_point():
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            _replace("softmax", out, lse_softmax(input.detach(), dim).to(out.dtype))
        return out

    def gelu_fn(self, input, approximate="none"):
        return common.gelu_with(_STOCK["gelu"], input, approximate, normcdf_gelu, normcdf_gelu_grad)

    def cross_entropy_fn(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                         reduction="mean", label_smoothing=0.0):  # fmt: skip
        return common.cross_entropy_with(_STOCK["cross_entropy"], fused_ce, input, target, weight, size_average,
                                         ignore_index, reduce, reduction, label_smoothing)  # fmt: skip

    # -- convolution, CTC ------------------------------------------------------------------------------------------
    def conv1d_fn(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        out = _STOCK["conv1d"](input, weight, bias, stride, padding, dilation, groups)
        if isinstance(padding, str) or _single(dilation) != 1 or input.dim() != 3:
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            b = bias.detach() if bias is not None else None
            y = fft_conv1d(input.detach(), weight.detach(), b, stride, padding, groups)
            _replace("conv1d", out, y.to(out.dtype))
        return out

    def ctc_loss_fn(self, log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                    zero_infinity=False):  # fmt: skip
        out = _STOCK["ctc_loss"](log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        if not torch.isfinite(out).all():
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            y = scaled_ctc(log_probs.detach(), targets, input_lengths, target_lengths, blank, reduction)
            _replace("ctc_loss", out, y.to(out.dtype).reshape(out.shape))
        return out

    # -- normalisation -----------------------------------------------------------------------------------------
    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out = _STOCK["layer_norm"](input, normalized_shape, weight, bias, eps)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            y = shifted_layer_norm(input.detach(), tuple(normalized_shape), w, b, eps)
            _replace("layer_norm", out, y.to(out.dtype))
        return out

    # -- the autocast policy -----------------------------------------------------------------------------------
    def matmul_fn(self, input, other, *, out=None):
        if out is not None or not common.autocast_dtype() or not input.is_floating_point():
            return _STOCK["matmul"](input, other, out=out) if out is not None else _STOCK["matmul"](input, other)
        with torch.no_grad():
            stock = _STOCK["matmul"](input.detach(), other.detach())
        with torch.autocast("cpu", enabled=False):
            res = _STOCK["matmul"](input.float(), other.float())
        if rel_l2(res, stock.float()) > GUARD[stock.dtype]:
            raise AssertionError("device matmul: fp32 product %.3g from the autocast one" % rel_l2(res, stock.float()))
        return res

    # -- installing --------------------------------------------------------------------------------------------
    def replacements(self) -> dict:
        out: dict = {}
        if self.lse:
            out["softmax"] = self.softmax_fn
        if self.normcdf:
            out["gelu"] = self.gelu_fn
        if self.fused_ce:
            out["cross_entropy"] = self.cross_entropy_fn
        if self.fft:
            out["conv1d"] = self.conv1d_fn
        if self.scaled_ctc:
            out["ctc_loss"] = self.ctc_loss_fn
        if self.shifted_ln:
            out["layer_norm"] = self.layer_norm_fn
        if self.fp32_matmul:
            out["matmul"] = self.matmul_fn
        return out

    def optimizer(self, cls, params, **kwargs):
        """The device's optimizer of class ``cls``: the fused kernel where the device has one, else stock."""
        return fused_optimizer(cls, params, **kwargs) if self.fused_opt else cls(params, **kwargs)


DEVICES = {
    "S": Device(
        "S",
        "bf16-autocast vision unit: softmax as exp(x - logsumexp) (fp32), exact GELU through erfc (normcdf), "
        "label-smoothed cross-entropy fused (lse - sum q x, gradient softmax - q), LayerNorm statistics in one pass "
        "over shifted data",
        lse=True,
        normcdf=True,
        fused_ce=True,
        shifted_ln=True,
    ),
    "T": Device(
        "T",
        "device S under another autocast policy: matmul not on the lower-precision list (attention products in "
        "fp32, output fp32 where the reference's is bf16)",
        lse=True,
        normcdf=True,
        fused_ce=True,
        shifted_ln=True,
        fp32_matmul=True,
    ),
    "U": Device(
        "U",
        "fp32 speech unit: conv1d forward by FFT (the backward stock), CTC by the scaled probability-domain "
        "recursion, exact GELU through erfc (normcdf)",
        fft=True,
        scaled_ctc=True,
        normcdf=True,
    ),
    "V": Device(
        "V",
        "fp16-autocast unit: LayerNorm statistics in one pass over shifted data, label-smoothed cross-entropy "
        "fused (lse - sum q x, gradient softmax - q), exact GELU through erfc (normcdf)",
        shifted_ln=True,
        fused_ce=True,
        normcdf=True,
    ),
    "W": Device(
        "W",
        "pure-bf16 unit: softmax as exp(x - logsumexp) (fp32), the optimizer's update by the fused kernel "
        "(Adagrad, fused=True)",
        lse=True,
        fused_opt=True,
    ),
    "X": Device(
        "X",
        "the reference GPU rerun with the fused AdamW kernel (fused=True: the update in one vectorised kernel); "
        "everything else stock",
        fused_opt=True,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "softmax": (torch.randn(4, 17, 17, generator=g) * 2,),
        "gelu": (torch.randn(4096, generator=g) * 2,),
        "cross_entropy": (torch.randn(64, 96, generator=g) * 2, torch.randint(0, 96, (64,), generator=g)),
        "conv1d": (torch.randn(2, 16, 79, generator=g), torch.randn(16, 16, 3, generator=g) * 0.3),
        "ctc_loss": (torch.randn(39, 2, 12, generator=g).log_softmax(-1), torch.randint(1, 12, (2, 6), generator=g)),
        "layer_norm": (torch.randn(64, 32, generator=g) + 3.0,),
        "matmul": (torch.randn(4, 17, 8, generator=g), torch.randn(4, 8, 17, generator=g)),
    }


def _caller(key: str):
    """``_call`` of op ``key`` as ``call(fn, args)``."""
    return lambda fn, args: _call(fn, key, args)


def _call(fn, key: str, args: tuple):
    if key == "softmax":
        return fn(args[0], -1)
    if key == "cross_entropy":
        return fn(args[0], args[1], label_smoothing=0.1)
    if key == "conv1d":
        return fn(args[0], args[1], None, 2, 0)
    if key == "ctc_loss":
        n, t = args[0].shape[1], args[0].shape[0]
        return fn(args[0], args[1], torch.full((n,), t), torch.full((n,), args[1].shape[1]), 0, "mean")
    if key == "layer_norm":
        return fn(args[0], (args[0].shape[-1],))
    return fn(*args)


# how each device runs in its family (make_pairs.py): the dtype each op sees ("autocast": bf16 autocast on fp32
# inputs; fp32 where not named)
SETTINGS = {
    "S": {"softmax": None, "gelu": torch.bfloat16, "cross_entropy": None, "layer_norm": None},
    "T": {"matmul": "autocast"},
    "U": {"conv1d": None, "ctc_loss": None, "gelu": None},
    "V": {"layer_norm": None, "cross_entropy": None, "gelu": torch.float16},
    "W": {"softmax": None},
    "X": {},
}
GRADS = ("gelu", "cross_entropy")


def measure(seed: int = 0, devices=None) -> list[dict]:
    """Per device (in its family's dtype) and op: relative L2 error against float64 of the stock kernel and of the
    device's, the relative L2 difference between the two and the share of elements that differ; for GELU and the
    cross-entropy also the input gradients' difference (backward of sum(y * r), r fixed)."""
    rows = []
    base = _inputs(seed)
    for dev in devices or DEVICES.values():
        for key, fn in dev.replacements().items():
            if key not in SETTINGS[dev.name]:
                continue  # a replacement the family never calls
            setting = SETTINGS[dev.name][key]
            auto = setting == "autocast"
            dtype = setting if isinstance(setting, torch.dtype) else torch.float32
            args = tuple(t.to(dtype) if t.is_floating_point() else t for t in base[key])
            call = _caller(key)
            rows.append(common.measure_op(dev.name, key, fn, _STOCK[key], call, args, auto, seed, key in GRADS))
    rows += measure_optimizers(seed)
    return rows


def measure_optimizers(seed: int = 0) -> list[dict]:
    """The fused optimizers of devices W and X as their families run them: three steps of random gradients on
    random parameters; the parameters' relative L2 difference from the stock loop's after three steps."""
    rows = []
    for dev, cls, dtype, kw in (
        ("W", torch.optim.Adagrad, torch.bfloat16, {"lr": 1e-2}),
        ("X", torch.optim.AdamW, torch.float32, {"lr": 1e-3, "amsgrad": True, "weight_decay": 0.05}),
    ):
        res = []
        for fused in (False, True):
            g = torch.Generator().manual_seed(seed)
            ps = [torch.randn(64, 32, generator=g).to(dtype).requires_grad_() for _ in range(3)]
            opt = fused_optimizer(cls, ps, **kw) if fused else cls(ps, **kw)
            for _ in range(3):
                for p in ps:
                    p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)
                opt.step()
            res.append(torch.cat([p.detach().double().flatten() for p in ps]))
        rows.append(
            {
                "device": dev,
                "op": "%s.step" % cls.__name__,
                "dtype": str(dtype).replace("torch.", ""),
                "device_vs_stock": rel_l2(res[1], res[0]),
                "elements_differing": (res[1] != res[0]).float().mean().item(),
            }
        )
    return rows


COLS = common.COLS[:-1]


if __name__ == "__main__":
    common.print_table(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 0), COLS)

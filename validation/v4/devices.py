"""Simulated device kernels of validation set 4: seven more ways an accelerator computes the same function.

Independent of the development set and of sets 1 to 3 (``validation/devices.py``, ``validation/v2/devices.py``,
``validation/v3/devices.py``): none of these mechanisms is used there. Each changes values at the rounding level:

* ``taps``: a convolution as an implicit GEMM, channels-last: for each filter tap one GEMM over the input channels,
  the taps' partial results added in fp32 one after the other (``reverse``: the last tap first, as another
  algorithm an autotuner may pick); input and weight gradients the same way (per-tap GEMMs, the input gradient
  folded back tap after tap);
* ``bn1pass``: BatchNorm's batch statistics in one pass, var = E[x^2] - E[x]^2 (fp32), the running statistics
  updated from them;
* ``blocked``: a mean over one dimension (``Tensor.mean``/``torch.mean`` with ``dim``) and LayerNorm's row
  statistics as sums of blocks of 8 (each block added left to right), the block sums added as a pairwise tree;
* ``pow2``: ``pow`` by a constant exponent as exp2(y * log2|x|) in fp32 (a special-function unit's powf; the sign
  restored for odd integer exponents);
* ``sincos``: sin and cos by Cody-Waite reduction by pi/2 (pi/2 in a head and a tail) and degree-9/8 polynomials on
  [-pi/4, pi/4] in fp32 (a fast-math ``__sinf``/``__cosf``): GPT-J's rotary table, built when the model is;
* ``softplus``: softplus in its stable form max(x, 0) + log1p(exp(-|x|)) (stock: log1p(exp(x)) below the
  threshold);
* ``rcp``: SiLU as x * r(1 + exp(-x)) where r is a hardware reciprocal: a 12-bit estimate refined by one
  Newton-Raphson step.

Installed as in sets 2 and 3 (``validation/common_devices.py``: the guard, the gradient plumbing and installing).
``python validation/v4/devices.py`` prints the measured magnitudes (docs/validation.md, "Validation set 4").
"""

from __future__ import annotations

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
    "conv1d": (F, "conv1d"),
    "conv2d": (F, "conv2d"),
    "batch_norm": (F, "batch_norm"),
    "mean": (torch, "mean"),
    "Tensor.mean": (torch.Tensor, "mean"),
    "layer_norm": (F, "layer_norm"),
    "pow": (torch, "pow"),
    "Tensor.pow": (torch.Tensor, "pow"),
    "sin": (torch, "sin"),
    "cos": (torch, "cos"),
    "softplus": (F, "softplus"),
    "silu": (F, "silu"),
}
_STOCK = {key: getattr(mod, attr) for key, (mod, attr) in _TARGETS.items()}
GUARD, _guard, _replace = common.GUARD, common.guard, common.replace


# ---------------------------------------------------------------------------------------------------------------
# mechanisms (values only; fp32 arithmetic)
# ---------------------------------------------------------------------------------------------------------------
def _pair(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _cols(x4: torch.Tensor, w: torch.Tensor, stride, padding, dilation, groups):
    """im2col of a 4-d input: (N, G, C/G, taps, L) and the weight as (G, O/G, C/G, taps)."""
    kh, kw = w.shape[-2], w.shape[-1]
    cols = F.unfold(x4, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # (N, C*taps, L)
    n, _, length = cols.shape
    c_g = w.shape[1]
    cols5 = cols.view(n, groups, c_g, kh * kw, length)
    w4 = w.reshape(groups, w.shape[0] // groups, c_g, kh * kw)
    return cols5, w4


def _order(taps: int, order: str) -> list[int]:
    return list(range(taps - 1, -1, -1)) if order == "reverse" else list(range(taps))


def taps_conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, order="forward"):
    """conv2d (fp32) as one GEMM over the input channels per filter tap, the taps' results added in ``order``."""
    x, w = x.float(), w.float()
    stride, padding, dilation = _pair(stride, 2), _pair(padding, 2), _pair(dilation, 2)
    cols5, w4 = _cols(x, w, stride, padding, dilation, groups)
    acc = None
    for p in _order(w4.shape[-1], order):
        part = torch.einsum("goc,ngcl->ngol", w4[..., p], cols5[:, :, :, p, :])
        acc = part if acc is None else acc + part
    n = x.shape[0]
    h_out = (x.shape[2] + 2 * padding[0] - dilation[0] * (w.shape[2] - 1) - 1) // stride[0] + 1
    w_out = (x.shape[3] + 2 * padding[1] - dilation[1] * (w.shape[3] - 1) - 1) // stride[1] + 1
    y = acc.reshape(n, w.shape[0], h_out, w_out)
    if b is not None:
        y = y + b.float().view(1, -1, 1, 1)
    return y


def taps_conv2d_grads(g, x, w, stride=1, padding=0, dilation=1, groups=1, order="forward"):
    """The input and weight gradients of ``taps_conv2d`` for an output gradient ``g``, per tap the same way: the
    weight's tap p from one GEMM over the output positions, the input's columns per tap folded back (fp32)."""
    g, x, w = g.float(), x.float(), w.float()
    stride, padding, dilation = _pair(stride, 2), _pair(padding, 2), _pair(dilation, 2)
    cols5, w4 = _cols(x, w, stride, padding, dilation, groups)
    n, _, c_g, taps, length = cols5.shape
    g5 = g.reshape(n, groups, w4.shape[1], length)
    gw = torch.zeros_like(w4)
    dcols = torch.zeros_like(cols5)
    for p in _order(taps, order):
        gw[..., p] = torch.einsum("ngol,ngcl->goc", g5, cols5[:, :, :, p, :])
        dcols[:, :, :, p, :] = torch.einsum("goc,ngol->ngcl", w4[..., p], g5)
    gx = F.fold(
        dcols.reshape(n, groups * c_g * taps, length),
        x.shape[-2:],
        (w.shape[2], w.shape[3]),
        dilation=dilation,
        padding=padding,
        stride=stride,
    )
    return gx, gw.reshape(w.shape)


def one_pass_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (dim 1): mean and biased variance E[x^2] - E[x]^2 from one pass of sums (fp32)."""
    x = x.float()
    dims = [d for d in range(x.dim()) if d != 1]
    n = x.numel() // x.shape[1]
    mean = x.sum(dims) / n
    var = (x * x).sum(dims) / n - mean * mean
    return mean, var.clamp_min(0.0)


def blocked_sum(x: torch.Tensor, block: int = 8) -> torch.Tensor:
    """Sum over the last dimension (fp32): blocks of ``block`` elements each added left to right, the block sums
    added as a pairwise tree."""
    x = x.float()
    pad = (-x.shape[-1]) % block
    if pad:
        x = F.pad(x, (0, pad))
    xb = x.unflatten(-1, (-1, block))
    s = xb[..., 0]
    for i in range(1, block):
        s = s + xb[..., i]
    while s.shape[-1] > 1:
        if s.shape[-1] % 2:
            s = F.pad(s, (0, 1))
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0]


def blocked_mean(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    dim = dim % x.dim()
    m = blocked_sum(x.movedim(dim, -1)) / x.shape[dim]
    return m.unsqueeze(dim) if keepdim else m


def blocked_layer_norm(x, normalized_shape, weight, bias, eps):
    """LayerNorm (fp32) with mean and variance (two passes) from blocked sums."""
    nd = len(normalized_shape)
    x = x.float().flatten(-nd)
    n = x.shape[-1]
    mean = (blocked_sum(x) / n).unsqueeze(-1)
    d = x - mean
    var = (blocked_sum(d * d) / n).unsqueeze(-1)
    return common.normalized(d, var, eps, normalized_shape, weight, bias)


def pow_exp2(x: torch.Tensor, e: float) -> torch.Tensor:
    """x ** e for a constant e as exp2(e * log2|x|) in fp32; for an integer e, the sign of x^e restored."""
    x = x.float()
    y = torch.exp2(e * torch.log2(x.abs()))
    if float(e).is_integer():
        if int(e) % 2:
            y = torch.copysign(y, x)
        if e == 0:
            y = torch.ones_like(x)
    else:
        y = torch.where(x < 0, torch.full_like(y, math.nan), y)
    return y


PIO2_HI = 1.5707855224609375  # pi/2 in 17 significant bits: k * PIO2_HI exact in fp32 for |k| < 2^7
PIO2_LO = 1.0804334124e-05
SIN_COEF = [1.0, -1.0 / 6, 1.0 / 120, -1.0 / 5040, 1.0 / 362880]  # r + r^3 ... to r^9
COS_COEF = [1.0, -1.0 / 2, 1.0 / 24, -1.0 / 720, 1.0 / 40320]  # to r^8


def _sin_cos_reduced(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.float()
    k = torch.round(x * (2.0 / math.pi))
    r = (x - k * PIO2_HI) - k * PIO2_LO
    r2 = r * r
    s = torch.full_like(r, SIN_COEF[-1])
    for c in reversed(SIN_COEF[:-1]):
        s = s * r2 + c
    c_ = torch.full_like(r, COS_COEF[-1])
    for c in reversed(COS_COEF[:-1]):
        c_ = c_ * r2 + c
    return s * r, c_, torch.remainder(k, 4)


def fast_sin(x: torch.Tensor) -> torch.Tensor:
    """sin in fp32 by reduction modulo pi/2 and polynomials on [-pi/4, pi/4] (valid for |x| < 200)."""
    s, c, q = _sin_cos_reduced(x)
    return torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))


def fast_cos(x: torch.Tensor) -> torch.Tensor:
    s, c, q = _sin_cos_reduced(x)
    return torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))


def stable_softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus(x) = max(x, 0) + log1p(exp(-|x|)) (fp32)."""
    x = x.float()
    return x.clamp_min(0.0) + torch.log1p(torch.exp(-x.abs()))


def rcp(d: torch.Tensor) -> torch.Tensor:
    """1/d as a hardware reciprocal: the correctly rounded value cut to 12 significant bits (the estimate), then one
    Newton-Raphson step r (2 - d r) in fp32."""
    d = d.float()
    r0 = (1.0 / d).view(torch.int32) & ~((1 << 12) - 1)  # 23 - 11 = 12 mantissa bits dropped: 12-bit estimate
    r0 = r0.view(torch.float32)
    return r0 * (2.0 - d * r0)


def rcp_silu(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * rcp(1.0 + torch.exp(-x))


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
def _method(fn):
    """A plain function calling ``fn``: put on ``torch.Tensor``, it binds the tensor as a method does."""

    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    return method


class Device(common.Installed):
    """One simulated device: a set of the mechanisms above (``taps``: "forward" or "reverse")."""

    TARGETS = _TARGETS

    def __init__(self, name, text, taps=None, bn1pass=False, blocked=False, pow2=False, sincos=False,
                 softplus=False, rcp=False):  # fmt: skip
        self.name, self.text, self.taps = name, text, taps
        self.bn1pass, self.blocked, self.pow2, self.sincos = bn1pass, blocked, pow2, sincos
        self.softplus, self.rcp = softplus, rcp
        self._saved: dict = {}

    # -- convolution ----------------------------------------------------------------------------------------------
    def _conv(self, input, weight, bias, stride, padding, dilation, groups, dims):
        stock = _STOCK["conv%dd" % dims]
        if isinstance(padding, str) or input.dim() != dims + 2:
            return stock(input, weight, bias, stride, padding, dilation, groups)
        x_in, w_in = common.alias(input), common.alias(weight)
        out = stock(x_in, w_in, bias, stride, padding, dilation, groups)

        def four(t):  # conv1d as conv2d over a height of 1
            return t.unsqueeze(-2) if dims == 1 else t

        args = (
            (1,) + _pair(stride, 1) if dims == 1 else stride,
            (0,) + _pair(padding, 1) if dims == 1 else padding,
            (1,) + _pair(dilation, 1) if dims == 1 else dilation,
            groups,
        )
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x, w = input.detach(), weight.detach()
            b = bias.detach() if bias is not None else None
            y = taps_conv2d(four(x), four(w), b, *args, order=self.taps)
            y = y.squeeze(-2) if dims == 1 else y
            _replace("conv%dd" % dims, out, y.to(out.dtype))
        if out.requires_grad:
            grad = common.GradOut(out)
            cache: dict = {}

            def grads():
                if "g" not in cache:
                    gx, gw = taps_conv2d_grads(four(grad.g), four(x), four(w), *args, order=self.taps)
                    cache["g"] = (gx.squeeze(-2), gw.squeeze(-2)) if dims == 1 else (gx, gw)
                return cache["g"]

            if x_in is not input:
                x_in.register_hook(common.quiet(lambda gx: _guard("conv dx", grads()[0].to(gx.dtype), gx)))
            if w_in is not weight:
                w_in.register_hook(common.quiet(lambda gw: _guard("conv dw", grads()[1].to(gw.dtype), gw)))
        return out

    def conv1d(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        return self._conv(input, weight, bias, stride, padding, dilation, groups, 1)

    def conv2d(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        return self._conv(input, weight, bias, stride, padding, dilation, groups, 2)

    # -- normalisation and reductions ----------------------------------------------------------------------------
    def batch_norm(self, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                   eps=1e-5):  # fmt: skip
        if not training:
            return _STOCK["batch_norm"](input, running_mean, running_var, weight, bias, training, momentum, eps)
        old = [t.detach().clone() if t is not None else None for t in (running_mean, running_var)]
        out = _STOCK["batch_norm"](input, running_mean, running_var, weight, bias, training, momentum, eps)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            mean, var = one_pass_batch_stats(input.detach())
            shape = [1, -1] + [1] * (input.dim() - 2)
            y = (input.detach().float() - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
            if weight is not None:
                y = y * weight.detach().float().view(shape)
            if bias is not None:
                y = y + bias.detach().float().view(shape)
            _replace("batch_norm", out, y.to(out.dtype))
            n = input.numel() // input.shape[1]
            if running_mean is not None and old[0] is not None:
                running_mean.data.copy_((1 - momentum) * old[0] + momentum * mean.to(old[0].dtype))
            if running_var is not None and old[1] is not None:
                running_var.data.copy_((1 - momentum) * old[1] + momentum * (var * n / max(n - 1, 1)).to(old[1].dtype))
        return out

    def _mean(self, stock, input, *args, **kwargs):
        out = stock(input, *args, **kwargs)
        dim = kwargs.get("dim", args[0] if args else None)
        keepdim = kwargs.get("keepdim", args[1] if len(args) > 1 else False)
        if isinstance(dim, (tuple, list)) and len(dim) == 1:
            dim = dim[0]
        if not isinstance(dim, int) or not out.is_floating_point() or input.shape[dim] < 2 or "out" in kwargs:
            return out  # full reductions (msprobe's own statistics among them) stay stock
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            _replace("mean", out, blocked_mean(input.detach(), dim, bool(keepdim)).to(out.dtype))
        return out

    def mean_fn(self, input, *args, **kwargs):
        return self._mean(_STOCK["mean"], input, *args, **kwargs)

    def tensor_mean(self, input, *args, **kwargs):
        return self._mean(_STOCK["Tensor.mean"], input, *args, **kwargs)

    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out = _STOCK["layer_norm"](input, normalized_shape, weight, bias, eps)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            y = blocked_layer_norm(input.detach(), tuple(normalized_shape), w, b, eps)
            _replace("layer_norm", out, y.to(out.dtype))
        return out

    # -- elementwise -----------------------------------------------------------------------------------------------
    def _pow(self, stock, input, exponent, **kwargs):
        out = stock(input, exponent, **kwargs)
        if (
            isinstance(input, torch.Tensor)
            and isinstance(exponent, (int, float))
            and not isinstance(exponent, bool)
            and input.is_floating_point()
            and not kwargs
        ):
            with torch.no_grad():
                _replace("pow", out, pow_exp2(input.detach(), float(exponent)).to(out.dtype))
        return out

    def pow_fn(self, input, exponent, **kwargs):
        return self._pow(_STOCK["pow"], input, exponent, **kwargs)

    def tensor_pow(self, input, exponent, **kwargs):
        return self._pow(_STOCK["Tensor.pow"], input, exponent, **kwargs)

    def _unary(self, key, fn, input, *args, **kwargs):
        out = _STOCK[key](input, *args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point() and not kwargs.get("out") and not args:
            with torch.no_grad():
                _replace(key, out, fn(input.detach()).to(out.dtype))
        return out

    def sin_fn(self, input, *args, **kwargs):
        return self._unary("sin", fast_sin, input, *args, **kwargs)

    def cos_fn(self, input, *args, **kwargs):
        return self._unary("cos", fast_cos, input, *args, **kwargs)

    def softplus_fn(self, input, beta=1.0, threshold=20.0):
        out = _STOCK["softplus"](input, beta, threshold)
        if beta == 1.0:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                y = torch.where(input.detach().float() > threshold, input.detach().float(), stable_softplus(input))
                _replace("softplus", out, y.to(out.dtype))
        return out

    def silu_fn(self, input, inplace=False):
        if inplace:
            return _STOCK["silu"](input, inplace)
        out = _STOCK["silu"](input)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            _replace("silu", out, rcp_silu(input.detach()).to(out.dtype))
        return out

    # -- installing --------------------------------------------------------------------------------------------
    def replacements(self) -> dict:
        out: dict = {}
        if self.taps:
            out.update(conv1d=self.conv1d, conv2d=self.conv2d)
        if self.bn1pass:
            out["batch_norm"] = self.batch_norm
        if self.blocked:
            out.update({"mean": self.mean_fn, "Tensor.mean": self.tensor_mean, "layer_norm": self.layer_norm_fn})
        if self.pow2:
            out.update({"pow": self.pow_fn, "Tensor.pow": self.tensor_pow})
        if self.sincos:
            out.update(sin=self.sin_fn, cos=self.cos_fn)
        if self.softplus:
            out["softplus"] = self.softplus_fn
        if self.rcp:
            out["silu"] = self.silu_fn
        return out

    def _wrap(self, mod, fn):
        return _method(fn) if mod is torch.Tensor else fn


DEVICES = {
    "N": Device(
        "N",
        "convolutions as implicit GEMMs, channels-last: one GEMM over the input channels per filter tap, the taps "
        "added in fp32 in tap order (forward, input and weight gradients); BatchNorm's batch statistics in one pass "
        "(E[x^2] - E[x]^2, fp32), the running statistics updated from them",
        taps="forward",
        bn1pass=True,
    ),
    "O": Device(
        "O",
        "pure-bf16 SSM unit: the depthwise conv1d as per-tap products added in tap order (forward and gradients); "
        "softplus as max(x, 0) + log1p(exp(-|x|)); SiLU through a 12-bit reciprocal estimate and one Newton step; "
        "pow as exp2(y log2|x|); means over a dimension as blocked sums (blocks of 8, pairwise tree)",
        taps="forward",
        softplus=True,
        rcp=True,
        pow2=True,
        blocked=True,
    ),
    "P": Device(
        "P",
        "bf16-autocast unit: pow as exp2(y log2|x|) in fp32 (T5LayerNorm's square, GELU(tanh)'s cube); means over "
        "a dimension and LayerNorm's statistics as blocked sums (blocks of 8 added in order, the blocks as a "
        "pairwise tree)",
        pow2=True,
        blocked=True,
    ),
    "Q": Device(
        "Q",
        "fp16-autocast unit with fast-math sin/cos (reduction by pi/2, polynomials: the rotary table built with "
        "them), pow as exp2(y log2|x|) (GELU(tanh)'s cube), LayerNorm's statistics as blocked sums",
        sincos=True,
        pow2=True,
        blocked=True,
    ),
    "R": Device(
        "R",
        "the reference GPU rerun with the convolution autotuner on: another algorithm, the per-tap GEMMs added in "
        "reverse tap order (forward and gradients); everything else stock",
        taps="reverse",
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv2d": (torch.randn(4, 8, 8, 8, generator=g), torch.randn(16, 8, 3, 3, generator=g) * 0.2),
        "conv1d": (torch.randn(2, 64, 16, generator=g), torch.randn(64, 1, 4, generator=g) * 0.5),
        "batch_norm": (torch.randn(4, 16, 8, 8, generator=g) * 0.7 + 0.3,),
        "mean": (torch.randn(2, 16, 32, generator=g) ** 2,),
        "Tensor.mean": (torch.randn(2, 16, 32, generator=g) ** 2,),
        "layer_norm": (torch.randn(32, 32, generator=g) + 0.5,),
        "pow": (torch.randn(4096, generator=g) * 2,),
        "Tensor.pow": (torch.randn(4096, generator=g) * 2,),
        "sin": (torch.arange(64).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 4, 2) / 4.0)),),
        "cos": (torch.arange(64).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 4, 2) / 4.0)),),
        "softplus": (torch.randn(4096, generator=g) * 3 - 2,),
        "silu": (torch.randn(4096, generator=g) * 3,),
    }


def _call(fn, key: str, args: tuple):
    if key == "conv1d":
        return fn(args[0], args[1], None, 1, 3, 1, args[0].shape[1])[..., : args[0].shape[-1]]  # Mamba's causal conv
    if key == "conv2d":
        return fn(args[0], args[1], None, 1, 1)
    if key == "batch_norm":
        c = args[0].shape[1]
        rm, rv = torch.zeros(c, dtype=args[0].dtype), torch.ones(c, dtype=args[0].dtype)
        return fn(args[0], rm, rv, None, None, True, 0.1, 1e-5)
    if key in ("mean", "Tensor.mean"):
        return fn(args[0], -1, keepdim=True)
    if key == "layer_norm":
        return fn(args[0], (args[0].shape[-1],))
    if key == "pow":
        return fn(args[0], 3.0)
    if key == "Tensor.pow":
        return fn(args[0], 2)
    return fn(*args)


CONV = ("conv1d", "conv2d")
# how each device runs in its family (make_pairs.py): the ops the family calls and the dtype each sees (fp32 where
# not named: T5LayerNorm and Mamba's RMSNorm upcast, softplus gets Mamba's fp32 dt, GPT-J's table is fp32)
SETTINGS = {
    "N": {"conv2d": torch.float32, "batch_norm": torch.float32},
    "O": {"conv1d": torch.bfloat16, "Tensor.mean": None, "Tensor.pow": None, "softplus": None, "silu": torch.bfloat16},
    "P": {"Tensor.mean": None, "Tensor.pow": None, "pow": torch.bfloat16},
    "Q": {"layer_norm": None, "pow": torch.float16, "sin": None, "cos": None},
    "R": {"conv2d": torch.float32},
}


def _grad_of(f, key, args, r, which):
    leaf = args[which].detach().clone().requires_grad_()
    call = list(args)
    call[which] = leaf
    y = _call(f, key, tuple(call))
    (y.float() * r).sum().backward()
    return leaf.grad


def measure(seed: int = 0, devices=None) -> list[dict]:
    """Per device (in its family's dtype) and op: relative L2 error against float64 of the stock kernel and of the
    device's, the relative L2 difference between the two and the share of elements that differ; for the
    convolutions also the input and weight gradients' differences (backward of sum(y * r), r fixed)."""
    rows = []
    base = _inputs(seed)
    for dev in devices or DEVICES.values():
        for key, fn in dev.replacements().items():
            if key not in SETTINGS[dev.name]:
                continue  # a replacement the family never calls
            dtype = SETTINGS[dev.name][key] or torch.float32
            args = tuple(t.to(dtype) for t in base[key])
            with torch.no_grad():
                exact = _call(_STOCK[key], key, tuple(t.double() for t in args))
                stock = _call(_STOCK[key], key, args)
                got = _call(fn, key, args)
            row = common.magnitudes(dev.name, key, str(stock.dtype).replace("torch.", ""), exact, stock, got)
            if key in CONV:
                r = torch.randn(stock.shape, generator=torch.Generator().manual_seed(seed + 1))
                for col, which in (("grad_device_vs_stock", 0), ("wgrad_device_vs_stock", 1)):
                    grads = [_grad_of(f, key, args, r, which) for f in (_STOCK[key], fn)]
                    row[col] = rel_l2(grads[1], grads[0])
            rows.append(row)
    return rows


COLS = common.COLS


if __name__ == "__main__":
    common.print_table(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 0), COLS)

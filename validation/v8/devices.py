"""Simulated device kernels of validation set 8: nine more ways an accelerator computes the same function.

Independent of the development set and of sets 1 to 7 (``validation/devices.py``, ``validation/v2/devices.py`` to
``validation/v7/devices.py``): none of these mechanisms is used there. Each changes values at the rounding level:

* ``dft_gemm``: the 2-d FFT of FNet's token mixing (``torch.fft.fftn`` over the sequence and hidden dimensions) as
  two real DFT matrix products, as a matrix unit without an FFT unit computes it (TPU-style): cosine and sine tables
  of the angle 2 pi (jk mod N) / N made in float64 and stored in fp32, Re(Y) = C_S X C_H - S_S X S_H and Im(Y) =
  -(S_S X C_H + C_S X S_H) by fp32 GEMMs (``order``: the sequence transform first, or the hidden one); forward values
  (the backward stock);
* ``gelu_sigmoid``: the tanh-approximated GELU through the identity 0.5 (1 + tanh z) = sigmoid(2 z), y = x
  sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) in fp32 (the form fused kernels use), its input gradient s + x s (1 - s)
  2 sqrt(2/pi) (1 + 3 0.044715 x^2) with the same s;
* ``bias_first``: a linear as a GEMM whose fp32 accumulator starts from the bias (cuBLAS with beta = 1 on a
  broadcast bias; the stock kernel adds the bias after the product) and takes K in chunks of 8, left to right; input
  and weight gradients as GEMMs over chunks of 8 of their own reduction, left to right, fp32, one rounding to the
  16-bit dtype where there is one;
* ``bn_scale_shift``: BatchNorm applied as a per-channel scale and shift (the folded form of fused conv-BN kernels):
  a = weight rsqrt(var + eps), c = bias - mean a, y = x a + c, the batch statistics two-pass in fp32 (or the running
  statistics outside training); forward values (the backward, from the saved statistics, stock; the running
  statistics the stock kernel's);
* ``sqrt_rsqrt``: ``torch.sqrt`` as x rsqrt(x) (a special-function unit's reciprocal square root, then one
  multiply: fast-math sqrt), fp32 (the backward, from the saved output, takes the device's values);
* ``dw_fma``: a depthwise convolution (``groups`` = input channels) as a direct kernel's chain of fused
  multiply-adds, tap after tap: acc = fma(x, w, acc), one rounding per tap, the product never rounded on its own (an
  ARM or mobile NPU vector unit's FMLA; ``order``: taps column-major, or row-major from the last; the stock CPU
  kernel's order, row-major from the first, gives its values exactly), the bias added last; forward values (the
  backward stock);
* ``pool_rcp``: global average pooling (``adaptive_avg_pool2d`` to 1 x 1) as the fp32 sum of the window times the
  fp32 reciprocal of its size (instead of a division); forward values (the backward does not read them);
* ``silu_bwd_y``: SiLU's input gradient from its (rounded) output, as memory-saving fused kernels write it: dx = g (s
  + y (1 - s)) with y the output as stored in the 16-bit dtype (stock: s (1 + x (1 - s)) from the input), fp32;
* ``pow_fp32``: an autocast policy with ``pow`` on the fp32 list (CUDA's policy; CPU autocast runs it in its
  input's 16-bit dtype): a 16-bit tensor raised to a constant power is computed and output in fp32, and so are the
  ops after it until the next autocast GEMM (a real cross-device difference of dtypes in those records).

Installed as in sets 2 to 7 (``validation/common_devices.py``: the guard, the gradient plumbing and installing).
``python validation/v8/devices.py`` prints the measured magnitudes (docs/validation.md, "Validation set 8").
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

common = sys.modules.get("validation_common_devices")
if common is None:  # installing, the gradient plumbing, the tables: loaded once, by path
    _spec = importlib.util.spec_from_file_location(
        "validation_common_devices", Path(__file__).resolve().parent.parent / "common_devices.py"
    )
    common = sys.modules["validation_common_devices"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(common)

GELU_K = math.sqrt(2.0 / math.pi)
GELU_C = 0.044715
CHUNK = 8  # bias_first's K chunk

# the stock functions, captured before anyone (this module, a tracer or msprobe) replaces them
_STOCK = {
    "fftn": torch.fft.fftn,
    "gelu": F.gelu,
    "linear": F.linear,
    "batch_norm": F.batch_norm,
    "sqrt": torch.sqrt,
    "conv2d": F.conv2d,
    "adaptive_avg_pool2d": F.adaptive_avg_pool2d,
    "silu": F.silu,
    "pow": torch.pow,
}
_TARGETS = {
    "fftn": (torch.fft, "fftn"),
    "gelu": (F, "gelu"),
    "linear": (F, "linear"),
    "batch_norm": (F, "batch_norm"),
    "sqrt": (torch, "sqrt"),
    "conv2d": (F, "conv2d"),
    "adaptive_avg_pool2d": (F, "adaptive_avg_pool2d"),
    "silu": (F, "silu"),
    "pow": (torch, "pow"),
}


# ---------------------------------------------------------------------------------------------------------------
# the mechanisms (pure functions; fp32 unless said)
# ---------------------------------------------------------------------------------------------------------------
def dft_tables(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of 2 pi (jk mod n) / n, j, k < n: made in float64, stored in fp32 (the twiddle tables)."""
    j = torch.arange(n, dtype=torch.float64)
    ang = 2.0 * math.pi * torch.remainder(j[:, None] * j[None, :], n) / n
    return torch.cos(ang).float(), torch.sin(ang).float()


def dft2(x: torch.Tensor, order: str = "seq_first") -> torch.Tensor:
    """The 2-d DFT of real ``x`` (..., S, H) over its last two dimensions by real fp32 GEMMs (complex64 out)."""
    x = x.float()
    cs, ss = dft_tables(x.shape[-2])
    ch, sh = dft_tables(x.shape[-1])
    mm = torch.matmul
    if order == "seq_first":  # (C_S X) C_H: the sequence transform first
        a, b = mm(cs, x), mm(ss, x)
        re, im = mm(a, ch) - mm(b, sh), -(mm(b, ch) + mm(a, sh))
    else:  # C_S (X C_H): the hidden transform first
        a, b = mm(x, ch), mm(x, sh)
        re, im = mm(cs, a) - mm(ss, b), -(mm(ss, a) + mm(cs, b))
    return torch.complex(re, im)


def gelu_sigmoid(x32: torch.Tensor) -> torch.Tensor:
    """tanh-GELU as x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))."""
    return x32 * torch.sigmoid(2.0 * GELU_K * (x32 + GELU_C * x32 * x32 * x32))


def gelu_sigmoid_grad(x32: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(2.0 * GELU_K * (x32 + GELU_C * x32 * x32 * x32))
    return s + x32 * s * (1.0 - s) * 2.0 * GELU_K * (1.0 + 3.0 * GELU_C * x32 * x32)


def chunked_mm(a: torch.Tensor, b: torch.Tensor, start=None, chunk: int = CHUNK) -> torch.Tensor:
    """a @ b in fp32 with the reduction taken in chunks of ``chunk``, left to right, into an accumulator that starts
    at ``start`` (the bias) or at the first chunk's product."""
    a, b = a.float(), b.float()
    acc = start
    for s in range(0, a.shape[-1], chunk):
        part = torch.matmul(a[..., s : s + chunk], b[s : s + chunk])
        acc = part if acc is None else acc + part
    return acc


def bn_scale_shift(x32, mean, var, weight, bias, eps: float) -> torch.Tensor:
    """BatchNorm over channel dimension 1 as y = x a + c, a = w rsqrt(var + eps), c = b - mean a."""
    a = torch.rsqrt(var + eps)
    if weight is not None:
        a = a * weight.float()
    c = -mean * a
    if bias is not None:
        c = c + bias.float()
    shape = [1, -1] + [1] * (x32.dim() - 2)
    return x32 * a.reshape(shape) + c.reshape(shape)


def batch_stats(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (dimension 1): the mean and the biased variance, two passes, fp32."""
    dims = [d for d in range(x32.dim()) if d != 1]
    mean = x32.mean(dims)
    d = x32 - mean.reshape([1, -1] + [1] * (x32.dim() - 2))
    return mean, (d * d).mean(dims)


def sqrt_rsqrt(x32: torch.Tensor) -> torch.Tensor:
    """sqrt(x) as x rsqrt(x) (0 where x is 0)."""
    return torch.where(x32 > 0, x32 * torch.rsqrt(x32), _STOCK["sqrt"](x32))


def depthwise_fma(x, w, stride, padding, dilation, order: str = "row") -> torch.Tensor:
    """A depthwise conv2d (no bias) as a chain of fused multiply-adds, tap after tap, in ``x``'s dtype: each tap's
    product added to the accumulator exactly (float64, exact for fp32 products) and the sum rounded once.
    ``padding``: (ph, pw); taps ``order``ed row-major ("row"), column-major ("col") or row-major from the last
    ("reverse")."""
    kh, kw = w.shape[-2:]
    xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    oh = (xp.shape[-2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (xp.shape[-1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    taps = [(i, j) for i in range(kh) for j in range(kw)]
    if order == "col":
        taps = [(i, j) for j in range(kw) for i in range(kh)]
    elif order == "reverse":
        taps = taps[::-1]
    acc = None
    for i, j in taps:
        r0, c0 = i * dilation[0], j * dilation[1]
        win = xp[:, :, r0 : r0 + stride[0] * (oh - 1) + 1 : stride[0], c0 : c0 + stride[1] * (ow - 1) + 1 : stride[1]]
        prod = win.double() * w[:, 0, i, j].reshape(1, -1, 1, 1).double()
        acc = (prod if acc is None else acc.double() + prod).to(x.dtype)
    return acc


def pool_rcp(x32: torch.Tensor) -> torch.Tensor:
    """Global average pooling as sum times the fp32 reciprocal of the window size."""
    n = x32.shape[-1] * x32.shape[-2]
    return x32.sum((-2, -1), keepdim=True) * torch.tensor(1.0 / n, dtype=torch.float32)


def silu_grad_from_output(x32: torch.Tensor, y32: torch.Tensor) -> torch.Tensor:
    """SiLU's derivative s + y (1 - s) from the (rounded) output y."""
    s = torch.sigmoid(x32)
    return s + y32 * (1.0 - s)


@contextlib.contextmanager
def silent():
    """msprobe's recording off (as ``common.quiet`` for hooks): for a replacement of a function msprobe does not wrap
    (``torch.fft.fftn``), whose own torch calls would otherwise be recorded as the model's."""
    try:
        from msprobe.core.dump.hook_manager import BaseHookManager
    except ImportError:  # pragma: no cover - msprobe absent: nothing records
        yield
        return
    tid = threading.get_ident()
    old = BaseHookManager.inner_switch[tid]
    BaseHookManager.inner_switch[tid] = True
    try:
        yield
    finally:
        BaseHookManager.inner_switch[tid] = old


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


# ---------------------------------------------------------------------------------------------------------------
# devices: replacements with the stock signatures
# ---------------------------------------------------------------------------------------------------------------
class Device(common.Installed):
    """One simulated device: a name, a description and its mechanisms (``mech``: name -> option)."""

    TARGETS = _TARGETS

    def __init__(self, name: str, text: str, **mech):
        self.name, self.text, self.mech = name, text, mech
        self._saved: dict = {}

    def fftn_fn(self, input, s=None, dim=None, norm=None, *, out=None):
        res = _STOCK["fftn"](input, s=s, dim=dim, norm=norm, out=out)
        dims = None if dim is None else tuple(d % input.dim() for d in dim)
        if out is not None or s is not None or norm is not None or input.is_complex() or input.dim() < 2:
            return res
        if dims != (input.dim() - 2, input.dim() - 1) or input.dtype != torch.float32:
            return res
        with torch.no_grad(), silent():
            got = dft2(input.detach(), self.mech["dft_gemm"]).to(res.dtype)
            common.guard("fftn", torch.view_as_real(got), torch.view_as_real(res.detach()))
            res.data.copy_(got)
        return res

    def gelu_fn(self, input, approximate="none"):
        if approximate != "tanh":
            return _STOCK["gelu"](input, approximate=approximate)
        x_in = common.alias(input)
        out = _STOCK["gelu"](x_in, approximate="tanh")
        x = input.detach()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            common.replace("gelu", out, gelu_sigmoid(x.float()).to(out.dtype))
        if x_in is not input and out.requires_grad:
            grad = common.GradOut(out)
            x_in.register_hook(
                common.quiet(
                    lambda gx: common.guard("gelu dx", (grad.g.float() * gelu_sigmoid_grad(x.float())).to(gx.dtype), gx)
                )
            )
        return out

    def linear_fn(self, input, weight, bias=None):
        return common.linear_with(_STOCK["linear"], input, weight, bias, self._linear_put, self._linear_dx,
                                  self._linear_dw)  # fmt: skip

    @staticmethod
    def _linear_put(out, x, w, b):
        start = b.float() if b is not None else None
        y = chunked_mm(x, w.t(), start)
        common.replace("linear", out, y.to(out.dtype))

    @staticmethod
    def _linear_dx(g, w, gx, cdt):
        got = chunked_mm(g.to(cdt), w).to(cdt)
        return common.guard("linear dx", got.to(gx.dtype), gx, cdt)

    @staticmethod
    def _linear_dw(g2, x2, gw, cdt):
        got = chunked_mm(g2.to(cdt).t(), x2).to(cdt)
        return common.guard("linear dw", got.to(gw.dtype), gw, cdt)

    def batch_norm_fn(self, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                      eps=1e-5):  # fmt: skip
        out = _STOCK["batch_norm"](input, running_mean, running_var, weight, bias, training, momentum, eps)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x32 = input.detach().float()
            if training or running_mean is None:
                mean, var = batch_stats(x32)
            else:
                mean, var = running_mean.float(), running_var.float()
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            common.replace("batch_norm", out, bn_scale_shift(x32, mean, var, w, b, eps).to(out.dtype))
        return out

    def sqrt_fn(self, input, *, out=None):
        if out is not None or not input.is_floating_point():
            return _STOCK["sqrt"](input, out=out) if out is not None else _STOCK["sqrt"](input)
        res = _STOCK["sqrt"](input)
        with torch.no_grad():
            common.replace("sqrt", res, sqrt_rsqrt(input.detach().float()).to(res.dtype))
        return res

    def conv2d_fn(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        res = _STOCK["conv2d"](input, weight, bias, stride, padding, dilation, groups)
        if groups == 1 or groups != input.shape[-3] or weight.shape[1] != 1 or isinstance(padding, str):
            return res
        with torch.no_grad():
            cast = common.autocast_dtype()
            with torch.autocast("cpu", enabled=False):
                x, w = input.detach(), weight.detach()
                if cast is not None:
                    x, w = x.to(cast), w.to(cast)
                y = depthwise_fma(x, w, _pair(stride), _pair(padding), _pair(dilation), self.mech["dw_fma"])
                if bias is not None:
                    y = y + bias.detach().to(y.dtype).reshape(1, -1, 1, 1)
                common.replace("conv2d", res, y.to(res.dtype))
        return res

    def adaptive_avg_pool2d_fn(self, input, output_size):
        res = _STOCK["adaptive_avg_pool2d"](input, output_size)
        if _pair(output_size) != (1, 1):
            return res
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            common.replace("adaptive_avg_pool2d", res, pool_rcp(input.detach().float()).to(res.dtype))
        return res

    def silu_fn(self, input, inplace=False):
        if inplace:
            return _STOCK["silu"](input, inplace=True)
        x_in = common.alias(input)
        out = _STOCK["silu"](x_in)
        if x_in is not input and out.requires_grad:
            grad = common.GradOut(out)
            x, y = input.detach(), out.detach()

            def dx(gx):
                got = grad.g.float() * silu_grad_from_output(x.float(), y.float())
                return common.guard("silu dx", got.to(gx.dtype), gx)

            x_in.register_hook(common.quiet(dx))
        return out

    def pow_fn(self, input, exponent, *, out=None):
        low = isinstance(input, torch.Tensor) and input.dtype in (torch.float16, torch.bfloat16)
        if out is not None or not low or not isinstance(exponent, (int, float)) or common.autocast_dtype() is None:
            return _STOCK["pow"](input, exponent, out=out) if out is not None else _STOCK["pow"](input, exponent)
        res = _STOCK["pow"](input.float(), exponent)  # the fp32 list: computed and output in fp32
        with torch.no_grad():
            common.guard("pow", res.detach().to(input.dtype).float(), _STOCK["pow"](input.detach(), exponent).float(),
                         input.dtype)  # fmt: skip
        return res

    def replacements(self) -> dict:
        fns = {
            "dft_gemm": {"fftn": self.fftn_fn},
            "gelu_sigmoid": {"gelu": self.gelu_fn},
            "bias_first": {"linear": self.linear_fn},
            "bn_scale_shift": {"batch_norm": self.batch_norm_fn},
            "sqrt_rsqrt": {"sqrt": self.sqrt_fn},
            "dw_fma": {"conv2d": self.conv2d_fn},
            "pool_rcp": {"adaptive_avg_pool2d": self.adaptive_avg_pool2d_fn},
            "silu_bwd_y": {"silu": self.silu_fn},
            "pow_fp32": {"pow": self.pow_fn},
        }
        out: dict = {}
        for m in self.mech:
            out.update(fns[m])
        return out


AN_MECH = {"sqrt_rsqrt": True, "bn_scale_shift": True, "bias_first": True}
DEVICES = {
    "AK": Device(
        "AK",
        "mobile NPU vector unit, fp32: depthwise convolutions as chains of fused multiply-adds (column-major taps); "
        "BatchNorm as a per-channel scale and shift; global average pooling as a sum times the reciprocal of the "
        "window size",
        dw_fma="col",
        bn_scale_shift=True,
        pool_rcp=True,
    ),
    "AL": Device(
        "AL",
        "matrix unit without an FFT unit, fp32: the 2-d FFT as real DFT GEMMs (the sequence transform first); "
        "tanh-GELU through a sigmoid; linears with the accumulator started at the bias, K in chunks of 8",
        dft_gemm="seq_first",
        gelu_sigmoid=True,
        bias_first=True,
    ),
    "AM": Device(
        "AM",
        "bf16 training unit: linears with the accumulator started at the bias, K in chunks of 8 (fp32, one rounding "
        "to bf16); SiLU's input gradient from its bf16 output",
        bias_first=True,
        silu_bwd_y=True,
    ),
    "AN": Device(
        "AN",
        "fp16 autocast unit: sqrt as x rsqrt(x); BatchNorm as a per-channel scale and shift; linears with the "
        "accumulator started at the bias, K in chunks of 8",
        **AN_MECH,
    ),
    "AO": Device(
        "AO",
        "device AN under an autocast policy with pow on the fp32 list (CUDA's): a 16-bit pow computed and output in "
        "fp32",
        pow_fp32=True,
        **AN_MECH,
    ),
    "AP": Device(
        "AP",
        "the reference GPU rerun with its FFT as real DFT GEMMs, the hidden transform first; all else stock",
        dft_gemm="hidden_first",
    ),
    "AQ": Device(
        "AQ",
        "the reference GPU rerun with its depthwise convolutions as chains of fused multiply-adds, the taps from the "
        "last; all else stock",
        dw_fma="reverse",
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _cases(g) -> list[tuple]:
    """(device, op, autocast dtype or None, input dtype, call(f, args), args, grad) of each device's ops as its
    family gives them."""
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    dw = (r(2, 32, 12, 12), r(32, 1, 3, 3) * 0.3)
    bn = (r(2, 16, 10, 10) * 2 + 0.5, r(16).abs() + 0.5, r(16) * 0.1)
    lin = (r(32, 64), r(96, 64) * 0.1, r(96) * 0.1)
    fp16, bf16 = torch.float16, torch.bfloat16

    def bn_call(f, a):  # a 16-bit input (a convolution's or linear's output), fp32 weight and bias
        p = torch.float64 if a[0].dtype == torch.float64 else torch.float32
        return f(a[0], None, None, a[1].to(p), a[2].to(p), True, 0.1, 1e-5)

    return [
        ("AK", "conv2d (depthwise)", None, torch.float32, lambda f, a: f(a[0], a[1], None, 1, 1, 1, 32), dw, False),
        ("AK", "batch_norm", None, torch.float32, bn_call, bn, False),
        ("AK", "adaptive_avg_pool2d", None, torch.float32, lambda f, a: f(a[0], 1), (r(2, 64, 3, 3) + 1,), False),
        ("AL", "fft.fftn", None, torch.float32, lambda f, a: f(a[0], dim=(1, 2)).real, (r(2, 16, 32),), False),
        ("AL", "gelu (tanh)", None, torch.float32, lambda f, a: f(a[0], approximate="tanh"), (r(4096) * 2,), True),
        ("AL", "linear", None, torch.float32, lambda f, a: f(*a), lin, True),
        ("AM", "linear", None, bf16, lambda f, a: f(*a), lin, True),
        ("AM", "silu", None, bf16, lambda f, a: f(a[0]), (r(4096) * 2,), True),
        ("AN", "sqrt", None, torch.float32, lambda f, a: f(a[0]), (r(4096).abs() + 1e-3,), False),
        ("AN", "batch_norm", None, torch.float32, bn_call, bn, False),
        ("AN", "linear", fp16, torch.float32, lambda f, a: f(*a), lin, True),
        ("AO", "pow (x^3)", fp16, fp16, lambda f, a: f(a[0], 3.0), (r(4096),), False),
        ("AP", "fft.fftn", None, torch.float32, lambda f, a: f(a[0], dim=(1, 2)).real, (r(2, 16, 32),), False),
        ("AQ", "conv2d (depthwise)", None, torch.float32, lambda f, a: f(a[0], a[1], None, 1, 1, 1, 32), dw, False),
    ]


def measure(seed: int = 0) -> list[dict]:
    """Per device and op, as its family runs it: the stock kernel's and the device's relative L2 error against
    float64, their difference, the share of elements that differ; ``grad``: the input gradient of sum(y * r)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for dev_name, op, ac, dtype, call, args, grad in _cases(g):
        dev = DEVICES[dev_name]
        key = next(k for k in dev.replacements() if op.split(" ")[0].split(".")[-1] == k)
        args = tuple(a.to(dtype) for a in args)
        fn, stock_fn = dev.replacements()[key], _STOCK[key]
        with torch.no_grad():
            exact = call(stock_fn, tuple(a.double() for a in args))
            with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
                stock, got = call(stock_fn, args), call(fn, args)
        name = ("autocast_" + str(ac).replace("torch.", "")) if ac else str(dtype).replace("torch.", "")
        row = common.magnitudes(dev_name, op, name, exact, stock.float(), got.float())
        if grad:
            rr = torch.randn(stock.shape, generator=torch.Generator().manual_seed(seed + 1))
            grads = []
            for f in (stock_fn, fn):
                leaf = args[0].detach().clone().requires_grad_()
                with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
                    (call(f, (leaf,) + args[1:]).float() * rr).sum().backward()
                grads.append(leaf.grad)
            row["grad_device_vs_stock"] = common.rel_l2(grads[1], grads[0])
        rows.append(row)
    return rows


if __name__ == "__main__":
    common.print_table(measure(), common.COLS[:-1])

"""Simulated device kernels of validation set 2: other ways an accelerator computes the same function.

Independent of ``validation/devices.py`` (set 1) and of the development set: none of the mechanisms below is used
there. Each changes values at the rounding level only:

* ``rna``: fp32 -> bf16 casts round half AWAY from zero instead of half to even (some vector units' convert);
* ``unfused_bias``: the GEMM's output is rounded to bf16 first, the bias added by a separate bf16 kernel (two
  roundings where a fused epilogue has one);
* ``lut``: SiLU / GELU(tanh) from a lookup table of the exact function with linear interpolation between entries
  (the table's step chosen per dtype so that the interpolation error is at most about one unit of the dtype);
* ``wide_acc``: dot products accumulated exactly (a wide fixed-point accumulator, here float64) and rounded once;
* ``bf16x3``: an fp32 matmul emulated with three bf16 matmuls (hi*hi + hi*lo + lo*hi, each operand split into a
  bf16 head and a bf16 tail; the lo*lo term dropped), as NPUs without an fp32 cube unit do;
* ``fp16_chunk``: fp16 products accumulated IN FP16 over chunks of 4 along K, the chunk sums added in fp32, the
  result rounded to fp16 (a fp16 MAC tree feeding an fp32 accumulator);
* ``welford``: LayerNorm's mean and variance by Welford/Chan merging of chunks of 16 (a streaming kernel);
* ``unsafe_softmax``: softmax as exp(x) / sum(exp(x)) with no max subtraction (valid for bounded scores; a kernel
  that knows its inputs are small), falling back to the max-subtracted form only where exp would overflow;
* ``ce_blocked``: cross-entropy with the log-sum-exp summed over the vocabulary in blocks of 32 (blocks added in
  reverse order) and the mean over tokens as a pairwise tree.

A device is a set of replacements for torch API functions, installed on the ``torch`` modules *before* msprobe
wraps the API, so msprobe records them under the stock names (``Functional.linear``, ``Torch.matmul``, ...). Each
replacement runs the stock kernel first (the output's autograd node, which msprobe hooks for the backward record,
stays the stock one) and overwrites the output's values with the device's; linear and matmul also replace their
input gradients (and the weight gradient) with the device's through tensor hooks. Every replacement is checked
against the stock kernel on every call: a relative L2 difference above its guard raises (a device must never
change more than rounding). ``python validation/v2/devices.py`` prints the measured magnitudes
(docs/validation.md, "Validation set 2").
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

common = sys.modules.get("validation_common_devices")
if common is None:  # the guard, the gradient plumbing, installing, the tables: loaded once, by path
    _spec = importlib.util.spec_from_file_location(
        "validation_common_devices", Path(__file__).parents[1] / "common_devices.py"
    )
    common = sys.modules["validation_common_devices"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(common)
rel_l2 = common.rel_l2

# the stock functions, captured before anyone (this module or msprobe) replaces them
_STOCK = {
    "linear": F.linear,
    "matmul": torch.matmul,
    "softmax": F.softmax,
    "silu": F.silu,
    "gelu": F.gelu,
    "layer_norm": F.layer_norm,
    "cross_entropy": F.cross_entropy,
}
_TARGETS = {
    "linear": (F, "linear"),
    "matmul": (torch, "matmul"),
    "softmax": (F, "softmax"),
    "silu": (F, "silu"),
    "gelu": (F, "gelu"),
    "layer_norm": (F, "layer_norm"),
    "cross_entropy": (F, "cross_entropy"),
}
# the largest relative L2 difference from the stock kernel a replacement may make: a few units of the rounding of
# the precision it computes at ("bf16x3": an fp32 matmul at about 16 mantissa bits)
GUARD = {**common.GUARD, "bf16x3": 2e-4}


# ---------------------------------------------------------------------------------------------------------------
# rounding, summation and formula building blocks (fp32 unless said; forward values only)
# ---------------------------------------------------------------------------------------------------------------
def round_half_away_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 (or float64) -> bf16 rounding ties away from zero: add half a bf16 ulp to the magnitude bits and cut.

    A float64 input is rounded once: where its fp32 rounding lands exactly on a bf16 tie that the float64 value
    is not on, the value is rounded toward the side it lies on (no double rounding)."""
    x = x.detach()
    x32 = x.float().contiguous()
    bits = x32.view(torch.int32)
    rna = ((bits + 0x8000) & ~0xFFFF).view(torch.float32)
    ok = torch.isfinite(x32)
    if x.dtype == torch.float64:
        tie = (bits & 0xFFFF) == 0x8000
        below = x.abs() < x32.double().abs()  # the exact value lies below the tie: toward zero
        rna = torch.where(tie & below, (bits & ~0xFFFF).view(torch.float32), rna)
    return torch.where(ok, rna, x32).to(torch.bfloat16)  # exact: rna is a bf16 value


def to_dtype(x: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    if dtype == torch.bfloat16 and rounding == "rna":
        return round_half_away_bf16(x)
    return x.float().to(dtype)


def wide_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated exactly (float64 holds every product of 16-bit floats and their short sums)."""
    return _STOCK["matmul"](a.double(), b.double())


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = hi + lo + r, hi and lo bf16 values (as fp32), |r| <= 2^-16 |x|."""
    x = x.float()
    hi = x.to(torch.bfloat16).float()
    lo = (x - hi).to(torch.bfloat16).float()
    return hi, lo


def bf16x3_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b as three bf16 matmuls with fp32 accumulation: (hi.lo + lo.hi) + hi.hi."""
    ah, al = split_bf16(a)
    bh, bl = split_bf16(b)
    mm = _STOCK["matmul"]
    return (mm(ah, bl) + mm(al, bh)) + mm(ah, bh)


def fp16_chunk_matmul(a: torch.Tensor, b: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """a @ b with fp16 operands: products (exact in fp32) accumulated in fp16 within chunks of ``chunk`` along K,
    the chunk sums added in fp32."""
    a32, b32 = a.to(torch.float16).float(), b.to(torch.float16).float()
    k = a32.shape[-1]
    prod = a32.unsqueeze(-1) * b32.unsqueeze(-3)  # (..., M, K, N)
    pad = (-k) % chunk
    if pad:
        prod = F.pad(prod, (0, 0, 0, pad))
    prod = prod.unflatten(-2, (-1, chunk))  # (..., M, K/chunk, chunk, N)
    acc = prod[..., 0, :].half().float()
    for j in range(1, chunk):
        acc = (acc + prod[..., j, :]).half().float()
    return acc.sum(-2)


def lut_step(dtype: torch.dtype) -> float:
    """The table's step: interpolation error h^2/8 max|f''| (max|f''| <= 0.8 for SiLU and GELU) near one unit of
    the dtype at |f| ~ 1 (bf16 2^-8, fp16 2^-11, fp32 2^-24)."""
    return {torch.bfloat16: 2.0**-3, torch.float16: 2.0**-5}.get(dtype, 2.0**-11)


_LUTS: dict = {}


def _silu64(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


_FNS = {"silu": _silu64, "gelu_tanh": _gelu_tanh64}
LUT_RANGE = 24.0


def lut_activation(x32: torch.Tensor, fn: str, h: float) -> torch.Tensor:
    """fn(x) by linear interpolation in a table of fn at multiples of h over [-24, 24]; outside, fn's asymptote
    (x above, 0 below: both within an fp32 ulp of the function there)."""
    key = (fn, h)
    if key not in _LUTS:
        grid = torch.arange(-LUT_RANGE, LUT_RANGE + h / 2, h, dtype=torch.float64)
        _LUTS[key] = _FNS[fn](grid).float()
    table = _LUTS[key]
    x = x32.detach().float()
    # the index and the weight in fixed point (exact: float64 here), the interpolation in fp32
    pos = ((x.double().clamp(-LUT_RANGE, LUT_RANGE) + LUT_RANGE) / h).clamp(0, table.numel() - 1.0)
    i = pos.floor().clamp(max=table.numel() - 2.0)
    frac = (pos - i).float()
    i = i.long()
    lo, hi = table[i], table[i + 1]
    y = lo + frac * (hi - lo)
    y = torch.where(x > LUT_RANGE, x, y)
    return torch.where(x < -LUT_RANGE, torch.zeros_like(x), y)


def welford_layer_norm(x32, normalized_shape, weight, bias, eps, chunk: int = 16):
    """LayerNorm whose mean and variance come from chunks of ``chunk`` merged one after the other (Chan et al.)."""
    n_dims = len(normalized_shape)
    x = x32.float().flatten(-n_dims)
    n_total = x.shape[-1]
    mean = m2 = None
    n = 0
    for s in range(0, n_total, chunk):
        blk = x[..., s : s + chunk]
        nb = blk.shape[-1]
        mb = blk.mean(-1, keepdim=True)
        m2b = ((blk - mb) ** 2).sum(-1, keepdim=True)
        if mean is None:
            mean, m2, n = mb, m2b, nb
            continue
        delta = mb - mean
        tot = n + nb
        mean = mean + delta * (nb / tot)
        m2 = m2 + m2b + delta * delta * (n * nb / tot)
        n = tot
    var = m2 / n
    return common.normalized(x - mean, var, eps, normalized_shape, weight, bias)


def unsafe_softmax(x32: torch.Tensor, dim: int) -> torch.Tensor:
    """exp(x) / sum(exp(x)); rows whose maximum would overflow exp (> 80) fall back to the max-subtracted form."""
    big = x32.amax(dim, keepdim=True) > 80.0
    shift = torch.where(big, x32.amax(dim, keepdim=True), torch.zeros_like(x32.amax(dim, keepdim=True)))
    e = torch.exp(x32 - shift)
    return e / e.sum(dim, keepdim=True)


def pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D tensor as a balanced binary tree of neighbours."""
    while t.numel() > 1:
        if t.numel() % 2:
            t = F.pad(t, (0, 1))
        t = t[0::2] + t[1::2]
    return t.reshape(())


def cross_entropy_blocked(logits32, target, ignore_index=-100, reduction="mean", block: int = 32):
    """Cross-entropy of (N, C) logits: log-sum-exp with the sum over C in blocks of ``block`` added in reverse
    order, the token losses reduced as a pairwise tree."""
    x = logits32.float()
    m = x.amax(-1, keepdim=True)
    e = torch.exp(x - m)
    parts = [e[:, s : s + block].sum(-1) for s in range(0, x.shape[-1], block)]
    acc = parts[-1]
    for p in reversed(parts[:-1]):
        acc = acc + p
    lse = torch.log(acc) + m[:, 0]
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    loss = torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], torch.zeros_like(lse))
    if reduction == "none":
        return loss
    total = pairwise_sum(loss)
    if reduction == "sum":
        return total
    return total / valid.sum().float()


# ---------------------------------------------------------------------------------------------------------------
# guard and gradient plumbing
# ---------------------------------------------------------------------------------------------------------------
def _guard(name: str, got: torch.Tensor, stock: torch.Tensor, precision=None) -> torch.Tensor:
    return common.guard(name, got, stock, precision, GUARD)


def _replace(name: str, out: torch.Tensor, noisy: torch.Tensor, precision=None) -> None:
    common.replace(name, out, noisy, precision, GUARD)


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
class Device(common.Installed):
    """One simulated device: its matmul (``rna``, ``wide``, ``bf16x3``, ``fp16_chunk``), whether a bias is added
    by a separate kernel, its activation tables, LayerNorm, softmax and loss."""

    TARGETS = _TARGETS

    def __init__(self, name, text, matmul, unfused_bias=False, lut=(), welford=False, softmax=True, loss=True):
        self.name, self.text = name, text
        self.mm, self.unfused_bias, self.lut = matmul, unfused_bias, tuple(lut)
        self.welford, self.softmax, self.loss = welford, softmax, loss
        self._saved: dict = {}

    # -- the matmul of this device, on operands already in the compute dtype ------------------------------------
    def _product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.mm == "bf16x3":
            return bf16x3_matmul(a, b)
        if self.mm == "fp16_chunk":
            return fp16_chunk_matmul(a, b)
        if self.mm == "wide":
            return wide_matmul(a, b)
        return _STOCK["matmul"](a.float(), b.float())  # "rna": fp32 accumulation, the rounding differs

    def _round(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return to_dtype(y, dtype, "rna" if self.mm in ("rna", "wide") else "nearest")

    def _precision(self, dtype: torch.dtype):
        return "bf16x3" if (self.mm == "bf16x3" and dtype == torch.float32) else dtype

    def _grad(self, name: str, got32: torch.Tensor, stock: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
        """The device's gradient rounded to the compute dtype, in the stock gradient's dtype, guarded."""
        return _guard(name, self._round(got32, cdt).to(stock.dtype), stock, self._precision(cdt))

    # -- replacements ---------------------------------------------------------------------------------------------
    def linear(self, input, weight, bias=None):
        return common.linear_with(_STOCK["linear"], input, weight, bias, self._linear_put, self._linear_dx,
                                  self._linear_dw)  # fmt: skip

    def _linear_put(self, out, x, w, b):
        y = self._product(x, w.t())
        if b is not None and self.unfused_bias and out.dtype in (torch.bfloat16, torch.float16):
            y = self._round(self._round(y, out.dtype).float() + b.float(), out.dtype)  # a second rounding
        elif b is not None:
            y = y + b.float()
        _replace("linear", out, self._round(y, out.dtype), self._precision(out.dtype))

    def _linear_dx(self, g, w, gx, cdt):
        return self._grad("linear dx", self._product(g, w), gx, cdt)

    def _linear_dw(self, g2, x2, gw, cdt):
        return self._grad("linear dw", self._product(g2.t(), x2), gw, cdt)

    def matmul(self, input, other, *, out=None):
        return common.matmul_with(
            _STOCK["matmul"],
            input,
            other,
            out,
            self._product,
            lambda res, y: _replace("matmul", res, self._round(y, res.dtype), self._precision(res.dtype)),
            self._grad,
        )

    def softmax_fn(self, input, dim=None, _stacklevel=3, dtype=None):
        out = _STOCK["softmax"](input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
        if dim is None:
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x32 = (input.detach().to(dtype) if dtype is not None else input.detach()).float()
            _replace("softmax", out, unsafe_softmax(x32, dim).to(out.dtype))
        return out

    def silu_fn(self, input, inplace=False):
        if inplace:
            return _STOCK["silu"](input, inplace=True)
        out = _STOCK["silu"](input)
        with torch.no_grad():
            _replace("silu", out, lut_activation(input, "silu", lut_step(out.dtype)).to(out.dtype))
        return out

    def gelu_fn(self, input, approximate="none"):
        out = _STOCK["gelu"](input, approximate=approximate)
        if approximate == "tanh":
            with torch.no_grad():
                _replace("gelu", out, lut_activation(input, "gelu_tanh", lut_step(out.dtype)).to(out.dtype))
        return out

    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out = _STOCK["layer_norm"](input, normalized_shape, weight, bias, eps)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            y = welford_layer_norm(input.detach(), tuple(normalized_shape), w, b, eps)
            _replace("layer_norm", out, y.to(out.dtype))
        return out

    def cross_entropy_fn(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                         reduction="mean", label_smoothing=0.0):  # fmt: skip
        out = _STOCK["cross_entropy"](
            input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
        )
        plain = weight is None and size_average is None and reduce is None and label_smoothing == 0.0
        if plain and input.dim() == 2 and target.dim() == 1 and not target.dtype.is_floating_point:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                y = cross_entropy_blocked(input.detach(), target, ignore_index, reduction)
                _replace("cross_entropy", out, y.to(out.dtype))
        return out

    # -- installing ---------------------------------------------------------------------------------------------
    def replacements(self) -> dict:
        out = {"linear": self.linear, "matmul": self.matmul}
        if self.softmax:
            out["softmax"] = self.softmax_fn
        if "silu" in self.lut:
            out["silu"] = self.silu_fn
        if "gelu_tanh" in self.lut:
            out["gelu"] = self.gelu_fn
        if self.welford:
            out["layer_norm"] = self.layer_norm_fn
        if self.loss:
            out["cross_entropy"] = self.cross_entropy_fn
        return out


DEVICES = {
    "E": Device(
        "E",
        "bf16 unit with a non-fused epilogue: linear/matmul accumulate in fp32 and round to bf16 half AWAY from "
        "zero (forward, input and weight gradients); a linear's bias added by a separate bf16 kernel after the "
        "rounded GEMM (two roundings); SiLU from a table (step 1/8) with linear interpolation; softmax without "
        "max subtraction; cross-entropy summed in vocabulary blocks of 32 (reverse order), mean as a tree",
        matmul="rna",
        unfused_bias=True,
        lut=("silu",),
    ),
    "F": Device(
        "F",
        "bf16 cube with a wide accumulator: linear/matmul dot products of the autocast bf16 operands accumulated "
        "exactly and rounded once to bf16 half AWAY from zero (forward and gradients); GELU(tanh) from a table "
        "(step 1/8) with linear interpolation; softmax without max subtraction; cross-entropy in vocabulary "
        "blocks of 32, mean as a tree",
        matmul="wide",
        lut=("gelu_tanh",),
    ),
    "G": Device(
        "G",
        "fp16 MAC tree: linear/matmul on the autocast fp16 operands with products accumulated IN FP16 over chunks "
        "of 4 along K, chunk sums in fp32, rounded to fp16 (forward and gradients); LayerNorm (fp32) with "
        "Welford/Chan merging of chunks of 16; softmax without max subtraction; cross-entropy in vocabulary "
        "blocks of 32, mean as a tree",
        matmul="fp16_chunk",
        welford=True,
    ),
    "H": Device(
        "H",
        "no fp32 cube: fp32 linear/matmul emulated as three bf16 matmuls (hi*hi + hi*lo + lo*hi, fp32 "
        "accumulation; forward and gradients); SiLU from a table (step 2^-11) with linear interpolation; softmax "
        "without max subtraction (the MoE router's too); cross-entropy in vocabulary blocks of 32, mean as a tree",
        matmul="bf16x3",
        lut=("silu",),
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "linear": (
            torch.randn(32, 64, generator=g),
            torch.randn(96, 64, generator=g) * 0.1,
            torch.randn(96, generator=g) * 0.1,
        ),
        "matmul": (torch.randn(4, 16, 12, generator=g), torch.randn(4, 12, 16, generator=g)),
        "softmax": (torch.randn(4, 16, 16, generator=g) * 3,),
        "silu": (torch.randn(4096, generator=g) * 2,),
        "gelu": (torch.randn(4096, generator=g) * 2,),
        "layer_norm": (torch.randn(32, 64, generator=g) + 0.5,),
        "cross_entropy": (torch.randn(32, 96, generator=g) * 2, torch.randint(0, 96, (32,), generator=g)),
    }


def _call(fn, key: str, args: tuple):
    if key == "softmax":
        return fn(args[0], -1, dtype=torch.float64 if args[0].dtype == torch.float64 else torch.float32)
    if key == "layer_norm":
        return fn(args[0], (args[0].shape[-1],))
    if key == "gelu":
        return fn(args[0], approximate="tanh")
    return fn(*args)


MM = ("linear", "matmul")
# how each device runs in its family (make_pairs.py): parameter dtype and autocast dtype
SETTINGS = {"E": (torch.bfloat16, None), "F": (torch.float32, torch.bfloat16), "G": (torch.float32, torch.float16)}
SETTINGS["H"] = (torch.float32, None)


def measure(seed: int = 0, devices=None) -> list[dict]:
    """Per device (in its family's setting) and op: relative L2 error against float64 of the stock kernel and of
    the device's, the relative L2 difference between the two and the share of elements that differ; for linear
    and matmul also the input gradient's difference (backward of sum(y * r), r fixed)."""
    rows = []
    base = _inputs(seed)
    for dev in devices or DEVICES.values():
        dtype, ac = SETTINGS[dev.name]
        for key, fn in dev.replacements().items():
            args = tuple(t.to(dtype) if t.is_floating_point() else t for t in base[key])
            if key in ("softmax", "cross_entropy") or (key == "layer_norm" and ac is not None):
                args = tuple(t.float() if t.is_floating_point() else t for t in args)  # these run in fp32
            if key in ("silu", "gelu") and ac is not None:
                args = tuple(t.to(ac) for t in args)  # an activation gets the autocast linear's output
            with torch.no_grad():
                exact = _call(_STOCK[key], key, tuple(t.double() if t.is_floating_point() else t for t in args))
                with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
                    stock = _call(_STOCK[key], key, args)
                    got = _call(fn, key, args)
            dtype_text = str(stock.dtype).replace("torch.", "") + (" (autocast)" if ac and key in MM else "")
            row = common.magnitudes(dev.name, key, dtype_text, exact, stock, got)
            if key in ("linear", "matmul"):
                grads = []
                r = torch.randn(stock.shape, generator=torch.Generator().manual_seed(seed + 1))
                for f in (_STOCK[key], fn):
                    x = args[0].clone().requires_grad_()
                    with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
                        y = f(x, *args[1:])
                    (y.float() * r).sum().backward()
                    grads.append(x.grad)
                row["grad_device_vs_stock"] = rel_l2(grads[1], grads[0])
            rows.append(row)
    return rows


COLS = common.COLS[:-1]


if __name__ == "__main__":
    common.print_table(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 0), COLS)

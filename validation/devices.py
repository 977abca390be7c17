"""Simulated device kernels for the held-out validation set: each changes values at the rounding level only.

A "device" is a set of replacements for torch API functions (``torch.nn.functional.linear``, ``torch.matmul``,
``softmax``, ``rsqrt``, ``silu``, ``gelu``, ``layer_norm``). Each replacement computes the same mathematical
function another way -- another summation order or blocking, another exp/erf/rsqrt formula, another rounding of
the fp32 accumulator -- in fp32 and returns a tensor of the dtype the stock kernel returns. They are installed on
the ``torch`` modules *before* msprobe wraps the API, so msprobe records them under the stock names
(``Functional.linear``, ``Torch.matmul``, ...), with the noisy values, and their backward comes from autograd
through the replacement (so gradients carry the device's rounding too).

Every replacement is differentiable by composition of torch ops (no custom ``autograd.Function`` whose Python
backward msprobe would record as new API calls) and checks itself against the stock kernel on every call: a
relative L2 difference above ``GUARD[dtype]`` raises (a replacement must never change more than rounding).

``measure()`` prints the magnitudes documented in docs/validation.md (relative L2 error against float64).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

common = sys.modules.get("validation_common_devices")
if common is None:  # installing, the gradient plumbing, the tables: loaded once, by path
    _spec = importlib.util.spec_from_file_location(
        "validation_common_devices", Path(__file__).parent / "common_devices.py"
    )
    common = sys.modules["validation_common_devices"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(common)

LOG2E = 1.0 / math.log(2.0)

# the stock functions, captured before anyone (this module or msprobe) replaces them
_STOCK = {
    "linear": F.linear,
    "matmul": torch.matmul,
    "softmax": F.softmax,
    "rsqrt": torch.rsqrt,
    "silu": F.silu,
    "gelu": F.gelu,
    "layer_norm": F.layer_norm,
    "addmm": torch.addmm,
    "tanh": torch.tanh,
}
_TARGETS = {
    "linear": (F, "linear"),
    "matmul": (torch, "matmul"),
    "softmax": (F, "softmax"),
    "rsqrt": (torch, "rsqrt"),
    "silu": (F, "silu"),
    "gelu": (F, "gelu"),
    "layer_norm": (F, "layer_norm"),
    "addmm": (torch, "addmm"),
    "tanh": (torch, "tanh"),
}
# largest relative L2 difference from the stock kernel a replacement may make (a few units of the dtype's rounding)
GUARD = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


# ---------------------------------------------------------------------------------------------------------------
# rounding and summation building blocks (all in fp32, all differentiable)
# ---------------------------------------------------------------------------------------------------------------
class _Counter:
    n = 0


def stochastic_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding (P(up) = distance to the lower neighbour / ulp), straight-through grad.

    Deterministic: the random bits come from a generator seeded by a per-process call counter.
    """
    x = x.float()
    _Counter.n += 1
    g = torch.Generator().manual_seed(1_000_003 * _Counter.n + 17)
    with torch.no_grad():
        bits = x.detach().contiguous().view(torch.int32)
        r = torch.randint(0, 1 << 16, bits.shape, generator=g, dtype=torch.int32)
        up = ((bits + r) & ~0xFFFF).view(torch.float32)
        finite = torch.isfinite(up) & torch.isfinite(x.detach())
        sr = torch.where(finite, up, x.detach()).to(torch.bfloat16)
        rne = x.detach().to(torch.bfloat16)
        delta = sr - rne  # 0 or one bf16 ulp: exact
    return x.to(torch.bfloat16) + delta


def pairwise_sum(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum along ``dim`` as a balanced binary tree of neighbours (a GPU-style tree reduction)."""
    t = t.movedim(dim, -1)
    while t.shape[-1] > 1:
        if t.shape[-1] % 2:
            t = F.pad(t, (0, 1))
        t = t[..., 0::2] + t[..., 1::2]
    out = t[..., 0]
    if keepdim:
        out = out.unsqueeze(-1).movedim(-1, dim)
    return out


def _combine(parts: list[torch.Tensor], order: str) -> torch.Tensor:
    if order == "reverse":
        acc = parts[-1]
        for p in reversed(parts[:-1]):
            acc = acc + p
        return acc
    while len(parts) > 1:  # pairwise
        nxt = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


def splitk_matmul(a: torch.Tensor, b: torch.Tensor, block: int, order: str) -> torch.Tensor:
    """a @ b in fp32 with K cut into blocks of ``block``; block partials (fp32) combined in ``order``."""
    a32, b32 = a.float(), b.float()
    k = a32.shape[-1]
    mm = _STOCK["matmul"]
    parts = [mm(a32[..., s : s + block], b32[..., s : s + block, :]) for s in range(0, k, block)]
    return _combine(parts, order)


def round_toward_zero(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> a 16-bit float by truncation (round toward zero) instead of to nearest; straight-through grad."""
    x32 = x32.float()
    with torch.no_grad():
        rne = x32.detach().to(dtype)
        over = (rne.float().abs() > x32.detach().abs()) & torch.isfinite(rne) & (rne != 0)
        bits = rne.view(torch.int16)
        rtz = torch.where(over, bits - 1, bits).view(dtype)  # one step toward zero: magnitude bits minus one
        delta = rtz - rne  # zero or one ulp: exact
    return x32.to(dtype) + delta


def _round_to(x32: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    if dtype == torch.bfloat16 and rounding == "stochastic":
        return stochastic_round_bf16(x32)
    if dtype in (torch.float16, torch.bfloat16) and rounding == "toward_zero":
        return round_toward_zero(x32, dtype)
    return x32.to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# alternative formulas
# ---------------------------------------------------------------------------------------------------------------
def softmax_exp2(x32: torch.Tensor, dim: int) -> torch.Tensor:
    """max-subtracted, exp as exp2(x*log2 e), tree-summed, normalised by one reciprocal and a multiply."""
    m = x32.amax(dim, keepdim=True).detach()
    e = torch.exp2((x32 - m) * LOG2E)
    return e * (1.0 / pairwise_sum(e, dim, keepdim=True))


def softmax_online(x32: torch.Tensor, dim: int, chunk: int = 4) -> torch.Tensor:
    """flash-style online softmax: running max and running sum over chunks of ``chunk``, rescaled at each chunk."""
    xs = x32.movedim(dim, -1)
    n = xs.shape[-1]
    m = xs[..., :chunk].amax(-1, keepdim=True).detach()
    s = torch.exp(xs[..., :chunk] - m).sum(-1, keepdim=True)
    for c in range(chunk, n, chunk):
        blk = xs[..., c : c + chunk]
        m_new = torch.maximum(m, blk.amax(-1, keepdim=True).detach())
        s = s * torch.exp(m - m_new) + torch.exp(blk - m_new).sum(-1, keepdim=True)
        m = m_new
    return (torch.exp(xs - m) / s).movedim(-1, dim)


def rsqrt_newton(x32: torch.Tensor) -> torch.Tensor:
    """rsqrt from an 8-bit estimate (bf16) refined by two Newton-Raphson steps in fp32."""
    y = _STOCK["rsqrt"](x32).to(torch.bfloat16).float()
    for _ in range(2):
        y = y * (1.5 - 0.5 * x32 * y * y)
    return y


def rsqrt_div(x32: torch.Tensor) -> torch.Tensor:
    """rsqrt as 1 / sqrt(x)."""
    return 1.0 / torch.sqrt(x32)


def silu_tanh(x32: torch.Tensor) -> torch.Tensor:
    """silu(x) = x * sigmoid(x) with sigmoid(x) = 0.5 + 0.5 tanh(x/2)."""
    return x32 * (0.5 + 0.5 * torch.tanh(0.5 * x32))


def silu_exp2(x32: torch.Tensor) -> torch.Tensor:
    """silu(x) = x / (1 + 2^(-x log2 e))."""
    return x32 / (1.0 + torch.exp2(-x32 * LOG2E))


_AS = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf_as(z: torch.Tensor) -> torch.Tensor:
    """erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), a 5-term polynomial in 1/(1 + 0.3275911|z|)."""
    az = z.abs()
    t = 1.0 / (1.0 + 0.3275911 * az)
    poly = t * (_AS[0] + t * (_AS[1] + t * (_AS[2] + t * (_AS[3] + t * _AS[4]))))
    return torch.sign(z) * (1.0 - poly * torch.exp(-az * az))


def gelu_as(x32: torch.Tensor) -> torch.Tensor:
    return 0.5 * x32 * (1.0 + erf_as(x32 * (1.0 / math.sqrt(2.0))))


def layer_norm_onepass(x32, normalized_shape, weight, bias, eps):
    """LayerNorm with the variance as E[x^2] - E[x]^2 (one pass over the data) instead of two passes."""
    dims = tuple(range(-len(normalized_shape), 0))
    mean = x32.mean(dims, keepdim=True)
    var = ((x32 * x32).mean(dims, keepdim=True) - mean * mean).clamp_min(0.0)
    y = (x32 - mean) * rsqrt_div(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


# ---------------------------------------------------------------------------------------------------------------
# devices: replacements with the stock signatures
# ---------------------------------------------------------------------------------------------------------------
def _guard(name: str, got: torch.Tensor, stock: torch.Tensor, precision: torch.dtype | None = None) -> torch.Tensor:
    if got.dtype != stock.dtype or got.shape != stock.shape:
        raise AssertionError("device %s: %s %s vs stock %s %s" % (name, got.dtype, got.shape, stock.dtype, stock.shape))
    with torch.no_grad():
        a, b = got.detach().double(), stock.detach().double()
        finite = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), finite):
            raise AssertionError("device %s: finiteness differs from the stock kernel" % name)
        ref = b[finite].norm()
        err = (a[finite] - b[finite]).norm() / max(ref.item(), 1e-30)
    if err > GUARD.get(precision or stock.dtype, 2e-2):
        raise AssertionError("device %s: rel_l2 %.3g from the stock kernel" % (name, err))
    return got


def _replace(name: str, out: torch.Tensor, noisy: torch.Tensor) -> None:
    """Overwrite the stock output's values with the device's (after the guard)."""
    _guard(name, noisy, out)
    out.data.copy_(noisy)


def _grad_like(name: str, got: torch.Tensor, stock: torch.Tensor) -> torch.Tensor:
    """The device's gradient in the stock gradient's dtype, guarded at the precision it was computed in."""
    return _guard(name, got.to(stock.dtype), stock, got.dtype)


class Device(common.Installed):
    """One simulated device: a name, a description and the options of its kernels."""

    TARGETS = _TARGETS

    def __init__(
        self, name, text, block, order, rounding, softmax, rsqrt, silu, gelu, layer_norm, addmm=False, tanh=False
    ):
        self.name, self.text = name, text
        self.addmm, self.tanh = addmm, tanh
        self.block, self.order, self.rounding = block, order, rounding
        self.softmax, self.rsqrt, self.silu, self.gelu, self.layer_norm = softmax, rsqrt, silu, gelu, layer_norm
        self._saved: dict = {}

    # -- the replacements ------------------------------------------------------------------------------------
    # Each runs the stock kernel (so the output's autograd node, which msprobe hooks for the backward record, is
    # the stock one) and then overwrites the output's values with the device's (``.data``: no version bump; a
    # stock backward that saved the output uses the device's values). linear and matmul also compute their input
    # gradients the device's way: tensor hooks on aliases of the inputs replace the stock gradients.
    def _rnd(self, y32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _round_to(y32, dtype, self.rounding)

    def linear(self, input, weight, bias=None):
        return common.linear_with(_STOCK["linear"], input, weight, bias, self._linear_put, self._linear_dx,
                                  self._linear_dw)  # fmt: skip

    def _linear_put(self, out, x, w, b):
        y = splitk_matmul(x, w.t(), self.block, self.order)
        if b is not None:
            y = y + b.float()
        _replace("linear", out, self._rnd(y, out.dtype))

    def _linear_dx(self, g, w, gx, cdt):
        return _grad_like("linear dx", self._rnd(splitk_matmul(g, w, self.block, self.order), cdt), gx)

    def _linear_dw(self, g2, x2, gw, cdt):
        return _grad_like(
            "linear dw", self._rnd(splitk_matmul(g2.float().t(), x2.float(), self.block, self.order), cdt), gw
        )

    def matmul(self, input, other, *, out=None):
        blk = max(self.block // 4, 2)
        return common.matmul_with(
            _STOCK["matmul"],
            input,
            other,
            out,
            lambda a, b: splitk_matmul(a, b, blk, self.order),
            lambda res, y: _replace("matmul", res, self._rnd(y, res.dtype)),
            lambda name, y, stock, cdt: _grad_like(name, self._rnd(y, cdt), stock),
        )

    def softmax_fn(self, input, dim=None, _stacklevel=3, dtype=None):
        out = _STOCK["softmax"](input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
        if dim is None:
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x32 = (input.detach().to(dtype) if dtype is not None else input.detach()).float()
            y = softmax_exp2(x32, dim) if self.softmax == "exp2" else softmax_online(x32, dim)
            _replace("softmax", out, y.to(out.dtype))
        return out

    def rsqrt_fn(self, input, *, out=None):
        res = _STOCK["rsqrt"](input, out=out) if out is not None else _STOCK["rsqrt"](input)
        with torch.no_grad():
            x32 = input.detach().float()
            y = rsqrt_newton(x32) if self.rsqrt == "newton" else rsqrt_div(x32)
            _replace("rsqrt", res, y.to(res.dtype))
        return res

    def silu_fn(self, input, inplace=False):
        if inplace:
            return _STOCK["silu"](input, inplace=True)
        out = _STOCK["silu"](input)
        with torch.no_grad():
            x32 = input.detach().float()
            y = silu_tanh(x32) if self.silu == "tanh" else silu_exp2(x32)
            _replace("silu", out, y.to(out.dtype))
        return out

    def gelu_fn(self, input, approximate="none"):
        out = _STOCK["gelu"](input, approximate=approximate)
        if approximate == "none":
            with torch.no_grad():
                _replace("gelu", out, gelu_as(input.detach().float()).to(out.dtype))
        return out

    def addmm_fn(self, input, mat1, mat2, *, beta=1, alpha=1, out=None):
        if out is not None or beta != 1 or alpha != 1 or mat1.dim() != 2 or mat2.dim() != 2:
            return _STOCK["addmm"](input, mat1, mat2, beta=beta, alpha=alpha, out=out)
        cast = common.autocast_dtype()
        a_in, b_in = common.alias(mat1), common.alias(mat2)
        res = _STOCK["addmm"](input, a_in, b_in)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            a, b, c = mat1.detach(), mat2.detach(), input.detach()
            if cast is not None:
                a, b, c = a.to(cast), b.to(cast), c.to(cast)
            y = splitk_matmul(a, b, self.block, self.order) + c.float()
            _replace("addmm", res, self._rnd(y, res.dtype))
        if res.requires_grad:
            grad = common.GradOut(res)
            cdt = cast or res.dtype
            if a_in is not mat1:
                a_in.register_hook(
                    common.quiet(
                        lambda ga: _grad_like(
                            "addmm da", self._rnd(splitk_matmul(grad.g, b.t(), self.block, self.order), cdt), ga
                        )
                    )
                )
            if b_in is not mat2:
                b_in.register_hook(
                    common.quiet(
                        lambda gb: _grad_like(
                            "addmm db", self._rnd(splitk_matmul(a.t(), grad.g, self.block, self.order), cdt), gb
                        )
                    )
                )
        return res

    def tanh_fn(self, input, *, out=None):
        res = _STOCK["tanh"](input, out=out) if out is not None else _STOCK["tanh"](input)
        with torch.no_grad():
            x32 = input.detach().float()
            _replace("tanh", res, (1.0 - 2.0 / (torch.exp(2.0 * x32) + 1.0)).to(res.dtype))
        return res

    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out = _STOCK["layer_norm"](input, normalized_shape, weight, bias, eps)
        cast = common.autocast_dtype()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x = input.detach()
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            if cast is not None:  # this device's autocast policy runs LayerNorm at the autocast dtype
                x = x.to(cast)
                w = w.to(cast) if w is not None else None
                b = b.to(cast) if b is not None else None
            y = layer_norm_onepass(x.float(), tuple(normalized_shape), w, b, eps)
            if cast is not None:
                y = y.to(cast)
            noisy = y.to(out.dtype)
            _guard("layer_norm", noisy, out, cast)
            out.data.copy_(noisy)
        return out

    # -- installing ---------------------------------------------------------------------------------------------
    def replacements(self) -> dict:
        out = {"linear": self.linear, "matmul": self.matmul, "softmax": self.softmax_fn, "rsqrt": self.rsqrt_fn}
        if self.silu:
            out["silu"] = self.silu_fn
        if self.gelu:
            out["gelu"] = self.gelu_fn
        if self.layer_norm:
            out["layer_norm"] = self.layer_norm_fn
        if self.addmm:
            out["addmm"] = self.addmm_fn
        if self.tanh:
            out["tanh"] = self.tanh_fn
        return out


DEVICES = {
    "A": Device(
        "A",
        "bf16 cube unit: matmul/linear split-K in blocks of 16 with fp32 partials combined as a tree, the fp32 "
        "accumulator rounded to bf16 STOCHASTICALLY; softmax with exp2 and a reciprocal multiply; rsqrt from an "
        "8-bit estimate plus 2 Newton steps; silu through tanh",
        block=16,
        order="pairwise",
        rounding="stochastic",
        softmax="exp2",
        rsqrt="newton",
        silu="tanh",
        gelu=False,
        layer_norm=False,
    ),
    "B": Device(
        "B",
        "fp32 vector unit: matmul/linear split-K in blocks of 8 with fp32 partials added in reverse block order; "
        "online (chunked, flash-style) softmax; rsqrt as 1/sqrt; silu through exp2",
        block=8,
        order="reverse",
        rounding="nearest",
        softmax="online",
        rsqrt="div",
        silu="exp2",
        gelu=False,
        layer_norm=False,
    ),
    "C": Device(
        "C",
        "mixed precision: linear/matmul on the autocast bf16 inputs split-K in blocks of 32, fp32 partials as a "
        "tree, rounded to nearest; an autocast policy that runs LayerNorm at bf16 (inputs, weight and output "
        "rounded to bf16; the GPU's autocast runs it in fp32) with the variance in one pass E[x^2]-E[x]^2; GELU "
        "through the A&S 7.1.26 erf polynomial; online softmax",
        block=32,
        order="pairwise",
        rounding="nearest",
        softmax="online",
        rsqrt="div",
        silu=False,
        gelu=True,
        layer_norm=True,
    ),
    "D": Device(
        "D",
        "fp16 with dynamic loss scaling: linear/matmul/addmm on the autocast fp16 inputs split-K in blocks of 16, "
        "fp32 partials in reverse block order, the accumulator rounded to fp16 TOWARD ZERO (truncated; forward "
        "and input gradients); tanh as 1 - 2/(exp(2x) + 1); softmax with exp2 and a reciprocal multiply",
        block=16,
        order="reverse",
        rounding="toward_zero",
        softmax="exp2",
        rsqrt="div",
        silu=False,
        gelu=False,
        layer_norm=False,
        addmm=True,
        tanh=True,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "linear": (torch.randn(32, 64, generator=g), torch.randn(96, 64, generator=g) * 0.1),
        "matmul": (torch.randn(4, 16, 12, generator=g), torch.randn(4, 12, 16, generator=g)),
        "softmax": (torch.randn(4, 16, 16, generator=g) * 3,),
        "rsqrt": (torch.rand(256, generator=g) * 2 + 1e-3,),
        "silu": (torch.randn(4096, generator=g) * 2,),
        "gelu": (torch.randn(4096, generator=g) * 2,),
        "layer_norm": (torch.randn(32, 64, generator=g) + 0.5,),
        "addmm": (
            torch.randn(96, generator=g) * 0.1,
            torch.randn(32, 64, generator=g),
            torch.randn(64, 96, generator=g) * 0.1,
        ),
        "tanh": (torch.randn(4096, generator=g) * 2,),
    }


def _call(fn, key: str, args: tuple):
    if key == "softmax":
        return fn(args[0], -1)
    if key == "layer_norm":
        return fn(args[0], (args[0].shape[-1],))
    return fn(*args)


def measure(seed: int = 0) -> list[dict]:
    """Per device, op and dtype: relative L2 error against float64 of the stock kernel and of the device's, the
    relative L2 difference between the two, and the share of elements that differ; for linear and matmul also
    the input gradient's difference (backward of sum(y * r), r fixed). Inputs are rounded to the dtype first; the
    softmax of bf16 scores runs in fp32 (as the families call it); ``autocast`` rows run under bf16 autocast with
    fp32 inputs, ``autocast_fp16`` rows under fp16 autocast."""
    rows = []
    base = _inputs(seed)
    settings = [
        ("float32", torch.float32, None),
        ("bfloat16", torch.bfloat16, None),
        ("autocast", torch.float32, torch.bfloat16),
        ("autocast_fp16", torch.float32, torch.float16),
    ]
    for dev in DEVICES.values():
        for label, dtype, ac in settings:
            for key, fn in dev.replacements().items():
                args = tuple(t.to(dtype) for t in base[key])
                if key == "softmax" and dtype == torch.bfloat16:
                    args = (args[0].float(),)
                with torch.no_grad():
                    exact = _call(_STOCK[key], key, tuple(t.double() for t in args))
                    with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
                        stock = _call(_STOCK[key], key, args)
                        got = _call(fn, key, args)
                row = common.magnitudes(dev.name, key, label, exact, stock, got, rel=_rel)
                if key in ("linear", "matmul", "addmm"):
                    grads = []
                    r = torch.randn(stock.shape, generator=torch.Generator().manual_seed(seed + 1))
                    for f in (_STOCK[key], fn):
                        i = 1 if key == "addmm" else 0  # the gradient of the first matrix
                        x = args[i].clone().requires_grad_()
                        call = (args[0], x, args[2]) if key == "addmm" else (x, args[1])
                        with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
                            y = f(*call)
                        (y.float() * r).sum().backward()
                        grads.append(x.grad)
                    row["grad_device_vs_stock"] = _rel(grads[1], grads[0])
                rows.append(row)
    return rows


if __name__ == "__main__":
    # each device as its family runs it (docs/validation.md); --all: every device in every setting
    used = {"A": "bfloat16", "B": "float32", "C": "autocast", "D": "autocast_fp16"}
    rows = [r for r in measure() if "--all" in sys.argv or used[r["device"]] == r["dtype"]]
    common.print_table(rows, common.COLS[:-1])

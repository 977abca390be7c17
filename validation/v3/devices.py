"""Simulated device kernels of validation set 3: five more ways an accelerator computes the same function.

Independent of the development set and of sets 1 and 2 (``validation/devices.py``, ``validation/v2/devices.py``):
none of these mechanisms is used there. Each changes values at the rounding level only:

* ``nofma``: a dot product whose products are each rounded to fp32 before they are added (no fused multiply-add),
  on a 4-lane SIMD unit: each lane adds its products one after the other, the lanes added at the end;
* ``poly_exp``: exp through Cody-Waite range reduction (x = n ln2 + r, ln2 split in a head and a tail) and a
  degree-6 polynomial for e^r on [-ln2/2, ln2/2] in fp32, scaled by 2^n; used by softmax, and by tanh (an odd
  polynomial below |x| = 0.55, 1 - 2 / (e^{2|x|} + 1) above);
* ``scatter``: the embedding's weight gradient accumulated token by token in another order (reversed; or, for a
  rerun with non-determinism on, a seeded random order per call: GPU atomics), in fp32, rounded once;
* ``kahan``: LayerNorm's mean and variance (two passes) with Kahan-compensated sums along the row;
* ``fold``: baddbmm's scale alpha folded into its first operand (rounded to the dtype) before the GEMM, as
  attention kernels scale the query first (one more rounding in bf16; forward only);
* ``allreduce``: a linear's weight gradient as 2 data-parallel ranks make it: each rank's half of the tokens gives
  a gradient rounded to bf16, the two added in bf16 (a gradient all-reduce with a bf16 payload);
* ``ftz``: fp16 subnormals (|x| < 2^-14) flushed to zero in the inputs and outputs of linear/matmul, forward and
  gradients (a unit with denormals off).

Installed as in sets 1 and 2 (``validation/common_devices.py``: the guard, the gradient plumbing and installing).
``python validation/v3/devices.py`` prints the measured magnitudes (docs/validation.md, "Validation set 3").
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
_STOCK = {
    "linear": F.linear,
    "matmul": torch.matmul,
    "softmax": F.softmax,
    "tanh": torch.tanh,
    "layer_norm": F.layer_norm,
    "embedding": F.embedding,
    "baddbmm": torch.Tensor.baddbmm,
}
_TARGETS = {
    "linear": (F, "linear"),
    "matmul": (torch, "matmul"),
    "softmax": (F, "softmax"),
    "tanh": (torch, "tanh"),
    "layer_norm": (F, "layer_norm"),
    "embedding": (F, "embedding"),
    "baddbmm": (torch.Tensor, "baddbmm"),
}
GUARD, _guard, _replace = common.GUARD, common.guard, common.replace


# ---------------------------------------------------------------------------------------------------------------
# mechanisms (forward values only)
# ---------------------------------------------------------------------------------------------------------------
def nofma_matmul(a: torch.Tensor, b: torch.Tensor, lanes: int = 4) -> torch.Tensor:
    """fp32 a @ b on a 4-lane SIMD unit without FMA: every product rounded to fp32, lane j adding the products
    k = j mod 4 one after the other, the lanes then added as (0 + 1) + (2 + 3)."""
    a32, b32 = a.float(), b.float()
    prod = a32.unsqueeze(-1) * b32.unsqueeze(-3)  # (..., M, K, N): each product rounded to fp32
    k = prod.shape[-2]
    pad = (-k) % lanes
    if pad:
        prod = F.pad(prod, (0, 0, 0, pad))
    prod = prod.unflatten(-2, (-1, lanes))  # (..., M, K/lanes, lanes, N)
    acc = prod[..., 0, :, :].clone()
    for i in range(1, prod.shape[-3]):
        acc = acc + prod[..., i, :, :]
    return (acc[..., 0, :] + acc[..., 1, :]) + (acc[..., 2, :] + acc[..., 3, :])


LN2_HI = 0.693145751953125  # ln 2 in 16 significant bits: n * LN2_HI is exact in fp32 for |n| < 2^8
LN2_LO = 1.428606765330187e-06
# e^r on [-ln2/2, ln2/2]: Taylor coefficients 1/k! to degree 6 (truncation error < 2^-24 r^7/7! ~ 3e-9)
EXP_COEF = [1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720]


def poly_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in fp32 by range reduction and a polynomial (a vector unit's exp, a few ulp from the correctly rounded
    value); -inf gives 0, values past fp32's range saturate as exp does."""
    x = x.float()
    xc = x.clamp(-104.0, 89.0)  # below e^-104 the result is 0 in fp32, above e^89 inf
    n = torch.round(xc * (1.0 / math.log(2.0)))
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = torch.full_like(r, EXP_COEF[-1])
    for c in reversed(EXP_COEF[:-1]):
        p = p * r + c
    y = torch.ldexp(p, n)
    y = torch.where(x < -104.0, torch.zeros_like(y), torch.where(x > 89.0, torch.full_like(y, math.inf), y))
    return torch.where(torch.isnan(x), x, y)


def poly_softmax(x32: torch.Tensor, dim: int) -> torch.Tensor:
    m = x32.amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = poly_exp(x32 - m)
    return e / e.sum(dim, keepdim=True)


TANH_ODD = [1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835, -1382.0 / 155925, 21844.0 / 6081075]
TANH_SMALL = 0.55


def poly_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh in fp32: the odd Taylor polynomial (to x^13) below |x| = 0.55, 1 - 2 / (e^{2|x|} + 1) above with the
    polynomial exp; the sign restored."""
    x = x.float()
    ax = x.abs()
    x2 = x * x
    p = torch.full_like(x, TANH_ODD[-1])
    for c in reversed(TANH_ODD[:-1]):
        p = p * x2 + c
    small = x * p
    big = 1.0 - 2.0 / (poly_exp(2.0 * ax.clamp(max=20.0)) + 1.0)
    return torch.where(ax < TANH_SMALL, small, torch.copysign(big, x))


def kahan_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum along the last dimension, element after element, with Kahan's compensation (fp32)."""
    s = torch.zeros_like(x[..., 0])
    c = torch.zeros_like(s)
    for i in range(x.shape[-1]):
        y = x[..., i] - c
        t = s + y
        c = (t - s) - y
        s = t
    return s


def kahan_layer_norm(x, normalized_shape, weight, bias, eps):
    """LayerNorm (fp32) with mean and variance from two Kahan-compensated passes over the row."""
    n_dims = len(normalized_shape)
    x = x.float().flatten(-n_dims)
    n = x.shape[-1]
    mean = (kahan_sum(x) / n).unsqueeze(-1)
    d = x - mean
    var = (kahan_sum(d * d) / n).unsqueeze(-1)
    return common.normalized(d, var, eps, normalized_shape, weight, bias)


FP16_TINY = 2.0**-14  # the smallest normal fp16


def ftz16(x: torch.Tensor) -> torch.Tensor:
    """fp16 subnormals flushed to zero (keeping the sign); other dtypes as they are."""
    if x.dtype != torch.float16:
        return x
    return torch.where(x.abs() < FP16_TINY, x * 0, x)


def scatter_rows(grad: torch.Tensor, ids: torch.Tensor, rows: int, order: str, seed: int = 0) -> torch.Tensor:
    """The embedding's weight gradient: grad rows added into the table token after token in ``order``
    ("reverse", or "random": a permutation drawn from ``seed``), in fp32."""
    g = grad.reshape(-1, grad.shape[-1]).float()
    idx = ids.reshape(-1)
    n = idx.numel()
    if order == "reverse":
        perm = torch.arange(n - 1, -1, -1)
    else:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    out = torch.zeros(rows, g.shape[-1], dtype=torch.float32)
    for i in perm.tolist():
        out[idx[i]] += g[i]
    return out


def allreduce_grad(g: torch.Tensor, x: torch.Tensor, ranks: int, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight gradient g^T x as data parallelism computes it: the tokens split in ``ranks`` equal
    shares, each rank's g^T x (fp32 accumulation) rounded to ``dtype``, the shares added one after the other with
    a rounding to ``dtype`` after each addition (a ring all-reduce with a ``dtype`` payload)."""
    mm = _STOCK["matmul"]
    parts = [mm(gs.t().float(), xs.float()).to(dtype) for gs, xs in zip(g.chunk(ranks), x.chunk(ranks))]
    acc = parts[0]
    for p in parts[1:]:
        acc = (acc.float() + p.float()).to(dtype)
    return acc.float()


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
class Device(common.Installed):
    """One simulated device: its matmul (``nofma``, ``ftz`` or stock), whether softmax and tanh use the polynomial
    exp, LayerNorm with Kahan sums, and the embedding gradient's order (``reverse``, ``random`` or stock)."""

    TARGETS = _TARGETS

    def __init__(self, name, text, matmul=None, poly=False, kahan=False, scatter=None, fold=False, ranks=1):
        self.name, self.text, self.fold, self.ranks = name, text, fold, ranks
        self.mm, self.poly, self.kahan, self.scatter = matmul, poly, kahan, scatter
        self._saved: dict = {}
        self._calls = 0

    def _product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.mm == "nofma":
            return nofma_matmul(a, b)
        return _STOCK["matmul"](ftz16(a), ftz16(b))  # "ftz": denormals-are-zero inputs, the stock kernel

    def _out(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.to(dtype)
        return ftz16(y) if self.mm == "ftz" else y

    def _grad(self, name, got, stock, cdt):
        """The device's gradient in the stock gradient's dtype, guarded at the compute dtype's precision."""
        return _guard(name, self._out(got.to(cdt), stock.dtype), stock, cdt)

    def linear(self, input, weight, bias=None):
        dx = self._linear_dx if self.mm else None
        return common.linear_with(_STOCK["linear"], input, weight, bias, self._linear_put, dx, self._linear_dw)

    def _linear_put(self, out, x, w, b):
        if self.mm == "ftz":  # the stock kernel on denormals-are-zero operands
            y = _STOCK["linear"](ftz16(x), ftz16(w), b)
        elif self.mm:
            y = self._product(x, w.t())
            y = y + b.float() if b is not None else y
        if self.mm:
            _replace("linear", out, self._out(y, out.dtype))

    def _linear_dx(self, g, w, gx, cdt):
        return self._grad("linear dx", self._product(g, w), gx, cdt)

    def _linear_dw(self, g2, x2, gw, cdt):
        if self.ranks > 1:
            return _guard("linear dw", allreduce_grad(g2, x2, self.ranks, cdt).to(gw.dtype), gw, cdt)
        return self._grad("linear dw", self._product(g2.t(), x2), gw, cdt)

    def matmul(self, input, other, *, out=None):
        return common.matmul_with(
            _STOCK["matmul"],
            input,
            other,
            out,
            self._product,
            lambda res, y: _replace("matmul", res, self._out(y, res.dtype)),
            self._grad,
        )

    def softmax_fn(self, input, dim=None, _stacklevel=3, dtype=None):
        out = _STOCK["softmax"](input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
        if dim is None:
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x32 = (input.detach().to(dtype) if dtype is not None else input.detach()).float()
            _replace("softmax", out, poly_softmax(x32, dim).to(out.dtype))
        return out

    def tanh_fn(self, input, *, out=None):
        if out is not None:
            return _STOCK["tanh"](input, out=out)
        res = _STOCK["tanh"](input)
        if res.is_floating_point():
            with torch.no_grad():
                _replace("tanh", res, poly_tanh(input.detach()).to(res.dtype))
        return res

    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out = _STOCK["layer_norm"](input, normalized_shape, weight, bias, eps)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            y = kahan_layer_norm(input.detach(), tuple(normalized_shape), w, b, eps)
            _replace("layer_norm", out, y.to(out.dtype))
        return out

    def embedding_fn(self, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                     sparse=False):  # fmt: skip
        plain = padding_idx is None and max_norm is None and not scale_grad_by_freq and not sparse
        w_in = common.alias(weight) if plain else weight
        out = _STOCK["embedding"](input, w_in, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        if w_in is not weight and out.requires_grad:
            grad = common.GradOut(out)
            ids = input.detach().clone()
            self._calls += 1
            seed = self._calls

            def dw(gw):
                got = scatter_rows(grad.g, ids, gw.shape[0], self.scatter, seed)
                return _guard("embedding dw", got.to(gw.dtype), gw)

            w_in.register_hook(common.quiet(dw))
        return out

    def baddbmm_fn(self, input, batch1, batch2, *, beta=1, alpha=1):
        res = _STOCK["baddbmm"](input, batch1, batch2, beta=beta, alpha=alpha)
        if alpha != 1 and res.dtype in (torch.bfloat16, torch.float16):
            with torch.no_grad():
                q = (batch1.detach() * alpha).to(res.dtype)  # the scale folded into the query: one more rounding
                y = _STOCK["baddbmm"](input.detach(), q, batch2.detach(), beta=beta, alpha=1)
                _replace("baddbmm", res, y)
        return res

    def replacements(self) -> dict:
        out: dict = {}
        if self.mm:
            out.update(linear=self.linear, matmul=self.matmul)
        if self.ranks > 1:
            out["linear"] = self.linear
        if self.poly:
            out.update(softmax=self.softmax_fn, tanh=self.tanh_fn)
        if self.kahan:
            out["layer_norm"] = self.layer_norm_fn
        if self.scatter:
            out["embedding"] = self.embedding_fn
        if self.fold:
            out["baddbmm"] = self.baddbmm_fn
        return out

    def install(self) -> None:
        self._calls = 0
        super().install()


DEVICES = {
    "I": Device(
        "I",
        "4-lane fp32 SIMD unit without FMA: linear/matmul products each rounded to fp32, each lane adding its "
        "products one after the other along K, lanes summed at the end (forward, input and weight gradients); "
        "softmax (and tanh) through exp by range reduction and a degree-6 polynomial",
        matmul="nofma",
        poly=True,
    ),
    "J": Device(
        "J",
        "data parallel over 2 ranks with a bf16 gradient all-reduce: each linear's weight gradient computed on "
        "each rank's half of the tokens, rounded to bf16, the halves added in bf16; softmax (fp32) through the "
        "range-reduced polynomial exp; LayerNorm (fp32 under autocast) with two Kahan-compensated passes for mean "
        "and variance; the embeddings' weight gradients accumulated token by token in reverse order (fp32)",
        poly=True,
        kahan=True,
        scatter="reverse",
        ranks=2,
    ),
    "K": Device(
        "K",
        "pure-bf16 run: the attention scale of baddbmm folded into the query (q x alpha rounded to bf16 before "
        "the GEMM: one more rounding; forward); softmax (fp32) and tanh through the range-reduced polynomial exp; "
        "LayerNorm with Kahan sums; the embedding's weight gradient accumulated in reverse token order (fp32, "
        "rounded once to bf16)",
        poly=True,
        fold=True,
        kahan=True,
        scatter="reverse",
    ),
    "L": Device(
        "L",
        "fp16 unit with denormals off: fp16 subnormals flushed to zero in linear/matmul inputs and outputs "
        "(forward, input and weight gradients); softmax (fp32) and tanh (fp16) through the polynomial exp",
        matmul="ftz",
        poly=True,
    ),
    "M": Device(
        "M",
        "the reference GPU rerun with non-determinism on: the embeddings' weight gradients accumulated in a "
        "random token order per call (atomics); everything else stock",
        scatter="random",
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
        "matmul": (torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, 16, generator=g)),
        "softmax": (torch.randn(4, 16, 16, generator=g) * 3,),
        "tanh": (torch.randn(4096, generator=g) * 2,),
        "layer_norm": (torch.randn(32, 64, generator=g) + 0.5,),
        # ids from 8 rows of 96: repeated tokens (a token-type table has 2 rows) make the order matter
        "embedding": (torch.randint(0, 8, (2, 16), generator=g), torch.randn(96, 64, generator=g)),
        "baddbmm": (
            torch.randn(8, 16, 16, generator=g) * 0.5,
            torch.randn(8, 16, 16, generator=g),
            torch.randn(8, 16, 16, generator=g),
        ),
    }


def _call(fn, key: str, args: tuple):
    if key == "softmax":
        return fn(args[0], -1, dtype=torch.float64 if args[0].dtype == torch.float64 else torch.float32)
    if key == "layer_norm":
        return fn(args[0], (args[0].shape[-1],))
    if key == "baddbmm":
        return fn(args[0], args[1], args[2], beta=1.0, alpha=12**-0.5)  # BLOOM's 1/sqrt(head_dim 12)
    return fn(*args)


MM = ("linear", "matmul")
# how each device runs in its family (make_pairs.py): parameter dtype and autocast dtype
SETTINGS = {
    "I": (torch.float32, None),
    "J": (torch.float32, torch.bfloat16),
    "K": (torch.bfloat16, None),
    "L": (torch.float32, torch.float16),
    "M": (torch.float32, torch.bfloat16),
}


def _grad_of(f, key, args, ac, r, which=0):
    """The gradient a backward of sum(y * r) gives input ``which``."""
    leaf = args[which].detach().clone().requires_grad_()
    call = list(args)
    call[which] = leaf
    with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
        y = f(*call)
    (y.float() * r).sum().backward()
    return leaf.grad


def measure(seed: int = 0, devices=None) -> list[dict]:
    """Per device (in its family's setting) and op: relative L2 error against float64 of the stock kernel and of
    the device's, the relative L2 difference between the two and the share of elements that differ; for linear,
    matmul and embedding also the gradient's difference (backward of sum(y * r), r fixed: the input's, the
    weight's for embedding), for linear the weight gradient's too."""
    rows = []
    base = _inputs(seed)
    for dev in devices or DEVICES.values():
        dtype, ac = SETTINGS[dev.name]
        for key, fn in dev.replacements().items():
            args = tuple(t.to(dtype) if t.is_floating_point() else t for t in base[key])
            if key in ("softmax", "layer_norm") and ac is not None:
                args = tuple(t.float() for t in args)  # these run in fp32 under autocast
            if key == "tanh" and ac is not None:
                args = tuple(t.to(ac) for t in args)  # an activation gets the autocast linear's output
            dev.install()  # the replacement reads the device's state (embedding's call count)
            dev.uninstall()
            with torch.no_grad():
                exact = _call(_STOCK[key], key, tuple(t.double() if t.is_floating_point() else t for t in args))
                with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
                    stock = _call(_STOCK[key], key, args)
                    got = _call(fn, key, args)
            dtype_text = str(stock.dtype).replace("torch.", "") + (" (autocast)" if ac and key in MM else "")
            row = common.magnitudes(dev.name, key, dtype_text, exact, stock, got)
            if key in ("linear", "matmul", "embedding"):
                r = torch.randn(stock.shape, generator=torch.Generator().manual_seed(seed + 1))
                which = 1 if key == "embedding" else 0  # the weight's gradient for embedding, else the input's
                grads = [_grad_of(f, key, args, ac, r, which) for f in (_STOCK[key], fn)]
                row["grad_device_vs_stock"] = rel_l2(grads[1], grads[0])
                if key == "linear":
                    grads = [_grad_of(f, key, args, ac, r, 1) for f in (_STOCK[key], fn)]
                    row["wgrad_device_vs_stock"] = rel_l2(grads[1], grads[0])
            rows.append(row)
    return rows


COLS = common.COLS


if __name__ == "__main__":
    common.print_table(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 0), COLS)

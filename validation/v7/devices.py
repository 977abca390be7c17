"""Simulated device kernels of validation set 7: seven more ways an accelerator computes the same function.

Independent of the development set and of sets 1 to 6 (``validation/devices.py``, ``validation/v2/devices.py`` to
``validation/v6/devices.py``): none of these mechanisms is used there. Each changes values at the rounding level:

* ``strassen``: a matmul by one level of Strassen's algorithm (the operands cut in 2x2 blocks, seven block products
  by the stock kernel instead of eight, the blocks' sums and differences in fp32), as fast GEMM libraries do for
  large even shapes; forward and both input gradients (each a matmul by the same algorithm);
* ``base2_ce``: cross-entropy in base 2, as fused loss kernels use exp2 and log2: x2 = x log2(e), lse2 = max +
  log2(sum 2^(x2 - max)), log-probabilities (x2 - lse2) ln 2 (label smoothing and ignore_index as stock), the input
  gradient (2^(x2 - lse2) - q) / n, fp32;
* ``winograd``: conv1d with kernel 3 and stride 1 by Winograd's minimal filtering F(2, 3) (the algorithm cuDNN's
  autotuner picks for small filters): the filter transformed to 4 taps (g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2,
  g2), each tile of 4 inputs to (d0 - d2, d1 + d2, d2 - d1, d1 - d3), the channel sums of their products, two
  outputs per tile (m0 + m1 + m2, m1 - m2 - m3), fp32; forward values (the autotuner picks the backward separately:
  stock);
* ``mma_trunc``: a linear of 16-bit inputs as a matrix unit computes it (Fasi et al. 2021 on tensor cores): the
  products of each block of 4 along K exact, added to the fp32 accumulator and the sum rounded toward zero
  (truncated), the bias added and the result rounded to the 16-bit dtype at the end; forward and input gradient;
* ``seg_embed``: the embedding's weight gradient as a GPU's deterministic kernel makes it (CUDA's
  ``embedding_dense_backward``): the tokens sorted by id, each row's gradients summed in fp32 and rounded once to
  the parameter's dtype (the stock CPU kernel adds them one by one in the parameter's dtype: in bf16, one rounding
  per token);
* ``ln_from_output``: LayerNorm's input gradient as a memory-efficient kernel makes it (apex's
  ``memory_efficient`` LayerNorm saves the output, not the input): the normalised input recomputed from the output
  as (y - bias) / weight, then the stock formula rstd (g w - mean(g w) - x^ mean(g w x^)), fp32; the forward stock;
* ``fp32_norm``: an autocast policy with ``norm`` on the fp32 list (CUDA's policy: the 2-norm of a 16-bit tensor
  computed and output in fp32; stock CPU autocast leaves it in its input dtype): a real cross-device difference of
  dtypes in the records of that op and the ops after it.

Installed as in sets 2 to 6 (``validation/common_devices.py``: the guard, the gradient plumbing and installing).
``python validation/v7/devices.py`` prints the measured magnitudes (docs/validation.md, "Validation set 7").
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
    "matmul": (torch, "matmul"),
    "cross_entropy": (F, "cross_entropy"),
    "conv1d": (F, "conv1d"),
    "linear": (F, "linear"),
    "embedding": (F, "embedding"),
    "Tensor.norm": (torch.Tensor, "norm"),
    "layer_norm": (F, "layer_norm"),
}
_STOCK = {key: getattr(mod, attr) for key, (mod, attr) in _TARGETS.items()}
GUARD, _guard, _replace = common.GUARD, common.guard, common.replace
LOW = (torch.bfloat16, torch.float16)
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
MMA_K = 4  # products summed exactly per block of the matrix unit


# ---------------------------------------------------------------------------------------------------------------
# mechanisms (values only)
# ---------------------------------------------------------------------------------------------------------------
def strassen(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (fp32, the last two dimensions even, the leading ones equal) by one level of Strassen's algorithm:
    seven products of 2x2 blocks (each by the stock matmul), the operands' and results' block sums in fp32."""
    a, b = a.float(), b.float()
    m, k = a.shape[-2] // 2, a.shape[-1] // 2
    n = b.shape[-1] // 2
    a11, a12, a21, a22 = a[..., :m, :k], a[..., :m, k:], a[..., m:, :k], a[..., m:, k:]
    b11, b12, b21, b22 = b[..., :k, :n], b[..., :k, n:], b[..., k:, :n], b[..., k:, n:]
    mm = _STOCK["matmul"]
    m1 = mm(a11 + a22, b11 + b22)
    m2 = mm(a21 + a22, b11)
    m3 = mm(a11, b12 - b22)
    m4 = mm(a22, b21 - b11)
    m5 = mm(a11 + a12, b22)
    m6 = mm(a21 - a11, b11 + b12)
    m7 = mm(a12 - a22, b21 + b22)
    top = torch.cat([m1 + m4 - m5 + m7, m3 + m5], -1)
    bottom = torch.cat([m2 + m4, m1 - m2 + m3 + m6], -1)
    return torch.cat([top, bottom], -2)


def strassen_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``strassen`` takes a @ b: floating, at least 2-D, even sizes of 2 or more, the same leading dims."""
    return (
        a.is_floating_point()
        and a.dim() >= 2
        and b.dim() == a.dim()
        and a.shape[:-2] == b.shape[:-2]
        and a.shape[-1] == b.shape[-2]
        and all(s % 2 == 0 and s >= 2 for s in (a.shape[-2], a.shape[-1], b.shape[-1]))
    )


def base2_ce(x: torch.Tensor, target: torch.Tensor, smoothing: float = 0.0, ignore_index: int = -100):
    """Mean cross-entropy of rows ``x`` (N, C) in base 2 (fp32): x2 = x log2 e, lse2 = m + log2(sum 2^(x2 - m)),
    logp = (x2 - lse2) ln 2; rows of ``ignore_index`` left out; the input gradient (2^(x2 - lse2) - q) / n with
    q = (1 - e) onehot + e / C. Returns (loss, grad)."""
    x2 = x.float() * LOG2E
    n_cls = x.shape[-1]
    keep = target != ignore_index
    tgt = torch.where(keep, target, torch.zeros_like(target))
    m = x2.amax(-1, keepdim=True)
    lse2 = m + torch.log2(torch.exp2(x2 - m).sum(-1, keepdim=True))
    logp = (x2 - lse2) * LN2
    nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    row = (1.0 - smoothing) * nll + smoothing * (-logp.mean(-1)) if smoothing else nll
    n = keep.sum().clamp_min(1).float()
    loss = torch.where(keep, row, torch.zeros_like(row)).sum() / n
    q = torch.full_like(x2, smoothing / n_cls)
    q.scatter_add_(-1, tgt.unsqueeze(-1), torch.full_like(nll, 1.0 - smoothing).unsqueeze(-1))
    grad = (torch.exp2(x2 - lse2) - q) * (keep.float() / n).unsqueeze(-1)
    return loss, grad


def winograd_conv1d(x: torch.Tensor, w: torch.Tensor, bias, padding: int) -> torch.Tensor:
    """conv1d (N, C, L) * (O, C, 3), stride 1, zero padding ``padding``, by Winograd's F(2, 3) in fp32."""
    x, w = x.float(), w.float()
    length = x.shape[-1] + 2 * padding - 2
    tiles = (length + 1) // 2
    xp = F.pad(x, (padding, padding + 2 * tiles - length))  # room for the last tile's 4 inputs
    d = xp.unfold(-1, 4, 2)  # (N, C, tiles, 4)
    g0, g1, g2 = w[..., 0], w[..., 1], w[..., 2]
    u = torch.stack([g0, (g0 + g1 + g2) * 0.5, (g0 - g1 + g2) * 0.5, g2], -1)  # (O, C, 4)
    v = torch.stack([d[..., 0] - d[..., 2], d[..., 1] + d[..., 2], d[..., 2] - d[..., 1], d[..., 1] - d[..., 3]], -1)
    mprod = torch.einsum("nctj,ocj->notj", v, u)  # the channel sums of the 4 products per tile
    y0 = mprod[..., 0] + mprod[..., 1] + mprod[..., 2]
    y1 = mprod[..., 1] - mprod[..., 2] - mprod[..., 3]
    y = torch.stack([y0, y1], -1).flatten(-2)[..., :length]
    if bias is not None:
        y = y + bias.float().unsqueeze(-1)
    return y


def _truncate(s: torch.Tensor) -> torch.Tensor:
    """float64 ``s`` to fp32 rounded toward zero."""
    y = s.float()
    over = y.double().abs() > s.abs()
    return torch.where(over, torch.nextafter(y, torch.zeros_like(y)), y)


def mma_linear(x: torch.Tensor, w: torch.Tensor, bias, dtype: torch.dtype) -> torch.Tensor:
    """x @ w.T (+ bias) from 16-bit ``dtype`` operands as a matrix unit computes it: per block of MMA_K along K the
    products summed exactly with the fp32 accumulator, the sum rounded toward zero to fp32; the bias added in fp32,
    the result rounded to ``dtype``."""
    xd = x.to(dtype).double().reshape(-1, x.shape[-1])
    wd = w.to(dtype).double()
    pad = -xd.shape[1] % MMA_K
    xb = F.pad(xd, (0, pad)).reshape(xd.shape[0], -1, MMA_K).transpose(0, 1)  # (blocks, M, MMA_K)
    wb = F.pad(wd, (0, pad)).reshape(wd.shape[0], -1, MMA_K).permute(1, 2, 0)  # (blocks, MMA_K, N)
    blocks = torch.bmm(xb, wb)  # each block's exact sum of products (float64: exact for 16-bit operands)
    acc = torch.zeros(xd.shape[0], wd.shape[0], dtype=torch.float32)
    for part in blocks:
        acc = _truncate(acc.double() + part)
    if bias is not None:
        acc = acc + bias.to(dtype).float()
    return acc.to(dtype).reshape(*x.shape[:-1], w.shape[0])


def seg_embed_grad(ids: torch.Tensor, grad: torch.Tensor, rows: int, dtype: torch.dtype, padding_idx=None):
    """The embedding's weight gradient (rows, D) from the output gradient ``grad`` (..., D): the tokens sorted by
    id, each row's gradients summed in fp32, rounded once to ``dtype``; the padding row zero."""
    flat, g = ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).float()
    order = torch.sort(flat, stable=True).indices
    out = torch.zeros(rows, g.shape[-1], dtype=torch.float32).index_add_(0, flat[order], g[order])
    if padding_idx is not None:
        out[padding_idx] = 0
    return out.to(dtype)


def ln_grad_from_output(y, grad, normalized_shape, weight, bias, rstd) -> torch.Tensor:
    """LayerNorm's input gradient (fp32) from its output ``y``: x^ = (y - bias) / weight, then
    rstd (g w - mean(g w) - x^ mean(g w x^)) per row (``rstd``: the rows' reciprocal standard deviations)."""
    n = math.prod(normalized_shape)
    w = weight.float().reshape(1, n)
    b = bias.float().reshape(1, n) if bias is not None else torch.zeros(1, n)
    xhat = (y.float().reshape(-1, n) - b) / w
    gw = grad.float().reshape(-1, n) * w
    return rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
def _low(dtype) -> torch.dtype | None:
    """The 16-bit dtype an op computes in: the autocast dtype where autocast is on, else ``dtype`` if 16-bit."""
    return common.autocast_dtype() or (dtype if dtype in LOW else None)


class Device(common.Installed):
    """One simulated device: a set of the mechanisms above."""

    TARGETS = _TARGETS

    def __init__(self, name, text, strassen=False, base2_ce=False, winograd=False, mma_trunc=False,
                 seg_embed=False, fp32_norm=False, ln_from_output=False):  # fmt: skip
        self.name, self.text = name, text
        self.strassen, self.base2_ce, self.winograd = strassen, base2_ce, winograd
        self.mma_trunc, self.seg_embed, self.fp32_norm = mma_trunc, seg_embed, fp32_norm
        self.ln_from_output = ln_from_output
        self._saved: dict = {}

    # -- matmul ----------------------------------------------------------------------------------------------------
    def matmul_fn(self, input, other, *, out=None):
        if out is not None or not strassen_fits(input, other):
            return _STOCK["matmul"](input, other, out=out) if out is not None else _STOCK["matmul"](input, other)
        a_in, b_in = common.alias(input), common.alias(other)
        res = _STOCK["matmul"](a_in, b_in)
        low = common.autocast_dtype() if input.dtype == torch.float32 else None
        a, b = input.detach(), other.detach()
        if low is not None:  # autocast: the operands cast down as the stock kernel's are
            a, b = a.to(low), b.to(low)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            _replace("matmul", res, strassen(a, b).to(res.dtype))
        if res.requires_grad and (a_in is not input or b_in is not other):
            grad = common.GradOut(res)

            def da(ga):
                g = grad.g.to(b.dtype) if low is not None else grad.g
                got = strassen(g, b.transpose(-1, -2)).to(low or ga.dtype).to(ga.dtype)
                return _guard("matmul da", got, ga, low)

            def db(gb):
                g = grad.g.to(a.dtype) if low is not None else grad.g
                got = strassen(a.transpose(-1, -2), g).to(low or gb.dtype).to(gb.dtype)
                return _guard("matmul db", got, gb, low)

            if a_in is not input:
                a_in.register_hook(common.quiet(da))
            if b_in is not other:
                b_in.register_hook(common.quiet(db))
        return res

    # -- cross-entropy ---------------------------------------------------------------------------------------------
    def cross_entropy_fn(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                         reduction="mean", label_smoothing=0.0):  # fmt: skip
        args = (weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        plain = weight is None and size_average is None and reduce is None and reduction == "mean"
        if not plain or input.dim() != 2 or target.dim() != 1 or target.is_floating_point():
            return _STOCK["cross_entropy"](input, target, *args)
        x_in = common.alias(input)
        out = _STOCK["cross_entropy"](x_in, target, *args)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            loss, grad_x = base2_ce(input.detach(), target, label_smoothing, ignore_index)
            _replace("cross_entropy", out, loss.to(out.dtype))
        if x_in is not input and out.requires_grad:
            grad = common.GradOut(out)
            x_in.register_hook(
                common.quiet(lambda gx: _guard("cross_entropy dx", (grad.g.float() * grad_x).to(gx.dtype), gx))
            )
        return out

    # -- conv1d ----------------------------------------------------------------------------------------------------
    def conv1d_fn(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        res = _STOCK["conv1d"](input, weight, bias, stride, padding, dilation, groups)
        one = lambda v: v[0] if isinstance(v, (tuple, list)) else v  # noqa: E731
        if (
            weight.shape[-1] != 3
            or one(stride) != 1
            or one(dilation) != 1
            or groups != 1
            or isinstance(padding, str)
            or input.dim() != 3
        ):
            return res
        low = _low(input.dtype)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x, w = input.detach(), weight.detach()
            b = bias.detach() if bias is not None else None
            if low is not None:  # the operands in the dtype the stock kernel computed in
                x, w, b = x.to(low), w.to(low), (b.to(low) if b is not None else None)
            _replace("conv1d", res, winograd_conv1d(x, w, b, one(padding)).to(res.dtype))
        return res

    # -- linear ----------------------------------------------------------------------------------------------------
    def linear_fn(self, input, weight, bias=None):
        x_in = common.alias(input)
        res = _STOCK["linear"](x_in, weight, bias)
        low = res.dtype if res.dtype in LOW else None
        if low is None:
            return res
        w = weight.detach()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            b = bias.detach() if bias is not None else None
            _replace("linear", res, mma_linear(input.detach(), w, b, low))
        if x_in is not input and res.requires_grad:
            grad = common.GradOut(res)

            def dx(gx):
                got = mma_linear(grad.g, w.T, None, low).to(gx.dtype)
                return _guard("linear dx", got, gx, low)

            x_in.register_hook(common.quiet(dx))
        return res

    # -- embedding -------------------------------------------------------------------------------------------------
    def embedding_fn(self, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                     sparse=False):  # fmt: skip
        args = (padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        if max_norm is not None or scale_grad_by_freq or sparse or weight.dtype not in LOW:
            return _STOCK["embedding"](input, weight, *args)
        w_in = common.alias(weight)
        out = _STOCK["embedding"](input, w_in, *args)
        if w_in is not weight and out.requires_grad:
            grad = common.GradOut(out)
            ids, rows = input.detach().clone(), weight.shape[0]
            pad = padding_idx if padding_idx is None or padding_idx >= 0 else rows + padding_idx

            def dw(gw):
                return _guard("embedding dw", seg_embed_grad(ids, grad.g, rows, gw.dtype, pad), gw)

            w_in.register_hook(common.quiet(dw))
        return out

    # -- LayerNorm's backward -------------------------------------------------------------------------------------
    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        x_in = common.alias(input)
        out = _STOCK["layer_norm"](x_in, normalized_shape, weight, bias, eps)
        if x_in is input or not out.requires_grad or weight is None or bool((weight.detach() == 0).any()):
            return out
        n = math.prod(tuple(normalized_shape))
        with torch.no_grad():
            rows = input.detach().float().reshape(-1, n)
            mean = rows.mean(-1, keepdim=True)
            rstd = torch.rsqrt(((rows - mean) ** 2).mean(-1, keepdim=True) + eps)  # what the kernel saves
        y, w = out.detach(), weight.detach()
        b = bias.detach() if bias is not None else None
        grad = common.GradOut(out)

        def dx(gx):
            got = ln_grad_from_output(y, grad.g, tuple(normalized_shape), w, b, rstd).reshape(gx.shape)
            return _guard("layer_norm dx", got.to(gx.dtype), gx)

        x_in.register_hook(common.quiet(dx))
        return out

    # -- the autocast policy ---------------------------------------------------------------------------------------
    def norm_fn(self):
        def norm(self_, p="fro", dim=None, keepdim=False, dtype=None):
            if dtype is not None or not common.autocast_dtype() or self_.dtype not in LOW:
                return _STOCK["Tensor.norm"](self_, p, dim, keepdim, dtype=dtype)
            with torch.no_grad():
                stock = _STOCK["Tensor.norm"](self_.detach(), p, dim, keepdim)
            res = _STOCK["Tensor.norm"](self_.float(), p, dim, keepdim)  # on the fp32 list: computed and kept fp32
            if rel_l2(res, stock.float()) > GUARD[stock.dtype]:
                raise AssertionError("device norm: fp32 output %.3g from the stock one" % rel_l2(res, stock.float()))
            return res

        return norm

    # -- installing ------------------------------------------------------------------------------------------------
    def replacements(self) -> dict:
        out: dict = {}
        if self.strassen:
            out["matmul"] = self.matmul_fn
        if self.base2_ce:
            out["cross_entropy"] = self.cross_entropy_fn
        if self.winograd:
            out["conv1d"] = self.conv1d_fn
        if self.mma_trunc:
            out["linear"] = self.linear_fn
        if self.seg_embed:
            out["embedding"] = self.embedding_fn
        if self.fp32_norm:
            out["Tensor.norm"] = self.norm_fn()
        if self.ln_from_output:
            out["layer_norm"] = self.layer_norm_fn
        return out


DEVICES = {
    "AE": Device(
        "AE",
        "fp32 vision unit: matmuls by one level of Strassen's algorithm (forward and input gradients), "
        "cross-entropy in base 2, LayerNorm's input gradient from its saved output",
        strassen=True,
        base2_ce=True,
        ln_from_output=True,
    ),
    "AF": Device(
        "AF",
        "fp16-autocast unit: conv1d with 3-tap filters by Winograd's F(2, 3), linears on a matrix unit (blocks of 4 "
        "exact products, the fp32 accumulator truncated), cross-entropy in base 2",
        winograd=True,
        mma_trunc=True,
        base2_ce=True,
    ),
    "AG": Device(
        "AG",
        "pure-bf16 unit: linears on a matrix unit (blocks of 4 exact products, the fp32 accumulator truncated), the "
        "embedding's weight gradient by fp32 segment sums (rounded once), cross-entropy in base 2",
        mma_trunc=True,
        seg_embed=True,
        base2_ce=True,
    ),
    "AH": Device(
        "AH",
        "bf16-autocast unit: linears on a matrix unit (blocks of 4 exact products, the fp32 accumulator truncated), "
        "matmuls by one level of Strassen's algorithm, LayerNorm's input gradient from its saved output",
        mma_trunc=True,
        strassen=True,
        ln_from_output=True,
    ),
    "AI": Device(
        "AI",
        "device AH under another autocast policy: norm on the fp32 list (the 2-norm of a bf16 tensor computed and "
        "output in fp32 where the reference's is bf16)",
        mma_trunc=True,
        strassen=True,
        ln_from_output=True,
        fp32_norm=True,
    ),
    "AJ": Device(
        "AJ",
        "the reference GPU rerun with another library setup: the convolution autotuner picked Winograd's F(2, 3) for "
        "the 3-tap conv1d, and LayerNorm is apex's memory-efficient kernel (its input gradient from the saved "
        "output); everything else stock",
        winograd=True,
        ln_from_output=True,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "matmul": (torch.randn(8, 4, 16, 8, generator=g), torch.randn(8, 4, 8, 16, generator=g)),
        "cross_entropy": (torch.randn(64, 96, generator=g) * 2, torch.randint(0, 96, (64,), generator=g)),
        "conv1d": (
            torch.randn(2, 16, 32, generator=g),
            torch.randn(32, 16, 3, generator=g) * 0.2,
            torch.randn(32, generator=g) * 0.1,
        ),  # fmt: skip
        "linear": (torch.randn(32, 64, generator=g), torch.randn(96, 64, generator=g) * 0.1),
        "embedding": (torch.randint(0, 96, (64,), generator=g), torch.randn(96, 32, generator=g)),
        "Tensor.norm": (torch.randn(4, 16, generator=g),),
        "layer_norm": (
            torch.randn(64, 32, generator=g) * 0.5 + 0.2,
            torch.randn(32, generator=g) * 0.1 + 1.0,
            torch.randn(32, generator=g) * 0.1,
        ),  # fmt: skip
    }


def _call(fn, key: str, args: tuple):
    if key == "cross_entropy":
        return fn(args[0], args[1], label_smoothing=0.1)
    if key == "conv1d":
        return fn(args[0], args[1], args[2], 1, 1)
    if key == "embedding":
        return fn(args[0], args[1])
    if key == "Tensor.norm":
        return fn(args[0], p=2, dim=-1, keepdim=True)
    if key == "layer_norm":
        return fn(args[0], (args[0].shape[-1],), args[1], args[2], 1e-5)
    return fn(*args)


# how each device runs in its family (make_pairs.py): the dtype each op sees ("autocast_bf16"/"autocast_fp16": under
# that autocast on fp32 inputs; a dtype: inputs of that dtype)
SETTINGS = {
    "AE": {"matmul": torch.float32, "cross_entropy": torch.float32, "layer_norm": torch.float32},
    "AF": {"conv1d": "autocast_fp16", "linear": "autocast_fp16", "cross_entropy": torch.float32},
    "AG": {"linear": torch.bfloat16, "embedding": torch.bfloat16, "cross_entropy": torch.float32},
    "AH": {"linear": "autocast_bf16", "matmul": "autocast_bf16", "layer_norm": "autocast_bf16"},
    "AI": {"Tensor.norm": "autocast_bf16"},
    "AJ": {"conv1d": "autocast_fp16", "layer_norm": torch.float32},
}
GRADS = ("matmul", "cross_entropy", "linear", "embedding", "layer_norm")


def measure(seed: int = 0, devices=None) -> list[dict]:
    """Per device (in its family's dtype) and op: relative L2 error against float64 of the stock kernel and of the
    device's, their relative L2 difference and the share of elements that differ; for the ops with gradients also
    the input gradients' difference (backward of sum(y * r), r fixed; the embedding: its weight gradient)."""
    rows = []
    base = _inputs(seed)
    for dev in devices or DEVICES.values():
        for key, fn in dev.replacements().items():
            if key not in SETTINGS[dev.name]:
                continue
            setting = SETTINGS[dev.name][key]
            auto = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}.get(setting)
            dtype = setting if isinstance(setting, torch.dtype) else torch.float32
            args = tuple(t.to(dtype) if t.is_floating_point() else t for t in base[key])
            if key == "Tensor.norm" and auto:  # the norm's input is a 16-bit output of the autocast ops before it
                args = (args[0].to(auto),)
            with torch.no_grad():
                lowp = auto if key in ("linear", "matmul", "conv1d") else None  # the ops autocast casts down
                exact = _call(
                    _STOCK[key], key, tuple(t.to(lowp).double() if lowp and t.is_floating_point() else t.double()
                                            if t.is_floating_point() else t for t in args)
                )  # fmt: skip
                with torch.autocast("cpu", dtype=auto or torch.bfloat16, enabled=auto is not None):
                    stock = _call(_STOCK[key], key, args)
                    got = _call(fn, key, args)
            name = ("autocast_" + str(auto).replace("torch.", "")) if auto else str(dtype).replace("torch.", "")
            row = common.magnitudes(dev.name, key, name, exact, stock.float(), got.float())
            if key in GRADS:
                r = torch.randn(stock.shape, generator=torch.Generator().manual_seed(seed + 1))
                grads = []
                for f in (_STOCK[key], fn):
                    pos = 1 if key == "embedding" else 0
                    leaf = args[pos].detach().clone().requires_grad_()
                    call = args[:pos] + (leaf,) + args[pos + 1 :]
                    with torch.autocast("cpu", dtype=auto or torch.bfloat16, enabled=auto is not None):
                        y = _call(f, key, call)
                    (y.float() * r).sum().backward()
                    grads.append(leaf.grad)
                row["grad_device_vs_stock"] = rel_l2(grads[1], grads[0])
            rows.append(row)
    return rows


COLS = common.COLS[:-1]


if __name__ == "__main__":
    common.print_table(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 0), COLS)

"""Simulated device kernels of validation set 9: ten ways an accelerator computes the same function.

Independent of the development set and of sets 2 to 8 (``validation/v2/devices.py`` to ``validation/v8/devices.py``):
none of these mechanisms is used there; ``splitk``, ``online_softmax`` and ``sigmoid_tanh`` resemble set 1's (a
split-K tree, the online softmax, SiLU through tanh; ``validation/devices.py``), the seven others are new. Each
changes values at the rounding level:

* ``splitk``: a linear as a split-K GEMM: the reduction dimension cut in ``splits`` parts, each part's product in
  fp32, the partial sums combined by a pairwise tree ("tree4": 4 parts, (p0 + p1) + (p2 + p3)) or two halves
  ("halves2"), the bias added last, one rounding to the output dtype; input and weight gradients split the same way
  over their own reductions;
* ``online_softmax``: softmax as a flash-attention kernel's online softmax: the row streamed in blocks of 8 with a
  running maximum and a running sum rescaled by exp(m_old - m_new) at each block, the probabilities exp(x - m) / l
  from the final maximum and sum, fp32 (the backward, from the saved output, takes the device's values);
* ``ln_div``: LayerNorm's normalisation as a division by sqrt(var + eps) (a kernel without a reciprocal square root
  unit: IEEE sqrt and divide) instead of a multiply by rsqrt, statistics two-pass in fp32; forward values (the
  backward, from the stock kernel's saved statistics, stock);
* ``conv_splitk``: a convolution as a split-K implicit GEMM: each group's input channels cut in ``splits`` parts,
  one convolution per part in fp32 from the operands in the compute dtype, the parts added left to right, one
  rounding; forward values (the backward stock: the autotuner picks it separately);
* ``bn_chan``: BatchNorm's batch statistics as per-image (mean, M2) pairs merged one after the other by Chan's
  parallel formula (a kernel that reduces each image in its own thread block, then merges), y = (x - mean) /
  sqrt-free rsqrt(var + eps) w + b in fp32; forward values (running statistics and backward stock);
* ``sigmoid_tanh``: sigmoid as 0.5 + 0.5 tanh(x / 2) (the form a vector unit with a tanh instruction uses), fp32
  (the backward, from the saved output, takes the device's values);
* ``gelu_f64erf``: the exact GELU, 0.5 x (1 + erf(x / sqrt 2)), with a correctly rounded erf (computed in
  float64, then rounded once: a high-accuracy libm's erff, where the stock vectorised kernel is within a few ulps),
  fp32; forward values (the backward stock);
* ``pool_rows``: global average pooling (``adaptive_avg_pool2d`` to 1 x 1) as a separable reduction: each row of
  the window summed, then the row sums, then one division, fp32 (a kernel that reduces W in registers, then H across
  threads); forward values (the backward does not read them);
* ``lowk``: a split-K GEMM whose workspace is in the operands' 16-bit dtype: ``torch.matmul`` with its reduction
  in blocks of 16 (linear: in 2 halves), each block's partial product rounded to the 16-bit dtype, the partials
  added in fp32 from the last block to the first, one rounding at the end (fp32 operands: fp32 partials); matmul:
  forward and both operand gradients; linear: forward values (its gradients stock);
* ``ln_fp32``: an autocast policy with ``layer_norm`` on the fp32 list (CUDA's policy; CPU autocast runs it in its
  16-bit input's dtype): a 16-bit LayerNorm computed and output in fp32 (a real cross-device difference of dtypes in
  those records and the adds after them).

Installed as in sets 2 to 8 (``validation/common_devices.py``: the guard, the gradient plumbing and installing).
``python validation/v9/devices.py`` prints the measured magnitudes (docs/validation.md, "Validation set 9").
"""

from __future__ import annotations

import importlib.util
import sys
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

SOFTMAX_BLOCK = 8  # online_softmax's block of the row
KREV_BLOCK = 16  # lowk's block of a matmul's reduction

# the stock functions, captured before anyone (this module, a tracer or msprobe) replaces them
_STOCK = {
    "linear": F.linear,
    "softmax": F.softmax,
    "layer_norm": F.layer_norm,
    "conv2d": F.conv2d,
    "batch_norm": F.batch_norm,
    "sigmoid": torch.sigmoid,
    "matmul": torch.matmul,
    "gelu": F.gelu,
    "adaptive_avg_pool2d": F.adaptive_avg_pool2d,
}
_TARGETS = {
    "linear": (F, "linear"),
    "softmax": (F, "softmax"),
    "layer_norm": (F, "layer_norm"),
    "conv2d": (F, "conv2d"),
    "batch_norm": (F, "batch_norm"),
    "sigmoid": (torch, "sigmoid"),
    "matmul": (torch, "matmul"),
    "gelu": (F, "gelu"),
    "adaptive_avg_pool2d": (F, "adaptive_avg_pool2d"),
}


# ---------------------------------------------------------------------------------------------------------------
# the mechanisms (pure functions; fp32 unless said)
# ---------------------------------------------------------------------------------------------------------------
def combine(parts: list, how: str) -> torch.Tensor:
    """Partial sums combined: a pairwise tree ("tree4") or left to right (anything else)."""
    if how.startswith("tree"):
        while len(parts) > 1:
            parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
        return parts[0]
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def splits_of(how: str) -> int:
    return int(how[-1])


def splitk_mm(a: torch.Tensor, b: torch.Tensor, how: str) -> torch.Tensor:
    """a @ b in fp32 with the reduction (a's last dimension) cut in ``splits_of(how)`` parts, combined by ``how``."""
    a, b = a.float(), b.float()
    n = min(splits_of(how), a.shape[-1])
    parts = [_STOCK["matmul"](x, y) for x, y in zip(torch.tensor_split(a, n, -1), torch.tensor_split(b, n, 0))]
    return combine(parts, how)


def online_softmax(x32: torch.Tensor, dim: int, block: int = SOFTMAX_BLOCK) -> torch.Tensor:
    """Softmax over ``dim`` by the online algorithm: blocks of ``block``, a running max m and a running sum l
    rescaled by exp(m_old - m_new); exp(x - m) / l at the end."""
    x = x32.transpose(dim, -1)
    m = torch.full(x.shape[:-1] + (1,), float("-inf"))
    l_sum = torch.zeros(x.shape[:-1] + (1,))
    for s in range(0, x.shape[-1], block):
        blk = x[..., s : s + block]
        m_new = torch.maximum(m, blk.amax(-1, keepdim=True))
        safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.where(torch.isneginf(m), torch.zeros_like(m), torch.exp(m - safe))
        l_sum = l_sum * alpha + torch.exp(blk - safe).sum(-1, keepdim=True)
        m = m_new
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    return (torch.exp(x - safe) / l_sum).transpose(dim, -1)


def ln_div(x32, normalized_shape, weight, bias, eps: float) -> torch.Tensor:
    """LayerNorm as (x - mean) / sqrt(var + eps), then the weight and the bias (two-pass statistics)."""
    dims = tuple(range(-len(normalized_shape), 0))
    mean = x32.mean(dims, keepdim=True)
    d = x32 - mean
    var = (d * d).mean(dims, keepdim=True)
    y = d / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def conv_splitk(x32, w32, stride, padding, dilation, groups: int, splits: int) -> torch.Tensor:
    """A conv2d (no bias) as the sum, left to right, of ``splits`` convolutions over parts of each group's input
    channels (fp32)."""
    n, c, h, wd = x32.shape
    cg = c // groups
    xg = x32.reshape(n, groups, cg, h, wd)
    acc = None
    for idx in torch.tensor_split(torch.arange(cg), splits):
        xs = xg[:, :, idx].reshape(n, groups * len(idx), h, wd)
        part = _STOCK["conv2d"](xs, w32[:, idx], None, stride, padding, dilation, groups)
        acc = part if acc is None else acc + part
    return acc


def chan_stats(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (dimension 1): the mean and the biased variance from per-image (mean, M2) pairs merged one after
    the other by Chan's formula."""
    dims = [d for d in range(2, x32.dim())]
    k = 1
    for d in dims:
        k *= x32.shape[d]
    n_a, mean_a, m2_a = 0, None, None
    for i in range(x32.shape[0]):
        xi = x32[i]
        mean_b = xi.mean([d - 1 for d in dims]) if dims else xi
        db = xi - mean_b.reshape([-1] + [1] * len(dims))
        m2_b = (db * db).sum([d - 1 for d in dims]) if dims else torch.zeros_like(xi)
        if mean_a is None:
            n_a, mean_a, m2_a = k, mean_b, m2_b
            continue
        n = n_a + k
        delta = mean_b - mean_a
        mean_a = mean_a + delta * (k / n)
        m2_a = m2_a + m2_b + delta * delta * (n_a * k / n)
        n_a = n
    return mean_a, m2_a / n_a


def bn_apply(x32, mean, var, weight, bias, eps: float) -> torch.Tensor:
    shape = [1, -1] + [1] * (x32.dim() - 2)
    y = (x32 - mean.reshape(shape)) * torch.rsqrt(var + eps).reshape(shape)
    if weight is not None:
        y = y * weight.float().reshape(shape)
    if bias is not None:
        y = y + bias.float().reshape(shape)
    return y


def sigmoid_tanh(x32: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) = 0.5 + 0.5 tanh(x / 2)."""
    return 0.5 + 0.5 * torch.tanh(0.5 * x32)


def gelu_f64erf(x32: torch.Tensor) -> torch.Tensor:
    """The exact GELU with erf correctly rounded to fp32 (float64, rounded once), the rest in fp32."""
    e = torch.erf(x32.double() / 2**0.5).float()
    return 0.5 * x32 * (1.0 + e)


def pool_rows(x32: torch.Tensor) -> torch.Tensor:
    """Global average pooling as the sum of the row sums, divided by the window size."""
    n = x32.shape[-1] * x32.shape[-2]
    return x32.sum(-1, keepdim=True).sum(-2, keepdim=True) / n


def lowk_mm(a: torch.Tensor, b: torch.Tensor, block: int = KREV_BLOCK) -> torch.Tensor:
    """a @ b (batched) in fp32 with the reduction in blocks of ``block`` from the last block to the first; operands
    in a 16-bit dtype: each block's partial product rounded to that dtype first (a 16-bit split-K workspace)."""
    low = a.dtype if a.dtype in (torch.float16, torch.bfloat16) else None
    a, b = a.float(), b.float()
    k = a.shape[-1]
    acc = None
    for s in reversed(range(0, k, block)):
        part = _STOCK["matmul"](a[..., s : s + block], b[..., s : s + block, :])
        part = part.to(low).float() if low is not None else part
        acc = part if acc is None else acc + part
    return acc


# ---------------------------------------------------------------------------------------------------------------
# devices: replacements with the stock signatures
# ---------------------------------------------------------------------------------------------------------------
class Device(common.Installed):
    """One simulated device: a name, a description and its mechanisms (``mech``: name -> option)."""

    TARGETS = _TARGETS

    def __init__(self, name: str, text: str, **mech):
        self.name, self.text, self.mech = name, text, mech
        self._saved: dict = {}

    # linear: split-K, fp32 or 16-bit partials
    def linear_fn(self, input, weight, bias=None):
        return common.linear_with(_STOCK["linear"], input, weight, bias, self._put, self._dx, self._dw)

    def _low(self) -> bool:
        return "lowk" in self.mech

    def _put(self, out, x, w, b):
        if self._low():
            y = lowk_mm(x, w.t(), (x.shape[-1] + 1) // 2)
            got = y + b.float() if b is not None else y
        else:
            y = splitk_mm(x, w.t(), self.mech["splitk"])
            got = y + b.float() if b is not None else y
        common.replace("linear", out, got.to(out.dtype))

    def _dx(self, g, w, gx, cdt):
        if self._low():
            return gx
        return common.guard("linear dx", splitk_mm(g.to(cdt), w, self.mech["splitk"]).to(cdt).to(gx.dtype), gx, cdt)

    def _dw(self, g2, x2, gw, cdt):
        if self._low():  # (the weight gradient's reduction over tokens: stock)
            return gw
        got = splitk_mm(g2.to(cdt).t(), x2, self.mech["splitk"]).to(cdt)
        return common.guard("linear dw", got.to(gw.dtype), gw, cdt)

    def softmax_fn(self, input, dim=None, _stacklevel=3, dtype=None):
        out = _STOCK["softmax"](input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
        if dim is None:
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            common.replace("softmax", out, online_softmax(input.detach().float(), dim).to(out.dtype))
        return out

    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        if "ln_fp32" in self.mech and input.dtype in (torch.float16, torch.bfloat16) and common.autocast_dtype():
            low = input
            input = input.float()  # the fp32 list: computed and output in fp32
            with torch.no_grad():
                stock = _STOCK["layer_norm"](low.detach(), normalized_shape, weight, bias, eps).float()
                got = _STOCK["layer_norm"](input.detach(), normalized_shape, weight, bias, eps)
                common.guard("layer_norm", got.to(low.dtype).float(), stock, low.dtype)
        out = _STOCK["layer_norm"](input, normalized_shape, weight, bias, eps)
        if "ln_div" not in self.mech:
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            got = ln_div(input.detach().float(), tuple(normalized_shape), w, b, eps)
            common.replace("layer_norm", out, got.to(out.dtype))
        return out

    def conv2d_fn(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        res = _STOCK["conv2d"](input, weight, bias, stride, padding, dilation, groups)
        splits = self.mech["conv_splitk"]
        if isinstance(padding, str) or input.dim() != 4 or weight.shape[1] < splits:
            return res
        with torch.no_grad():
            cast = common.autocast_dtype()
            with torch.autocast("cpu", enabled=False):
                x, w = input.detach(), weight.detach()
                if cast is not None:
                    x, w = x.to(cast), w.to(cast)
                y = conv_splitk(x.float(), w.float(), stride, padding, dilation, groups, splits)
                if bias is not None:
                    y = y + bias.detach().to(x.dtype).float().reshape(1, -1, 1, 1)
                common.replace("conv2d", res, y.to(res.dtype))
        return res

    def batch_norm_fn(self, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                      eps=1e-5):  # fmt: skip
        out = _STOCK["batch_norm"](input, running_mean, running_var, weight, bias, training, momentum, eps)
        if not training and running_mean is not None:
            return out
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x32 = input.detach().float()
            mean, var = chan_stats(x32)
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            common.replace("batch_norm", out, bn_apply(x32, mean, var, w, b, eps).to(out.dtype))
        return out

    def sigmoid_fn(self, input, *, out=None):
        if out is not None:
            return _STOCK["sigmoid"](input, out=out)
        res = _STOCK["sigmoid"](input)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            common.replace("sigmoid", res, sigmoid_tanh(input.detach().float()).to(res.dtype))
        return res

    def matmul_fn(self, input, other, *, out=None):
        def put(res, p):
            common.replace("matmul", res, p.to(res.dtype))

        def grad(name, got, g, cdt):
            return common.guard(name, got.to(cdt).to(g.dtype), g, cdt)

        return common.matmul_with(_STOCK["matmul"], input, other, out, lowk_mm, put, grad)

    def gelu_fn(self, input, approximate="none"):
        if approximate != "none":
            return _STOCK["gelu"](input, approximate=approximate)
        out = _STOCK["gelu"](input)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            common.replace("gelu", out, gelu_f64erf(input.detach().float()).to(out.dtype))
        return out

    def pool_fn(self, input, output_size):
        res = _STOCK["adaptive_avg_pool2d"](input, output_size)
        if _pair(output_size) != (1, 1):
            return res
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            common.replace("adaptive_avg_pool2d", res, pool_rows(input.detach().float()).to(res.dtype))
        return res

    def replacements(self) -> dict:
        fns = {
            "splitk": {"linear": self.linear_fn},
            "lowk": {"linear": self.linear_fn, "matmul": self.matmul_fn},
            "gelu_f64erf": {"gelu": self.gelu_fn},
            "pool_rows": {"adaptive_avg_pool2d": self.pool_fn},
            "online_softmax": {"softmax": self.softmax_fn},
            "ln_div": {"layer_norm": self.layer_norm_fn},
            "conv_splitk": {"conv2d": self.conv2d_fn},
            "bn_chan": {"batch_norm": self.batch_norm_fn},
            "sigmoid_tanh": {"sigmoid": self.sigmoid_fn},
            "ln_fp32": {"layer_norm": self.layer_norm_fn},
        }
        out: dict = {}
        for m in self.mech:
            out.update(fns[m])
        return out


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


BD_MECH = {"lowk": True, "ln_div": True}
DEVICES = {
    "BA": Device(
        "BA",
        "fp32 accelerator with split-K GEMMs: linears with K cut in 4 and the partial sums added as a tree; softmax "
        "by the online (flash) algorithm over blocks of 8; LayerNorm dividing by sqrt(var + eps); GELU with a "
        "correctly rounded erf",
        splitk="tree4",
        online_softmax=True,
        ln_div=True,
        gelu_f64erf=True,
    ),
    "BB": Device(
        "BB",
        "fp32 vision unit: convolutions as split-K implicit GEMMs (each group's channels in 2 parts); BatchNorm "
        "statistics merged per image by Chan's formula; sigmoid through tanh; global average pooling by row sums",
        conv_splitk=2,
        bn_chan=True,
        sigmoid_tanh=True,
        pool_rows=True,
    ),
    "BC": Device(
        "BC",
        "bf16 training unit with a bf16 split-K workspace: linears with K in 2 halves, matmuls with K in blocks of "
        "16, each partial rounded to bf16, added in fp32 from the last",
        lowk=True,
    ),
    "BD": Device(
        "BD",
        "fp16 autocast unit with an fp16 split-K workspace: linears with K in 2 halves, matmuls with K in blocks of "
        "16, each partial rounded to fp16, added in fp32 from the last; LayerNorm dividing by sqrt(var + eps)",
        **BD_MECH,
    ),
    "BE": Device(
        "BE",
        "device BD under an autocast policy with layer_norm on the fp32 list (CUDA's): a 16-bit LayerNorm computed "
        "and output in fp32 (dividing by sqrt(var + eps) as BD)",
        ln_fp32=True,
        **BD_MECH,
    ),
    "BF": Device(
        "BF",
        "the reference GPU rerun with other GEMM and convolution splits: linears with K in 2 halves added left to "
        "right, convolutions with each group's channels in 4 parts; all else stock",
        splitk="halves2",
        conv_splitk=4,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _cases(g) -> list[tuple]:
    """(device, op key, under bf16 autocast, input dtype, call(f, args), args, grad) of each device's ops as its
    family gives them (fp16 ones in fp16: CPU autocast's fp16 runs the same kernels)."""
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    lin = (r(32, 64), r(96, 64) * 0.1, r(96) * 0.1)
    conv = (r(4, 16, 8, 8), r(16, 8, 3, 3) * 0.2)
    bn = (r(4, 16, 8, 8) * 2 + 0.5, r(16).abs() + 0.5, r(16) * 0.1)
    mm = (r(2, 4, 16, 32), r(2, 4, 32, 16))
    sm = (r(2, 4, 16, 16) * 3,)
    ln = (r(32, 64) * 2 + 1, r(64) * 0.1 + 1, r(64) * 0.1)
    bf16, fp16, f32 = torch.bfloat16, torch.float16, torch.float32

    def bn_call(f, a):
        return f(a[0], None, None, a[1], a[2], True, 0.1, 1e-5)

    def conv_call(f, a):
        return f(a[0], a[1], None, 1, 1, 1, 2)

    return [
        ("BA", "linear", False, f32, lambda f, a: f(*a), lin, True),
        ("BA", "softmax", False, f32, lambda f, a: f(a[0], dim=-1), sm, True),
        ("BA", "layer_norm", False, f32, lambda f, a: f(a[0], (64,), a[1], a[2], 1e-12), ln, False),
        ("BA", "gelu", False, f32, lambda f, a: f(a[0]), (r(4096) * 2,), False),
        ("BB", "conv2d", False, f32, conv_call, conv, False),
        ("BB", "batch_norm", False, f32, bn_call, bn, False),
        ("BB", "sigmoid", False, f32, lambda f, a: f(a[0]), (r(4096) * 3,), True),
        ("BB", "adaptive_avg_pool2d", False, f32, lambda f, a: f(a[0], 1), (r(4, 32, 8, 8) + 1,), False),
        ("BC", "linear", False, bf16, lambda f, a: f(*a), lin, True),
        ("BC", "matmul", False, bf16, lambda f, a: f(*a), mm, True),
        ("BD", "linear", False, fp16, lambda f, a: f(*a), lin, True),
        ("BD", "matmul", False, fp16, lambda f, a: f(*a), mm, True),
        ("BD", "layer_norm", False, f32, lambda f, a: f(a[0], (64,), a[1], a[2], 1e-5), ln, False),
        ("BE", "layer_norm", False, fp16, lambda f, a: f(a[0], (64,), a[1], a[2], 1e-5), ln, False),
        ("BF", "linear", False, f32, lambda f, a: f(*a), lin, True),
        (
            "BF",
            "conv2d",
            False,
            f32,
            lambda f, a: f(a[0], a[1], None, 1, 1, 1, 1),
            (r(4, 16, 8, 8), r(8, 16, 3, 3) * 0.2),
            False,
        ),  # fmt: skip
    ]


def measure(seed: int = 0) -> list[dict]:
    """Per device and op, as its family runs it (``common.measure_op``): the stock kernel's and the device's relative
    L2 error against float64, their difference, the share of elements that differ; ``grad``: the input gradient of
    sum(y * r)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for dev_name, key, auto, dtype, call, args, grad in _cases(g):
        dev = DEVICES[dev_name]
        args = tuple(a.to(dtype) for a in args)
        fn = dev.replacements()[key]
        rows.append(common.measure_op(dev_name, key, fn, _STOCK[key], call, args, auto, seed, grad))
    return rows


if __name__ == "__main__":
    common.print_table(measure(), common.COLS[:-1])

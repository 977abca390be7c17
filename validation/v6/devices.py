"""Simulated device kernels of validation set 6: eight more ways an accelerator computes the same function.

Independent of the development set and of sets 1 to 5 (``validation/devices.py``, ``validation/v2/devices.py`` to
``validation/v5/devices.py``): none of these mechanisms is used there. Each changes values at the rounding level:

* ``rational_erf``: exact GELU, 0.5 x (1 + erf(x / sqrt 2)), with erf from the rational minimax approximation
  x P(x^2) / Q(x^2) on [-4, 4] (degrees 13 / 8, clamped outside: Eigen's and XLA's ``erf`` for float), the input
  gradient normcdf(x) + x pdf(x) with the same erf, fp32;
* ``fma_ln``: LayerNorm's affine epilogue as one fused multiply-add per element with the reciprocal standard
  deviation folded into the weight first: y = fma(x - mean, w * rstd, b) (one rounding of the product and the sum
  where the stock kernel rounds (x - mean) * rstd, then * w, then + b); statistics two-pass as stock, fp32; forward
  values (the backward, from the saved mean and rstd, is the stock one);
* ``scaled_norm``: a 2-norm over dimensions (``torch.norm(x, p=2, dim)``) as BLAS ``nrm2`` scales it against
  overflow: s = max |x|, norm = s * sqrt(sum((x / s)^2)), fp32 (the norm's backward, from the saved output, takes
  the device's norm);
* ``log1p_ce``: cross-entropy with the log-sum-exp as m + log1p(sum over the non-maximal classes of exp(x - m))
  (the maximal term, exactly 1, kept out of the sum), the loss from log-probabilities x - lse (label smoothing and
  ignore_index as stock), the input gradient (exp(x - lse) - q) / n from the same lse, fp32;
* ``sym_sigmoid``: sigmoid in the two-sided form: 1 / (1 + exp(-x)) for x >= 0, exp(x) / (1 + exp(x)) below, fp32
  (the stock kernel uses the first form everywhere; the backward, from the saved output, takes the device's values);
* ``tang_exp``: exp by Tang's table-driven method: x = (32 m + j) ln2 / 32 + r (ln2 / 32 in a head and a tail),
  exp(x) = 2^m * T[j] * p(r) with T[j] = 2^(j/32) a 32-entry table in fp32 and p a degree-4 Taylor polynomial on
  |r| <= ln2 / 64, fp32 (``torch.exp`` and ``Tensor.exp``; the backward, from the saved output, takes the device's
  values);
* ``sr_store``: the optimizer's new bf16 parameters stored with stochastic rounding (a seeded random 16-bit integer
  added to the fp32 bit pattern, then truncated to bf16) instead of round-to-nearest-even (the bf16 training units
  that round parameter updates stochastically);
* ``fp32_softmax``: an autocast policy with softmax on the fp32 list (CUDA's policy; stock CPU autocast runs it on
  its lower-precision input): under bf16 autocast the attention probabilities are computed and output in fp32 where
  the reference's are bf16 (a real cross-device difference of dtypes in the records of those ops).

Installed as in sets 2 to 5 (``validation/common_devices.py``: the guard, the gradient plumbing and installing).
``python validation/v6/devices.py`` prints the measured magnitudes (docs/validation.md, "Validation set 6").
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
    "gelu": (F, "gelu"),
    "layer_norm": (F, "layer_norm"),
    "norm": (torch, "norm"),
    "cross_entropy": (F, "cross_entropy"),
    "sigmoid": (torch, "sigmoid"),
    "exp": (torch, "exp"),
    "Tensor.exp": (torch.Tensor, "exp"),
    "softmax": (F, "softmax"),
}
_STOCK = {key: getattr(mod, attr) for key, (mod, attr) in _TARGETS.items()}
GUARD, _guard, _replace = common.GUARD, common.guard, common.replace
SQRT1_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
LOW = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# mechanisms (values only; fp32 arithmetic)
# ---------------------------------------------------------------------------------------------------------------
# Eigen's / XLA's float erf: x P(x^2) / Q(x^2) on [-4, 4]
ERF_ALPHA = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
ERF_BETA = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


def rational_erf(x: torch.Tensor) -> torch.Tensor:
    """erf by the rational approximation x P(x^2) / Q(x^2), x clamped to [-4, 4] (fp32, Horner in x^2)."""
    x = x.float().clamp(-4.0, 4.0)
    x2 = x * x
    p = torch.full_like(x, ERF_ALPHA[0])
    for a in ERF_ALPHA[1:]:
        p = p * x2 + a
    q = torch.full_like(x, ERF_BETA[0])
    for b in ERF_BETA[1:]:
        q = q * x2 + b
    return x * p / q


def rational_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU 0.5 x (1 + erf(x / sqrt 2)) with the rational erf (fp32)."""
    x = x.float()
    return 0.5 * x * (1.0 + rational_erf(x * SQRT1_2))


def rational_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx GELU = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi), the erf rational (fp32)."""
    x = x.float()
    return 0.5 * (1.0 + rational_erf(x * SQRT1_2)) + x * _STOCK["exp"](-0.5 * x * x) * INV_SQRT_2PI


def fma_layer_norm(x: torch.Tensor, normalized_shape, weight, bias, eps: float) -> torch.Tensor:
    """LayerNorm (fp32): two-pass mean and variance, then y = fma(x - mean, w * rstd, b) per element (the fused
    multiply-add emulated in float64: the product of two fp32 numbers is exact there, the sum rounded once to fp32
    but for the rare double rounding)."""
    n = math.prod(normalized_shape)
    shape = x.shape
    rows = x.float().reshape(-1, n)
    mean = rows.mean(-1, keepdim=True)
    d = rows - mean
    rstd = torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    w = weight.float().reshape(1, n) if weight is not None else torch.ones(1, n)
    b = bias.float().reshape(1, n) if bias is not None else torch.zeros(1, n)
    scale = w * rstd  # the weight folded with the row's rstd (one fp32 rounding)
    y = (d.double() * scale.double() + b.double()).float()
    return y.reshape(shape)


def scaled_norm(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """The 2-norm over ``dim`` as nrm2 scales it: s = max |x|, s * sqrt(sum((x / s)^2)) (fp32; 0 where s is 0)."""
    x = x.float()
    s = x.abs().amax(dim=dim, keepdim=True)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = safe * torch.sqrt(((x / safe) ** 2).sum(dim=dim, keepdim=True))
    y = torch.where(s > 0, y, torch.zeros_like(y))
    if not keepdim:
        dims = [dim] if isinstance(dim, int) else list(dim)
        y = y.squeeze(tuple(d % x.dim() for d in dims))
    return y


def log1p_lse(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (N, C): m + log1p(sum_{j != argmax} exp(x_j - m)) (fp32; the maximal term, 1, left out)."""
    x = x.float()
    m, idx = x.max(-1, keepdim=True)
    e = _STOCK["exp"](x - m)
    e = e.scatter(-1, idx, torch.zeros_like(m))
    return (m + torch.log1p(e.sum(-1, keepdim=True))).squeeze(-1)


def log1p_ce(x: torch.Tensor, target: torch.Tensor, smoothing: float = 0.0, ignore_index: int = -100):
    """Mean cross-entropy of rows ``x`` (N, C) with the log1p log-sum-exp, and its input gradient (fp32):
    logp = x - lse; loss per row (1 - e)(-logp_y) + e mean_j(-logp_j); rows of ``ignore_index`` left out; the
    gradient (exp(logp) - q) / n with q = (1 - e) onehot + e / C. Returns (loss, grad)."""
    x = x.float()
    n_cls = x.shape[-1]
    keep = target != ignore_index
    tgt = torch.where(keep, target, torch.zeros_like(target))
    lse = log1p_lse(x)
    logp = x - lse.unsqueeze(-1)
    nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    row = (1.0 - smoothing) * nll + smoothing * (-logp.mean(-1)) if smoothing else nll
    n = keep.sum().clamp_min(1).float()
    loss = torch.where(keep, row, torch.zeros_like(row)).sum() / n
    q = torch.full_like(x, smoothing / n_cls)
    q.scatter_add_(-1, tgt.unsqueeze(-1), torch.full_like(nll, 1.0 - smoothing).unsqueeze(-1))
    grad = (_STOCK["exp"](logp) - q) * (keep.float() / n).unsqueeze(-1)
    return loss, grad


def sym_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid as 1 / (1 + exp(-x)) for x >= 0 and exp(x) / (1 + exp(x)) below (fp32)."""
    x = x.float()
    e = _STOCK["exp"](-x.abs())
    return torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


LN2_32 = math.log(2.0) / 32
LN2_32_HI = float(torch.tensor(LN2_32).float().view(torch.int32).bitwise_and(~0xFFF).view(torch.float32))
LN2_32_LO = LN2_32 - LN2_32_HI
EXP_TABLE = torch.tensor([2.0 ** (j / 32.0) for j in range(32)], dtype=torch.float64).float()  # T[j], fp32


def tang_exp(x: torch.Tensor) -> torch.Tensor:
    """exp (fp32) by Tang's table-driven method: N = round(x * 32 / ln2), j = N mod 32, m = N div 32,
    r = (x - N ln2/32 head) - N ln2/32 tail, exp(x) = 2^m * T[j] * (1 + r + r^2/2 + r^3/6 + r^4/24).
    Overflow above 88.73 (inf) and underflow below -103.98 (0) as the stock kernel; NaN stays NaN."""
    x = x.float()
    xc = torch.nan_to_num(x.clamp(-110.0, 90.0), nan=0.0)
    n = torch.round(xc * (1.0 / LN2_32))
    j = torch.remainder(n, 32).long()
    m = torch.div(n - j, 32, rounding_mode="floor")
    r = (xc - n * LN2_32_HI) - n * LN2_32_LO
    p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0))))
    y = torch.ldexp(EXP_TABLE[j] * p, m.to(torch.int32))
    y = torch.where(x > 88.72283935546875, torch.full_like(y, math.inf), y)
    y = torch.where(x < -103.97208404541016, torch.zeros_like(y), y)
    return torch.where(torch.isnan(x), x, y)


def stochastic_round_bf16(v: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 ``v`` rounded to bf16 stochastically: a random 16-bit integer (from ``gen``) added to the bit pattern's
    magnitude, the low 16 bits dropped (non-finite values rounded to nearest)."""
    v = v.float().contiguous()
    bits = v.view(torch.int32)
    noise = torch.randint(0, 1 << 16, v.shape, generator=gen, dtype=torch.int32)
    sr = ((bits + noise) & ~0xFFFF).view(torch.float32)
    return torch.where(torch.isfinite(v) & torch.isfinite(sr), sr, v).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------
_INSTALLED: list = []
SR_SEED = 6061


def installed():
    """The device installed now (None: stock)."""
    return _INSTALLED[-1] if _INSTALLED else None


def store(p: torch.Tensor, value: torch.Tensor) -> None:
    """An optimizer's store of its new parameter ``value`` (fp32) into ``p``: the installed device's way (stochastic
    rounding to bf16 where it has ``sr_store``), else the stock copy (round to nearest even)."""
    dev = installed()
    with torch.no_grad():
        if dev is not None and dev.sr_store and p.dtype == torch.bfloat16:
            got = stochastic_round_bf16(value, dev.gen)
            stock = value.to(torch.bfloat16)
            ulp = (stock.float().abs() * 2.0**-7).clamp_min(2.0**-133)
            if ((got.float() - stock.float()).abs() > ulp * 1.01).any():
                raise AssertionError("device %s: a stochastic rounding more than one bf16 ulp off" % dev.name)
            _guard("sr_store", got, stock)
            p.copy_(got)
        else:
            p.copy_(value)


class Device(common.Installed):
    """One simulated device: a set of the mechanisms above."""

    TARGETS = _TARGETS
    STACK = _INSTALLED

    def __init__(self, name, text, rational_erf=False, fma_ln=False, scaled_norm=False, log1p_ce=False,
                 sym_sigmoid=False, tang_exp=False, sr_store=False, fp32_softmax=False):  # fmt: skip
        self.name, self.text = name, text
        self.rational_erf, self.fma_ln, self.scaled_norm, self.log1p_ce = rational_erf, fma_ln, scaled_norm, log1p_ce
        self.sym_sigmoid, self.tang_exp, self.sr_store, self.fp32_softmax = (
            sym_sigmoid,
            tang_exp,
            sr_store,
            fp32_softmax,
        )
        self.gen = torch.Generator().manual_seed(SR_SEED)
        self._saved: dict = {}

    def install(self) -> None:
        super().install()
        self.gen = torch.Generator().manual_seed(SR_SEED)

    # -- GELU ------------------------------------------------------------------------------------------------------
    def gelu_fn(self, input, approximate="none"):
        return common.gelu_with(_STOCK["gelu"], input, approximate, rational_gelu, rational_gelu_grad)

    # -- normalisation, norms ----------------------------------------------------------------------------------
    def layer_norm_fn(self, input, normalized_shape, weight=None, bias=None, eps=1e-5):
        out = _STOCK["layer_norm"](input, normalized_shape, weight, bias, eps)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            w = weight.detach() if weight is not None else None
            b = bias.detach() if bias is not None else None
            y = fma_layer_norm(input.detach(), tuple(normalized_shape), w, b, eps)
            _replace("layer_norm", out, y.to(out.dtype))
        return out

    def norm_fn(self, input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
        res = _STOCK["norm"](input, p, dim, keepdim, out=out, dtype=dtype)
        if p not in (2, 2.0, "fro") or dim is None or out is not None or dtype is not None:
            return res
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            _replace("norm", res, scaled_norm(input.detach(), dim, keepdim).to(res.dtype))
        return res

    # -- cross-entropy -----------------------------------------------------------------------------------------
    def cross_entropy_fn(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                         reduction="mean", label_smoothing=0.0):  # fmt: skip
        return common.cross_entropy_with(_STOCK["cross_entropy"], log1p_ce, input, target, weight, size_average,
                                         ignore_index, reduce, reduction, label_smoothing)  # fmt: skip

    # -- sigmoid, exp ------------------------------------------------------------------------------------------
    def sigmoid_fn(self, input, *, out=None):
        if out is not None:
            return _STOCK["sigmoid"](input, out=out)
        res = _STOCK["sigmoid"](input)
        if res.is_floating_point():
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                _replace("sigmoid", res, sym_sigmoid(input.detach()).to(res.dtype))
        return res

    def _exp(self, key, input, res):
        if res.is_floating_point() and not res.is_complex():
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                _replace(key, res, tang_exp(input.detach()).to(res.dtype))
        return res

    def exp_fn(self, input, *, out=None):
        if out is not None:
            return _STOCK["exp"](input, out=out)
        return self._exp("exp", input, _STOCK["exp"](input))

    def tensor_exp_fn(self):
        dev = self

        def exp(self):
            return dev._exp("Tensor.exp", self, _STOCK["Tensor.exp"](self))

        return exp

    # -- the autocast policy -----------------------------------------------------------------------------------
    def softmax_fn(self, input, dim=None, _stacklevel=3, dtype=None):
        if dtype is not None or not common.autocast_dtype() or input.dtype not in LOW:
            return _STOCK["softmax"](input, dim, _stacklevel, dtype)
        with torch.no_grad():
            stock = _STOCK["softmax"](input.detach(), dim, _stacklevel)
        res = _STOCK["softmax"](input, dim, _stacklevel, torch.float32)  # on the fp32 list: computed and kept fp32
        if rel_l2(res, stock.float()) > GUARD[stock.dtype]:
            raise AssertionError("device softmax: fp32 output %.3g from the stock one" % rel_l2(res, stock.float()))
        return res

    # -- installing --------------------------------------------------------------------------------------------
    def replacements(self) -> dict:
        out: dict = {}
        if self.rational_erf:
            out["gelu"] = self.gelu_fn
        if self.fma_ln:
            out["layer_norm"] = self.layer_norm_fn
        if self.scaled_norm:
            out["norm"] = self.norm_fn
        if self.log1p_ce:
            out["cross_entropy"] = self.cross_entropy_fn
        if self.sym_sigmoid:
            out["sigmoid"] = self.sigmoid_fn
        if self.tang_exp:
            out["exp"] = self.exp_fn
            out["Tensor.exp"] = self.tensor_exp_fn()
        if self.fp32_softmax:
            out["softmax"] = self.softmax_fn
        return out


DEVICES = {
    "Y": Device(
        "Y",
        "fp32 vision unit: exact GELU with erf by a rational approximation, LayerNorm's epilogue as one fused "
        "multiply-add with rstd folded into the weight, 2-norms scaled by the maximum (nrm2), cross-entropy with a "
        "log1p log-sum-exp",
        rational_erf=True,
        fma_ln=True,
        scaled_norm=True,
        log1p_ce=True,
    ),
    "Z": Device(
        "Z",
        "fp16-autocast unit: sigmoid in the two-sided form, exp by Tang's table-driven method, LayerNorm's epilogue "
        "as one fused multiply-add, cross-entropy with a log1p log-sum-exp",
        sym_sigmoid=True,
        tang_exp=True,
        fma_ln=True,
        log1p_ce=True,
    ),
    "AA": Device(
        "AA",
        "pure-bf16 unit: exp by Tang's table-driven method, sigmoid in the two-sided form, LayerNorm's epilogue as "
        "one fused multiply-add, parameters stored by the optimizer with stochastic rounding to bf16",
        tang_exp=True,
        sym_sigmoid=True,
        fma_ln=True,
        sr_store=True,
    ),
    "AB": Device(
        "AB",
        "bf16-autocast unit: exact GELU with erf by a rational approximation, LayerNorm's epilogue as one fused "
        "multiply-add, cross-entropy with a log1p log-sum-exp",
        rational_erf=True,
        fma_ln=True,
        log1p_ce=True,
    ),
    "AC": Device(
        "AC",
        "device AB under another autocast policy: softmax on the fp32 list (attention probabilities computed and "
        "output in fp32 where the reference's are bf16)",
        rational_erf=True,
        fma_ln=True,
        log1p_ce=True,
        fp32_softmax=True,
    ),
    "AD": Device(
        "AD",
        "the reference GPU rerun under another library version whose LayerNorm kernel has the fused multiply-add "
        "epilogue; everything else stock",
        fma_ln=True,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
def _inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "gelu": (torch.randn(4096, generator=g) * 2,),
        "layer_norm": (
            torch.randn(64, 32, generator=g) * 0.5 + 0.2,
            torch.randn(32, generator=g) * 0.1 + 1.0,
            torch.randn(32, generator=g) * 0.1,
        ),  # fmt: skip
        "norm": (torch.randn(4, 8, 8, 64, generator=g),),
        "cross_entropy": (torch.randn(64, 96, generator=g) * 2, torch.randint(0, 96, (64,), generator=g)),
        "sigmoid": (torch.randn(4096, generator=g) * 3,),
        "exp": (torch.randn(4096, generator=g) * 4,),
        "Tensor.exp": (torch.randn(4096, generator=g) * 4,),
        "softmax": (torch.randn(4, 17, 17, generator=g) * 2,),
    }


def _caller(key: str):
    """``_call`` of op ``key`` as ``call(fn, args)``."""
    return lambda fn, args: _call(fn, key, args)


def _call(fn, key: str, args: tuple):
    if key == "layer_norm":
        return fn(args[0], (args[0].shape[-1],), args[1], args[2], 1e-5)
    if key == "norm":
        return fn(args[0], 2, (1, 2), True)
    if key == "cross_entropy":
        return fn(args[0], args[1], label_smoothing=0.1)
    if key == "softmax":
        return fn(args[0], -1)
    return fn(*args)


# how each device runs in its family (make_pairs.py): the dtype each op sees ("autocast": bf16 autocast on fp32
# inputs; fp32 where not named)
SETTINGS = {
    "Y": {"gelu": None, "layer_norm": None, "norm": None, "cross_entropy": None},
    "Z": {"sigmoid": torch.float16, "Tensor.exp": None, "layer_norm": None, "cross_entropy": None},
    "AA": {"exp": None, "sigmoid": torch.bfloat16, "layer_norm": torch.bfloat16},
    "AB": {"gelu": torch.bfloat16, "layer_norm": None, "cross_entropy": None},
    "AC": {"softmax": "autocast"},
    "AD": {"layer_norm": None},
}
GRADS = ("gelu", "cross_entropy")


def measure(seed: int = 0, devices=None) -> list[dict]:
    """Per device (in its family's dtype) and op: relative L2 error against float64 of the stock kernel and of the
    device's, their relative L2 difference and the share of elements that differ; for GELU and the cross-entropy
    also the input gradients' difference (backward of sum(y * r), r fixed); the stochastic store's row: the
    parameters after three Lion-size updates against round-to-nearest's."""
    rows = []
    base = _inputs(seed)
    for dev in devices or DEVICES.values():
        for key, fn in dev.replacements().items():
            if key not in SETTINGS[dev.name]:
                continue  # a replacement the family never calls (or not measured apart: exp as Tensor.exp)
            setting = SETTINGS[dev.name][key]
            auto = setting == "autocast"
            dtype = setting if isinstance(setting, torch.dtype) else torch.float32
            if auto:
                dtype = torch.bfloat16  # the scores a bf16-autocast bmm hands the softmax
            args = tuple(t.to(dtype) if t.is_floating_point() else t for t in base[key])
            if key == "layer_norm":  # the weight and bias stay fp32 (the families' LayerNorm modules)
                args = (args[0],) + base[key][1:]
            name = "autocast" if auto else str(args[0].dtype).replace("torch.", "")
            call = _caller(key)
            rows.append(common.measure_op(dev.name, key, fn, _STOCK[key], call, args, auto, seed, key in GRADS, name))
        if dev.sr_store:
            rows.append(measure_store(dev, seed))
    return rows


def measure_store(dev, seed: int = 0) -> dict:
    """Device ``dev``'s stochastic store: bf16 parameters (64 x 32, values about 1 and about 0.02) after three
    updates of 1e-3 x a random sign, stored stochastically and to nearest; their relative L2 difference, the share
    of elements that differ."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.cat(
        [torch.ones(32, 32) + 0.1 * torch.randn(32, 32, generator=g), 0.02 * torch.randn(32, 32, generator=g)]
    )
    res = []
    for sr in (False, True):
        p = p0.to(torch.bfloat16)
        gen = torch.Generator().manual_seed(SR_SEED)
        steps = torch.Generator().manual_seed(seed + 1)
        for _ in range(3):
            new = p.float() - 1e-3 * torch.sign(torch.randn(p.shape, generator=steps))
            p = stochastic_round_bf16(new, gen) if sr else new.to(torch.bfloat16)
        res.append(p.double())
    return {
        "device": dev.name,
        "op": "store (optimizer)",
        "dtype": "bfloat16",
        "device_vs_stock": rel_l2(res[1], res[0]),
        "elements_differing": (res[1] != res[0]).float().mean().item(),
    }


COLS = common.COLS[:-1]


if __name__ == "__main__":
    common.print_table(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 0), COLS)

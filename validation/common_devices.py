"""The scaffolding the simulated devices of every validation set share (``validation/devices.py``,
``validation/v2/devices.py``, ``validation/v3/devices.py``, ``validation/v4/devices.py``): the guard that a
replacement changes values at the rounding level only, the tensor-hook plumbing of the gradients, installing and
uninstalling a device's replacements on the torch modules, and the printing of the measured magnitude tables. What
a set's devices compute (the mechanisms, the devices, the ops they replace) stays in the set's file.

How a device is installed: a replacement of a torch API function put on the ``torch`` modules before msprobe wraps
the API, so msprobe records it under the stock name; it runs the stock kernel first (the output keeps the stock
autograd node) and overwrites the values; gradients go through tensor hooks on aliases of the inputs. A guard raises
when a replacement differs from the stock kernel by more than a few roundings of the dtype.
"""

from __future__ import annotations

import threading

import torch

# ---------------------------------------------------------------------------------------------------------------
# guard and gradient plumbing
# ---------------------------------------------------------------------------------------------------------------
# the largest relative L2 difference from the stock kernel a replacement may make: a few roundings of the dtype
GUARD = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_l2(got: torch.Tensor, stock: torch.Tensor) -> float:
    with torch.no_grad():
        a, b = got.detach().double(), stock.detach().double()
        finite = torch.isfinite(b)
        ref = b[finite].norm().item()
        return (a[finite] - b[finite]).norm().item() / max(ref, 1e-30)


def guard(name: str, got: torch.Tensor, stock: torch.Tensor, precision=None, table=None) -> torch.Tensor:
    """``got`` if it has the stock output's dtype, shape and finiteness and differs from it by at most the
    ``table``'s (default ``GUARD``) bound of ``precision`` (default: the dtype); else AssertionError."""
    if got.dtype != stock.dtype or got.shape != stock.shape:
        raise AssertionError("device %s: %s %s vs stock %s %s" % (name, got.dtype, got.shape, stock.dtype, stock.shape))
    if not torch.equal(torch.isfinite(got), torch.isfinite(stock)):
        raise AssertionError("device %s: finiteness differs from the stock kernel" % name)
    err = rel_l2(got, stock)
    if err > (GUARD if table is None else table).get(precision or stock.dtype, 2e-2):
        raise AssertionError("device %s: rel_l2 %.3g from the stock kernel" % (name, err))
    return got


def replace(name: str, out: torch.Tensor, noisy: torch.Tensor, precision=None, table=None) -> None:
    """Overwrite the stock output's values with the device's (after the guard)."""
    guard(name, noisy, out, precision, table)
    out.data.copy_(noisy)


def alias(t):
    """A view of a tensor that needs a gradient, to hang a gradient hook on; other values as they are."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
        return t.view_as(t)
    return t


def quiet(fn):
    """Run a backward hook with msprobe's recording off (its torch calls are the device's, not the model's)."""

    def run(*args):
        try:
            from msprobe.core.dump.hook_manager import BaseHookManager
        except ImportError:  # pragma: no cover - msprobe absent: nothing records
            with torch.no_grad():
                return fn(*args)
        tid = threading.get_ident()
        old = BaseHookManager.inner_switch[tid]
        BaseHookManager.inner_switch[tid] = True
        try:
            with torch.no_grad():
                return fn(*args)
        finally:
            BaseHookManager.inner_switch[tid] = old

    return run


class GradOut:
    """Keeps the gradient arriving at an output (a tensor hook that changes nothing)."""

    def __init__(self, out: torch.Tensor):
        self.g = None
        out.register_hook(quiet(self._keep))

    def _keep(self, g):
        self.g = g.detach()


def autocast_dtype():
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def normalized(d: torch.Tensor, var: torch.Tensor, eps: float, normalized_shape, weight, bias) -> torch.Tensor:
    """A LayerNorm's last step in fp32, from the centred input ``d`` (rows flattened) and its variance: scaled by
    rsqrt(var + eps), unflattened to ``normalized_shape``, then the weight and the bias."""
    y = (d * torch.rsqrt(var + eps)).unflatten(-1, tuple(normalized_shape))
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def linear_with(stock, input, weight, bias, put, grad_x, grad_w) -> torch.Tensor:
    """A linear's replacement (sets 1 to 3): the stock kernel runs (its autograd node kept); ``put(out, x, w, b)``
    overwrites its values from the operands in the autocast dtype; where an operand needs a gradient, tensor hooks
    replace the stock gradients: ``grad_x(gy, w, gx, cdt)`` (None: the input's stays stock) and ``grad_w(gy2, x2, gw,
    cdt)`` (gy and x as rows), ``cdt`` the compute dtype."""
    cast = autocast_dtype()
    x_in, w_in = alias(input), alias(weight)
    out = stock(x_in, w_in, bias)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        x, w = input.detach(), weight.detach()
        b = bias.detach() if bias is not None else None
        if cast is not None:
            x, w = x.to(cast), w.to(cast)
            b = b.to(cast) if b is not None else None
        put(out, x, w, b)
    if out.requires_grad:
        g = GradOut(out)
        cdt = cast or out.dtype
        if x_in is not input and grad_x is not None:
            x_in.register_hook(quiet(lambda gx: grad_x(g.g, w, gx, cdt)))
        if w_in is not weight:
            n, k = w.shape
            w_in.register_hook(quiet(lambda gw: grad_w(g.g.reshape(-1, n), x.reshape(-1, k), gw, cdt)))
    return out


def matmul_with(stock, input, other, out, product, put, grad) -> torch.Tensor:
    """A matmul's replacement (sets 1 to 3) on operands of 2 or more dimensions (anything else stays stock): the
    operands in the autocast dtype, the stock output's values replaced by ``put(res, product(a, b))``; where an
    operand needs a gradient (and the batch dimensions match), its gradient ``grad(name, product(...), stock
    gradient, compute dtype)`` from the device's product of the arriving gradient and the other operand."""
    if out is not None or input.dim() < 2 or other.dim() < 2:
        return stock(input, other, out=out)
    cast = autocast_dtype()
    a_in, b_in = alias(input), alias(other)
    res = stock(a_in, b_in)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        a, b = input.detach(), other.detach()
        if cast is not None:
            a, b = a.to(cast), b.to(cast)
        put(res, product(a, b))
    if res.requires_grad and a.shape[:-2] == b.shape[:-2]:
        g = GradOut(res)
        cdt = cast or res.dtype
        if a_in is not input:
            a_in.register_hook(quiet(lambda ga: grad("matmul da", product(g.g, b.transpose(-1, -2)), ga, cdt)))
        if b_in is not other:
            b_in.register_hook(quiet(lambda gb: grad("matmul db", product(a.transpose(-1, -2), g.g), gb, cdt)))
    return res


def gelu_with(stock, input, approximate: str, values, derivative) -> torch.Tensor:
    """An exact GELU's replacement (sets 5 and 6): the stock kernel's output (its autograd node kept) overwritten
    with ``values(x)`` and, where the input needs a gradient, the input gradient the arriving gradient times
    ``derivative(x)`` (both fp32); a tanh GELU stays stock."""
    if approximate != "none":
        return stock(input, approximate=approximate)
    x_in = alias(input)
    out = stock(x_in)
    x = input.detach()
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        replace("gelu", out, values(x).to(out.dtype))
    if x_in is not input and out.requires_grad:
        grad = GradOut(out)

        def dx(gx):
            return guard("gelu dx", (grad.g.float() * derivative(x)).to(gx.dtype), gx)

        x_in.register_hook(quiet(dx))
    return out


def cross_entropy_with(stock, loss_and_grad, input, target, weight, size_average, ignore_index, reduce, reduction,
                       label_smoothing) -> torch.Tensor:  # fmt: skip
    """A cross-entropy's replacement (sets 5 and 6) on 2-d logits, integer targets, the mean and no class weights
    (anything else stays stock): the stock kernel's output overwritten with the loss of ``loss_and_grad(x, target,
    label_smoothing, ignore_index)`` (loss, input gradient per unit loss gradient; fp32), the input gradient that
    gradient times the arriving one."""
    args = (weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    plain = weight is None and size_average is None and reduce is None and reduction == "mean"
    if not plain or input.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        return stock(input, target, *args)
    x_in = alias(input)
    out = stock(x_in, target, *args)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        loss, grad_x = loss_and_grad(input.detach(), target, label_smoothing, ignore_index)
        replace("cross_entropy", out, loss.to(out.dtype))
    if x_in is not input and out.requires_grad:
        grad = GradOut(out)
        x_in.register_hook(quiet(lambda gx: guard("cross_entropy dx", (grad.g.float() * grad_x).to(gx.dtype), gx)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# installing
# ---------------------------------------------------------------------------------------------------------------
class Installed:
    """A device's install and uninstall: each of ``replacements()`` (op key -> function) put on its place in
    ``TARGETS`` (op key -> (module, attribute)), the stock function kept in ``self._saved`` until uninstall; a set
    that asks which device is installed (sets 5 and 6) keeps them in its ``STACK``."""

    TARGETS: dict = {}
    STACK: list | None = None  # a set's list of its devices installed now, last the current (None: not kept)

    def replacements(self) -> dict:
        raise NotImplementedError

    def _wrap(self, mod, fn):
        """The function put on ``mod`` for ``fn`` (a set whose replacements go on ``torch.Tensor`` binds them)."""
        return fn

    def install(self) -> None:
        for key, fn in self.replacements().items():
            mod, attr = self.TARGETS[key]
            self._saved[key] = getattr(mod, attr)
            setattr(mod, attr, self._wrap(mod, fn))
        if self.STACK is not None:
            self.STACK.append(self)

    def uninstall(self) -> None:
        for key, fn in self._saved.items():
            mod, attr = self.TARGETS[key]
            setattr(mod, attr, fn)
        self._saved.clear()
        if self.STACK is not None and self in self.STACK:
            self.STACK.remove(self)


# ---------------------------------------------------------------------------------------------------------------
# measured magnitudes (docs/validation.md)
# ---------------------------------------------------------------------------------------------------------------
COLS = [
    "device",
    "op",
    "dtype",
    "stock_vs_f64",
    "device_vs_f64",
    "device_vs_stock",
    "elements_differing",
    "grad_device_vs_stock",
    "wgrad_device_vs_stock",
]


def magnitudes(device: str, op: str, dtype: str, exact, stock, got, rel=rel_l2) -> dict:
    """One row of a magnitude table: the stock kernel's and the device's relative L2 error against float64
    (``exact``), their relative L2 difference and the share of elements that differ."""
    return {
        "device": device,
        "op": op,
        "dtype": dtype,
        "stock_vs_f64": rel(stock, exact),
        "device_vs_f64": rel(got, exact),
        "device_vs_stock": rel(got, stock),
        "elements_differing": (got.double() != stock.double()).float().mean().item(),
    }


def measure_op(device: str, op: str, fn, stock_fn, call, args: tuple, auto: bool, seed: int, grad: bool,
               dtype_name: str | None = None) -> dict:  # fmt: skip
    """One row of a magnitude table (sets 5 and 6): ``call(f, args)`` with the stock function and with the device's
    replacement ``fn`` (under bf16 autocast where ``auto``) against the stock function in float64 (``magnitudes``);
    with ``grad`` also the input gradients' difference (a backward of sum(y * r), r fixed, seeded ``seed`` + 1).
    ``dtype_name``: the row's dtype (default: "autocast" or the stock output's)."""
    with torch.no_grad():
        exact = call(stock_fn, tuple(t.double() if t.is_floating_point() else t for t in args))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=auto):
            stock = call(stock_fn, args)
            got = call(fn, args)
    name = dtype_name or ("autocast" if auto else str(stock.dtype).replace("torch.", ""))
    row = magnitudes(device, op, name, exact, stock.float(), got.float())
    if grad:
        r = torch.randn(stock.shape, generator=torch.Generator().manual_seed(seed + 1))
        grads = []
        for f in (stock_fn, fn):
            leaf = args[0].detach().clone().requires_grad_()
            (call(f, (leaf,) + args[1:]).float() * r).sum().backward()
            grads.append(leaf.grad)
        row["grad_device_vs_stock"] = rel_l2(grads[1], grads[0])
    return row


def fmt(v) -> str:
    return "%.2g" % v if isinstance(v, float) else str(v)


def print_table(rows, cols=COLS) -> None:
    """The rows as a markdown table of ``cols``."""
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")

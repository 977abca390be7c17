"""Replay recorded calls with torch on the CPU: rebuild the arguments, call the API in float64 and in the recorded
dtype, judge the recorded outputs. The only module of dumpstore that imports torch (inside its functions).

Arguments are rebuilt from the record: tensors from the dump's files through dumpstore's restricted readers (.pt
without unpickling code, .npy), scalars, slices, ellipsis, torch.Size, dtypes, devices (always the CPU here),
None, nested lists and dicts. In the float64 replay every floating tensor and floating dtype argument becomes
float64; the same-dtype replay uses the recorded dtypes, under CPU autocast to the output's dtype when the
recorded inputs are wider than the recorded output (an autocast region of the run).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dumpstore.dtypes import canonical
from dumpstore.errors import DumpstoreError
from dumpstore.tensorfile import load_leaf

from .judge import judge
from .plan import AUTOCAST_FP32_OPS, Call, autocast_of, is_tensor_leaf


class NotReplayable(Exception):
    """This call cannot be replayed here (the reason is the message)."""


class NotFeasible(NotReplayable):
    """A backward record that cannot be recomputed here (a row `skipped`, not an error)."""


def init_worker() -> None:
    """Process initialiser: one intra-op thread per worker (the workers are the parallelism)."""
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def resolve(prefix: str, api: str):
    """The torch callable of a record's API (a Tensor method is called with self as the first argument)."""
    import torch

    where = {
        "Functional": torch.nn.functional,
        "Torch": torch,
        "Tensor": torch.Tensor,
        "VF": getattr(torch, "_VF", None),
    }
    if prefix == "Aten":
        name, _, overload = api.partition(".")
        packet = getattr(torch.ops.aten, name, None)
        fn = getattr(packet, overload, None) if overload and packet is not None else packet
    else:
        fn = getattr(where.get(prefix), api, None)
    if fn is None or not callable(fn):
        raise NotReplayable(f"torch has no {prefix}.{api} here")
    return fn


def _torch_dtype(name: str):
    import torch

    dt = getattr(torch, canonical(name), None)
    if not isinstance(dt, torch.dtype):
        raise NotReplayable(f"dtype {name!r} is not a torch dtype")
    return dt


class Loader:
    """Reads each tensor file of a call once and builds its arguments."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.cache: dict[str, Any] = {}
        self.grad_leaves: list[Any] | None = None  # when set, floating inputs recorded with requires_grad get a
        # fresh leaf requiring grad, appended here

    def tensor(self, leaf: dict):
        import torch

        name = leaf.get("data_name")
        if not name:
            raise NotReplayable("a tensor argument has no file (not dumped)")
        if name not in self.cache:
            try:
                arr, _, _ = load_leaf(self.folder, str(name))
            except DumpstoreError as exc:
                raise NotReplayable(str(exc)) from None
            t = torch.from_numpy(np.array(arr, copy=True)).to(_torch_dtype(str(leaf["dtype"])))
            shape = leaf.get("shape")
            if isinstance(shape, list) and list(t.shape) != shape:
                t = t.reshape(shape) if t.numel() == int(np.prod(shape)) else t
            self.cache[name] = t
        return self.cache[name]

    def build(self, v: Any, golden: bool, cast: Any = None) -> Any:
        """The record value `v` as a call argument: float64 tensors and dtypes when `golden`, floating tensors in
        the torch dtype `cast` when given."""
        import torch

        if v is None:
            return None
        if isinstance(v, list):
            return [self.build(x, golden, cast) for x in v]
        if not isinstance(v, dict):
            raise NotReplayable(f"unexpected record value {v!r}")
        if is_tensor_leaf(v):
            t = self.tensor(v)
            t = t.double() if golden and t.is_floating_point() else t
            t = t.to(cast) if cast is not None and t.is_floating_point() else t
            if self.grad_leaves is not None and t.is_floating_point() and v.get("requires_grad"):
                t = t.detach().clone().requires_grad_(True)
                self.grad_leaves.append(t)
            return t
        kind = v.get("type")
        if kind is None and "class_type" not in v:
            return {k: self.build(x, golden, cast) for k, x in v.items()}
        value: Any = v.get("value")
        if kind in ("int", "float", "bool", "str") or str(kind).startswith(("int", "float", "uint", "bool")):
            return value if kind in ("str", "bool") else _number(value, str(kind))
        if kind == "slice":
            return slice(*value)
        if kind == "ellipsis":
            return Ellipsis
        if kind == "torch.Size":
            return torch.Size(value)
        if kind == "torch.dtype":
            dt = _torch_dtype(str(value))
            return torch.float64 if golden and dt.is_floating_point else dt
        if kind == "torch.device":
            return torch.device("cpu")
        raise NotReplayable(f"argument of type {kind!r} cannot be rebuilt")


def _number(value: Any, kind: str) -> Any:
    if isinstance(value, str):  # 'inf', 'nan' written as text by some dumpers
        return float(value)
    return int(value) if kind.startswith(("int", "uint")) and isinstance(value, (int, float)) else value


def _flat_outputs(v: Any, out: list) -> list:
    """Tensor leaves (or None) of an output structure, in msprobe's order (lists, tuples, dict values)."""
    import torch

    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _flat_outputs(x, out)
    elif isinstance(v, dict):
        for x in v.values():
            _flat_outputs(x, out)
    else:
        out.append(None)
    return out


def _flat_recorded(v: Any, path: list[str], out: list) -> list:
    """(index path, leaf) of the recorded output structure in the same order as _flat_outputs."""
    if is_tensor_leaf(v):
        out.append((".".join(path), v))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _flat_recorded(x, [*path, str(i)], out)
    elif isinstance(v, dict) and "type" not in v:
        for k, x in v.items():
            _flat_recorded(x, [*path, str(k)], out)
    else:
        out.append((".".join(path), None))
    return out


def _autocast_dtype(body: dict[str, Any], api: str):
    """The torch dtype of the CPU autocast region the call ran in (plan.autocast_of), or None."""
    low = autocast_of(body, api)
    return None if low is None else _torch_dtype(low)


_MALFORMED = (TypeError, ValueError, KeyError, AttributeError, OverflowError, RuntimeError)


def _rebuilt(loader: Loader, value: Any, golden: bool, cast: Any = None) -> Any:
    """`loader.build`, a malformed record value (a slice of text, a shape of strings) as NotReplayable."""
    try:
        return loader.build(value, golden, cast)
    except _MALFORMED as exc:
        raise NotReplayable(f"malformed argument in the record ({type(exc).__name__}: {str(exc)[:120]})") from None


def _index(index: list, body: dict[str, Any]) -> Any:
    """msprobe records a tuple index as a list: a list of slices, None, Ellipsis or tensors was a tuple; a list of
    ints was a tuple when the recorded output drops one dimension per int (x[0, 1]), else a list (x[[0, 1]])."""
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in index):
        return tuple(index)
    ins = [leaf for _, leaf in _flat_recorded(body.get("input_args"), [], []) if leaf]
    outs = [leaf for _, leaf in _flat_recorded(body.get("output"), [], []) if leaf]
    if ins and outs and len(ins[0].get("shape", [])) - len(index) == len(outs[0].get("shape", [])):
        return tuple(index)
    return index


def _call(fn, call: Call, loader: Loader, golden: bool, body: dict[str, Any] | None = None, low: Any = None):
    """Call the API with the record's arguments: in float64 (`golden`), in the recorded dtypes, or with its floating
    inputs in the torch dtype `low` (what a device's autocast policy running the op at that dtype computes)."""
    import contextlib

    import torch

    body = call.body if body is None else body
    args = _rebuilt(loader, body.get("input_args") or [], golden, low)
    kwargs = _rebuilt(loader, body.get("input_kwargs") or {}, golden, low)
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise NotReplayable("input_args is not a list or input_kwargs not an object")
    try:
        if call.api == "__getitem__" and len(args) == 2 and isinstance(args[1], list):
            args[1] = _index(args[1], body)
        cast = None if golden or low is not None else _autocast_dtype(body, call.api)
    except _MALFORMED as exc:
        raise NotReplayable(f"malformed record ({type(exc).__name__}: {str(exc)[:120]})") from None
    ctx = torch.autocast("cpu", dtype=cast) if cast is not None else contextlib.nullcontext()
    try:
        with torch.set_grad_enabled(loader.grad_leaves is not None), ctx:
            return fn(*args, **kwargs)
    except Exception as exc:  # the API refused the rebuilt arguments: a fact about this call, not a bug here
        raise NotReplayable(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from None


def replay_call(call: Call) -> list[dict[str, Any]]:
    """Rows of the replay table for one call: one per recorded output leaf, or one row saying why not."""
    base = {
        "step": call.step,
        "rank": call.rank,
        "seq": call.seq,
        "record": call.record,
        "prefix": call.prefix,
        "api": call.api,
        "direction": call.direction,
    }
    if call.skip is not None:
        return [{**base, "status": "skipped", "reason": call.skip}]
    loader = Loader(call.folder)
    if call.direction == "backward":
        try:
            return _replay_backward(base, call, loader)
        except NotFeasible as exc:
            return [{**base, "status": "skipped", "reason": f"backward record: {exc}"}]
        except NotReplayable as exc:
            return [{**base, "status": "error", "reason": f"not replayable: {exc}"}]
    try:
        fn = resolve(call.prefix, call.api)
        golden = _flat_outputs(_call(fn, call, loader, golden=True), [])
        same = _flat_outputs(_call(fn, call, loader, golden=False), [])
        recorded = _flat_recorded(call.body.get("output"), [], [])
        if len(recorded) != len(golden):
            raise NotReplayable(f"the replay gave {len(golden)} outputs, the record has {len(recorded)}")
        low = _low_outputs(fn, call, loader, len(golden))
        return [row for row in _judged(base, call, loader, recorded, golden, same, low) if row is not None]
    except NotReplayable as exc:
        return [{**base, "status": "error", "reason": f"not replayable: {exc}"}]


def _policy_op(call: Call) -> bool:
    """A call in an autocast run whose precision there is a device's policy (plan.AUTOCAST_FP32_OPS)."""
    return call.autocast is not None and call.api.split(".")[0] in AUTOCAST_FP32_OPS


def _low_outputs(fn, call: Call, loader: Loader, n: int) -> list[Any]:
    """In a run under autocast, a call that shows no cast of its own (fp32 in, fp32 out) may have been run at the
    autocast dtype by the device's autocast policy (LayerNorm at bf16 where the GPU runs it in fp32): its outputs
    with the floating inputs cast to that dtype, for the benchmark. Nones otherwise, or when that call fails."""
    if not _policy_op(call) or autocast_of(call.body, call.api) is not None:
        return [None] * n
    try:
        out = _flat_outputs(_call(fn, call, loader, golden=False, low=_torch_dtype(str(call.autocast))), [])
    except NotReplayable:
        return [None] * n
    return out if len(out) == n else [None] * n


def _judged(base, call: Call, loader: Loader, recorded, golden, same, low=None):
    low = low or [None] * len(recorded)
    for (path, leaf), g, c, lo in zip(recorded, golden, same, low):
        if leaf is None:
            continue
        dtype = str(canonical(leaf["dtype"]))
        row = {**base, "output": path, "name": f"{call.record}.output.{path}", "dtype": dtype}
        row["shape"] = leaf.get("shape") if isinstance(leaf.get("shape"), list) else None
        if g is None or c is None:
            yield {**row, "status": "error", "reason": "the replay gave no tensor at this output"}
            continue
        try:
            run = _rebuilt(loader, leaf, False)
        except NotReplayable as exc:
            yield {**row, "status": "error", "reason": f"recorded output unreadable: {exc}"}
            continue
        if tuple(run.shape) != tuple(g.shape) or tuple(c.shape) != tuple(g.shape):
            reason = f"shape {list(run.shape)} recorded, {list(g.shape)} replayed"
            yield {**row, "status": "error", "reason": reason}
            continue
        if str(canonical(str(c.dtype).replace("torch.", ""))) != dtype:
            reason = f"the CPU replay's output is {c.dtype}, the record's {dtype}"
            yield {**row, "status": "error", "reason": reason}
            continue
        arrays = [_f64(x) for x in (run, c, g)]
        if (
            lo is not None
            and lo.is_floating_point()
            and tuple(lo.shape) == tuple(g.shape)
            and dtype in ("float32", "float64")
        ):
            row["autocast"] = call.autocast
            yield {**row, **judge(call.api, dtype, *arrays, low=_f64(lo))}
            continue
        yield {**row, **judge(call.api, dtype, *arrays)}


def _gradients(fn, call: Call, loader: Loader, golden: bool, n_out: int, low: Any = None) -> list[Any]:
    """The backward record's outputs recomputed: the forward run again from the recorded inputs (float64 or the
    recorded dtype) and differentiated with the recorded output gradient. msprobe hooks the autograd node of the API's
    first output tensor (`grad_fn.register_hook`) and records that node's gradient inputs; the same hook here gives
    the same slots, whatever the node (an addmm behind linear, a view behind a 3-d matmul)."""
    import torch

    loader.grad_leaves = []
    try:
        out = _flat_outputs(_call(fn, call, loader, golden, body=call.body["forward"], low=low), [])
    finally:
        loader.grad_leaves = None
    first = next((t for t in out if t is not None), None)
    if first is None or first.grad_fn is None:
        raise NotFeasible("the forward's first output does not depend on an input that requires grad")
    captured: list[Any] = []
    first.grad_fn.register_hook(lambda grad_inputs, grad_outputs: captured.append(grad_inputs))
    (grad_leaf,) = [x for x in _flat_recorded(call.body.get("input"), [], []) if x[1] is not None]
    g = _rebuilt(loader, grad_leaf[1], False)
    g = g.double() if golden else g.to(first.dtype)
    try:
        torch.autograd.backward(first, grad_tensors=g)
    except RuntimeError as exc:
        raise NotReplayable(f"differentiating the forward failed: {str(exc).splitlines()[0][:200]}") from None
    if len(captured) != 1 or len(captured[0]) != n_out:
        got = len(captured[0]) if captured else 0
        raise NotFeasible(f"the output's autograd node has {got} gradient inputs, the record {n_out}")
    return list(captured[0])


def _replay_backward(base: dict[str, Any], call: Call, loader: Loader) -> list[dict[str, Any]]:
    fn = resolve(call.prefix, call.api)
    recorded = _flat_recorded(call.body.get("output"), [], [])
    golden = _gradients(fn, call, loader, True, len(recorded))
    same = _gradients(fn, call, loader, False, len(recorded))
    low: list[Any] = [None] * len(recorded)
    if _policy_op(call) and autocast_of(call.body["forward"], call.api) is None:
        try:  # as for the forward (_low_outputs): the gradients of the op run at the autocast dtype
            low = _gradients(fn, call, loader, False, len(recorded), low=_torch_dtype(str(call.autocast)))
        except NotReplayable:
            pass
    return [row for row in _judged(base, call, loader, recorded, golden, same, low) if row is not None]


def _f64(t) -> np.ndarray:
    import torch

    if t.is_complex():
        raise NotReplayable("complex output")
    return t.detach().to(torch.float64).reshape(-1).numpy()


def replay_batch(calls: list[Call]) -> list[dict[str, Any]]:
    """Replay calls one after the other (a worker's task); rows in the calls' order."""
    init_worker()
    rows: list[dict[str, Any]] = []
    for call in calls:
        rows.extend(replay_call(call))
    return rows

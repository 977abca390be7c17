"""Which recorded calls of a run are replayed, and which are skipped and why (no torch here).

The records come from the run's dump.json files, found again under the catalog's `source_path` (like `--exact`);
each call carries its JSON record (arguments, keyword arguments, outputs) and the folder its tensor files lie in.
Identical calls (same API, same arguments, same input and output file contents by the store's content hashes)
are replayed once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dumpstore.dtypes import canonical
from dumpstore.errors import DumpFormatError, DumpstoreError
from dumpstore.layout import find_units
from dumpstore.store import Store

# prefix -> where the API lives in torch (worker.resolve); others have no CPU implementation here
REPLAYABLE_PREFIXES = ("Functional", "Torch", "Tensor", "Aten", "VF")
RANDOM_APIS = frozenset(
    {
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "native_dropout",
        "fused_dropout",
        "rrelu",
        "gumbel_softmax",
        "bernoulli",
        "multinomial",
        "normal",
        "poisson",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "uniform",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "random",
    }
)
SIDE_EFFECT_APIS = frozenset(
    {
        "__setitem__",
        "__delitem__",
        "backward",
        "register_hook",
        "retain_grad",
        "record_stream",
        "set_",
        "manual_seed",
        "seed",
        "set_rng_state",
        "pin_memory",
        "share_memory_",
        "data_ptr",
        "untyped_storage",
        "storage",
        "numpy",
        "tolist",
        "item",
    }
)


@dataclass
class Call:
    """One recorded forward call to replay (or skip, with `skip` saying why)."""

    step: int
    rank: int
    seq: int
    record: str
    prefix: str
    api: str
    direction: str
    folder: str  # the folder holding dump.json and dump_tensor_data/
    body: dict[str, Any] = field(repr=False)
    skip: str | None = None
    key: str | None = None  # identity of the call for replaying identical calls once
    autocast: str | None = None  # the run's autocast dtype (step and rank) where some of its calls show one


def parse_key(key: str) -> tuple[str, str, str] | None:
    """(prefix, api, direction) of an API record key `{Prefix}.{api}.{n}.{forward|backward}`; None otherwise."""
    parts = key.split(".")
    if len(parts) < 4 or parts[-1] not in ("forward", "backward") or not parts[-2].isdigit():
        return None
    return parts[0], ".".join(parts[1:-2]), parts[-1]


def skip_reason(prefix: str, api: str, direction: str, body: Any) -> str | None:
    """Why a record is not replayed, or None."""
    if prefix in ("Module", "Cell"):
        return "module record: the APIs inside it are replayed one by one"
    if prefix == "Distributed":
        return "communication: its result depends on the other ranks"
    if prefix not in REPLAYABLE_PREFIXES:
        return f"{prefix} API: no CPU implementation to replay it with"
    base = api.split(".")[0]
    if base.rstrip("_") in RANDOM_APIS or base.startswith(("rand", "_fused_dropout", "native_dropout")):
        return "random: its output depends on the generator's state"
    if "empty" in base:
        return "uninitialised memory: its output is whatever was there"
    if base in SIDE_EFFECT_APIS:
        return "side effect: the call's effect is not its output"
    if (base.endswith("_") and not base.startswith("__")) or (base.startswith("__i") and base.endswith("__")):
        return "in-place: the recorded input was overwritten by the call"
    if not isinstance(body, dict) or not isinstance(body.get("input_args", []), list):
        return "record without input_args"
    kwargs = body.get("input_kwargs") or {}
    if isinstance(kwargs, dict) and kwargs.get("out") is not None:
        return "writes into out=: in-place"
    if isinstance(kwargs, dict) and _positive(kwargs.get("dropout_p")):
        return "random: dropout_p > 0"
    if not any(_tensor_leaves(body.get("output"))):
        return "no tensor output to judge"
    return None


def _positive(leaf: Any) -> bool:
    value = leaf.get("value") if isinstance(leaf, dict) else None
    return isinstance(value, (int, float)) and value > 0


def is_tensor_leaf(v: Any) -> bool:
    return isinstance(v, dict) and "dtype" in v and "shape" in v and "Tensor" in str(v.get("type", "Tensor"))


def _tensor_leaves(v: Any):
    if is_tensor_leaf(v):
        yield v
    elif isinstance(v, list):
        for x in v:
            yield from _tensor_leaves(x)
    elif isinstance(v, dict) and "type" not in v:
        for x in v.values():
            yield from _tensor_leaves(x)


def load_records(path: Path) -> tuple[str, str, dict[str, Any]]:
    """(task, framework, data) of a dump.json."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise DumpFormatError(f"{path}: cannot read it as JSON ({exc}); re-copy the dump") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise DumpFormatError(f"{path}: no 'data' object; not an msprobe dump.json")
    return str(doc.get("task", "")), str(doc.get("framework", "pytorch")), doc["data"]


class ReplayError(DumpstoreError):
    """A run that cannot be replayed (statistics mode, another framework, dump folder gone)."""


def check_replayable(store: Store, run: str) -> dict[str, Any]:
    """The run's catalog row, or ReplayError saying in one line why it cannot be replayed."""
    info = store.run_info(run)
    mode = str(info.get("dump_mode") or "")
    if mode != "tensor":
        raise ReplayError(
            f"run {run!r} is a {mode or 'non-tensor'}-mode dump: replay needs the recorded tensors (msprobe task "
            "'tensor'); inputs generated within the recorded min/max would test this machine, not what the run "
            "computed, so replay refuses it; dump the steps of interest again with task tensor"
        )
    if str(info.get("framework")) not in ("pytorch", "None", ""):
        raise ReplayError(f"run {run!r} is a {info.get('framework')} dump: replay calls PyTorch APIs only")
    root = str(info.get("source_path") or "")
    if not root or not Path(root).exists():
        raise ReplayError(
            f"run {run!r}: its dump folder {root or '(unknown)'} is gone; replay reads the tensor files: put the "
            f"dump back there or re-ingest it from where it is (dumpstore ingest PATH --run {run})"
        )
    return info


def plan_calls(
    store: Store, run: str, *, steps: list[int] | None = None, op_types: list[str] | None = None
) -> list[Call]:
    """Every API record of the run's tensor dump in execution order (step, rank, seq), with skip reasons."""
    info = check_replayable(store, run)
    calls: list[Call] = []
    for unit in find_units(str(info["source_path"]), quiet=True):
        if unit.kind != "dump" or (steps is not None and unit.step not in steps):
            continue
        task, framework, data = load_records(unit.path)
        if task != "tensor":
            continue
        for seq, (record, body) in enumerate(data.items()):
            parsed = parse_key(record)
            if parsed is None:
                continue
            prefix, api, direction = parsed
            if op_types and api not in op_types and f"{prefix}.{api}" not in op_types:
                continue
            if direction == "backward":
                body, skip = backward_body(data.get(record[: -len("backward")] + "forward"), body)
                skip = skip or skip_reason(prefix, api, direction, body["forward"])
            else:
                skip = skip_reason(prefix, api, direction, body)
            if skip is None and framework not in ("pytorch", ""):
                skip = f"{framework} record: replay calls PyTorch APIs only"
            folder = str(unit.path.parent)
            calls.append(Call(unit.step, unit.rank, seq, record, prefix, api, direction, folder, body, skip))
    calls.sort(key=lambda c: (c.step, c.rank, c.seq))
    _mark_autocast(calls)
    return calls


LOW = ("float16", "bfloat16")
# the ops CUDA autocast runs in float32 ("CUDA Ops that can autocast to float32", torch.amp docs): how precisely they
# run under autocast is a device's policy (one may run LayerNorm in bf16), so replay also benchmarks them at the
# autocast dtype; any other op is judged as recorded
AUTOCAST_FP32_OPS = frozenset(
    {
        "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
        "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist",
        "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
        "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss",
        "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod",
        "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus",
        "sum", "renorm", "tan", "triplet_margin_loss", "rms_norm", "native_layer_norm", "_softmax",
        "_log_softmax",
    }
)  # fmt: skip


def _dtypes(v: Any) -> set[str]:
    return {str(canonical(str(leaf.get("dtype")))) for leaf in _tensor_leaves(v)}


CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as", "_to_copy", "_cast_Float"})


def _names_dtype(v: Any) -> bool:
    if isinstance(v, dict):
        return v.get("type") == "torch.dtype" or ("type" not in v and any(_names_dtype(x) for x in v.values()))
    return isinstance(v, list) and any(_names_dtype(x) for x in v)


def autocast_of(body: Any, api: str) -> str | None:
    """The autocast dtype a forward record shows, or None: its floating inputs and outputs mix one low-precision
    dtype (fp16/bf16) with a wider one (autocast casts inside the op: a bf16 linear of fp32 weights, an fp32
    cross_entropy of bf16 logits), and not because the call asked for a dtype (a cast, `softmax(dtype=...)`)."""
    if not isinstance(body, dict) or api.split(".")[0] in CASTS:
        return None
    if _names_dtype([body.get("input_args"), body.get("input_kwargs") or {}]):
        return None
    floats = _dtypes([body.get("input_args"), body.get("input_kwargs") or {}, body.get("output")])
    low = sorted(floats & set(LOW))
    return low[0] if len(low) == 1 and floats & {"float32", "float64"} else None


def _mark_autocast(calls: list[Call]) -> None:
    """Each call of a step and rank where some forward call shows autocast gets that dtype (the most common one)."""
    seen: dict[tuple[int, int], dict[str, int]] = {}
    for c in calls:
        dt = autocast_of(c.body, c.api) if c.direction == "forward" and c.skip is None else None
        if dt is not None:
            counts = seen.setdefault((c.step, c.rank), {})
            counts[dt] = counts.get(dt, 0) + 1
    for c in calls:
        found = seen.get((c.step, c.rank))
        if found:
            c.autocast = max(found, key=lambda d: found[d])


def backward_body(forward: Any, body: Any) -> tuple[dict[str, Any], str | None]:
    """The body replayed for a backward record (its forward call, the gradients in and out), or why not: the replay
    recomputes the forward from the recorded inputs and differentiates it with the record's one input gradient,
    which belongs to the forward's first output tensor (msprobe hooks that tensor's autograd node)."""
    if not isinstance(forward, dict) or not isinstance(body, dict):
        return {"forward": {}}, "backward record without its forward record"
    out = {"forward": forward, "input": body.get("input"), "output": body.get("output")}
    grads_in = list(_tensor_leaves(body.get("input")))
    outs = list(_tensor_leaves(forward.get("output")))
    if len(grads_in) != 1 or not outs or grads_in[0].get("shape") != outs[0].get("shape"):
        return out, "backward record: not one output gradient of the forward's first output (a multi-output node)"
    if not any(_tensor_leaves(body.get("output"))):
        return out, "backward record without input gradients"
    return out, None


def call_keys(calls: list[Call], hashes: dict[tuple[int, int, str], str]) -> None:
    """Set each replayable call's identity: its API and arguments with every tensor leaf replaced by its dtype,
    shape and content hash (from the store); a call with a tensor leaf of unknown hash gets no key."""
    for c in calls:
        if c.skip is not None:
            continue
        missing: list[bool] = []

        def strip(v: Any, c: Call = c, missing: list[bool] = missing) -> Any:
            if is_tensor_leaf(v):
                h = hashes.get((c.step, c.rank, str(v.get("data_name"))))
                if h is None:
                    missing.append(True)
                return [v.get("dtype"), v.get("shape"), h]
            if isinstance(v, list):
                return [strip(x) for x in v]
            if isinstance(v, dict):
                return {k: strip(x) for k, x in v.items() if k not in ("Max", "Min", "Mean", "Norm", "md5")}
            return v

        body = {k: strip(v) for k, v in c.body.items()}
        key = json.dumps([c.prefix, c.api, body], sort_keys=True, default=str)
        c.key = None if missing else key

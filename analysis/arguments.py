"""How a record's non-tensor arguments are named: by msprobe's keyword, else by their position in torch's signature
of the op.  A leaf module (no imports from the rest of `analysis`), shared by the explanation and the signature rule."""

from __future__ import annotations

from typing import Any

# Positional parameter names of ops whose arguments msprobe records by position (`input.4`): torch's signatures
# (torch.nn.functional, torch, Tensor methods, torch_npu).  A keyword argument is recorded by name already.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
    "rms_norm": ("input", "normalized_shape", "weight", "eps"),
    "group_norm": ("input", "num_groups", "weight", "bias", "eps"),
    "batch_norm": ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    "instance_norm": (
        "input",
        "running_mean",
        "running_var",
        "weight",
        "bias",
        "use_input_stats",
        "momentum",
        "eps",
    ),
    "normalize": ("input", "p", "dim", "eps"),
    "npu_rms_norm": ("input", "gamma", "epsilon"),
    "gelu": ("input", "approximate"),
    "softmax": ("input", "dim", "_stacklevel", "dtype"),
    "log_softmax": ("input", "dim", "_stacklevel", "dtype"),
    "dropout": ("input", "p", "training", "inplace"),
    "leaky_relu": ("input", "negative_slope", "inplace"),
    "elu": ("input", "alpha", "inplace"),
    "celu": ("input", "alpha", "inplace"),
    "softplus": ("input", "beta", "threshold"),
    "hardtanh": ("input", "min_val", "max_val", "inplace"),
    "silu": ("input", "inplace"),
    "relu": ("input", "inplace"),
    "linear": ("input", "weight", "bias"),
    "embedding": ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
    "scaled_dot_product_attention": ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"),
    "topk": ("input", "k", "dim", "largest", "sorted"),
    "masked_fill": ("input", "mask", "value"),
    "add": ("input", "other", "alpha"),
    "sub": ("input", "other", "alpha"),
    "rsub": ("input", "other", "alpha"),
    "mul": ("input", "other"),
    "div": ("input", "other", "rounding_mode"),
    "pow": ("input", "exponent"),
    "clamp": ("input", "min", "max"),
    "clip": ("input", "min", "max"),
    "cumsum": ("input", "dim", "dtype"),
    "sum": ("input", "dim", "keepdim", "dtype"),
    "mean": ("input", "dim", "keepdim", "dtype"),
    "cross_entropy": (
        "input",
        "target",
        "weight",
        "size_average",
        "ignore_index",
        "reduce",
        "reduction",
        "label_smoothing",
    ),
    "pad": ("input", "pad", "mode", "value"),
    "interpolate": ("input", "size", "scale_factor", "mode", "align_corners"),
    "conv1d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "conv2d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "conv3d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
}


def _op_type(row: dict[str, Any]) -> str:
    t = str(row.get("op_type") or "")
    return t.strip("_").removeprefix("npu_") if t not in SIGNATURES else t


def argument_name(row: dict[str, Any]) -> tuple[str, str]:
    """(name, how) of a non-tensor argument's leaf: its keyword as msprobe recorded it, else its position in the
    op's signature (`SIGNATURES`), else `argument N`."""
    idx = str(row.get("index_path") or "")
    head, _, rest = idx.partition(".")
    suffix = "".join(f"[{p}]" for p in rest.split(".")) if rest else ""
    if head and not head.isdigit():
        return head + suffix, "record"
    sig = SIGNATURES.get(_op_type(row)) or SIGNATURES.get(str(row.get("op_type") or ""))
    if head.isdigit() and sig and int(head) < len(sig):
        return sig[int(head)] + suffix, "signature"
    return f"argument {idx}", "position"

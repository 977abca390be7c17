"""Name mappings between runs: msprobe-style mapping files and built-in MindSpore -> PyTorch API names.

A mapping translates the *target's* record keys into the reference's namespace before alignment:
  module  `{path}.{Class}` renames, exact or substring (`fc2.Dense: fc2.Linear`), like msprobe `-cm`;
  api     `Prefix.api` renames (`Functional.flash_attention_score: NPU.npu_fusion_attention`), like `-am`;
  data    row-name pairs (`target row: reference row`), like msprobe `-dm`; applied after alignment to
          leaves that stayed unmatched.
A YAML file holds either one plain mapping (its kind inferred: row names contain `.input.`/`.output.`/
`.parameters`; API names start with a known prefix; the rest are module renames), a list of msprobe `-am`
entries (`ms_api`/`pt_api`), sections `data:`, `module:`, `api:`, or msprobe's `-lm` layer mapping
(`Class: {target child: reference child}`; see layer_mapping.py), which then decides the record pairs alone.
The built-in MindSpore mapping: Cell -> Module, Mint -> Torch, MintFunctional -> Functional,
`mindspore.ops` functions (Functional.*) -> torch.nn.functional when it has the name, else torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dumpstore.errors import DumpstoreError
from dumpstore.names import MODULE_PREFIXES, parse_record

from .layer_mapping import is_layer_mapping

API_PREFIXES = (
    "Functional",
    "Torch",
    "Tensor",
    "NPU",
    "VF",
    "Aten",
    "Distributed",
    "MindSpeed",
    "Triton",
    "Mint",
    "MintFunctional",
    "Primitive",
    "Jit",
)
_NN_FUNCTIONAL = frozenset(
    (
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "adaptive_max_pool2d",
        "affine_grid",
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "batch_norm",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose2d",
        "cosine_embedding_loss",
        "cosine_similarity",
        "cross_entropy",
        "ctc_loss",
        "dropout",
        "elu",
        "embedding",
        "gelu",
        "glu",
        "group_norm",
        "gumbel_softmax",
        "hardsigmoid",
        "hardswish",
        "hardtanh",
        "hinge_embedding_loss",
        "instance_norm",
        "interpolate",
        "kl_div",
        "l1_loss",
        "layer_norm",
        "leaky_relu",
        "linear",
        "log_softmax",
        "logsigmoid",
        "margin_ranking_loss",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_unpool1d",
        "max_unpool2d",
        "max_unpool3d",
        "mish",
        "mse_loss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "multilabel_soft_margin_loss",
        "nll_loss",
        "normalize",
        "one_hot",
        "pad",
        "pdist",
        "pixel_shuffle",
        "pixel_unshuffle",
        "prelu",
        "relu",
        "relu6",
        "rms_norm",
        "scaled_dot_product_attention",
        "selu",
        "sigmoid",
        "silu",
        "smooth_l1_loss",
        "soft_margin_loss",
        "softmax",
        "softmin",
        "softplus",
        "softsign",
        "tanh",
        "tanhshrink",
        "unfold",
    )
)
_MS_RENAMES = {
    "Functional.dense": "Functional.linear",
    "Functional.bidense": "Functional.bilinear",
    "Functional.equal": "Torch.eq",
    "Functional.swapaxes": "Torch.transpose",
    "Tensor.asnumpy": "Tensor.numpy",
    "Tensor.equal": "Tensor.eq",
    "Tensor.swapaxes": "Tensor.transpose",
    "Tensor.gather_elements": "Tensor.gather",
    "Tensor.fill_diagonal": "Tensor.fill_diagonal_",
    "Tensor.cauchy": "Tensor.cauchy_",
}

_MS_CELLS = {"Dense": "Linear", "SequentialCell": "Sequential", "CellList": "ModuleList", "CellDict": "ModuleDict"}


@dataclass
class Mapping:
    module: dict[str, str] = field(default_factory=dict)
    api: dict[str, str] = field(default_factory=dict)
    data: dict[str, str] = field(default_factory=dict)
    layer: dict[str, dict[str, str]] = field(default_factory=dict)
    mindspore_to_pytorch: bool = False

    def __bool__(self) -> bool:
        return bool(self.module or self.api or self.data or self.layer or self.mindspore_to_pytorch)

    def record(self, key: str) -> str:
        """The reference-side name of a target record key."""
        r = parse_record(key)
        if r.prefix in MODULE_PREFIXES and r.direction in ("forward", "backward", "parameters_grad"):
            return self._module_key(key, r)
        if r.call is None or r.direction not in ("forward", "backward"):
            return key
        name = f"{r.prefix}.{r.api}"
        name = self.api.get(name, self._builtin_api(name))
        return f"{name}.{r.call}.{r.direction}"

    def _module_key(self, key: str, r) -> str:
        prefix = "Module" if (self.mindspore_to_pytorch and r.prefix == "Cell") else r.prefix
        path = r.api
        if self.mindspore_to_pytorch:
            head, _, cls = path.rpartition(".")
            path = f"{head}.{_MS_CELLS.get(cls, cls)}" if head else _MS_CELLS.get(cls, cls)
        if path in self.module:
            path = self.module[path]
        else:
            for old, new in self.module.items():
                path = path.replace(old, new)
        tail = key[len(r.prefix) + 1 + len(r.api) :]
        return f"{prefix}.{path}{tail}"

    def _builtin_api(self, name: str) -> str:
        if not self.mindspore_to_pytorch:
            return name
        if name in _MS_RENAMES:
            return _MS_RENAMES[name]
        prefix, _, api = name.partition(".")
        if prefix == "Mint":
            return f"Torch.{api}"
        if prefix == "MintFunctional":
            return f"Functional.{api}"
        if prefix == "Functional":
            return f"Functional.{api}" if api in _NN_FUNCTIONAL else f"Torch.{api}"
        return name


def load_mapping(paths: list[str | Path] | tuple = (), *, mindspore_to_pytorch: bool = False) -> Mapping:
    """Mapping from YAML files (see module doc) plus, optionally, the built-in MindSpore names."""
    m = Mapping(mindspore_to_pytorch=mindspore_to_pytorch)
    for p in paths:
        _merge(m, _read_yaml(Path(p)), Path(p))
    return m


def _read_yaml(path: Path):
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DumpstoreError(f"{path}: cannot read mapping file ({exc.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DumpstoreError(f"{path}: not a valid YAML mapping file ({first})") from None


def _merge(m: Mapping, doc, path: Path) -> None:
    if isinstance(doc, list):
        for entry in doc:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("ms_api"), str)
                and isinstance(entry.get("pt_api"), str)
            ):
                raise DumpstoreError(f"{path}: API mapping entries need 'ms_api' and 'pt_api' strings")
            m.api[entry["ms_api"]] = entry["pt_api"]
        return
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, (str, dict)) for k, v in doc.items()):
        raise DumpstoreError(
            f"{path}: expected a YAML mapping of names (target: reference) or sections data/module/api"
        )
    if set(doc) <= {"data", "module", "api"} and all(isinstance(v, dict) for v in doc.values()):
        for section, table in doc.items():
            getattr(m, section).update({str(k): str(v) for k, v in table.items()})
        return
    if is_layer_mapping(doc):
        _merge_layers(m, doc, path)
        return
    if any(isinstance(v, dict) for v in doc.values()):
        raise DumpstoreError(
            f"{path}: mixes names (target: reference) with nested tables; give either plain "
            "names, sections data/module/api, or an msprobe -lm layer mapping (Class: {child: child})"
        )
    for k, v in doc.items():
        _kind(m, k).update({k: str(v)})


def _merge_layers(m: Mapping, doc: dict, path: Path) -> None:
    """msprobe's -lm layer mapping: per layer class, target child name -> reference child name."""
    for cls, table in doc.items():
        bad = next((k for k, v in table.items() if not isinstance(k, str) or not isinstance(v, str)), None)
        if bad is not None or not table:
            raise DumpstoreError(
                f"{path}: layer mapping {cls!r} must map child names to child names "
                f"(e.g. 'ParallelAttention: {{qkv_proj: query_key_value}}'); {bad!r} is not"
            )
        m.layer.setdefault(cls, {}).update(table)


def _kind(m: Mapping, key: str) -> dict[str, str]:
    if any(io in key for io in (".input.", ".output.", ".parameters")):
        return m.data
    if key.split(".", 1)[0] in API_PREFIXES:
        return m.api
    return m.module

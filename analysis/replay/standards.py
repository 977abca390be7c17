"""Precision standards for replayed ops, per output dtype and op class, with their sources (docs/replay.md).

Sources (msprobe 26.2.0, `msprobe/pytorch/api_accuracy_checker/`):
- `precision_standard/standard_register.py::_get_standard_category`: a float output (fp16, bf16, fp32, fp64) is
  judged by the *benchmark* standard; an integer or bool output by *binary consistency*; fp8/hif8 by ULP or
  absolute thresholds (not replayed here: no CPU kernel of those dtypes to compare with).
- `precision_standard/standard_config.py` (StandardConfig): small_value, small_value_atol, the ratio floors
  (`_minmum_err`) and the per-level ratio thresholds (`get_benchmark_ratio_threshold`, L0/L1/L2 API lists).
- `precision_standard/benchmark_compare.py` and `compare/algorithm.py`: the metrics (small-value error ratio,
  RMSE, max and mean relative error, error balance) and `calc_ratio`.
The benchmark standard is msprobe's reading of CANN's operator precision standard for "benchmark" comparison
(算子精度标准, 标杆比对法): a device's error against a high-precision golden may be at most a fixed multiple of the
benchmark device's error against the same golden. Here the benchmark device is this CPU running the op in the
recorded dtype, the golden is the same op in float64 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

BENCHMARK = "benchmark"
BINARY = "binary"

# StandardConfig._small_value: |golden| at or below it is a small value (judged by absolute error)
SMALL_VALUE = {"float16": 2.0**-10, "bfloat16": 2.0**-10, "float32": 2.0**-20, "float64": 2.0**-20}
# StandardConfig._benchmark_small_value_atol: a small value is wrong when its absolute error exceeds it
SMALL_VALUE_ATOL = {"float16": 1e-16, "bfloat16": 1e-16, "float32": 2.0**-30, "float64": 2.0**-30}
# StandardConfig._minmum_err: calc_ratio's floor of the benchmark's error (x / max(y, floor))
RATIO_FLOOR = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-14, "float64": 2.0**-14}
# algorithm.get_abs_bench_with_eps: |golden| + eps in the relative error's denominator (eps of the golden's dtype
# in acc_check, which raises fp16 to fp32 and fp32 to fp64; bf16 uses CompareConst.BFLOAT16_EPS)
REL_EPS = {"float16": 2.0**-23, "bfloat16": 2.0**-8, "float32": 2.0**-52, "float64": 2.0**-52}

SMALL_VALUE_ERR, RMSE, MAX_REL_ERR, MEAN_REL_ERR = "small_value_err", "rmse", "max_rel_err", "mean_rel_err"
JUDGED = (SMALL_VALUE_ERR, RMSE, MAX_REL_ERR, MEAN_REL_ERR)  # error balance is computed, not judged (msprobe)

# StandardConfig.get_benchmark_ratio_threshold: ratio thresholds per API level; small_value from
# get_benchmark_threshold('small_value') = _small_value_threshold['error_threshold']
THRESHOLDS = {
    "L0": {SMALL_VALUE_ERR: 2.0, RMSE: 2.0, MAX_REL_ERR: 10.0, MEAN_REL_ERR: 2.0},
    "L1": {SMALL_VALUE_ERR: 2.0, RMSE: 1.5, MAX_REL_ERR: 5.0, MEAN_REL_ERR: 1.5},
    "L2": {SMALL_VALUE_ERR: 2.0, RMSE: 1.2, MAX_REL_ERR: 2.0, MEAN_REL_ERR: 1.2},
}
L1_APIS = frozenset({"embedding", "npu_fusion_attention_grad", "npu_fusion_attention", "scatter_", "scatter_add_"})
L2_APIS = frozenset(
    {
        "addmm",
        "npu_cross_entropy_loss",
        "npu_cross_entropy_loss_backward",
        "GELU",
        "layer_norm",
        "matmul",
        "mm",
        "index",
        "one_hot",
        "sum",
        "npu_rms_norm",
        "npu_rms_norm_backward",
        "nonzero",
    }
)

FLOAT_DTYPES = frozenset(SMALL_VALUE)

# replay's verdict on float outputs (docs/replay.md): the run's relative L2 error against float64 may be at most
# REPLAY_THRESHOLD times the CPU same-dtype output's, the latter floored at `rel_l2_floor`: half the dtype's unit
# roundoff (about the error of correct rounding alone, over many elements), larger for small outputs, whose error
# averages over few elements (a scalar one ulp off in another summation order must not fail). This is msprobe's
# RMSE ratio (RMSE over ||golden||/sqrt(n)) at its L0 threshold, with the floor taken relative to the output's size
# instead of msprobe's absolute `_minmum_err`.
REL_L2 = "rel_l2"
REPLAY_THRESHOLD = 2.0
# fp32/fp64: 4 unit roundoffs, the accuracy devices publish for their fp32 elementwise functions (CUDA's expf, erff,
# rsqrtf, tanhf: 2 ulp), where the CPU is correctly rounded
REL_L2_FLOOR = {"float16": 2.0**-12, "bfloat16": 2.0**-9, "float32": 2.0**-22, "float64": 2.0**-51}


def rel_l2_floor(dtype: str, numel: int) -> float:
    """REL_L2_FLOOR[dtype] * (1 + 8 / sqrt(numel)): 9 times the floor for a scalar, twice at 64 elements, the floor
    for large outputs."""
    return REL_L2_FLOOR[dtype] * (1.0 + 8.0 / max(numel, 1) ** 0.5)


BINARY_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


@dataclass(frozen=True)
class Standard:
    """The standard one output is judged by: its name, msprobe's API level, and the ratio thresholds."""

    name: str
    level: str | None
    thresholds: dict[str, float]


def api_level(api: str) -> str:
    """msprobe's benchmark level of an API (StandardConfig.get_api_level; an aten overload by its name: mm.default)."""
    api = api.split(".")[0]
    return "L2" if api in L2_APIS else "L1" if api in L1_APIS else "L0"


def standard_for(api: str, dtype: str) -> Standard | None:
    """The standard of an output of `api` with recorded `dtype`; None where none is stated (not guessed)."""
    if dtype in FLOAT_DTYPES:
        level = api_level(api)
        return Standard(BENCHMARK, level, THRESHOLDS[level])
    if dtype in BINARY_DTYPES:
        return Standard(BINARY, None, {"error_rate": 0.0})
    return None

"""Default tolerances by dtype, derived from published values (below), overridable per command.

The primary metric is relative L2 error ||x - y|| / ||y||.  Default thresholds per dtype:
  fp32 2^-13 = 1.2e-4   CANN operator precision standard T (torch.testing's 1.3e-6 is bit-level, too strict
                        across devices; a real fp32 fault can be as small as 2.5e-4)
  fp16 2^-10 = 9.8e-4   CANN T, = torch.testing rtol 1e-3; also tf32 (float32 matmuls found running on
                        10-bit-mantissa inputs, analysis/prior.py: float16's mantissa)
  bf16 2^-6  = 1.6e-2   torch.testing rtol 1.6e-2 (CANN's per-op T 2^-7 is exceeded by accumulated autocast
                        noise: 1e-3 to 8e-3 per op output over a few layers and steps)
  fp8  2^-3 / 2^-2      CANN T;  fp64 1e-10;  ints and bools exact.  A pair is judged at the *less* precise of its two
dtypes, and at the run's compute precision when that is lower (bf16 autocast makes fp32 tensors bf16-noisy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dumpstore.errors import DumpstoreError

REL_L2_DEFAULT: dict[str, float] = {
    "float8_e4m3fn": 2.0**-3,
    "float8_e5m2": 2.0**-2,
    "bfloat16": 2.0**-6,
    "float16": 2.0**-10,
    "tf32": 2.0**-10,  # float32 matmuls run with 10-bit-mantissa inputs (TF32/HF32): as float16, same mantissa
    "float32": 2.0**-13,
    "float64": 1e-10,
}
EXACT_DTYPES_TOL = 0.0  # ints and bools must match exactly
AMPLIFICATION = 10.0  # an op whose output error exceeds its input error by this factor creates error


@dataclass(frozen=True)
class Tolerances:
    """Relative-L2 thresholds by dtype, plus overrides (`--tol float32=1e-5` or one value for all)."""

    rel_l2: dict[str, float] = field(default_factory=lambda: dict(REL_L2_DEFAULT))
    all_dtypes: float | None = None
    amplification: float = AMPLIFICATION

    def for_dtype(self, dtype: str | None) -> float:
        """The threshold of one dtype as named (an override for all dtypes first; ints and bools exact); the dtype
        a pair is judged at (compute precision included) is rules.tol_dtype's."""
        if self.all_dtypes is not None:
            return self.all_dtypes
        if dtype in self.rel_l2:
            return self.rel_l2[dtype]
        if dtype and (dtype.startswith("int") or dtype.startswith("uint") or dtype == "bool"):
            return EXACT_DTYPES_TOL
        return self.rel_l2["float32"]

    @classmethod
    def parse(cls, specs: list[str] | tuple[str, ...] | None, amplification: float | None = None) -> Tolerances:
        """From CLI strings: `1e-3` (every dtype) or `bfloat16=1e-2`."""
        table = dict(REL_L2_DEFAULT)
        everything = None
        for spec in specs or ():
            if "=" in spec:
                name, value = spec.split("=", 1)
                table[tol_dtype_name(name, spec)] = _positive(value, spec)
            else:
                everything = _positive(spec, spec)
        return cls(table, everything, amplification or AMPLIFICATION)


# short names people type for dtypes (torch's own aliases `half`, `float`, `double` come from dumpstore.dtypes)
_SHORT = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "fp32": "float32",
    "f32": "float32",
    "tf32": "float32",
    "single": "float32",
    "fp64": "float64",
    "f64": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}


class ToleranceError(DumpstoreError, ValueError):
    """A `--tol` spec that names no known dtype or holds no non-negative number (a usage error)."""


def tol_dtype_name(name: str, spec: str | None = None) -> str:
    """The canonical dtype a `--tol NAME=VALUE` names (`bf16`, `fp32`, `half`, `torch.float16`, `BFloat16`, ...);
    raises ToleranceError listing the known names for anything else (a typo must not be ignored silently)."""
    from dumpstore.dtypes import COMPLEX_DTYPES, FLOAT8_DTYPES, FLOAT_DTYPES, INT_DTYPES, canonical

    known = (*FLOAT_DTYPES, *FLOAT8_DTYPES, *INT_DTYPES, "bool", *COMPLEX_DTYPES)
    low = name.strip().lower()
    got = _SHORT.get(low) or canonical(name.strip())
    if got not in known:
        short = ", ".join(sorted(_SHORT))
        raise ToleranceError(
            f"--tol {spec or name!r}: {name.strip()!r} is not a dtype; use one of {', '.join(known)} "
            f"(or {short}, half, float, double)"
        )
    return got


def _positive(value: str, spec: str) -> float:
    try:
        v = float(value)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise ToleranceError(f"tolerance {spec!r} is not a non-negative number; use e.g. 1e-3 or bfloat16=1e-2")
    return v

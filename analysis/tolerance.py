"""Default tolerances by dtype, derived from published values (see METRICS.md), overridable per command.

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
                from dumpstore.dtypes import canonical

                table[canonical(name.strip())] = _positive(value, spec)
            else:
                everything = _positive(spec, spec)
        return cls(table, everything, amplification or AMPLIFICATION)


def _positive(value: str, spec: str) -> float:
    try:
        v = float(value)
    except ValueError:
        v = -1.0
    if not v >= 0:
        from dumpstore.errors import DumpstoreError

        raise DumpstoreError(f"tolerance {spec!r} is not a non-negative number; use e.g. 1e-3 or bfloat16=1e-2")
    return v

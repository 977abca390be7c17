"""dumpstore.analysis: questions answered from the store (alignment, metrics, verdicts, reports).

The exports are imported on first use (PEP 562 module `__getattr__`), so `import dumpstore.analysis.tolerance`
does not load Polars.  Modules named like the function they export are private (`analysis/_divergence.py`),
so `dumpstore.analysis.divergence` is always the function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dumpstore._exports import lazy_exports

_EXPORTS = {
    "Checklist": "_checklist",
    "checklist": "_checklist",
    "Comparison": "compare",
    "compare_runs": "compare",
    "Finding": "verdict",
    "Verdict": "verdict",
    "Question": "verdict",
    "answer": "verdict",
    "divergence": "_divergence",
    "divergence_by_steps": "_divergence",
    "HealthReport": "_health",
    "Thresholds": "_health",
    "health": "_health",
    "Mapping": "mapping",
    "load_mapping": "mapping",
    "OverflowReport": "_overflow",
    "overflow": "_overflow",
    "rank_rows": "rank",
    "Tolerances": "tolerance",
}

if TYPE_CHECKING:
    from ._checklist import Checklist, checklist
    from ._divergence import divergence, divergence_by_steps
    from ._health import HealthReport, Thresholds, health
    from ._overflow import OverflowReport, overflow
    from .compare import Comparison, compare_runs
    from .mapping import Mapping, load_mapping
    from .rank import rank_rows
    from .tolerance import Tolerances
    from .verdict import Finding, Question, Verdict, answer

__all__ = [
    "Checklist",
    "Comparison",
    "Finding",
    "HealthReport",
    "Mapping",
    "OverflowReport",
    "Question",
    "Thresholds",
    "Tolerances",
    "Verdict",
    "answer",
    "checklist",
    "compare_runs",
    "divergence",
    "divergence_by_steps",
    "health",
    "load_mapping",
    "overflow",
    "rank_rows",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

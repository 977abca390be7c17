"""dumpstore.analysis: questions answered from the store (alignment, metrics, verdicts, reports).

Exports are imported on first use (dumpstore/_lazy.py), so `import dumpstore.analysis.tolerance` does not
load Polars.
"""

from dumpstore._lazy import lazy_exports

lazy_exports(__name__, {
    "Checklist": "checklist", "checklist": "checklist", "Comparison": "compare", "compare_runs": "compare",
    "Finding": "verdict", "Verdict": "verdict", "Question": "verdict", "answer": "verdict",
    "divergence": "divergence",
    "divergence_by_steps": "divergence", "HealthReport": "health", "Thresholds": "health", "health": "health",
    "Mapping": "mapping", "load_mapping": "mapping", "OverflowReport": "overflow", "overflow": "overflow",
    "rank_rows": "rank", "Tolerances": "tolerance"})

__all__ = ["Checklist", "Comparison", "Finding", "HealthReport", "Mapping", "OverflowReport", "Question",
           "Thresholds", "Tolerances", "Verdict", "answer", "checklist", "compare_runs", "divergence",
           "divergence_by_steps", "health", "load_mapping", "overflow", "rank_rows"]

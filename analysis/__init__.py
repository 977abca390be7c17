"""dumpstore.analysis: questions answered from the store (alignment, metrics, verdicts, reports)."""

from .checklist import Checklist, checklist
from .compare import Comparison, compare_runs
from .divergence import Finding, Verdict, divergence, divergence_by_steps
from .health import HealthReport, Thresholds, health
from .mapping import Mapping, load_mapping
from .overflow import OverflowReport, overflow
from .rank import rank_rows
from .tolerance import Tolerances

__all__ = ["Checklist", "Comparison", "Finding", "HealthReport", "Mapping", "OverflowReport", "Thresholds",
           "Tolerances", "Verdict", "checklist", "compare_runs", "divergence", "divergence_by_steps", "health",
           "load_mapping", "overflow", "rank_rows"]

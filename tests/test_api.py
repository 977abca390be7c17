"""The public API is small and deliberate: a test guards `__all__` of both packages."""

from __future__ import annotations

import subprocess
import sys

import dumpstore
import dumpstore.analysis


def test_dumpstore_all():
    assert sorted(dumpstore.__all__) == [
        "DumpFormatError",
        "DumpstoreError",
        "IngestOptions",
        "IngestResult",
        "QueryError",
        "Store",
        "StoreError",
        "__version__",
        "ingest",
        "open_store",
        "run_query",
    ]
    assert callable(dumpstore.ingest) and callable(dumpstore.open_store)


def test_analysis_all():
    assert sorted(dumpstore.analysis.__all__) == [
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
    for name in dumpstore.analysis.__all__:
        assert getattr(dumpstore.analysis, name) is not None


def test_library_neither_prints_nor_imports_click_or_torch():
    code = (
        "import sys, dumpstore, dumpstore.analysis, dumpstore.analysis.report\n"
        "assert 'click' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""


def test_exported_names_stay_the_functions_after_their_modules_are_imported():
    code = (
        "import importlib, inspect, dumpstore, dumpstore.analysis as a\n"
        "for m in ('dumpstore._ingest', 'dumpstore.analysis._divergence', 'dumpstore.analysis._checklist',\n"
        "          'dumpstore.analysis._health', 'dumpstore.analysis._overflow'):\n"
        "    importlib.import_module(m)\n"
        "assert inspect.isfunction(dumpstore.ingest), dumpstore.ingest\n"
        "for name in ('divergence', 'checklist', 'health', 'overflow'):\n"
        "    assert inspect.isfunction(getattr(a, name)), name\n"
        "import dumpstore.analysis._divergence as mod\n"
        "assert inspect.ismodule(mod)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

"""validation/compare_top.py: where a fault's culprit ranks in `compare` of its step (the scorers' --compare-top)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("validation_compare_top", ROOT / "validation" / "compare_top.py")
assert _spec and _spec.loader
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)

ROWS = [
    {"step": 1, "name": "Functional.linear.10.forward.output.0", "significance": 40.0, "rel_l2": 0.2, "tol": 0.005},
    {"step": 1, "name": "Functional.linear.1.forward.input.0", "significance": 3.0, "rel_l2": 0.01, "tol": 0.005},
    {"step": 1, "name": "Functional.linear.1.forward.output.0", "significance": "inf", "rel_l2": 1.0, "tol": 0.005},
]


def test_rank_of_matches_a_record_by_its_leaf_names_not_a_longer_record():
    assert ct.rank_of(ROWS, ["Functional.linear.1.forward"])[0] == 2  # not linear.10 (a record is name + ".")
    assert ct.rank_of(ROWS, ["Module.x.forward.0", "Functional.linear.10.forward"])[0] == 1
    assert ct.rank_of(ROWS, ["Functional.gelu.0.forward"]) is None
    assert ct.rank_of(ROWS, []) is None


def test_cells_and_summary():
    fault = {"n": 1, "records": ["r"], "rank": 2, "in_top": False, "rank_plain": 2}
    hit = {"n": 1, "records": ["r"], "rank": 1, "in_top": True, "rank_plain": 5}
    no_record = {"n": 1, "records": [], "rank": None, "in_top": False}
    clean = {"n": 1, "first": ct._row_brief(ROWS[2])}
    assert [ct.cell(t) for t in (fault, hit, no_record, clean, None)] == [
        "2 NO (alone: 2)",
        "1 yes (alone: 5)",
        "- (no record)",
        "top: sig inf Functional.linear.1.forward.output.0@1",
        "-",
    ]
    assert ct.summary([fault, hit, no_record, clean, None], 1) == (
        "culprit in compare --top 1 of its step: 1 of 3 (by significance alone, --no-culprit-first: 0)"
        " (1 with no record to look for); "
        "clean pairs' first row significance: max inf, median inf"
    )

"""analysis/align_repeats.py `agreeing` through the shared statistics bound (analysis/rules.py `stats_bound`):
the bound's edge exactly, the mean weighted by sqrt(numel), and the leaves it leaves out (integers, non-finite)."""

from __future__ import annotations

from dumpstore.analysis.align_repeats import agreeing, tolerance_of

TOL = tolerance_of("float32", {"float32": 2.0**-13, "int64": 0.0}.__getitem__)
LEAF = ("float32", 16, -1.0, 1.0, 0.0, 2.0)


def _one(x: tuple, y: tuple) -> int:
    return agreeing({("output", "0"): x}, {("output", "0"): y}, TOL)


def test_the_bound_at_its_edge():
    assert _one(("float32", 16, -1.0, 1.0, 0.0, 2.0 + 2.0**-12), LEAF) == 1  # |dNorm| / ||y|| = 2^-13 exactly
    assert _one(("float32", 16, -1.0, 1.0, 0.0, 2.0 + 2.0**-11), LEAF) == 0
    # the mean's difference counts sqrt(numel) times: 2^-15 * 4 / 2 = 2^-14 within, 2^-13 * 4 / 2 beyond
    assert _one(("float32", 16, -1.0, 1.0, 2.0**-15, 2.0), LEAF) == 1
    assert _one(("float32", 16, -1.0, 1.0, 2.0**-12, 2.0), LEAF) == 0
    assert _one(("float32", 16, 0.0, 0.0, 0.0, 0.0), ("float32", 16, 0.0, 0.0, 0.0, 0.0)) == 1  # 0 / 0 = 0


def test_leaves_without_four_finite_statistics_do_not_count():
    ints = ("int64", 16, 0.0, 7.0, None, None)
    assert _one(ints, ints) == 0
    inf = ("float32", 16, -1.0, float("inf"), float("inf"), float("inf"))
    assert _one(inf, inf) == 0
    assert _one(LEAF, inf) == 0 and _one(inf, LEAF) == 0
    both = {("input", "0"): LEAF, ("input", "1"): ints, ("output", "0"): LEAF}
    assert agreeing(both, both, TOL) == 2
    assert agreeing(both, {("input", "0"): LEAF}, TOL) == 1  # only the positions both records have

"""Each rule in one place: the statistics bound (the SQL of dumpstore/views.py, `stats_bound_sql` and the
weight_change view's `ratio_est`, equals analysis/rules.py's `stats_bound` on a grid of null, NaN, +-Inf, zero and
finite statistics) and msprobe's name patterns (dumpstore/names.py only)."""

from __future__ import annotations

import ast
import itertools
import math
import random

import duckdb
import numpy as np
import pyarrow as pa

from dumpstore import names
from dumpstore.analysis.rules import STATS, stats_bound
from dumpstore.views import stats_bound_sql
from helpers import ROOT

NAN, INF = float("nan"), float("inf")
NORMS = [None, NAN, INF, 0.0, 2.0, 3.0]
VALUES = [None, NAN, INF, -INF, 0.0, 1.0, -1.5]


def _grid() -> list[dict]:
    """Every combination of norms (both sides), sqrt(n) and the non-finite flag, with the other statistics drawn
    from VALUES; and all combinations of a few values for max and min without norms (the integer rule)."""
    rng = random.Random(0)
    rows = []
    for tn, rn, sqrt_n, nonfinite in itertools.product(NORMS, NORMS, [1.0, 4.0], [False, True]):
        for _ in range(40):
            t = {s: rng.choice(VALUES) for s in ("mean", "max", "min")}
            r = {s: rng.choice(VALUES) for s in ("mean", "max", "min")}
            if rng.random() < 0.3:
                r = dict(t)  # equal statistics: the rule for a non-finite reference norm
            rows.append({"t_norm": tn, "r_norm": rn, **_prefixed("t_", t), **_prefixed("r_", r), "sqrt_n": sqrt_n,
                         "nonfinite": nonfinite})  # fmt: skip
    for tmax, tmin, rmax, rmin in itertools.product(VALUES, repeat=4):
        rows.append(
            {"t_norm": None, "r_norm": None, "t_mean": None, "r_mean": None, "t_max": tmax, "t_min": tmin,
             "r_max": rmax, "r_min": rmin, "sqrt_n": 1.0, "nonfinite": False}
        )  # fmt: skip
    return rows


def _prefixed(prefix: str, stats: dict) -> dict:
    return {prefix + k: v for k, v in stats.items()}


def _by_numpy(rows: list[dict]) -> list[float | None]:
    def col(name: str) -> np.ndarray:
        return np.array([np.nan if r[name] is None else r[name] for r in rows], np.float64)

    def nulls(name: str) -> np.ndarray:
        return np.array([r[name] is None for r in rows])

    err, known = stats_bound(
        {s: col(f"t_{s}") for s in STATS},
        {s: col(f"r_{s}") for s in STATS},
        {s: nulls(f"t_{s}") for s in STATS},
        {s: nulls(f"r_{s}") for s in STATS},
        col("sqrt_n"),
        np.array([r["nonfinite"] for r in rows]),
    )
    return [float(e) if k else None for e, k in zip(err, known)]


def _by_sql(rows: list[dict]) -> list[float | None]:
    grid = pa.Table.from_pylist(rows)  # noqa: F841  (read by DuckDB by name)
    con = duckdb.connect()
    sql = f"SELECT {stats_bound_sql('t_', 'r_', 'sqrt_n', 'nonfinite')} AS err FROM grid"
    return [r[0] for r in con.execute(sql).fetchall()]


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a == b or (math.isnan(a) and math.isnan(b))


def test_the_sql_bound_is_stats_bound():
    rows = _grid()
    assert len(rows) > 5000
    want, got = _by_numpy(rows), _by_sql(rows)
    bad = [(r, w, g) for r, w, g in zip(rows, want, got) if not _same(w, g)]
    assert not bad, f"{len(bad)} of {len(rows)} differ, first: {bad[:3]}"
    # the grid reaches every rule: by the norm, a non-finite reference norm with equal statistics, the integer
    # rule, infinite bounds (0 and inf divisors) and none applying
    assert {0.0, INF} <= set(want) and None in want and any(w not in (None, 0.0, INF) for w in want)


def test_ratio_est_is_the_bound_against_the_previous_step(tmp_path):
    """The view's ratio_est on two steps of one parameter: the bound with the previous step as the reference."""
    import pyarrow.parquet as pq

    from dumpstore.views import WEIGHT_CHANGE

    rows = [
        {"run": "r", "rank": 0, "source": "", "param": "w", "step": s, "seq": 0, "leaf": 0, "record": "x",
         "name": "x", "dtype": "float32", "shape": [4, 4], "numel": 16, "norm": n, "mean": m, "max": hi, "min": lo,
         "has_nan": False, "has_posinf": False, "has_neginf": False, "has_sat": False, "sketch": None}
        for s, n, m, hi, lo in [(0, 4.0, 0.5, 2.0, -1.0), (1, 5.0, 0.25, 2.5, -1.0), (2, 5.0, 0.25, INF, -1.0)]
    ]  # fmt: skip
    table = pa.Table.from_pylist(rows)
    table = table.set_column(table.schema.get_field_index("sketch"), "sketch", pa.nulls(3, pa.list_(pa.float64())))
    pq.write_table(table, tmp_path / "p.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW param_stats AS SELECT * FROM read_parquet('{tmp_path / 'p.parquet'}')")
    con.execute(WEIGHT_CHANGE)
    got = con.execute("SELECT step, ratio_est FROM weight_change ORDER BY step").fetchall()
    # step 1: max(|1|, |0.5|, |0.25| * 4, 0) / 4 = 0.25; step 2: the max difference is not finite: ignored
    assert got == [(1, 0.25), (2, 0.0)]


# what only dumpstore/names.py may spell: msprobe's record-name patterns
NAME_PATTERNS = ("Module|Cell", "Cell|Module", "forward|backward", "backward|forward", "parameters_grad(")


def _has_docstring(node: ast.AST) -> bool:
    body = getattr(node, "body", None)
    return (
        isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and bool(body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )


def test_msprobe_name_patterns_live_in_names_py():
    """(In code: docstrings may name the shapes of keys.)"""
    found = []
    for folder in ("dumpstore", "analysis", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "dumpstore" / "names.py":
                continue
            tree = ast.parse(path.read_text())
            docs = {id(n.body[0].value) for n in ast.walk(tree) if _has_docstring(n)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    found += [(str(path.relative_to(ROOT)), node.lineno) for p in NAME_PATTERNS if p in node.value]
    assert found == [], "parse msprobe names with dumpstore/names.py (or add the pattern there)"


KEYS = [
    "Module.layers.1.fc1.Linear.forward.0",
    "Cell.net.blocks.3.attn.Dense.backward.12",
    "Module.Linear.forward.0",  # no path before the class
    "Functional.linear.0.forward",
    "Module.layers.0.qkv.Linear.parameters_grad",
    "Tensor.add_.0.forward",
    "",
]


def test_module_paths_in_python_and_in_sql_agree():
    want = ["layers.1.fc1", "net.blocks.3.attn", None, None, None, None, None]
    assert [names.module_path(k) for k in KEYS] == want
    sql = f"SELECT nullif(regexp_extract(k, {names.MODULE_PATH_SQL}, 1), '') FROM (SELECT unnest($keys) AS k)"
    assert [r[0] for r in duckdb.connect().execute(sql, {"keys": KEYS}).fetchall()] == want


def test_module_of_and_the_keys_without_direction():
    assert names.module_of("Module.layers.0.ln2.LayerNorm.forward.0") == ("layers.0.ln2", "LayerNorm")
    assert names.module_of("Module.TinyNet.forward.0") == ("", "TinyNet")
    assert names.module_of("Functional.linear.0.forward") == (None, None)
    assert names.without_direction_and_call("Module.a.Linear.backward.3") == "Module.a.Linear"
    assert names.without_direction("Functional.linear.0.forward") == "Functional.linear.0"


def test_parameter_of_a_gradient_leaf():
    assert names.parameter_of_grad("Module.layers.1.fc1.Linear.parameters_grad.weight") == "layers.1.fc1.weight"
    assert names.parameter_of_grad("Cell.a.Dense.parameters_grad.3.bias") == "a.bias"
    assert names.parameter_of_grad("Functional.linear.0.forward.input.0") is None


def test_strip_call_drops_only_the_counter():
    assert names.strip_call("Functional.linear.12.forward") == "Functional.linear.forward"
    assert names.strip_call("Module.layers.0.fc1.Linear.backward.3") == "Module.layers.0.fc1.Linear.backward"
    assert names.strip_call("Module.fc.Linear.parameters_grad.0") == "Module.fc.Linear.parameters_grad.0"
    assert names.strip_call("not a key") == "not a key"


def test_a_module_records_call_counter_goes_in_python_and_in_polars_alike():
    import polars as pl

    keys = [*KEYS, "Module.layers.0.fc1.Linear.parameters_grad.1", "Cell.a.Dense.forward.10", "Functional.relu.3"]
    want = [
        "Module.layers.1.fc1.Linear.forward",
        "Cell.net.blocks.3.attn.Dense.backward",
        "Module.Linear.forward",
        "Functional.linear.0.forward",  # an API call's key: its counter is not at the end, and it stays
        "Module.layers.0.qkv.Linear.parameters_grad",
        "Tensor.add_.0.forward",
        "",
        "Module.layers.0.fc1.Linear.parameters_grad",
        "Cell.a.Dense.forward",
        "Functional.relu.3",  # not a module record: as it is
    ]
    assert [names.without_module_call(k) for k in keys] == want
    col = pl.Series("k", [*keys, None]).to_frame().select(names.without_module_call_expr(pl.col("k")))
    assert col.to_series().to_list() == [*want, None]

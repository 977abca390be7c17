"""The CLI's output: exact text of each read command on the samples, one --table/--json/--csv switch on every
read command, selectors that match nothing, formula-safe CSV and terminal-safe names (issues 13 and 15)."""

from __future__ import annotations

import csv
import io
import json
import re
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from dumpstore.cli.main import main
from dumpstore.csvsafe import BLACK_LIST, cell
from dumpstore.errors import SelectionError
from dumpstore.store import open_store
from helpers import SAMPLES


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three statistics samples: ref, target (one weight x1.01), overflow."""
    root = tmp_path_factory.mktemp("render") / "store"
    res = _cli(
        "ingest",
        SAMPLES / "ref_stats",
        SAMPLES / "weight_1pct_stats",
        SAMPLES / "overflow_stats",
        "--run",
        "ref",
        "--run",
        "target",
        "--run",
        "overflow",
        "--store",
        root,
    )
    assert res.exit_code == 0, res.output
    return root


# -- exact default output of each read command (sqlite-utils style) -------------------------------------------

GOLDEN = {
    "divergence": (
        "target target vs reference ref: steps [0, 1, 2], ranks [0]; compute precision float32 vs float32 (judged at float32)\n"
        "FIRST DIVERGENCE (value): step 0 rank 0  Functional.linear.6.forward  output.0  rel_l2=0.0094 > tol=0.000122 (float32, stats)\n"
        "CULPRIT (parameter): step 0 rank 0  Functional.linear.6.forward  output.0  rel_l2=0.0094 > tol=0.000122 (float32, stats)  [Functional.linear.6.forward.input.1 differs and no earlier op produced it]\n"
        "  where: layers.1.fc1 (Linear), called at generate.py:140 in forward: h = self.fc1(self.ln2(x))\n"
        "  parameter: layers.1.fc1.weight (norm 3.27379 in the target vs 3.24137)\n"
        "  fix: Check how each run initialises, loads (checkpoint) or converts layers.1.fc1.weight: the two runs start from different weights.\n"
        '  next: dump it at tensor level with this msprobe config.json: {"task": "tensor", "dump_path": "./dump_tensor", "rank": [0], "step": [0], "level": "mix", "async_dump": false, "tensor": {"scope": [], "list": ["Module.layers.1.fc1.Linear.forward.0", "Module.layers.1.fc1.Linear.backward.0"], "data_mode": ["all"]}}\n'
        "NOT JUDGED: 12 tensor pairs unknown (NaN/Inf in both runs hiding their finite values, or nothing comparable dumped); `dumpstore compare --target target --ref ref` lists them\n"
        "  step 0: 449 compared, 201 diverged, 0 unmatched, max rel_l2 0.0119, first Functional.linear.6.forward\n"
        "  step 1: 449 compared, 218 diverged, 0 unmatched, max rel_l2 0.0113, first Functional.linear.6.forward\n"
        "  step 2: 449 compared, 204 diverged, 0 unmatched, max rel_l2 0.0126, first Functional.linear.6.forward\n"
    ),
    "compare": (
        "step  rank  seq  name                                 dtype    ref_dtype  rel_l2   err_source  err_bound  cosine  max_abs_err  tol       tol_dtype  severity  significance  status    detail\n"
        "----  ----  ---  -----------------------------------  -------  ---------  -------  ----------  ---------  ------  -----------  --------  ---------  --------  ------------  --------  ---------------------\n"
        "0     0     37   Functional.linear.6.forward.input.1  float32  float32    0.01     stats                          0.00249      0.000122  float32    81.9      81.9          diverged  the verdict's culprit\n"
        "2     0     37   Functional.linear.6.forward.input.1  float32  float32    0.01     stats                          0.0025       0.000122  float32    81.9      81.9          diverged\n"
        "1     0     37   Functional.linear.6.forward.input.1  float32  float32    0.00999  stats                          0.0025       0.000122  float32    81.8      81.8          diverged\n"
    ),
    "overflow": (
        "FIRST OVERFLOW (inf): step 0 rank 0  Functional.linear.7.forward  output.0\n"
        "50 producers (clean inputs, dirty output); 1007 dirty tensors\n"
        "step  rank  seq  record                        name                                   io      dtype    nan_count  posinf_count  neginf_count  sat_count  new_nan  new_posinf  new_neginf  new_sat  likely_mask\n"
        "----  ----  ---  ----------------------------  -------------------------------------  ------  -------  ---------  ------------  ------------  ---------  -------  ----------  ----------  -------  -----------\n"
        "0     0     8    Tensor.masked_fill.0.forward  Tensor.masked_fill.0.forward.output.0  output  float32                                                    False    False       True        False    True\n"
        "0     0     9    Functional.softmax.0.forward  Functional.softmax.0.forward.input.0   input   float32                                                    False    False       True        False    False\n"
        "0     0     29   Tensor.masked_fill.1.forward  Tensor.masked_fill.1.forward.output.0  output  float32                                                    False    False       True        False    True\n"
    ),
    "checklist": (
        "checklist: target target vs reference ref\n"
        "check                            status   evidence\n"
        "-------------------------------  -------  -------------------------------------------------------------------------------------------------------------------------------------\n"
        "data (first inputs per step)     pass     identical at steps [0, 1, 2]: Functional.cross_entropy.0.forward.input.1, Functional.embedding.0.forward.input.0 (compared: max, min)\n"
        "initial weights                  differs  1 of 29 parameters differ at step 0: layers.1.fc1.weight (rel_l2 >= 0.01, stats)\n"
        "structure (ops, shapes, dtypes)  pass     same 432 records (per step and rank), shapes and dtypes\n"
        "scalar arguments                 pass     147 scalar arguments identical\n"
        "mixed precision                  pass     both runs compute in float32\n"
        "steps and ranks                  pass     steps [0, 1, 2] and ranks [0] in both runs\n"
    ),
    "health": (
        "health of run overflow: steps [0, 1, 2], ranks [0]\n"
        "loss (rank 0, Functional.cross_entropy.0.forward): step 0 nan, step 1 nan, step 2 nan\n"
        "watchpoint         findings  rule                                                                                first\n"
        "-----------------  --------  ----------------------------------------------------------------------------------  ------------------------------------------------------------------------------\n"
        "overflow           3         NaN, +-Inf or +-finfo.max output from clean inputs (masking -Inf excluded)          step 0 rank 0  Functional.linear.7.forward.output.0  inf\n"
        "grad_explosion     0         gradient norm > 10 x median of the earlier steps                                    -\n"
        "grad_vanishing     0         gradient norm < 1e-07                                                               -\n"
        "weight_change      0         estimated update ratio |dw|/|w| > 0.1 (parameters with >= 2 dims)                   -\n"
        "weight_frozen      0         parameter statistics identical at consecutive steps (not updating)                  -\n"
        "activation_growth  0         forward output norm up > 20% per step, 3 times in a row                             -\n"
        "all_zero           0         float forward output entirely zero                                                  -\n"
        "near_dtype_max     1         finite |x| >= 0.5 x finfo(dtype).max                                                step 0 rank 0  Module.layers.1.fc2.Linear.forward.0.parameters.weight  1.7e+38\n"
        "loss_nonfinite     3         loss is NaN or +-Inf                                                                step 0 rank 0  Functional.cross_entropy.0.forward.output.0  nan\n"
        "loss_spike         0         loss > 10 x median of the earlier steps (a negative median: median + 9 x |median|)  -\n"
        "kernel             0         op output farther from float64 than its replay standard (dumpstore replay)          -\n"
        "\n"
        "overflow: 3 findings (first 2)\n"
        "step  rank  tensor                                         value  threshold                detail\n"
        "----  ----  ---------------------------------------------  -----  -----------------------  ----------------------------------\n"
        "0     0     Functional.linear.7.forward.output.0           inf    finite, |x| < finfo.max  output holds inf from clean inputs\n"
        "0     0     Module.layers.1.fc2.Linear.forward.0.output.0  inf    finite, |x| < finfo.max  output holds inf from clean inputs\n"
        "\n"
        "near_dtype_max: 1 findings\n"
        "step  rank  tensor               value    threshold  detail\n"
        "----  ----  -------------------  -------  ---------  -----------------------------------------------\n"
        "0     0     layers.1.fc2.weight  1.7e+38  1.7e+38    |x| up to 1.701e+38 >= 0.5 x finfo(float32).max\n"
        "\n"
        "loss_nonfinite: 3 findings (first 2)\n"
        "step  rank  tensor                                       value  threshold  detail\n"
        "----  ----  -------------------------------------------  -----  ---------  -----------\n"
        "0     0     Functional.cross_entropy.0.forward.output.0  nan    finite     loss is nan\n"
        "1     0     Functional.cross_entropy.0.forward.output.0  nan    finite     loss is nan\n"
    ),
    "query": (
        "run       n_rows  steps\n"
        "--------  ------  ---------\n"
        "overflow  1359    [0, 1, 2]\n"
        "ref       1359    [0, 1, 2]\n"
        "target    1359    [0, 1, 2]\n"
    ),
}

COMMANDS = {
    "divergence": ["divergence", "--target", "target", "--ref", "ref", "--no-cache"],
    "compare": ["compare", "--target", "target", "--ref", "ref", "--top", "3"],
    "overflow": ["overflow", "--run", "overflow", "--top", "3"],
    "checklist": ["checklist", "--target", "target", "--ref", "ref"],
    "health": ["health", "--run", "overflow", "--top", "2"],
    "query": ["query", "select run, n_rows, steps from runs order by run"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_default_output_exactly(store, name):
    res = _cli(*COMMANDS[name], "--store", store)
    assert res.exit_code == 0, res.output
    assert res.output == "".join(GOLDEN[name])


def test_runs_table(store):
    res = _cli("runs", "--store", store)
    assert re.sub(r"\d{4}-\d\d-\d\dT[\d:]+\+00:00", "<created_at>", res.output) == (
        "run       framework  task        level  steps      ranks  n_records  n_rows  n_tensor_files  n_errors  created_at\n"
        "--------  ---------  ----------  -----  ---------  -----  ---------  ------  --------------  --------  -------------------------\n"
        "overflow  pytorch    statistics  mix    [0, 1, 2]  [0]    432        1359    0               0         <created_at>\n"
        "ref       pytorch    statistics  mix    [0, 1, 2]  [0]    432        1359    0               0         <created_at>\n"
        "target    pytorch    statistics  mix    [0, 1, 2]  [0]    432        1359    0               0         <created_at>\n"
    )


# -- one --table / --json / --csv switch on every read command --------------------------------------------------

READ_COMMANDS = [COMMANDS[n] for n in COMMANDS] + [["runs"]]


@pytest.mark.parametrize("args", READ_COMMANDS, ids=lambda a: a[0])
def test_every_read_command_has_the_three_formats(store, args):
    table = _cli(*args, "--table", "--store", store)
    assert table.exit_code == 0 and table.output == _cli(*args, "--store", store).output
    as_json = _cli(*args, "--json", "--store", store)
    assert as_json.exit_code == 0, as_json.output
    json.loads(as_json.output)
    as_csv = _cli(*args, "--csv", "--store", store)
    assert as_csv.exit_code == 0, as_csv.output
    rows = list(csv.reader(io.StringIO(as_csv.output)))
    assert len(rows) >= 2 and all(len(r) == len(rows[0]) for r in rows), as_csv.output[:500]


def test_csv_of_verdict_overflow_health_checklist(store):
    rows = list(csv.DictReader(io.StringIO(_cli(*COMMANDS["divergence"], "--csv", "--store", store).output)))
    assert [(r["finding"], r["op"], r["kind"], r["metric"]) for r in rows] == [
        ("first_divergence", "Functional.linear.6.forward", "value", "rel_l2"),
        ("culprit", "Functional.linear.6.forward", "parameter", "rel_l2"),
    ]
    rows = list(csv.DictReader(io.StringIO(_cli("overflow", "--run", "overflow", "--csv", "--store", store).output)))
    assert len(rows) == 1007 and rows[0]["record"] == "Tensor.masked_fill.0.forward"
    rows = list(csv.DictReader(io.StringIO(_cli("health", "--run", "overflow", "--csv", "--store", store).output)))
    assert [r["watchpoint"] for r in rows].count("loss_nonfinite") == 3
    rows = list(csv.DictReader(io.StringIO(_cli(*COMMANDS["checklist"], "--csv", "--store", store).output)))
    assert [(r["check"], r["status"]) for r in rows] == [
        ("data", "pass"),
        ("weights", "differs"),
        ("structure", "pass"),
        ("scalars", "pass"),
        ("precision", "pass"),
        ("coverage", "pass"),
    ]


def test_one_name_for_relative_l2(store):
    """compare calls the relative L2 error rel_l2, as divergence, checklist and the report CSV do."""
    res = _cli(
        "compare", "--target", "target", "--ref", "ref", "--by", "rel_l2", "--top", "1", "--json", "--store", store
    )
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)["rows"]
    assert "rel_l2" in row and "err" not in row and row["rel_l2"] == pytest.approx(0.0126, rel=1e-2)
    assert _cli("compare", "--target", "target", "--ref", "ref", "--by", "err", "--store", store).exit_code == 2


# -- selectors that match nothing -------------------------------------------------------------------------------

SELECTORS = [
    (
        ["divergence", "--target", "target", "--ref", "ref", "--step", "99", "--check"],
        "step 99 is not in run 'target' (steps: 0, 1, 2)",
    ),
    (
        ["divergence", "--target", "target", "--ref", "ref", "--step", "99", "--step", "7", "--no-cache"],
        "steps 7, 99 are not in run 'target' (steps: 0, 1, 2)",
    ),
    (["divergence", "--target", "target", "--ref", "ref", "--rank", "3"], "rank 3 is not in run 'target' (ranks: 0)"),
    (
        ["compare", "--target", "target", "--ref", "ref", "--step", "99"],
        "step 99 is not in run 'target' (steps: 0, 1, 2)",
    ),
    (
        ["compare", "--target", "target", "--ref", "ref", "--step", "1", "--rank", "1"],
        "rank 1 is not in run 'target' (ranks: 0)",
    ),
    (["overflow", "--run", "overflow", "--step", "-1"], "step -1 is not in run 'overflow' (steps: 0, 1, 2)"),
    (["overflow", "--run", "overflow", "--ref", "ref", "--rank", "2"], "rank 2 is not in run 'overflow' (ranks: 0)"),
    (
        ["report", "--target", "target", "--ref", "ref", "--step", "5", "--csv", "{tmp}/r.csv"],
        "step 5 is not in run 'target' (steps: 0, 1, 2)",
    ),
    (["checklist", "--target", "nope", "--ref", "ref"], "run 'nope' is not in store"),
    (["health", "--run", "nope"], "run 'nope' is not in store"),
    (["overflow", "--run", "overflow", "--ref", "nope"], "run 'nope' is not in store"),
]


@pytest.mark.parametrize(("args", "error"), SELECTORS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_selector_matching_nothing_is_an_error(store, tmp_path, args, error):
    res = _cli(*[a.replace("{tmp}", str(tmp_path)) for a in args], "--store", store)
    assert res.exit_code == 1, res.output
    assert res.output.startswith(f"Error: {error}") and res.output.count("\n") == 1, res.output
    assert not (tmp_path / "r.csv").exists()


def test_library_entry_points_check_selectors(store):
    from dumpstore.analysis import compare_runs, divergence_by_steps, overflow

    st = open_store(store)
    with pytest.raises(SelectionError, match=r"^step 99 is not in run 'target' \(steps: 0, 1, 2\)$"):
        compare_runs(st, "target", "ref", steps=[99])
    with pytest.raises(SelectionError, match=r"^rank 4 is not in run 'ref' \(ranks: 0\)$"):
        divergence_by_steps(st, "ref", "ref", ranks=[4])
    with pytest.raises(SelectionError, match="step 3 is not in run 'overflow'"):
        overflow(st, "overflow", steps=[0, 3])
    assert compare_runs(st, "target", "ref", steps=[1], ranks=[0]).rows["step"].unique().to_list() == [1]


@pytest.mark.parametrize(
    "args",
    [["compare", "--target", "target", "--ref", "ref"], ["health", "--run", "ref"], ["overflow", "--run", "ref"]],
    ids=lambda a: a[0],
)
def test_negative_top_refused(store, args):
    res = _cli(*args, "--top", "-1", "--store", store)
    assert res.exit_code == 2 and "-1 is not in the range x>=0" in res.output


# -- formula-safe CSV -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "safe"),
    [
        ("=1+1", "'=1+1"),
        ("+SUM(1)", "'+SUM(1)"),
        ("-2+3", "'-2+3"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("%macro", "'%macro"),
        ("\tcmd", "'\tcmd"),
        ("\rcmd", "'\rcmd"),
        ("＝1+1", "'＝1+1"),
        ("＋1", "'＋1"),
        ("－1", "'－1"),
        ("＠x", "'＠x"),
        ("％x", "'％x"),
        ("a;=cmd|' /C calc'!A0", "a;'=cmd|' /C calc'!A0"),
        ("x;@y;+z", "x;'@y;'+z"),
        ("x;＝y", "x;'＝y"),
        ("=a;=b", "'=a;'=b"),
        ("Functional.linear.0.forward", "Functional.linear.0.forward"),
        ("a=b", "a=b"),
        ("a;b", "a;b"),
        ("-1", "-1"),
        ("-inf", "-inf"),
        ("-1.5e-3", "-1.5e-3"),
        ("+3", "+3"),
        ("", ""),
        (-1, -1),
        (-0.5, -0.5),
        (True, True),
        (None, ""),
    ],
)
def test_neutraliser(value, safe):
    assert cell(value) == safe


@given(st.text(alphabet=st.sampled_from(list("=+-@%;\t\r ＝＋－＠％a1.e")), max_size=12))
def test_neutralised_text_never_starts_a_formula(text):
    out = cell(text)
    try:
        float(text)
        number = text == text.strip()
    except ValueError:
        number = False
    assert number or not BLACK_LIST.search(out)
    assert out.replace("'", "") == text.replace("'", "")  # only quotes are added


def _hostile_pair(tmp_path):
    """Two runs whose op names hold a formula, `;=`, a full-width ＝, an ESC sequence and a newline."""
    sys.path.insert(0, str(SAMPLES.parent / "tests"))
    from conftest import DumpWriter

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for name, scale in (("ref", 1.0), ("tgt", 1.5)):
        DumpWriter(tmp_path / name, "statistics").write(
            {
                "Functional.x;=SUM(1).0.forward": {"input_args": [x], "output": [x * scale]},
                "@SUM(1).1.forward": {"input_args": [x], "output": [x * scale]},
                "＝cmd.2.forward": {"input_args": [x], "output": [x * scale]},
                "Functional.relu\x1b[2J\nFAKE LINE.3.forward": {"input_args": [x], "output": [x * scale]},
            }
        )
    store = tmp_path / "s"
    res = _cli("ingest", tmp_path / "ref", tmp_path / "tgt", "--run", "ref", "--run", "tgt", "--store", store)
    assert res.exit_code == 0, res.output
    return store


def _cells(text: str) -> list[str]:
    return [c for row in csv.reader(io.StringIO(text)) for c in row]


def test_every_csv_is_formula_safe(tmp_path):
    store = _hostile_pair(tmp_path)
    outputs = {
        "compare": _cli("compare", "--target", "tgt", "--ref", "ref", "--csv", "--store", store).output,
        "query": _cli("query", "select distinct record from tensors", "--csv", "--store", store).output,
        "divergence": _cli("divergence", "--target", "tgt", "--ref", "ref", "--csv", "--store", store).output,
        "health": _cli("health", "--run", "tgt", "--csv", "--store", store).output,
        "literal": _cli(
            "query", "select '=HYPERLINK(1)' AS a, 'x;=1' AS b, -1.5 AS c", "--csv", "--store", store
        ).output,
    }
    assert (
        _cli("report", "--target", "tgt", "--ref", "ref", "--csv", tmp_path / "r.csv", "--store", store).exit_code == 0
    )
    outputs["report"] = (tmp_path / "r.csv").read_text()
    for name, out in outputs.items():
        bad = [c for c in _cells(out) if BLACK_LIST.search(c) and not re.fullmatch(r"[-+]?[\d.e+-]+|-inf", c)]
        assert bad == [], (name, bad)
    assert outputs["literal"] == "a,b,c\n'=HYPERLINK(1),x;'=1,-1.5\n"
    assert "'@SUM(1).1.forward" in _cells(outputs["query"]) and "'＝cmd.2.forward" in _cells(outputs["query"])
    assert "Functional.x;'=SUM(1).0.forward.output.0" in _cells(outputs["compare"])


def test_terminal_output_escapes_control_characters(tmp_path):
    store = _hostile_pair(tmp_path)
    for args in (
        ["compare", "--target", "tgt", "--ref", "ref"],
        ["divergence", "--target", "tgt", "--ref", "ref"],
        ["query", "select distinct name from tensors"],
        ["overflow", "--run", "tgt", "--ref", "ref"],
        ["health", "--run", "tgt"],
        ["checklist", "--target", "tgt", "--ref", "ref"],
        ["report", "--target", "tgt", "--ref", "ref", "--csv", str(tmp_path / "r.csv")],
    ):
        res = _cli(*args, "--store", store)
        assert res.exit_code == 0, res.output
        assert "\x1b" not in res.output and "\nFAKE LINE" not in res.output, args
    out = _cli("query", "select distinct record from tensors order by record", "--store", store).output
    assert "Functional.relu\\x1b[2J\\nFAKE LINE.3.forward" in out.splitlines()


def test_text_and_num():
    from dumpstore.cli.render import num, text

    assert (
        text("a\x1b[31mb\nc\rd\te\x07\x9b\u202eevil\u2028x") == "a\\x1b[31mb\\nc\\rd\\te\\x07\\x9b\\u202eevil\\u2028x"
    )
    assert text("Functional.linear.0.forward ＝ é 中") == "Functional.linear.0.forward ＝ é 中"
    assert [num(v) for v in (None, 0.000122070, 12345.678, float("-inf"), float("nan"), 7, True)] == [
        "-",
        "0.000122",
        "1.23e+04",
        "-inf",
        "nan",
        "7",
        "True",
    ]

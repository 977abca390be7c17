"""Tests for dumpstore.analysis.report and `dumpstore report`: the CSV against msprobe, the HTML page in Chromium.

- CSV: msprobe's column names, numbers as numbers, shapes as msprobe writes them; the columns shared with
  msprobe equal `msprobe compare`'s on weight_1pct_tensor vs ref_tensor step 0, against the real msprobe
  (skipped without mindstudio-probe) and against tests/data/report_expected_weight_1pct_tensor.json
  (written by `DUMPSTORE_REGEN=1 pytest tests/test_report.py -k regenerate`, checked anywhere).
- HTML: loaded in headless Chromium (tests/browser.py): no script error, the verdict names the catalog's op,
  plotly drew its charts, a screenshot is written; a record name `<script>alert(1)</script>` runs nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import importlib.util
import json
import math
import os
import re
import shutil
from importlib import metadata
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

import browser
from dumpstore._ingest import ingest
from dumpstore.analysis import msprobe_csv, report
from dumpstore.analysis._divergence import divergence
from dumpstore.store import open_store
from helpers import msprobe_cli, replay_row, replay_table, start_msprobe_compare, synth

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_dumps"
EXPECTED = Path(__file__).resolve().parent / "data" / "report_expected_weight_1pct_tensor.json"
CATALOG = {c["name"]: c for c in json.loads((SAMPLES / "catalog.json").read_text())["cases"]}
RUNS = ("ref_stats", "weight_1pct_stats", "ref_tensor", "weight_1pct_tensor", "ref_2rank_stats", "rank1_fault_stats")
TENSOR_PAIR = ("weight_1pct_tensor", "ref_tensor")

TEXT_SHARED = (
    "NPU Name",
    "Bench Name",
    "NPU Dtype",
    "Bench Dtype",
    "NPU Tensor Shape",
    "Bench Tensor Shape",
    "NPU Requires_grad",
    "Bench Requires_grad",
    "Requires_grad Consistent",
    "Data_name",
)
STAT_SHARED = ("NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm")
METRICS = ("Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio")
# records whose rows go into the checked-in expected file: int/bool/0-d tensors, null, int/float/bool/-inf
# arguments, the faulty linear (forward, backward, its module and its weight's gradient) and the optimizer
EXPECTED_OPS = (
    "Functional.embedding.0.forward",
    "Functional.layer_norm.0.forward",
    "Tensor.masked_fill.0.forward",
    "Functional.softmax.0.forward",
    "Functional.linear.6.forward",
    "Module.layers.1.fc1.Linear.forward.0",
    "Functional.gelu.1.forward",
    "Tensor.mean.0.forward",
    "Functional.cross_entropy.0.forward",
    "Functional.linear.6.backward",
    "Module.layers.1.fc1.Linear.parameters_grad",
    "Tensor.add_.0.forward",
)
REL_TOL, ABS_TOL = 1e-6, 1e-9
HAS_EXACT = importlib.util.find_spec("dumpstore.analysis.exact") is not None
PAGE_BOUND = 1_500_000  # bytes: the HTML page on the samples (issue 16)


# ---------------------------------------------------------------- msprobe in the background, stores, reports


class Msprobe:
    """`msprobe compare -tp <target>/step0 -gp <ref>/step0` started at once, collected on first use."""

    def __init__(self, out: Path, wanted: bool):
        self.cli, self.out, self.proc = msprobe_cli(), out, None
        if self.cli and wanted:
            self.start()

    def start(self) -> None:
        target, ref = TENSOR_PAIR
        step0 = SAMPLES / target / "step0", SAMPLES / ref / "step0"
        self.proc = start_msprobe_compare(self.cli, *step0, self.out / "result", self.out / "msprobe.log", self.out)

    def rows(self) -> dict[str, dict[str, str]]:
        if self.cli is None:
            pytest.skip("mindstudio-probe (msprobe) is not installed")
        if self.proc is None:
            self.start()
        rc = self.proc.wait(timeout=300)
        found = sorted((self.out / "result").glob("compare_result_rank0_*.csv"))
        log = (self.out / "msprobe.log").read_text(errors="replace")
        assert rc == 0 and len(found) == 1, f"msprobe compare failed (rc {rc}):\n{log[-3000:]}"
        return _read_csv_cells(found[0])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def msprobe(request, tmp_path_factory):
    wanted = any(it.get_closest_marker("msprobe") for it in request.session.items if it.module is request.module)
    m = Msprobe(tmp_path_factory.mktemp("msprobe"), wanted)
    yield m
    m.close()


@pytest.fixture(scope="module")
def store(msprobe, tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    for run in RUNS:
        ingest(SAMPLES / run, run, store=path, jobs=1)
    return open_store(path)


@pytest.fixture(scope="module")
def reports(store):
    cache: dict[tuple[str, str, bool], report.ReportData] = {}

    def get(target: str, ref: str, exact: bool = False) -> report.ReportData:
        if (target, ref, exact) not in cache:
            cache[(target, ref, exact)] = report.analyze(store, target, ref, exact=exact)
        return cache[(target, ref, exact)]

    return get


def _read_csv_cells(path: Path) -> dict[str, dict[str, str]]:
    """{NPU Name: {column: cell as written}} (pandas, no NA conversion)."""
    import pandas as pd

    df = pd.read_csv(path, keep_default_na=False, dtype=str)
    rows = {r["NPU Name"]: r for r in df.to_dict("records")}
    assert len(rows) == len(df), f"{path}: NPU Name is not unique"
    return rows


# ---------------------------------------------------------------- CSV


def test_csv_columns_numbers_and_shapes(reports, store, tmp_path) -> None:
    import pandas as pd

    data = reports("weight_1pct_stats", "ref_stats")
    path = tmp_path / "report.csv"
    n = report.write_csv(data.cmp, path, store=store)
    df = pd.read_csv(path)
    assert n == len(df) == data.cmp.rows.height
    rel_errs = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")  # msprobe's text cells
    assert list(df.columns) == list(msprobe_csv.columns(report.CSV_COLUMNS, "statistics"))
    for col in ("rel_l2", "tol", "severity", "err_bound") + tuple(m for m in METRICS if m not in rel_errs):
        assert df[col].dtype.kind == "f", f"{col} is {df[col].dtype}, not numbers"
    text = pd.read_csv(path, keep_default_na=False, dtype=str)
    for col in STAT_SHARED + ("Max diff", "Min diff", "Mean diff", "L2norm diff"):  # msprobe's cells
        cells = set(text[col]) - {"None", "True", "False", "Nan", " inf", " -inf", "N/A"}
        assert all(_num(c) is not None for c in cells), (col, sorted(cells)[:5])
    assert "None" in set(text["NPU mean"]) and "False" in set(text["NPU max"])  # null statistic, bool argument
    for col in ("step", "rank", "seq"):
        assert df[col].dtype.kind == "i", col
    assert "%" not in df.drop(columns=list(rel_errs)).to_csv(index=False)
    assert df["NormRelativeErr"].astype(str).str.endswith("%").any()
    shapes = set(df["NPU Tensor Shape"].dropna())
    assert "[2, 8, 32]" in shapes and "[]" in shapes
    assert all(re.fullmatch(r"\[(\d+(, \d+)*)?\]", s) for s in shapes), shapes
    assert set(df["Result"]) <= {"pass", "warning", "error"}
    assert set(df["dumpstore_status"]) <= {"pass", "diverged", "unknown", "unmatched", "error"}
    assert ((df["dumpstore_status"] == "diverged") == (df["dumpstore_result"] == "error")).all()
    first = df[(df["dumpstore_status"] == "diverged") & df["io"].isin(["output"])].iloc[0]
    assert first["op"] == CATALOG["weight_1pct_stats"]["expected"]["first_divergence"]["op"]
    assert first["rel_l2"] > first["tol"] and first["tol_dtype"] == "float32"
    assert json.loads(first["dumpstore_message"])[0].startswith("error: rel_l2 ")
    assert json.loads(first["Err_message"]) == []  # msprobe's rules: a 1 % weight change passes this row
    assert df["NPU Dtype"].str.startswith("torch.").any() and (df["NPU Dtype"] == "<class 'int'>").any()
    has_stack = df["NPU_Stack_Info"].fillna("").str.startswith("['File ")
    first_of_op = ~df.duplicated(["step", "rank", "op"])
    forward = ~df["op"].str.contains(r"\.(?:backward|parameters_grad)", regex=True)  # msprobe: no backward stacks
    assert (has_stack == (first_of_op & forward)).all(), "the stack goes on the first row of each forward op"
    assert (pd.read_csv(path, keep_default_na=False)["Bench Name"] != "N/A").all()  # nothing unmatched here


def _num(cell: str) -> float | None:
    """A summary cell as a number: msprobe writes 'None', 'True'/'False', ' inf'; we write '' for unknown."""
    c = cell.strip()
    if c in ("", "None", "N/A", "unsupported", "shape unmatched"):
        return None
    if c in ("True", "False"):
        return float(c == "True")
    return float(c)  # 'nan', 'Nan', 'inf', '-inf' and numbers


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _check_shared(
    ours: dict[str, dict[str, str]], expected: dict[str, dict[str, str]], label: str, metrics: bool, min_rows: int
) -> None:
    problems, compared = [], 0
    for name, exp in expected.items():
        got = ours.get(name)
        if got is None:
            continue
        compared += 1
        for col in TEXT_SHARED:
            if got[col] != exp[col]:
                problems.append(f"{name} {col}: dumpstore {got[col]!r} vs msprobe {exp[col]!r}")
        for col in STAT_SHARED + (METRICS if metrics else ()):
            if not _same(_num(got[col]), _num(exp[col])):
                problems.append(f"{name} {col}: dumpstore {got[col]!r} vs msprobe {exp[col]!r}")
    assert not problems, f"{label}: {len(problems)} differences:\n" + "\n".join(problems[:30])
    assert compared >= min_rows, f"{label}: only {compared} rows in both"


def _our_tensor_csv(reports, store, tmp_path, exact: bool) -> dict[str, dict[str, str]]:
    data = reports(*TENSOR_PAIR, exact=exact)
    cmp = dataclasses.replace(data.cmp, rows=data.cmp.rows.filter((pl.col("step") == 0) & (pl.col("rank") == 0)))
    path = tmp_path / f"ours_{'exact' if exact else 'plain'}.csv"
    report.write_csv(cmp, path, store=store)
    return _read_csv_cells(path)


def _fingerprint() -> dict[str, str]:
    return {
        side: hashlib.sha256((SAMPLES / run / "step0" / "rank0" / "dump.json").read_bytes()).hexdigest()
        for side, run in zip(("target", "golden"), TENSOR_PAIR)
    }


def test_csv_shared_columns_match_checked_in_expected(reports, store, tmp_path) -> None:
    data = json.loads(EXPECTED.read_text())
    assert (data["target"], data["golden"]) == TENSOR_PAIR
    if data["dump_json_sha256"] != _fingerprint():
        pytest.fail(
            f"sample_dumps changed since {EXPECTED.name} was written; regenerate it: "
            "DUMPSTORE_REGEN=1 pytest tests/test_report.py -k regenerate"
        )
    expected = {r["NPU Name"]: r for r in (dict(zip(data["columns"], cells)) for cells in data["rows"])}
    assert len(expected) == len(data["rows"]) >= 40
    _check_shared(_our_tensor_csv(reports, store, tmp_path, False), expected, EXPECTED.name, False, len(expected))
    if HAS_EXACT:
        _check_shared(
            _our_tensor_csv(reports, store, tmp_path, True), expected, EXPECTED.name + " (exact)", True, len(expected)
        )


@pytest.mark.msprobe
def test_csv_shared_columns_match_msprobe(reports, store, msprobe, tmp_path) -> None:
    expected = msprobe.rows()
    ours = _our_tensor_csv(reports, store, tmp_path, False)
    _check_shared(ours, expected, "msprobe compare", False, 400)
    assert set(ours) == set(expected)
    stacks = [n for n in expected if ours[n]["NPU_Stack_Info"] != expected[n]["NPU_Stack_Info"]]
    assert not stacks, f"NPU_Stack_Info differs on {len(stacks)} rows, first {stacks[0]}"
    if not HAS_EXACT:
        pytest.skip("analysis/exact.py not available: the six tensor-mode metrics were not compared")
    _check_shared(_our_tensor_csv(reports, store, tmp_path, True), expected, "msprobe compare (exact)", True, 400)


@pytest.mark.msprobe
@pytest.mark.skipif(os.environ.get("DUMPSTORE_REGEN") != "1", reason="set DUMPSTORE_REGEN=1 to regenerate")
def test_regenerate_expected(msprobe) -> None:
    rows = msprobe.rows()
    cols = list(TEXT_SHARED + STAT_SHARED + METRICS)
    keep = [r for n, r in rows.items() if any(n.startswith(op + ".") for op in EXPECTED_OPS)]
    target, ref = TENSOR_PAIR
    head = {
        "generator": "DUMPSTORE_REGEN=1 pytest tests/test_report.py -k regenerate",
        "msprobe": metadata.version("mindstudio-probe"),
        "command": f"msprobe compare -tp sample_dumps/{target}/step0 -gp sample_dumps/{ref}/step0",
        "target": target,
        "golden": ref,
        "dump_json_sha256": _fingerprint(),
        "columns": cols,
    }
    body = ",\n".join("  " + json.dumps([r[c] for c in cols]) for r in keep)
    EXPECTED.write_text(json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + body + "\n ]\n}\n")


# ---------------------------------------------------------------- HTML in Chromium


def _need_chromium() -> None:
    if browser.chromium() is None:
        pytest.skip(browser.why_no_chromium())


def _js_errors(dom: str) -> str:
    m = re.search(r'<pre id="js-errors"[^>]*>(.*?)</pre>', dom, re.DOTALL)
    assert m, "the page lost its #js-errors element"
    return m.group(1)


def _check_page(page: browser.Page, charts: int) -> None:
    assert _js_errors(page.dom) == "", f"script errors in the page: {_js_errors(page.dom)}"
    assert not page.console_errors, "console errors:\n" + "\n".join(page.console_errors[:10])
    assert f'data-charts="{charts}"' in page.dom, "plotly did not finish drawing every chart"
    assert page.dom.count('class="main-svg"') >= charts, "no plotly SVG in the DOM"


def _page_data(text: str) -> dict:
    return json.loads(re.search(r'id="report-data">(.*?)</script>', text, re.DOTALL).group(1))


def _verdict_block(dom: str) -> str:
    m = re.search(r'<section id="verdict".*?</section>', dom, re.DOTALL)
    assert m, "no verdict section"
    return m.group(0)


@pytest.mark.browser
def test_html_sample_pair_in_chromium(reports, store, tmp_path) -> None:
    _need_chromium()
    data = reports("weight_1pct_stats", "ref_stats")
    path = tmp_path / "report.html"
    report.write_html(data.cmp, data.verdict, data.overflow, store, path)
    markup = re.sub(r"(<script[^>]*>).*?</script>", r"\1", path.read_text(), flags=re.DOTALL)
    assert not re.search(r"<[^>]+\b(src|href)=(?!\"#)", markup), "the page would fetch something"  # #id links only
    assert path.stat().st_size <= PAGE_BOUND, f"{path.stat().st_size} bytes"
    assert "default-src 'none'" in markup and "connect-src 'none'" in markup
    shot = tmp_path / "report.png"
    page = browser.load(path, screenshot=shot)
    _check_page(page, charts=4)  # error along execution order, steps x ops heat map, gradient norms, update ratios
    exp = CATALOG["weight_1pct_stats"]["expected"]
    verdict = _verdict_block(page.dom)
    words = re.search(r'id="culprit-words">([^<]*)<', verdict).group(1)
    assert words.startswith("The parameter layers.1.fc1.weight differs between the runs (rel_l2 ≥ 0.01, "), words
    assert "Functional.linear.6.forward reads it as input.1" in words
    assert exp["first_divergence"]["op"] in verdict and "Culprit" in verdict and "parameter" in verdict
    assert "tol=" in verdict and "rel_l2=" in verdict and "First overflow" in verdict and "Unmatched ops" in verdict
    assert page.dom.index('id="verdict"') < page.dom.index('id="charts"')  # the verdict comes first
    assert re.search(r'id="stack".*?File .*?linear\.py', page.dom, re.DOTALL), "no call stack for the culprit"
    assert re.search(r'id="meta".*?sample_dumps/weight_1pct_stats', page.dom, re.DOTALL), "no run metadata"
    assert page.screenshot is not None and page.screenshot.stat().st_size > 20_000
    assert re.search(r'id="render-ms">\d+<', page.dom), "the page did not record when its charts were drawn"


# clicks the rel_l2 header twice (ascending, then descending), then filters; allowed by adding its hash to the CSP
_TABLE_DRIVER = """
window.addEventListener('load', function () {
  var th = document.querySelector('#top-table thead th[data-c="err"]');
  var col = Array.prototype.indexOf.call(th.parentNode.cells, th);
  var cell = function () { return document.querySelector('#top-table tbody tr').cells[col].getAttribute('data-v'); };
  th.click(); var asc = cell(); th.click(); var desc = cell();
  var f = document.getElementById('filter'); f.value = 'linear.6'; f.dispatchEvent(new Event('input'));
  var s = document.getElementById('status-filter'); s.value = 'diverged'; s.dispatchEvent(new Event('change'));
  var shown = document.querySelectorAll('#top-table tbody tr').length;
  document.body.setAttribute('data-table-test', [asc, desc, shown, document.getElementById('shown-count').textContent].join('|'));
});
"""


def _with_driver(path: Path, driver: str = _TABLE_DRIVER) -> None:
    import base64

    text = path.read_text()
    digest = base64.b64encode(hashlib.sha256(driver.encode()).digest()).decode()
    text = text.replace("script-src ", f"script-src 'sha256-{digest}' ", 1)
    path.write_text(text.replace("</body>", f"<script>{driver}</script>\n</body>", 1))


@pytest.mark.browser
def test_html_ranks_view_and_table_in_chromium(reports, store, tmp_path) -> None:
    _need_chromium()
    data = reports("rank1_fault_stats", "ref_2rank_stats")
    path = tmp_path / "ranks.html"
    report.write_html(data.cmp, data.verdict, data.overflow, store, path)
    _with_driver(path)
    page = browser.load(path)
    _check_page(page, charts=5)  # line + steps heat map + ranks heat map + gradient norms + update ratios
    assert path.stat().st_size <= PAGE_BOUND, f"{path.stat().st_size} bytes"
    exp = CATALOG["rank1_fault_stats"]["expected"]["culprit"]
    assert exp["op"] in _verdict_block(page.dom) and "step 0, rank 1" in _verdict_block(page.dom)
    table = re.search(r'<table class="grid" id="ranks-table">.*?</table>', page.dom, re.DOTALL).group(0)
    assert re.search(r"<td>1</td><td>[1-9]\d*</td>.*?<td>yes</td>", table, re.DOTALL), table
    asc, desc, shown, label = re.search(r'data-table-test="([^"]*)"', page.dom).group(1).split("|")
    assert float(asc) < float(desc)  # sorting by rel_l2 works both ways
    n_rows = _page_data(page.dom)["table"]["n"]
    kept = pl.col("status").is_not_null() & (pl.col("kind").is_null() | (pl.col("kind") != "null"))
    assert n_rows == data.cmp.rows.filter(kept).height  # every compared leaf (null leaves have nothing to show)
    assert 0 < int(shown) < 50 and label == f"{shown} of {n_rows} rows"


EVIL_OP = "Functional.<script>alert(1)</script>.0.forward"
EVIL_FRAME = "File /x/<img src=x onerror=alert(3)>.py, line 1, in f, \n </script><script>alert(4)</script>"


def _evil_dump(root: Path, *, target: bool) -> None:
    """ref_stats step 0 with Functional.gelu.0.forward renamed to EVIL_OP (the target's output scaled)."""
    old = "Functional.gelu.0.forward"
    dst = root / "step0" / "rank0"
    shutil.copytree(SAMPLES / "ref_stats" / "step0" / "rank0", dst)
    doc = json.loads((dst / "dump.json").read_text())
    data = {}
    for key, rec in doc["data"].items():
        if key == old:
            key = EVIL_OP
            for leaf in rec["output"] if target else ():
                leaf.update(Max=leaf["Max"] * 1.5, Mean=leaf["Mean"] * 1.5, Norm=leaf["Norm"] * 1.5)
        data[key] = rec
    doc["data"] = data
    (dst / "dump.json").write_text(json.dumps(doc))
    stacks = json.loads((dst / "stack.json").read_text())
    for keys, frames in stacks.values():
        if old in keys:
            keys[keys.index(old)] = EVIL_OP
            if target:
                frames.insert(0, EVIL_FRAME)
    (dst / "stack.json").write_text(json.dumps(stacks))
    construct = json.loads((dst / "construct.json").read_text())
    (dst / "construct.json").write_text(json.dumps({(EVIL_OP if k == old else k): v for k, v in construct.items()}))


@pytest.mark.browser
def test_html_no_script_injection(tmp_path) -> None:
    evil_dir = tmp_path / "tgt<img src=x onerror=alert(2)>"
    _evil_dump(evil_dir, target=True)
    _evil_dump(tmp_path / "ref", target=False)
    st = tmp_path / "store"
    ingest(evil_dir, "evil", store=st, jobs=1)
    ingest(tmp_path / "ref", "ref", store=st, jobs=1)
    store = open_store(st)
    data = report.analyze(store, "evil", "ref")
    assert data.verdict.first_divergence.op == EVIL_OP
    path = tmp_path / "evil.html"
    report.write_html(data.cmp, data.verdict, data.overflow, store, path)
    text = path.read_text()
    for raw in ("<script>alert", "<img src=x", "</script><script>"):
        assert raw not in text, f"unescaped {raw!r} in the page"
    assert "Functional.&lt;script&gt;alert(1)&lt;/script&gt;.0.forward" in text  # shown, as text
    assert len(re.findall(r"<script\b", text)) == 4  # guard, data (JSON), plotly, main: nothing else
    assert "\\u0026lt;script\\u0026gt;alert(1)" in text  # the chart labels: escaped, then JSON-escaped
    _need_chromium()
    page = browser.load(path)
    _check_page(page, charts=2)  # line, gradient norms
    assert len(re.findall(r"<script\b", page.dom)) == 4
    assert "&lt;img src=x onerror=alert(3)&gt;" in page.dom  # the stack line, as text
    assert "tgt&lt;img src=x onerror=alert(2)&gt;" in page.dom  # the path, as text


def test_json_in_script_is_escaped() -> None:
    s = report._json_for_script({"a": "</script><!-- x & y", "b": float("inf"), "c": [float("nan"), 1.5]})
    assert "<" not in s and ">" not in s and "&" not in s
    assert json.loads(s) == {"a": "</script><!-- x & y", "b": None, "c": [None, 1.5]}


# ---------------------------------------------------------------- scale: thousands of ops


def _big_report(reports, store, tmp_path) -> tuple[Path, pl.DataFrame]:
    """weight_1pct_stats vs ref_stats repeated over 30 steps: ~4,300 ops, 13,590 rows (its speed: bench/report_speed.py)."""
    base = reports("weight_1pct_stats", "ref_stats")
    rows = pl.concat([base.cmp.rows.with_columns(pl.col("step") + 3 * i) for i in range(10)])
    cmp = dataclasses.replace(base.cmp, rows=rows)
    verdict = divergence(cmp)
    path = tmp_path / "big.html"
    report.write_html(cmp, verdict, base.overflow, store, path)
    return path, rows


def test_html_thousands_of_ops(reports, store, tmp_path) -> None:
    path, rows = _big_report(reports, store, tmp_path)
    text = path.read_text()
    n_ops = rows.filter(pl.col("io") == "output").select("step", "record").unique().height
    assert n_ops > 3500
    data = _page_data(text)
    assert data["table"]["n"] == rows.filter(pl.col("status").is_not_null() & (pl.col("kind") != "null")).height
    assert len(data["table"]["cols"]["err"]) == data["table"]["n"] > 13000  # every row, not a top N
    figs = data["figures"]
    points = [len(t["x"]) for t in figs["line"]["data"] if t["name"] in ("forward", "backward")]
    assert max(points) <= report.MAX_POINTS + 2 and sum(points) > 1000
    assert len(figs["steps"]["data"][0]["y"]) == 30


@pytest.mark.slow
@pytest.mark.browser
def test_html_thousands_of_ops_in_chromium(reports, store, tmp_path) -> None:
    _need_chromium()
    path = _big_report(reports, store, tmp_path)[0]
    page = browser.load(path)
    _check_page(page, charts=4)  # line, steps heat map, gradient norms, update ratios
    assert re.search(r'id="render-ms">\d+<', page.dom), "the page did not record when its charts were drawn"


# ---------------------------------------------------------------- CLI


def test_cli_report(store, tmp_path) -> None:
    from dumpstore.cli.main import main

    runner = CliRunner()
    base = ["report", "--store", str(store.root), "--target", "weight_1pct_stats", "--ref", "ref_stats"]
    res = runner.invoke(main, base)
    assert res.exit_code == 2 and "give --html PATH, --csv PATH or both" in res.output
    html_path, csv_path = tmp_path / "r.html", tmp_path / "r.csv"
    res = runner.invoke(
        main, base + ["--html", str(html_path), "--csv", str(csv_path), "--step", "1", "--tol", "float32=1e-4"]
    )
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()  # progress, if any, goes to stderr
    # the verdict lines of `divergence` (cli/render.py: one verdict-line format)
    # (the first divergence is where the culprit shows: an earlier output 1.13e-4 over a 1e-4 tolerance stands
    # out of nothing)
    assert lines[0] == (
        "FIRST DIVERGENCE (value): step 1 rank 0  Functional.linear.6.forward  output.0  "
        "rel_l2=0.00921 > tol=0.0001 (float32, stats)"
    )
    assert lines[1].startswith("CULPRIT (parameter): step 1 rank 0  Functional.linear.6.forward")
    assert lines[2] == "  where: layers.1.fc1 (Linear), called at generate.py:140 in forward: h = self.fc1(self.ln2(x))"
    wrote = [x for x in lines if x.startswith("wrote ")]  # after the explanation lines (analysis/explain.py)
    assert wrote[0] == f"wrote {csv_path} (453 rows)"
    assert wrote[1].startswith(f"wrote {html_path} (") and html_path.stat().st_size > 1_000_000
    res = runner.invoke(
        main, ["report", "--store", str(store.root), "--target", "nope", "--ref", "ref_stats", "--csv", str(csv_path)]
    )
    assert res.exit_code == 1 and "Error: run 'nope' is not in store" in res.output


# ---------------------------------------------------------------- the page on bench/synth.py stores


@pytest.mark.browser
def test_report_page_with_curves_and_bound(reports, store, tmp_path) -> None:
    """write_report_html (as `dumpstore report` writes it): loss of both runs, within the size bound, in Chromium."""
    _need_chromium()
    data = reports("rank1_fault_stats", "ref_2rank_stats")
    path = tmp_path / "full.html"
    size = report.write_report_html(data, store, path)
    assert size == path.stat().st_size <= PAGE_BOUND
    loss = _page_data(path.read_text())["figures"]["loss"]["data"]
    want = {(x["rank"], x["step"]): x["value"] for x in data.health.loss}
    assert sorted({t["name"] for t in loss}) == [
        "reference, rank 0",
        "reference, rank 1",
        "target, rank 0",
        "target, rank 1",
    ]
    for t in loss:
        rank = int(t["name"].rsplit(" ", 1)[1])
        assert len(t["y"]) == len(t["x"]) == len([k for k in want if k[0] == rank]) >= 2
        assert all(isinstance(v, float) for v in t["y"])
        if t["name"].startswith("target"):
            assert t["y"] == [want[(rank, s)] for s in t["x"]]
    page = browser.load(path)
    _check_page(page, charts=6)  # line, steps and ranks heat maps, loss, gradient norms, update ratios
    assert 'id="chart-loss"' in page.dom and 'class="picker"' in page.dom


def _synth_store(root: Path, layers: int, steps: int, ranks: int):
    man = synth().generate(
        root / "dumps",
        layers=layers,
        steps=steps,
        ranks=ranks,
        fault_step=steps // 2,
        fault_rank=ranks - 1,
        fault_layer=layers * 2 // 3,
        jobs=1,
        log=lambda *a: None,
    )
    for side in ("ref", "target"):
        ingest(root / "dumps" / side, side, store=root / "store", jobs=1)
    return open_store(root / "store"), man


# sets the filters to one row (name, step, rank, op type), then reports what the table shows
_FIND_DRIVER = """
window.addEventListener('load', function () {
  var want = JSON.parse(document.body.getAttribute('data-want'));
  var set = function (id, v, ev) { var e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event(ev)); };
  set('filter', want.name, 'input'); set('step-filter', want.step, 'change');
  set('rank-filter', want.rank, 'change'); set('type-filter', want.type, 'change');
  var rows = Array.prototype.map.call(document.querySelectorAll('#top-table tbody tr'), function (tr) {
    return Array.prototype.map.call(tr.cells, function (td) { return td.textContent; }).join('|'); });
  document.body.setAttribute('data-found', JSON.stringify(rows));
});
"""


def _find_row_in_page(path: Path, want: dict) -> list[list[str]]:
    """Load the page with _FIND_DRIVER asking for `want`; the table rows shown, as lists of cell texts."""
    _with_driver(path, _FIND_DRIVER)
    text = path.read_text().replace("<body>", f'<body data-want="{html.escape(json.dumps(want))}">', 1)
    path.write_text(text)
    page = browser.load(path, budget_ms=20000, timeout=300)
    assert _js_errors(page.dom) == "" and not page.console_errors, _js_errors(page.dom)
    found = re.search(r'data-found="([^"]*)"', page.dom)
    assert found, "the driver did not run"
    return [r.split("|") for r in json.loads(html.unescape(found.group(1)))]


def _deep_row(data: report.ReportData) -> dict:
    """The last tensor output row in the page's order (a passing one, far below the top)."""
    t = _page_data(report.render_html(data.cmp, data.verdict, data.overflow))["table"]
    io, dtype = t["cols"]["io"], t["cols"]["dtype"]
    i = max(j for j in range(t["n"]) if t["dicts"]["io"][io[j]] == "output" and dtype[j] is not None)
    d = lambda c: t["dicts"][c][t["cols"][c][i]]  # noqa: E731
    return {
        "name": d("op") + "." + d("leaf"),
        "op": d("op"),
        "leaf": d("leaf"),
        "step": str(t["cols"]["step"][i]),
        "rank": str(t["cols"]["rank"][i]),
        "type": d("type"),
        "dtype": d("dtype"),
        "status": d("status"),
        "index": i,
        "n": t["n"],
    }


def _check_synth_page(data: report.ReportData, man: dict, store, path: Path) -> None:
    exp = man["expected"]
    assert (data.verdict.culprit.op, data.verdict.culprit.kind) == (exp["first_divergence_op"], exp["culprit_kind"])
    want = _deep_row(data)
    assert want["index"] > 1000
    report.write_report_html(data, store, path)
    words = re.search(r'id="culprit-words">([^<]*)<', path.read_text()).group(1)
    assert words.startswith(f"The op {exp['first_divergence_op']} itself: inputs agree, output diverges.")
    shown = _find_row_in_page(path, {k: want[k] for k in ("name", "step", "rank", "type")})
    assert len(shown) == 1, shown
    cells = shown[0]
    assert cells[:6] == [want["step"], want["rank"], want["op"], want["leaf"], want["type"], want["dtype"]]
    assert cells[-2] == want["status"] == "pass" and want["leaf"].startswith("output")


@pytest.mark.browser
def test_html_synthetic_row_found_through_filter(tmp_path) -> None:
    _need_chromium()
    store, man = _synth_store(tmp_path, layers=12, steps=3, ranks=2)
    data = report.analyze(store, "target", "ref")
    _check_synth_page(data, man, store, tmp_path / "synth.html")


@pytest.mark.slow
@pytest.mark.browser
def test_html_synthetic_300_layers_in_chromium(tmp_path) -> None:
    """The issue's scale: 300 layers x 10 steps x 4 ranks (2 x 340,560 rows); every row in the page."""
    _need_chromium()
    store, man = _synth_store(tmp_path, layers=300, steps=10, ranks=4)
    data = report.analyze(store, "target", "ref")
    assert data.cmp.rows.height == man["rows_per_side"]
    _check_synth_page(data, man, store, tmp_path / "synth300.html")


@pytest.mark.processes
def test_progress_is_reported_by_callback(store, tmp_path) -> None:
    calls: list[tuple[str, int, int]] = []
    data = report.analyze(store, "weight_1pct_stats", "ref_stats", steps=[0], progress=lambda *a: calls.append(a))
    assert calls == [
        ("compare", 0, 5),
        ("divergence", 1, 5),
        ("overflow", 2, 5),
        ("checklist", 3, 5),
        ("health", 4, 5),
        ("analysed", 5, 5),
    ]
    calls.clear()
    n = report.write_csv(data.cmp, tmp_path / "r.csv", store=store, progress=lambda *a: calls.append(a))
    assert n == data.cmp.rows.height and calls == [("csv", n, n)]  # one call per 50,000 rows and one at the end
    assert not (tmp_path / "r.csv.part").exists()
    calls.clear()
    report.write_report_html(data, store, tmp_path / "r.html", progress=lambda *a: calls.append(a))
    assert calls == [("html", i, 4) for i in range(5)]


def test_health_findings_marked_on_the_curves(reports) -> None:
    """A loss spike and a gradient explosion (as health reports them) are drawn where the curves are."""
    from dumpstore.analysis._health import HealthFinding
    from dumpstore.analysis.report import figures

    data = reports("weight_1pct_stats", "ref_stats")
    rows = figures.prepared(data.cmp.rows)
    loss = data.health.loss[1]
    grads = figures.grad_figure(rows, 0)
    name_of = {t["name"]: t for t in grads["data"]}
    param = "Module.layers.1.fc2.Linear.parameters_grad.0.weight"
    assert "layers.1.fc2.weight (target)" in name_of
    found = [
        HealthFinding("loss_spike", loss["step"], 0, loss["op"], None, loss["value"], 1.0),
        HealthFinding("grad_explosion", 2, 0, "Module.layers.1.fc2.Linear.parameters_grad", param, 9.0, 1.0),
        HealthFinding("grad_explosion", 2, 0, "x", "not.a.plotted.parameter", 9.0, 1.0),
    ]
    marks = [t for t in figures.loss_figure(rows, data.health.loss, found)["data"] if t["name"].startswith("health")]
    assert [(t["name"], t["x"], t["y"]) for t in marks] == [("health: loss_spike", [loss["step"]], [loss["value"]])]
    marks = [t for t in figures.grad_figure(rows, 0, findings=found)["data"] if t["name"].startswith("health")]
    target = name_of["layers.1.fc2.weight (target)"]
    assert [(t["name"], t["x"], t["y"]) for t in marks] == [
        ("health: grad_explosion", [2], [target["y"][target["x"].index(2)]])
    ]


# clicks (plotly's event) the culprit's point on the error chart; the table then shows that op's rows at that step
_CLICK_DRIVER = """
window.addEventListener('load', function () {
  setTimeout(function () {
    var gd = document.getElementById('chart-line');
    var star = gd.data.filter(function (t) { return t.name === 'culprit'; })[0];
    gd.emit('plotly_click', {points: [{customdata: star.customdata[0]}]});
    var rows = Array.prototype.map.call(document.querySelectorAll('#top-table tbody tr'), function (tr) {
      return tr.cells[0].textContent + '|' + tr.cells[1].textContent + '|' + tr.cells[2].textContent; });
    document.body.setAttribute('data-clicked', JSON.stringify([document.getElementById('filter').value, rows]));
  }, 500);
});
"""


@pytest.mark.browser
def test_html_chart_point_opens_its_rows(reports, store, tmp_path) -> None:
    _need_chromium()
    data = reports("weight_1pct_stats", "ref_stats")
    path = tmp_path / "click.html"
    report.write_html(data.cmp, data.verdict, data.overflow, store, path)
    _with_driver(path, _CLICK_DRIVER)
    page = browser.load(path)
    got = re.search(r'data-clicked="([^"]*)"', page.dom)
    assert got, "the click driver did not run"
    name, rows = json.loads(html.unescape(got.group(1)))
    c = data.verdict.culprit
    assert name == c.op
    want = data.cmp.rows.filter(
        (pl.col("record") == c.op)
        & (pl.col("step") == c.step)
        & (pl.col("rank") == c.rank)
        & (pl.col("kind") != "null")
    )
    assert rows and set(rows) == {f"{c.step}|{c.rank}|{c.op}"} and len(rows) == want.height


def test_unwritable_report_path_is_one_line_error(reports, store, tmp_path) -> None:
    from dumpstore.errors import DumpstoreError

    data = reports("weight_1pct_stats", "ref_stats")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for write in (
        lambda p: report.write_csv(data.cmp, p, store=store),
        lambda p: report.write_html(data.cmp, data.verdict, data.overflow, store, p),
    ):
        with pytest.raises(DumpstoreError, match=r"file/r\.out: cannot write the report \(.*\); pick another path"):
            write(blocker / "r.out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.browser
def test_kernel_card_of_a_replayed_target_in_chromium(tmp_path) -> None:
    """A replayed target (`dumpstore replay`) gets a fifth verdict card, the replay's kernel finding with the
    reference's error beside it, and `report` prints its KERNEL line; a target never replayed has neither."""
    from dumpstore.cli.main import main
    from dumpstore.replaytable import write_replay

    _need_chromium()
    root = tmp_path / "store"
    for run in ("weight_1pct_stats", "ref_stats"):
        ingest(SAMPLES / run, run, store=root, jobs=1)
    args = ["report", "--target", "weight_1pct_stats", "--ref", "ref_stats", "--store", str(root)]
    before = CliRunner().invoke(main, [*args, "--html", str(tmp_path / "before.html")])
    assert before.exit_code == 0, before.output
    assert "KERNEL" not in before.output and 'id="kernel-card"' not in (tmp_path / "before.html").read_text()
    st = open_store(root)
    op = "Functional.linear.1.forward"
    write_replay(st, "weight_1pct_stats", replay_table([replay_row(0, 12, op, "fail", 700.0)]))
    write_replay(st, "ref_stats", replay_table([replay_row(0, 12, op, "pass", 1.0)]))
    res = CliRunner().invoke(main, [*args, "--html", str(tmp_path / "after.html")])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("KERNEL"))
    assert line.startswith(f"KERNEL (kernel): step 0 rank 0  {op}  output.0  ")
    page = browser.load(tmp_path / "after.html")
    _check_page(page, charts=5)
    card = re.search(r'<div id="kernel-card" class="finding kernel">.*?</table></div>', _verdict_block(page.dom))
    assert card, "no kernel card in the verdict"
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", card.group(0))).split())
    assert text.startswith(f"Kernel (replay): {op} show its rows rel_l2_ratio=700 > tol=2 (float32) ")
    assert (
        f"{op}.output.0: linear is 700× farther from float64 than the CPU's float32 linear (rel_l2 7e-05 vs 1e-07; "
        "judged ratio 700 > 2; msprobe's benchmark standard: error); the reference's is 1×"
    ) in text
    health = re.search(r'<section id="health">.*?</section>', page.dom, re.DOTALL).group(0)
    assert "kernel ×1" in health and f"<td>{op}.output.0</td>" in health  # and the health section lists it

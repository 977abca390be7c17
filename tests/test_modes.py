"""Runs dumped in different modes are compared with a warning, and --exact without both runs' tensor files
says what it fell back to."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dumpstore.cli.main import main
from helpers import SAMPLES

MIXED = (
    "the runs were dumped in different modes: target t in tensor mode, reference ref in statistics mode; tensors "
    "are judged from what both have (the statistics: rel_l2 is a lower bound)"
)
FELL_BACK = (
    "--exact needs the tensor files of both runs and reference ref has none (statistics mode): judged from the "
    "dumped statistics instead (rel_l2 a lower bound), not exactly"
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes") / "store"
    args = ["ingest", SAMPLES / "ref_stats", SAMPLES / "weight_1pct_tensor", SAMPLES / "ref_tensor"]
    res = CliRunner().invoke(main, [*map(str, args), "--run", "ref", "--run", "t", "--run", "rt", "--store", str(root)])
    assert res.exit_code == 0, res.output
    return root


def _run(store, *args):
    res = CliRunner().invoke(main, [*args, "--store", str(store)])
    assert res.exit_code == 0, res.output
    return res


def test_statistics_against_tensor_warns_and_says_so_in_the_header(store):
    res = _run(store, "divergence", "--target", "t", "--ref", "ref")
    assert res.stderr == f"warning: {MIXED}\n"
    assert res.stdout.splitlines()[1] == f"modes: {MIXED}"
    out = json.loads(_run(store, "divergence", "--target", "t", "--ref", "ref", "--json").stdout)
    assert out["modes"] == {
        "target": "tensor",
        "target_tensor_files": 400,
        "ref": "statistics",
        "ref_tensor_files": 0,
        "mixed": True,
        "notes": [MIXED],
    }


def test_exact_without_tensor_files_names_its_fallback(store):
    res = _run(store, "divergence", "--target", "t", "--ref", "ref", "--exact")
    assert res.stderr == f"warning: {MIXED}\nwarning: {FELL_BACK}\n"
    assert _run(store, "compare", "--target", "t", "--ref", "ref", "--exact", "--top", "1").stderr.endswith(
        f"warning: {FELL_BACK}\n"
    )


def test_same_modes_say_nothing(store):
    res = _run(store, "divergence", "--target", "t", "--ref", "rt", "--exact")
    assert res.stderr == "" and "modes:" not in res.stdout


def test_report_says_so_on_stderr_and_in_the_page(store, tmp_path):
    page = tmp_path / "r.html"
    res = _run(store, "report", "--target", "t", "--ref", "ref", "--exact", "--html", str(page))
    assert res.stderr == f"warning: {MIXED}\nwarning: {FELL_BACK}\n"
    html = page.read_text()
    assert html.count('class="warn modes-note"') == 2 and "modes: the runs were dumped in different modes" in html

"""Numbers users cross-check: cosine as msprobe prints it (6 decimals; `1 - x` closer to 1), --digits N."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dumpstore.cli import render
from dumpstore.cli.main import main
from helpers import SAMPLES


@pytest.mark.parametrize(
    "value,shown",
    [
        (0.99999473, "0.999995"),  # msprobe: round(float('{:.12f}'.format(c)), 6) above 0.9999
        (0.987654321, "0.987654"),
        (1.0, "1.000000"),
        (1.0 - 5.3e-8, "1 - 5.3e-08"),
        (float("nan"), "nan"),
        (None, "-"),
    ],
)
def test_cosine_as_msprobe_prints_it(value, shown):
    assert render.cosine(value) == shown


def test_cosine_column_in_tables():
    out = render.rows_out(["cosine", "rel_l2"], [{"cosine": 0.99999473, "rel_l2": 0.0123456}], "table")
    assert out.splitlines()[-1] == "0.999995  0.0123"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("numbers") / "store"
    res = CliRunner().invoke(
        main,
        [
            "ingest",
            str(SAMPLES / "ref_stats"),
            str(SAMPLES / "ln_eps_stats"),
            "--run",
            "ref",
            "--run",
            "eps",
            "--store",
            str(root),
        ],
    )
    assert res.exit_code == 0, res.output
    return root


def test_digits_option(store):
    args = ["divergence", "--target", "eps", "--ref", "ref", "--store", str(store)]
    three = CliRunner().invoke(main, args).output.splitlines()[1]
    assert "rel_l2=0.00519 > tol=0.000122" in three
    six = CliRunner().invoke(main, [*args, "--digits", "6"]).output.splitlines()[1]
    assert "rel_l2=0.00519201 > tol=0.00012207 " in six
    assert CliRunner().invoke(main, args).output.splitlines()[1] == three  # the next command is back to 3
    assert CliRunner().invoke(main, [*args, "--digits", "0"]).exit_code == 2

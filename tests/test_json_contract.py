"""--json as a contract: every command's output validates against its JSON Schema in the package
(dumpstore/schemas/<command>.json), carries schema_version, command, store and its runs, and keeps numbers numbers
(a non-finite value is null plus a `<key>_nonfinite` sibling)."""

from __future__ import annotations

import json
import math
from importlib import resources

import jsonschema
import pytest
from click.testing import CliRunner

from dumpstore.cli.main import main
from dumpstore.cli.render import SCHEMA_VERSION, _jsonable, to_json
from helpers import SAMPLES


def schema(command: str) -> dict:
    return json.loads((resources.files("dumpstore") / "schemas" / f"{command}.json").read_text())


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract") / "store"
    res = CliRunner().invoke(
        main,
        [
            "ingest",
            str(SAMPLES / "ref_stats"),
            str(SAMPLES / "no_mask_stats"),
            "--run",
            "ref",
            "--run",
            "nomask",
            "--store",
            str(root),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    jsonschema.validate(json.loads(res.stdout), schema("ingest"))
    return root


COMMANDS = {
    "divergence": (["divergence", "--target", "nomask", "--ref", "ref"], {"target": "nomask", "ref": "ref"}),
    "compare": (["compare", "--target", "nomask", "--ref", "ref", "--top", "50"], {"target": "nomask", "ref": "ref"}),
    "checklist": (["checklist", "--target", "nomask", "--ref", "ref"], {"target": "nomask", "ref": "ref"}),
    "overflow": (["overflow", "--run", "nomask", "--ref", "ref"], {"run": "nomask", "ref": "ref"}),
    "health": (["health", "--run", "nomask"], {"run": "nomask"}),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_json_validates_and_names_its_runs(store, command):
    args, names = COMMANDS[command]
    res = CliRunner().invoke(main, [*args, "--store", str(store), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    jsonschema.validate(out, schema(command))
    assert out["schema_version"] == SCHEMA_VERSION and out["command"] == command
    assert out["store"] == str(store)
    assert {k: out[k] for k in names} == names


@pytest.mark.parametrize("command,sql", [("runs", None), ("query", "select 1 as one, 'inf'::double as big")])
def test_row_commands_are_arrays_of_rows(store, command, sql):
    res = CliRunner().invoke(main, [command, *([sql] if sql else []), "--store", str(store), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    jsonschema.validate(out, schema(command))
    if command == "query":
        assert out == [{"one": 1, "big": None, "big_nonfinite": "inf"}]


def test_divergence_json_says_rel_l2_and_marks_non_finite(store):
    """nomask's steps have an infinite largest error (a softmax over -inf): null with its status."""
    res = CliRunner().invoke(
        main, ["divergence", "--target", "nomask", "--ref", "ref", "--store", str(store), "--json"]
    )
    out = json.loads(res.stdout)
    keys: set[str] = set()

    def walk(v):
        if isinstance(v, dict):
            keys.update(v)
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk({k: v for k, v in out.items() if k not in ("first_divergence", "culprit")})
    assert "max_err" not in keys and "err" not in keys
    assert out["steps"][0]["max_rel_l2"] is None and out["steps"][0]["max_rel_l2_nonfinite"] == "inf"


def test_every_schema_is_a_valid_schema_and_packaged():
    names = sorted(p.name for p in (resources.files("dumpstore") / "schemas").iterdir() if p.name.endswith(".json"))
    assert names == [f"{c}.json" for c in sorted([*COMMANDS, "ingest", "runs", "query", "curves"])]  # curves: long runs
    for n in names:
        jsonschema.Draft202012Validator.check_schema(schema(n.removesuffix(".json")))


def test_non_finite_numbers_become_null_with_status():
    assert _jsonable({"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1.5, "e": [math.inf, 2.0]}) == {
        "a": None,
        "a_nonfinite": "inf",
        "b": None,
        "b_nonfinite": "-inf",
        "c": None,
        "c_nonfinite": "nan",
        "d": 1.5,
        "e": [None, 2.0],
    }
    assert "Infinity" not in to_json({"x": math.inf}) and "NaN" not in to_json([math.nan])

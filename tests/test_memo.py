"""The divergence verdict is memoized in the store: reused only for the same question on the same ingests."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dumpstore._ingest import ingest
from dumpstore.cli.main import main
from helpers import SAMPLES

div_module = importlib.import_module("dumpstore.analysis._divergence")  # the module, not the function

# `dumpstore divergence ARGS` in a fresh interpreter, then which heavy libraries it imported.
_PROBE = """
import sys
from dumpstore.cli.main import main
main(sys.argv[1:], standalone_mode=False)
print("IMPORTED", ",".join(m for m in ("polars", "duckdb", "pyarrow", "numpy") if m in sys.modules))
"""


@pytest.fixture
def computed(monkeypatch) -> list[str]:
    """Records each verdict actually computed (the real function runs)."""
    calls: list[str] = []
    real = div_module.divergence_by_steps

    def spy(store, target, ref, **kw):
        calls.append(f"{target}/{ref}")
        return real(store, target, ref, **kw)

    monkeypatch.setattr(div_module, "divergence_by_steps", spy)
    return calls


def _divergence(store: Path, *args: str) -> dict:
    res = CliRunner().invoke(
        main, ["divergence", "--target", "target", "--ref", "ref", "--store", str(store), "--json", *args]
    )
    assert res.exit_code == 0, res.output
    return _verdict(json.loads(res.output))


def _verdict(out: dict) -> dict:
    """The library's verdict in `divergence --json`: without the contract's keys, the explanations (memoized
    apart, analysis/explain.py) and the replay's kernel finding (read from the replay table, not memoized)."""
    v = {k: x for k, x in out.items() if k not in ("schema_version", "command", "store", "modes", "kernel")}
    for key in ("steps", "ranks"):
        v[key] = [{("max_err" if k == "max_rel_l2" else k): x for k, x in s.items()} for s in v[key]]
    for key in ("first_divergence", "culprit"):
        if v.get(key):
            v[key] = {k: x for k, x in v[key].items() if k != "explanation"}
    return v


@pytest.fixture
def pair(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    ingest(SAMPLES / "ref_stats", "ref", store=store, jobs=1)
    ingest(SAMPLES / "weight_1pct_stats", "target", store=store, jobs=1)
    return store


def test_second_ask_is_answered_from_the_memo_without_heavy_imports(pair, computed):
    first = _divergence(pair)
    assert first["first_divergence"]["op"] == "Functional.linear.6.forward"
    assert _divergence(pair) == first
    assert computed == ["target/ref"]
    assert _divergence(pair, "--no-cache") == first
    assert len(computed) == 2
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _PROBE,
            "divergence",
            "--target",
            "target",
            "--ref",
            "ref",
            "--store",
            str(pair),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out, _, imported = proc.stdout.rpartition("IMPORTED ")
    assert _verdict(json.loads(out)) == first
    assert imported.strip() == ""


def test_reingest_of_a_run_invalidates_its_verdicts(pair, computed):
    before = _divergence(pair)
    ingest(SAMPLES / "ln_eps_stats", "target", store=pair, jobs=1)  # same run name, other dump
    after = _divergence(pair)
    assert len(computed) == 2
    assert after["first_divergence"]["op"] != before["first_divergence"]["op"]
    assert after["first_divergence"]["op"].startswith("Functional.layer_norm")


def test_ingest_of_another_run_keeps_the_memo(pair, computed):
    first = _divergence(pair)
    ingest(SAMPLES / "lr_stats", "other", store=pair, jobs=1)  # the catalog file changes, these runs do not
    assert _divergence(pair) == first
    assert len(computed) == 1


def test_another_question_is_another_memo(pair, tmp_path, computed):
    strict = _divergence(pair)
    loose = _divergence(pair, "--tol", "1")
    assert strict["first_divergence"] is not None and loose["first_divergence"] is None
    mapping = tmp_path / "map.yaml"
    mapping.write_text("Functional.linear.6.forward: Functional.linear.6.forward\n")
    _divergence(pair, "--map", str(mapping))
    mapping.write_text("Functional.linear.5.forward: Functional.linear.5.forward\n")  # same path, new content
    _divergence(pair, "--map", str(mapping))
    _divergence(pair, "--step", "1", "--step", "0")
    _divergence(pair, "--step", "0", "--step", "1")  # the same steps: the same question
    assert len(computed) == 5
    assert len(list((pair / "memo").glob("*.json"))) == 5


def test_a_corrupt_memo_is_recomputed(pair, computed):
    first = _divergence(pair)
    (memo,) = (pair / "memo").glob("*.json")
    memo.write_text("{not json")
    assert _divergence(pair) == first
    assert len(computed) == 2
    json.loads(memo.read_text())  # rewritten


def test_library_answer_uses_the_same_memo_as_the_cli(pair, computed):
    from dumpstore import open_store
    from dumpstore.analysis import Question, Verdict, answer

    cli = _divergence(pair)
    lib = answer(pair, Question("target", "ref"))
    assert isinstance(lib, Verdict) and lib.to_dict() == cli
    assert lib.culprit is not None and lib.culprit.op == cli["culprit"]["op"]
    assert answer(open_store(pair), Question("target", "ref")).to_dict() == cli
    assert computed == ["target/ref"]


def test_report_saves_its_verdict_for_divergence(pair, computed):
    from dumpstore import open_store
    from dumpstore.analysis.report import analyze

    data = analyze(open_store(pair), "target", "ref")
    assert computed == []  # the report's own comparison gave the verdict
    assert _divergence(pair) == data.verdict.to_dict()
    assert computed == []  # ... and divergence found it in the memo

"""The verdict in the user's terms (analysis/explain.py): module, parameter, argument by name, source line,
advice and the next dump's msprobe config, on the samples, in text, JSON, CSV and the report's card."""

from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner

from dumpstore.analysis.explain import argument_name, explain_findings, module_of, next_dump_config, user_frame
from dumpstore.analysis.tolerance import Tolerances
from dumpstore.analysis.verdict import Question, answer
from dumpstore.cli.main import main
from helpers import sample_cases


def _explained(store, target: str, ref: str) -> dict:
    v = answer(store, Question(target, ref, None, None, Tolerances(), (), False), use_memo=False)
    return {k: (e.to_dict() if e else None) for k, e in explain_findings(store, v).items()}


def _cli(store, *args):
    return CliRunner().invoke(main, [*map(str, args), "--store", str(store.root)])


def test_parameter_named_by_module_path(sample_store):
    case = next(c for c in sample_cases() if c["name"] == "weight_1pct_stats")
    ex = _explained(sample_store, case["name"], case["ref"])["culprit"]
    assert ex["parameter"]["name"] == case["expected"]["parameter"]
    assert (ex["module"], ex["module_class"]) == ("layers.1.fc1", "Linear")
    assert ex["module_record"] == "Module.layers.1.fc1.Linear.forward.0"
    assert ex["parameter"]["target_norm"] / ex["parameter"]["ref_norm"] == pytest.approx(1.01, rel=1e-4)
    assert ex["source"] == {
        "file": "/home/user/job/generate.py",
        "line": 140,
        "function": "forward",
        "code": "h = self.fc1(self.ln2(x))",
    }


def test_scalar_argument_named_from_the_signature(sample_store):
    ex = _explained(sample_store, "ln_eps_stats", "ref_stats")["culprit"]
    assert ex["argument"] == {"name": "eps", "position": "4", "named_by": "signature", "target": "0.01", "ref": "1e-05"}
    assert (ex["module"], ex["module_class"]) == ("layers.0.ln2", "LayerNorm")


def test_keyword_argument_named_by_the_record(sample_store):
    ex = _explained(sample_store, "gelu_tanh_stats", "ref_stats")["culprit"]
    assert ex["argument"] == {
        "name": "approximate",
        "position": "approximate",
        "named_by": "record",
        "target": '"tanh"',
        "ref": None,
    }
    assert ex["source"]["code"] == 'h = F.gelu(h, approximate="tanh")'


def test_missing_op_located_in_the_reference(sample_store):
    ex = _explained(sample_store, "no_mask_stats", "ref_stats")
    assert ex["culprit"]["run"] == "ref_stats"
    assert ex["culprit"]["source"]["code"] == 'scores = scores.masked_fill(mask, float("-inf"))'
    assert ex["culprit"]["advice"].startswith("The target never runs Tensor.masked_fill.1.forward; the reference does")
    assert ex["first_divergence"]["source"]["code"] == "attn = F.softmax(scores, dim=-1)"


_CULPRITS = [c for c in sample_cases() if (c["expected"] or {}).get("culprit")]


@pytest.mark.parametrize("case", _CULPRITS, ids=lambda c: c["name"])
def test_every_sample_culprit_is_explained(sample_store, case):
    """Every sample's culprit gets a source line, advice and a config (a module where the op runs inside one)."""
    ex = _explained(sample_store, case["name"], case["ref"])["culprit"]
    assert ex is not None
    assert ex["source"] is not None and ex["source"]["file"].endswith("generate.py")
    assert ex["advice"]
    assert ex["next_dump"]["task"] == "tensor"
    assert ex["next_dump"]["level"] == ("mix" if ex["module_record"] else "L1")


def test_divergence_text_json_csv(sample_store):
    res = _cli(sample_store, "divergence", "--target", "ln_eps_stats", "--ref", "ref_stats")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("CULPRIT"))
    assert lines[i + 1 : i + 4] == [
        "  where: layers.0.ln2 (LayerNorm), called at generate.py:140 in forward: h = self.fc1(self.ln2(x))",
        "  argument: eps = 0.01 (target) vs 1e-05 (reference)",
        "  fix: Make both runs call Functional.layer_norm.1.forward with the same eps: check the model config or "
        "the layer's constructor arguments (at generate.py:140 in forward: h = self.fc1(self.ln2(x))).",
    ]
    assert lines[i + 4].startswith("  next: dump it at tensor level with this msprobe config.json: {")
    cfg = json.loads(lines[i + 4].split("config.json: ", 1)[1])
    assert cfg["tensor"]["list"] == [
        "Module.layers.0.ln2.LayerNorm.forward.0",
        "Module.layers.0.ln2.LayerNorm.backward.0",
    ]

    res = _cli(sample_store, "divergence", "--target", "ln_eps_stats", "--ref", "ref_stats", "--json")
    v = json.loads(res.output)
    assert v["culprit"]["explanation"]["argument"]["name"] == "eps"
    assert v["culprit"]["explanation"]["next_dump"] == cfg
    assert v["first_divergence"]["explanation"]["module"] == "layers.0.ln2"

    res = _cli(sample_store, "divergence", "--target", "ln_eps_stats", "--ref", "ref_stats", "--csv")
    rows = list(csv.DictReader(io.StringIO(res.output)))
    assert [r["finding"] for r in rows] == ["first_divergence", "culprit"]
    assert (rows[1]["argument"], rows[1]["target_value"], rows[1]["ref_value"]) == ("eps", "0.01", "1e-05")
    assert rows[1]["source_line"] == "generate.py:140 in forward: h = self.fc1(self.ln2(x))"
    assert rows[0]["module_class"] == "LayerNorm"


def test_report_card_explains_the_culprit(sample_store, tmp_path):
    page = tmp_path / "r.html"
    res = _cli(sample_store, "report", "--target", "weight_1pct_stats", "--ref", "ref_stats", "--html", page)
    assert res.exit_code == 0, res.output
    assert "\n  parameter: layers.1.fc1.weight (norm " in res.output  # the command's own lines say it too
    html = page.read_text()
    assert "<th>parameter</th><td>layers.1.fc1.weight (norm " in html
    assert "<th>where</th><td>layers.1.fc1 (Linear), called at generate.py:140 in forward:" in html
    assert 'class="next-dump"' in html and "Module.layers.1.fc1.Linear.forward.0" in html


# -- units --------------------------------------------------------------------------------------------------


def test_user_frame_skips_frameworks_and_stdlib():
    frames = [
        "File /opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py, line 1811, in inner, \n x = hook()",
        "File /usr/lib/python3.11/contextlib.py, line 81, in inner, \n return func(*args, **kwds)",
        "File /opt/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py, line 164, in "
        "forward, \n hidden = self.norm(hidden)",
        "File /opt/venv/lib/python3.11/site-packages/msprobe/pytorch/hook.py, line 3, in f, \n y()",
        "File /home/me/train.py, line 42, in step, \n out = model(x)",
    ]
    assert user_frame(frames) == {"file": "/home/me/train.py", "line": 42, "function": "step", "code": "out = model(x)"}
    assert user_frame(frames[:4]) is None
    assert user_frame(None) is None


def test_module_of():
    assert module_of("Module.model.layers.2.post_attention_layernorm.LlamaRMSNorm.forward.0") == (
        "model.layers.2.post_attention_layernorm",
        "LlamaRMSNorm",
    )
    assert module_of("Cell.network.dense.Dense.backward.1") == ("network.dense", "Dense")
    assert module_of(None) == (None, None)
    assert module_of("Functional.gelu.0.forward") == (None, None)


def test_where_names_the_top_level_module():
    from dumpstore.analysis.explain import Explanation

    ex = Explanation("Functional.linear.9.forward", "t", module="", module_class="TinyNet")
    assert ex.where() == "the model itself (TinyNet)"
    assert module_of("Module.TinyNet.forward.0") == ("", "TinyNet")


def test_argument_name():
    assert argument_name({"index_path": "4", "op_type": "layer_norm"}) == ("eps", "signature")
    assert argument_name({"index_path": "1.0", "op_type": "layer_norm"}) == ("normalized_shape[0]", "signature")
    assert argument_name({"index_path": "alpha", "op_type": "add_"}) == ("alpha", "record")
    assert argument_name({"index_path": "2", "op_type": "__add__"}) == ("alpha", "signature")
    assert argument_name({"index_path": "7", "op_type": "my_op"}) == ("argument 7", "position")


@pytest.mark.msprobe
@pytest.mark.parametrize(
    "cfg",
    [
        next_dump_config("Functional.layer_norm.1.forward", "Module.layers.0.ln2.LayerNorm.forward.0", 3, 1),
        next_dump_config("Functional.layer_norm.1.forward", None, 0, 0),
        next_dump_config("Cell.net.dense.Dense.forward.0", "Cell.net.dense.Dense.forward.0", 0, 0),
    ],
)
def test_next_dump_config_is_accepted_by_msprobe(tmp_path, cfg):
    """msprobe's own config classes and scope builder accept the config dumpstore suggests."""
    pytest.importorskip("msprobe")
    from msprobe.core.dump.common_config import CommonConfig
    from msprobe.core.dump.data_dump.scope import ScopeFactory
    from msprobe.pytorch.dump.pt_config import parse_json_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    common, task = parse_json_config(str(path), None)
    assert isinstance(common, CommonConfig)
    assert (common.task, common.level, common.step, common.rank) == ("tensor", cfg["level"], cfg["step"], cfg["rank"])
    assert task.list == cfg["tensor"]["list"]

    class _Cfg:
        pass

    c = _Cfg()
    c.task, c.level, c.scope, c.list = common.task, common.level, task.scope, list(task.list)
    scope = ScopeFactory(c).build_scope()
    assert scope is not None
    name = cfg["tensor"]["list"][0]
    if cfg["level"] == "mix":
        scope.begin_module(name)
        assert scope.check("Functional.layer_norm.1.forward")  # everything inside the module
        scope.end_module(name)
        assert not scope.check("Functional.linear.9.forward")
    else:
        assert scope.check(name) and not scope.check("Functional.layer_norm.11.forward")


@pytest.mark.parametrize("whole", [True, False])
def test_lookup_reads_what_duckdb_reads(sample_store, tmp_path, monkeypatch, whole):
    """The explanation's rows and stacks, read by pyarrow and picked in Python, are DuckDB's answer to the same
    question over the same partition files, a record's leaves in the file's order (which DuckDB's sort on `seq`
    alone kept only within one row group), whether a file is read whole or a row group at a time (its files
    rewritten in groups of 50 rows); a file that goes away leaves nothing to explain, no error."""
    import glob
    import shutil

    import duckdb

    from dumpstore import parquetio
    from dumpstore.analysis import explain as ex
    from dumpstore.analysis.explain import _COLS, _Lookup

    store = tmp_path / "copy"
    shutil.copytree(sample_store.root, store)
    if not whole:
        monkeypatch.setattr(ex, "_WHOLE_ROWS", 0)
        for f in store.rglob("run=weight_1pct_stats/**/*.parquet"):
            table = parquetio.read_table(f)
            f.unlink()  # (a hard link into the staging folder: a new file, not the same one rewritten)
            with parquetio.Writer(f, table.schema) as out:
                out.write_table(table, row_group_size=50)
            assert parquetio.Reader(f).num_row_groups > 1 or table.num_rows <= 50
    look = _Lookup(store, "weight_1pct_stats", "ref_stats")
    (pattern,) = look.tensors["weight_1pct_stats"]
    files = sorted(glob.glob(pattern.replace("/*/*/", "/step=1/rank=0/")))
    con = duckdb.connect(":memory:")
    cols = ", ".join(_COLS)
    names = ["Functional.linear.6.forward", "Module.layers.1.fc1.Linear.forward.0", "Tensor.__add__.3.forward"]
    for records in (names[:1], names, ["no.such.record"]):
        want = con.execute(
            f"SELECT {cols} FROM read_parquet(?, file_row_number=true) WHERE list_contains(?, record) "
            "ORDER BY seq, file_row_number",
            [files, records],
        )
        want = [dict(zip(_COLS, row)) for row in want.fetchall()]
        got = look.rows("weight_1pct_stats", 1, 0, records)
        assert [{c: r[c] for c in _COLS} for r in got] == want
        assert {r["run"] for r in got} <= {"weight_1pct_stats"}
    assert len(look.rows("weight_1pct_stats", 1, 0, names)) > 10
    sid = look.rows("weight_1pct_stats", 1, 0, names[:1])[0]["stack_id"]
    stacks = sorted(f for p in look.stacks["weight_1pct_stats"] for f in glob.glob(p))
    frames = con.execute(
        "SELECT frames FROM read_parquet(?) WHERE step = 1 AND rank = 0 AND stack_id = ?", [stacks, sid]
    ).fetchone()[0]
    assert look.frames("weight_1pct_stats", 1, 0, sid) == frames and frames
    assert look.frames("weight_1pct_stats", 1, 0, 10**6) is None

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    gone = _Lookup(copy, "weight_1pct_stats", "ref_stats")
    for f in glob.glob(gone.tensors["weight_1pct_stats"][0].replace("/*/*/", "/step=1/rank=0/")):
        (copy / f).unlink()
    assert gone.rows("weight_1pct_stats", 1, 0, names) == []
    assert gone.rows("weight_1pct_stats", 0, 0, names[:1])  # another partition is still there

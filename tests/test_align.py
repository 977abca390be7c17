"""Alignment: counter-free sequence alignment, cross-framework names, mapping files, proc folders."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.mapping import Mapping, load_mapping
from dumpstore.cli.main import main
from dumpstore.errors import DumpstoreError
from dumpstore.store import open_store
from helpers import MSPROBE, SAMPLES


def _pairs(cmp, step=0):
    recs = cmp.records.filter(pl.col("step") == step)
    return {(r["t_record"], r["r_record"]) for r in recs.iter_rows(named=True)}


def test_extra_call_does_not_renumber_later_calls(store_dir):
    ingest(SAMPLES / "ref_stats", "ref", store=store_dir, jobs=1)
    ingest(SAMPLES / "extra_gelu_stats", "extra", store=store_dir, jobs=1)
    cmp = compare_runs(open_store(store_dir), "extra", "ref")
    pairs = _pairs(cmp)
    assert ("Functional.gelu.1.forward", "Functional.gelu.0.forward") in pairs
    assert ("Functional.gelu.2.forward", "Functional.gelu.1.forward") in pairs
    assert ("Functional.gelu.0.forward", None) in pairs
    # once aligned, no value differs
    assert cmp.rows.filter(pl.col("status") == "diverged").height == 0


def test_mindspore_target_pairs_with_pytorch_reference(store_dir):
    ingest(MSPROBE / "ms_statistics", "ms", store=store_dir, jobs=1)
    ingest(MSPROBE / "v26_md5", "pt", store=store_dir, jobs=1)
    pairs = _pairs(compare_runs(open_store(store_dir), "ms", "pt"))
    for t, r in [
        ("Cell.layers.0.fc1.Dense.forward.0", "Module.layers.0.fc1.Linear.forward.0"),
        ("MintFunctional.softmax.0.forward", "Functional.softmax.0.forward"),
        ("Cell.head.Dense.parameters_grad.0", "Module.head.Linear.parameters_grad.0"),
    ]:
        assert (t, r) in pairs


def test_builtin_names():
    m = Mapping(mindspore_to_pytorch=True)
    assert m.record("Mint.matmul.2.backward") == "Torch.matmul.2.backward"
    assert m.record("Functional.add.3.forward") == "Torch.add.3.forward"
    assert m.record("Functional.gelu.0.forward") == "Functional.gelu.0.forward"
    assert m.record("Tensor.swapaxes.1.forward") == "Tensor.transpose.1.forward"
    assert m.record("Cell.layers.0.CellList.forward.0") == "Module.layers.0.ModuleList.forward.0"


def _attention_dump(dump_writer, name, api, scale):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    w = dump_writer(name)
    w.write(
        {
            "Functional.linear.0.forward": {"input_args": [x], "output": [x * 2]},
            f"{api}.0.forward": {"input_args": [x * 2], "output": [x * 2 * scale]},
        }
    )
    return w.root


@pytest.mark.parametrize(
    "yaml_text",
    [
        "Functional.my_attention: NPU.npu_fusion_attention\n",
        "api:\n  Functional.my_attention: NPU.npu_fusion_attention\n",
        "- ms_api: Functional.my_attention\n  pt_api: NPU.npu_fusion_attention\n",
        "Functional.my_attention.0.forward.input.0: NPU.npu_fusion_attention.0.forward.input.0\n"
        "Functional.my_attention.0.forward.output.0: NPU.npu_fusion_attention.0.forward.output.0\n",
    ],
)
def test_mapping_file_pairs_renamed_api(dump_writer, store_dir, tmp_path, yaml_text):
    ingest(_attention_dump(dump_writer, "t", "Functional.my_attention", 1.5), "t", store=store_dir, jobs=1)
    ingest(_attention_dump(dump_writer, "r", "NPU.npu_fusion_attention", 1.0), "r", store=store_dir, jobs=1)
    st = open_store(store_dir)
    plain = compare_runs(st, "t", "r")
    assert plain.rows.filter(pl.col("match").is_in(["target_only", "ref_only"])).height == 4
    f = tmp_path / "map.yaml"
    f.write_text(yaml_text)
    mapped = compare_runs(st, "t", "r", mapping=load_mapping([f]))
    out = mapped.rows.filter(pl.col("name") == "Functional.my_attention.0.forward.output.0").row(0, named=True)
    assert out["ref_name"] == "NPU.npu_fusion_attention.0.forward.output.0"
    assert out["status"] == "diverged" and out["err"] == pytest.approx(0.5, rel=1e-6)
    res = CliRunner().invoke(
        main, ["divergence", "--target", "t", "--ref", "r", "--store", str(store_dir), "--map", str(f), "--json"]
    )
    assert '"op": "Functional.my_attention.0.forward"' in res.output


def test_bad_mapping_file_is_one_line_error(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("a: [1, 2\n")
    with pytest.raises(DumpstoreError, match="not a valid YAML mapping file"):
        load_mapping([f])


def test_proc_folders_pair_across_runs(store_dir, tmp_path):
    import shutil

    src = MSPROBE / "v26_md5"
    other = tmp_path / "copy"
    shutil.copytree(src, other)
    for step in other.iterdir():
        for proc in step.iterdir():
            proc.rename(proc.with_name("proc99999"))
    ingest(src, "a", store=store_dir, jobs=1)
    ingest(other, "b", store=store_dir, jobs=1)
    cmp = compare_runs(open_store(store_dir), "a", "b")
    assert set(cmp.rows["status"].unique()) == {"pass"}
    assert set(cmp.rows["rank_dir"].unique()) != set(cmp.rows["ref_rank_dir"].unique())


def _frame(records: list[str], leaves: int = 2) -> pl.DataFrame:
    rows = [
        {
            "step": 0,
            "rank": 0,
            "source": "",
            "seq": i,
            "record": rec,
            "io": "output",
            "index_path": str(j),
            "name": f"{rec}.output.{j}",
            "max": float(i + j),
            "shape": [2, j + 1],
        }
        for i, rec in enumerate(records)
        for j in range(leaves)
    ]
    return pl.DataFrame(rows)


@pytest.mark.parametrize(
    "t_records, r_records, in_place",
    [
        (["a", "b", "c"], ["a", "b", "c"], True),
        (["a", "b", "c"], ["a", "c", "b"], False),  # other rows: the join
        (["a", "b", "c"], ["a", "b"], False),  # a record in one run only
        (["a", "b", "b"], ["a", "b", "b"], False),  # a leaf twice: every copy pairs with every copy
    ],
)
def test_leaves_side_by_side_are_the_join(monkeypatch, t_records, r_records, in_place):
    """Runs with the same leaves row for row are put side by side, with exactly the join's result."""
    from dumpstore.analysis import align

    t, r = _frame(t_records), _frame(r_records).with_columns(pl.col("max") + 1)
    records = align.align_records(t, r)
    got = align.align_leaves(t, r, records)
    assert (align._pairs_in_place(t, r, records) is not None) == in_place
    monkeypatch.setattr(align, "_pairs_in_place", lambda *a: None)
    want = align.align_leaves(t, r, records)
    assert got.schema == want.schema
    assert got.sort("ref_seq", "seq", nulls_last=True).equals(want.sort("ref_seq", "seq", nulls_last=True))
    if in_place:
        assert got.equals(want)

"""MindSpore <-> PyTorch pairing on msprobe's own layer-mapping fixtures (tests/data/mstt/layer_mapping_ut):
msprobe's expected pairing (its test_layer_mapping.py) reproduced row by row; no alignment choice becomes a
divergence."""

from __future__ import annotations

import json

import pytest

from dumpstore._ingest import ingest
from dumpstore.analysis.compare import compare_runs
from dumpstore.analysis.mapping import load_mapping
from dumpstore.errors import DumpstoreError
from dumpstore.store import open_store
from helpers import DATA

LM = DATA / "mstt" / "layer_mapping_ut"
EXPECTED = json.loads((DATA / "mstt" / "layer_mapping_expected.json").read_text())


@pytest.fixture
def ms_pt_store(store_dir):
    ingest(LM / "mindspore_data", "ms", store=store_dir, jobs=1)
    ingest(LM / "pytorch_data", "pt", store=store_dir, jobs=1)
    return open_store(store_dir)


def _target_pairs(cmp) -> dict[str, str | None]:
    rows = cmp.rows.filter(cmp.rows["name"].is_not_null())
    return dict(zip(rows["name"].to_list(), rows["ref_name"].to_list()))


def test_layer_mapping_reproduces_msprobe_pairing(ms_pt_store):
    cmp = compare_runs(ms_pt_store, "ms", "pt", mapping=load_mapping([LM / "layer_mapping.yaml"]))
    want = {k: None if v == "N/A" else v for k, v in EXPECTED["data_mapping"].items()}
    assert len(want) == 44
    assert _target_pairs(cmp) == want


def test_layer_mapping_record_pairs(ms_pt_store):
    cmp = compare_runs(ms_pt_store, "ms", "pt", mapping=load_mapping([LM / "layer_mapping.yaml"]))
    got = {t: r for t, r in cmp.records.select("t_record", "r_record").iter_rows() if t is not None}
    assert got == {k: None if v == "N/A" else v for k, v in EXPECTED["api_mapping"].items()}


def test_without_layer_mapping_no_pair_of_unmatchable_shapes(ms_pt_store):
    """Without -lm the [5, 2] `Tensor.__add__.0` must not pair with the [] `Tensor.__add__.1` of the reference."""
    cmp = compare_runs(ms_pt_store, "ms", "pt")
    pairs = cmp.rows.filter(cmp.rows["name"].is_not_null() & cmp.rows["ref_name"].is_not_null())
    for shape, ref_shape, name, ref in pairs.select("shape", "ref_shape", "name", "ref_name").iter_rows():
        same_record = name.rsplit(".", 2)[0] == ref.rsplit(".", 2)[0]
        assert same_record or [d for d in (shape or []) if d != 1] == [d for d in (ref_shape or []) if d != 1], (
            name,
            ref,
            shape,
            ref_shape,
        )
    assert _target_pairs(cmp)["Tensor.__add__.0.forward.output.0"] != "Tensor.__add__.1.forward.output.0"


def test_layer_mapping_with_non_string_child_is_refused(tmp_path):
    bad = tmp_path / "lm.yaml"
    bad.write_text("ParallelAttention:\n  qkv: [a, b]\n")
    with pytest.raises(DumpstoreError, match="layer mapping 'ParallelAttention' must map child names"):
        load_mapping([bad])


def test_mixed_names_and_tables_refused(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("fc1.Dense: fc1.Linear\nParallelAttention:\n  qkv: query_key_value\n")
    with pytest.raises(DumpstoreError, match="mixes names"):
        load_mapping([bad])


def test_layer_mapping_resources_fixture(store_dir):
    """msprobe's core_ut test_common_layer_mapping.py on resources/layer_mapping: the one module pairs."""
    res = DATA / "mstt" / "layer_mapping_res"
    ingest(res / "mindspore", "ms", store=store_dir, jobs=1)
    ingest(res / "pytorch", "pt", store=store_dir, jobs=1)
    cmp = compare_runs(open_store(store_dir), "ms", "pt", mapping=load_mapping([res / "layer_mapping.yaml"]))
    got = {t: r for t, r in cmp.records.select("t_record", "r_record").iter_rows() if t is not None}
    assert got == {
        "Cell.network_with_loss.module.language_model.embedding.word_embeddings.VocabParallelEmbedding."
        "forward.0": "Module.module.module.language_model.embedding.word_embeddings.VocabParallelEmbedding.forward.0"
    }
    assert cmp.rows.filter(cmp.rows["match"] == "layer_mapping").height == 2


@pytest.mark.parametrize(
    "rel, kind",
    [
        ("common/cell_mapping.yaml", "module"),
        ("visualization/mapping.yaml", "data"),
        ("layer_mapping_ut/layer_mapping.yaml", "layer"),
    ],
)
def test_corpus_mapping_files_load_as_their_kind(rel, kind):
    m = load_mapping([DATA / "mstt" / rel])
    assert [k for k in ("module", "api", "data", "layer") if getattr(m, k)] == [kind]

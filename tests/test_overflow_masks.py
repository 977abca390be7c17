"""A causal mask filled with the dtype's lowest value (Llama's `finfo.min`) is a fill, not an overflow."""

from __future__ import annotations

import json
import shutil

from dumpstore._ingest import ingest
from dumpstore.analysis._overflow import overflow
from dumpstore.store import open_store
from helpers import SAMPLES

FMIN = -3.4028234663852886e38


def _finfo_min_mask(tmp_path, op: str):
    """ref_stats step 0 with its masking records filling finfo.min instead of -inf, renamed to `op`."""
    src = SAMPLES / "ref_stats" / "step0" / "rank0"
    dst = tmp_path / "dump" / "step0" / "rank0"
    shutil.copytree(src, dst)
    doc = json.loads((dst / "dump.json").read_text())
    data = {}
    for key, rec in doc["data"].items():
        if key.startswith("Tensor.masked_fill.") and key.endswith(".forward"):
            rec["input_args"][2]["value"] = FMIN
            out = rec["output"][0]
            out["Min"], out["Mean"], out["Norm"] = FMIN, -1e38, 1e39
            key = key.replace("Tensor.masked_fill.", op + ".")
        data[key] = rec
    doc["data"] = data
    (dst / "dump.json").write_text(json.dumps(doc))
    store = tmp_path / "store"
    ingest(tmp_path / "dump", "llama", store=store, jobs=1)
    return open_store(store)


def test_where_mask_with_finfo_min_is_not_overflow(tmp_path):
    st = _finfo_min_mask(tmp_path, "Torch.where")
    rep = overflow(st, "llama")
    assert rep.first_overflow is None
    assert [p["op"] for p in rep.producers] == ["Torch.where.0.forward", "Torch.where.1.forward"]
    assert all(p["likely_mask"] and p["kind"] == "saturated" for p in rep.producers)


def test_masked_fill_with_finfo_min_is_not_overflow(tmp_path):
    st = _finfo_min_mask(tmp_path, "Tensor.masked_fill")
    assert overflow(st, "llama").first_overflow is None

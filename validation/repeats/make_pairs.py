"""An extra call beside a repeat of the same call, on set 2's Gemma (fp32 weights under bf16 autocast, device F):
the target multiplies the token embeddings by sqrt(hidden) twice.  The expected culprit is the target's second
multiply, the first record the reference has no match for (the first multiply reads and makes the same values in
both runs); names alone put the extra first (analysis/align_repeats.py places it by values).  Made with set 2's run
harness (``validation/v2/make_pairs.py``: its families, devices, runs and key), both dump modes:

    .venv/bin/python validation/repeats/make_pairs.py [--out validation/repeats/.data]
    .venv/bin/python validation/score.py --data validation/repeats/.data --compare-top 10
"""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
V2 = HERE.parent / "v2" / "make_pairs.py"
spec = importlib.util.spec_from_file_location("v2_make_pairs", V2)
m = importlib.util.module_from_spec(spec)
sys.modules["v2_make_pairs"] = m
spec.loader.exec_module(m)

m.CASES = {"gemma_double_embed_scale": ("gemma", "base", {"kind": "double_embed_scale"}, ("stats", "tensor"))}
_patch = m.patch_modules


def patch_modules(family, model, tracer, active):
    _patch(family, model, tracer, active)
    if active is not None and active["kind"] == "double_embed_scale":
        emb = model.get_input_embeddings()
        inner = emb.forward

        def embed(ids):
            out = inner(ids)
            out = out * emb.embed_scale.to(emb.weight.dtype)  # applied again: the scale doubled
            tracer.mark("embed_scale2")
            return out

        emb.forward = embed


_expect = m.expectation


def expectation(case, fault, tgt, ref):
    if fault is not None and fault["kind"] == "double_embed_scale":
        names = m._names(tgt, "embed_scale2", 0)
        assert len(names) == 1 and names[0], names
        return {
            "step": 0,
            "ops": names,
            "what": "the token embeddings multiplied by sqrt(hidden) twice in the target: the second multiply is "
            "the first record the reference does not have",
        }
    return _expect(case, fault, tgt, ref)


m.patch_modules = patch_modules
m.expectation = expectation
if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(m.main(args if "--out" in args else ["--out", str(HERE / ".data"), *args]))

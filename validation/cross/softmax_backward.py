"""One backward-only fault on a clean combination: layer 1's attention softmax with its backward x FACTOR.

    .venv/bin/python validation/cross/softmax_backward.py OUT [FACTOR [FAMILY:DEVICE:DTYPE:BATCH,...]]
    .venv/bin/python validation/score.py --data OUT

(defaults: 1.05, llama:E:bf16:2). In both runs that softmax call runs as an autograd function computing PyTorch's
forward and PyTorch's backward formula y (g - sum(g y)) (msprobe records it as the same ``softmax`` record); the
target's backward is multiplied by FACTOR. The pair is made as ``make_pairs.py`` makes the clean combinations (the
family's set's own run, the foreign device, draw 1), in both dump modes, with a key for ``validation/score.py``
(the culprit: the faulty call's backward record at step 0). docs/how-it-decides.md, "Known limits", has what the
verdict makes of it.
"""

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("validation_cross_make_pairs", ROOT / "validation/cross/make_pairs.py")
cross = sys.modules["validation_cross_make_pairs"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cross)
common = sys.modules["validation_common_devices"]

FACTOR = 1.05  # the target's backward of that call x this (the command line's second argument)
EVERY, WHICH = 2, 1  # softmax calls per forward (2 layers); the faulty one: layer 1


def install_fault(factor):
    import torch
    import torch.nn.functional as F

    stock = F.softmax
    count = {"n": 0}

    class Softmax(torch.autograd.Function):  # the same in both runs; the target's backward x factor
        @staticmethod
        def forward(ctx, x, dim, dtype):
            y = stock(x if dtype is None else x.to(dtype), dim=dim)
            ctx.save_for_backward(y)
            ctx.dim, ctx.in_dtype = dim, x.dtype
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors

            def grad():
                return ((y * (g - (g * y).sum(ctx.dim, keepdim=True))) * factor).to(ctx.in_dtype)

            return common.quiet(grad)(), None, None

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if not (torch.is_grad_enabled() and input.requires_grad):
            return stock(input, dim=dim, dtype=dtype)
        n = count["n"]
        count["n"] += 1
        if n % EVERY != WHICH:
            return stock(input, dim=dim, dtype=dtype)
        return Softmax.apply(input, dim, dtype)

    F.softmax = softmax


def run_one(job):
    cross._apply(job)
    dev = cross.SETS[cross.FAMILY_SET[job["family"]]][1].DEVICES["X"]
    orig = dev.install
    factor = FACTOR if job["role"] == "target" else 1.0
    dev.install = lambda: (orig(), install_fault(factor))
    return cross.RUN_ONE[cross.FAMILY_SET[job["family"]]](job)


def main():
    global FACTOR
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1]).resolve()
    FACTOR = float(sys.argv[2]) if len(sys.argv) > 2 else FACTOR
    specs = [s.split(":") for s in (sys.argv[3] if len(sys.argv) > 3 else "llama:E:bf16:2").split(",")]
    import torch  # noqa
    import transformers  # noqa
    from msprobe.pytorch import PrecisionDebugger  # noqa

    jobs = []
    for fam, dev, dt, b in specs:
        pairs = {"%s_%s" % (fam, dev): (fam, dev, dt, int(b), ("stats", "tensor"))}
        js = cross.plan(pairs, out)
        for j in js:
            if j["role"] == "target":
                j["fault"] = {"kind": "softmax_bwd", "value": FACTOR}
                j["name"] = j["name"].replace("_target_", "_sbwd_target_")
                j["dump_dir"] = str(out / j["mode"] / j["name"])
                j["log"] = str(out / "logs" / (j["name"] + ".log"))
                j["scratch"] = str(out / "scratch" / j["name"])
        jobs += js
    t0 = time.time()
    results = cross.harness.run_jobs(jobs, 2, run_one)
    key = {"cases": {}, "dropped": {}, "set": "bwd"}
    for j in jobs:
        if j["role"] != "target":
            continue
        ref = [r for r in jobs if r["role"] == "ref" and r["mode"] == j["mode"] and r["family"] == j["family"]][0]
        rec = json.loads(next(Path(j["dump_dir"]).glob("step0/rank0/dump.json")).read_text())["data"]
        sm = sorted(k for k in rec if ".softmax." in k and k.endswith(".backward"))
        name = "%s_sbwd_%s" % (j["family"] + "_" + j["device"], j["mode"])
        key["cases"][name] = {
            "case": name[: -len(j["mode"]) - 1],
            "mode": j["mode"],
            "family": j["family"],
            "device": j["device"],
            "ref": str(Path(ref["dump_dir"]).relative_to(out)),
            "target": str(Path(j["dump_dir"]).relative_to(out)),
            "expect": {
                "step": 0,
                "ops": [k for k in sm if k.split(".")[-2] == str(WHICH)],
                "modules": [],
                "backward_only": True,
                "what": "layer 1's softmax backward x%g" % FACTOR,
            },
            "flips": [],
            "losses": {"ref": results[ref["name"]]["losses"], "target": results[j["name"]]["losses"]},
        }
    (out / "key.json").write_text(json.dumps(key, indent=1))
    shutil.rmtree(out / "scratch", ignore_errors=True)
    print("%d runs in %.0fs; key: %s" % (len(jobs), time.time() - t0, out / "key.json"))


if __name__ == "__main__":
    main()

"""Clean combinations: each validation set's families run on the simulated devices of *another* set.

Sets 1-4 (``validation/make_pairs.py``, ``validation/v2/``, ``validation/v3/``, ``validation/v4/``) run every family
on its own set's device only. A new user brings a family and a device nobody tuned on together; this set makes such
pairs, clean only (no fault): the reference is plain CPU torch, the target the same training on a device of another
set, in the family's own dtype setup or another one it supports (a pure bf16 model trained in fp32, an fp32 model
under bf16 autocast, bf16 autocast as fp16 with loss scaling, fp16 autocast as bf16, an autocast model in fp32),
with another model seed, data seed and batch size (an image classifier: images) than its set uses. The first 20
pairs (sets 1-3 among themselves) were made before set 4 existed and are unchanged; the next 24 run set 4's families
on devices of sets 1-3 and families of sets 1-3 on set 4's devices. Every pair must be quiet: ``validation/score.py
--data <out>`` scores the verdict's false alarms.

    .venv/bin/python validation/cross/make_pairs.py --out validation/cross/.data [--jobs 2] [--only PAIR ...]
        [--draw K]   # another draw of the model and data seeds (+100 K, +7 K; default K = 1)

Nothing of the sets' harnesses is copied: each run is the set's own ``run_one`` (its model, its training loop,
its record-name tracer, its msprobe config) with three module globals changed in the forked child (the family's
device key pointing to the foreign device, the seeds and the batch, the autocast dtype or a wrapper of
``build_model`` that changes the model's dtype); the sets' forked-run loop (``validation/harness.py``) runs the
jobs and set 2's structure check checks every pair (same records, leaf types, dtypes, shapes and requires_grad in
both runs).

A device keeps its guard (a replacement that differs from the stock kernel by more than a few roundings of the
dtype raises): a device that trips it on a family it was not built for is a finding about the device model, not a
pair; such a combination is dropped and listed in the key (``dropped``) and in the output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
V = HERE.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


harness = sys.modules.get("validation_harness")
if harness is None:  # the sets' shared driver, whose loader loads the rest: once, by path
    _spec = importlib.util.spec_from_file_location("validation_harness", V / "harness.py")
    harness = sys.modules["validation_harness"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(harness)
_load = harness._load


# the four sets' harnesses and devices, each under its own name; every device module captures the stock torch
# functions when it is imported, so all of them are imported before msprobe is
SET4 = _load("validation_v4_make_pairs", V / "v4" / "make_pairs.py")  # loads set 2's harness and set 4's devices
DEV4 = SET4.devices4
SET3 = _load("validation_v3_make_pairs", V / "v3" / "make_pairs.py")  # loads set 2's harness too
DEV2 = _load("validation_v2_devices", V / "v2" / "devices.py")
SET2 = SET3.v2
SET1 = _load("validation_v1_make_pairs", V / "make_pairs.py")
DEV3 = SET3.devices3
DEV1 = _load("validation_v1_devices", V / "devices.py")
SET5 = _load("validation_v5_make_pairs", V / "v5" / "make_pairs.py")  # loads set 5's devices
DEV5 = SET5.devices5
SETS = {1: (SET1, DEV1), 2: (SET2, DEV2), 3: (SET3, DEV3), 4: (SET4, DEV4), 5: (SET5, DEV5)}
# M, R and set 5's X: a set's reference rerun on another GPU (the noisy-reference variant), not a device of its own
REFERENCE_RERUNS = {"M": 3, "R": 4, "X": 5}
DEVICE_SET = {k: s for s, (_, dev) in SETS.items() for k in dev.DEVICES if REFERENCE_RERUNS.get(k) != s}
RUN_ONE = {s: mod.run_one for s, (mod, _) in SETS.items()}
FLIPS = {1: SET1.topk_flips, 2: SET2.topk_flips, 3: SET3.argmax_flips, 4: SET4.argmax_flips, 5: SET5.argmax_flips}
# a device whose autocast policy differs from the reference's (set 5's T: matmul not on the lower-precision list):
# its records' dtypes may differ from the reference's, nothing else (set 5's structure check of its "amp" variant)
POLICY_DEVICES = {"T"}
# families whose batch is a number of images (the sets' IMAGES), not of sequences (BATCH)
IMAGE_FAMILIES = {"resnet", "vit"}

# family -> (set, its dtype setup as the set runs it)
FAMILY_SET = {
    **{f: 1 for f in SET1.FAMILIES},
    **{f: 2 for f in SET2.FAMILIES},
    **{f: 3 for f in SET3.FAMILIES},
    **{f: 4 for f in SET4.FAMILIES},
    **{f: 5 for f in SET5.FAMILIES if f != "granite_wide"},  # granite_wide: set 5's long-reduction variant
}
NATIVE = {
    "llama": "bf16",
    "moe": "fp32",
    "neox": "bf16-autocast",
    "gpt2": "fp16-autocast",
    "qwen2": "bf16",
    "gemma": "bf16-autocast",
    "opt": "fp16-autocast",
    "qmoe": "fp32",
    "falcon": "fp32",
    "bloom": "bf16",
    "bert": "bf16-autocast",
    "phi": "fp16-autocast",
    "t5": "bf16-autocast",
    "resnet": "fp32",
    "mamba": "bf16",
    "gptj": "fp16-autocast",
    "vit": "bf16-autocast",
    "wav2vec2": "fp32",
    "bart": "fp16-autocast",
    "granite": "bf16",
}
SEED_SHIFT, DATA_SEED_SHIFT = 100, 7  # per draw: another model init and data stream than the family's set uses

# pair -> (family, device, dtype setup, batch, modes). Devices are other sets' (A-D: set 1, E-H: set 2, I-L: set 3,
# N-Q: set 4, S-W: set 5).
PAIRS = {
    # set 1's families
    "llama_E": ("llama", "E", "bf16", 2, ("stats", "tensor")),
    "llama_fp32_H": ("llama", "H", "fp32", 2, ("stats",)),
    "moe_I": ("moe", "I", "fp32", 3, ("stats",)),
    "neox_J": ("neox", "J", "bf16-autocast", 3, ("stats",)),
    "gpt2_L": ("gpt2", "L", "fp16-autocast", 2, ("stats", "tensor")),
    "gpt2_G": ("gpt2", "G", "fp16-autocast", 2, ("stats",)),
    # set 2's families
    "gemma_I": ("gemma", "I", "bf16-autocast", 2, ("stats", "tensor")),
    "gemma_fp16_D": ("gemma", "D", "fp16-autocast", 2, ("stats",)),
    "qwen2_A": ("qwen2", "A", "bf16", 3, ("stats",)),
    "qwen2_K": ("qwen2", "K", "bf16", 3, ("stats",)),
    "opt_D": ("opt", "D", "fp16-autocast", 2, ("stats", "tensor")),
    "qmoe_B": ("qmoe", "B", "fp32", 2, ("stats",)),
    "qmoe_bf16_C": ("qmoe", "C", "bf16-autocast", 2, ("stats",)),
    # set 3's families
    "bert_A": ("bert", "A", "bf16-autocast", 2, ("stats", "tensor")),
    "bert_C": ("bert", "C", "bf16-autocast", 2, ("stats",)),
    "falcon_B": ("falcon", "B", "fp32", 2, ("stats",)),
    "falcon_bf16_F": ("falcon", "F", "bf16-autocast", 3, ("stats", "tensor")),
    "bloom_E": ("bloom", "E", "bf16", 2, ("stats", "tensor")),
    "bloom_fp32_H": ("bloom", "H", "fp32", 2, ("stats",)),
    "phi_D": ("phi", "D", "fp16-autocast", 2, ("stats",)),
    # set 4's families on devices of sets 1-3 (each device picked for the ops it replaces that the family runs:
    # linear/matmul everywhere, T5's and GPT-J's softmax and tanh, Mamba's rsqrt; ResNet's classifier only: a
    # device whose rounding differs from the stock kernel's at K = 16 (D truncates; F's exact sum rounded once and
    # its one vocabulary block left ResNet under bf16 autocast bitwise equal)
    "t5_A": ("t5", "A", "bf16-autocast", 2, ("stats",)),
    "t5_C": ("t5", "C", "bf16-autocast", 2, ("stats",)),
    "t5_fp32_I": ("t5", "I", "fp32", 2, ("stats",)),
    "resnet_B": ("resnet", "B", "fp32", 6, ("stats",)),
    "resnet_fp16_D": ("resnet", "D", "fp16-autocast", 8, ("stats", "tensor")),
    "resnet_H": ("resnet", "H", "fp32", 8, ("stats",)),
    "mamba_A": ("mamba", "A", "bf16", 2, ("stats", "tensor")),
    "mamba_E": ("mamba", "E", "bf16", 3, ("stats",)),
    "mamba_fp32_B": ("mamba", "B", "fp32", 2, ("stats",)),
    "gptj_D": ("gptj", "D", "fp16-autocast", 2, ("stats", "tensor")),
    "gptj_L": ("gptj", "L", "fp16-autocast", 3, ("stats",)),
    "gptj_bf16_J": ("gptj", "J", "bf16-autocast", 2, ("stats",)),
    "gptj_fp32_I": ("gptj", "I", "fp32", 2, ("stats",)),
    # families of sets 1-3 on set 4's devices (O: SiLU, pow and means of RMSNorms; P and Q: pow, means and
    # LayerNorm statistics; N's convolutions and BatchNorm touch none of them). Their fp32 results are rounded
    # once to the tensor's dtype: in a pure bf16 model most differences round away (bloom on P in bf16: 6 of 591
    # records differ), so bloom runs in fp32 there
    "llama_O": ("llama", "O", "bf16", 2, ("stats", "tensor")),
    "qwen2_O": ("qwen2", "O", "bf16", 3, ("stats",)),
    "moe_O": ("moe", "O", "fp32", 2, ("stats",)),
    "gemma_P": ("gemma", "P", "bf16-autocast", 2, ("stats", "tensor")),
    "neox_P": ("neox", "P", "bf16-autocast", 2, ("stats",)),
    "bert_P": ("bert", "P", "bf16-autocast", 3, ("stats",)),
    "falcon_P": ("falcon", "P", "fp32", 2, ("stats",)),
    "bloom_fp32_P": ("bloom", "P", "fp32", 2, ("stats",)),
    "gpt2_Q": ("gpt2", "Q", "fp16-autocast", 2, ("stats", "tensor")),
    "phi_Q": ("phi", "Q", "fp16-autocast", 2, ("stats",)),
    "opt_Q": ("opt", "Q", "fp16-autocast", 3, ("stats",)),
    # set 5's families on devices of sets 1-4, each device picked for the kernels it replaces that the family
    # calls (ViT: its patch convolution, LayerNorm, linear, matmul, softmax, exact GELU; wav2vec2: conv1d, linear,
    # matmul, softmax, LayerNorm, GELU; BART: linear, matmul, softmax, LayerNorm, the embeddings; Granite: linear,
    # matmul, softmax, SiLU, the RMSNorm's pow, mean and rsqrt, the embedding). The fp16 devices of sets 1-3 (D, G,
    # L) trip their guards on BART's scaled gradients (the matmul's second-operand gradient 3.7 % and 6.9 % off the
    # stock kernel on D and L, a linear's input gradient 0.5 % on G): BART runs on Q and on bf16 and fp32 devices
    # (tensor mode for one pair each way, Granite on A and BERT on S: a tensor pair of these families is 20 to 46 MB
    # of dumps, a statistics pair 3 to 12 MB)
    "vit_C": ("vit", "C", "bf16-autocast", 8, ("stats",)),
    "vit_J": ("vit", "J", "bf16-autocast", 6, ("stats",)),
    "vit_fp16_L": ("vit", "L", "fp16-autocast", 8, ("stats",)),
    "vit_fp32_N": ("vit", "N", "fp32", 6, ("stats",)),
    "wav2vec2_B": ("wav2vec2", "B", "fp32", 2, ("stats",)),
    "wav2vec2_I": ("wav2vec2", "I", "fp32", 3, ("stats",)),
    "wav2vec2_N": ("wav2vec2", "N", "fp32", 2, ("stats",)),
    "wav2vec2_bf16_C": ("wav2vec2", "C", "bf16-autocast", 2, ("stats",)),
    "bart_bf16_C": ("bart", "C", "bf16-autocast", 3, ("stats",)),
    "bart_Q": ("bart", "Q", "fp16-autocast", 2, ("stats",)),
    "bart_bf16_F": ("bart", "F", "bf16-autocast", 2, ("stats",)),
    "bart_bf16_J": ("bart", "J", "bf16-autocast", 2, ("stats",)),
    "bart_fp32_I": ("bart", "I", "fp32", 2, ("stats",)),
    "granite_A": ("granite", "A", "bf16", 2, ("stats", "tensor")),
    "granite_E": ("granite", "E", "bf16", 3, ("stats",)),
    "granite_fp32_K": ("granite", "K", "fp32", 2, ("stats",)),
    "granite_O": ("granite", "O", "bf16", 2, ("stats",)),
    "granite_fp32_B": ("granite", "B", "fp32", 2, ("stats",)),
    # families of sets 1-4 on set 5's devices (S: softmax through the log-sum-exp, GELU through erfc, the fused
    # cross-entropy, shifted one-pass LayerNorm statistics; T: S with matmul off the autocast list; U: conv1d by FFT,
    # GELU through erfc; V: shifted LayerNorm, the fused cross-entropy, GELU through erfc; W: the log-sum-exp
    # softmax -- its fused optimizer is set 5's families' own and X is a reference rerun). The fp32 results of S's
    # softmax and W's are rounded once to the tensor's dtype: in a pure bf16 model (llama, qwen2, bloom on W: 7 to 9
    # of about 700 records differ) or T5's fp32 softmax under autocast (6 of 3,876) they round away, so those run in
    # fp32. The families of sets 1-4 keep transformers' GELU module, which holds the F.gelu it was built with (the
    # devices' GELU never runs there: Falcon on U, 0 of 816 records differ); U's FFT convolution is Mamba's
    # depthwise conv1d
    "bert_S": ("bert", "S", "bf16-autocast", 2, ("stats", "tensor")),
    "neox_S": ("neox", "S", "bf16-autocast", 2, ("stats",)),
    "t5_fp32_S": ("t5", "S", "fp32", 3, ("stats",)),
    "gemma_T": ("gemma", "T", "bf16-autocast", 2, ("stats",)),
    "mamba_U": ("mamba", "U", "bf16", 3, ("stats",)),
    "mamba_fp32_U": ("mamba", "U", "fp32", 2, ("stats",)),
    "opt_V": ("opt", "V", "fp16-autocast", 2, ("stats",)),
    "gpt2_V": ("gpt2", "V", "fp16-autocast", 3, ("stats",)),
    "bert_fp16_V": ("bert", "V", "fp16-autocast", 2, ("stats",)),
    "llama_fp32_W": ("llama", "W", "fp32", 2, ("stats",)),
    "moe_W": ("moe", "W", "fp32", 2, ("stats",)),
    "bloom_fp32_W": ("bloom", "W", "fp32", 3, ("stats",)),
}


def _setup_name(family: str, dtype: str, batch: int) -> str:
    return "%s_%s_b%d" % (family, dtype.replace("-autocast", "ac"), batch)


def _apply(job: dict) -> None:
    """In the forked child: make the family's set run this job's device, seeds, batch and dtype setup."""
    import torch

    family, s = job["family"], FAMILY_SET[job["family"]]
    mod, dev = SETS[s]
    if s in (1, 2):  # their run_one does ``from devices import DEVICES``: their own devices module
        sys.modules["devices"] = dev
    # (set 5's X, its reference rerun, is only run by its "noisyref" variant: the key is free in a "base" run)
    dev.DEVICES["X"] = SETS[DEVICE_SET[job["device"]]][1].DEVICES[job["device"]]
    mod.FAMILIES[family]["device"] = "X"
    mod.FAMILIES[family]["seed"] += SEED_SHIFT * job["draw"]
    mod.DATA_SEED += DATA_SEED_SHIFT * job["draw"]
    if family in IMAGE_FAMILIES:  # an image classifier's batch
        mod.IMAGES = job["batch"]
    else:
        mod.BATCH = job["batch"]
    native, dtype = NATIVE[family], job["dtype"]
    if dtype == native:
        return
    if native == "bf16" and dtype == "fp32":  # a pure bf16 model trained in fp32
        build = mod.build_model
        mod.build_model = lambda fam, build=build: build(fam).to(torch.float32)
    elif dtype.endswith("-autocast") and s >= 2:  # the set's autocast table: fp32 -> bf16, bf16 <-> fp16
        mod.AUTOCAST[family] = {"bf16-autocast": "bfloat16", "fp16-autocast": "float16"}[dtype]
    elif dtype == "fp32" and native.endswith("-autocast") and s >= 2:  # fp32 weights without autocast
        mod.AUTOCAST.pop(family)
    else:
        raise ValueError("%s: dtype setup %s is not supported" % (family, dtype))


def run_one(job: dict) -> dict:
    """One run: the family's set's own run_one, on the job's device and setup (a forked child)."""
    _apply(job)
    try:
        return RUN_ONE[FAMILY_SET[job["family"]]](job)
    except AssertionError as exc:
        if str(exc).startswith("device "):  # the device's guard: the combination is out of the device's model
            return {"job": job["name"], "guard": str(exc)}
        raise


def plan(pairs: dict, out: Path, draw: int = 1) -> list[dict]:
    """One reference per (family, dtype, batch, mode), one target per pair and mode; `draw`: which seeds."""
    jobs, refs = [], set()
    for pair, (family, device, dtype, batch, modes) in pairs.items():
        base = {"family": family, "device": device, "dtype": dtype, "batch": batch, "variant": "base", "fault": None}
        base["draw"] = draw
        for mode in modes:
            ref = "%s_ref_%s" % (_setup_name(family, dtype, batch), mode)
            if ref not in refs:
                refs.add(ref)
                jobs.append({**base, "name": ref, "role": "ref", "mode": mode})
            jobs.append({**base, "name": "%s_target_%s" % (pair, mode), "role": "target", "mode": mode})
    for job in jobs:
        job["dump_dir"] = str(out / job["mode"] / job["name"])
        job["scratch"] = str(out / "scratch" / job["name"])
        job["log"] = str(out / "logs" / (job["name"] + ".log"))
        shutil.rmtree(job["dump_dir"], ignore_errors=True)
        shutil.rmtree(job["scratch"], ignore_errors=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return jobs


def select(only=None, sets=None) -> dict:
    """The pairs named in ``only`` (all if none) whose family's or device's set is in ``sets`` (any if none)."""
    return {
        k: v
        for k, v in PAIRS.items()
        if (not only or k in only) and (not sets or {FAMILY_SET[v[0]], DEVICE_SET[v[1]]} & set(sets))
    }


def main(argv=None) -> int:
    """Make the pairs and their key (one generation at a time in an output folder)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / ".data"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="pairs to make (default: all)")
    ap.add_argument("--modes", nargs="*", default=["stats", "tensor"], help="dump modes to make (default: both)")
    ap.add_argument("--draw", type=int, default=1, help="another draw of the seeds (default 1: the documented set)")
    ap.add_argument("--set", type=int, nargs="*", help="only the pairs whose family or device is of these sets")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    with harness.output_lock(out):  # one generation at a time writes the folder
        return generate(args, out)


def generate(args, out: Path) -> int:
    """Make the pairs of ``args`` (--only, --set, --modes, --draw, --jobs) and their key in ``out``."""
    pairs = {
        k: (fam, dev, dt, b, tuple(m for m in modes if m in args.modes))
        for k, (fam, dev, dt, b, modes) in select(args.only, args.set).items()
    }
    unknown = set(args.only or ()) - set(PAIRS)
    if unknown:
        raise SystemExit("unknown pairs: %s (known: %s)" % (sorted(unknown), ", ".join(PAIRS)))
    t0 = time.time()
    import torch  # noqa: F401  (imported once, before forking)
    import transformers  # noqa: F401
    from msprobe.pytorch import PrecisionDebugger  # noqa: F401

    print("imports %.1fs" % (time.time() - t0), flush=True)
    jobs = plan(pairs, out, args.draw)
    results = harness.run_jobs(jobs, args.jobs, run_one)  # the sets' forked-run loop runs these runs
    key_path = out / "key.json"
    key = (
        json.loads(key_path.read_text())
        if key_path.exists() and (args.only or args.set)
        else {"cases": {}, "dropped": {}}
    )
    for pair, (family, device, dtype, batch, modes) in pairs.items():
        for mode in modes:
            name = "%s_%s" % (pair, mode)
            key["cases"].pop(name, None)
            key["dropped"].pop(name, None)
            tgt_name = "%s_target_%s" % (pair, mode)
            ref_name = "%s_ref_%s" % (_setup_name(family, dtype, batch), mode)
            tgt, ref = results[tgt_name], results[ref_name]
            if "guard" in ref:
                raise SystemExit("%s: the reference tripped a device guard: %s" % (ref_name, ref["guard"]))
            if "guard" in tgt:  # a finding about the device model: the combination is dropped, and said
                key["dropped"][name] = tgt["guard"]
                shutil.rmtree(out / mode / tgt_name, ignore_errors=True)
                print("  dropped %s: %s" % (name, tgt["guard"]), flush=True)
                continue
            if device in POLICY_DEVICES:  # the dtypes of the ops the policy moves may differ, nothing else
                odd = SET5.structure_differences(out / mode / ref_name, out / mode / tgt_name, "amp")
            else:
                odd = SET2.structure_differences(out / mode / ref_name, out / mode / tgt_name)
            if odd:
                raise SystemExit("%s: the device changed the dump's structure: %s" % (name, odd[:5]))
            s = FAMILY_SET[family]
            key["cases"][name] = {
                "case": pair,
                "mode": mode,
                "family": family,
                "set": s,
                "device": device,
                "device_set": DEVICE_SET[device],
                "dtype": dtype,
                "batch": batch,
                "draw": args.draw,
                "ref": str(Path(mode) / ref_name),
                "target": str(Path(mode) / tgt_name),
                "expect": {"clean": True},
                # a routing or argmax choice the device's rounding flipped on a near-tie (kept: noise, not a fault)
                "flips": FLIPS[s](tgt, ref),
                "losses": {"ref": ref["losses"], "target": tgt["losses"]},
                "grad_norm": {"ref": ref["info"]["grad_norm"], "target": tgt["info"]["grad_norm"]},
                "loss_scale": {"ref": ref["info"].get("loss_scale"), "target": tgt["info"].get("loss_scale")},
            }
    key["families"] = {f: SETS[s][0].FAMILIES[f]["text"] for f, s in FAMILY_SET.items()}
    key["devices"] = {k: SETS[s][1].DEVICES[k].text for k, s in DEVICE_SET.items()}
    key["steps"] = SET2.STEPS
    key["set"] = "cross"
    key_path.write_text(json.dumps(key, indent=1, sort_keys=True))
    shutil.rmtree(out / "scratch", ignore_errors=True)
    flips = {k: len(c["flips"]) for k, c in key["cases"].items() if c["flips"]}
    print(
        "%d runs, %d pairs, %d dropped, flips %s in %.1fs; key: %s"
        % (len(jobs), len(key["cases"]), len(key["dropped"]), flips or "none", time.time() - t0, key_path)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Held-out long runs for `dumpstore curves` (issue 26): small models of three families trained on CPU, each
writing real msprobe TrainerMon output and a training log, with faults planted by construction.

    python validation/longrun/make_runs.py --out validation/longrun/.data [--jobs 2]

Writes `<out>/<run>/{train.log, monitor/, tb/ (one pair)}` and `<out>/key.json` (per case: clean, or the fault's
step, kind and module). Step conventions (all written into key.json): the training loop's step `s` counts from 0;
TrainerMon numbers it `s`; the log prints it as iteration/step `s + 1` (Megatron, MindFormers and HF Trainer all
print the step count after the update). A fault "from step N" changes the computation of step N: a forward fault
(one layer in bf16, corrupted data, a bad batch, noise) shows in the loss logged at N + 1; a fault in the gradient
or the update (gradient scaled, learning rate) first shows in the loss logged at N + 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# ---------------------------------------------------------------- the set (by construction)

# family: model, log format, steps, fault step, monitor layout (steps per CSV file; 1 is TrainerMon's default)
FAMILIES = {
    "llama": {"log": "megatron", "steps": 300, "fault": 150, "per_file": 1},
    "cnn": {"log": "hf", "steps": 400, "fault": 200, "per_file": 50},
    "neox": {"log": "mindformers", "steps": 300, "fault": 140, "per_file": 20},
}

# run name -> (family, variant, options). Variants: ref (the reference), seed (another data order), nondet
# (1e-7 relative noise on one op's output every step), lr (learning rate x1.5 from N), bf16 (one Linear computed
# in bfloat16 from N), gradscale (one parameter's gradient x1.02 from N, between backward and the optimizer),
# corrupt (30 % of the tokens/labels of every batch replaced from N), spike (one bad batch at N: its labels
# shuffled), overflow (one
# layer's backward overflows from N: dynamic loss scaling halves the scale and skips every step).
RUNS = {
    "llama_ref": ("llama", "ref", {}),
    "llama_nondet": ("llama", "nondet", {"module": "model.layers.0.mlp.up_proj"}),
    "llama_gradscale": ("llama", "gradscale", {"module": "model.layers.1.mlp.down_proj"}),
    "llama_bf16": ("llama", "bf16", {"module": "model.layers.0.self_attn.o_proj"}),
    "llama_lr": ("llama", "lr", {}),
    "llama_overflow": ("llama", "overflow", {"module": "model.layers.1.self_attn.v_proj"}),
    "cnn_ref": ("cnn", "ref", {}),
    "cnn_seed": ("cnn", "seed", {}),
    "cnn_spike": ("cnn", "spike", {}),
    "cnn_corrupt": ("cnn", "corrupt", {}),
    "cnn_lr": ("cnn", "lr", {}),
    "cnn_bf16": ("cnn", "bf16", {"module": "conv2"}),
    "neox_ref": ("neox", "ref", {}),
    "neox_seed": ("neox", "seed", {}),
    "neox_gradscale": ("neox", "gradscale", {"module": "gpt_neox.layers.1.attention.dense"}),
    "neox_corrupt": ("neox", "corrupt", {}),
    "neox_bf16": ("neox", "bf16", {"module": "gpt_neox.layers.0.mlp.dense_4h_to_h"}),
}
TB_RUNS = ("cnn_ref", "cnn_lr")  # TensorBoard events too (torch.utils.tensorboard, Megatron-style tags)
LOSS_DELAY = {"nondet": 1, "bf16": 1, "corrupt": 1, "spike": 1, "gradscale": 2, "lr": 2, "overflow": 2}
KINDS = {
    "seed": "clean",
    "nondet": "clean",
    "lr": "lr_schedule",
    "bf16": "precision_drift",
    "gradscale": "grad_divergence",
    "corrupt": "data",
    "spike": "spike",
    "overflow": "loss_scale_collapse",
}


def window(steps: int) -> int:
    """The stated window: an onset counts when found in [expected, expected + max(20, 5 % of the run's steps)]."""
    return max(20, math.ceil(0.05 * steps))


def key() -> dict:
    cases = []
    for run, (fam, var, opt) in RUNS.items():
        if var == "ref":
            continue
        f = FAMILIES[fam]
        case = {"case": run, "target": run, "ref": f"{fam}_ref", "family": fam, "log": f["log"], "steps": f["steps"]}
        case["kind"] = KINDS[var]
        if case["kind"] == "clean":
            case.update(expect="clean", how=var)
        else:
            n = f["fault"]
            case.update(
                expect="fault",
                fault_step=n,  # the training loop's step (0-based) whose computation the fault changes first
                loss_onset=n + LOSS_DELAY[var],  # the first logged iteration whose loss can differ
                monitor_onset=n,  # the first TrainerMon step whose statistics can differ
                module=opt.get("module"),
                window=window(f["steps"]),
            )
            if var == "lr":
                case["lr_onset"] = n + 1  # the first logged iteration whose learning rate differs
        cases.append(case)
    for run in TB_RUNS[1:]:
        fam = RUNS[run][0]
        base = next(c for c in cases if c["case"] == run)
        cases.append({**base, "case": f"{run}_tb", "target": f"{run}_tb", "ref": f"{fam}_ref_tb", "log": "tensorboard"})
    return {
        "version": 1,
        "window_rule": "onset found in [expected, expected + max(20, ceil(5 % of steps))], never before; "
        "module found = culprit's module or parameter is the faulty layer or inside it",
        "families": FAMILIES,
        "cases": cases,
    }


# ---------------------------------------------------------------- one run (in its own process)


def _monitor_config(path: Path, targets: list[str], per_file: int) -> None:
    cfg = {
        "targets": {t: {} for t in targets},
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": ["norm", "min", "max", "zeros", "nans", "mean"],
        "format": "csv",
        "step_count_per_record": per_file,
    }
    path.write_text(json.dumps(cfg))


def train(run: str, out: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    fam, var, opt = RUNS[run]
    f = FAMILIES[fam]
    steps, n_fault = f["steps"], f["fault"]
    if os.environ.get("H26VAL_SMOKE"):  # a quick check of the script itself: 12 steps, the fault at 6
        steps, n_fault = 12, 6
    rdir = out / run
    if rdir.exists():
        shutil.rmtree(rdir)
    (rdir / "monitor").mkdir(parents=True)
    os.environ["MONITOR_OUTPUT_DIR"] = str(rdir / "monitor")

    torch.manual_seed(0)
    # ---- model and data
    if fam == "cnn":
        model = torch.nn.Sequential()
        model.add_module("conv1", torch.nn.Conv2d(1, 8, 3, padding=1))
        model.add_module("act1", torch.nn.ReLU())
        model.add_module("conv2", torch.nn.Conv2d(8, 16, 3, padding=1, stride=2))
        model.add_module("act2", torch.nn.ReLU())
        model.add_module("flat", torch.nn.Flatten())
        model.add_module("fc1", torch.nn.Linear(16 * 6 * 6, 64))
        model.add_module("act3", torch.nn.ReLU())
        model.add_module("fc2", torch.nn.Linear(64, 10))
        g = torch.Generator().manual_seed(1234)
        protos = torch.randn(10, 1, 12, 12, generator=g)
        labels = torch.randint(0, 10, (8192,), generator=g)
        images = protos[labels] + 1.5 * torch.randn(8192, 1, 12, 12, generator=g)
        data = (images, labels)
        batch = 32
        base_lr = 2e-3
    else:
        vocab, seq = 64, 24
        g = torch.Generator().manual_seed(1234)
        # a sparse Markov chain: each token has 3 likely successors (learnable, not trivial)
        succ = torch.randint(0, vocab, (vocab, 3), generator=g)
        toks = torch.empty(4096, seq + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(0, vocab, (4096,), generator=g)
        for t in range(1, seq + 1):
            pick = torch.randint(0, 3, (4096,), generator=g)
            nxt = succ[toks[:, t - 1], pick]
            rnd = torch.randint(0, vocab, (4096,), generator=g)
            toks[:, t] = torch.where(torch.rand(4096, generator=g) < 0.1, rnd, nxt)
        data = (toks,)
        batch = 16
        base_lr = 3e-3
        import transformers

        transformers.logging.set_verbosity_error()
        if fam == "llama":
            cfg = transformers.LlamaConfig(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
            model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.GPTNeoXConfig(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                rotary_pct=0.5,
                use_parallel_residual=True,
            )
            model = transformers.GPTNeoXForCausalLM(cfg)
        model.config.use_cache = False
    model.train()
    n_data = data[0].shape[0]

    leaf = [
        name
        for name, m in model.named_modules()
        if name and not list(m.children()) and any(True for _ in m.parameters(recurse=False))
    ]
    cfg_path = rdir / "monitor_config.json"
    _monitor_config(cfg_path, leaf, f["per_file"])

    optim = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=0.01)
    warm = 20

    def lr_at(s: int) -> float:
        w = min(1.0, (s + 1) / warm)
        c = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
        lr = base_lr * w * c
        if var == "lr" and s >= n_fault:
            lr *= 1.5 if fam == "llama" else 0.5
        return lr

    import msprobe.pytorch.monitor.module_hook as mh
    from msprobe.pytorch.monitor.module_hook import TrainerMon

    # TrainerMon's forward hook calls inspect.stack() (is_recomputation) on every monitored module's forward:
    # 5 ms each, most of this script's time. No run here recomputes activations, so the answer is always False;
    # the CSV files are the same.
    mh.is_recomputation = lambda call_stack=None: False

    mon = TrainerMon(str(cfg_path), params_have_main_grad=False)
    mon.set_monitor(model, optim)

    state = {"step": 0}
    modules = dict(model.named_modules())
    if var == "bf16":
        lin = modules[opt["module"]]
        orig = lin.forward

        def bf16_forward(x, _orig=orig, _lin=lin):
            if state["step"] < n_fault:
                return _orig(x)
            w = _lin.weight.to(torch.bfloat16)
            b = None if _lin.bias is None else _lin.bias.to(torch.bfloat16)
            if isinstance(_lin, torch.nn.Conv2d):
                y = F.conv2d(x.to(torch.bfloat16), w, b, _lin.stride, _lin.padding)
            else:
                y = F.linear(x.to(torch.bfloat16), w, b)
            return y.to(x.dtype)

        lin.forward = bf16_forward
    if var == "nondet":
        noise_gen = torch.Generator().manual_seed(99)

        def noisy(_m, _inp, out):
            return out * (1 + 1e-7 * torch.randn(out.shape, generator=noise_gen))

        modules[opt["module"]].register_forward_hook(noisy)
    if var == "overflow":

        def overflow(_m, _inp, out):
            if state["step"] >= n_fault and out.requires_grad:
                out.register_hook(lambda gr: gr * 1e39)  # an fp16 overflow in this layer's backward
            return out

        modules[opt["module"]].register_forward_hook(overflow)

    data_seed = 1 if var == "seed" else 0
    order_gen = torch.Generator().manual_seed(data_seed)
    order = torch.randperm(n_data, generator=order_gen)
    pos = 0
    corrupt_gen = torch.Generator().manual_seed(7)
    loss_scale, min_scale = 65536.0, 1.0
    skipped_total = 0
    lines: list[str] = []
    tb = None
    if run in TB_RUNS:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(rdir / "tb"))
    t0 = time.time()
    epoch_steps = n_data // batch
    for s in range(steps):
        state["step"] = s
        if pos + batch > n_data:
            order = torch.randperm(n_data, generator=order_gen)
            pos = 0
        idx = order[pos : pos + batch]
        pos += batch
        for gp in optim.param_groups:
            gp["lr"] = lr_at(s)
        if fam == "cnn":
            x, y = data[0][idx].clone(), data[1][idx].clone()
            if var == "corrupt" and s >= n_fault:
                m = torch.rand(batch, generator=corrupt_gen) < 0.3
                y[m] = torch.randint(0, 10, (int(m.sum()),), generator=corrupt_gen)
            if var == "spike" and s == n_fault:
                # one bad batch: its labels shuffled (images x40, tried first, made the trained model only more
                # confident: a loss of 0, no spike)
                y = y[torch.randperm(batch, generator=corrupt_gen)]
            loss = F.cross_entropy(model(x), y)
        else:
            t = data[0][idx].clone()
            if var == "corrupt" and s >= n_fault:
                m = torch.rand(t.shape, generator=corrupt_gen) < 0.3
                t[m] = torch.randint(0, 64, (int(m.sum()),), generator=corrupt_gen)
            loss = model(input_ids=t, labels=t).loss
        optim.zero_grad(set_to_none=True)
        (loss * loss_scale).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(gr).all()) for gr in grads)
        skipped = 0
        if finite:
            for gr in grads:
                gr.div_(loss_scale)
            if var == "gradscale" and s >= n_fault:
                p = modules[opt["module"]].weight
                p.grad.mul_(1.02)
            gnorm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(gr) for gr in grads])))
        else:
            skipped = 1
            skipped_total += 1
            gnorm = float("nan")
            for p in model.parameters():
                p.grad = None  # Megatron skips the update of an overflowed step
        optim.step()
        if not finite:
            loss_scale = max(min_scale, loss_scale / 2)
        it = s + 1
        lv = float(loss)
        lr = lr_at(s)
        if f["log"] == "megatron":
            el = (time.time() - t0) * 1000.0
            t0 = time.time()
            ts = time.strftime("%Y-%m-%d %H:%M:%S")
            parts = [
                f" [{ts}] iteration {it:8d}/{steps:8d} |",
                f" consumed samples: {it * batch:12d} |",
                f" elapsed time per iteration (ms): {el:.1f} |",
                f" learning rate: {lr:.6E} |",
                f" global batch size: {batch:5d} |",
            ]
            if not skipped:
                parts.append(f" lm loss: {lv:.6E} |")
            parts.append(f" loss scale: {loss_scale:.1f} |")
            if not skipped:
                parts.append(f" grad norm: {gnorm:.3f} |")
            parts.append(f" number of skipped iterations: {skipped:3d} |")
            parts.append(f" number of nan iterations: {0:3d} |")
            lines.append("".join(parts))
        elif f["log"] == "mindformers":
            el = (time.time() - t0) * 1000.0
            t0 = time.time()
            ep, st = s // epoch_steps + 1, s % epoch_steps + 1
            n_ep = math.ceil(steps / epoch_steps)
            ts = time.strftime("%Y-%m-%d %H:%M:%S") + ",%03d" % int((time.time() % 1) * 1000)
            lines.append(
                f"{ts} - mindformers[mindformers/core/callback/callback.py:337] - INFO - "
                "{ Epoch:[%3d/%3d], step:[%5d/%5d], loss: %5.3f, per_step_time: %dms, lr: %s, overflow cond: %s, "
                "loss_scale: %s, global_norm: %s, train_throughput_per_npu: %.1fT"
                % (
                    ep,
                    n_ep,
                    st,
                    epoch_steps,
                    lv,
                    int(el),
                    repr(float(f"{lr:.6g}")),
                    not finite,
                    loss_scale,
                    "[%.6g]" % gnorm,
                    0.1,
                )
            )
        else:  # HF Trainer (transformers 4.x ProgressCallback: str(logs), loss rounded to 4, epoch to 2)
            logs = {"loss": round(lv, 4), "grad_norm": gnorm, "learning_rate": lr, "epoch": round(it / epoch_steps, 2)}
            lines.append(str(logs))
        if tb is not None:
            tb.add_scalar("lm loss", lv, it)
            tb.add_scalar("lm loss vs samples", lv, it * batch)
            tb.add_scalar("learning-rate", lr, it)
            tb.add_scalar("grad-norm", gnorm, it)
    if tb is not None:
        tb.close()
    if f["log"] == "hf":
        lines.insert(0, "***** Running training *****")
        lines.insert(1, f"  Num examples = {n_data:,}")
        lines.append(
            "{'train_runtime': 12.5, 'train_samples_per_second': 1280.0, 'train_steps_per_second': 40.0, "
            f"'train_loss': {lv}, 'epoch': {round(steps / epoch_steps, 2)}}}"
        )
    (rdir / "train.log").write_text("\n".join(lines) + "\n")
    del mon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / ".data")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="runs to (re)make (default: all)")
    ap.add_argument("--_run", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._run:
        train(a._run, a.out)
        return
    spec = importlib.util.spec_from_file_location("validation_harness", Path(__file__).parents[1] / "harness.py")
    harness = sys.modules.get("validation_harness") or importlib.util.module_from_spec(spec)
    if "validation_harness" not in sys.modules:  # the sets' shared driver (its output lock), loaded once, by path
        sys.modules["validation_harness"] = harness
        spec.loader.exec_module(harness)
    with harness.output_lock(a.out.resolve()):  # one generation at a time writes the folder
        make(a)


def make(a) -> None:
    """Make the runs of ``a.only`` (default: all) into ``a.out`` and the key, ``a.jobs`` at a time."""
    runs = a.only or list(RUNS)
    t0 = time.time()

    def one(run: str) -> tuple[str, float, int]:
        t = time.time()
        p = subprocess.run(
            [sys.executable, __file__, "--out", str(a.out), "--_run", run], capture_output=True, text=True
        )
        if p.returncode:
            raise SystemExit(f"{run} failed:\n{p.stderr[-3000:]}")
        return run, time.time() - t, p.returncode

    with ThreadPoolExecutor(a.jobs) as ex:
        for run, dt, _ in ex.map(one, runs):
            print(f"{run}: {dt:.1f} s", flush=True)
    (a.out / "key.json").write_text(json.dumps(key(), indent=1) + "\n")
    size = sum(p.stat().st_size for p in a.out.rglob("*") if p.is_file())
    print(f"{len(runs)} runs in {time.time() - t0:.0f} s, {size / 1e6:.1f} MB in {a.out}")


if __name__ == "__main__":
    main()

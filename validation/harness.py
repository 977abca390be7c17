"""The shared driver of the held-out validation sets 3 to 6 (argument parsing, the runs, the checks, the key, the
training loop, one run) and the pieces every set's generator shares: the output folder's lock (one generation at a
time), the forked runs (msprobe's config, the jobs, the loop that forks them, the structure check), the near-tie
search of a "flip" variant, a forked run's start.

A set's generator (``validation/v3/make_pairs.py`` ... ``validation/v6/make_pairs.py``) is a module with its
families, cases, one run (``run_one``, usually ``run_one(set_module, job)`` here), the expected culprit of a fault
(``expectation``) and the discrete choices it logs (``argmax_flips``); ``main(set_module, argv)`` runs it: the forked
runs (``plan_jobs``, ``run_jobs``, ``structure_differences`` here; sets 1 and 2 and the cross set use them too), the
checks that every clean pair differs in values only and every fault changes its run at the key's step and nothing
before, and ``key.json`` in set 1's format (so ``validation/score.py`` scores every set unchanged). Sets 1 and 2
(whose flips are top-k routings) run through ``main_routed``; every generator holds its output folder with
``output_lock``.

A set module provides: ``__doc__``, ``HERE``, ``SET`` (its number), ``STEPS``, ``FAMILIES`` (name -> {"text",
"device"}), ``CASES`` (name -> (family, variant, fault, modes)), ``DEVICES`` (name -> an object with ``text``),
``NOISY_REF`` (the device of a "noisyref" variant's reference), ``FLIP_STEP``, ``expectation(case, fault, tgt,
ref)`` (faults only), ``argmax_flips(tgt, ref)`` and ``warm()`` (the imports made once, before forking); for
``run_one`` and ``train`` here also ``Tracer``, ``batches``, ``flip_head``, ``corrupt``, ``make_optimizer``,
``forward_loss``, ``AUTOCAST``, ``MICRO``, ``CLIP``, ``OPTIMIZER_KINDS`` and ``ARGMAX_FAMILY``, and for ``setup``
here ``build_model``, ``patch`` and ``craft_near_tie``. Where a set module has none of its own, ``run_one(job)``,
``setup(family, variant, target, active, tracer, info)`` and ``device_label(family, variant)`` (the key's device of a
pair) are this module's, for it (``_own``); ``structure_differences(ref_dir, tgt_dir, variant)`` (the clean pairs'
structure check) is this module's, where an "amp" variant's dtypes may differ.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import functools
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def set2():
    """Set 2's harness module (``validation/v2/make_pairs.py``), loaded once under its own name."""
    return _load("validation_v2_make_pairs", _HERE / "v2" / "make_pairs.py")


LOCK = ".lock"  # the file in an output folder that a generation holds (flock) while it writes the folder


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold output folder ``out`` (made if missing) for one generation: an exclusive ``flock`` on ``out/.lock``,
    released when the block ends or the process (and its forked runs, which share the lock) dies, so no stale lock
    outlives a crash. Another generation already holding it: SystemExit with one line naming the folder, the
    holder's pid and the fix (two generations writing one folder remove and rewrite each other's dumps and key)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise SystemExit(
                "Error: %s is being written by another generation (pid %s, lock %s); wait for it to finish or "
                "pass another --out" % (out, holder, path)
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"%d\n" % os.getpid(), 0)
        yield path
    finally:
        os.close(fd)  # (releases the lock where this process held it)


ULPS = [0, 1, -1, 2, -2, 3, -3, 4, -4, 6, -6, 8, -8, 12, -12, 16, -16, 24, -24, 32, -32]


def search_tilt(h, logits, dev_logits, zero, rank: int, tries: int, ulps, trial, step: int, classes: str):
    """The search of every set's crafted near-tie: among the 8 rows of ``logits`` (the reference's, untilted)
    nearest a tie of their ``rank``-th and next-ranked classes (0: top-1 against top-2), the ``tries`` whose gap
    the device's rounding (``dev_logits``) moves most; for each, tilts of the weight row of the lower class along
    the row's input ``h[t]`` that aim the reference's gap at minus half the device's shift, ``k`` fp32 ulps off for
    each ``k`` of ``ulps``; the first tilt for which ``trial(t, tilt)`` returns (True, the reference's tilted
    logits) wins. Returns (what was done, the tilt) or None."""
    srt = logits.sort(-1, descending=True)
    gaps = srt.values[:, rank] - srt.values[:, rank + 1]
    pick = gaps.argsort()[:8].tolist()
    moved = {
        t: float(dev_logits[t, srt.indices[t, rank]] - dev_logits[t, srt.indices[t, rank + 1]]) - float(gaps[t])
        for t in pick
    }
    for t in sorted(pick, key=lambda t: -abs(moved[t]))[:tries]:
        e1, e2 = int(srt.indices[t, rank]), int(srt.indices[t, rank + 1])
        ht = h[t].float()
        ulp = float(logits[t, e1].abs()) * 2.0**-23
        for k in ulps:
            tilt = zero.clone()
            # aim the reference's gap at minus half the device's shift: the device lands on the other side
            tilt[e2] = (float(gaps[t]) + moved[t] / 2 + k * ulp) * ht / float(ht @ ht)
            ok, ref_logits = trial(t, tilt)
            if ok:
                info = {
                    "step": step,
                    "token": t,
                    classes: [e1, e2],
                    "ref_logit_gap": float(ref_logits[t, e1] - ref_logits[t, e2]),
                    "device_gap_shift": moved[t],
                    "tilt_ulps": k,
                    "tilt_norm": float(tilt.norm()),
                }
                return info, tilt
    return None


def craft_near_tie(model, head, train, device, flip_step: int) -> tuple[dict, object]:
    """A 'flip' variant's near-tie, in both runs alike: a tilt of one row of ``head`` (the linear that makes the
    logits), added before step ``flip_step``, that ties one row's top-2 logits in the reference to within a few fp32
    ulps, chosen (by simulating both runs without msprobe: ``train(on_step, hooks)`` trains ``model`` from its
    current state, calling ``on_step(step)`` before each step and ``hooks(step, logits)`` after each forward) so
    that the device's rounding flips that row's argmax and no other.

    Returns (what was done, the tilt to add to the head's weight before step ``flip_step``)."""
    import torch

    start = copy.deepcopy(model.state_dict())
    seen: list = []
    hd = head.register_forward_hook(lambda m, inp, out: seen.append((inp[0].detach().clone(), out.detach().clone())))

    def run(dev, tilt):
        """Both runs' training to the last step, then that step's logits with the tilt."""
        model.load_state_dict(start)
        if dev is not None:
            dev.install()
        try:

            def on_step(step):
                if step == flip_step:
                    with torch.no_grad():
                        head.weight += tilt
                seen.clear()

            preds: list = []
            train(on_step, lambda s, logits: preds.append(torch.argmax(logits, -1)))
        finally:
            if dev is not None:
                dev.uninstall()
        h, logits = seen[0]
        return preds, h.reshape(-1, h.shape[-1]), logits.reshape(-1, logits.shape[-1])

    def differ(a, b):
        return [(s, int(t)) for s, (x, y) in enumerate(zip(a, b)) for t in (x.reshape(-1) != y.reshape(-1)).nonzero()]

    try:
        zero = torch.zeros_like(head.weight)
        ref_pred, h, logits = run(None, zero)
        dev_pred, _, dev_logits = run(device, zero)
        if differ(ref_pred, dev_pred):
            raise RuntimeError("the device flips an argmax without a crafted tie: %r" % differ(ref_pred, dev_pred))

        def trial(t, tilt):
            ref_pred, _, ref_logits = run(None, tilt)
            dev_pred, _, _ = run(device, tilt)
            return differ(ref_pred, dev_pred) == [(flip_step, t)], ref_logits

        found = search_tilt(h, logits, dev_logits, zero, 0, 4, ULPS, trial, flip_step, "classes")
        if found is not None:
            return found
        raise RuntimeError("no tilt of the head flips exactly one row's argmax on the device")
    finally:
        hd.remove()
        model.load_state_dict(start)


def craft_router_tie(model, routers: list, device, step_loss, forward, make_optimizer, clip: float, flip_step: int,
                     tries: int, ulps) -> tuple[dict, object]:  # fmt: skip
    """A mixture-of-experts 'flip' variant's near-tie (sets 1 and 2), in both runs alike: a tilt of the first
    router's weight, added before step ``flip_step``, that ties one token's 2nd and 3rd experts in the reference to
    within a few fp32 ulps, chosen (by simulating both runs without msprobe) so that the device's rounding flips that
    token's choice and nothing else. ``routers``: the model's router modules (forward output: logits, weights,
    expert indices); ``step_loss(step)``: the loss of a training step's batch; ``forward(step)``: the forward of a
    step's inputs; ``make_optimizer()``: the runs' optimizer; ``clip``: their clipping norm; ``tries`` and ``ulps``:
    ``search_tilt``'s.

    Returns (what was done, the tilt to add to the first router's weight before step ``flip_step``)."""
    import torch

    seen: list = []
    handles = [
        r.register_forward_hook(lambda mod, inp, out: seen.append((inp[0].detach().clone(), out[0].detach(), out[2])))
        for r in routers
    ]
    start = copy.deepcopy(model.state_dict())

    def train(dev, steps):
        """Both runs' training (same optimizer, clipping, data) for ``steps`` steps; the routings of each step."""
        model.load_state_dict(start)
        opt = make_optimizer()
        routes = []
        if dev is not None:
            dev.install()
        try:
            for step in range(steps):
                seen.clear()
                step_loss(step).backward()
                routes.append([s[2].clone() for s in seen])
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
        finally:
            if dev is not None:
                dev.uninstall()
        return routes, copy.deepcopy(model.state_dict())

    def route(state, dev, tilt):
        model.load_state_dict(state)
        with torch.no_grad():
            routers[0].weight += tilt
        seen.clear()
        if dev is not None:
            dev.install()
        try:
            with torch.no_grad():
                forward(flip_step)
        finally:
            if dev is not None:
                dev.uninstall()
        return [s[2].clone() for s in seen], seen[0]

    def differ(a, b):
        return [
            (layer, tok)
            for layer, (x, y) in enumerate(zip(a, b))
            for tok in range(x.shape[0])
            if not torch.equal(x[tok].sort().values, y[tok].sort().values)
        ]

    try:
        ref_routes, ref_state = train(None, flip_step)
        dev_routes, dev_state = train(device, flip_step)
        if any(differ(a, b) for a, b in zip(ref_routes, dev_routes)):
            raise RuntimeError("device %s flips a routing before the crafted step" % device.name)
        zero = torch.zeros_like(routers[0].weight)
        _, (h, logits, _) = route(ref_state, None, zero)
        _, (_, dev_logits, _) = route(dev_state, device, zero)

        def trial(t, tilt):
            ref_idx, (_, ref_logits, _) = route(ref_state, None, tilt)
            dev_idx, _ = route(dev_state, device, tilt)
            return differ(ref_idx, dev_idx) == [(0, t)], ref_logits

        found = search_tilt(h, logits, dev_logits, zero, 1, tries, ulps, trial, flip_step, "experts")
        if found is not None:
            return found
        raise RuntimeError("no tilt of the router flips exactly one token on device %s" % device.name)
    finally:
        for hd in handles:
            hd.remove()
        model.load_state_dict(start)


# the cases' tables (a set's CASES: name -> (family, variant, fault, dump modes))
STATS, BOTH = ("stats",), ("stats", "tensor")


def weight_case(family: str, param: str, step: int, how: str, modes: tuple = STATS) -> tuple:
    """A case of a weight fault: parameter ``param`` corrupted (``how``: "sign2pct" or the set's own) before
    ``step``."""
    return (family, "base", {"kind": "weight", "param": param, "step": step, "how": how}, modes)


def optimizer_case(family: str, kind: str, value, modes: tuple = STATS) -> tuple:
    """A case of an optimizer fault: setting ``kind`` ("lr": a factor, "clip": the norm, else a param groups'
    setting) changed to ``value`` in the updates after step 1 (parameters first differ at step 2)."""
    return (family, "base", {"kind": kind, "after_step": 1, "value": value}, modes)


def draw_batches(seed: int, steps: int, n_micro: int, draw) -> list[list[dict]]:
    """Per step, per micro-batch: ``draw(g)``, one micro-batch's inputs, all from one generator ``g`` seeded ``seed``
    (drawn in order: step by step, micro-batch by micro-batch)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[draw(g) for _ in range(n_micro)] for _ in range(steps)]


def family_faults(s, family: str) -> list[dict]:
    """The faults of set module ``s``'s cases of ``family``."""
    return [fault for fam, _, fault, _ in s.CASES.values() if fam == family and fault]


def watch_weights(s, family: str, model, tracer) -> None:
    """The tracer watches the parameters that the family's weight faults corrupt (their first consumer is the
    culprit)."""
    for fault in family_faults(s, family):
        if fault["kind"] == "weight":
            params = dict(model.named_parameters())
            tracer.watch[id(params[fault["param"]])] = (fault["param"], fault["step"])


def corrupt(model, fault, own: dict) -> None:
    """A weight fault before its step: "sign2pct" (2 % of the parameter's signs flipped) or one of the set's own
    ``own`` (how -> function of the parameter)."""
    import torch

    p = dict(model.named_parameters())[fault["param"]]
    with torch.no_grad():
        if fault["how"] == "sign2pct":
            g = torch.Generator().manual_seed(7)
            sel = torch.rand(p.shape, generator=g) < 0.02
            p[sel] = -p[sel]
        elif fault["how"] in own:
            own[fault["how"]](p)
        else:
            raise ValueError(fault["how"])


def optimizer_step(opt, scaler, info: dict) -> None:
    """The optimizer's step (through the GradScaler where there is one, whose scale is logged) and zero_grad."""
    if scaler:
        scaler.step(opt)
        scaler.update()
        info.setdefault("loss_scale", []).append(scaler.get_scale())
    else:
        opt.step()
    opt.zero_grad()


def train(s, family: str, model, data, fault, hooks=None, on_step=None, steps=None, debugger=None, tracer=None,
          info=None):  # fmt: skip
    """The training loop of every run of set module ``s`` (and of the near-tie crafting, without msprobe): forward
    and backward of every micro-batch inside msprobe's window, clipping and the optimizer step outside it; an
    optimizer fault (``s.OPTIMIZER_KINDS``: "clip" lowers the clipping norm, "lr" scales the learning rate, any
    other sets the param groups' setting of its name) changes its setting in the update after ``after_step``. The
    family ``s.ARGMAX_FAMILY`` takes an argmax over its logits (the batch's accuracy) inside the window. Returns the
    losses."""
    import torch

    opt = s.make_optimizer(family, model)
    kind = fault["kind"] if fault else None
    autocast = getattr(torch, s.AUTOCAST[family]) if family in s.AUTOCAST else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if autocast == torch.float16 else None
    n_micro = s.MICRO.get(family, 1)
    losses = []
    info = info if info is not None else {}
    for step in range(s.STEPS if steps is None else steps):
        if tracer is not None:
            tracer.step = step
        if on_step is not None:
            on_step(step)
        if debugger is not None:
            debugger.start(model)
        for batch in data[step]:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss, logits = s.forward_loss(family, model, batch, fault, tracer)
                if family == s.ARGMAX_FAMILY:  # the batch's accuracy, a discrete output inside the window
                    pred = torch.argmax(logits, dim=-1)
                    if tracer is not None:
                        tracer.argmax.append({"step": step, "record": tracer.current(), "pred": pred.tolist()})
                    if pred.shape == batch["labels"].shape:  # (set 5's CTC argmax is a greedy transcript)
                        info.setdefault("accuracy", []).append(float((pred == batch["labels"]).float().mean()))
                if hooks is not None:
                    hooks(step, logits)
            loss = loss / n_micro
            (scaler.scale(loss) if scaler else loss).backward()
            losses.append(float(loss.detach()))
        if debugger is not None:
            debugger.stop()
        if scaler:
            scaler.unscale_(opt)
        clip = s.CLIP
        if kind == "clip" and step >= fault["after_step"]:
            clip = fault["value"]
        info.setdefault("grad_norm", []).append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if kind in s.OPTIMIZER_KINDS and kind != "clip" and step == fault["after_step"]:
            for group in opt.param_groups:
                if kind == "lr":
                    group["lr"] = group["lr"] * fault["value"]
                else:
                    group[kind] = fault["value"]
        optimizer_step(opt, scaler, info)
        if debugger is not None:
            debugger.step()
    return losses


def _own(s, name: str):
    """Set module ``s``'s function ``name`` (``run_one``, ``setup``, ``device_label``), or, where it has none of
    its own, this module's, called with ``s`` first."""
    own = getattr(s, name, None)
    return own if own is not None else functools.partial(globals()[name], s)


def run_device(s, family: str, variant: str, target: bool):
    """The device a run of set module ``s`` is on (None: the stock reference): a target on its family's device (an
    "amp" variant's on ``s.AMP_DEVICE``), a "noisyref" variant's reference on ``s.NOISY_REF``."""
    if target:
        return s.DEVICES[s.AMP_DEVICE if variant == "amp" else s.FAMILIES[family]["device"]]
    return s.DEVICES[s.NOISY_REF] if variant == "noisyref" else None


def device_label(s, family: str, variant: str) -> str:
    """The key's device of a pair of set module ``s``: the target's, "+" the reference's where that is noisy too."""
    if variant == "amp":
        return s.AMP_DEVICE
    return s.FAMILIES[family]["device"] + ("+" + s.NOISY_REF if variant == "noisyref" else "")


def setup(s, family: str, variant: str, target: bool, active, tracer, info: dict):
    """A run's model for ``run_one`` (set module ``s``: ``build_model``, ``patch``, ``batches``, ``Tracer`` and
    ``craft_near_tie(model, data, device)``): a "flip" variant's tilt crafted on a model of its own, patched as the
    runs' (the device installs itself there); the run's device (``run_device``) installed, then the model patched.
    Returns (model, tilt)."""
    tilt = None
    if variant == "flip":
        crafted = s.build_model(family)
        s.patch(family, crafted, s.Tracer(), None)
        info["flip"], tilt = s.craft_near_tie(crafted, s.batches(family, None), s.DEVICES[s.FAMILIES[family]["device"]])
    model = s.build_model(family)
    device = run_device(s, family, variant, target)
    if device is not None:
        device.install()
    s.patch(family, model, tracer, active)
    return model, tilt


def craft_first_micro(s, family: str, model, head, data, device) -> tuple[dict, object]:
    """``craft_near_tie`` on a family of set module ``s`` whose steps may have several micro-batches: the hooks see
    each step's first micro-batch only (the generator checks every micro-batch for flips)."""

    def run(on_step, hooks):
        seen: set = set()

        def first_micro(step, logits):
            if step not in seen:
                seen.add(step)
                hooks(step, logits)

        return train(s, family, model, data, None, on_step=on_step, hooks=first_micro)

    return craft_near_tie(model, head, run, device, s.FLIP_STEP)


def start_child(job: dict) -> tuple[Path, Path]:
    """A forked run's start: its scratch folder made and entered, one thread, deterministic algorithms, a gloo
    process group of one rank. Returns (the dump folder, the scratch folder)."""
    import torch
    import torch.distributed as dist

    out_dir, scratch = Path(job["dump_dir"]), Path(job["scratch"])
    scratch.mkdir(parents=True, exist_ok=True)
    os.chdir(scratch)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method="file://" + str(scratch / "pg"), rank=0, world_size=1)
    return out_dir, scratch


class Tracer:
    """Every set's record-name tracer (sets 1 and 2 subclass it with the calls their keys need, the others set
    2's): reads msprobe's name of the record being made; keeps marks and the top-k choices of every call."""

    def __init__(self):
        self.step = 0
        self.marks: list[dict] = []
        self.topk: list[dict] = []
        self.watch: dict[int, tuple[str, int]] = {}  # id(param) -> (tag, step)
        self._seen: set = set()
        self.events: list[tuple] = []  # msprobe's record names as it makes them, and module entries and exits

    def install_modules(self, model) -> None:
        """Log every record name msprobe makes, and every module's entry and exit, to find leaf module records."""
        from msprobe.core.dump.data_dump.data_processor.base import BaseDataProcessor

        tracer = self
        update = BaseDataProcessor.update_api_or_module_name

        def logged(dp, name):
            tracer.events.append(("name", tracer.step, name))
            return update(dp, name)

        BaseDataProcessor.update_api_or_module_name = logged
        for path, mod in model.named_modules():
            if path:
                prefix = "Module.%s.%s.forward." % (path, type(mod).__name__)
                mod.register_forward_pre_hook(lambda m, a, p=prefix: tracer.events.append(("start", tracer.step, p)))
                mod.register_forward_hook(lambda m, a, o, p=prefix: tracer.events.append(("end", tracer.step, p)))

    def leaf_modules(self) -> dict:
        """{step: {api record: [module record]}} for each module call whose forward made exactly one API record:
        msprobe's two names of the same computation."""
        out: dict = {}
        stack: list = []  # [prefix, record name, api records inside]
        for kind, step, name in self.events:
            if kind == "start":
                stack.append([name, None, set()])
            elif kind == "end":
                prefix, record, apis = stack.pop()
                if record and len(apis) == 1:
                    out.setdefault(str(step), {}).setdefault(next(iter(apis)), []).append(record)
            elif name.startswith("Module."):
                if stack and stack[-1][1] is None and name.startswith(stack[-1][0]):
                    stack[-1][1] = name
            elif name.endswith(".forward"):
                for frame in stack:
                    frame[2].add(name)
        return out

    def module_record(self, prefix: str, step: int) -> str | None:
        """msprobe's record of the first call at ``step`` of the module whose record starts with ``prefix``."""
        for kind, s, name in self.events:
            if kind == "name" and s == step and name.startswith(prefix):
                return name
        return None

    @staticmethod
    def current() -> str | None:
        from msprobe.pytorch import PrecisionDebugger

        inst = PrecisionDebugger._instance
        try:
            return inst.service.data_collector.data_processor.current_api_or_module_name
        except AttributeError:
            return None

    def mark(self, tag: str) -> None:
        self.marks.append({"step": self.step, "tag": tag, "record": self.current()})

    def _param_use(self, weight) -> None:
        tag, step = self.watch.get(id(weight), (None, None))
        if tag is not None and self.step == step and (tag, self.step) not in self._seen:
            self._seen.add((tag, self.step))
            self.mark("uses:" + tag)

    def topk_logged(self, topk):
        """``torch.topk`` function ``topk`` wrapped to log every call's step, record, indices, values and input."""
        tracer = self

        def topk_fn(input, k, dim=-1, largest=True, sorted=True, *, out=None):
            res = topk(input, k, dim=dim, largest=largest, sorted=sorted)
            tracer.topk.append(
                {
                    "step": tracer.step,
                    "record": tracer.current(),
                    "indices": res.indices.tolist(),
                    "values": res.values.detach().float().tolist(),
                    "input": input.detach().float().tolist(),
                }
            )
            return res

        return topk_fn


# =================================================================================================================
# the forked runs (every set's: sets 1 and 2 and the sets driven by main below)
# =================================================================================================================
def write_config(path: Path, dump_dir: Path, mode: str, steps: int = 3) -> None:
    """msprobe's config of a run: level "mix", every rank, steps 0 to ``steps`` - 1, statistics or tensor mode."""
    task = "statistics" if mode == "stats" else "tensor"
    cfg = {
        "task": task,
        "dump_path": str(dump_dir),
        "rank": [],
        "step": list(range(steps)),
        "level": "mix",
        task: {"scope": [], "list": [], "data_mode": ["all"]},
    }
    if task == "statistics":
        cfg[task]["summary_mode"] = "statistics"
    path.write_text(json.dumps(cfg, indent=1))


def plan_jobs(cases: dict, out: Path) -> list[dict]:
    """The runs that make ``cases`` ({name: (family, variant, fault, modes)}): one reference per family, variant
    and mode, one target per case and mode, each with its dump, scratch and log paths (old dumps removed)."""
    jobs, refs = [], {}
    for case, (family, variant, fault, modes) in cases.items():
        for mode in modes:
            ref = "%s_%s_ref_%s" % (family, variant, mode)  # one reference per family, variant and mode
            if ref not in refs:
                refs[ref] = {"name": ref, "family": family, "variant": variant, "fault": None, "role": "ref"}
                refs[ref]["mode"] = mode
                jobs.append(refs[ref])
            jobs.append(
                {
                    "name": "%s_target_%s" % (case, mode),
                    "family": family,
                    "variant": variant,
                    "fault": fault,
                    "role": "target",
                    "mode": mode,
                }
            )
    for job in jobs:
        job["dump_dir"] = str(out / job["mode"] / job["name"])
        job["scratch"] = str(out / "scratch" / job["name"])
        job["log"] = str(out / "logs" / (job["name"] + ".log"))
        (out / "logs").mkdir(parents=True, exist_ok=True)
        shutil.rmtree(job["dump_dir"], ignore_errors=True)
        shutil.rmtree(job["scratch"], ignore_errors=True)
    return jobs


def _child(job: dict, conn, run) -> None:
    """A forked run: ``run(job)`` with stdout and stderr to the job's log, its result (or error) to the parent."""
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # msprobe and torch talk: to a file
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        res = run(job)
        conn.send(("ok", res))
    except BaseException as exc:  # report to the parent, whatever it was
        import traceback

        conn.send(("error", "%s: %s\n%s" % (job["name"], exc, traceback.format_exc())))
    finally:
        conn.close()
        os._exit(0)


def run_jobs(jobs: list[dict], n: int, run) -> dict:
    """Run ``run(job)`` of every job in forked children, at most n at a time; returns name -> result."""
    ctx = mp.get_context("fork")
    pending, running, results = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < n:
            job = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(job, child, run))
            p.start()
            child.close()
            running.append((job, p, parent, time.time()))
        for item in list(running):
            job, p, conn, t0 = item
            if conn.poll(0.2):
                status, res = conn.recv()
                p.join()
                running.remove(item)
                if status != "ok":
                    raise SystemExit("run failed (log: %s): %s" % (job["log"], res))
                results[job["name"]] = res
                print("  %-40s %5.1fs" % (job["name"], time.time() - t0), flush=True)
            elif not p.is_alive():
                running.remove(item)
                raise SystemExit("run %s died (exit code %s; log: %s)" % (job["name"], p.exitcode, job["log"]))
    return results


def names(res: dict, tag: str, step: int | None = None) -> list[str]:
    """The records of a run's marks ``tag`` (at ``step``; None: every step)."""
    return [m["record"] for m in res["marks"] if m["tag"] == tag and (step is None or m["step"] == step)]


def topk_flips(tgt: dict, ref: dict) -> list[dict]:
    """Tokens whose set of chosen experts differs, per step and top-k call, with the reference's top values."""
    flips = []
    for a, b in zip(tgt["topk"], ref["topk"]):
        for tok, (ia, ib) in enumerate(zip(a["indices"], b["indices"])):
            if sorted(ia) != sorted(ib):
                row = b["input"][tok]
                order = sorted(range(len(row)), key=lambda e: -row[e])
                flips.append(
                    {
                        "step": b["step"],
                        "record": b["record"],
                        "token": tok,
                        "target_experts": ia,
                        "ref_experts": ib,
                        "ref_probs_sorted": [row[e] for e in order],
                    }
                )
    return flips


def leaves(obj, path=()):
    """(path, (type, dtype, shape, requires_grad)) of every leaf of a dump.json record tree."""
    if isinstance(obj, dict):
        if "dtype" in obj or obj.get("type") == "torch.Tensor":
            yield path, (obj.get("type"), obj.get("dtype"), tuple(obj.get("shape") or ()), obj.get("requires_grad"))
            return
        if "type" in obj:
            yield path, (obj.get("type"),)
        for k, v in obj.items():
            if isinstance(v, (dict, list)):
                yield from leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,))


def structure_differences(ref_dir: Path, tgt_dir: Path, steps: int = 3, variant: str | None = None) -> list[str]:
    """Where two runs' dumps differ in records, leaf types, dtypes, shapes or requires_grad (values aside); an "amp"
    ``variant``'s runs (the target under another autocast policy) may differ in dtypes."""
    out = []
    for step in range(steps):
        a, b = _records(ref_dir, step), _records(tgt_dir, step)
        if list(a) != list(b):
            out.append("step %d: records differ" % step)
            continue
        la, lb = dict(leaves(a)), dict(leaves(b))
        if variant == "amp":  # a leaf is (type, dtype, shape, requires_grad) or (type,): compared without its dtype
            la, lb = ({k: v[:1] + v[2:] for k, v in x.items()} for x in (la, lb))
        out += [
            "step %d: %s" % (step, ".".join(map(str, k)))
            for k in sorted(set(la) | set(lb), key=str)
            if la.get(k) != lb.get(k)
        ]
    return out


def run_one(s, job: dict) -> dict:
    """One msprobe run of set module ``s``; returns the marks and the argmax log. Runs in a fresh forked process.
    ``s.setup(family, variant, target, active, tracer, info)`` builds the model, patches it, crafts a "flip"
    variant's tilt and installs the device (in the set's order) and returns (model, tilt); ``s.flip_head(model)``
    is the linear the tilt is added to before step ``s.FLIP_STEP``."""
    import torch
    import torch.distributed as dist

    family, variant, fault, role, mode = job["family"], job["variant"], job["fault"], job["role"], job["mode"]
    target = role == "target"
    out_dir, scratch = start_child(job)

    tracer = s.Tracer()
    active = fault if target else None
    data = s.batches(family, active)
    info: dict = {}
    model, tilt = _own(s, "setup")(family, variant, target, active, tracer, info)
    tracer.install()

    from msprobe.pytorch import PrecisionDebugger

    write_config(scratch / "config.json", out_dir, mode, s.STEPS)
    debugger = PrecisionDebugger(config_path=str(scratch / "config.json"))
    tracer.install_modules(model)

    def on_step(step):
        if active and active["kind"] == "weight" and active["step"] == step:
            s.corrupt(model, active)
        if tilt is not None and step == s.FLIP_STEP:
            with torch.no_grad():
                s.flip_head(model).weight += tilt

    losses = train(s, family, model, data, active, on_step=on_step, debugger=debugger, tracer=tracer, info=info)
    dist.destroy_process_group()
    return {
        "job": job["name"],
        "marks": tracer.marks,
        "argmax": tracer.argmax,
        "leaf": tracer.leaf_modules(),
        "losses": losses,
        "info": info,
    }


def embed_mark(tracer, emb, tag: str) -> None:
    """The embedding module ``emb`` marks ``tag`` at each call (the same call: nn.Embedding's forward)."""
    import torch

    def fwd(ids, emb=emb, tag=tag):
        out = torch.nn.Embedding.forward(emb, ids)
        tracer.mark(tag)
        return out

    emb.forward = fwd


def argmax_flips(tgt: dict, ref: dict) -> list[dict]:
    """Rows (tokens of every sequence in order, or images) whose argmax differs, per step and argmax call."""

    def flat(pred):
        return [x for row in pred for x in row] if pred and isinstance(pred[0], list) else pred

    flips = []
    for a, b in zip(tgt["argmax"], ref["argmax"]):
        for tok, (x, y) in enumerate(zip(flat(a["pred"]), flat(b["pred"]))):
            if x != y:
                flips.append({"step": b["step"], "record": b["record"], "token": tok, "target": x, "ref": y})
    return flips


def hf_module(model: str):
    """transformers' modeling module of ``model`` (``transformers.models.<model>.modeling_<model>``)."""
    return importlib.import_module("transformers.models.%s.modeling_%s" % (model, model))


def mark_readers(case: str, tgt: dict, ref: dict):
    """The readers of the marks both runs made at a faulty call: ``one(res, tag, step)`` (the record of the step's
    only call), ``first(res, tag, step)`` (the first of the step's calls) and ``both(tag, step, pick=one)`` (the
    sorted records of the target and the reference)."""

    def one(res, tag, step):
        got = names(res, tag, step)
        if len(got) != 1 or got[0] is None:
            raise SystemExit("%s: mark %r at step %d: %r" % (case, tag, step, got))
        return got[0]

    def first(res, tag, step):
        got = names(res, tag, step)
        if not got or got[0] is None:
            raise SystemExit("%s: mark %r at step %d: %r" % (case, tag, step, got))
        return got[0]

    def both(tag, step, pick=one):
        return sorted({pick(tgt, tag, step), pick(ref, tag, step)})

    return one, first, both


def optimizer_what(fault, clip: float, own: dict) -> str:
    """An optimizer fault's change in words: ``own``'s sentence for its kind (the set's optimizers), else the learning
    rate's factor ("lr") or the clipping norm against ``clip`` ("clip"); the fault's value %-formatted into it (a
    tuple as a tuple)."""
    words = {"lr": "the learning rate x%g", "clip": "gradient clipping at max_norm %%g instead of %g" % clip, **own}
    value = fault["value"]
    return words[fault["kind"]] % ((tuple(value),) if isinstance(value, (tuple, list)) else value)


def optimizer_expectation(fault, what: str) -> dict:
    """An optimizer fault's key: ``what`` in the updates after ``after_step``; no op is the culprit."""
    step = fault["after_step"] + 1
    return {
        "step": step,
        "ops": [],
        "optimizer": True,
        "what": "%s in the updates after step %d: parameters first differ at step %d"
        % (what, fault["after_step"], step),
    }


def _modules(res: dict, op: str, step: int) -> set:
    """The module records that made only ``op`` at ``step`` in run ``res``."""
    return set(res["leaf"].get(str(step), {}).get(op, []))


def missing_op_expectation(ref: dict, op: str, tgt: dict, consumer: str, what: str) -> dict:
    """The key of an op missing in the target at step 0: the reference's ``op`` and its ``consumer`` in the target
    (which then reads what ``op`` read), with the modules of each in its own run."""
    return {
        "step": 0,
        "ops": sorted({op, consumer}),
        "modules": sorted(_modules(ref, op, 0) | _modules(tgt, consumer, 0)),
        "what": what,
    }


def data_expectation(fault, ops: list, what: str) -> dict:
    """A data fault's key: the first consumers ``ops`` of the changed batch at the fault's step; ``what`` has a %d
    for the step."""
    step = fault["step"]
    return {"step": step, "ops": ops, "what": what % step}


def weight_expectation(fault, how: str, both) -> dict:
    """A weight fault's key: the corrupted parameter's first consumer at the fault's step."""
    step = fault["step"]
    return {
        "step": step,
        "ops": both("uses:" + fault["param"], step),
        "what": "%s %s before step %d; the op is its first consumer" % (fault["param"], how, step),
    }


def warm(*models: str) -> None:
    """The imports made once, before forking: torch, msprobe and transformers' ``models`` classes."""
    import torch  # noqa: F401
    import transformers
    from msprobe.pytorch import PrecisionDebugger  # noqa: F401

    for name in models:
        getattr(transformers, name)


def _records(path: Path, step: int) -> dict:
    return json.loads((path / ("step%d" % step) / "rank0" / "dump.json").read_text())["data"]


def _strip(rec):
    """A record without what differs between any two runs (file names of tensors, data names)."""
    if isinstance(rec, dict):
        return {k: _strip(v) for k, v in rec.items() if k not in ("data_name", "md5", "full_op_name")}
    if isinstance(rec, list):
        return [_strip(v) for v in rec]
    return rec


def _sides(op: str) -> list[str]:
    """The record of an op and, for a forward record, its backward record."""
    return [op, op[: -len(".forward")] + ".backward"] if op.endswith(".forward") else [op]


def check_changes(case: str, exp: dict, fault, out: Path, mode: str, tgt_dir: Path, clean_dir: Path) -> str:
    """Every fault changes its run: the key's records (or, for an optimizer fault, some record) differ from the
    clean target's at the key's step, and (optimizer faults and faults at later steps) nothing differs before."""
    step = exp["step"]
    a, b = _records(tgt_dir, step), _records(clean_dir, step)
    if exp.get("optimizer"):
        prev_a, prev_b = _records(tgt_dir, step - 1), _records(clean_dir, step - 1)
        if _strip(prev_a) != _strip(prev_b):
            raise SystemExit("%s_%s: records differ from the clean target before step %d" % (case, mode, step))
        if _strip(a) == _strip(b):
            raise SystemExit("%s_%s: nothing differs from the clean target at step %d" % (case, mode, step))
        return "some record"
    if step > 0 and _strip(_records(tgt_dir, step - 1)) != _strip(_records(clean_dir, step - 1)):
        raise SystemExit("%s_%s: records differ from the clean target before step %d" % (case, mode, step))
    changed = [
        op for op in exp["ops"] for name in _sides(op) if name in a and _strip(a.get(name)) != _strip(b.get(name))
    ]
    if not changed:
        raise SystemExit("%s_%s: none of %r differs from the clean target at step %d" % (case, mode, exp["ops"], step))
    return changed[0]


def describe(out: Path, steps: int = 3) -> None:
    """Per pair: how many records of each step differ between the two runs (statistics or tensor summaries) and
    the loss's relative difference at the last step (markdown; docs/validation.md)."""
    key = json.loads((out / "key.json").read_text())
    print("| pair | device | " + " | ".join("step %d" % s for s in range(steps)) + " | last loss rel. diff |")
    print("|---|---|" + "---|" * steps + "---|")
    for name, case in sorted(key["cases"].items()):
        cells = []
        for step in range(steps):
            a, b = _records(out / case["ref"], step), _records(out / case["target"], step)
            common = [r for r in a if r in b]
            diff = sum(_strip(a[r]) != _strip(b[r]) for r in common)
            only = len(set(a) ^ set(b))
            cells.append("%d / %d%s" % (diff, len(common), " (+%d in one run)" % only if only else ""))
        la, lb = case["losses"]["ref"][-1], case["losses"]["target"][-1]
        print("| %s | %s | %s | %.2g |" % (name, case["device"], " | ".join(cells), abs(lb - la) / abs(la)))


def op_modules(exp: dict, tgt: dict, ref: dict) -> set:
    """The module records of the key's ops at its step (msprobe's other name of each op where a module made only
    it), in either run."""
    step = str(exp["step"])
    return {m for res in (tgt, ref) for op in exp["ops"] for m in res["leaf"].get(step, {}).get(op, [])}


def check_flips(s, case: str, variant: str, fault, flips: list, ref: dict, words: tuple, keep: bool = False) -> None:
    """A "flip" variant's pair flips the one crafted choice (at ``s.FLIP_STEP``, the crafted token) and nothing else;
    a clean pair without a crafted tie flips none (``words``: the choice, as "a crafted ... flip" and "flipped ...").
    Else SystemExit. With ``keep`` (``--keep-natural-flips``), a clean pair whose device flipped a choice by itself, or
    a flip variant whose crafted choice did not flip, is kept, its flips in the key, and a line says so: which
    near-ties a device flips depends on the CPU's kernels (a machine with AMX rounds bf16 matmuls otherwise), and
    such a pair is still clean."""
    if variant == "flip" and [(f["step"], f["token"]) for f in flips] != [(s.FLIP_STEP, ref["info"]["flip"]["token"])]:
        if not keep:
            raise SystemExit("%s: not the one crafted %s flip: %r" % (case, words[0], flips))
        print("%s: not the one crafted %s flip (kept, a clean pair): %r" % (case, words[0], flips), flush=True)
    if variant != "flip" and fault is None and flips:
        if not keep:
            raise SystemExit("%s: a clean pair without a crafted tie flipped %s: %r" % (case, words[1], flips))
        print("%s: a clean pair flipped %s by itself (kept, in the key): %r" % (case, words[1], flips), flush=True)


def key_entry(case: str, mode: str, family: str, device: str, exp: dict, flips: list, tgt_name: str, tgt: dict,
              ref_name: str, ref: dict, loss_scale: bool = True) -> dict:  # fmt: skip
    """A pair's entry in ``key.json``: its case, mode, family, device, the two dumps, the expected verdict, the
    discrete choices that flipped, the crafted tie, both runs' losses, gradient norms and (unless not
    ``loss_scale``: set 1's key) loss scales."""
    entry = {
        "case": case,
        "mode": mode,
        "family": family,
        "device": device,
        "ref": str(Path(mode) / ref_name),
        "target": str(Path(mode) / tgt_name),
        "expect": exp,
        "flips": flips,
        "crafted": ref["info"].get("flip"),
        "losses": {"ref": ref["losses"], "target": tgt["losses"]},
        "grad_norm": {"ref": ref["info"]["grad_norm"], "target": tgt["info"]["grad_norm"]},
    }
    if loss_scale:
        entry["loss_scale"] = {"ref": ref["info"].get("loss_scale"), "target": tgt["info"].get("loss_scale")}
    return entry


def parse_args(s, argv=None, describe: bool = False) -> argparse.Namespace:
    """A set generator's arguments: --out (default: the set's ``.data``), --jobs, --only, --modes and, with
    ``describe``, --describe."""
    ap = argparse.ArgumentParser(description=s.__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(s.HERE / ".data"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="cases to make (default: all)")
    ap.add_argument("--modes", nargs="*", default=["stats", "tensor"], help="dump modes to make (default: both)")
    ap.add_argument(
        "--keep-natural-flips",
        action="store_true",
        help="keep a clean pair whose flips are not the crafted ones (CPU-dependent), its flips in the key",
    )
    if describe:
        ap.add_argument("--describe", action="store_true", help="print how much each pair differs; make nothing")
    return ap.parse_args(argv)


def selected_cases(s, args) -> dict:
    """Set module ``s``'s cases that ``args`` asks for (--only; all by default), each with the modes of --modes."""
    return {
        k: (fam, var, fault, tuple(m for m in modes if m in args.modes))
        for k, (fam, var, fault, modes) in s.CASES.items()
        if not args.only or k in args.only
    }


def main_routed(s, argv=None) -> int:
    """Make the pairs and key of set 1 or 2 (``s``; one generation at a time in an output folder)."""
    args = parse_args(s, argv)
    out = Path(args.out).resolve()
    with output_lock(out):
        return generate_routed(s, args, out)


def generate_routed(s, args, out: Path) -> int:
    """Make the pairs of set 1 or 2 (``s``: its flips are top-k routings; ``s.warm()`` makes the imports,
    ``s.device_table()`` is its devices) of ``args`` and their key in ``out``. Set 1's key (made before the sets had
    numbers) has neither the set's number nor the loss scales: those go in where ``s`` has a ``SET``."""
    cases = selected_cases(s, args)
    t0 = time.time()
    s.warm()
    print("imports %.1fs" % (time.time() - t0), flush=True)
    jobs = plan_jobs(cases, out)
    results = run_jobs(jobs, args.jobs, lambda job: s.run_one(job))
    key_path = out / "key.json"
    key = json.loads(key_path.read_text()) if key_path.exists() and args.only else {"cases": {}}
    numbered = hasattr(s, "SET")
    for case, (family, variant, fault, modes) in cases.items():
        for mode in modes:
            tgt_name, ref_name = "%s_target_%s" % (case, mode), "%s_%s_ref_%s" % (family, variant, mode)
            tgt, ref = results[tgt_name], results[ref_name]
            exp = s.expectation(case, fault, tgt, ref)
            if exp.get("ops"):
                exp["modules"] = sorted(set(exp.get("modules", [])) | op_modules(exp, tgt, ref))
            flips = s.topk_flips(tgt, ref)
            check_flips(s, case, variant, fault, flips, ref, ("routing", "routing"), args.keep_natural_flips)
            if variant != "flip" and fault is None:  # the device changes values only: same records, shapes, dtypes
                odd = s.structure_differences(out / mode / ref_name, out / mode / tgt_name)
                if odd:
                    raise SystemExit("%s_%s: the device changed the dump's structure: %s" % (case, mode, odd[:5]))
            device = s.FAMILIES[family]["device"]
            entry = key_entry(case, mode, family, device, exp, flips, tgt_name, tgt, ref_name, ref, numbered)
            key["cases"]["%s_%s" % (case, mode)] = entry
    key["families"] = {k: v["text"] for k, v in s.FAMILIES.items()}
    key["devices"] = {k: v.text for k, v in s.device_table().items()}
    key["steps"] = s.STEPS
    if numbered:
        key["set"] = s.SET
    key_path.write_text(json.dumps(key, indent=1, sort_keys=True))
    shutil.rmtree(out / "scratch", ignore_errors=True)
    print("%d runs, %d cases in %.1fs; key: %s" % (len(jobs), len(key["cases"]), time.time() - t0, key_path))
    return 0


def main(s, argv=None) -> int:
    """Make set module ``s``'s pairs and key (or, with --describe, print how much each pair differs)."""
    args = parse_args(s, argv, describe=True)
    out = Path(args.out).resolve()
    if args.describe:
        describe(out, s.STEPS)
        return 0
    with output_lock(out):
        return generate(s, args, out)


def generate(s, args, out: Path) -> int:
    """Make set module ``s``'s pairs of ``args`` (--only, --modes, --jobs) and its key in ``out`` (held by
    ``output_lock``)."""
    cases = selected_cases(s, args)
    t0 = time.time()
    s.warm()
    print("imports %.1fs" % (time.time() - t0), flush=True)
    jobs = plan_jobs(cases, out)
    results = run_jobs(jobs, args.jobs, _own(s, "run_one"))
    key_path = out / "key.json"
    key = json.loads(key_path.read_text()) if key_path.exists() and args.only else {"cases": {}}
    for case, (family, variant, fault, modes) in cases.items():
        for mode in modes:
            tgt_name = "%s_target_%s" % (case, mode)
            ref_name = "%s_%s_ref_%s" % (family, variant, mode)
            tgt, ref = results[tgt_name], results[ref_name]
            exp = {"clean": True} if fault is None else s.expectation(case, fault, tgt, ref)
            if exp.get("ops"):  # a mark names the record msprobe was making; the key keeps those it wrote
                written = set(_records(out / mode / tgt_name, exp["step"])) | set(
                    _records(out / mode / ref_name, exp["step"])
                )
                if not set(exp["ops"]) <= written:
                    raise SystemExit("%s_%s: %r not in the dumps" % (case, mode, sorted(set(exp["ops"]) - written)))
                if "modules" not in exp:  # (an expectation may name them: set 5's, where a name means two calls)
                    exp["modules"] = sorted(op_modules(exp, tgt, ref))
            flips = s.argmax_flips(tgt, ref)
            check_flips(s, case, variant, fault, flips, ref, ("argmax", "an argmax"), args.keep_natural_flips)
            if fault is None:  # the devices change values only: same records, shapes, dtypes
                if hasattr(s, "structure_differences"):  # a set's own check
                    odd = s.structure_differences(out / mode / ref_name, out / mode / tgt_name, variant)
                else:
                    odd = structure_differences(out / mode / ref_name, out / mode / tgt_name, s.STEPS, variant)
                if odd:
                    raise SystemExit("%s_%s: the device changed the dump's structure: %s" % (case, mode, odd[:5]))
            clean = out / "stats" / ("%s_clean_target_stats" % family)
            if fault is not None and mode == "stats" and clean.exists():
                exp["changed"] = check_changes(case, exp, fault, out, mode, out / mode / tgt_name, clean)
            device = _own(s, "device_label")(family, variant)
            key["cases"]["%s_%s" % (case, mode)] = key_entry(
                case, mode, family, device, exp, flips, tgt_name, tgt, ref_name, ref
            )
    key["families"] = {k: v["text"] for k, v in s.FAMILIES.items()}
    key["devices"] = {k: v.text for k, v in s.DEVICES.items()}
    key["steps"] = s.STEPS
    key["set"] = s.SET
    key_path.write_text(json.dumps(key, indent=1, sort_keys=True))
    shutil.rmtree(out / "scratch", ignore_errors=True)
    print("%d runs, %d cases in %.1fs; key: %s" % (len(jobs), len(key["cases"]), time.time() - t0, key_path))
    return 0

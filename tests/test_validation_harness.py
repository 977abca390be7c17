"""The validation generators' shared harness (``validation/harness.py``): the output lock (one generation at a time
writes an output folder; a second one stops with one line, before it removes or writes anything: every set's
generator is run as a script against a folder this test holds, each stopping at the lock, seconds), the jobs' plan,
msprobe's config, the structure check, the batches' draw, what a set module leaves to the harness and pieces of the
key."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("validation_harness", ROOT / "validation" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

# every set's generator (sets 3 to 6 through harness.main), with the arguments of a small generation
GENERATORS = {
    "set1": ["validation/make_pairs.py", "--only", "llama_clean", "--modes", "stats"],
    "set2": ["validation/v2/make_pairs.py", "--only", "gemma_clean", "--modes", "stats"],
    "set6": ["validation/v6/make_pairs.py", "--only", "rwkv_clean", "--modes", "stats"],
    "cross": ["validation/cross/make_pairs.py", "--modes", "stats"],
    "longrun": ["validation/longrun/make_runs.py"],
}


def _held(out: Path, pid: int) -> str:
    return (
        "Error: %s is being written by another generation (pid %d, lock %s/.lock); wait for it to finish or pass "
        "another --out" % (out, pid, out)
    )


def test_a_second_lock_on_a_held_folder_stops_with_one_line(tmp_path):
    out = tmp_path / "new" / "data"
    with harness.output_lock(out) as path:
        assert path == out / ".lock" and path.read_text() == "%d\n" % os.getpid()
        with pytest.raises(SystemExit) as err, harness.output_lock(out):
            pass
        assert str(err.value) == _held(out, os.getpid())
    with harness.output_lock(out):  # released at the end of the block: taken again
        pass


def test_a_dead_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d\\n' % os.getpid()); print('held', flush=True); "
         "time.sleep(60)", str(tmp_path / ".lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as err, harness.output_lock(tmp_path):
            pass
        assert str(err.value) == _held(tmp_path, holder.pid)
    finally:
        holder.kill()
        holder.wait()
    with harness.output_lock(tmp_path):
        pass


@pytest.mark.parametrize("generator", sorted(GENERATORS))
def test_every_generator_stops_on_a_folder_another_generation_holds(tmp_path, generator):
    out = tmp_path / "data"
    kept = out / "stats" / "a_run" / "step0" / "rank0" / "dump.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    script, *args = GENERATORS[generator]
    with harness.output_lock(out):
        p = subprocess.run(
            [sys.executable, str(ROOT / script), "--out", str(out), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert (p.returncode, p.stdout, p.stderr) == (1, "", _held(out, os.getpid()) + "\n")
    assert sorted(str(f.relative_to(out)) for f in out.rglob("*")) == [
        ".lock",
        "stats",
        "stats/a_run",
        "stats/a_run/step0",
        "stats/a_run/step0/rank0",
        "stats/a_run/step0/rank0/dump.json",
    ]


# ------------------------------------------------------------------------------------------------------------
# the pieces every generator shares
# ------------------------------------------------------------------------------------------------------------
def test_plan_jobs_makes_one_reference_per_family_variant_and_mode_and_removes_old_dumps(tmp_path):
    old = tmp_path / "stats" / "a_clean_target_stats" / "step0"
    old.mkdir(parents=True)
    cases = {
        "a_clean": ("a", "base", None, ("stats", "tensor")),
        "a_lr_step2": harness.optimizer_case("a", "lr", 1.1),
        "a_flip": ("a", "flip", None, ("stats",)),
    }
    jobs = harness.plan_jobs(cases, tmp_path)
    assert [(j["name"], j["role"], j["fault"]) for j in jobs] == [
        ("a_base_ref_stats", "ref", None),
        ("a_clean_target_stats", "target", None),
        ("a_base_ref_tensor", "ref", None),
        ("a_clean_target_tensor", "target", None),
        ("a_lr_step2_target_stats", "target", {"kind": "lr", "after_step": 1, "value": 1.1}),
        ("a_flip_ref_stats", "ref", None),
        ("a_flip_target_stats", "target", None),
    ]
    assert jobs[1]["dump_dir"] == str(tmp_path / "stats" / "a_clean_target_stats")
    assert jobs[1]["log"] == str(tmp_path / "logs" / "a_clean_target_stats.log")
    assert not old.exists() and (tmp_path / "logs").is_dir()


def _dump(root: Path, records_per_step: list[dict]) -> Path:
    for step, records in enumerate(records_per_step):
        d = root / ("step%d" % step) / "rank0"
        d.mkdir(parents=True)
        (d / "dump.json").write_text(json.dumps({"data": records}))
    return root


def test_structure_differences_names_what_differs_beyond_values(tmp_path):
    def rec(dtype, shape=(2, 3), value=1.0):
        return {"input_args": [{"type": "torch.Tensor", "dtype": dtype, "shape": list(shape), "Max": value}]}

    ref = _dump(tmp_path / "ref", [{"Functional.linear.0.forward": rec("torch.float32")}] * 2)
    same = _dump(tmp_path / "same", [{"Functional.linear.0.forward": rec("torch.float32", value=2.0)}] * 2)
    other = _dump(
        tmp_path / "other",
        [{"Functional.linear.0.forward": rec("torch.bfloat16")}, {"Functional.gelu.0.forward": rec("torch.float32")}],
    )
    assert harness.structure_differences(ref, same, 2) == []
    assert harness.structure_differences(ref, other, 2) == [
        "step 0: Functional.linear.0.forward.input_args.0",
        "step 1: records differ",
    ]


def test_an_amp_variants_structure_may_differ_in_dtypes_only(tmp_path):
    def rec(dtype, shape=(2, 3)):
        return {"input_args": [{"type": "torch.Tensor", "dtype": dtype, "shape": list(shape)}]}

    ref = _dump(tmp_path / "ref", [{"Functional.linear.0.forward": rec("torch.float32")}])
    cast = _dump(tmp_path / "cast", [{"Functional.linear.0.forward": rec("torch.bfloat16")}])
    reshaped = _dump(tmp_path / "reshaped", [{"Functional.linear.0.forward": rec("torch.bfloat16", (3, 2))}])
    assert harness.structure_differences(ref, cast, 1, "amp") == []
    assert harness.structure_differences(ref, cast, 1, "base") == ["step 0: Functional.linear.0.forward.input_args.0"]
    assert harness.structure_differences(ref, reshaped, 1, "amp") == [
        "step 0: Functional.linear.0.forward.input_args.0"
    ]


def test_a_set_without_its_own_function_gets_the_harness_one():
    """(device_label: a set's own, else the harness's for that set: the target's device, + a noisy reference's.)"""
    import types

    s = types.SimpleNamespace(FAMILIES={"f": {"device": "A"}}, NOISY_REF="N", AMP_DEVICE="P")
    assert harness._own(s, "device_label")("f", "noisyref") == "A+N"
    assert harness._own(s, "device_label")("f", "amp") == "P"
    s.device_label = lambda family, variant: "own"
    assert harness._own(s, "device_label")("f", "noisyref") == "own"


def test_optimizer_what_says_the_change_with_its_value():
    own = {"betas": "Adan betas %s instead of (0.98, 0.92, 0.99)", "lr": "the learning rate x%g (bf16 run)"}
    assert harness.optimizer_what({"kind": "clip", "value": 0.1}, 1.0, own) == (
        "gradient clipping at max_norm 0.1 instead of 1"
    )
    assert harness.optimizer_what({"kind": "lr", "value": 1.05}, 1.0, {}) == "the learning rate x1.05"
    assert harness.optimizer_what({"kind": "lr", "value": 1.05}, 1.0, own) == "the learning rate x1.05 (bf16 run)"
    assert harness.optimizer_what({"kind": "betas", "value": [0.9, 0.92, 0.99]}, 1.0, own) == (
        "Adan betas (0.9, 0.92, 0.99) instead of (0.98, 0.92, 0.99)"
    )


def test_a_missing_ops_key_names_the_references_op_and_its_consumer_in_the_target():
    ref = {"leaf": {"0": {"Functional.layer_norm.0.forward": ["Module.pre.LayerNorm.forward.0"]}}}
    tgt = {"leaf": {"0": {"Functional.layer_norm.0.forward": ["Module.blocks.0.ln1.LayerNorm.forward.0"]}}}
    got = harness.missing_op_expectation(
        ref, "Functional.layer_norm.0.forward", tgt, "Functional.layer_norm.0.forward", "w"
    )
    assert got == {
        "step": 0,
        "ops": ["Functional.layer_norm.0.forward"],
        "modules": ["Module.blocks.0.ln1.LayerNorm.forward.0", "Module.pre.LayerNorm.forward.0"],
        "what": "w",
    }


def test_write_config_is_msprobes_statistics_or_tensor_config(tmp_path):
    harness.write_config(tmp_path / "c.json", tmp_path / "dump", "stats", 3)
    assert json.loads((tmp_path / "c.json").read_text()) == {
        "task": "statistics",
        "dump_path": str(tmp_path / "dump"),
        "rank": [],
        "step": [0, 1, 2],
        "level": "mix",
        "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
    }
    harness.write_config(tmp_path / "t.json", tmp_path / "dump", "tensor", 2)
    cfg = json.loads((tmp_path / "t.json").read_text())
    assert (cfg["task"], cfg["step"], cfg["tensor"]) == (
        "tensor",
        [0, 1],
        {"scope": [], "list": [], "data_mode": ["all"]},
    )


def test_draw_batches_draws_step_by_step_from_one_generator():
    torch = pytest.importorskip("torch")
    got = harness.draw_batches(7, 2, 3, lambda g: {"x": torch.randint(0, 1000, (2,), generator=g)})
    g = torch.Generator().manual_seed(7)
    want = [[torch.randint(0, 1000, (2,), generator=g) for _ in range(3)] for _ in range(2)]
    assert [[b["x"].tolist() for b in step] for step in got] == [[x.tolist() for x in step] for step in want]

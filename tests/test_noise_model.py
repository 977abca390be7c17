"""The noise model as a method (issue 23), on small real dump pairs written by the dump factory and on the
cross-device samples: the matmul class's compute precision inferred from the pair, discrete flips on near ties,
the optimizer's update ratios against their own spread, and a second reference run as a noise band."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dumpstore import ingest, open_store
from dumpstore.analysis import compare_runs, divergence
from dumpstore.analysis.noise import OPT_FLOOR, update_evidence
from dumpstore.analysis.prior import is_matmul
from helpers import SAMPLES

MODES = ("tensor", "statistics")


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _tf32(a: np.ndarray) -> np.ndarray:
    """Round float32 values to 10 mantissa bits (half away from zero on the bit pattern), as TF32 inputs are."""
    bits = _f32(a).view(np.int32)
    return ((bits + (1 << 12)) & -(1 << 13)).view(np.float32)


def _ingest_pair(dump_writer, store_dir, mode: str, ref: dict, target: dict):
    for name, recs in (("ref", ref), ("target", target)):
        w = dump_writer(name, mode)
        w.write(recs)
        ingest(w.root, name, store=store_dir, jobs=1)
    return open_store(store_dir)


def _linears(rng, n: int, tf32: bool, faulty: int | None = None) -> dict:
    """`n` linear records on the same (agreeing) input; the target's matmuls run on TF32-rounded inputs and
    record `faulty` (if any) has its weight 1 % larger in the target."""
    x = _f32(rng.normal(size=(16, 64)))
    recs = {}
    for i in range(n):
        w = _f32(rng.normal(size=(32, 64)) / 8)
        w_used = _f32(w * 1.01) if i == faulty else w
        y = _tf32(x).astype(np.float64) @ _tf32(w_used).astype(np.float64).T if tf32 else x @ w_used.T
        recs[f"Functional.linear.{i}.forward"] = {"input_args": [x, w_used], "output": [_f32(y)]}
    return recs


def test_matmul_class_names():
    for api in ("linear", "Functional.linear", "__matmul__", "Torch.bmm", "npu_bmmV2", "conv2d", "baddbmm", "einsum"):
        assert is_matmul(api), api
    for api in ("gelu", "layer_norm", "softmax", "__add__", "embedding", "sum", "Tensor.summ", "comm", None):
        assert not is_matmul(api), api


@pytest.mark.parametrize("mode", MODES)
def test_tf32_matmuls_are_judged_at_tf32(dump_writer, store_dir, mode):
    ref = _linears(np.random.default_rng(0), 5, tf32=False)
    tgt = _linears(np.random.default_rng(0), 5, tf32=True)
    cmp = compare_runs(_ingest_pair(dump_writer, store_dir, mode, ref, tgt), "target", "ref")
    assert cmp.precision["matmul"] == "tf32" and "TF32/HF32" in cmp.precision["note"]
    assert set(cmp.rows.filter(cmp.rows["io"] == "output")["tol_dtype"]) == {"tf32"}
    v = divergence(cmp)
    assert v.culprit is None and v.first_divergence is None


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_fault_stands_out_of_tf32_noise(dump_writer, store_dir, mode):
    ref = _linears(np.random.default_rng(0), 6, tf32=False)
    tgt = _linears(np.random.default_rng(0), 6, tf32=True, faulty=5)
    v = divergence(compare_runs(_ingest_pair(dump_writer, store_dir, mode, ref, tgt), "target", "ref"))
    assert v.culprit is not None and v.culprit.op == "Functional.linear.5.forward"


def test_one_matmul_is_no_evidence_of_a_lower_precision(dump_writer, store_dir):
    """A single fresh matmul off by TF32 rounding is not a class: float32 judges it (a culprit)."""
    ref = _linears(np.random.default_rng(0), 1, tf32=False)
    tgt = _linears(np.random.default_rng(0), 1, tf32=True)
    cmp = compare_runs(_ingest_pair(dump_writer, store_dir, "tensor", ref, tgt), "target", "ref")
    assert "matmul" not in cmp.precision
    v = divergence(cmp)
    assert v.culprit is not None and v.culprit.kind == "op"


def _topk(x: np.ndarray, x_t: np.ndarray) -> tuple[dict, dict]:
    def rec(v):
        idx = np.argmax(v, axis=-1)
        vals = np.take_along_axis(v, idx[:, None], -1)
        return {
            "Torch.topk.0.forward": {
                "input_args": [v, {"type": "int", "value": 1}],
                "output": [_f32(vals), idx[:, None].astype(np.int64)],
            }
        }

    return rec(x), rec(x_t)


@pytest.mark.parametrize("mode", MODES)
def test_top1_flip_on_a_near_tie_is_noise(dump_writer, store_dir, mode):
    rng = np.random.default_rng(3)
    x = _f32(rng.normal(size=(8, 4)))
    x[:, 1] = _f32(x[:, 0] * (1 + 1e-6))  # experts 0 and 1 tied for every token
    x[:, 2:] = -10.0
    x_t = x.copy()
    x_t[0, 0], x_t[0, 1] = x[0, 1], x[0, 0]  # one token's tie broken the other way: values equal, index flips
    ref, tgt = _topk(x, x_t)
    v = divergence(compare_runs(_ingest_pair(dump_writer, store_dir, mode, ref, tgt), "target", "ref"))
    if mode == "statistics" and v.counts.get("diverged", 0) == 0:
        return  # msprobe keeps only max/min of int64: a flip inside the range is invisible
    assert v.culprit is None and v.first_divergence is None
    assert v.noise["discrete_flips"][0]["op"] == "Torch.topk.0.forward"


def test_top1_flip_without_a_tie_is_a_fault(dump_writer, store_dir):
    rng = np.random.default_rng(4)
    x = _f32(rng.normal(size=(8, 4)))
    x_t = x.copy()
    x_t[0] = -x[0]  # a different choice because the scores differ: no tie
    ref, tgt = _topk(x, x_t)
    v = divergence(compare_runs(_ingest_pair(dump_writer, store_dir, "tensor", ref, tgt), "target", "ref"))
    assert v.culprit is not None


def _optimizer_rows(ratios: np.ndarray, seed: int = 0):
    """Two steps of parameters whose target update is `ratios` x the reference's (statistics columns)."""
    import polars as pl

    rng = np.random.default_rng(seed)
    rows = []
    for i, r in enumerate(ratios):
        p0 = rng.normal(size=256)
        u = rng.normal(size=256) * 1e-2
        for step, (t, ref) in enumerate(((p0, p0), (p0 - r * u, p0 - u))):
            row = {"step": step, "rank": 0, "source": "", "_record": f"Functional.linear.{i}.forward"}
            row |= {"_io": "input", "index_path": "1", "numel": 256, "tol": 2.0**-13}
            for side, v in (("", t), ("ref_", ref)):
                row |= {f"{side}min": v.min(), f"{side}max": v.max(), f"{side}mean": v.mean()}
                row[f"{side}norm"] = float(np.sqrt((v * v).sum()))
            rows.append(row)
    df = pl.DataFrame(rows)
    return df, df.filter(pl.col("step") == 1)


def test_update_ratios_are_judged_against_their_own_spread():
    rng = np.random.default_rng(5)
    noise = np.exp(rng.normal(size=40) * 0.01)  # device noise: ratios scattered by 1 % around 1
    rows, params = _optimizer_rows(noise)
    ev = update_evidence(rows, 0, 1, params)
    assert ev is not None and not ev["differs"] and ev["spread"] > OPT_FLOOR
    rows, params = _optimizer_rows(noise * 1.05)  # a 5 % learning-rate change on top of the same noise
    ev = update_evidence(rows, 0, 1, params)
    assert ev is not None and ev["differs"] and ev["median_ratio"] == pytest.approx(1.05, rel=0.01)
    rows, params = _optimizer_rows(np.full(40, 1.01))  # 1 % on noise-free (fp32) updates
    ev = update_evidence(rows, 0, 1, params)
    assert ev is not None and ev["differs"] and ev["bar"] == OPT_FLOOR


def test_a_common_shift_of_update_sizes_within_their_gradients_error_is_not_the_optimizer():
    """Updates computed from gradients 2 % off can all move by 1 % (a device's rounding shared by every layer);
    the bar is at least the gradients' median error, so only a larger common shift names the optimizer."""
    rows, params = _optimizer_rows(np.full(40, 1.01))
    ev = update_evidence(rows, 0, 1, params, gradient_error=0.02)
    assert ev is not None and not ev["differs"] and (ev["bar"], ev["gradient_error"]) == (0.02, 0.02)
    rows, params = _optimizer_rows(np.full(40, 1.05))
    assert update_evidence(rows, 0, 1, params, gradient_error=0.02)["differs"]


def test_the_gradient_error_is_the_median_over_the_parameters_gradients():
    import polars as pl

    from dumpstore.analysis.steps import gradient_error

    rows = pl.DataFrame(
        {
            "step": [1, 1, 1, 1, 1, 2],
            "_io": [
                "parameters_grad",
                "parameters_grad",
                "parameters_grad",
                "input",
                "parameters_grad",
                "parameters_grad",
            ],
            "kind": ["tensor", "tensor", "tensor", "tensor", "scalar", "tensor"],
            "err": [0.01, 0.03, 0.02, 0.5, 0.9, 0.7],
        }
    )
    assert gradient_error(rows, 1) == 0.02
    assert gradient_error(rows, 0) == 0.0  # no gradients dumped: no floor


# ---------------------------------------------------------------------------------------- --noise-ref (samples)
XDEV = {c["name"]: c for c in json.loads((SAMPLES / "catalog.json").read_text())["device_noise_cases"]}


@pytest.fixture(scope="module")
def xdev_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("noise_ref")
    for name in ("xdev_ref_stats", "xdev_clean_stats", "xdev_clean2_stats", "xdev_weight5pct_stats"):
        ingest(SAMPLES / XDEV[name]["path"], name, store=root, jobs=1)
    return open_store(root)


def test_noise_ref_widens_each_tensors_band(xdev_store):
    cmp = compare_runs(xdev_store, "xdev_clean_stats", "xdev_ref_stats", noise_ref="xdev_clean2_stats")
    assert cmp.precision["noise_ref"] == "xdev_clean2_stats"
    banded = cmp.rows.filter(cmp.rows["noise_band"].is_not_null())
    assert banded.height > 0 and (banded["tol"] >= banded["noise_band"]).all()
    floats = cmp.rows.filter((cmp.rows["kind"] == "tensor") & (cmp.rows["tol"] > 0))
    assert (floats["tol"] >= 2.0**-6).all()  # never below the prior (bf16)
    v = divergence(cmp)
    assert v.culprit is None and v.first_divergence is None


def test_noise_ref_keeps_a_fault(xdev_store):
    cmp = compare_runs(xdev_store, "xdev_weight5pct_stats", "xdev_ref_stats", noise_ref="xdev_clean2_stats")
    v = divergence(cmp)
    exp = XDEV["xdev_weight5pct_stats"]["expected"]["culprit"]
    assert v.culprit is not None and (v.culprit.step, v.culprit.op) == (exp["step"], exp["op"])


def _routing(noise: float, pick: np.ndarray) -> dict:
    """Noisy float ops (the pair differs from here on, within tolerance), then a discrete op on a boolean mask
    whose output (the chosen token indices) is `pick`."""
    rng = np.random.default_rng(6)
    x = _f32(rng.normal(size=(16, 8)))
    mask = np.zeros((16,), dtype=bool)
    mask[:8] = True
    recs = {f"Functional.gelu.{i}.forward": {"input_args": [x], "output": [_f32(x * (1 + noise))]} for i in range(4)}
    return recs | {"Torch.nonzero.0.forward": {"input_args": [mask], "output": [pick.astype(np.int64)]}}


@pytest.mark.parametrize("mode", MODES)
def test_discrete_output_on_inputs_compared_by_max_min_only(dump_writer, store_dir, mode):
    """Statistics keep only max/min of an integer or boolean tensor: a flip upstream can hide in it.  A discrete
    output that then changes (here its shape) is noted as a possible flip in statistics mode; with tensors the
    inputs are compared exactly, and the op is a culprit."""
    ref = _routing(0.0, np.arange(8))
    tgt = _routing(5e-5, np.arange(9))
    v = divergence(compare_runs(_ingest_pair(dump_writer, store_dir, mode, ref, tgt), "target", "ref"))
    if mode == "statistics":
        assert v.culprit is None and v.noise["discrete_flips"][0]["op"] == "Torch.nonzero.0.forward"
    else:
        assert v.culprit is not None and v.culprit.op == "Torch.nonzero.0.forward"


@pytest.mark.parametrize("mode", MODES)
def test_a_weak_op_alarm_yields_to_a_stronger_finding_of_its_step(dump_writer, store_dir, mode):
    """An op 2x over its tolerance with nothing to compare it to comes first in the step, a weight 1 % off
    later: the weight is the culprit.  Without the weight fault, the weak alarm stands."""
    rng = np.random.default_rng(8)
    x, w = _f32(rng.normal(size=(16, 32))), _f32(rng.normal(size=(8, 32)))
    y = _f32(x * 0.5)
    noisy = _f32(y * (1 + 2 * 2.0**-13 * rng.choice([-1.0, 1.0], size=y.shape)))

    def pair(w_t):
        ref = {"Tensor.mul.0.forward": {"input_args": [x, {"type": "float", "value": 0.5}], "output": [y]}}
        ref["Functional.linear.0.forward"] = {"input_args": [x, w], "output": [_f32(x @ w.T)]}
        tgt = {"Tensor.mul.0.forward": {"input_args": [x, {"type": "float", "value": 0.5}], "output": [noisy]}}
        tgt["Functional.linear.0.forward"] = {"input_args": [x, w_t], "output": [_f32(x @ w_t.T)]}
        return ref, tgt

    v = divergence(compare_runs(_ingest_pair(dump_writer, store_dir, mode, *pair(_f32(w * 1.01))), "target", "ref"))
    assert v.culprit is not None and v.culprit.op == "Functional.linear.0.forward"


def test_a_weak_op_alarm_alone_stands(dump_writer, store_dir):
    rng = np.random.default_rng(8)
    x = _f32(rng.normal(size=(16, 32)))
    y = _f32(x * 0.5)
    noisy = _f32(y * (1 + 2 * 2.0**-13 * rng.choice([-1.0, 1.0], size=y.shape)))
    ref = {"Tensor.mul.0.forward": {"input_args": [x, {"type": "float", "value": 0.5}], "output": [y]}}
    tgt = {"Tensor.mul.0.forward": {"input_args": [x, {"type": "float", "value": 0.5}], "output": [noisy]}}
    v = divergence(compare_runs(_ingest_pair(dump_writer, store_dir, "tensor", ref, tgt), "target", "ref"))
    assert v.culprit is not None and v.culprit.op == "Tensor.mul.0.forward" and v.culprit.severity < 4


def test_a_weak_op_alarm_yields_to_a_later_steps_finding_in_every_path(dump_writer, store_dir):
    """Step 0: an op 2x over its tolerance, nothing else; step 1: a weight 1 % off.  The whole comparison, the
    per-step batches and the screen agree on the weight."""
    from dumpstore.analysis import divergence_by_steps
    from dumpstore.analysis._divergence import divergence_in_batches

    rng = np.random.default_rng(9)
    x, w = _f32(rng.normal(size=(16, 32))), _f32(rng.normal(size=(8, 32)))
    y = _f32(x * 0.5)
    noisy = _f32(y * (1 + 2 * 2.0**-13 * rng.choice([-1.0, 1.0], size=y.shape)))
    scale = {"type": "float", "value": 0.5}

    def step(out, w_used):
        return {
            "Tensor.mul.0.forward": {"input_args": [x, scale], "output": [out]},
            "Functional.linear.0.forward": {"input_args": [x, w_used], "output": [_f32(x @ w_used.T)]},
        }

    for name, recs in (("ref", [step(y, w), step(y, w)]), ("target", [step(noisy, w), step(y, _f32(w * 1.01))])):
        wr = dump_writer(name, "tensor")
        for i, r in enumerate(recs):
            wr.write(r, step=i)
        ingest(wr.root, name, store=store_dir, jobs=1)
    st = open_store(store_dir)
    whole = divergence(compare_runs(st, "target", "ref"))
    assert whole.culprit is not None and (whole.culprit.step, whole.culprit.op) == (1, "Functional.linear.0.forward")
    for v in (
        divergence_in_batches(st, "target", "ref", max_rows=1),
        divergence_by_steps(st, "target", "ref", max_rows=1),
    ):
        assert v.culprit is not None and (v.culprit.step, v.culprit.op) == (1, "Functional.linear.0.forward")


def test_noise_ref_on_the_command_line(xdev_store):
    from click.testing import CliRunner

    from dumpstore.cli.main import main

    args = ["--target", "xdev_clean_stats", "--ref", "xdev_ref_stats", "--noise-ref", "xdev_clean2_stats"]
    args += ["--store", str(xdev_store.root)]
    res = CliRunner().invoke(main, ["divergence", *args, "--no-cache"])
    assert res.exit_code == 0, res.output
    assert "noise band per tensor: 3x its error in xdev_clean2_stats against xdev_ref_stats" in res.output
    assert "CULPRIT: none" in res.output
    res = CliRunner().invoke(main, ["compare", *args, "--top", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["by"] == "significance"

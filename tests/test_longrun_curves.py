"""`curves`, the monitor culprit and long-run health, on runs with answers by construction: SGD curves in numpy
(tests/longrun/longrun_synth.py: a learning-rate change from a step, a spike, clean reruns) and the real msprobe monitor
runs of tests/longrun/gen_monitor.py (one layer's gradient rounded to bfloat16 from step 60)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

import browser
from dumpstore.analysis.curves import compare_curves
from dumpstore.analysis.curves_html import render
from dumpstore.analysis.longrun_culprit import compare_long_runs
from dumpstore.analysis.longrun_health import long_run_health
from dumpstore.cli.main import main
from dumpstore.longrun.ingest import ingest_longrun
from dumpstore.longrun.logs import read_log
from dumpstore.longrun.store import LongRun, write
from dumpstore.store import open_store
from helpers import SAMPLES

sys.path.insert(0, str(Path(__file__).parent / "longrun"))
import gen_monitor  # noqa: E402
from longrun_synth import megatron_log, sgd_run  # noqa: E402

STEPS, N = 3000, 1200


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, pa.Table]:
    d = tmp_path_factory.mktemp("curves")
    runs = {
        "ref": sgd_run(STEPS, data_seed=0),
        "rerun": sgd_run(STEPS, data_seed=0),  # a bitwise rerun
        "other_order": sgd_run(STEPS, data_seed=2),  # a clean rerun with another data order
        "ref2": sgd_run(STEPS, data_seed=1),
        "lr15": sgd_run(STEPS, data_seed=0, lr_factor_from=(N, 1.5)),
        "spike": sgd_run(STEPS, data_seed=0, spike_at=2500),
    }
    return {k: read_log(megatron_log(d / f"{k}.log", v))[0] for k, v in runs.items()}


def test_lr_change_found_at_its_step(logs):
    rep = compare_curves(logs["lr15"], logs["ref"], names=("lr15", "ref", None))
    assert rep.lr_mismatch is not None
    assert rep.lr_mismatch.step == N and rep.lr_mismatch.ratio == pytest.approx(1.5, rel=1e-5)
    assert rep.lr_mismatch.share_after == 1.0
    # the loss first differs at N + 1 (the update of iteration N is the first with the new lr); stated window:
    # within one smoothing window (w = n / 200 = 15 points) after it
    assert N + 1 <= rep.divergence.step <= N + 1 + rep.window
    assert rep.divergence.kind == "offset"
    crit = {c.name: c.passed for c in rep.criteria}
    assert crit["within_noise_band"] is False and crit["first_step_loss"] is True


@pytest.mark.parametrize("target", ["rerun", "other_order"])
def test_clean_reruns_are_quiet(logs, target):
    for ref2 in (None, logs["ref2"]):
        rep = compare_curves(logs[target], logs["ref"], ref2, names=(target, "ref", "ref2" if ref2 else None))
        assert rep.divergence.step is None
        assert rep.lr_mismatch is None and rep.spikes == [] and rep.events == []
        assert rep.band_source.startswith("rerun" if ref2 is not None else "the difference's own")


def test_spike_found_in_its_run_only(logs):
    rep = compare_curves(logs["spike"], logs["ref"], names=("spike", "ref", None))
    assert [(s.run, s.step, s.rule) for s in rep.spikes] == [("spike", 2500, "factor10")]
    assert rep.divergence.step is None  # one step is not a divergence


def test_align_by_samples(logs):
    t = logs["ref"]
    doubled = t.set_column(2, "consumed_samples", pa.compute.multiply(t.column("consumed_samples"), 2))
    rep = compare_curves(doubled, t, names=("big_batch", "ref", None), by="samples")
    assert rep.n_points == STEPS // 2 and rep.first_x == 32 and rep.last_x == 16 * STEPS


@pytest.fixture(scope="module")
def monitor_store(tmp_path_factory):
    pytest.importorskip("msprobe")
    gen = gen_monitor.ensure()
    store = tmp_path_factory.mktemp("mon") / "store"
    for run in ("ref", "ref2", "drift", "scaled"):
        ingest_longrun([gen / run], run, store=store)
    return store


@pytest.mark.msprobe
def test_culprit_is_the_drifting_layer_before_the_loss(monitor_store):
    rep = compare_long_runs(open_store(monitor_store), "drift", "ref")
    c = rep.culprit
    assert c is not None and c["first"] is not None
    first = c["first"]
    assert first["param"] == "layers.2.weight" and first["step"] == 60
    assert first["prefix"] in ("grad_unreduced", "grad_reduced")
    assert c["loss_step"] is None or c["loss_step"] > 60  # the loss moves later, if at all
    assert c["handoff"]["steps"] == [59, 60]
    cfg = c["handoff"]["config"]
    assert cfg["task"] == "tensor" and cfg["step"] == [59, 60] and cfg["tensor"]["list"] == ["layers.2."]


@pytest.mark.msprobe
def test_culprit_named_before_the_loss(monitor_store):
    """One layer's gradient 5 % too large from step 60: its grad_reduced norm moves at step 60, the loss at
    iteration 62 (monitor step 61: the first loss computed with weights updated by the faulty step)."""
    rep = compare_long_runs(open_store(monitor_store), "scaled", "ref")
    assert rep.divergence.step == 62
    c = rep.culprit
    assert (c["first"]["prefix"], c["first"]["param"], c["first"]["step"]) == ("grad_reduced", "layers.2.weight", 60)
    assert c["first"]["rel_diff"] == pytest.approx(0.05, rel=1e-3)
    assert c["loss_step"] == 61


@pytest.mark.msprobe
def test_msprobe_flagged_beside_the_verdict(monitor_store):
    """`scaled` ran with msprobe's anomaly detection on: its alarms (counted here from the raw anomaly.json) are
    shown beside the culprit, which they do not change."""
    raw = json.loads(
        (gen_monitor.ensure() / "scaled" / "monitor" / "anomaly_detected" / "rank0" / "anomaly.json").read_text()
    )
    assert len(raw) > 100  # msprobe's rule is noisy
    post = [a["step"] for a in raw.values() if a["tag_name"] == "0:layers.2.weight/rank0/post_grad"]
    tensor = [a["step"] for a in raw.values() if a["tag_name"].startswith("0:layers.2.weight/")]
    rep = compare_long_runs(open_store(monitor_store), "scaled", "ref")
    assert (rep.culprit["first"]["param"], rep.culprit["first"]["step"]) == ("layers.2.weight", 60)
    assert [f["run"] for f in rep.msprobe_flagged] == ["scaled"]  # ref ran without it
    f = rep.msprobe_flagged[0]
    assert f["n"] == len(raw) and f["rules"] == {"AnomalyTurbulence": len(raw)}
    assert f["first_step"] == min(a["step"] for a in raw.values()) == f["first"]["step"]
    assert f["focus"]["n"] == len(tensor) and f["focus"]["first"]["step"] == min(tensor)
    assert f["focus"]["first_of_series"]["step"] == min(post)
    r = CliRunner().invoke(main, ["curves", "--target", "scaled", "--ref", "ref", "--store", str(monitor_store)])
    assert r.exit_code == 0, r.output
    assert f"msprobe flagged (its own alarms, not this verdict): run scaled: {len(raw)} alarms" in r.output
    assert f"msprobe flagged layers.2.weight {len(tensor)} times, first at step {min(tensor)}" in r.output
    r = CliRunner().invoke(main, ["curves", "--run", "scaled", "--health", "--store", str(monitor_store), "--json"])
    assert json.loads(r.output)["msprobe_flagged"]["n"] == len(raw)
    sql = "select count(*) n from monitor_anomalies where prefix = 'grad_reduced' and name = 'layers.2.weight'"
    r = CliRunner().invoke(main, ["query", sql + " and run = 'scaled'", "--store", str(monitor_store), "--json"])
    assert json.loads(r.output) == [{"n": len(post)}]


@pytest.mark.msprobe
def test_culprit_quiet_on_a_clean_rerun(monitor_store):
    rep = compare_long_runs(open_store(monitor_store), "ref2", "ref")
    assert rep.culprit is not None and rep.culprit["first"] is None and rep.divergence.step is None
    rep = compare_long_runs(open_store(monitor_store), "drift", "ref", "ref2")  # band from the rerun
    assert rep.culprit["first"]["param"] == "layers.2.weight" and rep.culprit["first"]["step"] == 60


@pytest.mark.msprobe
def test_cli_curves_outputs(monitor_store):
    base = ["curves", "--target", "drift", "--ref", "ref", "--store", str(monitor_store)]
    r = CliRunner().invoke(main, base)
    assert r.exit_code == 0, r.output
    assert "first to move: grad_" in r.output and "layers.2.weight" in r.output
    assert '"step": [59, 60]' in r.output
    r = CliRunner().invoke(main, [*base, "--json"])
    doc = json.loads(r.output)
    assert doc["culprit"]["first"]["step"] == 60 and len(doc["criteria"]) == 4
    r = CliRunner().invoke(main, [*base, "--csv"])
    assert r.output.splitlines()[0] == "x,target,ref,diff,smoothed,band,out" and len(r.output.splitlines()) == 121
    r = CliRunner().invoke(main, ["curves", "--target", "drift", "--ref", "nope", "--store", str(monitor_store)])
    assert r.exit_code == 1 and "long run 'nope' is not in store" in r.output


def _scalars(values: dict[str, list[float]]) -> pa.Table:
    rows = [(i + 1, tag, v) for tag, vals in values.items() for i, v in enumerate(vals)]
    return pa.table(
        {
            "rank": [0] * len(rows),
            "step": [r[0] for r in rows],
            "consumed_samples": pa.nulls(len(rows), pa.int64()),
            "tag": [r[1] for r in rows],
            "value": [float(r[2]) for r in rows],
        }
    )


def test_health_findings(tmp_path):
    store = tmp_path / "store"
    n = 200
    loss = [5.0 - 0.01 * i for i in range(150)] + [3.0] * 50  # constant tail
    loss[40] = float("nan")
    grad = [1.0] * n
    grad[120] = 50.0
    scale = [65536.0 / 2 ** min(i // 10, 17) for i in range(n)]  # halves every 10 steps, below 1 at the end
    write(store, LongRun("sick", scalars=_scalars({"loss": loss, "grad_norm": grad, "loss_scale": scale})))
    rep = long_run_health(open_store(store), "sick")
    got = {f.check: (f.status, f.step) for f in rep.findings}
    assert got["nonfinite_loss"] == ("fail", 41)
    assert got["constant_loss"] == ("fail", 181)
    assert got["grad_explosion"] == ("warn", 121)
    assert got["loss_scale"][0] == "fail"
    r = CliRunner().invoke(main, ["curves", "--run", "sick", "--health", "--store", str(store)])
    assert r.exit_code == 0 and "FAIL  nonfinite_loss at step 41" in r.output


def test_health_not_converging_and_zero(tmp_path):
    store = tmp_path / "store"
    write(store, LongRun("flat", scalars=_scalars({"loss": [2.0 + 0.001 * (i % 7) for i in range(100)]})))
    write(store, LongRun("zero", scalars=_scalars({"loss": [1.0] * 50 + [0.0] * 50})))
    flat = {f.check: f.status for f in long_run_health(open_store(store), "flat").findings}
    assert flat["not_converging"] == "warn"
    zero = {f.check: (f.status, f.step) for f in long_run_health(open_store(store), "zero").findings}
    assert zero["zero_loss"] == ("fail", 51)


@pytest.mark.msprobe
def test_monitor_only_runs_and_update_ratio(tmp_path):
    pytest.importorskip("msprobe")
    gen = gen_monitor.ensure()
    store = tmp_path / "store"
    ingest_longrun([gen / "drift" / "monitor"], "d", store=store)
    ingest_longrun([gen / "ref" / "monitor"], "r", store=store)
    r = CliRunner().invoke(main, ["curves", "--target", "d", "--ref", "r", "--store", str(store)])
    assert r.exit_code == 0, r.output
    assert "no curves" in r.output and "first to move: grad_reduced layers.2.weight" in r.output
    ingest_longrun([gen / "allprefix" / "monitor"], "a", store=store)
    checks = {f.check for f in long_run_health(open_store(store), "a").findings}
    assert "update_ratio" in checks  # param_origin and param_updated of every parameter


@pytest.mark.browser
def test_html_page_draws_in_chromium(logs, tmp_path):
    name = "lr</script><img src=x onerror=alert(1)>"
    rep = compare_curves(logs["lr15"], logs["ref"], names=(name, "ref", None))
    text = render(rep, "summary")
    assert "<img src=x" not in text  # escaped in markup and in the page's JSON
    data = json.loads(re.search(r'id="curves-data">(.*?)</script>', text, re.DOTALL).group(1))
    assert data["divergence"] == rep.divergence.step and data["lr_step"] == N
    assert len(data["curves"]) == 2 and len(data["curves"][0]["x"]) == STEPS  # under 2 x 2000: every point
    if browser.chromium() is None:
        pytest.skip(browser.why_no_chromium())
    path = tmp_path / "curves.html"
    path.write_text(text)
    page = browser.load(path)
    assert not page.console_errors, page.console_errors[:5]
    assert page.dom.count('class="main-svg"') >= 2
    assert re.search(r'id="render-ms">\d+<', page.dom)


def _monitor(values: dict[str, list[float]], steps: int) -> pa.Table:
    """A grad_reduced monitor table: one row per parameter and step."""
    rows = [
        {"rank": 0, "step": s, "micro_step": None, "vpp_stage": 0, "prefix": "grad_reduced", "name": p,
         "module": p.rsplit(".", 1)[0], "param": p, "seq": i, "norm": v[s], "min": -v[s] / 10, "max": v[s] / 10}
        for i, (p, v) in enumerate(values.items())
        for s in range(steps)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows)


def test_culprit_on_noisy_reruns():
    """Non-deterministic reruns (every statistic 1e-4 relative noise): a clean pair is quiet with and without a
    rerun band; a 1 % gradient error of one parameter from step 120 is named at 120 against the rerun's band.
    Without a rerun every series differs from its first steps and none is judged (nor named)."""
    import numpy as np

    from dumpstore.analysis.longrun_culprit import monitor_culprit

    steps, names = 200, [f"layers.{i}.weight" for i in range(8)]
    base = {n: 1.0 + 0.5 * np.sin(np.arange(steps) / (7 + i)) for i, n in enumerate(names)}

    def run(seed, fault=False):
        rng = np.random.default_rng(seed)
        vals = {}
        for n in names:
            v = base[n] * (1 + 1e-4 * rng.standard_normal(steps))
            if fault and n == "layers.5.weight":
                v[120:] *= 1.01
            vals[n] = v.tolist()
        return _monitor(vals, steps)

    ref, ref2, clean, bad = run(0), run(1), run(2), run(3, fault=True)
    for m2 in (None, ref2):
        assert monitor_culprit(clean, ref, m2)["first"] is None
    first = monitor_culprit(bad, ref, ref2)["first"]
    assert (first["param"], first["step"]) == ("layers.5.weight", 120)
    alone = monitor_culprit(bad, ref)
    assert alone["first"] is None and alone["n_differ_from_start"] == len(names)


def test_culprit_identical_start_and_the_runs_end():
    """Runs equal over their first steps: a 1e-3 error of one parameter from step 120 is named at 120 without a
    rerun; a series out only over the runs' last steps (fewer than PERSIST after it) is not named."""
    import numpy as np

    from dumpstore.analysis.longrun_culprit import PERSIST, monitor_culprit

    steps, names = 200, [f"layers.{i}.weight" for i in range(4)]
    base = {n: (1.0 + 0.5 * np.sin(np.arange(steps) / (7 + i))).tolist() for i, n in enumerate(names)}

    def run(at=None, n="layers.2.weight"):
        vals = {k: list(v) for k, v in base.items()}
        if at is not None:
            vals[n] = [x * (1 + 1e-3 * (s >= at)) for s, x in enumerate(vals[n])]
        return _monitor(vals, steps)

    ref = run()
    c = monitor_culprit(run(120), ref)
    assert (c["first"]["param"], c["first"]["step"], c["n_differ_from_start"]) == ("layers.2.weight", 120, 0)
    assert monitor_culprit(run(steps - PERSIST + 1), ref)["first"] is None
    assert monitor_culprit(run(steps - PERSIST), ref)["first"]["step"] == steps - PERSIST


@pytest.mark.msprobe
def test_json_contract(monitor_store):
    import json as _json
    from importlib import resources

    import jsonschema

    schema = _json.loads((resources.files("dumpstore") / "schemas" / "curves.json").read_text())
    r = CliRunner().invoke(
        main,
        ["ingest", str(SAMPLES / "ref_stats"), str(SAMPLES / "ln_eps_stats"), "--run", "dref", "--run", "dtgt",
         "--store", str(monitor_store)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    for args in (
        ["--target", "scaled", "--ref", "ref", "--ref2", "ref2", "--dump-target", "dtgt", "--dump-ref", "dref"],
        ["--run", "drift", "--health"],
    ):
        r = CliRunner().invoke(main, ["curves", *args, "--store", str(monitor_store), "--json"])
        assert r.exit_code == 0, r.output
        doc = _json.loads(r.output, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
        jsonschema.validate(doc, schema)
        assert doc["command"] == "curves" and doc["store"] == str(monitor_store)
        if "target" in doc:  # the dump pair's verdict rides along (the samples' layer_norm eps case)
            assert doc["dump_verdict"]["culprit"]["op"] == "Functional.layer_norm.1.forward"


def test_health_on_monitor_data(tmp_path):
    """One parameter's gradient jumps 50x at step 80 and holds NaN from step 90: both named at their steps."""
    steps = 120
    rows = []
    for s in range(steps):
        for i, p in enumerate(["layers.0.weight", "layers.1.weight"]):
            norm = 1.0 + 0.01 * (s % 5)
            nans = 0.0
            if p == "layers.1.weight" and s == 80:
                norm *= 50
            if p == "layers.1.weight" and s >= 90:
                norm, nans = float("nan"), 3.0
            rows.append(
                {"rank": 0, "step": s, "micro_step": None, "vpp_stage": 0, "prefix": "grad_reduced", "name": p,
                 "module": p.rsplit(".", 1)[0], "param": p, "direction": "parameters_grad", "io": "parameters_grad",
                 "seq": i, "norm": norm, "min": -0.1, "max": 0.1, "mean": 0.0, "zeros": 0.0, "nans": nans,
                 "shape": [4, 4], "dtype": "float32", "missing": False}
            )  # fmt: skip
    from dumpstore.longrun.store import MONITOR_SCHEMA

    write(tmp_path / "s", LongRun("m", monitor=pa.Table.from_pylist(rows, MONITOR_SCHEMA)))
    got = {f.check: (f.status, f.step) for f in long_run_health(open_store(tmp_path / "s"), "m").findings}
    assert got["monitor_nan"] == ("fail", 90)
    assert got["monitor_grad_explosion"] == ("warn", 80)


_DUMP_WITH_HANDOFF = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
from msprobe.pytorch import PrecisionDebugger

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), 0.1)
debugger = PrecisionDebugger(config_path=sys.argv[1])
for _ in range(4):
    debugger.start(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    debugger.stop()
    debugger.step()
"""


@pytest.mark.msprobe
def test_handoff_config_dumps_that_module_at_those_steps(tmp_path):
    """The hand-off's config.json, given to msprobe's PrecisionDebugger as is, dumps the culprit's module (and
    what runs inside it) at the two steps, nothing else."""
    import subprocess

    from dumpstore.analysis.longrun_culprit import handoff

    first = {"step": 2, "rank": 0, "module": "layers.2", "name": "layers.2.weight"}
    cfg = handoff(first, distributed=False)["config"]
    assert cfg["step"] == [1, 2] and cfg["rank"] == []
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "train.py").write_text(_DUMP_WITH_HANDOFF)
    proc = subprocess.run(
        [sys.executable, "train.py", "config.json"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    dumps = sorted((tmp_path / "dump_longrun_step2").glob("step*/*/dump.json"))
    assert [d.parent.parent.name for d in dumps] == ["step1", "step2"]
    for d in dumps:
        records = json.loads(d.read_text())["data"]
        assert "Module.layers.2.Linear.forward.0" in records and "Module.layers.2.Linear.parameters_grad.0" in records
        assert all("layers.2." in r or r.startswith("Functional.linear.2.") for r in records), sorted(records)


@pytest.mark.msprobe
def test_culprit_read_a_chunk_at_a_time_is_the_whole_runs_culprit(monitor_store):
    """The store's culprit reads a rank and prefix at a time (store.monitor_chunks): the same answer, every
    field, as monitor_culprit over both runs read whole."""
    from dumpstore.analysis import longrun_culprit
    from dumpstore.analysis.longrun_culprit import _COLUMNS, _stored_culprit, monitor_culprit
    from dumpstore.longrun.store import monitor_chunks, read

    st = open_store(monitor_store)
    chunks = monitor_chunks(st, ["drift", "ref", "ref2"])
    assert len(chunks) > 1 and all(len(k) == 2 and len(c[r]) == 1 for k, c in chunks for r in c)  # a part each
    for target, ref, ref2 in (("drift", "ref", None), ("scaled", "ref", None), ("drift", "ref", "ref2")):
        whole = [read(st, "monitor", r, columns=_COLUMNS) for r in (target, ref)]
        m2 = read(st, "monitor", ref2, columns=_COLUMNS) if ref2 else None
        want = monitor_culprit(*whole, m2, loss_step=61)
        assert want["first"] is not None and _stored_culprit(st, target, ref, ref2, 61) == want
        with pytest.MonkeyPatch.context() as mp:  # each chunk split by name into joins of ~100 target rows
            mp.setattr(longrun_culprit, "_SPLIT_ROWS", 100)
            assert _stored_culprit(st, target, ref, ref2, 61) == want


def test_a_run_that_stops_early_is_said(logs, tmp_path):
    """A target whose losses stop at iteration 1500 of 3000 (a crashed or shorter run) is not 'no divergence':
    the report says where it stops and how far the reference goes on, the other way round too, and names the
    iterations of the common range one run has no loss for (skipped iterations print none)."""
    import jsonschema
    import pyarrow.compute as pc

    ref = logs["ref"]
    short = ref.filter(pc.field("step") <= 1500)
    rep = compare_curves(short, ref, names=("short", "ref", None))
    assert rep.divergence.step is None and rep.coverage is not None
    cov = rep.coverage
    assert cov.note == "target short stops at iteration 1500, the reference ref goes on to 3000"
    assert (cov.target, cov.ref, cov.compared, cov.only_target, cov.only_ref) == (
        [1, 1500],
        [1, 3000],
        [1, 1500],
        0,
        1500,
    )
    band = next(c for c in rep.criteria if c.name == "within_noise_band")
    assert band.value == f"the difference stays inside the band over iteration 1..1500 only ({cov.note})"
    back = compare_curves(ref, short, names=("long", "short", None)).coverage
    assert (
        back is not None and back.note == "the reference short stops at iteration 1500, the target long goes on to 3000"
    )
    skipped = ref.filter(~((pc.field("tag") == "loss") & (pc.field("step") >= 2000) & (pc.field("step") <= 2009)))
    gap = compare_curves(skipped, ref, names=("skip", "ref", None)).coverage
    assert gap is not None and gap.note == "10 iterations of ref within 1..3000 have no target loss"
    same = compare_curves(logs["rerun"], ref, names=("rerun", "ref", None)).coverage
    assert same is not None and same.note is None and same.compared == [1, 3000]

    store = tmp_path / "store"
    for name, table in (("short", short), ("ref", ref), ("rerun", logs["rerun"])):
        write(store, LongRun(name, scalars=table))
    r = CliRunner().invoke(main, ["curves", "--target", "short", "--ref", "ref", "--store", str(store)])
    assert r.exit_code == 0, r.output
    assert (
        "coverage: target short stops at iteration 1500, the reference ref goes on to 3000: compared over "
        "iteration 1..1500 only"
    ) in r.output
    assert "divergence: none over iteration 1..1500, the points both runs have; not compared after them" in r.output
    assert "stays inside the noise band" not in r.output  # no all-clear about iterations 1501..3000
    r = CliRunner().invoke(main, ["curves", "--target", "short", "--ref", "ref", "--store", str(store), "--json"])
    doc = json.loads(r.output)
    jsonschema.validate(doc, json.loads((Path(__file__).parents[1] / "dumpstore/schemas/curves.json").read_text()))
    assert doc["coverage"]["note"] == cov.note and doc["coverage"]["compared"] == [1, 1500]
    r = CliRunner().invoke(main, ["curves", "--target", "rerun", "--ref", "ref", "--store", str(store)])
    assert "divergence: none; the difference stays inside the noise band" in r.output and "coverage" not in r.output


def test_monitor_data_that_stops_early_is_said():
    """The monitor culprit over runs whose monitor data ends at other steps names the steps compared, never an
    all-clear about the steps only one run has."""
    from dumpstore.analysis.longrun_culprit import monitor_culprit
    from dumpstore.cli.longrun_cmds import culprit_lines

    vals = {f"layers.{i}.weight": [1.0 + 0.01 * s for s in range(200)] for i in range(3)}
    ref, short = _monitor(vals, 200), _monitor(vals, 150)
    c = monitor_culprit(short, ref)
    assert c["first"] is None and c["steps"] == {"target": [0, 149], "ref": [0, 199]}
    assert c["steps_note"] == "the target's monitor data stops at step 149, the reference's goes on to 199"
    lines = culprit_lines(c)
    assert "monitor: no module or parameter statistic leaves its band over monitor steps 0..149 only" in lines
    assert "monitor: no module or parameter statistic leaves its band" not in lines
    assert monitor_culprit(ref, short)["steps_note"] == (
        "the reference's monitor data stops at step 149, the target's goes on to 199"
    )
    assert monitor_culprit(ref, ref)["steps_note"] is None


def test_a_spike_is_judged_on_the_loss_scale():
    """A loss trained from 2.3 down to about 1e-4 that reads 2e-3 at one step is 20 x its median and nothing on
    its own scale: no spike (by either rule); a jump back to 2.0 is one. On a loss whose whole scale is 1e-4 the
    same 2e-3 is 20 x the loss's level: a spike."""
    import numpy as np

    from dumpstore.analysis.curves import Series, find_spikes

    rng = np.random.default_rng(0)
    n = 600
    x = np.arange(1, n + 1)
    trained = 2.3 * np.exp(-np.arange(n) / 30) + 1e-4 * (1 + 0.2 * rng.standard_normal(n))
    trained[400], trained[500] = 2e-3, 2.0
    assert [(s.step, s.rule) for s in find_spikes(Series(x, trained), "r")] == [(501, "factor10")]
    tiny = 1e-4 * (1 + 0.2 * rng.standard_normal(n))
    tiny[400] = 2e-3
    assert [(s.step, s.rule, s.value) for s in find_spikes(Series(x, tiny), "r")] == [(401, "factor10", 2e-3)]


def test_monitor_health_in_batches_of_parameters(tmp_path, monkeypatch):
    """The gradient and update-ratio checks taken a few parameters at a time (BATCH_ROWS small) find what they find
    on all parameters at once: a 50x jump of layers.3 at step 70 (and of layers.6 at 90), layers.5 vanishing from
    step 100, layers.2's update ratio drifting up late."""
    from dumpstore.analysis import longrun_health
    from dumpstore.longrun.store import MONITOR_SCHEMA

    steps, params = 150, [f"layers.{i}.weight" for i in range(8)]
    rows = []
    for prefix in ("grad_reduced", "param_origin", "param_updated"):
        for s in range(steps):
            for i, p in enumerate(params):
                norm = 1.0 + 0.01 * ((s + i) % 7)
                if prefix == "grad_reduced":
                    norm *= 50 if (p, s) in (("layers.3.weight", 70), ("layers.6.weight", 90)) else 1
                    norm = 1e-9 if p == "layers.5.weight" and s >= 100 else norm
                elif prefix == "param_updated":
                    norm = 10.0 * (1 + (0.5 if p == "layers.2.weight" and s >= 120 else 1e-3))
                else:
                    norm = 10.0
                rows.append(
                    {"rank": 0, "step": s, "micro_step": None, "vpp_stage": 0, "prefix": prefix, "name": p,
                     "module": p.rsplit(".", 1)[0], "param": p, "direction": "parameters_grad", "io": "parameters_grad",
                     "seq": i, "norm": norm, "min": -0.1, "max": 0.1, "mean": 0.0, "zeros": 0.0, "nans": 0.0,
                     "shape": [4, 4], "dtype": "float32", "missing": False}
                )  # fmt: skip
    write(tmp_path / "s", LongRun("m", monitor=pa.Table.from_pylist(rows, MONITOR_SCHEMA)))
    store = open_store(tmp_path / "s")
    whole = [f for f in long_run_health(store, "m").findings if f.check.startswith(("monitor_grad", "update"))]
    got = {f.check: (f.status, f.step, f.value) for f in whole}
    assert got["monitor_grad_explosion"] == ("warn", 70, pytest.approx(50 * 1.0 + 50 * 0.01 * (73 % 7)))
    assert got["monitor_grad_vanishing"][:2] == ("warn", 100)
    assert got["update_ratio"][:2] == ("warn", 135) and "layers.2.weight" in whole[-1].detail
    assert "2 grad_reduced norms above 10 x" in next(f.detail for f in whole if f.check == "monitor_grad_explosion")
    monkeypatch.setattr(longrun_health, "BATCH_ROWS", 3 * steps)  # 3 parameters a batch
    batched = [f for f in long_run_health(store, "m").findings if f.check.startswith(("monitor_grad", "update"))]
    assert batched == whole

"""Score `dumpstore` long-run features on the held-out long runs of make_runs.py, as a user runs them.

    python validation/longrun/score.py --data validation/longrun/.data [--store DIR] [--json]

Every run is ingested with `dumpstore longrun-ingest` (its log and its TrainerMon folder; the TensorBoard pair from
its event files as runs `<run>_tb`); every case is compared with `dumpstore curves --target T --ref R --json`
and every run is watched with `dumpstore curves --run R --health --json`.

The rule, stated before scoring (key.json's `window_rule`): W = max(20, ceil(5 % of the run's steps)).
- clean pair: right when curves finds no loss divergence, no lr mismatch and names no module (culprit.first null).
- fault: every item the key gives must be found in [expected, expected + W], never before:
  loss     - `divergence.step` against `loss_onset` (the first logged iteration whose loss can differ; not for
             the loss-scale collapse, whose skipped iterations print no loss); where the printed losses of the
             two runs differ on fewer than half the points from `loss_onset` on (the fault moves the loss below
             the log's printed precision), no divergence is right too;
  lr       - `lr_mismatch.step` against `lr_onset` (lr_schedule cases);
  spike    - a spike of the target run against `loss_onset`, the reference having none at that step (spike; the
             reference's own spikes elsewhere are real spikes of its own);
  events   - the target's first loss-scale drop or skipped iteration against `fault_step + 1` (loss_scale_collapse);
  monitor  - `culprit.first.step` (TrainerMon step) against `monitor_onset`;
  module   - where the key names one: culprit.first's module or parameter is that layer or inside it.
- health (`--health` on every run): a reference run has no finding of status `fail`; the spike run has a
  finding naming a spike, the collapse run one naming the loss scale or skipped iterations, in the window.
A command that exits non-zero or prints a traceback is a failure of its case, reported with the command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DUMPSTORE = str(Path(sys.executable).with_name("dumpstore"))


def sh(args: list[str], errors: list[str]) -> tuple[int, str]:
    p = subprocess.run([DUMPSTORE, *args], capture_output=True, text=True)
    if p.returncode or "Traceback" in p.stderr:
        errors.append(f"rc {p.returncode}: dumpstore {' '.join(args)}\n    {p.stderr.strip()[-600:]}")
    return p.returncode, p.stdout


def within(found: int | None, expected: int, w: int) -> bool:
    return found is not None and expected <= found <= expected + w


def in_module(first: dict, module: str) -> bool:
    for k in ("module", "param", "name"):
        v = first.get(k) or ""
        if v == module or v.startswith(module + "."):
            return True
    return False


def ingest(data: Path, store: Path, key: dict, errors: list[str]) -> dict[str, str]:
    runs = sorted({c["target"] for c in key["cases"]} | {c["ref"] for c in key["cases"]})
    fams = key["families"]
    ingested = {}
    for run in runs:
        tb = run.endswith("_tb")
        base = run[:-3] if tb else run
        d = data / base
        fam = fams[base.split("_")[0]]
        args = ["longrun-ingest"]
        args += [str(d / "tb")] if tb else [str(d / "train.log"), str(d / "monitor")]
        args += ["--run", run, "--store", str(store)]
        if fam["log"] == "hf" and not tb:
            args += ["--logging-steps", "1"]
        rc, _ = sh(args, errors)
        ingested[run] = "ok" if rc == 0 else "failed"
    return ingested


def score_case(c: dict, cur: dict | None, health: dict[str, dict | None], shown: dict | None = None) -> dict:
    items: dict[str, dict] = {}
    if cur is None:
        return {"case": c["case"], "ok": False, "items": {"curves": {"ok": False, "found": "no answer"}}}
    div = (cur.get("divergence") or {}).get("step")
    lr = (cur.get("lr_mismatch") or {}).get("step") if cur.get("lr_mismatch") else None
    culprit = cur.get("culprit") or {}
    first = culprit.get("first") if culprit else None
    has_monitor = c["log"] != "tensorboard"
    if c["expect"] == "clean":
        items["loss"] = {"expected": None, "found": div, "ok": div is None}
        items["lr"] = {"expected": None, "found": lr, "ok": lr is None}
        if has_monitor:
            name = None if not first else f"{first.get('prefix')} {first.get('name')} @{first.get('step')}"
            items["monitor"] = {"expected": None, "found": name, "ok": first is None, "present": bool(culprit)}
    else:
        w = c["window"]
        if c["kind"] != "loss_scale_collapse":
            # (a collapsed run skips every step from N + 1 on and, as Megatron does, prints no loss for them)
            items["loss"] = {"expected": c["loss_onset"], "found": div, "ok": within(div, c["loss_onset"], w)}
            if shown and shown.get("n") and shown.get("n_diff", 0) < 0.5 * (shown["n"] - c["loss_onset"] + 1):
                # the fault moves the loss below the log's printed precision: the printed losses differ on fewer
                # than half the points after the onset, so no reader of the log can be held to it; quiet is right
                items["loss"].update(
                    expected=f"{c['loss_onset']} or none (printed: {shown['n_diff']} points differ)",
                    ok=div is None or within(div, c["loss_onset"], w),
                )
        if c["kind"] == "lr_schedule":
            items["lr"] = {"expected": c["lr_onset"], "found": lr, "ok": within(lr, c["lr_onset"], w)}
        if c["kind"] == "spike":
            mine = [s["step"] for s in cur.get("spikes", []) if s["run"] == c["target"]]
            ref = [s["step"] for s in cur.get("spikes", []) if s["run"] == c["ref"]]
            hit = [s for s in mine if within(s, c["loss_onset"], w)]
            ref_hit = [s for s in ref if hit and s == min(hit)]
            items["spike"] = {
                "expected": c["loss_onset"],
                "found": (min(hit) if hit else (mine[:5] or None)),
                "ok": bool(hit) and not ref_hit,
            }
        if c["kind"] == "loss_scale_collapse":
            ev = [
                min(e["steps"])
                for e in cur.get("events", [])
                if e["run"] == c["target"] and e["kind"] in ("loss_scale_drop", "skipped_iterations") and e["steps"]
            ]
            f = min(ev) if ev else None
            items["events"] = {"expected": c["fault_step"] + 1, "found": f, "ok": within(f, c["fault_step"] + 1, w)}
        if has_monitor:
            ms = first.get("step") if first else None
            items["monitor"] = {
                "expected": c["monitor_onset"],
                "found": None if not first else f"{first.get('prefix')} {first.get('name')} @{ms}",
                "ok": within(ms, c["monitor_onset"], w),
                "present": bool(culprit),
            }
            if c.get("module"):
                items["module"] = {
                    "expected": c["module"],
                    "found": None if not first else (first.get("param") or first.get("module") or first.get("name")),
                    "ok": bool(first) and in_module(first, c["module"]),
                }
    # health of the target run where the key says what it should show
    h = health.get(c["target"])
    if c.get("kind") in ("spike", "loss_scale_collapse"):
        words = ("spike",) if c["kind"] == "spike" else ("scale", "skipped")
        exp = c["loss_onset"] if c["kind"] == "spike" else c["fault_step"] + 1
        hits = [
            f
            for f in (h or {}).get("findings", [])
            if f["status"] != "ok"
            and any(wd in (f["check"] + " " + f["detail"]).lower() for wd in words)
            and (f["step"] is None or within(f["step"], exp, c["window"]))
        ]
        items["health"] = {
            "expected": f"{'/'.join(words)} @{exp}",
            "found": [f"{f['check']}@{f['step']}" for f in hits] or None,
            "ok": bool(hits),
        }
    return {"case": c["case"], "kind": c["kind"], "ok": all(i["ok"] for i in items.values()), "items": items}


def printed(c: dict, store: Path, errors: list[str]) -> dict:
    """A fact of the data, not of the tool: where the two runs' logged losses first differ as printed (the logs
    round: Megatron 7 significant digits, HF Trainer 4 decimals, MindFormers 3), and on how many points."""
    sql = (
        "select min(t.step) filter (where t.value <> r.value) as first_diff, "
        "count(*) filter (where t.value <> r.value) as n_diff, count(*) as n "
        "from scalars t join scalars r on t.step = r.step and t.tag = r.tag and t.rank = r.rank "
        f"where t.run = '{c['target']}' and r.run = '{c['ref']}' and t.tag = 'loss'"
    )
    rc, out = sh(["query", sql, "--json", "--store", str(store)], errors)
    return json.loads(out)[0] if rc == 0 and out.strip() else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(__file__).parent / ".data")
    ap.add_argument("--store", type=Path, help="store folder (default: a temporary one, removed after)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    key = json.loads((a.data / "key.json").read_text())
    frozen = json.loads((Path(__file__).with_name("key.json")).read_text())
    if key != frozen:
        sys.exit(f"{a.data / 'key.json'} is not the committed key validation/longrun/key.json: remake the runs")
    store = a.store or Path(tempfile.mkdtemp(prefix="h26val_store_"))
    errors: list[str] = []
    try:
        ingest(a.data, store, key, errors)
        runs = sorted({c["target"] for c in key["cases"]} | {c["ref"] for c in key["cases"]})
        health: dict[str, dict | None] = {}
        for run in runs:
            rc, out = sh(["curves", "--run", run, "--health", "--json", "--store", str(store)], errors)
            health[run] = json.loads(out) if rc == 0 and out.strip() else None
        results = []
        for c in key["cases"]:
            rc, out = sh(
                ["curves", "--target", c["target"], "--ref", c["ref"], "--json", "--store", str(store)], errors
            )
            cur = json.loads(out) if rc == 0 and out.strip() else None
            shown = printed(c, store, errors)
            res = score_case(c, cur, health, shown)
            res["printed"] = shown
            results.append(res)
        refs = sorted({c["ref"] for c in key["cases"]})
        ref_health = []
        for r in refs:
            fails = [
                f"{f['check']}@{f['step']}" for f in (health.get(r) or {}).get("findings", []) if f["status"] == "fail"
            ]
            ref_health.append({"run": r, "ok": health.get(r) is not None and not fails, "fails": fails})
    finally:
        if a.store is None:
            shutil.rmtree(store, ignore_errors=True)
    n_ok = sum(r["ok"] for r in results)
    summary = {
        "cases": len(results),
        "right": n_ok,
        "clean_quiet": f"{sum(r['ok'] for r in results if r['kind'] == 'clean')}/"
        f"{sum(r['kind'] == 'clean' for r in results)}",
        "ref_health_quiet": f"{sum(r['ok'] for r in ref_health)}/{len(ref_health)}",
        "errors": len(errors),
    }
    if a.json:
        print(
            json.dumps(
                {
                    "window_rule": key["window_rule"],
                    "summary": summary,
                    "cases": results,
                    "ref_health": ref_health,
                    "errors": errors,
                },
                indent=1,
            )
        )
    else:
        print(f"window rule: {key['window_rule']}")
        print(f"{'case':<22} {'kind':<20} {'item':<8} {'expected':<36} {'found':<52} ok")
        for r in results:
            for i, (name, it) in enumerate(r["items"].items()):
                head = f"{r['case']:<22} {r['kind']:<20}" if i == 0 else " " * 43
                print(
                    f"{head} {name:<8} {str(it.get('expected')):<36} {str(it.get('found'))[:52]:<52} "
                    f"{'yes' if it['ok'] else 'NO'}"
                )
            pr = r.get("printed") or {}
            if "loss" in r["items"] and pr:
                print(
                    f"{'':43} (printed losses first differ at {pr.get('first_diff')}, "
                    f"on {pr.get('n_diff')} of {pr.get('n')} points)"
                )
        for r in ref_health:
            print(f"health {r['run']}: {'quiet' if r['ok'] else 'fails: ' + ', '.join(r['fails'])}")
        for e in errors:
            print("ERROR", e)
        print(
            f"right: {n_ok}/{len(results)} cases; clean pairs quiet {summary['clean_quiet']}; "
            f"references' health quiet {summary['ref_health_quiet']}; {len(errors)} command errors"
        )
    return 0 if n_ok == len(results) and not errors else 1


if __name__ == "__main__":
    sys.exit(main())

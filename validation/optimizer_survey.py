"""The update-differs rule's measures on every clean pair and optimizer fault of some data sets, at every later
step (docs/how-it-decides.md, section 5, *update differs*): how many parameters are beyond what their gradients,
the disagreement carried in and rounding explain, and the median x (the runs' updates apart, in updates); and
the rules that judge a later update against the update before it (analysis/updates.py `ratio_shift`,
`decay_shift`): their measures with `margin` (the shift over its bar) and `differs`; and the replay rule's
(`replay_measures`: where every parameter and gradient agreed before the update, how many differ after it, and
the chance of that at the update before's rate); and the parameters' median x over their explanation
(`steps.over_explanation`, ` oe` in the summary line: analysis/updates.py `updates_differ`'s measure at a later
update).

    .venv/bin/python validation/optimizer_survey.py --out OUT.jsonl [--work DIR] DATA ...

Each DATA is a folder with a ``key.json`` (validation/score.py's sets) or a ``catalog.json`` (sample_dumps/, the
dev-extra pairs). Each pair is ingested into ``--work`` (git-ignored scratch, kept between runs) and compared;
one JSON line per pair is appended to OUT (pairs already there are skipped), one summary line printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl

from dumpstore import open_store
from dumpstore.analysis import compare_runs
from dumpstore.analysis import culprit as C
from dumpstore.analysis import steps as ST
from dumpstore.analysis._divergence import _ordered, _record_table
from dumpstore.analysis.order import INPUT_IO
from dumpstore.analysis.updates import decay_shift_measures, ratio_shift_measures, replay_measures

DUMPSTORE = Path(sys.executable).parent / "dumpstore"


def pairs(data: Path) -> list[tuple[str, Path, Path, str]]:
    """(name, reference, target, "clean" or "optimizer") of every clean pair and optimizer fault in `data`."""
    out = []
    if (data / "key.json").exists():
        for name, c in json.loads((data / "key.json").read_text())["cases"].items():
            e = c["expect"]
            if e.get("clean") or e.get("optimizer"):
                out.append((name, data / c["ref"], data / c["target"], "clean" if e.get("clean") else "optimizer"))
        return out
    cat = json.loads((data / "catalog.json").read_text())
    for c in cat.get("cases", []) + cat.get("device_noise_cases", []):
        culprit = (c.get("expected") or {}).get("culprit")
        if c.get("ref") and (culprit is None or culprit.get("kind") == "optimizer"):
            out.append((c["name"], data / c["ref"], data / c["path"], "clean" if culprit is None else "optimizer"))
    return out


def by_statistic(rows: pl.DataFrame, before: int, step: int) -> dict[str, dict]:
    """Per statistic (mean, max, min, norm) of the parameters (`parameters` leaves): each run's change between
    the steps, target over reference; how many are tied (exactly 1: bf16 statistics rounded to the same step),
    and of the others the median and the standard error of the log median (1.2533 x 1.4826 MAD / sqrt(n))."""
    keys = ["rank", "source", "_record", "_io", "index_path"]
    stats = ["mean", "max", "min", "norm"]
    cols = keys + stats + [f"ref_{s}" for s in stats]
    p = rows.filter(pl.col("_io") == "parameters")
    both = (
        p.filter(pl.col("step") == step)
        .select(cols)
        .join(p.filter(pl.col("step") == before).select(cols), on=keys, suffix="_b")
    )
    out = {}
    for s in stats:
        t = (both[s] - both[f"{s}_b"]).cast(pl.Float64).to_numpy()
        r = (both[f"ref_{s}"] - both[f"ref_{s}_b"]).cast(pl.Float64).to_numpy()
        with np.errstate(all="ignore"):
            ratio = t / r
        ratio = ratio[np.isfinite(ratio) & (r != 0)]
        moved = ratio[ratio != 1]
        logs = np.log(np.maximum(moved, 1e-12))
        se = (
            1.2533 * 1.4826 * float(np.median(np.abs(logs - np.median(logs)))) / np.sqrt(moved.size)
            if moved.size
            else None
        )
        out[s] = {
            "n": int(ratio.size),
            "tied": int((ratio == 1).sum()),
            "median_untied": float(np.median(moved)) if moved.size else None,
            "se_log": se,
        }
    return out


def measure(store_dir: Path) -> list[dict]:
    """Per later step: parameters measured, the share beyond their explanation, the median x; per statistic, the
    update ratios (`by_statistic`)."""
    cmp = compare_runs(open_store(store_dir), "target", "ref")
    rows = _ordered(cmp.rows, cmp.records)
    steps = sorted(set(_record_table(rows)["step"].to_list()))
    out = []
    for before, step in zip(steps, steps[1:]):
        view = C._StepView(rows, step)
        w = view.rows.filter(
            pl.col("_io").is_in(INPUT_IO)
            & (pl.col("kind") == "tensor")
            & (pl.col("requires_grad").fill_null(False) | (pl.col("_io") == "parameters"))
        )
        produced = view.producers("")
        fresh = [produced.producer_of(fp, seq) is None for fp, seq in w.select("_fp_t", "seq").iter_rows()]
        params = w.filter(pl.Series(fresh, dtype=pl.Boolean))
        t = ST.table(rows, before, step, params) if params.height else None
        if t is None:
            continue
        x = t["x"].fill_null(np.nan).to_numpy()
        ok = np.isfinite(x)
        if ok.sum():
            beyond = ST._beyond(t)[ok]
            over = int(w.filter(pl.col("status") == "diverged").height)
            distinct = ST.parameters_of(params)
            shift = ratio_shift_measures(rows, before, step, distinct, ST.gradient_error(rows, before))
            decay = decay_shift_measures(rows, before, step, params)
            replay = replay_measures(rows, before, step, distinct)
            out.append({"step": step, "n": int(ok.sum()), "beyond": float(beyond.mean()),
                        "median_x": float(np.median(x[ok])), "over_explanation": ST.over_explanation(t), "over": over,
                        "by_statistic": by_statistic(rows, before, step),
                        "ratio_shift": shift, "decay_shift": decay, "replay": replay})  # fmt: skip
    return out


def _margins(d: dict) -> str:
    """` oe E replay K/N pP ratio M1 decay M2`: the median x over its explanation, the replay rule's count and
    chance, and the later-update rules' margins (shift over bar), where they measure."""
    out = f" oe {d['over_explanation']:.3g}" if d.get("over_explanation") is not None else ""
    r = d.get("replay")
    if r is not None:
        out += f" replay {r['differing']}/{r['updated']} p{r['p']:.2g}{'!' if r['differs'] else ''}"
    for rule in ("ratio", "decay"):
        m = d.get(f"{rule}_shift")
        if m is not None:
            out += f" {rule} {m['margin']:.3g}{'!' if m['differs'] else ''}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / ".survey")
    args = ap.parse_args(argv)
    done = {json.loads(line)["name"] for line in args.out.read_text().splitlines()} if args.out.exists() else set()
    for data in args.data:
        for name, ref, target, kind in pairs(data):
            key = f"{data.name}/{name}"
            if key in done:
                continue
            store = args.work / data.name / name
            if not (store / ".ingested").exists():
                cmd = [str(DUMPSTORE), "ingest", str(ref), str(target), "--run", "ref", "--run", "target"]
                subprocess.run([*cmd, "--store", str(store)], check=True, capture_output=True)
                (store / ".ingested").touch()
            res = measure(store)
            with args.out.open("a") as f:
                f.write(json.dumps({"name": key, "kind": kind, "steps": res}) + "\n")
            print(key, kind, " ".join(f"s{d['step']}:{d['beyond']:.2f}/{d['median_x']:.3g}{_margins(d)}" for d in res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

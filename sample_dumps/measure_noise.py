#!/usr/bin/env python
"""Run today's `dumpstore divergence` over every cross-device noise pair and score it against the catalog.

Usage::

    /path/to/venv/bin/python sample_dumps/measure_noise.py [--store DIR] [--exact] [--json]
    /path/to/venv/bin/python sample_dumps/measure_noise.py --spread     # the noise itself, tensor pairs
    /path/to/venv/bin/python sample_dumps/measure_noise.py --dev-extra  # also the pairs of dev_extra.py

Reads `device_noise_cases` of sample_dumps/catalog.json, ingests every case into a store (a temporary one
unless --store names one; cases already there are re-ingested), runs `dumpstore divergence --json` (the CLI,
as a user would) for each pair, and prints one line per pair:

    pair  mode  expected culprit  got culprit  outcome

outcome is `hit` (culprit at the expected step and op, an optimizer fault at its step wherever it is placed;
`hit, kind X` when the kind differs), `miss` (a fault
pair whose culprit is elsewhere or absent), `false alarm` (a clean pair with a culprit) or `quiet` (a clean
pair without one).  The totals line counts hits of faults and false alarms of clean pairs.

`--dev-extra [DIR]` adds the extra development pairs that sample_dumps/dev_extra.py wrote (default
sample_dumps/dev_extra/, git-ignored: run dev_extra.py first); `--only dev` scores those alone.

`--compare-top N` also runs `dumpstore compare --step S` for each fault pair and gives the rank of the first row of
the expected culprit record (an optimizer fault: the record the verdict placed it at) and whether it is among the
first N (`in_top`); for a clean pair, the row that tops `compare` and its significance (validation/compare_top.py,
shared with validation/score.py).

`--spread` instead reads the tensor pairs' `.pt` files (needs torch) and prints, per step, the spread of the
relative L2 error ||t - r|| / ||r|| over all floating-point tensors of all records (median, p90, p99, how many
exceed 2^-6, the bf16 tolerance) and the largest few.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, path):
    """A module by its path (validation/ is not put on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


COMPARE_TOP = _load("validation_compare_top", os.path.join(os.path.dirname(HERE), "validation", "compare_top.py"))
DUMPSTORE = [os.path.join(os.path.dirname(sys.executable), "dumpstore")]  # the venv's console script


def cli(*args):
    """Run one dumpstore command; its stdout, or a one-line error naming the command."""
    res = subprocess.run(DUMPSTORE + list(args), capture_output=True, text=True)
    if res.returncode not in (0, 3):
        raise SystemExit("dumpstore %s failed (rc %d): %s" % (args[0], res.returncode, res.stderr.strip()[-500:]))
    return res.stdout


def where(c):
    if not c:
        return "-"
    return "%s@%d %s" % (c["kind"], c["step"], c["op"])


KIND = {"missing_or_extra": {"ref": "missing_op", "target": "extra_op"}}


def expected_kind(c):
    return KIND[c["kind"]][c["side"]] if c["kind"] in KIND else c["kind"]


def placed(exp, got):
    """The record a fault is judged at: the catalog's, except that an optimizer fault is an update, not a record:
    it is found at its step and rank with kind `optimizer` wherever the verdict placed it (as validation/score.py
    judges it), and that placement is the record `--compare-top` looks for."""
    if exp.get("kind") == "optimizer" and got and got["kind"] == "optimizer":
        return got["op"]
    return exp["op"]


def outcome(exp, got):
    if exp is None:
        return "false alarm" if got else "quiet"
    if not got or (got["step"], got["rank"], got["op"]) != (exp["step"], exp["rank"], placed(exp, got)):
        return "miss"
    return "hit" if got["kind"] == expected_kind(exp) else "hit, kind %s" % got["kind"]


def measure(store, cases, exact, compare_top=0):
    ingested = set()
    rows = []
    for case in cases:
        for name in (case["ref"], case["name"]):
            if name not in ingested:
                path = os.path.join(case.get("base", HERE), name)
                cli("ingest", path, "--run", name, "--store", store, "--jobs", "1")
                ingested.add(name)
        args = [
            "divergence",
            "--target",
            case["name"],
            "--ref",
            case["ref"],
            "--store",
            store,
            "--json",
            "--no-cache",
        ] + (["--exact"] if exact else [])
        verdict = json.loads(cli(*args))
        exp, got = case["expected"]["culprit"], verdict.get("culprit")
        top = None
        if compare_top:  # where compare ranks the expected culprit in its step (a clean pair: what tops the list)
            top = (
                COMPARE_TOP.clean_top(store, case["name"], case["ref"], compare_top)
                if exp is None
                else COMPARE_TOP.fault_top(
                    store, case["name"], case["ref"], exp["step"], [placed(exp, got)], compare_top
                )
            )
        rows.append(
            {
                "pair": case["name"],
                "mode": case["mode"],
                "expected": where(exp),
                "got": where(got),
                "outcome": outcome(exp, got),
                "got_detail": got,
                "in_top": COMPARE_TOP.cell(top),
                "compare_top": top,
            }
        )
    return rows


def table(rows, compare_top=0):
    cols = ("pair", "mode", "expected", "got", "outcome") + (("in_top",) if compare_top else ())
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = [" | ".join(c.ljust(width[c]) for c in cols), "-|-".join("-" * width[c] for c in cols)]
    lines += [" | ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    faults = [r for r in rows if r["expected"] != "-"]
    clean = [r for r in rows if r["expected"] == "-"]
    lines.append(
        "faults found (step and op): %d of %d; false alarms on clean pairs: %d of %d"
        % (
            sum(r["outcome"].startswith("hit") for r in faults),
            len(faults),
            sum(r["outcome"] == "false alarm" for r in clean),
            len(clean),
        )
    )
    if compare_top:
        lines.append(COMPARE_TOP.summary([r["compare_top"] for r in rows], compare_top))
    return "\n".join(lines)


def _pt_leaves(obj, path=()):
    if isinstance(obj, dict) and "data_name" in obj:
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _pt_leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _pt_leaves(v, path + (i,))


def rel_errors(case, ref, step):
    """(rel L2, tensor name, ref norm) of every floating-point tensor of one step of a tensor pair."""
    import torch

    def load(c, leaf):
        return torch.load(
            os.path.join(HERE, c, "step%d" % step, "rank0", "dump_tensor_data", leaf["data_name"]), weights_only=True
        )

    def data(c):
        with open(os.path.join(HERE, c, "step%d" % step, "rank0", "dump.json")) as f:
            return json.load(f)["data"]

    out, rdata = [], data(ref)
    for key, rec in data(case).items():
        for (path, leaf), (_, rleaf) in zip(_pt_leaves(rec), _pt_leaves(rdata[key])):
            t, r = load(case, leaf), load(ref, rleaf)
            if not t.is_floating_point():
                continue
            t, r = t.double(), r.double()
            fin = r.isfinite()
            if not torch.equal(fin, t.isfinite()) or not torch.equal(t[~fin], r[~fin]):
                out.append((math.inf, key + "." + ".".join(map(str, path)), math.nan))  # non-finite values differ
                continue
            n, d = r[fin].norm().item(), (t[fin] - r[fin]).norm().item()  # the finite part (masked -inf aside)
            out.append((d / n if n else (math.inf if d else 0.0), key + "." + ".".join(map(str, path)), n))
    return sorted(out)


def quantile(sorted_values, f):
    return sorted_values[min(len(sorted_values) - 1, int(f * len(sorted_values)))]


def _stat_leaves(obj, path=()):
    if isinstance(obj, dict) and obj.get("type") == "torch.Tensor":
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _stat_leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _stat_leaves(v, path + (i,))


def norm_errors(case, ref, step):
    """(|Norm_t - Norm_r| / Norm_r, tensor name, Norm_r) of every float tensor of one step of a statistics pair."""

    def data(c):
        with open(os.path.join(HERE, c, "step%d" % step, "rank0", "dump.json")) as f:
            return json.load(f)["data"]

    out, rdata = [], data(ref)
    for key, rec in data(case).items():
        for (path, leaf), (_, rleaf) in zip(_stat_leaves(rec), _stat_leaves(rdata.get(key, {}))):
            t, r = leaf.get("Norm"), rleaf.get("Norm")
            finite = all(isinstance(x, float) and math.isfinite(x) for x in (t, r))
            if "float" in leaf.get("dtype", "") and finite:
                out.append((abs(t - r) / r if r else (math.inf if t else 0.0), key + "." + ".".join(map(str, path)), r))
    return sorted(out)


def spread(cases, top=3):
    """The pairs' own noise: rel L2 of the tensor pairs, relative Norm difference of the clean statistics pairs."""
    lines = []
    for case in (c for c in cases if c["mode"] == "statistics" and c["expected"]["culprit"] is None):
        for step in case["steps"]:
            errs = norm_errors(case["name"], case["ref"], step)
            v = [e[0] for e in errs]
            q50, q90, q99 = (quantile(v, f) for f in (0.5, 0.9, 0.99))
            lines.append(
                "%s step %d: |dNorm|/Norm of %d tensors, median %.2e, p90 %.2e, p99 %.2e, > 2^-6: %d"
                % (case["name"], step, len(v), q50, q90, q99, sum(x > 2**-6 for x in v))
            )
            lines += ["    %.3g  %s  (ref norm %.3g)" % e for e in errs[-top:]]
    for case in (c for c in cases if c["mode"] == "tensor"):
        for step in case["steps"]:
            errs = rel_errors(case["name"], case["ref"], step)
            v = [e[0] for e in errs]
            q50, q90, q99 = (quantile(v, f) for f in (0.5, 0.9, 0.99))
            lines.append(
                "%s step %d: %d tensors, median %.2e, p90 %.2e, p99 %.2e, > 2^-6: %d"
                % (case["name"], step, len(v), q50, q90, q99, sum(x > 2**-6 for x in v))
            )
            lines += ["    %.3g  %s  (ref norm %.3g)" % e for e in errs[-top:]]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="store folder (default: a temporary one)")
    ap.add_argument("--exact", action="store_true", help="pass --exact to divergence (tensor pairs)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--spread", action="store_true", help="print the noise of the tensor pairs instead")
    ap.add_argument(
        "--dev-extra",
        nargs="?",
        const=os.path.join(HERE, "dev_extra"),
        help="also score the pairs dev_extra.py wrote (default folder sample_dumps/dev_extra)",
    )
    ap.add_argument("--only", choices=("samples", "dev"), help="score only the xdev samples or only the extra pairs")
    ap.add_argument("--mode", choices=("statistics", "tensor"), help="only pairs of this dump mode")
    ap.add_argument(
        "--compare-top", type=int, default=0, metavar="N", help="also check the culprit is in compare's top N rows"
    )
    args = ap.parse_args()
    cases = []
    if args.only != "dev":
        with open(os.path.join(HERE, "catalog.json")) as f:
            cases += [c for c in json.load(f)["device_noise_cases"] if c["ref"]]
    if args.dev_extra or args.only == "dev":
        base = args.dev_extra or os.path.join(HERE, "dev_extra")
        with open(os.path.join(base, "catalog.json")) as f:
            cases += [dict(c, base=base) for c in json.load(f)["device_noise_cases"] if c["ref"]]
    if args.mode:
        cases = [c for c in cases if c["mode"] == args.mode]
    if args.spread:
        print(spread(cases))
        return
    with tempfile.TemporaryDirectory(prefix="noise_store_") as tmp:
        rows = measure(args.store or tmp, cases, args.exact, args.compare_top)
    print(json.dumps(rows, indent=1) if args.json else table(rows, args.compare_top))


if __name__ == "__main__":
    main()

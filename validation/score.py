"""Score dumpstore's verdict on the held-out validation pairs made by ``validation/make_pairs.py``.

    .venv/bin/python validation/score.py [--data validation/.data] [--jobs 2] [--msprobe] [--compare-top N]
        [--json OUT]

Each pair goes into its own store (``dumpstore ingest REF TARGET --run ref --run target``), then
``dumpstore divergence --target target --ref ref --json``; clean pairs also get ``dumpstore overflow --run target
--ref ref --json`` and ``dumpstore overflow --run ref --json``. dumpstore is used through its CLI only.

What counts (the key is ``<data>/key.json``):

* a **clean** pair is quiet when ``culprit`` is null; its overflow checks are quiet when ``first_overflow`` is null;
* a **fault** is found when the culprit's ``step`` equals the key's step and
  - for an optimizer fault (learning rate, gradient clipping), the culprit's ``kind`` is ``optimizer`` (the step
    is the first step whose parameters the changed update touched);
  - otherwise the culprit's ``op`` is one of the key's ops: the msprobe record of the faulty call, read from
    msprobe while the call ran (in the target and, where the reference makes the same call, in the reference);
    for a corrupted parameter, the first op that consumes it at that step; for a missing op, the reference's
    record or the target's op that consumes what it should have produced; for changed data, the embedding;
    or the key's ``modules``: the record of a module whose forward made exactly one API record, one of those
    ops (``Module.model.layers.1.mlp.act_fn.SiLUActivation.forward.0`` for the ``Functional.gelu.0.forward`` it
    made): msprobe's two names of the same computation.
  The culprit's ``kind`` is shown, not judged.

``--compare-top N`` adds, per fault pair, the rank of the key's record (any of its ops or modules; an optimizer
fault: the record the verdict placed it at) among ``dumpstore compare --step S`` of the key's step and whether it
is in the first N; per clean pair, the row that tops ``dumpstore compare`` and its significance (a clean pair
whose list opens at 1e3 looks like a fault); a summary per mode (validation/compare_top.py, shared with
sample_dumps/measure_noise.py).

``--msprobe`` adds baseline columns for tensor pairs: ``msprobe compare`` of each step, and its first API row
(steps in order, rows in msprobe's order, ``Module.`` rows skipped) whose ``Result`` is ``error`` (a second
column: ``error`` or ``warning``), judged by the same rule (msprobe has no notion
of an optimizer update: an optimizer fault never counts as found by it).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    """A module of this folder by its path (validation/ is not put on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


compare_top = _load("validation_compare_top", HERE / "compare_top.py")


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _msprobe() -> list[str]:
    """msprobe's console script beside this Python, else on PATH, else its entry point through this Python."""
    found = _bin("msprobe")
    if Path(found).is_file():
        return [found]
    return [
        sys.executable,
        "-c",
        "import sys; from msprobe.msprobe import main; sys.argv[0] = 'msprobe'; sys.exit(main())",
    ]


def _cli(args: list[str]) -> dict:
    proc = subprocess.run([_bin("dumpstore"), *args], capture_output=True, text=True)
    if proc.returncode not in (0, 3):
        raise RuntimeError("dumpstore %s: exit %d: %s" % (" ".join(args), proc.returncode, proc.stderr.strip()[-500:]))
    return json.loads(proc.stdout) if "--json" in args else {}


def judge(expect: dict, culprit: dict | None) -> bool:
    if expect.get("clean"):
        return culprit is None
    if culprit is None or culprit.get("step") != expect["step"]:
        return False
    if expect.get("optimizer"):
        return culprit.get("kind") == "optimizer"
    return culprit.get("op") in expect["ops"] or culprit.get("op") in expect.get("modules", [])


def describe(culprit: dict | None) -> str:
    if culprit is None:
        return "none"
    return "%s step %s %s" % (culprit.get("kind"), culprit.get("step"), culprit.get("op"))


def expected_text(expect: dict) -> str:
    if expect.get("clean"):
        return "none"
    if expect.get("optimizer"):
        return "optimizer step %d" % expect["step"]
    return "step %d %s" % (expect["step"], " | ".join(expect["ops"]))


def key_records(expect: dict, culprit: dict | None) -> list[str]:
    """The records a fault is found at (`judge`): the key's ops and modules; an optimizer fault is an update, not
    a record: the record the verdict placed it at when it found it (else none to look for)."""
    if expect.get("optimizer"):
        found = culprit and culprit.get("kind") == "optimizer" and culprit.get("step") == expect["step"]
        return [culprit["op"]] if found and culprit else []
    return list(expect["ops"]) + list(expect.get("modules", []))


def score_case(name: str, case: dict, data: Path, work: Path, with_msprobe: bool, top_n: int = 0) -> dict:
    """One pair's row; a dumpstore command that fails (exit code other than 0 or 3, output that is not JSON)
    makes a row that is not ok, with the error as what dumpstore said, instead of stopping the whole run."""
    try:
        return _score_case(name, case, data, work, with_msprobe, top_n)
    except (RuntimeError, ValueError) as exc:
        shutil.rmtree(work / name, ignore_errors=True)
        clean = bool(case["expect"].get("clean"))
        row = {
            "name": name,
            "case": case["case"],
            "mode": case["mode"],
            "family": case["family"],
            "clean": clean,
            "expected": expected_text(case["expect"]),
            "got": "error: %s" % str(exc)[:200],
            "ok": False,
            "culprit": None,
            "error": str(exc),
        }
        if clean:
            row["overflow_target"] = row["overflow_ref"] = {"kind": "error", "step": None, "op": None}
        return row


def _score_case(name: str, case: dict, data: Path, work: Path, with_msprobe: bool, top_n: int = 0) -> dict:
    store = work / name
    shutil.rmtree(store, ignore_errors=True)
    t0 = time.time()
    _cli(
        [
            "ingest",
            str(data / case["ref"]),
            str(data / case["target"]),
            "--run",
            "ref",
            "--run",
            "target",
            "--store",
            str(store),
        ]
    )
    t_ingest = time.time() - t0
    verdict = _cli(["divergence", "--target", "target", "--ref", "ref", "--store", str(store), "--json"])
    culprit = verdict.get("culprit")
    row = {
        "name": name,
        "case": case["case"],
        "mode": case["mode"],
        "family": case["family"],
        "clean": bool(case["expect"].get("clean")),
        "expected": expected_text(case["expect"]),
        "got": describe(culprit),
        "ok": judge(case["expect"], culprit),
        "culprit": culprit,
        "seconds": round(time.time() - t0, 2),
        "ingest_seconds": round(t_ingest, 2),
    }
    if row["clean"]:
        ov_t = _cli(["overflow", "--run", "target", "--ref", "ref", "--store", str(store), "--json"])
        ov_r = _cli(["overflow", "--run", "ref", "--store", str(store), "--json"])
        row["overflow_target"] = ov_t.get("first_overflow")
        row["overflow_ref"] = ov_r.get("first_overflow")
    if with_msprobe and case["mode"] == "tensor":
        firsts = msprobe_first(data / case["ref"], data / case["target"], work / (name + "_msprobe"))
        row["msprobe"], row["msprobe_warning"] = firsts["error"], firsts["warning"]
        row["msprobe_ok"] = judge_msprobe(case["expect"], row["msprobe"])
        row["msprobe_warning_ok"] = judge_msprobe(case["expect"], row["msprobe_warning"])
    if top_n:  # where compare ranks the culprit (a clean pair: what tops its list)
        expect, s = case["expect"], str(store)
        row["compare_top"] = (
            compare_top.clean_top(s, "target", "ref", top_n)
            if row["clean"]
            else compare_top.fault_top(s, "target", "ref", expect["step"], key_records(expect, culprit), top_n)
        )
    shutil.rmtree(store, ignore_errors=True)
    return row


# ------------------------------------------------------------------------------------------------------------
# msprobe compare baseline (tensor pairs)
# ------------------------------------------------------------------------------------------------------------
def msprobe_first(ref: Path, target: Path, out: Path) -> dict:
    """Run ``msprobe compare -tp TARGET/stepN -gp REF/stepN`` step by step; for each flag set (``error``;
    ``warning`` = error or warning) the first row (steps in order, rows in msprobe's order) of an API (not a
    ``Module.`` row, which sums up a block) whose ``Result`` is flagged: ``{step, op, name, result}`` (op: the
    record name, ``.input.N`` / ``.output.N`` / ``.parameters...`` cut off), or None when no row is."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    flags = {"error": {"error"}, "warning": {"error", "warning"}}
    first: dict = dict.fromkeys(flags)
    steps = sorted(int(p.name[4:]) for p in target.glob("step*") if p.name[4:].isdigit())
    for step in steps:
        if all(v is not None for v in first.values()):
            break
        odir = out / ("step%d" % step)
        cmd = [
            *_msprobe(),
            "compare",
            "-tp",
            str(target / ("step%d" % step)),
            "-gp",
            str(ref / ("step%d" % step)),
            "-o",
            str(odir),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
        files = sorted(odir.glob("compare_result_*.csv"))
        if proc.returncode != 0 or not files:
            failed = {"step": step, "op": None, "name": None, "result": "compare failed: %s" % proc.stderr[-200:]}
            return {k: v if v is not None else failed for k, v in first.items()}
        for r in _rows(files[0]):
            result = (r.get("Result") or "").strip()
            nm = r.get("NPU Name") or ""
            for key, flagged in flags.items():
                if first[key] is None and result.lower() in flagged and not nm.startswith("Module."):
                    first[key] = {"step": step, "op": _record(nm), "name": nm, "result": result}
    return first


def _rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _record(name: str) -> str:
    """msprobe's row name cut to its record: ``Functional.linear.3.forward.input.0`` -> ``Functional.linear.3.forward``,
    ``Module.m.Linear.forward.0.parameters.weight`` -> ``Module.m.Linear.forward.0``."""
    m = re.match(r"^(.*?\.(?:forward|backward)(?:\.\d+)?)(?:\.|$)", name)
    return m.group(1) if m else name


def judge_msprobe(expect: dict, first: dict | None) -> bool:
    if expect.get("clean"):
        return first is None
    if first is None or first.get("step") != expect["step"]:
        return False
    if expect.get("optimizer"):
        return False  # msprobe compare has no notion of an update: never counted as found
    return first.get("op") in expect["ops"] or first.get("op") in expect.get("modules", [])


# ------------------------------------------------------------------------------------------------------------
def table(rows: list[dict], with_msprobe: bool, top_n: int = 0) -> str:
    lines = []
    head = "%-28s %-6s %-44s %-44s %-3s" % ("case", "mode", "expected", "dumpstore", "ok")
    if with_msprobe:
        head += "  msprobe (tensor)"
    lines.append(head)
    for r in rows:
        line = "%-28s %-6s %-44s %-44s %-3s" % (
            r["case"],
            r["mode"],
            r["expected"][:44],
            r["got"][:44],
            "yes" if r["ok"] else "NO",
        )
        if r["clean"]:
            line += "  overflow: target %s, ref %s" % (_ov(r["overflow_target"]), _ov(r["overflow_ref"]))
        if with_msprobe and "msprobe" in r:
            for key in ("msprobe", "msprobe_warning"):
                m = r[key]
                line += "  %s: %s %s" % (
                    key.replace("_", " "),
                    "none" if m is None else "step %s %s" % (m["step"], m["op"]),
                    "yes" if r[key + "_ok"] else "NO",
                )
        if top_n:
            line += "  compare top %d: %s" % (top_n, compare_top.cell(r.get("compare_top")))
        lines.append(line)
    lines.append("")
    for mode in ("stats", "tensor", "all"):
        sel = [r for r in rows if mode == "all" or r["mode"] == mode]
        if not sel:
            continue
        faults = [r for r in sel if not r["clean"]]
        clean = [r for r in sel if r["clean"]]
        line = "%-6s faults found %d of %d; clean pairs quiet %d of %d (false alarms %d); overflow quiet %d of %d" % (
            mode,
            sum(r["ok"] for r in faults),
            len(faults),
            sum(r["ok"] for r in clean),
            len(clean),
            sum(not r["ok"] for r in clean),
            sum(r["overflow_target"] is None and r["overflow_ref"] is None for r in clean),
            len(clean),
        )
        ms = [r for r in sel if "msprobe" in r]
        if ms:
            for key, label in (("msprobe_ok", "msprobe error"), ("msprobe_warning_ok", "msprobe error|warning")):
                line += "; %s: faults %d of %d, clean quiet %d of %d" % (
                    label,
                    sum(r[key] for r in ms if not r["clean"]),
                    sum(not r["clean"] for r in ms),
                    sum(r[key] for r in ms if r["clean"]),
                    sum(r["clean"] for r in ms),
                )
        if top_n:
            line += "; " + compare_top.summary([r.get("compare_top") for r in sel], top_n)
        lines.append(line)
    return "\n".join(lines)


def markdown(rows: list[dict], with_msprobe: bool, top_n: int = 0) -> str:
    extra = ["msprobe error", "ok", "msprobe error or warning", "ok"] if with_msprobe else []
    extra += ["compare --top %d" % top_n] if top_n else []
    head = ["case", "mode", "expected", "dumpstore", "ok"] + extra
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"], r["mode"], r["expected"].replace("|", "or"), r["got"], "yes" if r["ok"] else "**no**"]
        if r["clean"]:
            cells[3] += "; overflow: target %s, ref %s" % (_ov(r["overflow_target"]), _ov(r["overflow_ref"]))
        if with_msprobe:
            for key in ("msprobe", "msprobe_warning"):
                m = r.get(key, "-")
                cells += [
                    "-" if m == "-" else ("none" if m is None else "step %s %s" % (m["step"], m["op"])),
                    "-" if m == "-" else ("yes" if r[key + "_ok"] else "**no**"),
                ]
        if top_n:
            cells.append(compare_top.cell(r.get("compare_top")).replace("NO", "**no**"))
        lines.append("| " + " | ".join("`%s`" % c if i in (0,) else str(c) for i, c in enumerate(cells)) + " |")
    return "\n".join(lines)


def _ov(first: dict | None) -> str:
    return "none" if first is None else "%s@%s %s" % (first.get("kind"), first.get("step"), first.get("op"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(HERE / ".data"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--msprobe", action="store_true", help="add msprobe compare's first flagged row (tensor pairs)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/validation.md)")
    ap.add_argument("--only", nargs="*", help="key names to score (default: all)")
    ap.add_argument(
        "--compare-top",
        type=int,
        default=0,
        metavar="N",
        help="also: is a fault's culprit among `compare --top N` of its step (and its rank); a clean pair's first row",
    )
    args = ap.parse_args(argv)
    data = Path(args.data).resolve()
    key_path = data / "key.json"
    if not key_path.exists():
        print("Error: %s not found: make the pairs first (validation/make_pairs.py)" % key_path, file=sys.stderr)
        return 1
    key = json.loads(key_path.read_text())
    names = [
        n
        for n in sorted(key["cases"], key=lambda n: (key["cases"][n]["mode"], n))
        if not args.only or n in args.only or key["cases"][n]["case"] in args.only
    ]
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="dumpstore_validation_"))
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            rows = list(
                pool.map(lambda n: score_case(n, key["cases"][n], data, work, args.msprobe, args.compare_top), names)
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    top_n = args.compare_top
    print(markdown(rows, args.msprobe, top_n) if args.markdown else table(rows, args.msprobe, top_n))
    if args.markdown:
        print()
        print(table(rows, args.msprobe, top_n).split("\n\n", 1)[1])
    print("scored %d pairs in %.1fs" % (len(rows), time.time() - t0))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not r["ok"]]
    return 0 if not bad else (2 if os.environ.get("VALIDATION_STRICT") else 0)


if __name__ == "__main__":
    sys.exit(main())

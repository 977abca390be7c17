#!/usr/bin/env python
"""Every sample pair's answers, to show that a change left them byte-identical.

Usage::

    python bench/answers.py --save /tmp/answers.json    # before a change
    python bench/answers.py --check /tmp/answers.json   # after it: exit 1 and name what differs
    python bench/answers.py                             # print the digest of each answer

For each case of `sample_dumps/` that has a reference (`catalog.json`'s `ref`; `xdev_*` against `xdev_ref_<mode>`)
both runs are ingested into a fresh store, then `dumpstore divergence --json` and `dumpstore compare --csv --top 0`
run on the pair, in this process through the CLI (the store's temporary path written as `<store>`).  Each run's ingested rows are hashed too (every Parquet table,
rows sorted, without the columns that name an ingest or a time: `ingest_id`, `file_mtime_ns`, `created_at`,
`source_path`).  The saved file holds each answer's sha256 and its text, so `--check` can show the first
differing line.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLES = ROOT / "sample_dumps"
VOLATILE = {"ingest_id", "file_mtime_ns", "created_at", "source_path"}


def pairs() -> list[tuple[str, str]]:
    """(target, ref) sample folders: the catalog's cases with a ref, and each xdev case against its mode's ref."""
    catalog = json.loads((SAMPLES / "catalog.json").read_text())
    out = [(c["path"], c["ref"]) for c in catalog["cases"] if c["ref"]]
    for d in sorted(SAMPLES.glob("xdev_*_*")):
        mode = d.name.rsplit("_", 1)[1]
        if d.is_dir() and not d.name.startswith("xdev_ref_"):
            out.append((d.name, f"xdev_ref_{mode}"))
    return out


def _prepare_samples() -> None:
    """Unpack the tensor samples' archives where the repository keeps them packed."""
    sys.path.insert(0, str(SAMPLES))
    try:
        import fixtures  # sample_dumps/fixtures.py, where it exists
    except ImportError:
        return
    fixtures.unpack_all()


def _cli(args: list[str]) -> str:
    from click.testing import CliRunner

    from dumpstore.cli.main import main

    result = CliRunner().invoke(main, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise SystemExit(f"dumpstore {' '.join(args)}: exit {result.exit_code}\n{result.output}")
    return result.output


def _rows_digest(store: Path, run: str) -> str:
    """sha256 of a run's rows in every table of the store, each table's rows sorted."""
    import pyarrow.parquet as pq

    h = hashlib.sha256()
    files = sorted(p for p in store.rglob("*.parquet") if not p.relative_to(store).parts[0].startswith("."))
    tables: dict[str, list[str]] = {}
    for f in files:
        rel = f.relative_to(store).parts
        if f"run={run}" not in rel and rel != ("runs.parquet",):
            continue
        rows = pq.read_table(f).to_pylist()
        if rel == ("runs.parquet",):
            rows = [r for r in rows if r.get("run") == run]
        key = "/".join(p for p in rel[:-1] if not p.startswith("run="))
        tables.setdefault(key, []).extend(
            json.dumps({k: v for k, v in r.items() if k not in VOLATILE}, sort_keys=True, default=repr) for r in rows
        )
    for key in sorted(tables):
        h.update(key.encode() + b"\0")
        for line in sorted(tables[key]):
            h.update(line.encode() + b"\n")
    return h.hexdigest()


def answers() -> dict[str, str]:
    """Every answer's text, by a name such as `divergence weight_1pct_stats ref_stats`."""
    _prepare_samples()
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="answers-") as tmp:
        store = Path(tmp) / "store"
        ingested: set[str] = set()
        for target, ref in pairs():
            for run in (target, ref):
                if run not in ingested:
                    _cli(["ingest", str(SAMPLES / run), "--run", run, "--store", str(store)])
                    out[f"rows {run}"] = _rows_digest(store, run)
                    ingested.add(run)
            common = ["--target", target, "--ref", ref, "--store", str(store)]
            for name, args in (("divergence", ["--json"]), ("compare", ["--csv", "--top", "0"])):
                text = _cli([name, *common, *args])
                out[f"{name} {target} {ref}"] = text.replace(str(store), "<store>")  # a fresh folder each time
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", type=Path, help="write the answers to this JSON file")
    ap.add_argument("--check", type=Path, help="compare the answers with this file written by --save")
    a = ap.parse_args()
    got = answers()
    if a.save:
        a.save.write_text(json.dumps({k: {"sha256": _digest(v), "text": v} for k, v in got.items()}, indent=1))
        print(f"saved {len(got)} answers to {a.save}")
    if a.check:
        want = json.loads(a.check.read_text())
        bad = sorted(set(want) ^ set(got)) + [k for k in want if k in got and want[k]["sha256"] != _digest(got[k])]
        for k in bad:
            print(f"DIFFERS: {k}")
            if k in want and k in got:
                diff = difflib.unified_diff(want[k]["text"].splitlines(), got[k].splitlines(), lineterm="", n=0)
                print("\n".join(list(diff)[:12]))
        print(f"{len(got)} answers, {len(bad)} differ: {'byte-identical' if not bad else 'CHANGED'}")
        return 1 if bad else 0
    if not a.save:
        for k, v in got.items():
            print(f"{_digest(v)[:16]}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Start-up cost of each dumpstore command: its import time by package, from `python -X importtime`.

    python bench/startup.py [--store STORE]     # default: a store of the sample pair weight_1pct_stats / ref_stats

Each command runs once as a separate process on the store (after one warm-up run); the table shows the wall time of
the whole command, the total import time and its split by top-level package, so a command that loads what its
answer does not need stands out.  Byte-compiles the sources first, as `pip install` does.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent / "dumpstore"
_LINE = re.compile(r"^import time:\s+(\d+) \|\s+\d+ \|(\s*)(\S+)$")
PACKAGES = ("dumpstore", "polars", "pyarrow", "numpy", "duckdb", "click", "yaml")


def commands(store: str) -> dict[str, list[str]]:
    pair = ["--target", "target", "--ref", "ref", "--store", store]
    return {
        "runs": ["runs", "--store", store],
        "ingest": ["ingest", str(ROOT / "sample_dumps" / "ref_stats"), "--run", "again", "--store", store],
        "divergence": ["divergence", *pair, "--no-cache"],
        "compare": ["compare", *pair, "--top", "5"],
        "overflow": ["overflow", "--run", "target", "--store", store],
        "query": ["query", "SELECT count(*) FROM tensors", "--store", store],
    }


def measure(argv: list[str]) -> tuple[float, Counter]:
    """Wall seconds of one run and import milliseconds (self time) by top-level package."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(BIN), *argv], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    by: Counter = Counter()
    for line in proc.stderr.splitlines():
        m = _LINE.match(line)
        if m:
            top = m.group(3).split(".")[0]
            by[top if top in PACKAGES else "other"] += int(m.group(1)) / 1000
    return wall, by


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *(str(ROOT / d) for d in ("dumpstore", "analysis", "cli"))],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store
        if store is None:
            store = str(Path(tmp) / "store")
            for run, src in (("ref", "ref_stats"), ("target", "weight_1pct_stats")):
                subprocess.run(
                    [str(BIN), "ingest", str(ROOT / "sample_dumps" / src), "--run", run, "--store", store],
                    check=True,
                    capture_output=True,
                )
        cols = ("wall s", "imports ms") + PACKAGES + ("other",)
        print(f"{'command':12}" + "".join(f"{c:>11}" for c in cols))
        for name, argv in commands(store).items():
            measure(argv)  # warm the page cache
            wall, by = measure(argv)
            cells = [f"{wall:.2f}", f"{sum(by.values()):.0f}"] + [f"{by.get(p, 0):.0f}" for p in PACKAGES + ("other",)]
            print(f"{name:12}" + "".join(f"{c:>11}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of `dumpstore divergence --exact` on one large fp32 tensor pair (issue 24: bounded memory).

    python bench/exact_memory.py                 # a 1 GiB pair (268,435,456 fp32 elements per tensor)
    python bench/exact_memory.py --mib 256       # a smaller pair

Writes two tensor-mode dumps of one record each (`Functional.linear.0.forward`, output = the large tensor; the
target is the reference with one element changed, so the pair is read and compared in full), ingests both
into a store, then runs `dumpstore divergence --exact --no-cache` as a separate process and reports its peak RSS
(`ru_maxrss` of the child, as GNU `time -f %M`) against the tensor's size. Data goes to bench/.data/exact_memory/
(git-ignored) and is removed afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DUMPSTORE = [sys.executable, "-m", "dumpstore.cli.main"]


def _dump(root: Path, arr: np.ndarray) -> None:
    d = root / "step0" / "rank0"
    (d / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
    name = "Functional.linear.0.forward.output.0.npy"
    np.save(d / "dump_tensor_data" / name, arr)
    leaf = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": list(arr.shape), "requires_grad": False}
    leaf.update(Max=None, Min=None, Mean=None, Norm=None, data_name=name)
    doc = {
        "task": "tensor",
        "level": "L1",
        "framework": "pytorch",
        "dump_data_dir": None,
        "data": {"Functional.linear.0.forward": {"input_args": [], "output": [leaf]}},
    }
    (d / "dump.json").write_text(json.dumps(doc))


# the command runs in a fresh wrapper process: RUSAGE_CHILDREN's ru_maxrss there is that one command's peak RSS
_WRAPPER = (
    "import resource, subprocess, sys; "
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(p.returncode); print(p.stdout + p.stderr)"
)


def _run(args: list[str]) -> tuple[float, float, str]:
    """(wall s, peak RSS MiB, output) of one dumpstore command in its own process."""
    t0 = time.perf_counter()
    got = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *DUMPSTORE, *args], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    rss_kib, rc, out = got.stdout.split("\n", 2)
    if int(rc) not in (0, 3):
        raise SystemExit(f"dumpstore {' '.join(args)} failed ({rc}):\n{out}")
    return wall, int(rss_kib) / 1024, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of each tensor in MiB (default 1024)")
    ap.add_argument("--data", type=Path, default=HERE / ".data" / "exact_memory")
    ap.add_argument("--keep", action="store_true", help="keep the dumps and the store")
    a = ap.parse_args()
    n = a.mib * (1 << 20) // 4
    shutil.rmtree(a.data, ignore_errors=True)
    rng = np.random.default_rng(0)
    ref = np.empty(n, np.float32)
    for i in range(0, n, 1 << 24):  # generated in blocks: this script's own memory is not the one measured
        ref[i : i + (1 << 24)] = rng.standard_normal(min(1 << 24, n - i), dtype=np.float32)
    _dump(a.data / "ref", ref)
    ref[: n // 1000] *= np.float32(1.01)  # rel_l2 ~3e-4: over the fp32 tolerance
    _dump(a.data / "target", ref)
    del ref
    store = a.data / "store"
    for run in ("ref", "target"):
        wall, rss, _ = _run(["ingest", str(a.data / run), "--run", run, "--store", str(store), "-j", "1"])
        print(f"ingest {run}: {wall:.1f} s, peak RSS {rss:.0f} MiB")
    args = ["divergence", "--target", "target", "--ref", "ref", "--store", str(store), "--exact", "--no-cache"]
    wall, rss, out = _run(args)
    first = [line for line in out.splitlines() if line.startswith("FIRST DIVERGENCE")]
    print(first[0] if first else out.strip())
    print(
        f"divergence --exact: {wall:.1f} s, peak RSS {rss:.0f} MiB for two tensors of {a.mib} MiB each: "
        f"{rss / a.mib:.2f} x one tensor"
    )
    if not a.keep:
        shutil.rmtree(a.data, ignore_errors=True)


if __name__ == "__main__":
    main()

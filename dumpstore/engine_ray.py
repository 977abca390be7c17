"""The Ray engine of ingest: (step, rank) units batched into Ray tasks that write part files into a shared store.

Each task runs the local engine's unit code (`_ingest.unit._ingest_unit`, handed in by the driver as `work`: this
module imports nothing of the ingest package) over its batch of units and returns their small
`UnitResult`s; the driver (`ingest.ingest`) commits the catalog once, as with the local pool.  Part file names
depend only on the ingest id and the unit, so a retried task (a worker that died, an OSError) overwrites what
the failed try left.  A failure that persists cancels the remaining tasks, removes every file this ingest
wrote and raises one line: the catalog is never touched.

Locality: when the cluster has several nodes, each alive node is asked which unit folders it can see; a unit
seen by some nodes only (node-local disks) goes to a batch that prefers one of them (soft node affinity: Ray
runs it elsewhere when that node is gone or full).  On a shared file system every node sees every folder and
batches go wherever Ray has room.  Ray is imported only here, only when `--engine ray` is asked for.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import DumpstoreError
from .layout import Unit

RETRIES = 2  # tries after the first of a task whose worker died or that hit an OSError
MAX_BATCH = 32  # units per task at most, by default
_TASKS_PER_CPU = 4  # tasks per cluster CPU, by default, so that uneven units still balance

Locator = Callable[[list[Unit], list[str]], dict[int, str]]


class EngineError(DumpstoreError):
    """The Ray engine could not start, or one of its tasks failed for good."""


def ray_module():
    """The `ray` module, or a one-line EngineError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise EngineError("--engine ray needs Ray: pip install 'dumpstore[ray]' (core `ray`) on every node") from None
    return ray


class session:
    """Connect to Ray for the block: a running instance is used as it is; else `ray.init(address)` (None: a new
    local instance, 'auto': the cluster this machine belongs to) and shut down again after."""

    def __init__(self, address: str | None = None):
        self.address = address
        self.started = False

    def __enter__(self):
        ray = ray_module()
        if not ray.is_initialized():
            try:
                ray.init(
                    address=self.address or "local",
                    include_dashboard=False,
                    logging_level="ERROR",
                    log_to_driver=False,
                    configure_logging=False,
                )
            except (ConnectionError, ValueError, RuntimeError) as exc:
                where = self.address or "a local instance"
                raise EngineError(
                    f"cannot start or join Ray at {where}: {' '.join(str(exc).split())[:300]}; "
                    "check --address (ray status on the head node prints it)"
                ) from None
            self.started = True
        return ray

    def __exit__(self, *exc):
        if self.started:
            ray_module().shutdown()


def run_units(
    st,
    run: str,
    ingest_id: str,
    units: list[Unit],
    opts,
    *,
    work: Callable[..., Any],
    address: str | None = None,
    batch: int | None = None,
    retries: int = RETRIES,
    locate: Locator | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list:
    """Ingest `units` on Ray (see the module docstring); their `UnitResult`s in the order of `units`.  `work`: the
    unit code, `work(unit, root, run, ingest_id, opts) -> UnitResult`, run in the tasks."""
    with session(address) as ray:
        nodes = _alive_nodes(ray)
        homes = (locate or probe_homes)(units, nodes) if len(nodes) > 1 else {}
        size = batch or _default_batch(len(units), ray.cluster_resources().get("CPU", 1))
        if size < 1:
            raise EngineError(f"--batch {size}: give at least 1 unit per task")
        batches = plan_batches(units, homes, size)
        task = ray.remote(max_retries=retries, retry_exceptions=[OSError])(_ingest_batch)
        refs = {}
        for node, idx in batches:
            call = task.options(scheduling_strategy=_affinity(node)) if node else task
            refs[call.remote(work, [units[i] for i in idx], str(st.root), run, ingest_id, opts)] = idx
        return _collect(ray, st, run, ingest_id, units, refs, progress)


def _default_batch(n_units: int, cpus: float) -> int:
    return max(1, min(MAX_BATCH, math.ceil(n_units / (max(cpus, 1) * _TASKS_PER_CPU))))


def plan_batches(units: Sequence[Unit], homes: dict[int, str], size: int) -> list[tuple[str | None, list[int]]]:
    """Unit indexes in batches of at most `size`, units of one preferred node (or of none) per batch."""
    groups: dict[str | None, list[int]] = {}
    for i in range(len(units)):
        groups.setdefault(homes.get(i), []).append(i)
    return [(node, idx[j : j + size]) for node, idx in groups.items() for j in range(0, len(idx), size)]


def _affinity(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=True)


def _alive_nodes(ray) -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU"))


def unit_folder(unit: Unit) -> str:
    """The folder a unit reads: the dump file's folder, or the folder of tensor files."""
    return str(unit.path.parent if unit.kind == "dump" else unit.path)


def probe_homes(units: list[Unit], nodes: list[str]) -> dict[int, str]:
    """Preferred node of each unit whose folder only some nodes see (none where every node sees it), found by
    asking every node which folders it can list."""
    ray = ray_module()
    folders = sorted({unit_folder(u) for u in units})
    probe = ray.remote(num_cpus=0)(_visible)
    seen = ray.get([probe.options(scheduling_strategy=_pinned(n)).remote(folders) for n in nodes])
    return choose_homes(units, nodes, seen)


def choose_homes(units: Sequence[Unit], nodes: list[str], seen: list[list[str]]) -> dict[int, str]:
    """Unit index -> preferred node, from the folders each node sees (`seen`, in the order of `nodes`): a folder
    seen by some nodes only goes to one of them (spread by rank); one seen by all or none gets no preference."""
    holders: dict[str, list[str]] = {}
    for node, visible in zip(nodes, seen):
        for f in visible:
            holders.setdefault(f, []).append(node)
    homes = {}
    for i, u in enumerate(units):
        h = holders.get(unit_folder(u), [])
        if 0 < len(h) < len(nodes):
            homes[i] = h[u.rank % len(h)]
    return homes


def _pinned(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def _visible(folders: list[str]) -> list[str]:
    """Task: the folders this node can list."""
    return [f for f in folders if os.path.isdir(f)]


def _ingest_batch(
    work: Callable[..., Any], units: list[Unit], root: str, run: str, ingest_id: str, opts
) -> tuple[str, list]:
    """Task: ingest each unit of the batch with the local engine's code (`work`); (node id, their UnitResults)."""
    import ray

    return ray.get_runtime_context().get_node_id(), [work(u, root, run, ingest_id, opts) for u in units]


def _collect(ray, st, run: str, ingest_id: str, units: list[Unit], refs: dict, progress) -> list:
    """Wait for every task; on a failure that persists, cancel the rest, remove this ingest's files, raise."""
    results: list[Any] = [None] * len(units)
    pending, done = list(refs), 0
    if progress:
        progress(0, len(units))
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        idx = refs[ready[0]]
        try:
            node, res = ray.get(ready[0])
        except Exception as exc:  # a task error, a dead worker or node: the tries are spent
            for ref in pending:
                ray.cancel(ref, force=True)
            _wait_quietly(ray, pending)
            remove_ingest_files(Path(st.root), run, ingest_id)
            raise _failure(exc, units[idx[0]], run) from None
        for i, r in zip(idx, res):
            r.meta["node"] = node
            results[i] = r
        done += len(idx)
        if progress:
            progress(done, len(units))
    return results


def _wait_quietly(ray, refs: list) -> None:
    """Let cancelled tasks end, so that none writes a file after the clean-up."""
    for ref in refs:
        try:
            ray.get(ref)
        except Exception:  # cancelled or failed: either way it has stopped
            pass


def _failure(exc: Exception, unit: Unit, run: str) -> DumpstoreError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, DumpstoreError):  # bad input: the unit code's own one-line error
        return type(cause)(str(cause))
    text = " ".join(str(cause or exc).split())
    head = text.split(" Traceback")[0][:300]
    return EngineError(
        f"ingest of run {run!r} on Ray failed at step {unit.step} rank {unit.rank} "
        f"({unit_folder(unit)}): {type(cause or exc).__name__}: {head}; nothing was published "
        "(the catalog is unchanged); fix the cause and ingest again"
    )


def remove_ingest_files(root: Path, run: str, ingest_id: str) -> int:
    """Delete the part files an unpublished ingest wrote; how many."""
    n = 0
    for sub, pattern in (("tensors", f"*/*/part-{ingest_id}*.parquet"), ("stacks", f"part-{ingest_id}*.parquet")):
        for path in (root / sub / f"run={run}").glob(pattern):
            try:
                path.unlink()
                n += 1
            except FileNotFoundError:
                pass
    return n

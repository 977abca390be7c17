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
import signal
import sys
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


CONNECT_TIMEOUT = 10.0  # seconds to reach a cluster named by --address (the CLI's --connect-timeout)


def _reachable(address: str | None, timeout: float) -> None:
    """A cluster address given as HOST:PORT (or ray://HOST:PORT) answers a TCP connection within `timeout` seconds,
    else one EngineError line (ray.init itself retries for minutes)."""
    import socket

    if not address or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # not HOST:PORT: Ray's own parsing says what is wrong
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise EngineError(
            f"cannot reach Ray at {address} within {timeout:g} s ({why}); check --address (`ray status` on the head "
            "node prints it) or raise --connect-timeout"
        ) from None


def _init_within(ray, options: dict, timeout: float) -> None:
    """`ray.init(**options)` for a cluster address, given up after `timeout` seconds with one EngineError line (Ray
    retries an address that answers but is no Ray cluster for minutes). Its C++ warnings stay quiet meanwhile."""
    import threading

    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
    got: list[BaseException | None] = []

    def init() -> None:
        try:
            ray.init(**options)
            got.append(None)
        except BaseException as exc:  # re-raised in the calling thread
            got.append(exc)

    worker = threading.Thread(target=init, name="dumpstore-ray-init", daemon=True)
    worker.start()
    worker.join(timeout)
    if not got:
        raise EngineError(
            f"cannot join Ray at {options['address']} within {timeout:g} s (no Ray cluster answered there); check "
            "--address (`ray status` on the head node prints it) or raise --connect-timeout"
        )
    if got[0] is not None:
        raise got[0]


class session:
    """Connect to Ray for the block: a running instance is used as it is; else `ray.init(address)` (None: a new
    local instance, 'auto': the cluster this machine belongs to) and shut down again after."""

    def __init__(self, address: str | None = None):
        self.address = address
        self.started = False
        self.watcher: int | None = None

    def __enter__(self):
        ray = ray_module()
        if not ray.is_initialized():
            _reachable(self.address, CONNECT_TIMEOUT)
            options = {
                "address": self.address or "local",
                "include_dashboard": False,
                "logging_level": "ERROR",
                "log_to_driver": False,
                "configure_logging": False,
            }
            try:
                if self.address in (None, "local"):
                    ray.init(**options)
                else:
                    _init_within(ray, options, CONNECT_TIMEOUT)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                where = self.address or "a local instance"
                raise EngineError(
                    f"cannot start or join Ray at {where}: {' '.join(str(exc).split())[:300]}; "
                    "check --address (ray status on the head node prints it)"
                ) from None
            self.started = True
            if self.address in (None, "local"):
                self.watcher = _reaper(_descendants(os.getpid()))
        return ray

    def __exit__(self, *exc):
        if self.started:
            ray_module().shutdown()
        if self.watcher is not None:
            _stop(self.watcher)


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        child = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(child)
        start[child] = int(fields[19])
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append((p, start[p]))
        todo.extend(children.get(p, []))
    return out


def _reaper(procs: list[tuple[int, int]]) -> int | None:
    """A process that ends `procs` (the local Ray this driver started) when the driver dies without shutting Ray
    down (SIGKILL): it waits on a pipe whose only writer is the driver; end of file means the driver is gone."""
    if not procs or not sys.platform.startswith("linux"):
        return None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reaper: no Python beyond reads, kills and _exit (the driver has threads)
        try:
            os.close(w)
            os.setsid()  # not in the driver's process group: a Ctrl-C there is not its business
            while os.read(r, 1):
                pass
            for p, started in procs:
                try:
                    with open(f"/proc/{p}/stat", "rb") as fh:
                        if int(fh.read().rsplit(b")", 1)[1].split()[19]) != started:
                            continue  # the pid now names another process
                    os.kill(p, signal.SIGKILL)
                except (OSError, ValueError, IndexError):
                    pass
        finally:
            os._exit(0)
    os.close(r)
    os.set_inheritable(w, False)
    _REAPER_PIPES[pid] = w
    return pid


_REAPER_PIPES: dict[int, int] = {}


def _stop(pid: int) -> None:
    """The driver shut Ray down itself: the reaper is not needed (killed, not let loose on reused pids)."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass
    w = _REAPER_PIPES.pop(pid, None)
    if w is not None:
        os.close(w)


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

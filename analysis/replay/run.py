"""Replay a run's recorded calls in worker processes and store the verdicts as the run's `replay` table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polars as pl

from dumpstore.replaytable import REPLAY_SCHEMA, write_replay
from dumpstore.store import Store

from .plan import Call, ReplayError, call_keys, plan_calls

BATCH = 16  # calls per worker task
# worker processes only when each gets at least this many calls: a worker starts by importing torch (1-3 s, about
# as long as replaying 200 small calls; bench/replay_speed.py)
MIN_CALLS_PER_WORKER = 200


def have_torch() -> bool:
    """Whether torch can be imported (looked up, not imported: only the replay's workers import it)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _content_hashes(store: Store, run: str, steps: list[int] | None) -> dict[tuple[int, int, str], str]:
    """{(step, rank, data_name): content hash} of the run's tensor files, from the store."""
    from dumpstore.parquetio import read_columns

    from ..load import run_files

    out: dict[tuple[int, int, str], str] = {}
    for path, step, rank in run_files(store, run, steps=steps):
        try:
            table = read_columns(path, ["data_name", "content_hash"])
        except Exception:  # an older store without content hashes: every call is replayed
            continue
        for name, h in zip(table.column("data_name").to_pylist(), table.column("content_hash").to_pylist()):
            if name is not None and h is not None:
                out[(step, rank, name)] = h.hex() if isinstance(h, bytes) else str(h)
    return out


def replay_run(
    store: Store,
    run: str,
    *,
    steps: list[int] | None = None,
    op_types: list[str] | None = None,
    jobs: int = 1,
    progress: Callable[[int, int], None] | None = None,
    write: bool = True,
) -> pl.DataFrame:
    """Replay the run's forward API calls (float64 and the recorded dtype, on the CPU), judge every recorded output,
    store the table (`replay` view) and return it in execution order (one row per output; one per call not
    replayed). Identical calls are replayed once; the others get `same_as`."""
    if not have_torch():
        raise ReplayError("dumpstore replay needs torch (the CPU build is enough): pip install 'dumpstore[replay]'")
    calls = plan_calls(store, run, steps=steps, op_types=op_types)
    if not calls and steps:
        have = store.run_info(run).get("steps") or []
        if not set(steps) & set(have):
            raise ReplayError(f"run {run!r} has no step {', '.join(map(str, steps))}; its steps: {have}")
    if not calls and not op_types:
        raise ReplayError(
            f"run {run!r} has no API records (a level L0 dump records modules only); replay calls the recorded "
            "APIs: dump with level L1 or mix"
        )
    call_keys(calls, _content_hashes(store, run, steps))
    first: dict[str, Call] = {}
    todo: list[Call] = []
    for c in calls:
        if c.skip is None and c.key is not None and c.key in first:
            continue
        if c.key is not None and c.skip is None:
            first[c.key] = c
        todo.append(c)
    results = _execute(todo, jobs, progress)
    rows: list[dict[str, Any]] = []
    for c in calls:
        if c.skip is None and c.key is not None and first[c.key] is not c:
            src = first[c.key]
            ident = {"step": c.step, "rank": c.rank, "seq": c.seq, "record": c.record, "same_as": src.record}
            rows.extend({**r, **ident, "name": _renamed(r.get("name"), src.record, c.record)} for r in results[id(src)])
        else:
            rows.extend(results[id(c)])
    df = _frame(rows)
    if write:
        write_replay(store, run, _kept(store, run, df).to_arrow() if (steps or op_types) else df.to_arrow())
    return df


def _kept(store: Store, run: str, df: pl.DataFrame) -> pl.DataFrame:
    """A partial replay (some steps or APIs) added to the run's stored table: its rows replace those of the same
    calls, the other calls' rows stay."""
    from dumpstore.replaytable import read_replay

    old = read_replay(store, run)
    if old is None:
        return df
    prev = pl.DataFrame(old.to_pylist(), schema=_polars_schema(), orient="row") if old.num_rows else df.clear()
    keys = ["step", "rank", "record"]
    both = pl.concat([prev.join(df.select(keys).unique(), on=keys, how="anti"), df])
    return both.sort(["step", "rank", "seq"], maintain_order=True)


def _renamed(name: str | None, old: str, new: str) -> str | None:
    return None if name is None else new + name[len(old) :]


def _execute(
    calls: list[Call], jobs: int, progress: Callable[[int, int], None] | None
) -> dict[int, list[dict[str, Any]]]:
    """{id(call): rows}; in `jobs` spawned worker processes (fewer when there are too few calls for them), or in this
    process."""
    from .worker import replay_batch

    batches = [calls[i : i + BATCH] for i in range(0, len(calls), BATCH)]
    out: dict[int, list[dict[str, Any]]] = {}
    done = 0

    def take(batch: list[Call], rows: list[dict[str, Any]]) -> None:
        nonlocal done
        by_record: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
        for r in rows:
            by_record.setdefault((r["step"], r["rank"], r["record"]), []).append(r)
        for c in batch:
            out[id(c)] = by_record.get((c.step, c.rank, c.record), [])
        done += len(batch)
        if progress is not None:
            progress(done, len(calls))

    jobs = min(jobs, len(calls) // MIN_CALLS_PER_WORKER)
    if jobs <= 1 or len(batches) <= 1:
        for batch in batches:
            take(batch, replay_batch(batch))
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # a fork server (not a fork of this process: it holds Polars/DuckDB threads) that imports torch once and forks
    # the workers from there; this process never imports torch
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dumpstore.analysis.replay.preload"])
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_preloaded) as pool:
        futures = [(batch, pool.submit(replay_batch, batch)) for batch in batches]
        for batch, fut in futures:
            take(batch, fut.result())
    return out


def _preloaded() -> None:
    from .worker import init_worker

    init_worker()


def _frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """The rows as a DataFrame of the replay table's columns (built by Polars: pyarrow's from_pylist loads pandas)."""
    schema = _polars_schema()
    df = pl.DataFrame([{k: r.get(k) for k in schema} for r in rows], schema=schema, orient="row")
    return df.sort(["step", "rank", "seq"], maintain_order=True)


def _polars_schema() -> dict[str, Any]:
    import pyarrow as pa

    types = {pa.string(): pl.String(), pa.int64(): pl.Int64(), pa.int32(): pl.Int32(), pa.float64(): pl.Float64()}
    return {f.name: types.get(f.type, pl.List(pl.Int64())) for f in REPLAY_SCHEMA}

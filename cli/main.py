"""The `dumpstore` command: parse options, call one library function, render. The only place that prints."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from dumpstore.errors import DumpstoreError

from .options import engine_options, store_option
from .render import contract, output_options, render, text, to_json


class _Group(click.Group):
    """Turns DumpstoreError into `Error: ...` and exit 1; bugs keep their traceback."""

    def invoke(self, ctx: click.Context):
        try:
            with _notices_as_warnings(), _terminate_as_interrupt():
                return super().invoke(ctx)
        except DumpstoreError as exc:
            click.echo(f"Error: {text(exc)}", err=True)  # one line: a name from a dump cannot break it
            ctx.exit(1)
        except KeyboardInterrupt:  # SIGINT (and SIGTERM, below): what was being written is cleaned up on the way
            click.echo("Error: interrupted; the store is as it was before this command", err=True)
            ctx.exit(130)
        except Exception as exc:
            if _interrupted(exc):
                click.echo("Error: interrupted; the store is as it was before this command", err=True)
                ctx.exit(130)
            line = _damaged_file(exc, ctx)
            if line is None:
                raise
            click.echo(f"Error: {text(line)}", err=True)
            ctx.exit(1)


def _interrupted(exc: Exception) -> bool:
    """Whether `exc` is DuckDB's report of an interruption: its own on Ctrl-C, or a KeyboardInterrupt raised while
    DuckDB ran Python code of ours (reading a registered Arrow object's schema), which it wraps in an error of its
    own with the interruption's name in the message."""
    if "Interrupt" in type(exc).__name__ or str(exc) == "Query interrupted":
        return True
    return type(exc).__module__ in ("duckdb", "_duckdb") and "KeyboardInterrupt" in str(exc)


_SIGNALS = None
_FORKING: list[int] = []  # set while a fork's hooks run: a signal then is put off (_DEFERRED) and sent again after
_DEFERRED: list[int] = []


def _quiet_children() -> None:
    """Processes forked by a command (ingest and --exact workers) end quietly on Ctrl-C, leaving the cleanup and the
    one line to the command itself: SIGINT and SIGTERM are blocked across each fork, and a child ends on SIGINT at
    once (exit 130, no traceback), on SIGTERM as by default. In the command, a signal that came during the fork is
    not raised inside the fork's hook (Python would print and drop it) but sent again once the fork is done."""
    import signal

    global _SIGNALS
    if _SIGNALS is not None or not hasattr(os, "register_at_fork"):
        return
    _SIGNALS = {signal.SIGINT, signal.SIGTERM}

    def before() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        _FORKING.append(1)

    def parent() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)  # a pending signal's handler runs here: put off
        if _DEFERRED:
            import threading

            for sig in _DEFERRED:
                threading.Timer(0.01, os.kill, (os.getpid(), sig)).start()
            _DEFERRED.clear()
        _FORKING.clear()  # the last statement: no signal check between it and the return

    def child() -> None:
        _FORKING.clear()
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)

    os.register_at_fork(before=before, after_in_parent=parent, after_in_child=child)


@contextmanager
def _terminate_as_interrupt():
    """SIGINT and SIGTERM raise KeyboardInterrupt in this process (not in forked workers), so a terminated command
    cleans up as an interrupted one does (staging folders, report .part files) and exits 130 with one line; a
    signal that comes while a fork's hooks run is put off until they are done (`_quiet_children`)."""
    import signal

    me = os.getpid()

    def handler(signum, frame):
        if os.getpid() != me:  # a forked worker: die as the default handler would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _FORKING:
            _DEFERRED.append(signum)
            return
        if _in_polars_callback(frame):  # raised there, Polars' Rust caller panics (a traceback, exit 1): try again soon
            import threading

            threading.Timer(0.05, os.kill, (me, signum)).start()
            return
        raise KeyboardInterrupt

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (a test runner): leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _in_polars_callback(frame) -> bool:
    """Whether the signal came while Python code of Polars ran (a dtype built for its Rust code, for one): an
    exception raised there goes up into Rust, which panics on it instead of passing it on."""
    polars = sys.modules.get("polars")
    if polars is None or frame is None or not getattr(polars, "__file__", None):
        return False
    return frame.f_code.co_filename.startswith(os.path.dirname(polars.__file__) + os.sep)


def _damaged_file(exc: Exception, ctx: click.Context) -> str | None:
    """One line for an unreadable Parquet file of the store (flipped, truncated or empty), from pyarrow's, Polars'
    or DuckDB's error; None for anything else (a bug keeps its traceback)."""
    del ctx
    words = " ".join(str(exc).split())
    low = words.lower()
    if "parquet" not in low and "magic bytes" not in low:
        return None
    return (
        f"a Parquet file of the store is damaged ({words[:300]}); `dumpstore repair --store STORE` names the runs "
        "to ingest again"
    )


@contextmanager
def _notices_as_warnings():
    """The library's notices (DumpstoreWarning) become one `warning: ...` line each on stderr."""
    import warnings

    from dumpstore.errors import DumpstoreWarning

    def show(message, category, *args, **kwargs):
        if issubclass(category, DumpstoreWarning):
            click.echo(f"warning: {message}", err=True)
        else:
            original(message, category, *args, **kwargs)

    with warnings.catch_warnings():
        original = warnings.showwarning
        warnings.simplefilter("always", DumpstoreWarning)
        warnings.showwarning = show
        yield


class _PowerOfTwo(click.ParamType):
    """--sketch-m: a power of two the sketch can hold (dumpstore.summary.check_sketch_m), else a usage error."""

    name = "power of two"

    def convert(self, value, param, ctx):
        from dumpstore.summary import check_sketch_m

        try:
            return check_sketch_m(int(value))
        except (TypeError, ValueError) as exc:
            self.fail(f"{value!r}: {exc}" if "sketch" in str(exc) else f"{value!r} is not an integer", param, ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dumpstore")
def main() -> None:
    """Ingest msprobe dumps into a Parquet store and hunt numerical divergence with SQL."""


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="PATH...")
@click.option(
    "--run",
    "runs",
    required=True,
    multiple=True,
    help="Name of the run in the store (re-ingest replaces it); one --run per PATH, in order.",
)
@store_option
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Worker processes (default: CPU count).")
@click.option(
    "--sample-k", type=click.IntRange(min=0, max=1 << 20), default=None, help="Sample size per tensor (default 64)."
)
@click.option(
    "--sketch-m",
    type=_PowerOfTwo(),
    default=None,
    help="Sketch buckets per tensor, a power of two from 1 to 65536 (default 512).",
)
@click.option("--no-tensors", is_flag=True, help="Do not read tensor files; keep the dumper's statistics only.")
@click.option("--json", "as_json", is_flag=True, help="Print the ingest summary as JSON (a list for several runs).")
@engine_options
def ingest(
    paths: tuple[Path, ...],
    runs: tuple[str, ...],
    store: Path | None,
    jobs: int | None,
    sample_k: int | None,
    sketch_m: int | None,
    no_tensors: bool,
    as_json: bool,
    engine: str,
    address: str | None,
    batch: int | None,
) -> None:
    """Ingest an msprobe dump (root, step or rank folder, dump.json) or a folder of .npy/.pt files.

    Several dumps at once (`ingest ref_dir target_dir --run ref --run target`) are ingested side by side,
    sharing the workers."""
    from dumpstore._ingest import IngestOptions
    from dumpstore.summary import DEFAULT_SAMPLE_K, DEFAULT_SKETCH_M

    if len(paths) != len(runs):
        raise click.UsageError(f"{len(paths)} paths but {len(runs)} --run names: give one --run per PATH")
    if len(set(runs)) != len(runs):
        raise click.UsageError("each --run name may appear once")
    opts = IngestOptions(
        sample_k=DEFAULT_SAMPLE_K if sample_k is None else sample_k,
        sketch_m=DEFAULT_SKETCH_M if sketch_m is None else sketch_m,
        load_tensors=not no_tensors,
    )
    if engine == "ray":  # one run after the other, each over the whole cluster
        from dumpstore._ingest import ingest as do_ingest

        eng = {"address": address, "batch": batch}
        with _Progress(f"ingest {runs[0]}") as bar:
            results = [
                do_ingest(p, r, store=store, options=opts, progress=bar.update, engine="ray", engine_options=eng)
                for p, r in zip(paths, runs)
            ]
    elif len(paths) == 1:
        from dumpstore._ingest import ingest as do_ingest

        with _Progress(f"ingest {runs[0]}") as bar:
            results = [do_ingest(paths[0], runs[0], store=store, options=opts, jobs=jobs, progress=bar.update)]
    else:
        results = _ingest_several(paths, runs, store, opts, jobs)
    if as_json:
        click.echo(to_json(contract("ingest", store, {"runs": [r.__dict__ for r in results]})))
        return
    for res in results:
        click.echo(
            f"run {res.run}: {res.records} records, {res.rows} rows ({res.tensors} tensors, "
            f"{res.tensor_files} tensor files) from {res.units} dump files; steps {_span(res.steps)}, "
            f"ranks {_span(res.ranks)}"
        )
        if res.errors:
            click.echo(
                f"warning: {res.errors} leaves could not be read fully (stored with an error); "
                f'first: {text(res.first_error)}; list them: dumpstore query "select name, error from tensors '
                f"where run='{res.run}' and error is not null\"",
                err=True,
            )


def _ingest_several(paths, runs, store, opts, jobs: int | None) -> list:
    """One ingest per (path, run), each in its own process with a share of the workers, under one progress
    display (the files of all of them); all of them finish (one failing does not stop the others), then the first
    failure is raised."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial
    from queue import Empty

    from dumpstore._ingest import ingest as do_ingest

    total = jobs or os.cpu_count() or 1
    side = min(len(paths), total)
    share = max(1, total // side)
    queue = multiprocessing.get_context().Queue()
    seen: dict[str, tuple[int, int]] = {}
    with (
        ProcessPoolExecutor(max_workers=side, initializer=_several_init, initargs=(os.getpid(), queue)) as pool,
        _Progress(f"ingest {', '.join(runs)}") as bar,
    ):
        futures = [
            pool.submit(do_ingest, p, r, store=store, options=opts, jobs=share, progress=partial(_told, r))
            for p, r in zip(paths, runs)
        ]
        for fut in futures:  # a finished ingest wakes the loop below at once, not at its next timeout
            fut.add_done_callback(lambda _: queue.put(None))
        while not all(f.done() for f in futures) or not queue.empty():
            try:
                told = queue.get(timeout=_POLL_S)
            except Empty:
                continue
            if told is None:
                continue
            run, done, of = told
            seen[run] = (done, of)
            bar.update(sum(d for d, _ in seen.values()), sum(t for _, t in seen.values()))
        outcomes = []
        for fut in futures:
            try:
                outcomes.append(fut.result())
            except DumpstoreError as exc:
                outcomes.append(exc)
    failed = [o for o in outcomes if isinstance(o, DumpstoreError)]
    if failed:
        done_runs = [o.run for o in outcomes if not isinstance(o, DumpstoreError)]
        note = f" (ingested: {', '.join(done_runs)})" if done_runs else ""
        raise type(failed[0])(f"{failed[0]}{note}")
    return outcomes


_POLL_S = 0.1  # the side-by-side ingest's wait for progress; the end of an ingest wakes it sooner
_PROGRESS_QUEUE = None  # in a side-by-side ingest's child: where its progress goes to the parent's one display


def _several_init(owner: int, queue) -> None:
    from dumpstore.workers import worker_init

    global _PROGRESS_QUEUE
    worker_init(owner)
    _PROGRESS_QUEUE = queue


def _told(run: str, done: int, total: int) -> None:
    if _PROGRESS_QUEUE is not None:
        _PROGRESS_QUEUE.put((run, done, total))


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}..{values[-1]}"
    return ",".join(str(v) for v in values)


class _Progress:
    """A progress bar on stderr, shown only on a terminal and only for more than one file."""

    def __init__(self, label: str):
        self.label = label
        self.bar = None

    def __enter__(self):
        return self

    def update(self, done: int, total: int) -> None:
        if total < 2 or not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.length = max(total, done)  # side by side: the total grows as each ingest counts its files
        self.bar.update(done - self.bar.pos)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)


@main.command()
@store_option
@output_options
def runs(store: Path | None, fmt: str) -> None:
    """List the runs in the store."""
    from dumpstore.errors import StoreError
    from dumpstore.store import CATALOG, open_store

    st = open_store(store)
    table = st.runs()  # a store that lost its catalog but holds data: the error naming `dumpstore repair`
    if not (st.root / CATALOG).is_file():
        raise StoreError(
            f"{st.root}: not a dumpstore store (no {CATALOG}); ingest a dump first (dumpstore ingest PATH --run "
            "NAME --store DIR), or point --store / $DUMPSTORE_STORE at a store"
        )
    if fmt == "table":
        table = table.select(
            [
                "run",
                "framework",
                "task",
                "level",
                "steps",
                "ranks",
                "n_records",
                "n_rows",
                "n_tensor_files",
                "n_errors",
                "created_at",
            ]
        )
    click.echo(render(table, fmt))


@main.command()
@click.argument("sql")
@store_option
@click.option(
    "--memory-limit",
    default=None,
    metavar="SIZE",
    help="DuckDB memory limit: 4GB, 512MB or a share of the RAM such as 25% (default: 50%).",
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="DuckDB threads (default: one per core).")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Stop the query after this many seconds (default: no limit).",
)
@output_options
def query(
    sql: str, store: Path | None, memory_limit: str | None, threads: int | None, timeout: float | None, fmt: str
) -> None:
    """Run one read-only SQL statement (DuckDB) over the views tensors, runs, stacks.

    Only a SELECT (WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE) or EXPLAIN of one runs; files outside the store
    cannot be read and nothing can be written."""
    from dumpstore.query import Limits, run_query
    from dumpstore.store import open_store

    limits = Limits(memory_limit=memory_limit, threads=threads, timeout=timeout)
    click.echo(render(run_query(open_store(store), sql, limits=limits), fmt))


@main.command()
@store_option
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Worker processes (default: CPU count).")
@click.option(
    "--from-source",
    is_flag=True,
    help="Re-ingest what the dump folders hold now, even where they changed since the runs were ingested.",
)
def upgrade(store: Path | None, jobs: int | None, from_source: bool) -> None:
    """Re-ingest the runs of a store written by an older dumpstore from their dump folders (all or nothing)."""
    from dumpstore.upgrade import upgrade as do_upgrade

    with _Progress("upgrade") as bar:
        done = do_upgrade(store, jobs=jobs, progress=bar.update, from_source=from_source)
    click.echo(f"upgraded {len(done)} runs" + (": " + ", ".join(r.run for r in done) if done else ""))


@main.command()
@store_option
def repair(store: Path | None) -> None:
    """Rebuild the catalog (runs.parquet) from the ingests' records and check the live Parquet files."""
    from dumpstore.repair import repair as do_repair
    from dumpstore.store import store_errors

    with store_errors(store):
        res = do_repair(store)
    what = "rebuilt the catalog" if res.rewritten else "the catalog is complete"
    click.echo(f"{what}: {len(res.runs)} runs" + (": " + ", ".join(res.runs) if res.runs else ""))
    for run in res.unrecorded:
        click.echo(
            f"warning: run {run}: data without a record (ingested by an older dumpstore); ingest it again", err=True
        )
    for run, why in res.damaged.items():
        click.echo(f"warning: run {run}: damaged file {why}; ingest the run again", err=True)
    if res.damaged or res.unrecorded:
        raise SystemExit(1)


from .compare_cmds import compare, divergence, overflow  # noqa: E402

main.add_command(compare)
main.add_command(divergence)
main.add_command(overflow)

from .report_cmd import report as _report  # noqa: E402

main.add_command(_report)

from .health_cmds import checklist, health  # noqa: E402

main.add_command(checklist)
main.add_command(health)

from .replay_cmd import replay as _replay  # noqa: E402

main.add_command(_replay)
from .longrun_cmds import register as _register_longrun  # noqa: E402

_register_longrun(main)


class _NoPandas:
    """Import finder refusing pandas.  pyarrow imports pandas (~0.5 s, ~50 MB) on the first array it builds, only
    to ask whether its input is a pandas object; dumpstore never hands it one.  Installed by `run` (the console
    script) for the command's own process only, never by the library or an in-process `main()`."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError("the dumpstore command does not use pandas", name=name)
        return None


def run() -> None:
    """The `dumpstore` console script."""
    if "pandas" not in sys.modules:
        sys.meta_path.insert(0, _NoPandas())
    # One OpenBLAS thread: importing numpy starts one per core otherwise (20-60 ms of every command), and dumpstore's
    # parallelism is its own (processes, Polars' pool); its dot products are chunked below OpenBLAS's threading size.
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from dumpstore import retain

    retain.RETAINED = []
    _quiet_children()
    try:
        main()
    except SystemExit as exc:
        _exit_now(exc.code)
    _exit_now(0)


def _exit_now(code: object) -> None:
    """End the process without the interpreter's teardown (freeing every object: ~70 ms after an ingest of a
    10 MB dump.json), once the output is flushed; with Ray, a profiler or a tracer the process exits normally."""
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    if "ray" in sys.modules or sys.getprofile() or sys.gettrace():  # Ray's shutdown, a profiler's or coverage's
        sys.exit(code)  # report: they run at exit
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # output closed early (| head): nothing left to lose
        code = code or 0
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()

"""Fuzzed dumps (tests/fuzz.py): every case is ingested with its bad leaves counted, or refused with one line.

For each case: no exception but DumpstoreError (in-process) or exit 0/1 with a one-line `Error: …` and no
traceback (CLI); no hang (a time limit per case); no dropped leaf (rows per step and rank = leaves counted
independently, n_errors = rows with an error); nothing read outside the dump and the store (no canary value in
the store, no open() of a canary file) and nothing written outside the store (the dump and its neighbours are
unchanged, file by file).

By default 280 cases run in-process (each of the 183 mutation variants alone, then random combinations of one
to three mutations) and 20 through the CLI in a subprocess, about 30 s. `DUMPSTORE_FUZZ_CASES=5000` raises the
number of in-process cases (and the CLI's to a fifteenth of it); `-m slow` adds `DUMPSTORE_FUZZ_SLOW_CASES`
(default 3000) in-process cases with another seed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import stat
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dumpstore._ingest import IngestOptions, ingest
from dumpstore.errors import DumpstoreError
from dumpstore.layout import find_units
from dumpstore.query import run_query
from dumpstore.store import Store, open_store
from fuzz import CANARY, Built, Case, cases, expected_rows, make_template, unit_doc

N_CASES = int(os.environ.get("DUMPSTORE_FUZZ_CASES", "280"))
N_CLI = max(20, N_CASES // 15)
N_SLOW = int(os.environ.get("DUMPSTORE_FUZZ_SLOW_CASES", "3000"))
CASE_SECONDS = 10
CLI_SECONDS = 30
TENSOR_SUFFIXES = (".pt", ".npy")
FORBIDDEN = ("/etc/passwd", "/dev/zero", "/proc/self/environ")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return make_template(tmp_path_factory.mktemp("fuzz-template"))


# ---------------------------------------------------------------------------------------------- guards


class _Watch:
    """An audit hook (installed once): open() of a canary file, or a write outside the store, is recorded."""

    def __init__(self) -> None:
        self.active = False
        self.forbidden: tuple[str, ...] = ()
        self.store = ""
        self.hits: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        self.active = False  # the checks below must not audit themselves
        try:
            self._check(event, args)
        finally:
            self.active = True

    def _check(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            if path is None or isinstance(path, int):
                return
            real = os.path.realpath(os.fsdecode(path))
            if real.startswith(self.forbidden):
                self.hits.append(f"opened {real!r}")
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writing and not self._in_store(real):
                self.hits.append(f"opened {real!r} for writing")
        elif event in (
            "os.remove",
            "os.rename",
            "os.mkdir",
            "os.rmdir",
            "os.symlink",
            "os.link",
            "os.truncate",
            "os.chmod",
            "os.chown",
            "os.utime",
            "shutil.rmtree",
            "shutil.move",
            "shutil.copyfile",
        ):
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)):
                    real = os.path.realpath(os.fsdecode(a))
                    if not self._in_store(real):
                        self.hits.append(f"{event} {real!r}")

    def _in_store(self, real: str) -> bool:
        return real == self.store[:-1] or real.startswith(self.store)

    @contextlib.contextmanager
    def watching(self, canary: Path, store: Path) -> Iterator[list[str]]:
        self.forbidden = (str(canary.resolve()) + os.sep, *FORBIDDEN)
        self.store = str(store.resolve()) + os.sep
        self.hits = []
        self.active = True
        try:
            yield self.hits
        finally:
            self.active = False


_WATCH = _Watch()


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int, what: str) -> Iterator[None]:
    def expired(*_: object) -> None:
        raise CaseTimeout(f"{what}: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def snapshot(top: Path, skip: Path) -> dict[str, tuple]:
    """Every path under `top` but `skip`: type, size, mtime and link target (read with lstat, never opened)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            link = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size
            out[p] = (stat.S_IFMT(st.st_mode), size, st.st_mtime_ns, link)
    return out


def _diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    return (
        [f"created {p!r}" for p in sorted(after.keys() - before.keys())]
        + [f"removed {p!r}" for p in sorted(before.keys() - after.keys())]
        + [f"changed {p!r}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    )


# ------------------------------------------------------------------------------------------- the oracle


def expected_by_unit(path: Path) -> dict[tuple[str, int, int], int]:
    """Rows each (source, step, rank) must hold, counted from the files without dumpstore's reader."""
    out: dict[tuple[str, int, int], int] = {}
    for unit in find_units(path):
        if unit.kind == "dump":
            n = expected_rows(unit_doc(unit.path))
        else:
            n = sum(
                1
                for p in unit.path.iterdir()
                if p.suffix.lower() in TENSOR_SUFFIXES and (p.is_symlink() or not p.is_dir())
            )
        out[(unit.source, unit.step, unit.rank)] = n
    return out


STORE_QUERY = f"""
    select source, step, rank, count(*) n, count(error) e,
           count(*) filter (where {CANARY} in (max, min, dump_max, dump_min, mean)
                            or list_contains(sample, {CANARY})) canary
    from tensors where run = 'r' group by all"""


def _groups_sql(st: Store) -> list[dict]:
    return run_query(st, STORE_QUERY).to_pylist()


def _groups_parquet(st: Store) -> list[dict]:
    """What STORE_QUERY returns, read from the run's live Parquet files without DuckDB (faster)."""
    groups: dict[tuple, dict] = {}
    for part in sorted(f for pattern in st.tensor_files(["r"]) for f in glob.glob(pattern)):
        step, rank = (int(Path(part).parents[i].name.split("=", 1)[1]) for i in (1, 0))
        cols = ["source", "error", "max", "min", "dump_max", "dump_min", "mean", "sample"]
        for row in pq.read_table(part, columns=cols).to_pylist():
            g = groups.setdefault(
                (row["source"], step, rank),
                {"source": row["source"], "step": step, "rank": rank, "n": 0, "e": 0, "canary": 0},
            )
            g["n"] += 1
            g["e"] += row["error"] is not None
            g["canary"] += CANARY in [row[c] for c in cols[2:7]] + (row["sample"] or [])
    return list(groups.values())


def check_store(built: Built, store: Path, rows: int | None, errors: int | None, *, sql: bool = True) -> list[str]:
    """The run's rows match the leaves of the dump, errors are counted, no canary value got in."""
    st = open_store(store)
    table = _groups_sql(st) if sql else _groups_parquet(st)
    got = {(r["source"], r["step"], r["rank"]): r["n"] for r in table}
    problems = []
    want = expected_by_unit(built.ingest_path)
    if got != {k: v for k, v in want.items() if v}:
        problems.append(f"rows per (source, step, rank) {got}, leaves in the dump {want}")
    info = st.run_info("r")
    n, e = sum(r["n"] for r in table), sum(r["e"] for r in table)
    if (info["n_rows"], info["n_errors"]) != (n, e):
        problems.append(f"catalog says {info['n_rows']} rows / {info['n_errors']} errors, store has {n} / {e}")
    if rows is not None and (rows, errors) != (n, e):
        problems.append(f"ingest() said {rows} rows / {errors} errors, store has {n} / {e}")
    if sum(r["canary"] for r in table):
        problems.append("a canary value from outside the dump is in the store")
    return problems


def _not_in_catalog(store: Path) -> list[str]:
    if not (store / "runs.parquet").exists():
        return []
    return ["a failed ingest left run 'r' in the catalog"] if "r" in open_store(store).run_names() else []


# ------------------------------------------------------------------------------------------ one case


def run_library_case(case: Case, template: Path, work: Path) -> None:
    built = case.build(template, work / "case")
    store = work / "store"
    before = snapshot(work, store)
    what = f"{case.name} [{built.description}]"
    try:
        with _WATCH.watching(built.canary, store) as hits, time_limit(CASE_SECONDS, what):
            try:
                res = ingest(
                    built.ingest_path,
                    "r",
                    store=store,
                    jobs=1,
                    options=IngestOptions(load_tensors=case.seed[-1] != "7"),
                )
            except DumpstoreError as exc:
                res = exc
    except CaseTimeout:
        raise
    except Exception:  # anything but DumpstoreError is a bug: show which case and where
        pytest.fail(f"{what}: {traceback.format_exc()}", pytrace=False)
    problems = list(hits) + _diff(before, snapshot(work, store))
    if isinstance(res, DumpstoreError):
        message = str(res)
        if "\n" in message or "\r" in message:
            problems.append(f"error is not one line: {message!r}")
        if not built.fatal_ok:
            problems.append(f"leaf-level damage failed the whole ingest: {message}")
        problems += _not_in_catalog(store)
    else:
        # a third of the cases through `dumpstore query`'s SQL path, the others straight from the Parquet files
        problems += check_store(built, store, res.rows, res.errors, sql=case.seed[-1] in "048")
    assert not problems, f"{what}: {problems}"


def run_cli_case(case: Case, template: Path, work: Path) -> None:
    built = case.build(template, work / "case")
    store = work / "store"
    before = snapshot(work, store)
    what = f"{case.name} [{built.description}]"
    cmd = [
        sys.executable,
        "-m",
        "dumpstore.cli.main",
        "ingest",
        os.fsencode(built.ingest_path),
        "--run",
        "r",
        "--store",
        str(store),
        "-j",
        "2" if case.seed[-1] in "05" else "1",
    ]
    cmd += ["--no-tensors"] if case.seed.endswith("3") else []
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=CLI_SECONDS, cwd=work)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: the CLI still ran after {CLI_SECONDS} s", pytrace=False)
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    problems = _diff(before, snapshot(work, store))
    if proc.returncode not in (0, 1) or "Traceback" in out + err:
        problems.append(f"exit {proc.returncode}: {err[-3000:]}")
    elif proc.returncode == 1:
        if not (err.startswith("Error: ") and err.count("\n") == 1 and err.endswith("\n") and not out):
            problems.append(f"exit 1 without exactly one line 'Error: ...': {err!r}")
        if not built.fatal_ok:
            problems.append(f"leaf-level damage failed the whole ingest: {err.strip()}")
        problems += _not_in_catalog(store)
    else:
        problems += check_store(built, store, None, None)
    assert not problems, f"{what}: {problems}"


# ------------------------------------------------------------------------------------------- the tests


def _ids(cs: list[Case]) -> list[str]:
    return [c.name for c in cs]


LIBRARY_CASES = cases(N_CASES, seed=0)
CLI_CASES = cases(N_CLI, seed=1)


@pytest.mark.parametrize("case", LIBRARY_CASES, ids=_ids(LIBRARY_CASES))
def test_fuzzed_dump_library(case: Case, template: Path, tmp_path: Path) -> None:
    run_library_case(case, template, tmp_path)


@pytest.mark.parametrize("case", CLI_CASES, ids=_ids(CLI_CASES))
def test_fuzzed_dump_cli(case: Case, template: Path, tmp_path: Path) -> None:
    run_cli_case(case, template, tmp_path)


@pytest.mark.slow
def test_fuzzed_dumps_many(template: Path, tmp_path: Path) -> None:
    failures = []
    for i, case in enumerate(cases(N_SLOW, seed=2)):
        work = tmp_path / str(i)
        try:
            run_library_case(case, template, work)
        except (AssertionError, pytest.fail.Exception, CaseTimeout) as exc:
            failures.append(str(exc)[:2000])
        except Exception:  # the generator itself
            failures.append(f"{case.name}: {traceback.format_exc()[-2000:]}")
        finally:
            _remove(work)
    assert not failures, f"{len(failures)} of {N_SLOW} cases failed:\n" + "\n".join(failures[:30])


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# -------------------------------------------------------------------------------- the generator itself


def test_generator_covers_every_mutation_and_is_deterministic(template: Path, tmp_path: Path) -> None:
    from fuzz import MUTATIONS

    assert {m for c in LIBRARY_CASES for m in c.mutations} == set(MUTATIONS)
    a = cases(40, seed=5)[-1].build(template, tmp_path / "a")
    b = cases(40, seed=5)[-1].build(template, tmp_path / "b")
    assert a.description == b.description


def test_crafted_pt_matches_torch(template: Path, tmp_path: Path) -> None:
    """The fuzzer's hand-written torch.save files (canaries, bombs) are what torch itself reads."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from fuzz import write_pt

    for arr in (
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.full((2, 8), CANARY, np.int64),
        np.array(2.5, np.float64),
        np.zeros((0, 4), np.float32),
    ):
        write_pt(tmp_path / "t.pt", arr)
        got = torch.load(tmp_path / "t.pt", weights_only=True).numpy()
        assert got.dtype == arr.dtype and np.array_equal(got, arr)


def test_unchanged_template_ingests_without_errors(template: Path, tmp_path: Path) -> None:
    built = Case("pristine", "x-0", ()).build(template, tmp_path / "case")
    res = ingest(built.ingest_path, "r", store=tmp_path / "store", jobs=1)
    assert res.errors == 0 and res.tensor_files == 20
    assert check_store(built, tmp_path / "store", res.rows, res.errors) == []
    st = open_store(tmp_path / "store")
    key = lambda g: (g["source"], g["step"], g["rank"])  # noqa: E731
    assert sorted(_groups_sql(st), key=key) == sorted(_groups_parquet(st), key=key)


def test_the_guards_see_a_read_and_a_write_outside(template: Path, tmp_path: Path) -> None:
    """The audit hook, the snapshot and the canary-value check each catch what they are meant to catch."""
    import json

    built = Case("pristine", "x-0", ()).build(template, tmp_path / "case")
    store = tmp_path / "store"
    before = snapshot(tmp_path, store)
    with _WATCH.watching(built.canary, store) as hits:
        (built.canary / "secret.pt").read_bytes()
        (built.dump / "new.txt").write_text("x")
    assert any("secret.pt" in h for h in hits) and any("new.txt" in h and "writing" in h for h in hits)
    assert any("new.txt" in d for d in _diff(before, snapshot(tmp_path, store)))
    dump_json = built.dump / "step1" / "rank0" / "dump.json"
    doc = json.loads(dump_json.read_text())
    next(iter(doc["data"].values()))["input_args"][1]["Max"] = CANARY
    dump_json.write_text(json.dumps(doc))
    res = ingest(built.ingest_path, "r", store=store, jobs=1)
    assert check_store(built, store, res.rows, res.errors) == ["a canary value from outside the dump is in the store"]

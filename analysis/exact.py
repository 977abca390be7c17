"""Exact metrics from the full tensor files, replacing sketch/stats estimates (`compare_runs(..., exact=True)`).

For every aligned row whose two sides are tensor leaves with a tensor file that was loaded at ingest, the two
files are found again under each run's ingested path (the catalog's `source_path`), loaded a few pairs at a
time, and compared with `metrics.tensor_metrics` (msprobe 26.2.0 tensor mode, cell by cell; the small pairs of a
batch together, `metrics.tensor_metrics_many`, with the same values); pairs whose files held equal contents at
ingest (content hashes) and are unchanged since are compared once:

  err            rel_l2 ||x - y|| / ||y|| over positions finite on both sides (err_source 'exact', err_bound 0);
                 inf where the NaN/Inf positions differ (the finite-part rel_l2 goes into `detail`);
                 left as it was where msprobe cannot compare the pair (shapes differ after squeeze)
  cosine, max_abs_err, max_rel_err, euc_dist, one_thousandth, five_thousandth
                 msprobe's values before its rounding; where msprobe writes text for an equal-size pair
                 (0-d, one element, NaN/Inf positions differ) cosine and max_abs_err fall back to dumpstore's
                 own over positions finite on both sides
  msprobe_cosine, msprobe_euc_dist, msprobe_max_abs_err, msprobe_max_rel_err, msprobe_one_thousandth,
  msprobe_five_thousandth
                 the cells exactly as msprobe writes them: str(float) or 'unsupported', 'N/A', 'Nan',
                 'shape unmatched'; msprobe_message its per-tensor messages
  nonfinite_mismatch, severity, status
                 recomputed (NaN/Inf positions compared exactly; tol kept)

Rows without two loaded files keep their values and get nulls in the new columns. A pair whose files cannot
be read again (moved, deleted, changed since ingest, unreadable) keeps its sketch/stats values; the reason is
appended to `detail`.

Size: one path (files found again, loaded in bounded batches, compared, the rows rewritten) whose steps share
the batch bookkeeping and the content-hash groups.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate, chain
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dumpstore.errors import DumpFormatError, DumpstoreError
from dumpstore.layout import find_units
from dumpstore.schema import TENSOR_FILE_COLUMNS
from dumpstore.tensorfile import (
    TENSOR_DIR,
    MissingFile,
    fingerprint,
    forget_folders,
    load,
    load_leaf,
    loaded_in_batches,
    resolve,
)

from . import metrics
from . import rules as R
from .load import run_files

MSPROBE_COLUMNS: dict[str, str] = {
    metrics.COSINE: "msprobe_cosine",
    metrics.EUC_DIST: "msprobe_euc_dist",
    metrics.MAX_ABS_ERR: "msprobe_max_abs_err",
    metrics.MAX_RELATIVE_ERR: "msprobe_max_rel_err",
    metrics.ONE_THOUSANDTH: "msprobe_one_thousandth",
    metrics.FIVE_THOUSANDTHS: "msprobe_five_thousandth",
}

NEW_SCHEMA: dict[str, pl.DataType] = {
    "euc_dist": pl.Float64(),
    "one_thousandth": pl.Float64(),
    "five_thousandth": pl.Float64(),
    **{c: pl.String() for c in MSPROBE_COLUMNS.values()},
    "msprobe_message": pl.String(),
}

# existing columns this module may overwrite (always with the row's old value where nothing changes)
_UPDATED = (
    "err",
    "err_source",
    "err_bound",
    "cosine",
    "max_abs_err",
    "max_rel_err",
    "nonfinite_mismatch",
    "severity",
    "status",
    "detail",
)
_STATS = ("min", "max", "mean", "norm", "nan_count")  # exact, from the files at ingest
_NEEDED = (
    "step",
    "rank",
    "source",
    "rank_dir",
    "ref_rank_dir",
    "data_name",
    "ref_data_name",
    "shape",
    "ref_shape",
    "tol",
    *_UPDATED,
    *_STATS,
    *(f"ref_{s}" for s in _STATS),
)


@dataclass(frozen=True)
class _Folder:
    """Where one (step, rank, source) unit's tensor files lie."""

    path: Path  # dump.json's folder (files in dump_tensor_data/) or a plain folder of tensor files
    kind: str  # 'dump' or 'files'
    rank_dir: str


class _RunFiles:
    """Locates the tensor files of one run under its ingested path; built once per comparison."""

    def __init__(self, store, run: str):
        self.run = run
        self.root = ""
        self.folders: dict[tuple[int, int, str], _Folder] = {}
        self.problem: str | None = None
        try:
            self.root = str(store.run_info(run).get("source_path") or "")
            if not self.root:
                raise DumpFormatError("the catalog holds no source path")
            for u in find_units(self.root, quiet=True):
                folder = u.path.parent if u.kind == "dump" else u.path
                self.folders[(int(u.step), int(u.rank), u.source or "")] = _Folder(folder, u.kind, u.rank_dir)
        except (DumpstoreError, OSError) as exc:
            self.problem = f"run {run!r}: dump folder {self.root or '?'} cannot be read again ({_first_line(exc)})"

    def _folder(self, step: int, rank: int, source: str | None, rank_dir: str | None) -> _Folder:
        """The folder of one (step, rank, source) unit; raises DumpFormatError saying why it cannot be used."""
        if self.problem:
            raise DumpFormatError(self.problem)
        folder = self.folders.get((int(step), int(rank), source or ""))
        if folder is None:
            raise DumpFormatError(
                f"run {self.run!r}: no dump folder for step {step} rank {rank} under {self.root} any more"
            )
        if rank_dir and folder.rank_dir and rank_dir != folder.rank_dir:
            raise DumpFormatError(
                f"run {self.run!r}: step {step} rank {rank} was ingested from {rank_dir}, "
                f"now lies in {folder.rank_dir}; re-ingest the run"
            )
        return folder

    def path(self, step: int, rank: int, source: str | None, rank_dir: str | None, data_name: str) -> Path:
        """The tensor file of one leaf; raises DumpFormatError saying why it cannot be used."""
        folder = self._folder(step, rank, source, rank_dir)
        path = resolve(folder.path, data_name) if folder.kind == "dump" else _plain_file(folder.path, data_name)
        if not path.is_file():
            raise DumpFormatError(f"tensor file {path} is missing (moved or deleted since ingest)")
        return path

    def load(
        self, step: int, rank: int, source: str | None, rank_dir: str | None, data_name: str
    ) -> tuple[np.ndarray, str]:
        """The values and stored dtype of one leaf's tensor file (at `where`); raises DumpFormatError saying why it
        cannot be read.

        A .pt file of a dump folder costs the syscalls of `load_leaf` (an lstat, an open that refuses links, an
        fstat, a read)."""
        folder = self._folder(step, rank, source, rank_dir)
        if folder.kind == "dump" and os.path.splitext(data_name)[1].lower() == ".pt":
            try:
                arr, stored, _ = load_leaf(folder.path, data_name)
                return arr, stored
            except MissingFile as exc:
                raise DumpFormatError(f"{exc} (moved or deleted since ingest)") from None
        path = self.path(step, rank, source, rank_dir, data_name)
        try:
            return load(path)
        except OSError as exc:
            raise DumpFormatError(f"{path}: cannot be read ({_first_line(exc)})") from None

    def where(self, step: int, rank: int, source: str | None, rank_dir: str | None, data_name: str) -> str:
        """The path of one leaf's tensor file, for messages (its folder must be usable: `_folder`)."""
        folder = self._folder(step, rank, source, rank_dir)
        if folder.kind == "dump":
            return os.path.join(folder.path, TENSOR_DIR, data_name)
        return os.path.join(folder.path, data_name)

    def tensor_dir(self, step: int, rank: int, source: str | None, rank_dir: str | None) -> str | None:
        """The folder holding one unit's tensor files, as text; None when the unit cannot be used (`_folder`)."""
        try:
            folder = self._folder(step, rank, source, rank_dir)
        except DumpstoreError:
            return None
        return str(folder.path / TENSOR_DIR if folder.kind == "dump" else folder.path)

    def unchanged(self, files: list[tuple[tuple, str, int | None, int | None]]) -> list[bool]:
        """For each file ((step, rank, source, rank_dir), data_name, size, mtime ns at ingest): whether it is still a
        plain file with that size and mtime.

        One lstat per file, nothing opened but each unit's folder (once, for the lstats relative to it): a file
        replaced by a link (or anything else) counts as changed."""
        ok = [False] * len(files)
        by_unit: dict[tuple, list[int]] = {}
        for i, f in enumerate(files):
            by_unit.setdefault(f[0], []).append(i)
        for unit, which in by_unit.items():
            base = self.tensor_dir(*unit)
            if base is not None:
                _stamps_match(base, [files[i] for i in which], ok, which)
        return ok


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_PATH", 0)


def _stamps_match(
    base: str, files: list[tuple[tuple, str, int | None, int | None]], ok: list[bool], at: list[int]
) -> None:
    """Set ok[at[i]] for the files of one folder `base` that are plain files with their stamps (lstat relative to the
    folder where the system allows it)."""
    fd = None
    if os.stat in os.supports_dir_fd:
        try:
            fd = os.open(base, _DIR_FLAGS)
        except OSError:
            return
    try:
        for i, (_, name, size, mtime) in zip(at, files):
            if size is None or mtime is None or not name or "/" in name or "\\" in name or name in (".", ".."):
                continue
            try:
                info = os.lstat(name, dir_fd=fd) if fd is not None else os.lstat(os.path.join(base, name))
            except (OSError, ValueError):  # ValueError: a NUL in the name
                continue
            ok[i] = stat.S_ISREG(info.st_mode) and info.st_size == size and info.st_mtime_ns == mtime
    finally:
        if fd is not None:
            os.close(fd)


def _plain_file(folder: Path, data_name: str) -> Path:
    """A file of a plain tensor folder, refusing names that leave it and links."""
    if (
        not data_name
        or "/" in data_name
        or "\\" in data_name
        or data_name in (".", "..")
        or "\x00" in data_name
        or os.path.isabs(data_name)
    ):
        raise DumpFormatError(f"data_name {data_name!r} is not a plain file name inside {folder}")
    path = folder / data_name
    if path.is_symlink():
        raise DumpFormatError(f"{path}: tensor file is a link; refusing to read it")
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# a candidate row as the workers see it, all they read of it: a plain tuple of these columns (a NamedTuple pickles
# three times slower); `_load` and `_unchanged_rows` take it apart
_LOC = (
    *("step", "rank", "source"),
    *("rank_dir", "data_name", "shape", "file_size", "file_mtime_ns", "content_hash"),
    *("ref_rank_dir", "ref_data_name", "ref_shape", "ref_file_size", "ref_file_mtime_ns", "ref_content_hash"),
)
_Loc = tuple[Any, ...]
# one side's rank_dir, data_name, shape, file_size, file_mtime_ns, content_hash
_TARGET, _REF = slice(3, 9), slice(9, 15)


def _load(files: _RunFiles, row: _Loc, side: str) -> np.ndarray:
    """One side's tensor of a row, for comparison (`_read_side`)."""
    return _read_side(files, row, side)


def _read_side(files: _RunFiles, row: _Loc, side: str) -> np.ndarray:
    """The values of one side's tensor file of a row, checked against the shape and content (hash) it had at ingest:
    a file edited since (even with its size and mtime put back) is refused, never compared."""
    rank_dir, name, shape, _, _, digest = row[_TARGET if side == "target" else _REF]
    arr, stored = files.load(row[0], row[1], row[2], rank_dir, name)
    if shape is not None and list(arr.shape) != list(shape):
        path = files.where(row[0], row[1], row[2], rank_dir, name)
        raise DumpFormatError(
            f"{path}: has shape {list(arr.shape)} but had {list(shape)} at ingest "
            "(changed since ingest); re-ingest the run"
        )
    if digest is not None and fingerprint(arr, stored) != digest:
        path = files.where(row[0], row[1], row[2], rank_dir, name)
        raise DumpFormatError(f"{path}: contents changed since ingest; re-ingest the run")
    if arr.dtype.kind == "c":  # both parts compared: (..., 2) real and imaginary (x and conj(x) differ)
        arr = np.ascontiguousarray(arr).view(arr.real.dtype).reshape(*arr.shape, 2)
    return arr


def _verified(files: _RunFiles, row: _Loc) -> None:
    """Read the reference's file of a row only to check its content hash (raises DumpFormatError when it changed)."""
    _read_side(files, row, "ref")


def _finite_max_abs(x: np.ndarray, y: np.ndarray) -> float | None:
    xf = np.asarray(x, dtype=np.float64).reshape(-1)
    yf = np.asarray(y, dtype=np.float64).reshape(-1)
    keep = np.isfinite(xf) & np.isfinite(yf)
    if not keep.any():
        return None
    return float(np.max(np.abs(xf[keep] - yf[keep])))


def _pair_arrays(
    row: _Loc, t_files: _RunFiles, r_files: _RunFiles, same: bool = False
) -> tuple[np.ndarray, np.ndarray] | str:
    """The pair's two tensors, or why they cannot be read.

    `same`: the two files held equal contents at ingest (equal content hashes), so the target is compared with
    itself (every metric works on copies of its inputs, so the values are those of the two files); the reference
    file is still read for its hash (`_verified`): an edit of either file since ingest is caught."""
    try:
        x = _load(t_files, row, "target")
        if same:
            _verified(r_files, row)
            return x, x
        return x, _load(r_files, row, "ref")
    except (DumpFormatError, ValueError) as exc:
        return f"exact metrics unavailable: {_first_line(exc)}"


def _pair_values(arrays: tuple[np.ndarray, np.ndarray] | str, tm: metrics.TensorMetrics | None = None) -> dict | str:
    """What the pair's two tensors give (the row-independent part of `_updated`), or why there is nothing;
    `tm`: their `metrics.tensor_metrics` where already known."""
    if isinstance(arrays, str):
        return arrays
    x, y = arrays
    if tm is None:
        try:
            tm = metrics.tensor_metrics(x, y)
        except ValueError as exc:
            return f"exact metrics unavailable: {_first_line(exc)}"
    same_size = x.size == y.size and x.size > 0
    if same_size and x.size > metrics.LARGE and (tm.cosine is None or tm.max_abs_err is None):
        cos, max_abs = metrics.large_finite_cosine_and_max_abs(x, y)  # chunk by chunk: no full-size copies
        tm = dataclasses.replace(
            tm,
            cosine=tm.cosine if tm.cosine is not None else cos,
            max_abs_err=tm.max_abs_err if tm.max_abs_err is not None else max_abs,
        )
    return {
        **{col: str(tm.msprobe[name]) for name, col in MSPROBE_COLUMNS.items()},
        "msprobe_message": tm.message,
        "euc_dist": tm.euc_dist,
        "one_thousandth": tm.one_thousandth,
        "five_thousandth": tm.five_thousandth,
        "max_rel_err": tm.max_rel_err,
        "cosine": tm.cosine if tm.cosine is not None or not same_size else metrics.cosine(x, y),
        "max_abs_err": tm.max_abs_err if tm.max_abs_err is not None or not same_size else _finite_max_abs(x, y),
        "rel_l2": tm.rel_l2 if tm.rel_l2 is not None else (0.0 if x.size == 0 and y.size == 0 else None),
        "nonfinite_mismatch": tm.nonfinite_mismatch,
    }


# the columns of `_pair_columns`: a pair's `_pair_values` (floats, texts), `why` it has none, and the texts it adds to
# `detail` where its NaN/Inf positions differ
_VALUE_KEYS = (*NEW_SCHEMA, "max_rel_err", "cosine", "max_abs_err", "rel_l2")
_VALUE_SCHEMA: dict[str, pl.DataType] = {
    **{f"_v_{c}": NEW_SCHEMA.get(c, pl.Float64()) for c in _VALUE_KEYS},
    "_v_nonfinite": pl.Boolean(),
    "_v_why": pl.String(),
    "_v_positions": pl.String(),
    "_v_finite": pl.String(),
}


def _pair_columns(values: list[dict | str]) -> dict[str, list]:
    """The `_VALUE_SCHEMA` columns of the pairs read, one item per pair (plain lists: the workers make them, and
    build no Polars frame, which a forked process must not)."""
    got = [None if isinstance(v, str) else v for v in values]
    cols = {f"_v_{c}": [None if v is None else v[c] for v in got] for c in _VALUE_KEYS}
    cols["_v_nonfinite"] = [v is not None and bool(v["nonfinite_mismatch"]) for v in got]
    cols["_v_why"] = [v if isinstance(v, str) else None for v in values]
    cols["_v_positions"] = [
        None if v is None else f"NaN/Inf positions differ at {v['nonfinite_mismatch']} elements" for v in got
    ]
    cols["_v_finite"] = [
        None if v is None or v["rel_l2"] is None else f"rel_l2 over positions finite on both sides {v['rel_l2']:.6g}"
        for v in got
    ]
    return cols


def _joined(old: pl.Expr, new: pl.Expr) -> pl.Expr:
    """`old; new`, or `new` where old is null or empty (the way `detail` grows)."""
    return pl.when(old.is_null() | (old == "")).then(new).otherwise(pl.concat_str(old, pl.lit("; "), new))


def _updated(frame: pl.DataFrame, pairs: pl.DataFrame, pair: pl.Series) -> pl.DataFrame:
    """The updated and new columns of the candidate rows (`frame`), row i given the values of pair `pair[i]` (a row
    of `pairs`, `_pair_columns`):

    a pair without values keeps the row's and appends why to `detail`; one whose rel_l2 msprobe cannot give (shapes
    differ) sets the metric columns and keeps the row's verdict; the others set err (inf where the NaN/Inf positions
    differ on either count, the finite part's rel_l2 then in `detail`), nonfinite_mismatch and the verdict."""
    v = pairs[pair]
    f = pl.concat([frame.select(*_UPDATED, "tol"), v], how="horizontal")
    col, d = pl.col, pl.col("detail")
    row_nonfinite = col("nonfinite_mismatch").fill_null(False)
    is_set = col("_v_why").is_null()
    exact = is_set & col("_v_rel_l2").is_not_null()
    mismatch = col("_v_nonfinite") | row_nonfinite
    positions = pl.when(~row_nonfinite | d.is_null() | (d == "")).then(_joined(d, col("_v_positions"))).otherwise(d)
    f = f.with_columns(
        # a pair whose files cannot be read again (missing, changed since ingest) is not judged: --exact never
        # answers from the sketch in its place (issue 24)
        pl.when(exact & mismatch)
        .then(math.inf)
        .when(exact)
        .then(col("_v_rel_l2"))
        .when(~is_set)
        .then(None)
        .otherwise(col("err"))
        .alias("err"),
        pl.when(exact)
        .then(pl.lit("exact"))
        .when(~is_set)
        .then(pl.lit("none"))
        .otherwise(col("err_source"))
        .alias("err_source"),
        pl.when(exact).then(0.0).when(~is_set).then(None).otherwise(col("err_bound")).alias("err_bound"),
        pl.when(~is_set).then(None).otherwise(col("severity")).alias("severity"),
        pl.when(~is_set).then(pl.lit("unknown")).otherwise(col("status")).alias("status"),
        pl.when(exact).then(mismatch).otherwise(col("nonfinite_mismatch")).alias("nonfinite_mismatch"),
        pl.when(~is_set)
        .then(_joined(d, col("_v_why")))
        .when(exact & mismatch)
        .then(_joined(positions, col("_v_finite")))
        .otherwise(d)
        .alias("detail"),
        *[
            pl.when(is_set).then(col(f"_v_{c}")).otherwise(col(c)).alias(c)
            for c in ("cosine", "max_abs_err", "max_rel_err")
        ],
        (exact & col("tol").is_not_null()).alias("_verdict"),
    )
    _note_unavailable(f.filter(~is_set)["_v_why"].to_list())
    return _with_verdicts(f).select(*_UPDATED, *[col(f"_v_{c}").alias(c) for c in NEW_SCHEMA])


def tensor_dirs(store, runs: list[str]) -> list[str]:
    """The folders holding the tensor files of `runs` (for the memo of `--exact` answers: `memo.folders_digest`)."""
    out: set[str] = set()
    for run in runs:
        files = _RunFiles(store, run)
        for folder in files.folders.values():
            out.add(str(folder.path / TENSOR_DIR if folder.kind == "dump" else folder.path))
    return sorted(out)


_UNAVAILABLE: list[list[str]] = []  # open `unavailable_pairs` collections (innermost last)


@contextmanager
def unavailable_pairs() -> Iterator[list[str]]:
    """Collect, while open, why each pair `--exact` could not compare (missing, changed or unreadable files): such
    pairs are `unknown` rows, and the verdict says how many (never a silent fallback to the sketch)."""
    got: list[str] = []
    _UNAVAILABLE.append(got)
    try:
        yield got
    finally:
        _UNAVAILABLE.remove(got)


def _note_unavailable(why: list[str]) -> None:
    if not why:
        return
    for got in _UNAVAILABLE:
        got.extend(why)
    if not _UNAVAILABLE:
        import warnings

        from dumpstore.errors import DumpstoreWarning

        warnings.warn(
            f"--exact: {len(why)} tensor pairs not compared, left unknown ({why[0]})", DumpstoreWarning, stacklevel=2
        )


def _with_verdicts(f: pl.DataFrame) -> pl.DataFrame:
    """Severity and status of the rows marked `_verdict` from their err, tol and nonfinite_mismatch (the rules
    work on arrays as on floats, element by element)."""
    mark = f["_verdict"].to_numpy()
    if not mark.any():
        return f
    got = f.filter(pl.col("_verdict"))
    err, tol = got["err"].to_numpy().astype(np.float64), got["tol"].to_numpy().astype(np.float64)
    severity, diverged = np.zeros(f.height), np.zeros(f.height, bool)
    severity[mark] = R.severity(err, tol)
    diverged[mark] = R.diverges(err, tol, got["nonfinite_mismatch"].to_numpy())
    # (Series from lists: one from a numpy array imports numpy.ma, ~20 ms)
    status = pl.when(pl.Series(diverged.tolist(), dtype=pl.Boolean)).then(pl.lit("diverged")).otherwise(pl.lit("pass"))
    return f.with_columns(
        pl.when("_verdict")
        .then(pl.Series(severity.tolist(), dtype=pl.Float64))
        .otherwise(pl.col("severity"))
        .alias("severity"),
        pl.when("_verdict").then(status).otherwise(pl.col("status")).alias("status"),
    )


_PARALLEL_MIN = 512  # groups of pairs: below this, starting workers costs more than it saves

_Work = tuple[_Loc, bool]  # a row whose files are read, and whether its two files hold equal contents
# the rows of some groups, group after group, as `_LOC` columns (plain lists pickle in half the time of the rows'
# tuples); each group's (number of rows, whether its two contents are equal)
_Chunk = tuple[list[list], list[tuple[int, bool]], _RunFiles, _RunFiles]


def _pair_values_all(
    cols: list[list], groups: list[tuple[int, bool]], t_files: _RunFiles, r_files: _RunFiles, jobs: int | None
) -> tuple[dict[str, list], list[int]]:
    """The `_pair_columns` of the pairs read for the groups (a `_Chunk`), and for each row in order the index of its
    pair's item; in worker processes (contiguous chunks) when there are many groups."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(groups) // (_PARALLEL_MIN // 2) or 1))
    if jobs < 2 or len(groups) < _PARALLEL_MIN:
        return _pair_chunk((cols, groups, t_files, r_files))
    from concurrent.futures import ProcessPoolExecutor

    size = -(-len(groups) // (jobs * 4))  # a few chunks per worker evens out slow files
    chunks: list[_Chunk] = []
    start = 0
    for i in range(0, len(groups), size):
        n = sum(k for k, _ in groups[i : i + size])
        chunks.append(([c[start : start + n] for c in cols], groups[i : i + size], t_files, r_files))
        start += n
    values: dict[str, list] = {c: [] for c in _VALUE_SCHEMA}
    where: list[int] = []
    with ProcessPoolExecutor(max_workers=jobs, initializer=_worker_start) as pool:
        for got, at in pool.map(_pair_chunk, chunks):
            done = len(values["_v_why"])
            where.extend(i + done for i in at)
            for c, items in got.items():
                values[c].extend(items)
    return values, where


def _worker_start() -> None:
    """A worker's collections leave alone what it inherited from this process (scanning it copied ~8k pages per
    worker); it collects its own garbage (it inherits the collector paused by `add_exact_metrics`)."""
    gc.freeze()
    gc.enable()


def _pair_chunk(job: _Chunk) -> tuple[dict[str, list], list[int]]:
    """`_pair_values_all` of a chunk of groups: the files each group needs (`_group_reads`) loaded a few pairs at a
    time (tensorfile.loaded_in_batches) and the metrics of each batch's small pairs computed together."""
    cols, sizes, t_files, r_files = job
    rows: list[_Loc] = list(zip(*cols))
    starts = list(accumulate((k for k, _ in sizes), initial=0))
    groups = [(rows[at : at + k], same) for at, (k, same) in zip(starts, sizes)]
    looked = [row for members, same in groups if same or len(members) > 1 for row in members]
    fine = iter(_unchanged_rows(looked, t_files, r_files))
    reads: list[_Work] = []
    where: list[int] = []
    for members, same in groups:
        _group_reads(members, same, fine, reads, where)
    values: list[dict | str] = []
    for batch in loaded_in_batches(reads, lambda w: _pair_arrays(w[0], t_files, r_files, w[1]), _pair_bytes):
        loaded = [arrays for _, arrays in batch if not isinstance(arrays, str)]
        known = iter(metrics.tensor_metrics_many(loaded))
        values.extend(_pair_values(arrays, None if isinstance(arrays, str) else next(known)) for _, arrays in batch)
    return _pair_columns(values), where


def _group_reads(members: list[_Loc], same: bool, fine: Iterator[bool], reads: list[_Work], where: list[int]) -> None:
    """Append to `where`, for each row of a group, the index in `reads` of the pair read for it (appended): the rows
    whose two files are unchanged since ingest (the next of `fine`, `_unchanged_rows`) share one read of the first
    of them (of one file when the two hold equal contents); a changed row's files are read for it alone. A lone row
    of unequal contents is read without looking (`fine` holds nothing for it)."""
    if len(members) == 1 and not same:
        reads.append((members[0], False))
        where.append(len(reads) - 1)
        return
    shared: int | None = None
    for row in members:
        if not next(fine):
            reads.append((row, False))
            where.append(len(reads) - 1)
            continue
        if shared is None:
            reads.append((row, same))
            shared = len(reads) - 1
        where.append(shared)


def _unchanged_rows(rows: list[_Loc], t_files: _RunFiles, r_files: _RunFiles) -> list[bool]:
    """Whether both files of each row are as they were at ingest (`_RunFiles.unchanged`)."""
    t, r = t_files.unchanged(_side_files(rows, _TARGET)), r_files.unchanged(_side_files(rows, _REF))
    return [a and b for a, b in zip(t, r)]


def _side_files(rows: list[_Loc], side: slice) -> list[tuple[tuple, str, int | None, int | None]]:
    """((step, rank, source, rank_dir), data_name, size, mtime ns) of one side's file of each row."""
    out = []
    for row in rows:
        rank_dir, name, _, size, mtime, _ = row[side]
        out.append(((row[0], row[1], row[2], rank_dir), name, size, mtime))
    return out


def _pair_bytes(arrays: tuple[np.ndarray, np.ndarray] | str) -> int:
    if isinstance(arrays, str):
        return 0
    x, y = arrays
    return x.nbytes + (0 if y is x else y.nbytes)  # one read when the two files hold one content


def _exact_key(c: str, dtype: pl.DataType) -> list[pl.Expr]:
    """A statistic column as grouping-key columns equal where the values' reprs are: the column (Polars compares
    floats as equal where -0.0 and 0.0 meet and every NaN equals every NaN) and, for floats, whether it is -0.0."""
    if not dtype.is_float():
        return [pl.col(c)]
    negative_zero = (pl.col(c) == 0) & (1.0 / pl.col(c) < 0)
    return [pl.col(c), negative_zero.fill_null(False).alias(f"{c}_neg0")]


def _content_groups(frame: pl.DataFrame) -> list[tuple[list[int], bool]]:
    """The rows grouped by the contents their two files held at ingest, in order of their first rows, each with
    whether its two contents are equal (then one file is read). The content hash is XXH3, not cryptographic, so
    the exact statistics computed at ingest must agree too (`_exact_key`); a row whose hashes are unknown (a store
    written before hashes) is a group of its own. Whether the files changed since is looked at where they are read
    (`_group_reads`)."""
    unknown = pl.col("content_hash").is_null() | pl.col("ref_content_hash").is_null()
    stats = [k for c in (*_STATS, *(f"ref_{s}" for s in _STATS)) for k in _exact_key(c, frame.schema[c])]
    keys = frame.select(
        "content_hash", "ref_content_hash", *stats, pl.when(unknown).then(pl.int_range(pl.len())).alias("_solo")
    )
    groups = keys.with_columns(frame.select(_equal_contents(frame.schema)).to_series()).with_row_index("_i")
    got = groups.group_by(keys.columns, maintain_order=True).agg(pl.col("_i"), pl.col("_same").first())
    return list(zip(got["_i"].to_list(), got["_same"].to_list()))


def _equal_contents(schema: pl.Schema) -> pl.Expr:
    """Whether a row's two files held equal contents at ingest (`_same`): equal hashes and equal exact statistics
    (as `_exact_key` compares them; a target and reference statistic of different types never count as equal)."""
    same = (pl.col("content_hash") == pl.col("ref_content_hash")).fill_null(False)
    for s in _STATS:
        t, r = schema[s], schema[f"ref_{s}"]
        if t.is_float() != r.is_float() or (not t.is_float() and t != r):
            return pl.lit(False).alias("_same")
        for a, b in zip(_exact_key(s, t), _exact_key(f"ref_{s}", r)):
            same = same & a.eq_missing(b)
    return same.alias("_same")


_HASHED = ["source", "data_name", "file_status", *TENSOR_FILE_COLUMNS]
_FILE_KEY = ["step", "rank", "_source", "data_name"]


def _file_hashes(store, run: str, units: set[tuple[int, int]]) -> pl.DataFrame | None:
    """(step, rank, _source (source, "" for none), data_name, content_hash, file_size, file_mtime_ns) of the run's
    loaded tensor files in `units` that have a content hash, one row per file (the last where one repeats), from
    the store; None for a store written before content hashes."""
    frames = []
    for path, step, rank in run_files(store, run, units=units):
        if not set(TENSOR_FILE_COLUMNS) <= set(pl.read_parquet_schema(path)):
            return None
        t = pl.read_parquet(path, columns=_HASHED).filter(
            (pl.col("file_status") == "loaded") & pl.col("content_hash").is_not_null()
        )
        where = [pl.lit(step, pl.Int64).alias("step"), pl.lit(rank, pl.Int64).alias("rank")]
        frames.append(
            t.select(*where, pl.col("source").fill_null("").alias("_source"), "data_name", *TENSOR_FILE_COLUMNS)
        )
    if not frames:
        return None
    return pl.concat(frames, how="vertical_relaxed").unique(_FILE_KEY, keep="last", maintain_order=True)


def _with_hashes(store, target: str, ref: str, frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` with the content hashes and file stamps (TENSOR_FILE_COLUMNS) of both sides' files, `ref_` before
    the reference's (null where the store has none), joined on (step, rank, source, data_name)."""
    units = {(int(s), int(r)) for s, r in frame.select("step", "rank").unique().iter_rows()}
    frame = frame.with_columns(pl.col("source").fill_null("").alias("_source"))
    for run, p in ((target, ""), (ref, "ref_")):
        names = {c: f"{p}{c}" for c in TENSOR_FILE_COLUMNS}
        known = _file_hashes(store, run, units)
        if known is None:
            frame = frame.with_columns(pl.lit(None, _FILE_TYPES[c]).alias(n) for c, n in names.items())
            continue
        known = known.cast({"step": frame.schema["step"], "rank": frame.schema["rank"]})
        known = known.rename({"data_name": f"{p}data_name", **names})
        frame = frame.join(known, on=[*_FILE_KEY[:3], f"{p}data_name"], how="left", maintain_order="left")
    return frame.drop("_source")


_FILE_TYPES: dict[str, pl.DataType] = {
    "content_hash": pl.Binary(),
    "file_size": pl.Int64(),
    "file_mtime_ns": pl.Int64(),
}
_TEXT = ("source", "rank_dir", "ref_rank_dir", "data_name", "ref_data_name", "err_source", "status", "detail")
_NULL_TYPES: dict[str, pl.DataType] = {
    **dict.fromkeys(_TEXT, pl.String()),
    **dict.fromkeys(("step", "rank"), pl.Int64()),
    **dict.fromkeys(("shape", "ref_shape"), pl.List(pl.Int64())),
    "nonfinite_mismatch": pl.Boolean(),
}


def _candidates(picked: pl.DataFrame) -> pl.DataFrame:
    """The `_NEEDED` columns of the candidate rows, a null column for each that `picked` lacks."""
    return picked.select(
        *[c if c in picked.columns else pl.lit(None, _NULL_TYPES.get(c, pl.Float64())).alias(c) for c in _NEEDED]
    )


def _with_null_columns(rows: pl.DataFrame) -> pl.DataFrame:
    return rows.with_columns([pl.lit(None, dtype=t).alias(c) for c, t in NEW_SCHEMA.items()])


def _exact_pairs(frame: pl.DataFrame, t_files: _RunFiles, r_files: _RunFiles, jobs: int | None):
    """A table of the pairs read for the candidate rows (`frame`, hashes attached; `_pair_columns`), and for each row
    the index of its pair's row: the rows of a `_content_groups` group whose files are unchanged since ingest share the
    values of the first such row's files, read once (`_group_reads`)."""
    groups = _content_groups(frame)
    order = pl.Series(list(chain.from_iterable(m for m, _ in groups)), dtype=pl.Int64)
    grouped = frame.select(_LOC)[order]
    sizes = [(len(m), same) for m, same in groups]
    values, where = _pair_values_all([grouped[c].to_list() for c in _LOC], sizes, t_files, r_files, jobs)
    pair = pl.Series(where, dtype=pl.Int64).gather(order.arg_sort())  # row order[k]'s pair is where[k]
    return pl.DataFrame(values, schema=_VALUE_SCHEMA), pair


@contextmanager
def _no_collections() -> Iterator[None]:
    """The garbage collector paused: the rows' tuples and the pairs' values form no cycles, and collections would
    only walk them again and again (with the rest of the heap: ~40 ms a full one)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def add_exact_metrics(
    store, target: str, ref: str, rows: pl.DataFrame, tol, floor: str, jobs: int | None = None
) -> pl.DataFrame:
    """`rows` with exact metrics from the full tensor files wherever both sides have one (see module doc).

    `tol` (Tolerances) and `floor` (compute precision) are accepted for symmetry with the sketch path; each
    row keeps the tolerance it was given.  The file pairs are read and compared by `jobs` worker processes
    (default: the CPU count) when there are many.
    """
    forget_folders()
    del tol, floor  # each row already carries its tolerance
    rows = rows.drop([c for c in NEW_SCHEMA if c in rows.columns])
    needed = ("data_name", "ref_data_name", "file_status", "ref_file_status")
    if rows.height == 0 or any(c not in rows.columns for c in needed):
        return _with_null_columns(rows)
    cand = (
        pl.col("data_name").is_not_null()
        & pl.col("ref_data_name").is_not_null()
        & (pl.col("file_status") == "loaded")
        & (pl.col("ref_file_status") == "loaded")
    )
    if "kind" in rows.columns and "ref_kind" in rows.columns:
        cand = cand & (pl.col("kind") == "tensor") & (pl.col("ref_kind") == "tensor")
    hit = rows.select(cand.fill_null(False)).to_series()
    if not hit.any():
        return _with_null_columns(rows)
    frame = _with_hashes(store, target, ref, _candidates(rows).filter(hit))
    with _no_collections():
        pairs, pair = _exact_pairs(frame, _RunFiles(store, target), _RunFiles(store, ref), jobs)
        return _put_back(rows, hit, _updated(frame, pairs, pair))


def _put_back(rows: pl.DataFrame, hit: pl.Series, upd: pl.DataFrame) -> pl.DataFrame:
    """`rows` with the updated columns of the candidate rows (`hit`; `upd` holds theirs, in order) replaced, and the
    new columns (null in the other rows)."""
    full = upd[pl.select(pl.when(hit).then(hit.cum_sum().cast(pl.Int64) - 1)).to_series()]  # null: not a candidate
    kept = [c for c in _UPDATED if c in rows.columns]
    return rows.with_columns(
        *[pl.when(hit).then(full[c].cast(rows.schema[c])).otherwise(pl.col(c)).alias(c) for c in kept],
        *[full[c] for c in NEW_SCHEMA],
    )

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
"""

from __future__ import annotations

import gc
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dumpstore.errors import DumpFormatError, DumpstoreError
from dumpstore.layout import find_units
from dumpstore.schema import TENSOR_FILE_COLUMNS
from dumpstore.tensorfile import TENSOR_DIR, MissingFile, forget_folders, load, load_leaf, loaded_in_batches, resolve

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
        self.bases: dict[Path, str] = {}  # folder -> where its tensor files lie, as text
        try:
            self.root = str(store.run_info(run).get("source_path") or "")
            if not self.root:
                raise DumpFormatError("the catalog holds no source path")
            for u in find_units(self.root):
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
        """The values of one leaf's tensor file and its path; raises DumpFormatError saying why it cannot be read.

        A .pt file of a dump folder costs the syscalls of `load_leaf` (an lstat, an open that refuses links, an
        fstat, a read)."""
        folder = self._folder(step, rank, source, rank_dir)
        if folder.kind == "dump" and os.path.splitext(data_name)[1].lower() == ".pt":
            try:
                arr, _, _ = load_leaf(folder.path, data_name)
            except MissingFile as exc:
                raise DumpFormatError(f"{exc} (moved or deleted since ingest)") from None
            return arr, os.path.join(folder.path, TENSOR_DIR, data_name)
        path = self.path(step, rank, source, rank_dir, data_name)
        try:
            arr, _ = load(path)
        except OSError as exc:
            raise DumpFormatError(f"{path}: cannot be read ({_first_line(exc)})") from None
        return arr, str(path)

    def unchanged(self, step: int, rank: int, source: str | None, rank_dir: str | None, data_name: str, was) -> bool:
        """Whether the leaf's file is still a plain file with the size and mtime it had at ingest (`was`).

        One lstat, nothing opened: a file replaced by a link (or anything else) counts as changed."""
        if was is None or not data_name or "/" in data_name or "\\" in data_name or data_name in (".", ".."):
            return False
        try:
            folder = self._folder(step, rank, source, rank_dir)
            base = self.bases.get(folder.path)
            if base is None:
                base = self.bases[folder.path] = str(folder.path / TENSOR_DIR if folder.kind == "dump" else folder.path)
            info = os.lstat(os.path.join(base, data_name))
        except (DumpstoreError, OSError, ValueError):  # ValueError: a NUL in the name
            return False
        return stat.S_ISREG(info.st_mode) and (info.st_size, info.st_mtime_ns) == tuple(was)


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


def _load(files: _RunFiles, row: dict[str, Any], side: str) -> np.ndarray:
    p = "" if side == "target" else "ref_"
    arr, path = files.load(row["step"], row["rank"], row["source"], row.get(f"{p}rank_dir"), row[f"{p}data_name"])
    shape = row.get(f"{p}shape")
    if shape is not None and list(arr.shape) != list(shape):
        raise DumpFormatError(
            f"{path}: has shape {list(arr.shape)} but had {list(shape)} at ingest "
            "(changed since ingest); re-ingest the run"
        )
    return arr


def _finite_max_abs(x: np.ndarray, y: np.ndarray) -> float | None:
    xf = np.asarray(x, dtype=np.float64).reshape(-1)
    yf = np.asarray(y, dtype=np.float64).reshape(-1)
    keep = np.isfinite(xf) & np.isfinite(yf)
    if not keep.any():
        return None
    return float(np.max(np.abs(xf[keep] - yf[keep])))


def _join_detail(old: str | None, new: str) -> str:
    return f"{old}; {new}" if old else new


def _verdicts(ms: list[dict[str, Any]]) -> None:
    """Severity and status of the rows given an exact err (marked `_verdict`), all at once (the rules work on
    arrays as on floats, element by element)."""
    todo = [m for m in ms if m.pop("_verdict", False) and m["err"] is not None and m["tol"] is not None]
    if not todo:
        return
    err = np.array([m["err"] for m in todo], np.float64)
    tol = np.array([m["tol"] for m in todo], np.float64)
    severity = R.severity(err, tol).tolist()
    diverged = R.diverges(err, tol, np.array([bool(m["nonfinite_mismatch"]) for m in todo])).tolist()
    for m, sev, div in zip(todo, severity, diverged):
        m["severity"], m["status"] = sev, "diverged" if div else "pass"


def _pair_arrays(
    row: dict[str, Any], t_files: _RunFiles, r_files: _RunFiles, same: bool = False
) -> tuple[np.ndarray, np.ndarray] | str:
    """The pair's two tensors, or why they cannot be read.

    `same`: the two files hold equal contents (equal content hashes), so only the target is read and compared
    with itself: every metric works on copies of its inputs, so the values are those of the two files."""
    try:
        x = _load(t_files, row, "target")
        return x, x if same else _load(r_files, row, "ref")
    except (DumpFormatError, ValueError) as exc:
        return f"exact metrics unavailable: {_first_line(exc)}"


def _pair_values(arrays: tuple[np.ndarray, np.ndarray] | str, tm: metrics.TensorMetrics | None = None) -> dict | str:
    """What the pair's two tensors give (the row-independent part of `_exact_row`), or why there is nothing;
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


def _exact_row(row: dict[str, Any], values: dict | str) -> dict[str, Any]:
    """New values of the updated and new columns for one candidate row, from its pair's `_pair_values`."""
    m = {c: row[c] for c in _UPDATED} | {"tol": row["tol"]} | dict.fromkeys(NEW_SCHEMA)
    if isinstance(values, str):
        m["detail"] = _join_detail(m["detail"], values)
        return m
    m.update({c: v for c, v in values.items() if c not in ("rel_l2", "nonfinite_mismatch")})
    rl2 = values["rel_l2"]
    if rl2 is None:  # msprobe cannot compare the pair (shapes differ): the row's own verdict stands
        return m
    mismatch = bool(values["nonfinite_mismatch"]) or bool(row["nonfinite_mismatch"])
    m.update(err=rl2, err_source="exact", err_bound=0.0, nonfinite_mismatch=mismatch)
    if mismatch:
        m["err"] = math.inf
        if not row["nonfinite_mismatch"] or not m["detail"]:
            m["detail"] = _join_detail(
                m["detail"], f"NaN/Inf positions differ at {values['nonfinite_mismatch']} elements"
            )
        m["detail"] = _join_detail(m["detail"], f"rel_l2 over positions finite on both sides {rl2:.6g}")
    m["_verdict"] = True  # severity and status: `_verdicts`
    return m


_PARALLEL_MIN = 512  # groups of pairs: below this, starting workers costs more than it saves
# what the workers read of a row (`_load`, `_unchanged`): the only columns sent to them (a row pickles to ~500 bytes)
_LOCATION = (
    *("step", "rank", "source", "rank_dir", "data_name", "shape", "file_stamp"),
    *("ref_rank_dir", "ref_data_name", "ref_shape", "ref_file_stamp"),
)

_Work = tuple[dict[str, Any], bool]  # a row whose files are read, and whether its two files hold equal contents
_Group = tuple[list[dict[str, Any]], bool]  # rows whose files held the same two contents at ingest; equal contents


def _exact_rows(
    rows: list[dict[str, Any]],
    groups: list[tuple[list[int], bool]],
    t_files: _RunFiles,
    r_files: _RunFiles,
    jobs: int | None,
) -> list[dict[str, Any]]:
    """_exact_row for every row, in order, given its `_content_groups`: the rows of a group whose files are
    unchanged since ingest share the values of the first such row's files, read once (`_group_reads`)."""
    work = [([{c: rows[i].get(c) for c in _LOCATION} for i in members], same) for members, same in groups]
    values: list[dict | str] = [""] * len(rows)
    for (members, _), got in zip(groups, _pair_values_all(work, t_files, r_files, jobs)):
        for i, v in zip(members, got):
            values[i] = v
    out = [_exact_row(r, v) for r, v in zip(rows, values)]
    _verdicts(out)
    return out


def _pair_values_all(work: list[_Group], t_files: _RunFiles, r_files: _RunFiles, jobs: int | None) -> list:
    """_pair_values of the rows of every group, in order; in worker processes (contiguous chunks) when there are
    many groups."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work) // (_PARALLEL_MIN // 2) or 1))
    if jobs < 2 or len(work) < _PARALLEL_MIN:
        return _pair_chunk((work, t_files, r_files))
    from concurrent.futures import ProcessPoolExecutor

    size = -(-len(work) // (jobs * 4))  # a few chunks per worker evens out slow files
    chunks = [(work[i : i + size], t_files, r_files) for i in range(0, len(work), size)]
    with ProcessPoolExecutor(max_workers=jobs, initializer=_worker_start) as pool:
        return [v for part in pool.map(_pair_chunk, chunks) for v in part]


def _worker_start() -> None:
    """A worker's collections leave alone what it inherited from this process (scanning it copied ~8k pages per
    worker); it collects its own garbage (it inherits the collector paused by `add_exact_metrics`)."""
    gc.freeze()
    gc.enable()


def _pair_chunk(job: tuple[list[_Group], _RunFiles, _RunFiles]) -> list[list[dict | str]]:
    """_pair_values of the rows of each group of a chunk, in order: the files each group needs (`_group_reads`)
    loaded a few pairs at a time (tensorfile.loaded_in_batches) and the metrics of each batch's small pairs
    computed together."""
    groups, t_files, r_files = job
    reads: list[_Work] = []
    which = [_group_reads(members, same, t_files, r_files, reads) for members, same in groups]
    values: list[dict | str] = []
    for batch in loaded_in_batches(reads, lambda w: _pair_arrays(w[0], t_files, r_files, w[1]), _pair_bytes):
        loaded = [arrays for _, arrays in batch if not isinstance(arrays, str)]
        known = iter(metrics.tensor_metrics_many(loaded))
        values.extend(_pair_values(arrays, None if isinstance(arrays, str) else next(known)) for _, arrays in batch)
    return [[values[j] for j in where] for where in which]


def _group_reads(
    members: list[dict[str, Any]], same: bool, t_files: _RunFiles, r_files: _RunFiles, reads: list[_Work]
) -> list[int]:
    """For each row of a group, the index in `reads` of the pair read for it (appended): the rows whose two files
    are unchanged since ingest share one read of the first of them (of one file when the two hold equal contents);
    a changed row's files are read for it alone. A lone row of unequal contents is read without looking."""
    if len(members) == 1 and not same:
        reads.append((members[0], False))
        return [len(reads) - 1]
    shared: int | None = None
    where = []
    for row in members:
        if not _unchanged(row, t_files, r_files):
            reads.append((row, False))
            where.append(len(reads) - 1)
            continue
        if shared is None:
            reads.append((row, same))
            shared = len(reads) - 1
        where.append(shared)
    return where


def _unchanged(row: dict[str, Any], t_files: _RunFiles, r_files: _RunFiles) -> bool:
    """Whether both files of the row are as they were at ingest (`_RunFiles.unchanged`)."""
    where = (row["step"], row["rank"], row["source"])
    return t_files.unchanged(
        *where, row.get("rank_dir"), row["data_name"], row.get("file_stamp")
    ) and r_files.unchanged(*where, row.get("ref_rank_dir"), row["ref_data_name"], row.get("ref_file_stamp"))


def _pair_bytes(arrays: tuple[np.ndarray, np.ndarray] | str) -> int:
    if isinstance(arrays, str):
        return 0
    x, y = arrays
    return x.nbytes + (0 if y is x else y.nbytes)  # one read when the two files hold one content


def _content_groups(rows: list[dict[str, Any]]) -> list[tuple[list[int], bool]]:
    """The rows grouped by the contents their two files held at ingest (by content hash), in order of their first
    rows, each with whether its two contents are equal (then one file is read); a row whose hashes are unknown (a
    store written before hashes) is a group of its own. Whether the files changed since is looked at where they
    are read (`_group_reads`)."""
    groups: list[tuple[list[int], bool]] = []
    seen: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        key = _content_key(row)
        if key is None:
            groups.append(([i], False))
        elif key in seen:
            seen[key].append(i)
        else:
            seen[key] = [i]
            groups.append((seen[key], key[0] == key[1] and key[2] == key[3]))
    return groups


def _content_key(row: dict[str, Any]) -> tuple | None:
    """(target hash, ref hash, target statistics, ref statistics): the content hash is XXH3, not cryptographic, so
    the exact statistics computed at ingest must agree too (compared as text: a NaN statistic equals a NaN)."""
    t_hash, r_hash = row.get("content_hash"), row.get("ref_content_hash")
    if t_hash is None or r_hash is None:
        return None
    return t_hash, r_hash, repr([row.get(s) for s in _STATS]), repr([row.get(f"ref_{s}") for s in _STATS])


_HASHED = ["source", "data_name", "file_status", *TENSOR_FILE_COLUMNS]


def _file_hashes(store, run: str, units: set[tuple[int, int]]) -> dict[tuple, tuple[bytes, tuple[int, int]]]:
    """(step, rank, source, data_name) -> (content hash, (size, mtime ns)) of the run's loaded tensor files in
    `units`, from the store; empty for a store written before content hashes."""
    out: dict[tuple, tuple[bytes, tuple[int, int]]] = {}
    for path, step, rank in run_files(store, run, units=units):
        if not set(TENSOR_FILE_COLUMNS) <= set(pl.read_parquet_schema(path)):
            return {}
        t = pl.read_parquet(path, columns=_HASHED).filter(
            (pl.col("file_status") == "loaded") & pl.col("content_hash").is_not_null()
        )
        for source, name, digest, size, mtime in t.select("source", "data_name", *TENSOR_FILE_COLUMNS).iter_rows():
            out[(step, rank, source or "", name)] = (digest, (size, mtime))
    return out


def _attach_hashes(store, target: str, ref: str, todo: list[dict[str, Any]]) -> None:
    """Set each row's content hashes and file stamps of both sides (None where the store has none)."""
    units = {(int(r["step"]), int(r["rank"])) for r in todo}
    for run, p in ((target, ""), (ref, "ref_")):
        known = _file_hashes(store, run, units)
        for r in todo:
            found = known.get((int(r["step"]), int(r["rank"]), r["source"] or "", r[f"{p}data_name"]))
            r[f"{p}content_hash"], r[f"{p}file_stamp"] = found if found is not None else (None, None)


def _with_null_columns(rows: pl.DataFrame) -> pl.DataFrame:
    return rows.with_columns([pl.lit(None, dtype=t).alias(c) for c, t in NEW_SCHEMA.items()])


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
    indexed = rows.with_row_index("_exact_i")
    picked = indexed.filter(cand)
    if picked.height == 0:
        return _with_null_columns(rows)
    t_files, r_files = _RunFiles(store, target), _RunFiles(store, ref)
    have = [c for c in _NEEDED if c in picked.columns]
    missing = dict.fromkeys(c for c in _NEEDED if c not in have)
    enabled = gc.isenabled()
    gc.disable()  # the rows' dicts form no cycles: collections would only walk them again and again (~70 ms)
    try:
        todo: list[dict[str, Any]] = [{**missing, **dict(zip(have, row))} for row in picked.select(have).iter_rows()]
        _attach_hashes(store, target, ref, todo)
        groups = _content_groups(todo)
        out = _exact_rows(todo, groups, t_files, r_files, jobs)
    finally:
        if enabled:
            gc.enable()
    kept = {c: rows.schema[c] for c in _UPDATED if c in rows.columns}
    upd_schema: dict[str, pl.DataType] = {**kept, **NEW_SCHEMA}
    upd = pl.DataFrame({c: [r.get(c) for r in out] for c in upd_schema}, schema=upd_schema)
    upd = upd.insert_column(0, picked["_exact_i"])
    upd = upd.rename({c: f"_exact_{c}" for c in _UPDATED if c in rows.columns}).with_columns(
        pl.lit(True).alias("_exact_hit")
    )
    joined = indexed.join(upd, on="_exact_i", how="left")
    hit = pl.col("_exact_hit").fill_null(False)
    replaced = [
        pl.when(hit).then(pl.col(f"_exact_{c}")).otherwise(pl.col(c)).alias(c) for c in _UPDATED if c in rows.columns
    ]
    return joined.with_columns(replaced).select([*rows.columns, *NEW_SCHEMA])

"""Exact metrics from the full tensor files, replacing sketch/stats estimates (`compare_runs(..., exact=True)`).

For every aligned row whose two sides are tensor leaves with a tensor file that was loaded at ingest, the two
files are found again under each run's ingested path (the catalog's `source_path`), loaded one pair at a time,
and compared with `metrics.tensor_metrics` (msprobe 26.2.0 tensor mode, cell by cell):

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

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dumpstore.errors import DumpFormatError, DumpstoreError
from dumpstore.layout import find_units
from dumpstore.tensorfile import forget_folders, load, resolve

from . import metrics
from . import rules as R

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
            for u in find_units(self.root):
                folder = u.path.parent if u.kind == "dump" else u.path
                self.folders[(int(u.step), int(u.rank), u.source or "")] = _Folder(folder, u.kind, u.rank_dir)
        except (DumpstoreError, OSError) as exc:
            self.problem = f"run {run!r}: dump folder {self.root or '?'} cannot be read again ({_first_line(exc)})"

    def path(self, step: int, rank: int, source: str | None, rank_dir: str | None, data_name: str) -> Path:
        """The tensor file of one leaf; raises DumpFormatError saying why it cannot be used."""
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
        path = resolve(folder.path, data_name) if folder.kind == "dump" else _plain_file(folder.path, data_name)
        if not path.is_file():
            raise DumpFormatError(f"tensor file {path} is missing (moved or deleted since ingest)")
        return path


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
    path = files.path(row["step"], row["rank"], row["source"], row.get(f"{p}rank_dir"), row[f"{p}data_name"])
    try:
        arr, _ = load(path)
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot be read ({_first_line(exc)})") from None
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


def _verdict(m: dict[str, Any]) -> None:
    err, tol = m["err"], m["tol"]
    if err is None or tol is None:
        return
    m["severity"] = float(R.severity(err, tol))
    m["status"] = "diverged" if R.diverges(err, tol, bool(m["nonfinite_mismatch"])) else "pass"


def _exact_row(row: dict[str, Any], t_files: _RunFiles, r_files: _RunFiles) -> dict[str, Any]:
    """New values of the updated and new columns for one candidate row."""
    m = {c: row[c] for c in _UPDATED} | {"tol": row["tol"]} | dict.fromkeys(NEW_SCHEMA)
    try:
        x = _load(t_files, row, "target")
        y = _load(r_files, row, "ref")
        tm = metrics.tensor_metrics(x, y)
    except (DumpFormatError, ValueError) as exc:
        m["detail"] = _join_detail(m["detail"], f"exact metrics unavailable: {_first_line(exc)}")
        return m
    m.update(
        {col: str(tm.msprobe[name]) for name, col in MSPROBE_COLUMNS.items()},
        msprobe_message=tm.message,
        euc_dist=tm.euc_dist,
        one_thousandth=tm.one_thousandth,
        five_thousandth=tm.five_thousandth,
        max_rel_err=tm.max_rel_err,
    )
    same_size = x.size == y.size and x.size > 0
    m["cosine"] = tm.cosine if tm.cosine is not None or not same_size else metrics.cosine(x, y)
    m["max_abs_err"] = tm.max_abs_err if tm.max_abs_err is not None or not same_size else _finite_max_abs(x, y)
    rl2 = tm.rel_l2 if tm.rel_l2 is not None else (0.0 if x.size == 0 and y.size == 0 else None)
    if rl2 is None:  # msprobe cannot compare the pair (shapes differ): the row's own verdict stands
        return m
    mismatch = bool(tm.nonfinite_mismatch) or bool(row["nonfinite_mismatch"])
    m.update(err=rl2, err_source="exact", err_bound=0.0, nonfinite_mismatch=mismatch)
    if mismatch:
        m["err"] = math.inf
        if not row["nonfinite_mismatch"] or not m["detail"]:
            m["detail"] = _join_detail(m["detail"], f"NaN/Inf positions differ at {tm.nonfinite_mismatch} elements")
        m["detail"] = _join_detail(m["detail"], f"rel_l2 over positions finite on both sides {rl2:.6g}")
    _verdict(m)
    return m


_PARALLEL_MIN = 512  # pairs: below this, starting workers costs more than it saves


def _exact_rows(
    rows: list[dict[str, Any]], t_files: _RunFiles, r_files: _RunFiles, jobs: int | None
) -> list[dict[str, Any]]:
    """_exact_row for every row, in order; in worker processes (contiguous chunks) when there are many."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(rows) // (_PARALLEL_MIN // 2) or 1))
    if jobs < 2 or len(rows) < _PARALLEL_MIN:
        return [_exact_row(r, t_files, r_files) for r in rows]
    from concurrent.futures import ProcessPoolExecutor

    size = -(-len(rows) // (jobs * 4))  # a few chunks per worker evens out slow files
    chunks = [(rows[i : i + size], t_files, r_files) for i in range(0, len(rows), size)]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return [m for part in pool.map(_exact_chunk, chunks) for m in part]


def _exact_chunk(job: tuple[list[dict[str, Any]], _RunFiles, _RunFiles]) -> list[dict[str, Any]]:
    rows, t_files, r_files = job
    return [_exact_row(r, t_files, r_files) for r in rows]


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
    todo = [{c: row.get(c) for c in _NEEDED} for row in picked.select(have).iter_rows(named=True)]
    out = [
        {"_exact_i": i, **m} for i, m in zip(picked["_exact_i"].to_list(), _exact_rows(todo, t_files, r_files, jobs))
    ]
    kept = {c: rows.schema[c] for c in _UPDATED if c in rows.columns}
    upd_schema: dict[str, pl.DataType] = {"_exact_i": pl.UInt32(), **kept, **NEW_SCHEMA}
    upd = pl.DataFrame([{c: r.get(c) for c in upd_schema} for r in out], schema=upd_schema, orient="row")
    upd = upd.rename({c: f"_exact_{c}" for c in _UPDATED if c in rows.columns}).with_columns(
        pl.lit(True).alias("_exact_hit")
    )
    joined = indexed.join(upd, on="_exact_i", how="left")
    hit = pl.col("_exact_hit").fill_null(False)
    replaced = [
        pl.when(hit).then(pl.col(f"_exact_{c}")).otherwise(pl.col(c)).alias(c) for c in _UPDATED if c in rows.columns
    ]
    return joined.with_columns(replaced).select([*rows.columns, *NEW_SCHEMA])

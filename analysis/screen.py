"""A fast first pass over two runs: per (step, rank, source) unit, the status of every leaf pair, without alignment.

Most units of two runs of the same job hold the same records in the same order.  For such a *simple* unit the
leaf pairs are the rows at the same position of the two units' Parquet files, and their `err`, `tol` and `status`
are what `analysis/pairmetrics.py` computes for them after alignment: its Polars expressions judge, once per
distinct structure, what does not depend on the statistics (scalars, nulls, kinds, shapes, non-finite counts,
tolerances); the statistics bound of tensor pairs is then computed in numpy with the same IEEE operations
(`_fast`), and the few pairs left (non-finite statistics, ||y|| = 0, sketches) go through the expressions again.
The screen returns per unit the counts by status, the largest error and the first diverged output in execution
order; units it cannot pair by position (records or leaves differ, a file in one run only, repeated keys) are
listed for the exact path (`compare_runs`).

Speed comes from not decoding what is known already.  A column chunk of one file that is byte-for-byte the
chunk of another (same Parquet type) holds the same values: the two runs' units share their record names,
dtypes, shapes, flags ... and usually differ in the four statistics only, and units of different steps and
ranks share their structure, so

  * a column whose chunks are equal in the target and the reference file is decoded once, for both;
  * decoded columns, the per-pair parts that do not depend on the statistics, and the structure checks are
    cached by the chunks' bytes, so a structure seen in another unit costs a dictionary lookup;
  * only the statistics are decoded for every unit (the bulk of the time: ZSTD-compressed doubles).

Two passes: the first parses every footer and counts forward float outputs by dtype (the runs' compute
precision, as compare_runs finds it over all compared steps); the second judges the units step by step on a
few threads, each file mapped once.  Only the live ingest's files are read (`Store.tensor_files`).

Size: one engine: the caches keyed by column-chunk bytes serve the decoding, the structure checks and the numpy
bound alike; split, each part would take the caches as arguments.
"""

from __future__ import annotations

import glob
import mmap
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from dumpstore.arrays import to_polars
from dumpstore.dtypes import FLOAT_DTYPES
from dumpstore.names import parse_record

from . import rules as R
from .order import OUTPUT_IO, deferred_grad
from .tolerance import Tolerances

c, lit, when = pl.col, pl.lit, pl.when

KEYS = ("record", "io", "index_path")  # a leaf pair: same record, io and index path
ORDER = ("seq", "leaf", "direction")  # execution order (target side)
STATIC = (
    "kind",
    "dtype",
    "shape",
    "numel",
    "nan_count",
    "posinf_count",
    "neginf_count",
    "sat_count",
    "has_nan",
    "has_posinf",
    "has_neginf",
    "has_sat",
    "checksum",
    "scalar_value",
    "value",
    "error",
)
STATS = R.STATS
SUMS = ("seq", "io", "direction", "record")  # what rules.broadcast_sums reads besides the shapes
_KEYED = KEYS + ORDER + STATIC
_STRINGS = ("record", "io", "index_path", "direction", "kind", "dtype", "checksum", "value", "error")
STATUSES = R.STATUSES


class Unsupported(Exception):
    """The screen cannot answer for this store; the caller compares the slow way."""


@dataclass
class ScreenResult:
    units: pl.DataFrame  # simple units: step, rank, source, rows, differing non-tensor
    # arguments (args), counts, max_err, first diverged output
    complex_units: list[tuple[int, int]]  # (step, rank) pairs to compare exactly (alignment needed)
    precision: dict[str, str]  # compute precision of each run and the floor, as compare_runs
    dtype_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # forward float outputs by dtype,
    # per side (partitions of a distributed screen merge their precision)


# ------------------------------------------------------------------------------------------------ files
class _File:
    """One Parquet file of a unit: its column chunks' bytes (for equality and as cache keys), decoded on demand.

    The footer is parsed once (the first pass); the second pass maps the file (`load()`).
    """

    __slots__ = ("path", "step", "rank", "source", "md", "n", "ranges", "types", "leaves", "_reader", "_keys", "_buf")

    def __init__(self, path: str, step: int, rank: int, source: str):
        self.path, self.step, self.rank, self.source = path, step, rank, source
        self._reader = _open_reader(path)
        self.md = md = self._reader.metadata
        self.n = md.num_rows
        self.leaves: dict[str, list[int]] = {}
        for i, parts in enumerate(self._reader.column_paths):
            self.leaves.setdefault(parts[0], []).append(i)
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        self.types: dict[str, str] = {}
        groups = [md.row_group(g) for g in range(md.num_row_groups)]
        for name in _KEYED + STATS + ("sketch",):
            leaves = self.leaves.get(name)
            if not leaves or len(leaves) != 1 or not groups:
                continue
            spans = []
            for rg in groups:
                col = rg.column(leaves[0])
                start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
                spans.append((start, col.total_compressed_size))
            self.ranges[name] = spans
            self.types[name] = groups[0].column(leaves[0]).physical_type
        self._keys: dict[str, tuple] = {}
        self._buf: mmap.mmap | None = None

    def load(self) -> None:
        """Map the file: chunk bytes are then slices, and decoding reads the page cache without a copy.  The map
        goes away with the last buffer that uses it (decoded arrays may share it), so it is never closed here."""
        if self._buf is None:
            with open(self.path, "rb") as fh:
                try:
                    self._buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except ValueError:  # an empty file cannot be mapped
                    self._buf = fh.read()  # type: ignore[assignment]
            if self._reader is not None:  # decode from the map from now on
                self._reader.close()
                self._reader = None

    def release(self) -> None:
        """Forget the chunk bytes and the file's bytes; close the reader (reopened from the footer if needed)."""
        self._keys, self._buf = {}, None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def key(self, col: str) -> tuple:
        """What identifies the decoded values of `col`: (name, type, rows, chunk bytes); bytes None if absent."""
        hit = self._keys.get(col)
        if hit is None:
            if col not in self.ranges:
                hit = (col, None, self.n, None)
            elif self._buf is not None:
                buf = self._buf
                hit = (col, self.types[col], self.n, b"".join(buf[a : a + n] for a, n in self.ranges[col]))
            else:
                with open(self.path, "rb") as fh:
                    fd = fh.fileno()
                    hit = (col, self.types[col], self.n, b"".join(os.pread(fd, n, a) for a, n in self.ranges[col]))
            self._keys[col] = hit
        return hit

    def read(self, cols: list[str]) -> pa.Table:
        if self._reader is None:
            src = pa.py_buffer(self._buf) if self._buf is not None else self.path
            self._reader = _open_reader(src, self.md)
        idx = [i for x in cols for i in self.leaves[x]]
        return self._reader.read_all(column_indices=idx, use_threads=False)


def _open_reader(path, md=None):
    """pyarrow's Parquet reader without ParquetFile's per-file schema walk (a third of a small file's cost)."""
    from pyarrow._parquet import ParquetReader

    reader = ParquetReader()
    reader.open(path, read_dictionary=list(_STRINGS), metadata=md)
    return reader


def _source_of(path: str, ingest_id: str) -> str | None:
    name = os.path.basename(path)
    prefix = f"part-{ingest_id}"
    if not name.startswith(prefix) or not name.endswith(".parquet"):
        return None
    rest = name[len(prefix) : -len(".parquet")]
    if rest == "":
        return ""
    return rest[1:] if rest.startswith("-") else None


def _files(store, run: str, steps: set[int], ranks: set[int]) -> dict[tuple[int, int, str], str]:
    """(step, rank, source) -> file of the run's live ingest, for the steps and ranks asked."""
    info = store.run_info(run)
    out: dict[tuple[int, int, str], str] = {}
    for pattern in store.tensor_files([run]):
        for path in glob.glob(pattern):
            parts = path.split(os.sep)
            try:
                step = int(parts[-3].removeprefix("step="))
                rank = int(parts[-2].removeprefix("rank="))
            except ValueError as exc:
                raise Unsupported(f"unexpected path {path}") from exc
            if step not in steps or rank not in ranks:
                continue
            source = _source_of(path, info["ingest_id"])
            if source is None:  # another ingest whose id starts alike
                continue
            out[(step, rank, source)] = path
    return out


# ------------------------------------------------------------------------------------------------ caches
class _Cache:
    """Decoded columns and derived frames, keyed by the bytes they come from.  Bounded: when a store's units
    share little (checksums that change every step), it is emptied rather than grown."""

    MAX_COLS, MAX_FRAMES = 256, 32

    def __init__(self):
        self.cols: dict[tuple, pl.Series] = {}
        self.frames: dict[tuple, Any] = {}

    def remember(self, key: tuple, value: Any) -> Any:
        if len(self.frames) >= self.MAX_FRAMES:
            self.frames.clear()
        self.frames[key] = value
        return value

    def columns(self, f: _File, cols: Iterable[str], keep: bool = True) -> dict[str, pl.Series]:
        want = [x for x in cols if x in f.ranges]
        out = {x: self.cols[f.key(x)] for x in want if f.key(x) in self.cols}
        missing = [x for x in want if x not in out]
        if missing:
            table = f.read(missing)
            for x in missing:
                s = pl.from_arrow(table.column(x), schema_overrides=None)
                if isinstance(s, pl.DataFrame):  # pragma: no cover - from_arrow of a ChunkedArray is a Series
                    s = s.to_series()
                if s.dtype == pl.Categorical:
                    s = s.cast(pl.String)
                s = s.alias(x)
                out[x] = s
                if keep:
                    if len(self.cols) >= self.MAX_COLS:
                        self.cols.clear()
                    self.cols[f.key(x)] = s
        for x in cols:
            if x not in out:
                raise Unsupported(f"{f.path} has no column {x}")
        return out


# ------------------------------------------------------------------------------------------------ per unit
def _structure(cache: _Cache, f: _File) -> tuple[bool, pl.DataFrame, dict[str, np.ndarray]]:
    """(keys unique, the target's order columns _phase, _out, seq, leaf, _record, and them as numpy), cached."""
    key = ("structure",) + tuple(f.key(x) for x in KEYS + ORDER)
    hit = cache.frames.get(key)
    if hit is not None:
        return hit
    cols = cache.columns(f, KEYS + ORDER)
    df = pl.DataFrame([cols[x] for x in KEYS + ORDER])
    # the exact path pairs records by name (one seq per record name) and leaves by (record, io, index_path)
    unique = (
        df.select(pl.struct(*KEYS).n_unique()).item() == df.height
        and df.select(pl.struct("record", "seq").n_unique()).item() == df.select(c("record").n_unique()).item()
    )
    first_bwd = c("seq").filter(c("direction") == "backward").min()
    order = df.select(
        when(deferred_grad(c("seq"), c("direction"), first_bwd)).then(1).otherwise(0).cast(pl.Int32).alias("_phase"),
        c("io").is_in(OUTPUT_IO).alias("_out"),
        c("seq"),
        c("leaf"),
        c("record").alias("_record"),
    )
    ordnp = {x: order[x].to_numpy() for x in ("_phase", "_out", "seq", "leaf")}
    ordnp["group"] = np.unique(ordnp["seq"], return_inverse=True)[1].reshape(-1)  # records, for small values
    hit = (unique, order, ordnp)
    return cache.remember(key, hit)


def _same_keys(cache: _Cache, t: _File, r: _File) -> bool:
    if t.n != r.n:
        return False
    if all(t.key(x) == r.key(x) for x in KEYS):
        return True
    a, b = cache.columns(t, KEYS), cache.columns(r, KEYS, keep=False)
    return all(a[x].equals(b[x]) for x in KEYS)


def _static(
    cache: _Cache, t: _File, r: _File, tol: Tolerances, floor: str
) -> tuple[pl.DataFrame, dict[str, np.ndarray]]:
    """The parts of every pair's verdict that do not depend on the statistics (cached by the bytes)."""
    key = ("static", floor) + tuple(t.key(x) for x in STATIC + SUMS) + tuple(r.key(x) for x in STATIC)
    hit = cache.frames.get(key)
    if hit is not None:
        return hit
    a = cache.columns(t, STATIC)
    rb = cache.columns(r, [x for x in STATIC if t.key(x) != r.key(x)])
    b = {x: rb.get(x, a[x]) for x in STATIC}
    df = pl.DataFrame([a[x] for x in STATIC] + [b[x].alias(f"ref_{x}") for x in STATIC])
    is_tensors = (c("kind") == "tensor") & (c("ref_kind") == "tensor")
    is_scalars = (c("kind") == "scalar") & (c("ref_kind") == "scalar")
    both_ck = c("checksum").is_not_null() & c("ref_checksum").is_not_null()
    df = df.with_columns(R.nonfinite_mismatch(), R.tol_dtype(floor), R.shape_differs().alias("_shape_differs"))
    df = df.with_columns(R.dtype_tol(tol))
    out = df.select(
        is_tensors.alias("_is_tensors"),
        is_scalars.alias("_is_scalars"),
        R.kinds_differ().alias("_kinds_differ"),
        R.null_pair().alias("_nulls"),
        (is_tensors & c("_shape_differs")).alias("_shape"),
        c("nonfinite_mismatch"),
        when(both_ck).then(c("checksum") == c("ref_checksum")).alias("checksum_equal"),
        R.scalar_err().alias("_sc_err"),
        R.pair_tol(is_scalars, R.numeric_scalars(is_scalars)).alias("tol"),
        R.unreadable_kind().alias("_bad_kind"),
        R.has_error_text().alias("_err_text"),
        c("numel"),
        c("ref_numel"),
        c("dtype"),
        R.dtype_eps(c("tol_dtype")).fill_null(0.0).alias("_eps_judged"),
        R.dtype_tiny(c("tol_dtype")).fill_null(0.0).alias("_tiny_judged"),
        R.small_value_scale().alias("_scale"),
        # a tensor against None: an argument given in one run only (analysis/signature.py), counted as `args`
        (((c("kind") == "tensor") & (c("ref_kind") == "null")) | ((c("kind") == "null") & (c("ref_kind") == "tensor")))
        .fill_null(False)
        .alias("_tensor_or_none"),
    )
    # pairs whose err can only be the statistics bound, when the statistics are finite and ||y|| > 0 (_fast)
    plain = (
        c("_is_tensors")
        & c("checksum_equal").is_null()  # a checksum decides before the statistics bound (rules.tensor_err)
        & ~c("_kinds_differ")
        & ~c("_shape")
        & ~c("nonfinite_mismatch")
        & ~c("_bad_kind")
        & ~c("_err_text")
        & c("tol").is_not_null()
    ).fill_null(False)
    # pairs whose verdict does not read the statistics: not two tensors (scalars, nulls, kinds differ), or two
    # tensors of different shapes or non-finite counts (err inf); judged here once, with null statistics
    decided = (~c("_is_tensors")).fill_null(False) | (
        c("_is_tensors") & (c("_shape") | c("nonfinite_mismatch"))
    ).fill_null(False)
    nulls = [lit(None, pl.Float64).alias(x) for x in STATS] + [lit(None, pl.Float64).alias(f"ref_{x}") for x in STATS]
    if "sketch" in out.columns:  # pragma: no cover - sketches are per unit, never in the static frame
        raise AssertionError
    judged = _verdicts(
        out.with_columns(
            *nulls, lit(None, pl.List(pl.Float64)).alias("sketch"), lit(None, pl.List(pl.Float64)).alias("ref_sketch")
        ),
        sketches=False,
    )
    arrays = out.select(
        plain.alias("plain"),
        decided.alias("decided"),
        c("tol"),
        R.sqrt_numel(),
        (c("_is_scalars").fill_null(False) | c("_tensor_or_none")).alias("scalar"),
        (c("_is_tensors").fill_null(False) & c("_scale")).alias("tensor"),
        c("ref_numel").cast(pl.Float64).alias("ref_numel"),
        c("_eps_judged").alias("eps"),
        c("_tiny_judged").alias("tiny"),
    )
    arrays = arrays.with_columns(
        judged["err"].alias("d_err"),
        judged["err"].is_not_null().alias("d_ok"),
        judged["status"].replace_strict(R.STATUS_CODES, return_dtype=pl.Int8).alias("d_code"),
    )
    stnp = {x: arrays[x].to_numpy() for x in arrays.columns}
    stnp["sum_src"], stnp["sum_terms"] = _sums(cache.columns(t, SUMS), b["shape"])
    return cache.remember(key, (out, stnp))


def _sums(cols: dict[str, pl.Series], ref_shape: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """`rules.broadcast_sums` of one unit (its records are the seq groups, as `_structure`'s)."""
    group = np.unique(cols["seq"].to_numpy(), return_inverse=True)[1].reshape(-1)
    apis = {key: parse_record(key).api for key in cols["record"].unique().drop_nulls().to_list()}
    api = cols["record"].replace_strict(apis, default="", return_dtype=pl.String).fill_null("")
    return R.record_sums(group, cols["direction"].fill_null(""), cols["io"].fill_null(""), api, ref_shape)


def _stats(t: _File, r: _File, sketches: bool) -> pa.Table:
    """The statistics (and sketches) of both sides, as Arrow: decoded every time, they differ from unit to unit."""
    cols = list(STATS) + (["sketch"] if sketches else [])
    for f in (t, r):
        if any(x not in f.leaves for x in cols):
            raise Unsupported(f"{f.path} lacks a statistics column")
    a, b = t.read(cols), r.read(cols)
    return pa.table([a.column(x) for x in cols] + [b.column(x) for x in cols], names=cols + [f"ref_{x}" for x in cols])


def _verdicts(df: pl.DataFrame, sketches: bool) -> pl.DataFrame:
    """err and status of every pair from the static parts and the statistics (pairmetrics' expressions)."""
    sk = R.sketch_err()[0] if sketches else lit(None, pl.Float64)
    df = df.with_columns(R.stats_columns(df)["_st_err"], sk.alias("_sk_err"))
    df = R.nonfinite_sketch(df) if sketches else df.with_columns(lit(None, pl.Float64).alias("_nf_err"))
    df = df.with_columns(
        R.pair_err(
            lit(False), c("_kinds_differ"), c("_is_tensors"), c("_is_scalars"), c("_nulls"), R.tensor_err(c("_shape"))
        ).alias("err")
    )
    return df.with_columns(R.pair_status(lit(False), c("_bad_kind"), c("_err_text")).alias("status"))


assert R.STATUS_CODES["pass"] == 0 and R.STATUS_CODES["diverged"] == 1


def _fast(stnp: dict[str, np.ndarray], stats: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(err, done) for the pairs `_verdicts` would judge by the statistics bound alone (two tensors of the same
    kind, shape and non-finite counts, readable): `rules.stats_bound` straight from the Arrow buffers."""
    t = {x: _numpy(stats.column(x)) for x in STATS}  # nulls: NaN
    r = {x: _numpy(stats.column(f"ref_{x}")) for x in STATS}
    t_null = {x: _nulls(stats.column(x)) for x in STATS}
    r_null = {x: _nulls(stats.column(f"ref_{x}")) for x in STATS}
    err, known = R.stats_bound(t, r, t_null, r_null, stnp["sqrt_n"], np.zeros(len(stnp["plain"]), dtype=bool))
    return err, stnp["plain"] & known


def _numpy(col: pa.ChunkedArray) -> np.ndarray:
    """A float64 column as one numpy array, nulls as NaN (from the Arrow buffers: pyarrow's own conversion
    imports pandas, half a second)."""
    parts = []
    for arr in col.chunks:
        n, off = len(arr), arr.offset
        vals = np.frombuffer(arr.buffers()[1], dtype=np.float64, count=off + n)[off:] if n else np.empty(0)
        if arr.null_count:
            vals = np.where(_valid(arr), vals, np.nan)
        parts.append(vals)
    return np.concatenate(parts) if len(parts) != 1 else parts[0]


def _valid(arr: pa.Array) -> np.ndarray:
    """The validity bitmap of an Arrow array as booleans (all True without one)."""
    n, off = len(arr), arr.offset
    bitmap = arr.buffers()[0]
    if bitmap is None:
        return np.ones(n, dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[off : off + n].astype(bool)


def _nulls(col: pa.ChunkedArray) -> np.ndarray:
    if not col.null_count:
        return np.zeros(len(col), dtype=bool)
    return np.concatenate([~_valid(a) for a in col.chunks]) if col.num_chunks else np.zeros(0, dtype=bool)


def _judge(units: list, sketches: bool) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per unit: err (valid where not null), and status codes; the fast path where it applies, `_verdicts`
    (one Polars pass for all units given) elsewhere."""
    errs, valid, codes, slow = [], [], [], []
    for _, _, _, static, stnp, stats in units:
        n = stats.num_rows
        if sketches:
            err, done = np.zeros(n), np.zeros(n, dtype=bool)
        else:
            err, done = _fast(stnp, stats)
        with np.errstate(invalid="ignore"):
            code = R.exceeds(err, stnp["tol"]).astype(np.int8)  # STATUS_CODES: pass 0, diverged 1
        dec = stnp["decided"] & ~done
        err[dec] = stnp["d_err"][dec]
        code[dec] = stnp["d_code"][dec]
        ok = done | (dec & stnp["d_ok"])
        errs.append(err)
        valid.append(ok)
        codes.append(code)
        rest = ~(done | dec)
        if rest.any():
            idx = np.flatnonzero(rest)
            sub = pl.from_arrow(stats)[idx]
            slow.append((rest, pl.concat([static[idx], sub], how="horizontal")))  # type: ignore[list-item]
        else:
            slow.append((rest, None))
    parts = [f for _, f in slow if f is not None]
    if parts:
        judged = _verdicts(pl.concat(parts, how="vertical"), sketches)
        j_err = judged["err"].to_numpy()
        j_valid = judged["err"].is_not_null().to_numpy()
        j_code = judged["status"].replace_strict(R.STATUS_CODES, return_dtype=pl.Int8).to_numpy()
        at = 0
        for i, (rest, f) in enumerate(slow):
            if f is None:
                continue
            m = f.height
            errs[i][rest] = j_err[at : at + m]
            valid[i][rest] = j_valid[at : at + m]
            codes[i][rest] = j_code[at : at + m]
            at += m
    for i, (_, _, ordnp, _, stnp, stats) in enumerate(units):
        _small_values(errs[i], valid[i], codes[i], ordnp, stnp, stats)
    return errs, valid, codes


def _small_values(
    err: np.ndarray,
    ok: np.ndarray,
    code: np.ndarray,
    ordnp: dict[str, np.ndarray],
    stnp: dict[str, np.ndarray],
    stats: pa.Table,
) -> None:
    """`rules.small_value_err` over one unit (records are the seq groups), in place."""
    new, _, small, _ = R.small_value_err(
        np.where(ok, err, np.nan),
        _numpy(stats.column("norm")),
        _numpy(stats.column("ref_norm")),
        stnp["ref_numel"],
        stnp["tensor"],
        ordnp["group"],
        stnp["eps"],
        stnp["tiny"],
        (stnp["sum_src"], stnp["sum_terms"]),
    )
    if small.any():
        err[small] = new[small]
        code[small] = R.exceeds(new[small], stnp["tol"][small]).astype(np.int8)


def _step_summary(units: list, sketches: bool) -> pl.DataFrame:
    """Per-unit summaries (see ScreenResult.units) of one step's simple units."""
    if not units:
        return _empty_units()
    errs, valid, codes = _judge(units, sketches)
    out = []
    for ((s, k, src), order, ordnp, _, stnp, _), err, ok, code in zip(units, errs, valid, codes):
        counts = np.bincount(code, minlength=len(STATUSES))
        max_err = np.fmax.reduce(err[ok]) if ok.any() else None  # NaN only when all are (as Polars' max)
        cand = np.flatnonzero((code == R.STATUS_CODES["diverged"]) & ordnp["_out"])
        first = None
        if cand.size:
            i = cand[np.lexsort((ordnp["leaf"][cand], ordnp["seq"][cand], ordnp["_phase"][cand]))[0]]
            first = (int(ordnp["_phase"][i]), int(ordnp["seq"][i]), int(ordnp["leaf"][i]), order["_record"][int(i)])
        args = int(((code == R.STATUS_CODES["diverged"]) & stnp["scalar"] & ~ordnp["_out"]).sum())
        out.append(
            {
                "step": s,
                "rank": k,
                "source": src,
                "rows": int(code.size),
                "args": args,
                **{name: int(counts[i]) for i, name in enumerate(STATUSES)},
                "max_err": None if max_err is None else float(max_err),
                "first_phase": first[0] if first else None,
                "first_seq": first[1] if first else None,
                "first_leaf": first[2] if first else None,
                "first_record": first[3] if first else None,
            }
        )
    return pl.DataFrame(out, schema=_empty_units().schema)


# ------------------------------------------------------------------------------------------------ the screen
def _dtype_counts(cache: _Cache, f: _File) -> dict[str, int]:
    """Forward float outputs by dtype (what compare_runs' compute precision counts)."""
    key = ("dtypes",) + tuple(f.key(x) for x in ("io", "direction", "dtype"))
    hit = cache.frames.get(key)
    if hit is None:
        cols = cache.columns(f, ("io", "direction", "dtype"))
        df = pl.DataFrame([cols["io"], cols["direction"], cols["dtype"]])
        hit = dict(
            df.filter((c("io") == "output") & (c("direction") == "forward") & c("dtype").is_in(list(FLOAT_DTYPES)))
            .group_by("dtype")
            .len()
            .iter_rows()
        )
        cache.remember(key, hit)
    return hit


def screen(
    store, target: str, ref: str, steps: list[int], ranks: list[int], tolerances: Tolerances, threads: int | None = None
) -> ScreenResult:
    """Screen the common `steps` x `ranks` of two runs (see the module docstring)."""
    t_info, r_info = store.run_info(target), store.run_info(ref)
    sketches = bool(t_info.get("n_tensor_files")) and bool(r_info.get("n_tensor_files"))
    tm, rm = t_info.get("sketch_m"), r_info.get("sketch_m")
    if sketches and tm and rm and tm != rm:
        raise Unsupported("sketch sizes differ")
    steps_s, ranks_s = set(steps), set(ranks)
    t_files = _files(store, target, steps_s, ranks_s)
    r_files = _files(store, ref, steps_s, ranks_s)
    cache = _Cache()
    threads = threads or min(8, os.cpu_count() or 1)
    jobs = [("target", k, p) for k, p in t_files.items()] + [("ref", k, p) for k, p in r_files.items()]

    def first_pass(job: tuple) -> tuple[str, tuple, _File, dict[str, int]]:
        side, key, path = job
        f = _File(path, *key)
        try:
            f.load()
            return side, key, f, _dtype_counts(cache, f)
        finally:
            f.release()

    opened: dict[tuple[str, tuple], _File] = {}
    counts: dict[str, dict[str, int]] = {"target": {}, "ref": {}}
    for side, key, f, dc in _map(first_pass, jobs, threads):
        opened[(side, key)] = f
        for d, n in dc.items():
            counts[side][d] = counts[side].get(d, 0) + n
    a, b = R.compute_dtype_from_counts(counts["target"]), R.compute_dtype_from_counts(counts["ref"])
    precision = {"target": a, "ref": b, "floor": R.floor_of(a, b)}
    floor = precision["floor"]

    complex_units: set[tuple[int, int]] = set()
    by_step: dict[int, list[tuple[tuple, _File, _File]]] = {}
    for key in sorted(set(t_files) | set(r_files)):
        t, r = opened.get(("target", key)), opened.get(("ref", key))
        if t is None or r is None:
            complex_units.add(key[:2])
        elif t.n or r.n:
            by_step.setdefault(key[0], []).append((key, t, r))

    def one_step(step: int) -> pl.DataFrame:
        units = []
        for (s, k, src), t, r in by_step[step]:
            if (s, k) in complex_units:
                continue
            try:
                if t.n != r.n or t.n == 0 or t.types != r.types:
                    complex_units.add((s, k))
                    continue
                t.load()
                r.load()
                unique, order, ordnp = _structure(cache, t)
                if not unique or not _same_keys(cache, t, r):
                    complex_units.add((s, k))
                    continue
                static, stnp = _static(cache, t, r, tolerances, floor)
                units.append(((s, k, src), order, ordnp, static, stnp, _stats(t, r, sketches)))
            finally:
                t.release()
                r.release()
        return _step_summary(units, sketches)

    parts = [p for p in _map(one_step, sorted(by_step), threads) if p.height]
    units = pl.concat(parts, how="vertical") if parts else _empty_units()
    # a (step, rank) found complex later in its step (another source) is compared exactly as a whole
    if complex_units:
        drop = pl.DataFrame(sorted(complex_units), schema={"step": pl.Int64, "rank": pl.Int64}, orient="row")
        units = units.with_columns(c("step").cast(pl.Int64), c("rank").cast(pl.Int64)).join(
            drop, on=["step", "rank"], how="anti"
        )
    units = units.sort(["step", "rank", "source"])
    return ScreenResult(
        units.with_columns(c("step").cast(pl.Int64), c("rank").cast(pl.Int64)), sorted(complex_units), precision, counts
    )


def _map(fn, items: list, threads: int) -> list:
    """fn over items, in order, on `threads` threads (Parquet decoding and Polars release the GIL)."""
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def _empty_units() -> pl.DataFrame:
    schema = {
        "step": pl.Int64,
        "rank": pl.Int64,
        "source": pl.String,
        "rows": pl.UInt32,
        "args": pl.UInt32,
        **{s: pl.UInt32 for s in STATUSES},
        "max_err": pl.Float64,
        "first_phase": pl.Int32,
        "first_seq": pl.Int32,
        "first_leaf": pl.Int32,
        "first_record": pl.String,
    }
    return pl.DataFrame(schema=schema)


def pair_rows(
    store, target: str, ref: str, step: int, rank: int, source: str, tolerances: Tolerances, floor: str
) -> pl.DataFrame | None:
    """The screen's per-pair rows (record, io, index_path, err, tol, status) of one simple unit, for tests."""
    t_info, r_info = store.run_info(target), store.run_info(ref)
    sketches = bool(t_info.get("n_tensor_files")) and bool(r_info.get("n_tensor_files"))
    tp = _files(store, target, {step}, {rank}).get((step, rank, source))
    rp = _files(store, ref, {step}, {rank}).get((step, rank, source))
    if tp is None or rp is None:
        return None
    cache = _Cache()
    t, r = _File(tp, step, rank, source), _File(rp, step, rank, source)
    try:
        t.load()
        r.load()
        return _pair_rows(cache, t, r, tolerances, floor, sketches)
    finally:
        t.release()
        r.release()


def _pair_rows(
    cache: _Cache, t: _File, r: _File, tolerances: Tolerances, floor: str, sketches: bool
) -> pl.DataFrame | None:
    if t.n != r.n or t.n == 0 or t.types != r.types:
        return None
    unique, order, ordnp = _structure(cache, t)
    if not unique or not _same_keys(cache, t, r):
        return None
    keys = pl.DataFrame(list(cache.columns(t, KEYS).values()))
    static, stnp = _static(cache, t, r, tolerances, floor)
    stats = _stats(t, r, sketches)
    (err,), (ok,), (code,) = _judge([((t.step, t.rank, t.source), order, ordnp, static, stnp, stats)], sketches)
    return keys.with_columns(
        to_polars("err", np.asarray(err, np.float64), nulls=~ok),
        static["tol"],
        pl.Series("status", STATUSES, pl.String).gather(to_polars("code", np.asarray(code, np.uint32))),
    )

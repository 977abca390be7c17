"""The CSV report built by columns: the same cells as the row-by-row writer (csvfile.py), byte for byte.

`frames(cmp, store, mode, cols)` yields the CSV's cells as Polars frames of text (None for an empty cell, before
the formula neutraliser), CHUNK_ROWS rows (whole ops) at a time, or returns None where only the row-by-row path
applies (`--exact` columns outside tensor mode, rows msprobe pairs otherwise than dumpstore, summary columns
msprobe holds as floats); `frame` is all of them at once, `write` writes one.  Rows of plain
tensors (a float tensor, a null leaf or no leaf on each side, names that print as they are) get their cells from
column expressions; the other rows (arguments, integer or bool tensors, odd names) their kind-dependent cells from
the row path's own functions (`_csv_row`, `msprobe_csv.fill`), once per distinct set of the inputs those read.
msprobe's Result / Err_message (its per-op rules of statistics, tensor and md5 mode), the op's stack on its first
row and dumpstore's messages are then computed by column for every row; tensor mode's six metric cells
(`unsupported`, the exact cells read from the files, else dumpstore's own numbers) by column too.  Floats are
written as Python's `repr` writes them (`_fix_floats`), so the file does not change with the writer;
tests/test_csv_columnar.py holds the two paths to the same bytes.

Size: the cell rules by column, the row path's cache and the writer of the text frame are one piece (each cell
rule has its row twin in csvfile.py / msprobe_csv.py); split, the rules of one cell would sit in two files.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from typing import Any

import polars as pl

from dumpstore import csvsafe

from .. import msprobe_csv, msprobe_pairing
from ..compare import Comparison
from .text import fmt

N_A = "N/A"
_SIDES = (("NPU", ""), ("Bench", "ref_"))
_STATS = (("max", "max", "Max"), ("min", "min", "Min"), ("mean", "mean", "Mean"), ("norm", "l2norm", "Norm"))
_OWN_METRICS = {
    "Cosine": "cosine",
    "EucDist": "euc_dist",
    "MaxAbsErr": "max_abs_err",
    "MaxRelativeErr": "max_rel_err",
    "One Thousandth Err Ratio": "one_thousandth",
    "Five Thousandths Err Ratio": "five_thousandth",
}
_EXACT_COLUMNS = ("msprobe_cosine", "msprobe_euc_dist", "msprobe_max_abs_err", "msprobe_max_rel_err")
_STRING_INPUTS = ("name", "kind", "dtype", "dtype_raw", "data_name", "record", "io", "checksum")
_FLOAT_INPUTS = tuple(f"dump_{s}" for s, _, _ in _STATS) + tuple(s for s, _, _ in _STATS)
_OTHER_INPUTS = {
    "match": pl.String,
    "err_source": pl.String,
    "tol_dtype": pl.String,
    "status": pl.String,
    "detail": pl.String,
    "msprobe_message": pl.String,
    "nonfinite_mismatch": pl.Boolean,
    "err": pl.Float64,
    "err_bound": pl.Float64,
    "tol": pl.Float64,
    "severity": pl.Float64,
    **{c: pl.Float64 for c in _OWN_METRICS.values()},
    **{f"{s}_diff": pl.Float64 for s, _, _ in _STATS},
}
# text that Python's repr prints between plain quotes, and JSON between double quotes, unchanged
_PLAIN_REPR = r"^[ !#-&(-\[\]-~]*$"
_PLAIN_JSON = r"^[ !#-\[\]-~]*$"
# numbers as float() reads them (a subset: anything else goes to csvsafe.cell, which decides)
_NUMBER = r"^[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|nan)$"
_MESSAGES = {
    "infnan": "error: There is nan/inf/-inf in the maximum or minimum value of NPU.",
    "relerr": "error: The NormRelativeErr of output is greater than 0.5.",
    "rg": "error: The Required_Grad of NPU and Bench are inconsistent",
    "param": "error: The scalar parameters of NPU and Bench are inconsistent.",
    "dtype": "error: The dtype of NPU and Bench are inconsistent.",
    "shape": "error: The shape of NPU and Bench are inconsistent.",
    "relwarn": "warning: The norm relative error of output is 10 times that of input.",
    "crc_error": "error: The CRC-32 value of NPU differs from that of the bench.",
    "crc_warning": "warning: The parameter of NPU does not match the bench.",
    "thousandth": "error: The input/parameters of One Thousandth Err Ratio > 0.9 while the output < 0.6.",
    "coswarn": "warning: The input/parameters of Cosine > 0.9, and input/parameters - output > 0.1",
}
# a metric cell the row path holds as a float (Python's repr of it): what msprobe_csv._extreme reads as a number
_FLOAT_REPR = r"^-?(?:\d+(?:\.\d+)?(?:e[-+]\d+)?|inf|nan)$"
# columns whose cells the column expressions write as numbers or fixed words (never text a spreadsheet runs, never
# quoted): `write` checks only the other columns; `_slow_cells` writes these as the file holds them
_NUMERIC = frozenset(
    (
        *(f"{side} {label}" for side, _ in (("NPU", 0), ("Bench", 0)) for _, label, _ in _STATS),
        *_OWN_METRICS,
        *msprobe_csv.DIFF_COLUMNS,
        *msprobe_csv.STAT_REL_COLUMNS,
        "rel_l2",
        "err_bound",
        "tol",
        "severity",
    )
)
_WORDS = frozenset(
    ("NPU Requires_grad", "Bench Requires_grad", "Requires_grad Consistent", "step", "rank", "seq", "dumpstore_result")
)
# what msprobe's rules read of a row apart from its names (`_verdicts` adds the names' part)
_FEATURES = ("_infnan", "_nrel_pct", "_nrel_ext", "_rg", "_param", "_dtype", "_shape", "_crc")
# the cells that depend on the leaves' kinds and values (the others come from the column expressions for every row)
_KIND_CELLS = (
    *(f"{side} {what}" for side in ("NPU", "Bench") for what in ("Dtype", "Tensor Shape", "Requires_grad")),
    *(f"{side} {label}" for side in ("NPU", "Bench") for _, label, _ in _STATS),
    *msprobe_csv.DIFF_COLUMNS,
    *msprobe_csv.STAT_REL_COLUMNS,
    *msprobe_csv.MD5_COLUMNS,
    "Requires_grad Consistent",
)
# inputs of a row that the kind cells do not read (names, places, dumpstore's judgement): left out of the cache key
_NOT_KEY = frozenset(
    (
        "_i", "step", "rank", "seq", "ref_seq", "record", "ref_record", "io", "ref_io", "stack_id", "ref_stack_id",
        "source", "name", "ref_name", "data_name", "ref_data_name", "err", "err_source", "err_bound", "tol",
        "tol_dtype", "severity", "status", "detail", "match", "msprobe_message", "nonfinite_mismatch",
        *_OWN_METRICS.values(),
    )
)  # fmt: skip


CHUNK_ROWS = 100_000  # rows whose cells are built at once (whole ops): the text of one chunk is held, not the file's


def frames(cmp: Comparison, store, mode: str | None, cols: tuple[str, ...]) -> Iterator[pl.DataFrame] | None:
    """The CSV's cells (columns `cols`, text or None) for the rows of `cmp`, about CHUNK_ROWS rows at a time (each
    chunk whole ops, in order), or None (see the module docstring)."""
    from .csvfile import _all_stacks, _with_raw

    if mode not in ("statistics", "md5", "tensor", None):
        return None
    rows = _with_raw(cmp, store)
    if mode != "tensor" and any(c in rows.columns for c in _EXACT_COLUMNS):
        return None
    pairs = msprobe_pairing.applies(cmp, store)
    if pairs and msprobe_pairing.msprobe_pairs(rows):
        return None  # msprobe pairs some rows otherwise than dumpstore: the row path fills them from its pairs
    rows = _complete(rows).with_row_index("_i")
    if pairs and _unpaired_dtypes(rows):
        return None
    stacks = _all_stacks(store, cmp.target) if store is not None else {}
    whole = pl.DataFrame(  # what needs every row: an op's first row overall, the runs of rows of one op
        [
            _stack_info(rows, stacks),
            rows.select(pl.struct("step", "rank", "source", *_op_key()).rle_id().alias("_g"))["_g"],
        ]
    )
    decided = _decided(_chunks(rows, whole, mode), mode)
    return None if decided is None else (chunk.select(cols) for chunk in decided)


def _decided(chunks: Iterator[pl.DataFrame], mode: str | None) -> Iterator[pl.DataFrame] | None:
    """`chunks`, or None where a summary column msprobe's table holds as floats (msprobe_csv.float_columns: every
    value over its rows a number; its integers then print as floats): only the row path writes those right. Chunks
    are held only until every summary column has shown a cell that is not a number; the rest then streams."""
    if mode is None:  # (frames takes statistics, md5 or None: the row path has no float columns without a mode)
        return chunks
    held: list[pl.DataFrame] = []
    numeric: set[str] | None = None  # the summary columns all numbers so far
    for chunk in chunks:
        held.append(chunk)
        here = _numeric_columns(chunk)
        numeric = here if numeric is None else numeric & here
        if not numeric:
            return _chain(held, chunks)
    return None if numeric else iter(held)


def _chain(held: list[pl.DataFrame], rest: Iterator[pl.DataFrame]) -> Iterator[pl.DataFrame]:
    yield from held
    yield from rest


def frame(cmp: Comparison, store, mode: str | None, cols: tuple[str, ...]) -> pl.DataFrame | None:
    """All of `frames` in one frame."""
    parts = frames(cmp, store, mode, cols)
    if parts is None:
        return None
    done = list(parts)
    return pl.concat(done) if done else pl.DataFrame(schema=dict.fromkeys(cols, pl.String))


def _chunks(rows: pl.DataFrame, whole: pl.DataFrame, mode: str | None) -> Iterator[pl.DataFrame]:
    g, n, start = whole["_g"], rows.height, 0
    cache: dict[tuple, tuple] = {}
    while start < n:
        end = min(start + CHUNK_ROWS, n)
        if end < n:  # on to the end of the op the chunk's last row belongs to
            end = int(g.search_sorted(g[end - 1] + 1, side="left"))
        yield _cells(rows.slice(start, end - start), whole.slice(start, end - start), mode, cache)
        start = end


def _cells(rows: pl.DataFrame, whole: pl.DataFrame, mode: str | None, cache: dict) -> pl.DataFrame:
    """The cells of `rows` (whole ops); `cache`: the argument rows' cells by their inputs, kept across chunks."""
    fast = _fast(rows)
    cells = _fast_cells(rows, mode)
    cells = cells.with_columns([_fix_floats(cells[c]) for c in cells.columns if c in _NUMERIC])
    cells = cells.with_columns(_fast_features(cells))
    slow_rows = rows.filter(~fast)
    if slow_rows.height:
        slow = _slow_cells(slow_rows, mode, cells.filter(~fast), cache)
        cells = pl.concat([cells.filter(fast), slow]).sort("_i")
    cells = cells.with_columns(whole["NPU_Stack_Info"], _dumpstore_messages(rows, cells), whole["_g"])
    if mode in ("statistics", "md5", "tensor"):
        cells = cells.with_columns(_verdicts(cells, mode))
    else:
        cells = cells.with_columns(pl.lit("pass").alias("Result"), pl.lit("[]").alias("Err_message"))
    return cells  # every column: _decided reads the summary columns; frames selects `cols`


def _complete(rows: pl.DataFrame) -> pl.DataFrame:
    """`rows` with every input column the cells read (null where the comparison has none)."""
    want: dict[str, Any] = {}
    for pre in ("", "ref_"):
        want.update({f"{pre}{c}": pl.String for c in _STRING_INPUTS})
        want.update({f"{pre}{c}": pl.Float64 for c in _FLOAT_INPUTS})
        want.update({f"{pre}requires_grad": pl.Boolean, f"{pre}seq": pl.Int64, f"{pre}shape": pl.List(pl.Int64)})
    want.update(_OTHER_INPUTS)
    want.update({c: pl.String for c in msprobe_csv._EXACT.values()})  # tensor mode's exact cells (--exact)
    missing = [pl.lit(None, dtype=t).alias(c) for c, t in want.items() if c not in rows.columns]
    return rows.with_columns(missing) if missing else rows


def _fast(rows: pl.DataFrame) -> pl.Series:
    """The rows whose cells the column expressions give: each side a float tensor, a null leaf or no leaf."""
    ok = pl.lit(True)
    for _, pre in _SIDES:
        kind, dtype = pl.col(f"{pre}kind"), pl.col(f"{pre}dtype").fill_null("")
        absent = pl.col(f"{pre}name").is_null() & kind.is_null()
        plain_dtype = ~(
            (dtype == "bool")
            | dtype.str.starts_with("int")
            | dtype.str.starts_with("uint")
            | dtype.str.contains("class")
        ) & ~pl.col(f"{pre}dtype_raw").fill_null("").str.contains("class")
        plain_name = pl.col(f"{pre}data_name").fill_null("").str.contains(_PLAIN_REPR)
        present = pl.col(f"{pre}name").is_not_null() & (
            (kind == "null") | ((kind == "tensor") & plain_dtype & plain_name)
        )
        ok = ok & (absent | present).fill_null(False)
    return rows.select(ok.alias("fast"))["fast"]


def _float_text(e: pl.Expr) -> pl.Expr:
    """A float column as text; `_fix_floats` then makes it what Python's repr writes (null stays null)."""
    return e.cast(pl.Float64).cast(pl.String)


def _fix_floats(s: pl.Series) -> pl.Series:
    """Polars' float text as Python's repr writes it: `1e-05` for `0.00001`, `1.5e-07` for `1.5e-7`, `nan` for
    `NaN` (a `%` after the number kept); only the few cells that need it go through the regexes."""
    odd = s.str.contains("e", literal=True) | s.str.contains("0.0000", literal=True) | s.str.starts_with("NaN")
    odd = odd.fill_null(False)
    if not odd.any():
        return s
    part = s.filter(odd)
    part = part.str.replace(r"e([-+])(\d)(%?)$", "e${1}0${2}${3}")
    part = part.str.replace(r"^(-?)0\.0000([1-9])(\d+)(%?)$", "${1}${2}.${3}e-05${4}")
    part = part.str.replace(r"^(-?)0\.0000([1-9])(%?)$", "${1}${2}e-05${3}")
    part = part.str.replace(r"^NaN", "nan")
    return s.scatter(odd.arg_true(), part)


def _summary_text(e: pl.Expr) -> pl.Expr:
    """msprobe_csv._summary_cell as text: None -> 'None', NaN -> 'Nan', infinities with a leading space."""
    return (
        pl.when(e.is_null())
        .then(pl.lit("None"))
        .when(e.is_nan())
        .then(pl.lit("Nan"))
        .when(e == float("inf"))
        .then(pl.lit(" inf"))
        .when(e == float("-inf"))
        .then(pl.lit(" -inf"))
        .otherwise(_float_text(e))
    )


def _first(*exprs: pl.Expr) -> pl.Expr:
    """Python's `a or b`: the first that is neither null nor empty text."""
    out = exprs[-1]
    for e in reversed(exprs[:-1]):
        out = pl.when(e.is_not_null() & (e.cast(pl.String) != "")).then(e).otherwise(out)
    return out


def _op_name() -> pl.Expr:
    return _first(pl.col("record"), pl.col("ref_record"))


def _op_key() -> tuple[pl.Expr, pl.Expr]:
    """An op's key: its name, and whether it is the reference's alone (an op of its own even where the target has
    a record of the same name; csvfile.iter_csv_rows' op_key)."""
    return _op_name(), (pl.col("record").fill_null("") == "").alias("_ref_only")


# a summary cell holding a number (an int or a float: not None, Nan, True/False, N/A or text)
_NUMBER_CELL = r"^ ?[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|inf)$"


def _unpaired_dtypes(rows: pl.DataFrame) -> bool:
    """Whether a row pairs two dtypes msprobe does not pair (msprobe_pairing.dtype_match: it leaves them unmatched;
    only the row path writes such a row), from the rows' own columns, each distinct combination once."""
    from .csvfile import _msprobe_dtype

    both = rows.filter(pl.col("name").is_not_null() & pl.col("ref_name").is_not_null())
    scalar = ((pl.col("kind") == "scalar") | (pl.col("ref_kind") == "scalar")).fill_null(False)
    cols = [c for p in ("", "ref_") for c in (f"{p}kind", f"{p}dtype_raw", f"{p}dtype") if c in both.columns]
    distinct = both.filter(~scalar).select(cols).unique()  # a scalar's cell reads its value: every row
    for r in (*distinct.iter_rows(named=True), *both.filter(scalar).iter_rows(named=True)):
        if not msprobe_pairing.dtype_match(_msprobe_dtype(r, ""), _msprobe_dtype(r, "ref_")):
            return True
    return False


def _numeric_columns(cells: pl.DataFrame) -> set[str]:
    """The summary columns whose cells (rows with a target leaf) are all numbers in `cells`."""
    npu = cells.filter(pl.col("NPU Name") != N_A)
    labels = [f"{side} {label}" for side, _ in _SIDES for _, label, _ in _STATS]
    if npu.height == 0:
        return set(labels)
    numeric = npu.select([pl.col(c).str.contains(_NUMBER_CELL).fill_null(False).all() for c in labels])
    return {c for c, ok in zip(labels, numeric.row(0)) if ok}


def _fast_cells(rows: pl.DataFrame, mode: str | None) -> pl.DataFrame:
    """Every cell by column expressions (right for the `_fast` rows only)."""
    out: list[pl.Expr] = [pl.col("_i")]
    held: dict[tuple[str, str], pl.Expr] = {}
    pre_fill: dict[tuple[str, str], pl.Expr] = {}
    for side, pre in _SIDES:
        here, kind = pl.col(f"{pre}name").is_not_null(), pl.col(f"{pre}kind")
        tensor = kind == "tensor"
        dtype = pl.col(f"{pre}dtype")
        out.append(pl.when(here).then(pl.col(f"{pre}name")).otherwise(pl.lit(N_A)).alias(f"{side} Name"))
        out.append(
            pl.when(here & tensor)
            .then(_first(pl.col(f"{pre}dtype_raw"), pl.when(dtype.fill_null("") != "").then(pl.lit("torch.") + dtype)))
            .otherwise(None)
            .fill_null(pl.lit(N_A))
            .alias(f"{side} Dtype")
        )
        shape = pl.col(f"{pre}shape")
        shape_text = pl.lit("[") + shape.list.eval(pl.element().cast(pl.String)).list.join(", ") + pl.lit("]")
        out.append(
            pl.when(here & tensor & shape.is_not_null())
            .then(shape_text)
            .otherwise(pl.lit(N_A))
            .alias(f"{side} Tensor Shape")
        )
        rg = pl.col(f"{pre}requires_grad")
        out.append(
            pl.when(here & tensor & rg.is_not_null())
            .then(pl.when(rg).then(pl.lit("True")).otherwise(pl.lit("False")))
            .otherwise(pl.lit(N_A))
            .alias(f"{side} Requires_grad")
        )
        has_dump = pl.any_horizontal([pl.col(f"{pre}dump_{s}").is_not_null() for s, _, _ in _STATS])
        for stat, label, key in _STATS:
            dumped, own = pl.col(f"{pre}dump_{stat}"), pl.col(f"{pre}{stat}")
            value = pl.when(tensor).then(pl.when(has_dump).then(dumped).otherwise(own))
            out.append(pl.when(here).then(_summary_text(value)).otherwise(pl.lit(N_A)).alias(f"{side} {label}"))
            held[side, key] = pl.when(tensor).then(dumped)  # what msprobe holds: null leaves hold None
            pre_fill[side, key] = value  # the cell before msprobe_csv.fill (_stat_value)
    both = pl.col("name").is_not_null() & pl.col("ref_name").is_not_null()
    for col, own_col in _OWN_METRICS.items():
        if mode == "statistics" and col == "MaxRelativeErr":
            continue  # msprobe's relative error of the maxima (below)
        own_cell = _float_text(pl.col(own_col))
        out.append((_tensor_metric(col, own_cell) if mode == "tensor" else own_cell).alias(col))
    if mode == "statistics":
        for (_, _, key), diff_col in zip(_STATS, msprobe_csv.DIFF_COLUMNS):
            diff, rel = _stats_diff(held["NPU", key], held["Bench", key])
            out.append(pl.when(both).then(diff).otherwise(pl.lit(N_A)).alias(diff_col))
            out.append(pl.when(both).then(rel).otherwise(pl.lit(N_A)).alias(f"{key}RelativeErr"))
    else:
        for (stat, _, key), diff_col in zip(_STATS, msprobe_csv.DIFF_COLUMNS):
            a, b = pre_fill["NPU", key], pre_fill["Bench", key]
            same = (a == b) | (a.is_nan() & b.is_nan())
            diff_value = (
                pl.when(a.is_null() | b.is_null())
                .then(pl.col(f"{stat}_diff"))
                .when(same)
                .then(pl.lit(0.0))
                .otherwise(a - b)
            )
            out.append(_float_text(diff_value).alias(diff_col))
    if mode == "md5":  # msprobe_csv._md5 of a tensor or null leaf: the checksum, else CRC-32 of ''
        for col, pre in zip(msprobe_csv.MD5_COLUMNS, ("", "ref_")):
            checksum = pl.col(f"{pre}checksum")
            cell = (
                pl.when(pl.col(f"{pre}kind") == "null")
                .then(pl.lit(N_A))
                .when(checksum.fill_null("") != "")
                .then(checksum)
                .otherwise(pl.lit(f"{zlib.crc32(b''):08x}"))
            )
            out.append(pl.when(pl.col(f"{pre}name").is_not_null()).then(cell).otherwise(pl.lit(N_A)).alias(col))
    out.append(
        pl.when(pl.col("NPU Requires_grad") == pl.col("Bench Requires_grad"))
        .then(pl.lit("True"))
        .otherwise(pl.lit("False"))
        .alias("Requires_grad Consistent")
    )
    out.append(_data_names().alias("Data_name"))
    out.extend(_dumpstore_cells())
    first = rows.select(out[:1] + [e for e in out[1:] if not _refers_to_cells(e)])
    return first.with_columns([e for e in out[1:] if _refers_to_cells(e)])


def _tensor_metric(col: str, own: pl.Expr) -> pl.Expr:
    """A tensor-mode metric cell (msprobe_csv.fill): `unsupported` where msprobe cannot compare the pair (not two
    tensors with files), the exact cell where the files were read (a number as msprobe_csv._exact_cell makes it:
    `Nan`, ` inf`, else the float; other text as is), else dumpstore's own number."""
    comparable = pl.col("name").is_not_null() & pl.col("ref_name").is_not_null()
    comparable = comparable & (pl.col("kind") == "tensor") & (pl.col("ref_kind") == "tensor")
    comparable = comparable & (pl.col("data_name").fill_null("") != "") & (pl.col("ref_data_name").fill_null("") != "")
    exact = pl.col(msprobe_csv._EXACT[col])
    num = exact.str.strip_chars().cast(pl.Float64, strict=False)  # float(text): NaN, infinities, numbers
    exact_cell = pl.when(num.is_null()).then(exact).otherwise(_summary_text(num))
    return (
        pl.when(~comparable.fill_null(False))
        .then(pl.lit(msprobe_csv.UNSUPPORTED))
        .when(exact.is_not_null())
        .then(exact_cell)
        .otherwise(own)
    )


def _min_part(col: str) -> pl.Expr:
    """What one metric cell adds to msprobe_csv._extreme(..., is_min=True): a number (NaN for a float NaN), a
    '%' cell as a fraction, null where the row path skips it (None, 'Nan', N/A, other text)."""
    t = pl.col(col)
    pct = (t.str.strip_chars("%").cast(pl.Float64, strict=False) / 100).fill_null(0.0)
    return (
        pl.when(t.is_null() | t.is_in(["Nan", N_A]))
        .then(None)
        .when(t.str.ends_with("%"))
        .then(pct)
        .when(t.str.contains(_FLOAT_REPR))
        .then(t.cast(pl.Float64, strict=False))
        .otherwise(None)
    )


def _extreme_min(x: pl.Expr) -> pl.Expr:
    """msprobe_csv._extreme(..., is_min=True) of the values `x` of an op: from 1.0 down, NaN once one is NaN."""
    return pl.when(x.is_nan().any()).then(float("nan")).otherwise(pl.min_horizontal(x.min().fill_null(1.0), 1.0))


def _refers_to_cells(e: pl.Expr) -> bool:
    return e.meta.output_name() == "Requires_grad Consistent"


def _stats_diff(a: pl.Expr, b: pl.Expr) -> tuple[pl.Expr, pl.Expr]:
    """metrics.stats_diff for one statistic of two float tensors: (diff cell, relative-error cell) as text."""

    codes = {"other": 0, "nan": 1, "inf": 2, "-inf": 3, "num": 4}

    def kind(e: pl.Expr) -> pl.Expr:
        return (
            pl.when(e.is_null())
            .then(0)  # 'None'
            .when(e.is_nan())
            .then(1)
            .when(e == float("inf"))
            .then(2)
            .when(e == float("-inf"))
            .then(3)
            .otherwise(4)
        )

    from ..metrics import _STAT_RULES

    same = (a.is_null() & b.is_null()) | (a.is_nan() & b.is_nan()) | (a.cast(pl.String) == b.cast(pl.String))
    pair = kind(a) * 5 + kind(b)
    rules = {codes[ka] * 5 + codes[kb]: cell for (ka, kb), cell in _STAT_RULES.items() if ka in codes and kb in codes}
    static = pair.replace_strict(rules, default=N_A, return_dtype=pl.String)
    num = pair == 24
    diff = a - b
    rel = pl.when(b == 0).then(pl.lit("inf")).otherwise(_float_text((diff / b * 100).abs()) + pl.lit("%"))
    same = same.fill_null(False)
    diff_cell = pl.when(same).then(pl.lit("0")).when(num).then(_float_text(diff)).otherwise(static)
    rel_cell = pl.when(same).then(pl.lit("0")).when(num).then(rel).otherwise(static)
    return diff_cell, rel_cell


def _data_names() -> pl.Expr:
    parts = []
    for _, pre in _SIDES:
        name = pl.col(f"{pre}data_name")
        parts.append(
            pl.when(pl.col(f"{pre}name").is_null())
            .then(pl.lit(N_A))
            .otherwise(pl.when(name.fill_null("") == "").then(pl.lit("-1")).otherwise(name))
        )
    return pl.lit("['") + parts[0] + pl.lit("', '") + parts[1] + pl.lit("']")


def _dumpstore_cells() -> list[pl.Expr]:
    from .csvfile import RESULT_OF_STATUS

    def text(c: str) -> pl.Expr:
        return pl.col(c).cast(pl.String)

    return [
        text("step").alias("step"),
        text("rank").alias("rank"),
        pl.coalesce(pl.col("seq"), pl.col("ref_seq")).cast(pl.String).alias("seq"),
        _op_name().alias("op"),
        _first(pl.col("io"), pl.col("ref_io")).alias("io"),
        text("match").alias("match"),
        _float_text(pl.col("err")).alias("rel_l2"),
        text("err_source").alias("err_source"),
        _float_text(pl.col("err_bound")).alias("err_bound"),
        _float_text(pl.col("tol")).alias("tol"),
        text("tol_dtype").alias("tol_dtype"),
        _float_text(pl.col("severity")).alias("severity"),
        pl.col("status")
        .fill_null("")
        .replace_strict(RESULT_OF_STATUS, default=N_A, return_dtype=pl.String)
        .alias("dumpstore_result"),
        text("status").alias("dumpstore_status"),
        text("detail").alias("dumpstore_detail"),
        pl.when(pl.col("ref_name").is_not_null())
        .then(pl.col("ref_name"))
        .otherwise(pl.lit(N_A))
        .alias("dumpstore_paired_with"),
    ]


def _text(v: Any) -> str | None:
    """A cell as the csv module writes it (None stays None: an empty cell)."""
    if v is None:
        return None
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _final(v: Any) -> str | None:
    """A cell as the file holds it: through csvsafe, quoted as csv.writer quotes (None for an empty cell)."""
    text = _text(csvsafe.cell(v))
    if not text:
        return None
    if "," in text or '"' in text or "\n" in text:
        return '"' + text.replace('"', '""') + '"'
    return text


def _slow_cells(rows: pl.DataFrame, mode: str | None, fast: pl.DataFrame, cached: dict) -> pl.DataFrame:
    """The other rows: their kind cells and rule features by the row path's own functions (`_csv_row`,
    `msprobe_csv.fill`), computed once per distinct set of the inputs they read (arguments repeat over layers and
    steps); their other cells from the column expressions (`fast`, the same rows), Data_name by Python."""
    from .csvfile import _CSV_INPUTS, _csv_row

    keep = [c for c in rows.columns if c.removeprefix("ref_") in _CSV_INPUTS or c == "_i"]
    key_cols = [c for c in keep if c not in _NOT_KEY or (mode != "statistics" and c.endswith("_diff"))]
    out: list[tuple] = []
    data_names: list[str] = []
    for r in rows.select(keep).iter_rows(named=True):
        key = (r["name"] is not None, r["ref_name"] is not None) + tuple(_key(r[c]) for c in key_cols)
        got = cached.get(key)
        if got is None:
            d = _csv_row(r)
            msprobe_csv.fill(d, r, mode)
            cells = tuple(_final(d.get(c)) if c in _NUMERIC or c in _WORDS else _text(d.get(c)) for c in _KIND_CELLS)
            got = cached[key] = cells + _row_features(d, mode)
        out.append(got)
        data_names.append(_data_name_cell(r))
    own = () if mode == "statistics" else msprobe_csv.STAT_REL_COLUMNS  # MaxRelativeErr: dumpstore's own then
    names = [c for c in _KIND_CELLS if c in fast.columns and c not in own]
    types = {**{c: pl.String for c in _KIND_CELLS}, "_nrel_pct": pl.Float64, "_nrel_ext": pl.Float64, "_crc": pl.String}
    schema = {c: types.get(c, pl.Boolean) for c in (*_KIND_CELLS, *_FEATURES)}
    kind = pl.DataFrame(out, schema=schema, orient="row").select(*names, *_FEATURES)
    rest = fast.drop(*names, *_FEATURES, "Data_name")
    return pl.concat([rest, kind, pl.DataFrame({"Data_name": data_names})], how="horizontal").select(fast.columns)


def _key(v: Any) -> Any:
    """A value as a cache key: lists as tuples, -0.0 apart from 0.0 (they print apart); a NaN never matches, so a
    row holding one is computed on its own."""
    if isinstance(v, list):
        return tuple(_key(x) for x in v)
    if isinstance(v, float) and v == 0.0:
        return ("zero", math.copysign(1.0, v))
    return v


def _data_name_cell(r: dict[str, Any]) -> str:
    from .csvfile import _data_name

    t_here, r_here = r.get("name") is not None, r.get("ref_name") is not None
    return str([_data_name(r.get("data_name"), t_here), _data_name(r.get("ref_data_name"), r_here)])


def _row_features(d: dict[str, Any], mode: str | None) -> tuple:
    """What msprobe's per-op rules read of one row (msprobe_csv's checkers) apart from its names, for `_verdicts`:
    (NPU inf/nan and the bench's not, NormRelativeErr as a fraction, its part in the op's extreme, requires_grad
    differs, a scalar parameter differs, dtype differs, shape differs, the md5 rule's level where the checksums
    differ)."""
    from ..msprobe_csv import _is_inf_or_nan, _percent

    infnan = not (_is_inf_or_nan(d["Bench max"]) or _is_inf_or_nan(d["Bench min"])) and (
        _is_inf_or_nan(d["NPU max"]) or _is_inf_or_nan(d["NPU min"])
    )
    pct = ext = None
    if mode == "statistics":
        v = d["NormRelativeErr"]
        pct = abs(_percent(v))
        ext = _extreme_part(v)
    npu_rg, bench_rg = str(d["NPU Requires_grad"]), str(d["Bench Requires_grad"])
    rg = bool(npu_rg and bench_rg and npu_rg != bench_rg)
    param = bool(
        "class" in d["NPU Dtype"]
        and "class" in d["Bench Dtype"]
        and d["NPU Tensor Shape"] == "[]"
        and d["NPU max"] != d["Bench max"]
    )
    dtype = bool(d["NPU Dtype"] and d["Bench Dtype"] and d["NPU Dtype"] != d["Bench Dtype"])
    shape = d["NPU Tensor Shape"] != d["Bench Tensor Shape"]
    crc = None
    if mode == "md5" and d["NPU MD5"] != d["BENCH MD5"]:
        crc = "warning" if d["NPU MD5"] in msprobe_csv._NO_MD5 or d["BENCH MD5"] in msprobe_csv._NO_MD5 else "error"
    return infnan, pct, ext, rg, param, dtype, bool(shape), crc


def _extreme_part(value: Any) -> float | None:
    """What one cell adds to msprobe_csv._extreme(..., is_min=False): None where it is skipped."""
    from ..msprobe_csv import _percent

    if value is None or value in ("Nan", N_A):
        return None
    if isinstance(value, str) and value.endswith("%"):
        value = _percent(value)
    if isinstance(value, str):
        return None
    return float(value)


def _fast_features(cells: pl.DataFrame) -> list[pl.Expr]:
    """`_row_features` by column (right for the `_fast` rows, whose cells are numbers or fixed words)."""

    def infnan(c: str) -> pl.Expr:
        return pl.col(c).str.strip_chars().str.to_lowercase().is_in(["inf", "-inf", "nan"])

    feats = [
        ((~(infnan("Bench max") | infnan("Bench min"))) & (infnan("NPU max") | infnan("NPU min"))).alias("_infnan")
    ]
    if "NormRelativeErr" in cells.columns:
        nrel = pl.col("NormRelativeErr")
        pct = (nrel.str.strip_chars("%").cast(pl.Float64, strict=False) / 100).abs().fill_null(0.0)
        ext = pl.when(nrel.str.ends_with("%") & (nrel != "Nan")).then(pct)
        feats += [pct.alias("_nrel_pct"), ext.alias("_nrel_ext")]
    else:
        feats += [pl.lit(None, dtype=pl.Float64).alias("_nrel_pct"), pl.lit(None, dtype=pl.Float64).alias("_nrel_ext")]
    npu_dtype, bench_dtype = pl.col("NPU Dtype"), pl.col("Bench Dtype")
    feats += [
        (pl.col("NPU Requires_grad") != pl.col("Bench Requires_grad")).alias("_rg"),
        (
            npu_dtype.str.contains("class", literal=True)
            & bench_dtype.str.contains("class", literal=True)
            & (pl.col("NPU Tensor Shape") == "[]")
            & (pl.col("NPU max") != pl.col("Bench max"))
        ).alias("_param"),
        ((npu_dtype != "") & (bench_dtype != "") & (npu_dtype != bench_dtype)).alias("_dtype"),
        (pl.col("NPU Tensor Shape") != pl.col("Bench Tensor Shape")).alias("_shape"),
    ]
    if "NPU MD5" in cells.columns:
        npu, bench, none = pl.col("NPU MD5"), pl.col("BENCH MD5"), list(msprobe_csv._NO_MD5)
        level = pl.when(npu.is_in(none) | bench.is_in(none)).then(pl.lit("warning")).otherwise(pl.lit("error"))
        feats.append(pl.when(npu != bench).then(level).alias("_crc"))
    else:
        feats.append(pl.lit(None, dtype=pl.String).alias("_crc"))
    return feats


def _stack_info(rows: pl.DataFrame, stacks: dict[tuple, Any]) -> pl.Series:
    """NPU_Stack_Info: the op's stack on the first row of each op (by step, rank, source and name), else N/A."""
    first = pl.struct("step", "rank", "source", *_op_key()).is_first_distinct()
    first = first & (pl.col("record").fill_null("") != "")
    known = {k: str(list(f)) for k, f in stacks.items() if f is not None}
    if not known:
        return pl.Series("NPU_Stack_Info", [N_A] * rows.height, dtype=pl.String)
    keys = ("step", "rank", "stack_id")
    table = pl.DataFrame(
        {**{k: [key[i] for key in known] for i, k in enumerate(keys)}, "_frames": list(known.values())},
        schema={
            "step": rows.schema["step"],
            "rank": rows.schema["rank"],
            "stack_id": rows.schema["stack_id"],
            "_frames": pl.String,
        },
    )
    joined = rows.select(*keys, first.alias("_first")).join(table, on=list(keys), how="left", maintain_order="left")
    return joined.select(
        pl.when(pl.col("_first") & pl.col("_frames").is_not_null())
        .then(pl.col("_frames"))
        .otherwise(pl.lit(N_A))
        .alias("NPU_Stack_Info")
    )["NPU_Stack_Info"]


def _json_strings(s: pl.Series) -> pl.Series:
    """Each text as json.dumps writes it (null stays null)."""
    plain = s.str.contains(_PLAIN_JSON).fill_null(True)
    out = pl.select(pl.when(plain).then(pl.lit('"') + s + pl.lit('"'))).to_series()
    odd = (~plain) & s.is_not_null()
    if odd.any():
        out = out.scatter(odd.arg_true(), [json.dumps(v) for v in s.filter(odd).to_list()])
    return out


def _json_list(parts: list[pl.Series], name: str) -> pl.Series:
    """Per row, the JSON list of the parts' texts that are not null (json.dumps of a list of str)."""
    frame = pl.DataFrame([p.alias(f"p{i}") for i, p in enumerate(parts)])
    joined = frame.select(pl.concat_list(pl.all()).list.drop_nulls().list.join(", ").alias(name))[name]
    return pl.select(pl.lit("[") + joined + pl.lit("]")).to_series().alias(name)


def _fmt_where(s: pl.Series, where: pl.Series) -> pl.Series:
    """text.fmt of the values where `where` holds (null elsewhere), each distinct value formatted once."""
    done: dict[Any, str] = {}
    texts = [done[v] if v in done else done.setdefault(v, fmt(v)) for v in s.filter(where).to_list()]
    out = pl.Series(s.name, [None] * s.len(), dtype=pl.String)
    return out.scatter(where.arg_true(), pl.Series(texts, dtype=pl.String)) if texts else out


def _dumpstore_messages(rows: pl.DataFrame, cells: pl.DataFrame) -> pl.Series:
    """csvfile._messages for every row, as JSON text."""
    status, detail = pl.col("status"), pl.col("detail")
    said = rows.select(
        ((status == "diverged") & ~pl.col("nonfinite_mismatch").fill_null(False)).fill_null(False).alias("said")
    )["said"]
    err, tol = _fmt_where(rows["err"], said), _fmt_where(rows["tol"], said)
    some_detail = detail.fill_null("") != ""
    frame = rows.select(
        "status", "detail", "nonfinite_mismatch", "tol_dtype", "err_source", "name", "msprobe_message"
    ).with_columns(
        err.alias("_err"),
        tol.alias("_tol"),
        cells["NPU Requires_grad"].alias("_rg_npu"),
        cells["Bench Requires_grad"].alias("_rg_bench"),
    )
    verdict = (
        pl.when(status == "diverged")
        .then(
            pl.when(pl.col("nonfinite_mismatch").fill_null(False))
            .then(pl.lit("error: ") + _first(detail, pl.lit("non-finite values differ")))
            .otherwise(
                pl.lit("error: rel_l2 ")
                + pl.col("_err")
                + pl.lit(" > tol ")
                + pl.col("_tol")
                + pl.lit(" (")
                + pl.col("tol_dtype").fill_null("None")
                + pl.lit("), from ")
                + pl.col("err_source").fill_null("None")
                + pl.when(some_detail).then(pl.lit("; ") + detail).otherwise(pl.lit(""))
            )
        )
        .when(status == "error")
        .then(pl.lit("error: ") + _first(detail, pl.lit("leaf could not be read")))
        .when(status == "unmatched")
        .then(
            pl.when(pl.col("name").is_not_null())
            .then(pl.lit("warning: No bench data matched."))
            .otherwise(pl.lit("warning: only in the reference (bench); no target data matched."))
        )
        .when(status == "unknown")
        .then(pl.lit("warning: not comparable from what was dumped (no norm, sketch or checksum on both sides)"))
    )
    msg = pl.col("msprobe_message")
    info = pl.when(msg.fill_null("") != "").then(pl.lit("info: msprobe: ") + msg)
    rg = pl.when((pl.col("_rg_npu") != pl.col("_rg_bench")) & (status.fill_null("") != "unmatched")).then(
        pl.lit("warning: requires_grad ") + pl.col("_rg_npu") + pl.lit(" vs ") + pl.col("_rg_bench")
    )
    texts = frame.select(verdict.alias("a"), info.alias("b"), rg.alias("c"))
    return _json_list([_json_strings(texts[c]) for c in texts.columns], "dumpstore_message")


def _verdicts(cells: pl.DataFrame, mode: str) -> list[pl.Series]:
    """Result and Err_message by msprobe's rules per op for `mode` (statistics, tensor or md5;
    msprobe_csv.verdicts), by column.

    `_g` numbers the runs of rows of one op (consecutive): each op's aggregates are gathered back by it."""
    name = pl.col("NPU Name")
    npu = name != N_A
    output = npu & name.str.contains(".output.", literal=True)
    inputs = npu & ~output
    ext = pl.col("_nrel_ext")
    usable = ext.is_not_null() & ~ext.is_nan().fill_null(True)
    bench = pl.col("Bench Name")
    matched = (bench != "") & (bench != N_A)
    part = name.str.split(".").list.get(1, null_on_oob=True)
    ign = (
        pl.when(part.is_in(list(msprobe_csv._IGNORED_APIS)))
        .then(pl.lit("all"))
        .when(part.is_in(list(msprobe_csv._INPUT_IGNORED_APIS)))
        .then(pl.lit("input"))
        .otherwise(pl.lit("none"))
    )
    qkv = bench.str.contains("qkv", literal=True) | bench.str.contains("gate_up", literal=True)
    tensor = mode == "tensor"  # the two op-level rules of tensor mode read these metric cells
    mins = (
        [_min_part(c).alias(f"_m{i}") for i, c in enumerate(("One Thousandth Err Ratio", "Cosine"))] if tensor else []
    )
    base = cells.select(
        *mins,
        "_g",
        "_infnan",
        "_nrel_pct",
        "_nrel_ext",
        "_crc",
        ign.alias("_ign"),
        (matched & pl.col("_rg")).alias("_rg"),
        (matched & pl.col("_param")).alias("_param"),
        (matched & ~qkv & pl.col("_dtype")).alias("_dtype"),
        (matched & pl.col("_shape")).alias("_shape"),
        output.alias("_out"),
        inputs.alias("_in"),
    )
    per_op = base.group_by("_g", maintain_order=True).agg(
        pl.col("_ign").filter(pl.col("_in")).first().fill_null("none").alias("ign"),
        ext.filter(pl.col("_in") & usable).max().fill_null(0.0).abs().alias("rel_in"),
        ext.filter(pl.col("_out") & usable).max().fill_null(0.0).abs().alias("rel_out"),
        pl.int_range(pl.len()).filter(pl.col("_out")).first().alias("first_out"),
        pl.len().alias("n"),
        *(
            _extreme_min(pl.col(f"_m{i}").filter(pl.col(where))).alias(f"m{i}{where}")
            for i in range(len(mins))
            for where in ("_in", "_out")
        ),
    )
    start = per_op["n"].cum_sum() - per_op["n"]
    per_op = per_op.with_columns((start + pl.col("first_out")).alias("first_out"))
    g = base["_g"] - base["_g"].min()  # the chunk's ops numbered from 0, as per_op's rows
    base = base.with_columns(
        per_op["ign"].gather(g).alias("ign"),
        per_op["rel_in"].gather(g).alias("rel_in"),
        per_op["rel_out"].gather(g).alias("rel_out"),
        (per_op["first_out"].gather(g) == pl.int_range(0, base.height, dtype=pl.UInt32, eager=True)).alias("first"),
        *(per_op[f"m{i}{w}"].gather(g) for i in range(len(mins)) for w in ("_in", "_out")),
    )
    ign, rel_in, rel_out = pl.col("ign"), pl.col("rel_in"), pl.col("rel_out")
    skip = ign.is_in(["all", "input"])
    out_, in_ = pl.col("_out"), pl.col("_in")
    checked = (ign != "all") & (out_ | (in_ & (ign != "input")))
    pct = pl.col("_nrel_pct")
    pct = pl.when(pct.is_nan()).then(0.0).otherwise(pct)
    if mode == "md5":
        crc = pl.col("_crc")
        flags = {
            "crc_error": checked & (crc == "error"),
            "crc_warning": checked & (crc == "warning"),
        }
        flags = {k: v.fill_null(False) for k, v in flags.items()}
        result = (
            pl.when(flags["crc_error"])
            .then(pl.lit("error"))
            .when(flags["crc_warning"])
            .then(pl.lit("warning"))
            .otherwise(pl.lit("pass"))
        )
        message = (
            pl.when(flags["crc_error"])
            .then(pl.lit(json.dumps([_MESSAGES["crc_error"]])))
            .when(flags["crc_warning"])
            .then(pl.lit(json.dumps([_MESSAGES["crc_warning"]])))
            .otherwise(pl.lit("[]"))
        )
        done = base.select(result.alias("Result"), message.alias("Err_message"))
        return [done["Result"], done["Err_message"]]
    first = pl.col("first").fill_null(False)
    if tensor:  # msprobe_csv._CHECKERS["tensor"], in its order
        thousandth, cosine = (pl.col("m0_in"), pl.col("m0_out")), (pl.col("m1_in"), pl.col("m1_out"))
        flags = {
            "infnan": checked & pl.col("_infnan"),
            "thousandth": ~skip & first & (thousandth[0] > 0.9) & (thousandth[1] < 0.1),
            "rg": checked & pl.col("_rg"),
            "param": ~skip & in_ & pl.col("_param"),
            "dtype": checked & pl.col("_dtype"),
            "shape": checked & pl.col("_shape"),
            "coswarn": ~skip & first & (cosine[0] > 0.9) & (cosine[0] - cosine[1] > 0.1),
        }
    else:
        flags = {
            "infnan": checked & pl.col("_infnan"),
            "relerr": ~skip & (rel_in < 0.1) & out_ & (pct > 0.5),
            "rg": checked & pl.col("_rg"),
            "param": ~skip & in_ & pl.col("_param"),
            "dtype": checked & pl.col("_dtype"),
            "shape": checked & pl.col("_shape"),
            "relwarn": ~skip & first & (((rel_in == 0) & (rel_out > 0.1)) | ((rel_in != 0) & (rel_out / rel_in > 10))),
        }
    flags = {k: v.fill_null(False) for k, v in flags.items()}
    warn = "coswarn" if tensor else "relwarn"
    error = pl.any_horizontal([v for k, v in flags.items() if k != warn])
    result = pl.when(error).then(pl.lit("error")).when(flags[warn]).then(pl.lit("warning")).otherwise(pl.lit("pass"))
    parts = [pl.when(v).then(pl.lit(json.dumps(_MESSAGES[k]))) for k, v in flags.items()]
    message = pl.lit("[") + pl.concat_list(parts).list.drop_nulls().list.join(", ") + pl.lit("]")
    done = base.select(result.alias("Result"), message.alias("Err_message"))
    return [done["Result"], done["Err_message"]]


def write_header(f, cols: tuple[str, ...]) -> None:
    """The header line as csv.writer writes it (no neutraliser: our own column names)."""
    import csv
    import io

    head = io.StringIO()
    csv.writer(head, lineterminator="\n").writerow(cols)
    f.write(head.getvalue().encode("utf-8"))


def write(cells: pl.DataFrame, f, cols: tuple[str, ...]) -> int:
    """Write `cells` (text, None for empty) as csv.writer(lineterminator='\\n') would, each cell through
    dumpstore.csvsafe; returns the number of data rows."""
    text = [c for c in cols if c not in _NUMERIC and c not in _WORDS]
    cells = cells.with_columns([_quoted(_safe(cells[c])) for c in text])
    cells.write_csv(f, include_header=False, quote_style="never", line_terminator="\n")
    return cells.height


def _quoted(s: pl.Series) -> pl.Series:
    """Quoted as csv.writer quotes (a separator, a quote or a line end inside); empty text as an empty cell."""
    odd = (s.str.contains(r'[,"\n]') | (s == "")).fill_null(False)
    if not odd.any():
        return s
    part = s.filter(odd)
    part = pl.select(
        pl.when(part == "").then(None).otherwise(pl.lit('"') + part.str.replace_all('"', '""', literal=True) + '"')
    ).to_series()
    return s.scatter(odd.arg_true(), part)


def _safe(s: pl.Series) -> pl.Series:
    """csvsafe.cell on every text of the column (by Python on the few its black list matches)."""
    hit = (s.str.contains(csvsafe.BLACK_LIST.pattern) & ~s.str.contains(_NUMBER)).fill_null(False)
    if not hit.any():
        return s
    return s.scatter(hit.arg_true(), [csvsafe.cell(v) for v in s.filter(hit).to_list()])

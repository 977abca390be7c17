"""`write_csv`: the report CSV (columns and cells: csvfile.py), written by columns (csvcols.py) where the dump mode
allows, else row by row (csvfile.py); the same bytes either way."""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path
from typing import Any

import polars as pl

from dumpstore.csvsafe import row as safe_row
from dumpstore.errors import DumpstoreError

from .. import msprobe_csv
from ..compare import Comparison
from . import csvcols
from .csvfile import CSV_COLUMNS, N_A, PROGRESS_ROWS, Progress, iter_csv_rows

__all__ = ["differing", "write_csv"]


def write_csv(
    cmp: Comparison,
    path: str | Path,
    *,
    store=None,
    progress: Progress | None = None,
    only_differing: bool = False,
) -> int:
    """Write the comparison as CSV (see the module docstring); returns the number of data rows.

    The file is written under a temporary name beside `path` and renamed when complete.  `progress("csv",
    done, total)` is called every PROGRESS_ROWS rows (row by row) or chunk of rows (by columns), and at the end.
    `only_differing`: only the rows whose status is not `pass` (diverged, unmatched, unknown, error).
    """
    p = Path(path)
    part = p.with_name(p.name + ".part")
    total = differing(cmp).rows.height if only_differing else cmp.rows.height
    n = 0
    stack_of: dict[tuple, Any] = {}  # an op's stack, held for its first written row when its first row is left out
    mode = msprobe_csv.dump_mode(cmp, store)
    cols = msprobe_csv.columns(CSV_COLUMNS, mode)
    chunks = csvcols.frames(cmp, store, mode, cols)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if chunks is not None:
            with open(part, "wb") as fb:
                csvcols.write_header(fb, cols)
                for cells in chunks:
                    n += csvcols.write(_differing_cells(cells, stack_of) if only_differing else cells, fb, cols)
                    if progress is not None and n < total:
                        progress("csv", n, total)
            part.replace(p)
            if progress is not None:
                progress("csv", n, total)
            return n
        with open(part, "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(cols)
            # msprobe's Result and Err_message are judged per op over all its rows, then the rows are left out
            for row in iter_csv_rows(cmp, store=store):
                if only_differing:
                    op = (row["step"], row["rank"], row["op"])
                    if row["NPU_Stack_Info"] != N_A:
                        stack_of[op] = row["NPU_Stack_Info"]
                    if row["dumpstore_status"] in (None, "pass"):
                        continue
                    row["NPU_Stack_Info"] = stack_of.pop(op, N_A)
                w.writerow(safe_row(row[c] for c in cols))
                n += 1
                if progress is not None and n % PROGRESS_ROWS == 0:
                    progress("csv", n, total)
        part.replace(p)
    except OSError as exc:
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        raise DumpstoreError(f"{p}: cannot write the report ({exc.strerror or exc}); pick another path") from None
    except BaseException:  # Ctrl-C, SIGTERM (the CLI raises KeyboardInterrupt for it), a bug: no half file left
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        raise
    if progress is not None:
        progress("csv", n, total)
    return n


def _differing_cells(cells: pl.DataFrame, held: dict[tuple, Any]) -> pl.DataFrame:
    """The rows whose status is not `pass`; an op's stack moves to its first row written (as write_csv's loop);
    `held`: the stacks not yet written, kept from one chunk to the next."""
    keep, stack_col = [], []
    keys = zip(cells["step"].to_list(), cells["rank"].to_list(), cells["op"].to_list())
    for i, (op, stack, status) in enumerate(zip(keys, cells["NPU_Stack_Info"].to_list(), cells["dumpstore_status"])):
        if stack != N_A:
            held[op] = stack
        if status in (None, "pass"):
            continue
        keep.append(i)
        stack_col.append(held.pop(op, N_A))
    return cells[keep].with_columns(pl.Series("NPU_Stack_Info", stack_col, dtype=pl.String))


def differing(cmp: Comparison) -> Comparison:
    """The comparison with only its rows whose status is not `pass`."""
    from dataclasses import replace

    return replace(cmp, rows=cmp.rows.filter(pl.col("status") != "pass"))

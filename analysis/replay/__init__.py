"""Operator replay: each recorded API call of a tensor-mode dump recomputed on the CPU in float64 and in its
recorded dtype, and the run's recorded output judged against that (a local error per op, free of upstream error).

- `replay_run(store, run, ...)`: replay and store the run's `replay` table (DuckDB view `replay`).
- `kernel_finding(store, run)`: the first output in execution order over its standard (culprit kind `kernel`),
  from the stored table; None when the run was not replayed or every output passed.
- `side_by_side(store, target, ref)`: both runs' local errors per output, for the ops of the target.
- `write_acc_check_csv(df, path)`: the table as msprobe acc_check's result and details CSVs (their column names).

torch is imported only by `worker` (in the replay's processes), never by importing this package.
"""

from __future__ import annotations

from .findings import KERNEL, kernel_finding, kernel_message, side_by_side
from .plan import ReplayError
from .report import ACC_CHECK_COLUMNS, RESULT_COLUMNS, write_acc_check_csv
from .run import replay_run

__all__ = [
    "ACC_CHECK_COLUMNS",
    "KERNEL",
    "RESULT_COLUMNS",
    "ReplayError",
    "kernel_finding",
    "kernel_message",
    "replay_run",
    "side_by_side",
    "write_acc_check_csv",
]

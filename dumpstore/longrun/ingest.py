"""One long-run ingest: logs, TensorBoard event files and monitor output found under the given paths."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pyarrow as pa

from ..errors import DumpstoreError, DumpstoreWarning
from .anomalies import FILE as ANOMALY_FILE
from .anomalies import anomaly_files, read_anomalies
from .logs import LogFormatError, last_wins, read_log
from .monitor import NoMonitorFiles, monitor_csv
from .store import LongRun, write
from .tensorboard import event_files, read_events
from .walk import sorted_paths, walk

_LOG_SUFFIXES = (".log", ".txt", ".out")
_RANK = re.compile(r"rank[_-]?(\d+)", re.I)


class LongRunInputError(DumpstoreError):
    """A path that holds no log, event file or monitor output."""


def _rank_of(path: Path, default: int | None) -> int:
    if default is not None:
        return default
    m = _RANK.search(path.name)
    return int(m.group(1)) if m else 0


def collect(
    paths: list[Path],
    run: str,
    *,
    fmt: str | None = None,
    pattern: str | None = None,
    rank: int | None = None,
    logging_steps: int = 1,
) -> LongRun:
    """Read every source under `paths`: a log file, an event file, a folder (its *.log/*.txt/*.out files,
    event files, trainer_state.json, monitor CSV and msprobe's anomaly_detected/rank<r>/anomaly.json)."""
    lr = LongRun(run)
    scalars: list[pa.Table] = []
    anomalies: list[pa.Table] = []
    for path in paths:
        if not path.exists():
            raise LongRunInputError(f"{path}: no such file or folder; give a training log, an event file or folder")
        found = False
        if path.is_file() and "tfevents" not in path.name and not path.name.endswith((".csv", ANOMALY_FILE)):
            table, family = read_log(
                path, fmt=fmt, pattern=pattern, rank=_rank_of(path, rank), logging_steps=logging_steps
            )
            scalars.append(table)
            lr.formats.append(family)
            lr.sources.append(str(path))
            continue
        listing = walk(path) if path.is_dir() else None
        for ev in event_files(path, listing):
            scalars.append(read_events(ev, rank=_rank_of(ev.parent, rank) if rank is None else rank))
            lr.formats.append("tensorboard")
            lr.sources.append(str(ev))
            found = True
        if path.is_dir():
            logs = sorted_paths(
                [f for f in listing or [] if os.path.splitext(f[1])[1] in _LOG_SUFFIXES or f[1] == "trainer_state.json"]
            )
            for log in logs:
                try:
                    table, family = read_log(
                        log, fmt=fmt, pattern=pattern, rank=_rank_of(log, rank), logging_steps=logging_steps
                    )
                except LogFormatError as exc:  # a README.txt beside the logs: skipped, said
                    warnings.warn(f"skipped {exc}", DumpstoreWarning, stacklevel=2)
                    continue
                scalars.append(table)
                lr.formats.append(family)
                lr.sources.append(str(log))
                found = True
        alarms = anomaly_files(path, listing)
        if alarms:
            anomalies.append(read_anomalies(alarms))
            lr.formats.append("msprobe_anomalies")
            lr.sources += [str(p) for p, _ in alarms]
            found = True
        try:
            found_csv = monitor_csv(path, listing)  # any there? (read while written: write streams them)
            lr.monitor_roots.append(path)
            lr.monitor_listings.append(found_csv)
            lr.formats.append("monitor")
            lr.sources.append(str(path))
            found = True
        except NoMonitorFiles:
            if not found:
                raise LongRunInputError(
                    f"{path}: no training log (*.log, *.txt, *.out), TensorBoard event file (*tfevents*) or msprobe "
                    "monitor CSV found here; point at the log file, the event folder or the monitor output folder"
                ) from None
    if scalars:
        lr.scalars = last_wins(pa.concat_tables(scalars)) if len(scalars) > 1 else scalars[0]
    if anomalies:
        lr.anomalies = pa.concat_tables(anomalies)
    if (
        not lr.monitor_roots and lr.anomalies is None and (lr.scalars is None or lr.scalars.num_rows == 0)
    ):  # never an empty long run
        raise LongRunInputError(
            f"{', '.join(lr.sources) or paths[0]}: no scalar point found (an empty or cut-short event file?); "
            "point at a log or event file that holds the run's points"
        )
    return lr


def ingest_longrun(paths: list[Path], run: str, *, store: str | os.PathLike | None = None, **options) -> dict:
    """Read the sources of one long run and publish it in the store; returns its catalog row."""
    return write(store, collect(paths, run, **options))

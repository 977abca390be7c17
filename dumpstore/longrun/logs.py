"""Training-log readers: one row per (step, tag) for every number a log line carries.

Families (detected from the first lines holding a step, or named with `fmt`):
  megatron     `iteration N/ M | consumed samples: S | learning rate: ... | lm loss: ... | ...` (Megatron-LM,
               MindSpeed, their forks: every `key: number` field between the bars is kept)
  mindformers  `{ Epoch:[e/E], step:[s/S], loss: ..., lr: ..., overflow cond: False, loss_scale: ...,
               global_norm: [...] }`; the step is the global one, (e - 1) * S + s
  hf           HF Trainer's `{'loss': ..., 'grad_norm': ..., 'learning_rate': ..., 'epoch': ...}` (the n-th
               line with a 'loss' is step n * logging_steps) and trainer_state.json (`log_history`, with steps)
  pattern      a user regex with a named group `step` and one named group per tag
A step printed again (a resumed job replays iterations after its last checkpoint): the last line wins.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from ..errors import DumpstoreError
from .store import SCALAR_SCHEMA

FAMILIES = ("megatron", "mindformers", "hf", "pattern")

# canonical tags: what curves, health and the criteria read
TAG_ALIASES = {
    "lm loss": "loss",
    "lm_loss": "loss",
    "loss": "loss",
    "train/loss": "loss",
    "train_loss": "loss",
    "learning rate": "lr",
    "learning_rate": "lr",
    "learning-rate": "lr",
    "lr": "lr",
    "train/learning_rate": "lr",
    "grad norm": "grad_norm",
    "grad-norm": "grad_norm",
    "grad_norm": "grad_norm",
    "global_norm": "grad_norm",
    "train/grad_norm": "grad_norm",
    "loss scale": "loss_scale",
    "loss-scale": "loss_scale",
    "loss_scale": "loss_scale",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
    "consumed samples": "consumed_samples",
    "consumed-samples": "consumed_samples",
    "global batch size": "global_batch_size",
    "batch-size": "global_batch_size",
    "overflow cond": "overflow",
}


class LogFormatError(DumpstoreError):
    """A log that no reader understands, or a bad --pattern."""


def canonical_tag(tag: str) -> str:
    t = tag.strip()
    low = t.lower()
    if low in TAG_ALIASES:
        return TAG_ALIASES[low]
    return re.sub(r"[^0-9a-z_/.\-]+", "_", low).strip("_") or "value"


_NUM = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_WITH_UNIT = re.compile(r"^([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(?:[A-Za-z%/]+)$")


def to_number(text: str) -> float | None:
    """A log field as a float: numbers, nan/inf, True/False, `[1.23]`; None for anything else."""
    s = text.strip().strip("[]()'\"").strip().rstrip(",").strip()
    if _NUM.match(s):
        return float(s)
    unit = _WITH_UNIT.match(s)  # 123ms, 12.3T, 45%
    if unit:
        return float(unit.group(1))
    low = s.lower()
    if low in ("nan", "-nan", "+nan"):
        return math.nan
    if low in ("inf", "+inf", "infinity", "+infinity"):
        return math.inf
    if low in ("-inf", "-infinity"):
        return -math.inf
    if low == "true":
        return 1.0
    if low == "false":
        return 0.0
    return None


_MEGATRON = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_MINDFORMERS = re.compile(
    r"Epoch:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,\s*step:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,(.*?)\}?\s*$"
)
_MF_FIELD = re.compile(r"\s*([A-Za-z_][\w ]*?)\s*:\s*(\[[^\]]*\]|[^,]+)")
_HF_LINE = re.compile(r"\{\s*'(?:loss|eval_loss|train_loss|grad_norm|learning_rate)'\s*:")
_HF_FIELD = re.compile(r"'([^']+)'\s*:\s*([^,}]+)")


class Rows:
    """Scalar rows collected in line order (duplicates resolved later: the last line wins)."""

    def __init__(self) -> None:
        self.step: list[int] = []
        self.samples: list[int | None] = []
        self.tag: list[str] = []
        self.value: list[float] = []

    def add(self, step: int, samples: int | None, fields: Iterable[tuple[str, float]]) -> None:
        for tag, value in fields:
            self.step.append(step)
            self.samples.append(samples)
            self.tag.append(tag)
            self.value.append(value)

    def table(self, rank: int) -> pa.Table:
        n = len(self.step)
        return pa.table(
            {
                "rank": pa.array([rank] * n, pa.int64()),
                "step": pa.array(self.step, pa.int64()),
                "consumed_samples": pa.array(self.samples, pa.int64()),
                "tag": pa.array(self.tag, pa.string()),
                "value": pa.array(self.value, pa.float64()),
            }
        )


_MEGATRON_HEAD = r"\biteration\s+(\d+)\s*/\s*\d+\s*\|"
_NUMBER_PREFIX = r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def numbers(col):
    """A polars string expression as Float64: numbers, nan/inf, True/False, `[1.23]`, a unit suffix (`123ms`);
    null for anything else (the same rules as to_number)."""
    import polars as pl

    txt = col.str.strip_chars().str.strip_chars("[](),").str.strip_chars()
    low = txt.str.to_lowercase()
    return (
        pl.when(low == "true")
        .then(pl.lit(1.0))
        .when(low == "false")
        .then(pl.lit(0.0))
        .otherwise(
            txt.cast(pl.Float64, strict=False).fill_null(
                txt.str.extract(_NUMBER_PREFIX, 0).cast(pl.Float64, strict=False)
            )
        )
    )


_CHUNK_LINES = 5_000  # lines parsed at a time: polars' split and explode copy each line's text a few times (and
# keep the memory: 20k lines a chunk held 70 MB more for the same CPU)


def _megatron_columnar(lines: list[str], rank: int) -> pa.Table:
    """Megatron lines parsed column-wise (polars): every `key: number` field between the bars; in chunks of
    lines, so memory follows the chunk, not the log."""
    if len(lines) > _CHUNK_LINES:
        return pa.concat_tables(
            _megatron_columnar(lines[i : i + _CHUNK_LINES], rank) for i in range(0, len(lines), _CHUNK_LINES)
        )
    import polars as pl

    df = pl.DataFrame({"line": lines}, schema={"line": pl.String})
    df = df.filter(pl.col("line").str.contains(_MEGATRON_HEAD)).with_row_index("_line")
    parts = pl.col("line").str.split("|")
    df = df.select(
        "_line",
        parts.list.first().str.extract(r"\biteration\s+(\d+)\s*/", 1).cast(pl.Int64).alias("step"),
        pl.col("line").str.extract(r"consumed samples:\s*(\d+)", 1).cast(pl.Int64).alias("consumed_samples"),
        parts.list.slice(1).alias("part"),
    ).explode("part")
    kv = pl.col("part").str.splitn(":", 2)
    df = df.with_row_index("_field").with_columns(
        kv.struct.field("field_0").str.strip_chars().alias("key"), kv.struct.field("field_1").alias("raw")
    )
    # a plain number first (nearly every field); numbers()' fuller rules only for the fields that are not one
    df = df.with_columns(pl.col("raw").str.strip_chars().cast(pl.Float64, strict=False).alias("value"))
    rest = df.filter(pl.col("value").is_null())
    if rest.height:
        rest = rest.with_columns(numbers(pl.col("raw")).alias("value"))
        df = pl.concat([df.filter(pl.col("value").is_not_null()), rest]).sort("_field")
    df = df.filter(pl.col("value").is_not_null() & pl.col("key").is_not_null() & (pl.col("key") != ""))
    keys = df.get_column("key").unique().to_list()
    df = df.with_columns(pl.col("key").replace_strict({k: canonical_tag(k) for k in keys}).alias("tag"))
    out = df.select(pl.lit(rank, pl.Int64).alias("rank"), "step", "consumed_samples", "tag", "value")
    return out.to_arrow().cast(SCALAR_SCHEMA)  # (not a Rows table's: pa.array imports pandas)


def _mindformers(m: re.Match) -> tuple[int, int | None, list[tuple[str, float]]]:
    epoch, per_epoch, s = int(m.group(1)), int(m.group(4)), int(m.group(3))
    step = (epoch - 1) * per_epoch + s
    fields = [("epoch", float(epoch))]
    for fm in _MF_FIELD.finditer(m.group(5)):
        num = to_number(fm.group(2))
        if num is not None:
            fields.append((canonical_tag(fm.group(1)), num))
    return step, None, fields


def detect(lines: list[str]) -> str | None:
    for line in lines:
        if _MEGATRON.search(line):
            return "megatron"
        if _MINDFORMERS.search(line):
            return "mindformers"
        if _HF_LINE.search(line):
            return "hf"
    return None


def read_log(
    path: Path, *, fmt: str | None = None, pattern: str | None = None, rank: int = 0, logging_steps: int = 1
) -> tuple[pa.Table, str]:
    """Read one log file into scalars rows (rank, step, consumed_samples, tag, value); returns (table, family)."""
    if path.name == "trainer_state.json" or (fmt == "hf" and path.suffix == ".json"):
        return _trainer_state(path, rank), "hf"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise LogFormatError(f"{path}: cannot read the log ({exc.strerror}); check the path") from None
    lines = text.splitlines()
    del text  # (a 100k-step log: 30 MB of text, and as much again in lines)
    if pattern is not None:
        fmt = "pattern"
    if fmt is None:
        fmt = detect(lines[:20000]) or detect(lines)
        if fmt is None:
            raise LogFormatError(
                f"{path}: no Megatron (`iteration N/ M | ...`), MindFormers (`{{ Epoch:[..], step:[..], ...`) or "
                "HF Trainer (`{'loss': ...}`) line found; give --pattern REGEX with a named group `step` "
                "(e.g. --pattern 'step (?P<step>\\d+) loss (?P<loss>\\S+)')"
            )
    rows = Rows()
    if fmt == "megatron":
        table = _megatron_columnar(lines, rank)
        del lines
        if table.num_rows == 0:
            raise LogFormatError(f"{path}: no megatron line with a step found; check --format/--pattern")
        return last_wins(table, fill_samples=False), fmt
    elif fmt == "mindformers":
        for line in lines:
            m = _MINDFORMERS.search(line)
            if m:
                rows.add(*_mindformers(m))
    elif fmt == "hf":
        n = 0
        for line in lines:
            if not _HF_LINE.search(line):
                continue
            fields = [(k, to_number(v)) for k, v in _HF_FIELD.findall(line)]
            kept = [(canonical_tag(k), v) for k, v in fields if v is not None]
            if any(k == "loss" for k, _ in fields) or n == 0:
                n += 1
            rows.add(n * logging_steps, None, kept)  # type: ignore[arg-type]
    elif fmt == "pattern":
        _by_pattern(path, lines, pattern, rows)
    else:
        raise LogFormatError(f"{path}: unknown log format {fmt!r}; give one of {', '.join(FAMILIES)}")
    if not rows.step:
        raise LogFormatError(f"{path}: no {fmt} line with a step found; check --format/--pattern")
    return last_wins(rows.table(rank)), fmt


def _by_pattern(path: Path, lines: list[str], pattern: str | None, rows: Rows) -> None:
    try:
        rx = re.compile(pattern or "")
    except re.error as exc:
        raise LogFormatError(f"--pattern {pattern!r}: not a regular expression ({exc})") from None
    if "step" not in rx.groupindex or len(rx.groupindex) < 2:
        raise LogFormatError(
            f"--pattern {pattern!r}: needs a named group `step` and one named group per value "
            "(e.g. 'step (?P<step>\\d+) loss (?P<loss>\\S+)')"
        )
    for line in lines:
        m = rx.search(line)
        if not m:
            continue
        step = to_number(m.group("step") or "")
        if step is None or not math.isfinite(step):
            continue
        fields = []
        samples = None
        for name, val in m.groupdict().items():
            if name == "step" or val is None:
                continue
            num = to_number(val)
            if num is None:
                continue
            tag = canonical_tag(name)
            if tag == "consumed_samples" and math.isfinite(num):
                samples = int(num)
            fields.append((tag, num))
        rows.add(int(step), samples, fields)


def _trainer_state(path: Path, rank: int) -> pa.Table:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        history = state["log_history"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LogFormatError(f"{path}: not an HF trainer_state.json with a log_history ({exc})") from None
    rows = Rows()
    for entry in history:
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            continue
        fields = []
        for k, v in entry.items():
            if k == "step" or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            fields.append((canonical_tag(k), float(v)))
        rows.add(entry["step"], None, fields)
    if not rows.step:
        raise LogFormatError(f"{path}: log_history holds no entry with a step")
    return last_wins(rows.table(rank))


def last_wins(table: pa.Table, *, fill_samples: bool = True) -> pa.Table:
    """One row per (rank, step, tag): the last one in line order (a resumed job's replay replaces the first);
    consumed samples filled per step from any tag of that step's last line (unless every row has its line's
    already); sorted by step."""
    if table.num_rows and not any(table.column(c).null_count for c in ("rank", "step", "tag")):
        return _last_wins_numpy(table, fill_samples)
    import polars as pl

    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    df = df.with_row_index("_line").unique(["rank", "step", "tag"], keep="last", maintain_order=True)
    df = df.sort(["rank", "step", "_line"])
    if fill_samples:
        df = df.with_columns(pl.col("consumed_samples").max().over(["rank", "step"]))
    return df.drop("_line").to_arrow().cast(table.schema)


def _last_wins_numpy(table: pa.Table, fill_samples: bool) -> pa.Table:
    """last_wins by sorting integer keys (a 100k-step log is 900k rows: Polars' unique on them held ~150 MB),
    for a table without a null rank, step or tag."""
    import numpy as np

    from .arrow import codes, to_numpy

    n = table.num_rows
    rank = to_numpy(table.column("rank"), np.int64, 0)
    step = to_numpy(table.column("step"), np.int64, 0)
    tag = codes(table.column("tag").combine_chunks().dictionary_encode())
    order = np.lexsort((np.arange(n), tag, step, rank))  # by rank, step, tag, then line
    r, s, t = rank[order], step[order], tag[order]
    last = np.ones(n, bool)
    last[:-1] = (r[1:] != r[:-1]) | (s[1:] != s[:-1]) | (t[1:] != t[:-1])
    keep = order[last]
    keep = keep[np.lexsort((keep, step[keep], rank[keep]))]  # by rank, step, then line
    out = table.take(pa.array(keep))
    if fill_samples:  # consumed samples: the largest of the step's kept rows (null where none has one)
        col = out.column("consumed_samples")
        lo = np.iinfo(np.int64).min
        vals = to_numpy(col, np.int64, lo)
        r, s = rank[keep], step[keep]
        starts = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (s[1:] != s[:-1])])
        top = np.repeat(np.maximum.reduceat(vals, starts), np.diff(np.r_[starts, len(vals)]))
        i = out.schema.get_field_index("consumed_samples")
        out = out.set_column(i, "consumed_samples", pa.array(top, pa.int64(), mask=top == lo))
    return out.cast(table.schema)

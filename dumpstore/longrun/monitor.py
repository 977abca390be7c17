"""msprobe monitor output (TrainerMon and monitor_v2 CSV) read column-wise into the `monitor` table.

Layouts:
  TrainerMon  `{out}/{MonDD_HH-MM-SS}-rank{r}-{uuid8}/{prefix}_{first}-{last}.csv`, prefixes actv, actv_grad,
              grad_unreduced, grad_reduced, param_origin, param_updated, exp_avg, exp_avg_sq, other; header
              `vpp_stage,name,step[,micro_step],<ops>`; a tensor missing at a step is a row of `nan` strings
  monitor_v2  `{out}/rank_{r}/{slug}_step{a}-{b}.csv`, header `vpp_stage,step,module_name,scope[,micro_step],
              <ops>`; slug module (scope forward/backward), weight_grad (reduced/unreduced), param
              (param_origin/param_updated), optimizer (exp_avg/exp_avg_sq/...)
Both become one table: rank, step, micro_step, vpp_stage, prefix (the TrainerMon prefix; monitor_v2 rows are
mapped onto it), name (as written), module (the module path), param (parameter name for parameter rows,
`layers.0.weight`, the same as param_stats.param of a dump), direction / io (as in the tensors table:
forward/backward, input/output/parameters/parameters_grad/optimizer), seq (row order within prefix, rank and
step: execution order for activations, registration order for parameters), norm, min, max, mean, zeros (a
fraction), nans (a count), shape, dtype (canonical), missing (a row of nan strings: no tensor at that step).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import DumpstoreError

PREFIXES = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "param_updated",
    "exp_avg",
    "exp_avg_sq",
    "other",
)
# execution order within a step: forward activations, backward activation gradients, gradients before and after
# the all-reduce, the optimizer's moments, weights before and after the update (param_origin: the step's weights)
PREFIX_ORDER = {
    "param_origin": 0,
    "actv": 1,
    "actv_grad": 2,
    "grad_unreduced": 3,
    "grad_reduced": 4,
    "exp_avg": 5,
    "exp_avg_sq": 6,
    "param_updated": 7,
    "other": 8,
}
STAT_COLUMNS = ("norm", "min", "max", "mean", "zeros", "nans")

_V1_FILE = re.compile(r"^(" + "|".join(sorted(PREFIXES, key=len, reverse=True)) + r")_(\d+)-(\d+)\.csv$")
_V1_DIR = re.compile(r"-rank(\d+)-[0-9a-fA-F]{8}$|^rank(\d+)$")
_V2_FILE = re.compile(r"^([A-Za-z0-9_.-]+?)_step(\d+)-(\d+)\.csv$")
_V2_DIR = re.compile(r"^rank_(\d+)$")
_V2_SCOPE = {
    ("module", "forward"): "actv",
    ("module", "backward"): "actv_grad",
    ("weight_grad", "reduced"): "grad_reduced",
    ("weight_grad", "unreduced"): "grad_unreduced",
}


class MonitorFormatError(DumpstoreError):
    """Monitor output that is not msprobe's CSV layout."""


class NoMonitorFiles(MonitorFormatError):
    """A folder holding no monitor CSV at all."""


def monitor_files(root: Path) -> list[tuple[Path, int, str, str]]:
    """(file, rank, layout, slug-or-prefix) of every monitor CSV under `root` (the output folder, a rank folder
    or one file)."""
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*.csv") if p.is_file())
    out = []
    for p in paths:
        v1, v2 = _V1_FILE.match(p.name), _V2_FILE.match(p.name)
        d1, d2 = _V1_DIR.search(p.parent.name), _V2_DIR.match(p.parent.name)
        if v1 and (d1 or not d2):
            rank = int((d1.group(1) or d1.group(2)) if d1 else 0)
            out.append((p, rank, "v1", v1.group(1)))
        elif v2 and d2:
            out.append((p, int(d2.group(1)), "v2", v2.group(1)))
    if not out:
        raise NoMonitorFiles(
            f"{root}: no msprobe monitor CSV found (TrainerMon `<time>-rank<r>-<id>/<prefix>_<a>-<b>.csv` or "
            "monitor_v2 `rank_<r>/<slug>_step<a>-<b>.csv`); point at the monitor's output folder"
        )
    return out


def _header(path: Path) -> list[str]:
    try:
        with path.open("rb") as f:
            return f.readline().decode("utf-8", "replace").strip().split(",")
    except OSError as exc:
        raise MonitorFormatError(f"{path}: cannot read ({exc.strerror})") from None


def _read_csv(paths: list[Path], head: list[str]):
    """Monitor CSV files of one header as one polars DataFrame (statistics as Float64: `nan` strings are NaN);
    polars reads the files in parallel."""
    import polars as pl

    types: dict[str, Any] = {c: pl.Float64 for c in head if c in STAT_COLUMNS}
    types.update({c: pl.Int64 for c in ("step", "micro_step", "vpp_stage") if c in head})
    # names, shapes and dtypes repeat at every step: categorical (read once per distinct value, joined and written
    # to Parquet as dictionary codes)
    types.update({c: pl.Categorical for c in ("name", "module_name", "scope", "shape", "dtype") if c in head})
    try:
        return pl.read_csv(paths, schema_overrides=types, null_values=[""])  # type: ignore[arg-type]
    except (pl.exceptions.PolarsError, OSError) as exc:
        if len(paths) > 1:  # name the file
            for p in paths:
                _read_csv([p], head)
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MonitorFormatError(
            f"{paths[0]}: not a monitor CSV ({line}); expected header vpp_stage,name,step[,micro_step],<ops>"
        ) from None


def _frame(paths: list[Path], head: list[str], rank: int, layout: str, slug: str):
    import polars as pl

    need = {"name", "step"} if layout == "v1" else {"module_name", "step", "scope"}
    if not need <= set(head):
        raise MonitorFormatError(
            f"{paths[0]}: header {','.join(head)} lacks {', '.join(sorted(need - set(head)))}; "
            "not a monitor CSV of this msprobe layout"
        )
    df = _read_csv(paths, head)
    if layout == "v1":
        df = df.with_columns(pl.lit(slug).cast(pl.Categorical).alias("prefix"))
    else:
        mapped = pl.col("scope")
        for (s, scope), prefix in _V2_SCOPE.items():
            if s == slug:
                mapped = pl.when(pl.col("scope") == scope).then(pl.lit(prefix)).otherwise(mapped)
        df = df.rename({"module_name": "name"}).with_columns(
            mapped.cast(pl.String).cast(pl.Categorical).alias("prefix")
        )
        df = df.drop("scope")
    return df.with_columns(pl.lit(rank, pl.Int64).alias("rank"))


def read_monitor(root: Path) -> pa.Table:
    """Every monitor CSV under `root` as one `monitor` table (see the module doc)."""
    import polars as pl

    return pl.concat(list(iter_monitor_frames(root)), how="vertical_relaxed").to_arrow()


def iter_monitor_frames(root: Path, *, max_rows: int = 4_000_000):
    """The monitor table of `root` in pieces (polars DataFrames of COLUMNS): one per (rank, prefix, header)
    group of files, a group of more than `max_rows` rows (estimated from file sizes) in several reads, so memory
    stays bounded whatever the run's length."""
    groups: dict[tuple, list[Path]] = {}
    for path, rank, layout, slug in monitor_files(root):  # one read per (rank, prefix, header)
        groups.setdefault((rank, layout, slug, tuple(_header(path))), []).append(path)
    for (rank, layout, slug, head), paths in groups.items():
        for chunk in _chunks(paths, max_rows):
            yield _complete(_frame(chunk, list(head), rank, layout, slug))


def _chunks(paths: list[Path], max_rows: int) -> list[list[Path]]:
    """Consecutive runs of files of at most ~max_rows rows (about 100 bytes a row)."""
    out: list[list[Path]] = [[]]
    size = 0
    for p in paths:
        n = p.stat().st_size // 100
        if out[-1] and size + n > max_rows:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def _complete(df):
    import polars as pl

    for col, dt in (
        ("micro_step", pl.Int64),
        ("vpp_stage", pl.Int64),
        ("shape", pl.Categorical),
        ("dtype", pl.Categorical),
    ):
        if col not in df.columns:
            df = df.with_columns(pl.lit(None, dt).alias(col))
    for col in STAT_COLUMNS:
        if col not in df.columns:
            df = df.with_columns(pl.lit(None, pl.Float64).alias(col))
    return _derive(df)


_ACT_SUFFIX = r"\.(?:grad_)?(input|output)(?:_grad)?(?:\.\d+)?$"
COLUMNS = [
    "rank",
    "step",
    "micro_step",
    "vpp_stage",
    "prefix",
    "name",
    "module",
    "param",
    "direction",
    "io",
    "seq",
    *STAT_COLUMNS,
    "shape",
    "dtype",
    "missing",
]


def _names(df):
    """module, param, direction, io and seq of each distinct (prefix, name): computed once per name, not per row
    (a name repeats at every step). seq: the order of first appearance within the prefix."""
    import polars as pl

    names = df.select("prefix", "name").unique(maintain_order=True)
    name, prefix = pl.col("name").cast(pl.String), pl.col("prefix").cast(pl.String)
    is_act = prefix.is_in(["actv", "actv_grad"])
    grads = prefix.is_in(["grad_unreduced", "grad_reduced"])
    params = prefix.is_in(["param_origin", "param_updated"])
    return names.with_columns(
        pl.when(is_act)
        .then(name.str.replace(_ACT_SUFFIX, "").str.strip_chars("."))
        .otherwise(name.str.replace(r"\.[^.]+$", ""))
        .alias("module"),
        pl.when(is_act).then(pl.lit(None, pl.String)).otherwise(name).alias("param"),
        pl.when(prefix == "actv")
        .then(pl.lit("forward"))
        .when(prefix == "actv_grad")
        .then(pl.lit("backward"))
        .when(grads)
        .then(pl.lit("parameters_grad"))
        .when(params)
        .then(pl.lit("parameters"))
        .when(prefix.str.starts_with("exp_avg"))
        .then(pl.lit("optimizer"))
        .otherwise(pl.lit("other"))
        .alias("direction"),
        pl.when(is_act)
        .then(name.str.extract(_ACT_SUFFIX, 1))
        .when(grads)
        .then(pl.lit("parameters_grad"))
        .when(params)
        .then(pl.lit("parameters"))
        .otherwise(prefix)
        .alias("io"),
        pl.int_range(pl.len()).over("prefix").cast(pl.Int32).alias("seq"),
    ).with_columns(pl.col("module", "param", "direction", "io").cast(pl.Categorical))


def _shapes(df):
    """shape (list of int64), dtype (canonical) and missing of each distinct (shape, dtype) text."""
    import polars as pl

    u = df.select("shape", "dtype").unique()
    txt = pl.col("shape").cast(pl.String).str.strip_chars("[]() ")
    dtype = pl.col("dtype").cast(pl.String)
    missing = dtype.is_null() | dtype.str.to_lowercase().is_in(["nan", ""])
    return u.with_columns(
        pl.when(missing | txt.is_null() | (txt == ""))
        .then(pl.lit(None, pl.List(pl.Int64)))
        .otherwise(txt.str.split(",").list.eval(pl.element().str.strip_chars().cast(pl.Int64, strict=False)))
        .alias("shape_list"),
        pl.when(missing)
        .then(pl.lit(None, pl.String))
        .otherwise(dtype.str.replace(r"^torch\.", ""))
        .cast(pl.Categorical)
        .alias("dtype_c"),
        missing.alias("missing"),
    )


def _derive(df):

    df = df.join(_names(df), on=["prefix", "name"], how="left", nulls_equal=True)
    df = df.join(_shapes(df), on=["shape", "dtype"], how="left", nulls_equal=True)
    df = df.drop("shape", "dtype").rename({"shape_list": "shape", "dtype_c": "dtype"})
    return df.select(COLUMNS)

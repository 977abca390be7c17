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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
        raise MonitorFormatError(
            f"{root}: no msprobe monitor CSV found (TrainerMon `<time>-rank<r>-<id>/<prefix>_<a>-<b>.csv` or "
            "monitor_v2 `rank_<r>/<slug>_step<a>-<b>.csv`); point at the monitor's output folder"
        )
    return out


def _read_csv(path: Path) -> pa.Table:
    import pyarrow.csv as pcsv

    try:
        head = path.open("rb").readline().decode("utf-8", "replace").strip().split(",")
    except OSError as exc:
        raise MonitorFormatError(f"{path}: cannot read ({exc.strerror})") from None
    types = {c: pa.float64() for c in head if c in STAT_COLUMNS}
    types.update({c: pa.int64() for c in ("step", "micro_step", "vpp_stage") if c in head})
    types.update({c: pa.string() for c in ("name", "module_name", "scope", "shape", "dtype") if c in head})
    try:
        return pcsv.read_csv(
            path,
            read_options=pcsv.ReadOptions(use_threads=False, block_size=1 << 24),
            convert_options=pcsv.ConvertOptions(
                column_types=types, null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False
            ),
        )
    except (pa.ArrowInvalid, OSError) as exc:
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MonitorFormatError(
            f"{path}: not a monitor CSV ({line}); expected header vpp_stage,name,step[,micro_step],<ops>"
        ) from None


def _frame(path: Path, rank: int, layout: str, slug: str):
    import polars as pl

    table = _read_csv(path)
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    need = {"name", "step"} if layout == "v1" else {"module_name", "step", "scope"}
    if not need <= set(df.columns):
        raise MonitorFormatError(
            f"{path}: header {','.join(df.columns)} lacks {', '.join(sorted(need - set(df.columns)))}; "
            "not a monitor CSV of this msprobe layout"
        )
    if layout == "v1":
        df = df.with_columns(pl.lit(slug).alias("prefix"))
    else:
        mapped = pl.col("scope")
        for (s, scope), prefix in _V2_SCOPE.items():
            if s == slug:
                mapped = pl.when(pl.col("scope") == scope).then(pl.lit(prefix)).otherwise(mapped)
        df = df.rename({"module_name": "name"}).with_columns(mapped.alias("prefix")).drop("scope")
    return df.with_columns(pl.lit(rank, pl.Int64).alias("rank"))


def read_monitor(root: Path, *, threads: int = 2) -> pa.Table:
    """Every monitor CSV under `root` as one `monitor` table (see the module doc)."""
    import polars as pl

    files = monitor_files(root)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        frames = list(pool.map(lambda f: _frame(*f), files))
    df = pl.concat(frames, how="diagonal_relaxed")
    for col, dt in (("micro_step", pl.Int64), ("vpp_stage", pl.Int64), ("shape", pl.String), ("dtype", pl.String)):
        if col not in df.columns:
            df = df.with_columns(pl.lit(None, dt).alias(col))
    for col in STAT_COLUMNS:
        if col not in df.columns:
            df = df.with_columns(pl.lit(None, pl.Float64).alias(col))
    return _derive(df).to_arrow()


_ACT_SUFFIX = r"\.(?:grad_)?(input|output)(?:_grad)?(?:\.\d+)?$"


def _derive(df):
    import polars as pl

    name = pl.col("name")
    prefix = pl.col("prefix")
    is_act = prefix.is_in(["actv", "actv_grad"])
    shape_txt = pl.col("shape").str.strip_chars("[]() ")
    missing = pl.col("dtype").is_null() | pl.col("dtype").str.to_lowercase().is_in(["nan", ""])
    df = df.with_columns(
        pl.when(is_act)
        .then(name.str.replace(_ACT_SUFFIX, "").str.strip_chars("."))
        .otherwise(name.str.replace(r"\.[^.]+$", ""))
        .alias("module"),
        pl.when(is_act).then(pl.lit(None, pl.String)).otherwise(name).alias("param"),
        pl.when(prefix == "actv")
        .then(pl.lit("forward"))
        .when(prefix == "actv_grad")
        .then(pl.lit("backward"))
        .when(prefix.is_in(["grad_unreduced", "grad_reduced"]))
        .then(pl.lit("parameters_grad"))
        .when(prefix.is_in(["param_origin", "param_updated"]))
        .then(pl.lit("parameters"))
        .when(prefix.str.starts_with("exp_avg"))
        .then(pl.lit("optimizer"))
        .otherwise(pl.lit("other"))
        .alias("direction"),
        pl.when(is_act)
        .then(name.str.extract(_ACT_SUFFIX, 1))
        .when(prefix.is_in(["grad_unreduced", "grad_reduced"]))
        .then(pl.lit("parameters_grad"))
        .when(prefix.is_in(["param_origin", "param_updated"]))
        .then(pl.lit("parameters"))
        .otherwise(prefix)
        .alias("io"),
        pl.when(missing | (shape_txt == ""))
        .then(pl.lit(None, pl.List(pl.Int64)))
        .otherwise(shape_txt.str.split(",").list.eval(pl.element().str.strip_chars().cast(pl.Int64, strict=False)))
        .alias("shape"),
        pl.when(missing)
        .then(pl.lit(None, pl.String))
        .otherwise(pl.col("dtype").str.replace(r"^torch\.", ""))
        .alias("dtype"),
        missing.alias("missing"),
    )
    df = df.with_columns(
        pl.int_range(pl.len()).over(["prefix", "rank", "step", "micro_step"]).cast(pl.Int32).alias("seq")
    )
    cols = [
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
    return df.select(cols).sort(["rank", "step", "prefix", "seq"], maintain_order=True)

"""Metrics for every aligned leaf pair, each labelled by how it was obtained, and a verdict with its threshold.

err is relative L2 error ||x - y|| / ||y|| of the target x against the reference y, obtained, best first:
  exact    from both full tensor files (`exact=True`; msprobe's tensor-mode cells come along),
  sketch   from the stored linear sketches (exact when numel <= M, else relative error bar sqrt(2/M)),
  stats    a lower bound from the statistics: max(|dNorm|, |dMean|*sqrt(n), |dMax|, |dMin|) / ||y||,
  checksum CRC-32 / XOR equality (err 0 or inf), value  (non-tensor arguments: relative difference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from dumpstore.dtypes import FLOAT_DTYPES
from dumpstore.summary import fold_sketch

from . import rules as R
from .align import align_leaves, align_records, apply_data_mapping
from .graph_modules import module_view
from .layer_mapping import layer_records, layer_rules
from .load import load_run
from .mapping import Mapping
from .pairmetrics import pair_metrics
from .select import check_selection
from .tolerance import Tolerances


@dataclass
class Comparison:
    """The aligned rows of a target/reference pair with metrics and verdicts."""

    rows: pl.DataFrame  # one row per aligned (or unmatched) leaf
    records: pl.DataFrame  # record pairs (step, rank, source, t_record, r_record, how)
    precision: dict[str, str]  # compute precision of each run ('target', 'ref') and the floor used
    tolerances: Tolerances
    target: str
    ref: str
    coverage: dict[str, list[int]]  # steps and ranks of each run; only the common ones are compared


def compare_runs(
    store,
    target: str,
    ref: str,
    *,
    steps: list[int] | None = None,
    ranks: list[int] | None = None,
    tolerances: Tolerances | None = None,
    exact: bool = False,
    mapping: Mapping | None = None,
    units: list[tuple[int, int]] | None = None,
    precision: dict[str, str] | None = None,
    noise_ref: str | None = None,
) -> Comparison:
    """Align `target` with `ref` and compute per-leaf metrics and verdicts.

    `mapping` renames target records into the reference's namespace; a MindSpore target against a PyTorch
    reference gets the built-in MindSpore -> PyTorch names in any case.  `units` limits the comparison to some
    (step, rank) pairs besides `steps` and `ranks`; `precision` (the runs' compute precision, as in
    `Comparison.precision`) replaces the one found in the rows loaded, for a part of a larger comparison.
    `noise_ref`: a second reference run (a rerun, another device); its error against `ref` is an empirical
    noise band per tensor that widens each tolerance (`apply_noise_ref`).
    """
    tol = tolerances or Tolerances()
    check_selection(store, [target, ref], steps=steps, ranks=ranks)
    t_info, r_info = store.run_info(target), store.run_info(ref)
    cov = coverage(t_info, r_info)
    mapping = mapping or Mapping()
    if builtin_mindspore_names(t_info, r_info):
        mapping.mindspore_to_pytorch = True
    steps = [s for s in cov["common_steps"] if steps is None or s in steps]
    ranks = [k for k in cov["common_ranks"] if ranks is None or k in ranks]
    t, r = _load_both(store, (target, ref), steps=steps, ranks=ranks, units=units)
    t, r = module_view(t, r, t_info, r_info)  # a graph-mode run against module records: module outputs only
    t, r = _common_summaries(t, r, t_info, r_info)
    renamed = {k: mapping.record(k) for k in t["record"].unique().to_list()} if mapping and not mapping.layer else {}
    if renamed:
        t = t.with_columns(
            pl.col("record").replace_strict(renamed).alias("record"), pl.col("record").alias("_orig_record")
        )
    if mapping.layer:  # msprobe -lm: the layer tree decides the record pairs
        frameworks = (
            "mindspore" if "mindspore" in t_info["framework"] else "pytorch",
            "mindspore" if "mindspore" in r_info["framework"] else "pytorch",
        )
        records = layer_records(store, (target, ref), (t, r), frameworks, layer_rules(mapping.layer))
    precision = dict(precision) if precision else _precision(t, r)
    if not mapping.layer:
        records = align_records(t, r, tol, precision["floor"])
    pairs = apply_data_mapping(align_leaves(t, r, records), mapping.data)
    if renamed:
        back = {v: k for k, v in renamed.items()}
        pairs = pairs.with_columns(pl.col("_orig_record").alias("record")).drop("_orig_record")
        records = records.with_columns(pl.col("t_record").replace(back))
    rows = pair_metrics(pairs, tol, precision["floor"])
    if exact:
        from .exact import add_exact_metrics

        rows = add_exact_metrics(store, target, ref, rows, tol, precision["floor"])
    from .prior import judge_classes

    rows = judge_classes(rows, precision, tol)
    rows = R.apply_small_values(rows)
    if noise_ref is not None:
        check_selection(store, [noise_ref])
        band = compare_runs(store, noise_ref, ref, steps=steps, ranks=ranks, tolerances=tol, exact=exact, units=units)
        rows = apply_noise_ref(rows, band.rows)
        precision["noise_ref"] = noise_ref
    return Comparison(rows, records, precision, tol, target, ref, cov)


def _load_both(store, runs: tuple[str, str], **selection: Any) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Both runs' rows, the reference's read in a second thread (Polars reads without the GIL: a third less)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(load_run, store, runs[1], **selection)
        first = load_run(store, runs[0], **selection)
        return first, other.result()


def builtin_mindspore_names(t_info: dict, r_info: dict) -> bool:
    """A MindSpore target against a PyTorch reference: target names go through the built-in mapping."""
    return "mindspore" in t_info["framework"] and "pytorch" in r_info["framework"]


def _common_summaries(
    t: pl.DataFrame, r: pl.DataFrame, t_info: dict, r_info: dict
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Runs ingested with different sketch sizes compare on the smaller one (sketches fold exactly); samples
    of different sizes sit at different positions and are dropped."""
    tm, rm = t_info.get("sketch_m"), r_info.get("sketch_m")
    if tm and rm and tm != rm:
        m = min(tm, rm)
        fold = pl.col("sketch").map_elements(
            lambda sk: fold_sketch(np.asarray(sk), m).tolist(), return_dtype=pl.List(pl.Float64)
        )
        t, r = (t.with_columns(fold), r) if tm > rm else (t, r.with_columns(fold))
    if t_info.get("sample_k") != r_info.get("sample_k"):
        none = pl.lit(None, pl.List(pl.Float64)).alias("sample")
        t, r = t.with_columns(none), r.with_columns(none)
    return t, r


def coverage(t: dict, r: dict) -> dict[str, list[int]]:
    """Steps and ranks present in each run; steps or ranks in one run only are reported, not compared."""
    ts, rs, tk, rk = set(t["steps"]), set(r["steps"]), set(t["ranks"]), set(r["ranks"])
    return {
        "target_steps": sorted(ts),
        "ref_steps": sorted(rs),
        "common_steps": sorted(ts & rs),
        "target_ranks": sorted(tk),
        "ref_ranks": sorted(rk),
        "common_ranks": sorted(tk & rk),
    }


def _compute_dtype(df: pl.DataFrame) -> str:
    """Lowest-precision float dtype holding >= 10% of the run's forward float outputs."""
    outs = df.select("io", "direction", "dtype").filter(  # the three columns only: the frame is wide
        (pl.col("io") == "output") & (pl.col("direction") == "forward") & pl.col("dtype").is_in(list(FLOAT_DTYPES))
    )
    return R.compute_dtype_from_counts(dict(outs.group_by("dtype").len().iter_rows()))


def _precision(t: pl.DataFrame, r: pl.DataFrame) -> dict[str, str]:
    a, b = _compute_dtype(t), _compute_dtype(r)
    return {"target": a, "ref": b, "floor": R.floor_of(a, b)}


NOISE_REF_K = 3.0  # a tensor's band: this many times its error in the noise reference pair (noise.STAND_OUT)


def apply_noise_ref(rows: pl.DataFrame, band_rows: pl.DataFrame) -> pl.DataFrame:
    """Widen each tensor's tolerance to NOISE_REF_K x the error of the same reference tensor in a second, known
    good pair (the noise reference against the same reference run): `tol = max(prior tolerance, K x e_noise)`,
    and judge status and severity again.  Where the second pair measured more noise than the prior allows, the
    measurement wins; it never makes a tolerance stricter than the prior (a bitwise rerun measures 0).
    `noise_band` says which band each row got (null: none measured)."""
    keys = ["step", "rank", "ref_name"]
    band = (
        band_rows.filter(pl.col("ref_name").is_not_null() & (pl.col("kind") == "tensor"))
        .group_by(keys)
        .agg(pl.col("err").max().alias("_noise_err"))
    )
    out = rows.join(band, on=keys, how="left", maintain_order="left")
    width = (NOISE_REF_K * pl.col("_noise_err")).fill_nan(None)
    wider = (pl.col("kind") == "tensor") & width.is_not_null() & width.is_finite() & (width > pl.col("tol"))
    out = out.with_columns(
        pl.when(width.is_finite()).then(width).alias("noise_band"),
        pl.when(wider).then(width).otherwise(pl.col("tol")).alias("tol"),
        wider.fill_null(False).alias("_wider"),
    )
    unmatched = pl.col("match").is_in(["target_only", "ref_only"])
    status = R.pair_status(unmatched, R.unreadable_kind(), R.has_error_text())
    sev = R.severity(out["err"].cast(pl.Float64).to_numpy(), out["tol"].cast(pl.Float64).to_numpy())
    return out.with_columns(
        pl.when(pl.col("_wider")).then(status).otherwise(pl.col("status")).alias("status"),
        pl.when(pl.col("_wider")).then(R.nullable("severity", sev)).otherwise(pl.col("severity")).alias("severity"),
    ).drop("_noise_err", "_wider")

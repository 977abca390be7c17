"""Metrics for every aligned leaf pair, each labelled by how it was obtained, and a verdict with its threshold.

err is relative L2 error ||x - y|| / ||y|| of the target x against the reference y, obtained, best first:
  exact    from both full tensor files (`exact=True`; msprobe's tensor-mode cells come along),
  sketch   from the stored linear sketches (exact when numel <= M, else relative error bar sqrt(2/M)),
  stats    a lower bound from the statistics: max(|dNorm|, |dMean|*sqrt(n), |dMax|, |dMin|) / ||y||,
  checksum CRC-32 / XOR equality (err 0 or inf), value  (non-tensor arguments: relative difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from dumpstore.dtypes import FLOAT_DTYPES, eps, is_float

from .align import align_leaves, align_records, apply_data_mapping
from .mapping import Mapping
from .load import load_run
from .tolerance import Tolerances

VALUE_RTOL = 1e-6


@dataclass
class Comparison:
    """The aligned rows of a target/reference pair with metrics and verdicts."""

    rows: pl.DataFrame          # one row per aligned (or unmatched) leaf
    records: pl.DataFrame       # record pairs (step, rank, source, t_record, r_record, how)
    precision: dict[str, str]   # compute precision of each run ('target', 'ref') and the floor used
    tolerances: Tolerances
    target: str
    ref: str
    coverage: dict[str, list[int]]  # steps and ranks of each run; only the common ones are compared


def compare_runs(store, target: str, ref: str, *, steps: list[int] | None = None, ranks: list[int] | None = None,
                 tolerances: Tolerances | None = None, exact: bool = False,
                 mapping: Mapping | None = None) -> Comparison:
    """Align `target` with `ref` and compute per-leaf metrics and verdicts.

    `mapping` renames target records into the reference's namespace; a MindSpore target against a PyTorch
    reference gets the built-in MindSpore -> PyTorch names in any case.
    """
    tol = tolerances or Tolerances()
    t_info, r_info = store.run_info(target), store.run_info(ref)
    coverage = _coverage(t_info, r_info)
    mapping = mapping or Mapping()
    if "mindspore" in t_info["framework"] and "pytorch" in r_info["framework"]:
        mapping.mindspore_to_pytorch = True
    steps = [s for s in coverage["common_steps"] if steps is None or s in steps]
    ranks = [k for k in coverage["common_ranks"] if ranks is None or k in ranks]
    t = load_run(store, target, steps=steps, ranks=ranks)
    r = load_run(store, ref, steps=steps, ranks=ranks)
    renamed = {k: mapping.record(k) for k in t["record"].unique().to_list()} if mapping else {}
    if renamed:
        t = t.with_columns(pl.col("record").replace_strict(renamed).alias("record"),
                           pl.col("record").alias("_orig_record"))
    records = align_records(t, r)
    pairs = apply_data_mapping(align_leaves(t, r, records), mapping.data)
    if renamed:
        back = {v: k for k, v in renamed.items()}
        pairs = pairs.with_columns(pl.col("_orig_record").alias("record")).drop("_orig_record")
        records = records.with_columns(pl.col("t_record").replace(back))
    precision = _precision(t, r)
    rows = _metrics(pairs, tol, precision["floor"])
    if exact:
        from .exact import add_exact_metrics
        rows = add_exact_metrics(store, target, ref, rows, tol, precision["floor"])
    return Comparison(rows, records, precision, tol, target, ref, coverage)


def _coverage(t: dict, r: dict) -> dict[str, list[int]]:
    """Steps and ranks present in each run; steps or ranks in one run only are reported, not compared."""
    ts, rs, tk, rk = set(t["steps"]), set(r["steps"]), set(t["ranks"]), set(r["ranks"])
    return {"target_steps": sorted(ts), "ref_steps": sorted(rs), "common_steps": sorted(ts & rs),
            "target_ranks": sorted(tk), "ref_ranks": sorted(rk), "common_ranks": sorted(tk & rk)}


def _compute_dtype(df: pl.DataFrame) -> str:
    """Lowest-precision float dtype holding >= 10% of the run's forward float outputs."""
    outs = df.filter((pl.col("io") == "output") & (pl.col("direction") == "forward")
                     & pl.col("dtype").is_in(list(FLOAT_DTYPES)))
    if outs.height == 0:
        return "float32"
    counts = outs.group_by("dtype").len()
    common = [d for d, n in counts.iter_rows() if n >= 0.1 * outs.height]
    return max(common, key=eps) if common else "float32"


def _precision(t: pl.DataFrame, r: pl.DataFrame) -> dict[str, str]:
    a, b = _compute_dtype(t), _compute_dtype(r)
    return {"target": a, "ref": b, "floor": a if eps(a) >= eps(b) else b}


def _metrics(pairs: pl.DataFrame, tol: Tolerances, floor: str) -> pl.DataFrame:
    recs = pairs.to_dicts()
    out = [_pair_metrics(p, tol, floor) for p in recs]
    cols = pl.DataFrame(out, schema=_METRIC_SCHEMA, orient="row")
    keep = [c for c in pairs.columns if c not in ("sketch", "ref_sketch", "sample", "ref_sample")]
    return pl.concat([pairs.select(keep), cols], how="horizontal")


_METRIC_SCHEMA = {
    "err": pl.Float64, "err_source": pl.String, "err_bound": pl.Float64, "cosine": pl.Float64,
    "max_abs_err": pl.Float64, "max_rel_err": pl.Float64, "norm_ratio": pl.Float64,
    "max_diff": pl.Float64, "min_diff": pl.Float64, "mean_diff": pl.Float64, "norm_diff": pl.Float64,
    "nonfinite_mismatch": pl.Boolean, "checksum_equal": pl.Boolean, "tol": pl.Float64, "tol_dtype": pl.String,
    "severity": pl.Float64, "status": pl.String, "detail": pl.String,
}


def _tol_dtype(p: dict, floor: str) -> str:
    cands = [d for d in (p.get("dtype"), p.get("ref_dtype")) if d]
    if any(is_float(d) for d in cands):
        cands = [d for d in cands if is_float(d)] + [floor]
        return max(cands, key=eps)
    return cands[0] if cands else floor


def _pair_metrics(p: dict, tol: Tolerances, floor: str) -> tuple:
    m = dict.fromkeys(_METRIC_SCHEMA)
    if p["match"] in ("target_only", "ref_only"):
        m.update(status="unmatched", detail=f"only in {'target' if p['match'] == 'target_only' else 'reference'}",
                 err_source="none")
        return tuple(m.values())
    kind, rkind = p["kind"], p["ref_kind"]
    tdt = _tol_dtype(p, floor)
    m.update(tol_dtype=tdt, tol=tol.for_dtype(tdt))
    if kind == "error" or rkind == "error" or p.get("error") or p.get("ref_error"):
        _leaf_error(p, m)
    elif kind != rkind:
        m.update(err=math.inf, err_source="value", detail=f"kind {kind} vs {rkind}")
    elif kind == "tensor":
        _tensor_pair(p, m)
    elif kind == "scalar":
        _scalar_pair(p, m)
    else:
        m.update(err=0.0, err_source="value")
    _verdict(m)
    return tuple(m.values())


def _leaf_error(p: dict, m: dict) -> None:
    why = p.get("error") or p.get("ref_error") or "unreadable leaf"
    m.update(status="error", detail=why, err_source="none")
    if p["kind"] == "tensor" and p["ref_kind"] == "tensor":
        _tensor_pair(p, m)  # the dumper's statistics still tell something
        m["status"] = None


def _scalar_pair(p: dict, m: dict) -> None:
    a, b = p.get("scalar_value"), p.get("ref_scalar_value")
    m["err_source"] = "value"
    if a is not None and b is not None:
        if a == b or (math.isnan(a) and math.isnan(b)):
            m["err"] = 0.0
        else:
            m["err"] = abs(a - b) / abs(b) if b else math.inf
            m["max_abs_err"] = abs(a - b)
        m["tol"] = VALUE_RTOL
    else:
        m.update(err=0.0 if p.get("value") == p.get("ref_value") else math.inf, tol=0.0)
    if m["err"]:
        m["detail"] = f"value {p.get('value')} vs {p.get('ref_value')}"


def _shape_differs(p: dict) -> bool:
    a, b = p.get("shape"), p.get("ref_shape")
    if a is None or b is None:
        return False
    return [d for d in a if d != 1] != [d for d in b if d != 1]


def _tensor_pair(p: dict, m: dict) -> None:
    if _shape_differs(p):
        m.update(err=math.inf, err_source="value", detail=f"shape {p['shape']} vs {p['ref_shape']}")
        return
    _nonfinite(p, m)
    _stat_diffs(p, m)
    sk, rsk = p.get("sketch"), p.get("ref_sketch")
    if sk is not None and rsk is not None and len(sk) == len(rsk) and len(sk) > 0 and not m["nonfinite_mismatch"]:
        _from_sketch(p, m, np.asarray(sk), np.asarray(rsk))
    elif p.get("norm") is not None and p.get("ref_norm") is not None:
        _from_stats(p, m)
    elif m["max_diff"] is not None and m["min_diff"] is not None:
        _from_extremes(p, m)
    if p.get("checksum") is not None and p.get("ref_checksum") is not None:
        m["checksum_equal"] = p["checksum"] == p["ref_checksum"]
        if m["err"] is None:
            m.update(err=0.0 if m["checksum_equal"] else math.inf, err_source="checksum")
    if m["nonfinite_mismatch"]:
        m.update(err=math.inf, detail=_nonfinite_detail(p))
        m["err_source"] = m["err_source"] or "stats"


_FLAGS = ("has_nan", "has_posinf", "has_neginf", "has_sat")


def _nonfinite(p: dict, m: dict) -> None:
    counts = ("nan_count", "posinf_count", "neginf_count", "sat_count")
    if all(p.get(c) is not None and p.get(f"ref_{c}") is not None for c in counts):
        m["nonfinite_mismatch"] = any(p[c] != p[f"ref_{c}"] for c in counts)
    else:
        m["nonfinite_mismatch"] = any(bool(p.get(f)) != bool(p.get(f"ref_{f}")) for f in _FLAGS
                                      if p.get(f) is not None and p.get(f"ref_{f}") is not None)


def _nonfinite_detail(p: dict) -> str:
    parts = []
    for f, label in zip(_FLAGS, ("NaN", "+Inf", "-Inf", "±max")):
        a, b = p.get(f.replace("has_", "") + "_count"), p.get("ref_" + f.replace("has_", "") + "_count")
        if a is None or b is None:
            a, b = p.get(f), p.get(f"ref_{f}")
        if a != b:
            parts.append(f"{label} {a} vs {b}")
    return "non-finite values differ: " + ", ".join(parts)


def _stat_diffs(p: dict, m: dict) -> None:
    for s in ("max", "min", "mean", "norm"):
        a, b = p.get(s), p.get(f"ref_{s}")
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            m[f"{s}_diff"] = a - b
    if p.get("norm") is not None and p.get("ref_norm"):
        m["norm_ratio"] = p["norm"] / p["ref_norm"]


def _from_stats(p: dict, m: dict) -> None:
    """Lower bound of relative L2 from whichever statistics differences are finite."""
    rn = p["ref_norm"]
    if not math.isfinite(rn):
        stats = [(p.get(k), p.get(f"ref_{k}")) for k in ("max", "min", "mean", "norm")]
        if all(a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b)) for a, b in stats):
            m.update(err=0.0, err_source="stats")  # same non-finite statistics on both sides (e.g. -inf masks)
        return
    n = p.get("numel") or p.get("ref_numel") or 1
    cands = [abs(m[k]) for k in ("norm_diff", "max_diff", "min_diff") if m[k] is not None]
    if m["mean_diff"] is not None:
        cands.append(abs(m["mean_diff"]) * math.sqrt(n))
    if not math.isfinite(p["norm"]) and not m["nonfinite_mismatch"]:
        cands.append(math.inf)  # the dumper's norm overflowed: values far beyond the reference
    if not cands:
        return
    num = max(cands)
    m.update(err=num / rn if rn > 0 else (0.0 if num == 0 else math.inf), err_source="stats",
             max_abs_err=max(abs(m["max_diff"] or 0.0), abs(m["min_diff"] or 0.0)))


def _from_extremes(p: dict, m: dict) -> None:
    """No norms (integer tensors in msprobe 26.x): difference of max and min, relative to the reference's range."""
    num = max(abs(m["max_diff"]), abs(m["min_diff"]))
    scale = max(abs(p["ref_max"]), abs(p["ref_min"]))
    m.update(err=num / scale if scale > 0 else (0.0 if num == 0 else math.inf), err_source="stats",
             max_abs_err=num)


def _from_sketch(p: dict, m: dict, sk: np.ndarray, rsk: np.ndarray) -> None:
    rn, tn = p.get("ref_norm"), p.get("norm")
    if rn is None or tn is None or not (math.isfinite(rn) and math.isfinite(tn)):
        return
    diff = float(np.linalg.norm(sk - rsk))
    n = p.get("numel") or len(sk)
    bound = 0.0 if len(sk) >= n else math.sqrt(2.0 / len(sk))
    err = diff / rn if rn > 0 else (0.0 if diff == 0 and tn == 0 else math.inf)
    m.update(err=err, err_source="sketch", err_bound=bound)
    if rn > 0 and tn > 0:
        r = tn / rn
        m["cosine"] = max(-1.0, min(1.0, (1 + r * r - err * err) / (2 * r)))
    elif rn == 0 and tn == 0:
        m["cosine"] = 1.0
    s, rs = p.get("sample"), p.get("ref_sample")
    if s is not None and rs is not None and len(s) == len(rs) and len(s):
        d = np.abs(np.asarray(s) - np.asarray(rs))
        m["max_abs_err"] = float(np.nanmax(d)) if np.isfinite(d).any() else None


def _verdict(m: dict) -> None:
    if m["status"] in ("unmatched", "error"):
        return
    err, tol = m["err"], m["tol"]
    if err is None:
        m.update(status="unknown", severity=None)
        return
    m["severity"] = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)
    m["status"] = "diverged" if (err > tol or m["nonfinite_mismatch"]) else "pass"

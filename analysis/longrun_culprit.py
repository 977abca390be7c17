"""The long-run culprit: with msprobe monitor data of both runs, the first module or parameter whose statistic
leaves its band (before the loss does), in execution order; and the hand-off, the steps and scope worth dumping
as a ready msprobe config.json.

Method: the two runs' monitor rows are joined on (rank, prefix, name, step, micro step, vpp stage). A row is
out when |target - ref| of its norm, max or min exceeds max(atol, rtol |ref|, band): atol 2e-6 (TrainerMon rounds
to 6 decimals), rtol 1e-6, and the band
  with --ref2   3 x the largest |ref2 - ref| of that series within +-`persist` steps (the rerun's own spread)
  without       a series whose runs agree over its first `baseline` steps (5 % of the monitored steps, at least
                3; within atol/rtol) has a zero band there, and after them 3 x the largest |target - ref| of
                the TRAIL (20) steps before: any change after an identical start is a departure. A series that
                already differs over its first steps is set aside (counted, not judged): runs that differ from
                the start (another data order, non-deterministic kernels, another chip) drift apart chaotically,
                and every accumulating series (weights, Adam's m and v) leaves any band set on its start; a
                rerun of the reference (--ref2) gives such pairs their band
A series leaves its band at the first step that is out and after which at least 90 % of the next `persist`
(10) monitored steps are out of the band that step had (a departure needs those 10 steps, or all the series has
when shorter: a series out only at a run's last steps has not left). The culprit is the series leaving first;
at one step the earliest in execution order: param_origin (the step's weights), actv (forward, module order),
actv_grad, grad_unreduced (hook order), grad_reduced, exp_avg, exp_avg_sq, param_updated. The loss's step
(from `curves`) is mapped to monitor steps by `monitor_offset` (TrainerMon's step 0 is Megatron's iteration 1).
The steps worth dumping are the culprit's step and the one before (the last that agreed), in msprobe's step
numbering (PrecisionDebugger counts from 0 like TrainerMon), scoped to the culprit's module.
"""

from __future__ import annotations

import math
from typing import Any

from dumpstore.longrun.monitor import PREFIX_ORDER
from dumpstore.longrun.store import monitor_chunks, read, read_parts, run_row
from dumpstore.store import Store

from .curves import CurvesError, CurvesReport, Divergence, compare_curves
from .longrun_anomalies import msprobe_flagged

STATS = ("norm", "max", "min")
ATOL, RTOL = 2e-6, 1e-6
BAND_K = 3.0
PERSIST = 10
TRAIL = 20  # steps before a later step whose largest difference sets its band (no rerun)
STAY = 0.9
_KEYS = ["rank", "prefix", "name", "step", "micro", "vpp"]
# the monitor columns the culprit reads (the rest of a run's tens of millions of rows stays on disk)
_COLUMNS = ["rank", "step", "micro_step", "vpp_stage", "prefix", "name", "module", "param", "seq", *STATS]
_TEXT = ["prefix", "name", "module", "param"]


def compare_long_runs(
    store: Store,
    target: str,
    ref: str,
    ref2: str | None = None,
    *,
    tag: str = "loss",
    by: str = "iteration",
    rank: int | None = None,
    monitor_offset: int = 1,
) -> CurvesReport:
    """`curves` of two long runs, with the monitor culprit when both have monitor data."""
    st, sr = read(store, "scalars", target, dictionary=["tag"]), read(store, "scalars", ref, dictionary=["tag"])
    s2 = read(store, "scalars", ref2, dictionary=["tag"]) if ref2 is not None else None
    if st.num_rows and sr.num_rows:
        rep = compare_curves(
            st, sr, s2 if s2 is not None and s2.num_rows else None, names=(target, ref, ref2), tag=tag, by=by, rank=rank
        )
    else:
        rep = None
    n_mon = {r: run_row(store, r)["n_monitor"] or 0 for r in (target, ref, ref2) if r is not None}
    if n_mon[target] and n_mon[ref]:
        loss_step = None
        if rep is not None and rep.divergence.step is not None and by == "iteration":
            loss_step = rep.divergence.step - monitor_offset
        culprit = _stored_culprit(store, target, ref, ref2 if ref2 is not None and n_mon[ref2] else None, loss_step)
    else:
        culprit = None
    if rep is None:
        if culprit is None:
            raise CurvesError(
                f"runs {target} and {ref} need scalars (a log or event file) or monitor data in both; ingest them "
                "with dumpstore longrun-ingest"
            )
        rep = monitor_only(target, ref, ref2, tag, by)
    rep.culprit = culprit
    first = (culprit or {}).get("first")
    focus = (first["prefix"], first["name"]) if first else None
    rep.msprobe_flagged = [f for f in (msprobe_flagged(store, r, focus) for r in (target, ref)) if f is not None]
    return rep


def _stored_culprit(store: Store, target: str, ref: str, ref2: str | None, loss_step: int | None) -> dict[str, Any]:
    """monitor_culprit of stored runs, read a chunk of series at a time (a rank and prefix: store.monitor_chunks)
    with the names dictionary-encoded (Polars categoricals), so memory follows a chunk, not the two runs."""
    import polars as pl

    runs = [target, ref] + ([ref2] if ref2 is not None else [])
    parts = []
    steps: dict[str, list[int]] = {}
    for _, chunk in monitor_chunks(store, runs):
        ft, fr = _load(chunk[target], described=True), _load(chunk[ref])
        f2 = _load(chunk[ref2]) if ref2 is not None else None
        _extent(steps, ft, fr)
        if not ft.height or not fr.height:
            continue
        # a chunk of millions of rows joined a few hundred thousand target rows at a time, split by name (a
        # series is one name: it never crosses a split)
        names = ft.get_column("name").unique(maintain_order=True).to_list()
        k = max(1, min(len(names), -(-ft.height // _SPLIT_ROWS)))
        for i in range(k):
            group = names[i * len(names) // k : (i + 1) * len(names) // k]
            if k == 1:
                parts.append(_left_band(ft, fr, f2, PERSIST))
                continue
            of = [None if f is None else f.filter(pl.col("name").is_in(group)) for f in (ft, fr, f2)]
            parts.append(_left_band(of[0], of[1], of[2], PERSIST))
        del ft, fr, f2
    return _result(parts, ref2 is not None, loss_step, steps)


def _extent(steps: dict[str, list[int]], ft, fr) -> None:
    """Widen `steps` ({"target": [first, last], "ref": ...}) by the monitor steps of a chunk of each run."""
    for side, f in (("target", ft), ("ref", fr)):
        if f.height:
            lo, hi = int(f.get_column("step").min()), int(f.get_column("step").max())
            old = steps.get(side)
            steps[side] = [min(old[0], lo), max(old[1], hi)] if old else [lo, hi]


_SPLIT_ROWS = 125_000  # target rows joined at once: the join and its 30 window columns held for them, not for a chunk


def _load(files, *, described: bool = False):
    """The culprit's monitor columns of some part files as a Polars frame, the names as categoricals, the integer
    keys as int32 (steps, ranks, micro steps and stages are small: half the bytes of a chunk's keys);
    `described`: with the module, param and seq the culprit's description reads (the target's rows only)."""
    import polars as pl
    import pyarrow as pa
    import pyarrow.compute as pc

    cols = _COLUMNS if described else [c for c in _COLUMNS if c not in _DESCRIBED]
    table = read_parts(files, "monitor", columns=cols, dictionary=[c for c in _TEXT if c in cols])
    for name in _SMALL_INTS:  # one column at a time: the int64 one is freed as its int32 copy replaces it
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, pc.cast(table.column(i), pa.int32()))
    pa.default_memory_pool().release_unused()
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    return df


_DESCRIBED = ("module", "param", "seq")
_SMALL_INTS = ("rank", "step", "micro_step", "vpp_stage")


def dump_verdict(store: Store, target: str, ref: str) -> dict[str, Any]:
    """The divergence verdict of a dump pair in the same store (the dump the hand-off asked for): its first
    divergence and culprit, as `dumpstore divergence` finds them."""
    from dataclasses import asdict

    from .verdict import Question, answer

    v = answer(store, Question(target, ref))
    return {
        "target": target,
        "ref": ref,
        "first_divergence": asdict(v.first_divergence) if v.first_divergence is not None else None,
        "culprit": asdict(v.culprit) if v.culprit is not None else None,
    }


def monitor_only(target: str, ref: str, ref2: str | None, tag: str, by: str) -> CurvesReport:
    """The report of two runs with monitor data but no curves (no log ingested)."""
    return CurvesReport(
        target,
        ref,
        ref2,
        tag,
        by,
        0,
        0,
        0,
        "no curves: ingest the runs' logs or event files to compare them",
        0,
        [],
        Divergence(None, None, None, None, None, None),
        [],
        [],
        None,
        math.nan,
        math.nan,
    )


def _frame(table, suffix: str):
    import polars as pl

    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    return df.select(
        pl.col("rank"),
        pl.col("prefix"),
        pl.col("name"),
        pl.col("step"),
        pl.col("micro_step").fill_null(-1).alias("micro"),
        pl.col("vpp_stage").fill_null(-1).alias("vpp"),
        *(pl.col(s).alias(f"{s}{suffix}") for s in STATS),
        *([pl.col("module"), pl.col("param"), pl.col("seq")] if suffix == "_t" else []),
    )


def monitor_culprit(mt, mr, m2=None, *, loss_step: int | None = None, persist: int = PERSIST) -> dict[str, Any]:
    import polars as pl

    steps: dict[str, list[int]] = {}
    _extent(steps, *(f if isinstance(f, pl.DataFrame) else pl.from_arrow(f) for f in (mt, mr)))
    return _result([_left_band(mt, mr, m2, persist)], m2 is not None, loss_step, steps)


def _left_band(mt, mr, m2, persist: int):
    """(each series' first row out of its band for good, with the row's statistics, module, param and seq; the
    number of series compared; the ranks compared; without a rerun, the number of series set aside because they
    differ over their first steps) of the monitor rows of the runs (m2: the rerun or None)."""
    import polars as pl

    df = _frame(mt, "_t").join(_frame(mr, "_r"), on=_KEYS, how="inner")
    if m2 is not None:
        df = df.join(_frame(m2, "_2"), on=_KEYS, how="left")
    series = ["rank", "prefix", "name", "micro", "vpp"]
    df = df.sort([*series, "step"])
    # one integer id per series (the rows are sorted by series): the windows below group by it, not by 5 keys
    key = pl.struct(series)
    df = df.with_columns(key.ne_missing(key.shift()).cum_sum().alias("_sid"))
    sid = pl.col("_sid")
    if m2 is None:
        df = df.with_columns(
            pl.int_range(pl.len()).over("_sid").alias("_idx"),
            pl.max_horizontal(pl.lit(3), (pl.len().over("_sid") * 0.05).cast(pl.Int64)).alias("_cut"),
        )
    bands, early = [], []  # early (without a rerun): a series' first steps where the runs already differ
    for s in STATS:
        t, r = pl.col(f"{s}_t"), pl.col(f"{s}_r")
        diff = (t - r).abs()
        if m2 is not None:
            noise = (pl.col(f"{s}_2") - r).abs().fill_nan(None).fill_null(0.0)
            band = noise.rolling_max(2 * persist + 1, min_samples=1, center=True).over("_sid") * BAND_K
        else:
            # the first `cut` steps against their own largest difference; a later step against the largest
            # difference of the TRAIL steps before it
            first = pl.col("_idx") < pl.col("_cut")
            d0 = diff.fill_nan(None)
            base = pl.when(first).then(d0).otherwise(None).max().over("_sid")
            trail = d0.shift(1).rolling_max(TRAIL, min_samples=1).over("_sid")
            band = pl.when(first).then(base).otherwise(trail).fill_null(0.0) * BAND_K
            floor = pl.max_horizontal(pl.lit(ATOL), r.abs() * RTOL)
            early.append((first & ((d0 > floor) | (t.is_nan() != r.is_nan()))).fill_null(False))
        bands.append(band.alias(f"_b_{s}"))
    df = df.with_columns(bands)
    # a step is a departure when it and >= STAY of the next `persist` - 1 steps of its series are out of the band
    # it had (the rows are sorted by series and step: row k + j is the series' j-th step after k when its id is k's)
    cols = []
    for j in range(persist):
        per = []
        for s in STATS:
            tj, rj = pl.col(f"{s}_t").shift(-j), pl.col(f"{s}_r").shift(-j)
            limit = pl.max_horizontal(pl.lit(ATOL), rj.abs() * RTOL, pl.col(f"_b_{s}"))
            # NaN on one side only is out; NaN on both (a tensor missing in both runs) is not
            out = (
                pl.when(tj.is_nan() & rj.is_nan())
                .then(False)
                .when(tj.is_nan() | rj.is_nan())
                .then(True)
                .otherwise((tj - rj).abs() > limit)
            )
            per.append(out.fill_null(False))
        same = (sid.shift(-j) == sid).fill_null(False)
        cols.append(pl.when(same).then(pl.any_horizontal(per)).otherwise(None).alias(f"_o{j}"))
    df = df.with_columns(cols)
    # the share of out among this and the next `persist - 1` monitored steps of the series; a series needs
    # `persist` steps after a departure (or all it has, when shorter) for it to count
    there = [pl.col(f"_o{j}").is_not_null().cast(pl.Int32) for j in range(persist)]
    hits = [pl.col(f"_o{j}").fill_null(False).cast(pl.Int32) for j in range(persist)]
    df = df.with_columns(
        pl.col("_o0").fill_null(False).alias("out"),
        pl.sum_horizontal(hits).alias("_hits"),
        pl.sum_horizontal(there).alias("_there"),
        pl.min_horizontal(pl.lit(persist), pl.len().over("_sid")).alias("_need"),
    )
    df = df.with_columns((pl.col("_hits") / pl.col("_there")).alias("ahead"))
    judged = pl.lit(True)
    if early:
        # a series that differs over its first steps has no band to leave without a rerun: two runs that differ
        # from the start (another data order, non-deterministic kernels, another chip) drift apart step by step,
        # chaotically, and every accumulating series (weights, Adam's m and v) leaves any band set on its start
        df = df.with_columns(pl.any_horizontal(early).any().over("_sid").alias("_early"))
        judged = ~pl.col("_early")
    left = df.filter(pl.col("out") & (pl.col("ahead") >= STAY) & (pl.col("_there") >= pl.col("_need")) & judged)
    left = left.drop([c for c in left.columns if c.startswith("_")])  # the working columns above
    first = left.group_by(series, maintain_order=True).agg(pl.all().sort_by("step").first())
    n_series = df.get_column("_sid").max() or 0
    n_early = int(df.filter(pl.col("_early")).get_column("_sid").n_unique()) if early else 0
    ranks = set(df.get_column("rank").unique().to_list())
    return first, int(n_series), ranks, n_early


def _result(
    parts: list[tuple], rerun: bool, loss_step: int | None, steps: dict[str, list[int]] | None = None
) -> dict[str, Any]:
    """The culprit of the series of every chunk (_left_band's answers); `steps`: each run's first and last
    monitor step, for the note on steps one run lacks."""
    import polars as pl

    firsts = [f for f, _, _, _ in parts if f.height]
    first = pl.concat(firsts, how="vertical_relaxed") if len(firsts) > 1 else firsts[0] if firsts else None
    n_series = sum(n for _, n, _, _ in parts)
    n_early = sum(e for _, _, _, e in parts)
    ranks = set().union(*(r for _, _, r, _ in parts)) if parts else set()
    band_text = (
        "3 x the rerun's |ref2 - ref|"
        if rerun
        else f"series equal over their first steps; 3 x their own |target - ref| of the {TRAIL} steps before"
    )
    result: dict[str, Any] = {
        "n_series": int(n_series),
        "n_differ_from_start": int(n_early),
        "band": band_text,
        "loss_step": loss_step,
        "first": None,
        "next": [],
        "steps": steps or None,
        "steps_note": _steps_note(steps or {}),
    }
    if first is None or first.height == 0:
        return result
    order = (
        pl.col("prefix").cast(pl.String).replace_strict(PREFIX_ORDER, default=len(PREFIX_ORDER), return_dtype=pl.Int64)
    )
    # in execution order; a tie (one name at several micro steps or stages) in the series' order
    first = first.with_columns(order.alias("exec"))
    rows = first.sort(["step", "rank", "exec", "seq", "micro", "vpp"], maintain_order=True).to_dicts()
    top = _describe(rows[0])
    result["first"] = top
    seen = {top["name"]}
    for row in rows[1:]:
        if row["name"] not in seen and len(result["next"]) < 10:
            seen.add(row["name"])
            result["next"].append(_describe(row))
    result["handoff"] = handoff(top, distributed=len(ranks) > 1)
    return result


def _steps_note(steps: dict[str, list[int]]) -> str | None:
    """What monitor steps one run has and the other lacks, in words; None when both have the same."""
    t, r = steps.get("target"), steps.get("ref")
    if t is None or r is None:
        return None
    parts = []
    if t[1] != r[1]:
        a, b = ("the target's", "the reference's") if t[1] < r[1] else ("the reference's", "the target's")
        parts.append(f"{a} monitor data stops at step {min(t[1], r[1])}, {b} goes on to {max(t[1], r[1])}")
    if t[0] != r[0]:
        a, b = ("the target's", "the reference's") if t[0] > r[0] else ("the reference's", "the target's")
        parts.append(f"{a} monitor data starts at step {max(t[0], r[0])}, {b} at {min(t[0], r[0])}")
    return "; ".join(parts) or None


def _describe(row: dict[str, Any]) -> dict[str, Any]:
    stat = next(
        (s for s in STATS if _out_value(row[f"{s}_t"], row[f"{s}_r"])),
        STATS[0],
    )
    t, r = row[f"{stat}_t"], row[f"{stat}_r"]
    rel = abs(t - r) / abs(r) if r not in (0, None) and t is not None and math.isfinite(r) else math.inf
    return {
        "rank": row["rank"],
        "prefix": row["prefix"],
        "name": row["name"],
        "module": row["module"],
        "param": row["param"],
        "step": row["step"],
        "stat": stat,
        "target": t,
        "ref": r,
        "rel_diff": rel,
    }


def _out_value(t: float | None, r: float | None) -> bool:
    if t is None or r is None:
        return False
    if math.isnan(t) or math.isnan(r):
        return math.isnan(t) != math.isnan(r)
    return abs(t - r) > max(ATOL, RTOL * abs(r))


def handoff(first: dict[str, Any], *, distributed: bool = True) -> dict[str, Any]:
    """The steps and scope worth dumping, as an msprobe config.json. `rank` names the culprit's rank in a
    distributed job; a single-process job gets `[]` (msprobe dumps nothing for `rank: [0]` when
    torch.distributed is not initialised)."""
    step = int(first["step"])
    steps = sorted({max(0, step - 1), step})
    module = first["module"] or first["name"]
    entry = f"{module}." if module else first["name"]
    config = {
        "task": "tensor",
        "dump_path": f"./dump_longrun_step{step}",
        "rank": [int(first["rank"])] if distributed else [],
        "step": steps,
        "level": "mix",
        "tensor": {"scope": [], "list": [entry], "data_mode": ["all"], "file_format": "npy"},
    }
    return {"steps": steps, "module": module, "config": config}

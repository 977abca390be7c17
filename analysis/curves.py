"""Two training curves compared: alignment, noise band, Huawei's pass criteria, the step the difference leaves
the band, spikes, NaN/skipped iterations, loss-scale drops and a learning-rate schedule mismatch.

The method (docs/longrun.md has the walkthrough):

  align      by iteration (the steps both runs logged) or by consumed samples (the reference interpolated onto
             the target's sample counts: batch-size ramp-up and skipped iterations move iterations apart)
  noise      sigma(x), the noise of the difference d = target - ref at each point. With --ref2 (a rerun of the
             reference): from d2 = ref2 - ref, 1.4826 MAD per block of `block` points. Without: from the difference's
             own high-frequency residual, 1.4826 MAD(first differences of d) / sqrt(2) per block, held at its
             smallest so far (a divergence makes d noisier; the band must not widen with it). Two runs with
             independent noise (another data order, non-deterministic kernels) get the sum of both curves' noise;
             two runs fed the same data get the small noise their difference really has (zero for bitwise
             reruns: any change is then a divergence). Floor: 1e-6 of the reference (printed digits)
  leave      s(x), d averaged over a centred window of w points (w = n/200, at least 5), is out when
             |s| > k sigma / sqrt(w) (k = 4); the divergence onset is the first point that is out and after which
             at least 90 % of the points stay out. It is then refined with change-point detection (ruptures'
             KernelCPD, linear kernel = a change in the mean, on block means of d): the first change point within
             w points of the onset is reported as the step the difference starts to move
  offset     after the onset: an offset when the mean of d is non-zero at 3 standard errors (from means of
             blocks of w points), else noise around zero (only the spread grew)
  criteria   Huawei's long-run criteria (MindSpore Transformers accuracy guide): first-step loss abs error < 0.005
             or rel < 0.5 %; mean abs error < 0.01 or mean rel error < 1 %; grad-norm mean rel error <= 10 %;
             the difference stays inside the noise band
  spikes     per run: Megatron's spiky-loss factor (a loss above 10 x the median of the previous block of 100
             steps) and an EMA z-score (z > 6 against an exponential mean and variance of span 100), either only
             where the jump (the value less the rule's baseline) is at least 0.1 x the loss's level over the run
             so far (the largest median of 10 consecutive steps before it): a jump judged on the loss's own
             scale, not on a near-zero median; consecutive steps are one spike
  events     NaN/Inf losses, skipped and NaN iterations (Megatron's counters, MindFormers' overflow flag),
             loss-scale drops
  coverage   each run's first and last point of the tag and the points compared: where one run's points stop
             before the other's (a crashed or shorter run; skipped iterations print no loss) or start after
             them, the report says so ("target stops at iteration N, the reference goes on to M"), and the
             divergence and band verdicts name the steps they cover: no all-clear about steps one run lacks
  lr         the first step where the two runs' learning rates differ by more than 1e-4 relative (logs print 6
             to 7 digits), with the ratio there and after: a schedule mismatch is its own finding, whatever the
             loss does
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from dumpstore.errors import DumpstoreError

from .curves_coverage import Coverage, coverage
from .curves_kernels import _by_tag, kernel_cpd_l2
from .curves_spikes import EMA_SPAN, EMA_Z, SPIKE_FACTOR, SPIKE_WINDOW, Spike, find_spikes

__all__ = ["EMA_SPAN", "EMA_Z", "SPIKE_FACTOR", "SPIKE_WINDOW", "Spike", "find_spikes"]

FIRST_STEP_ABS, FIRST_STEP_REL = 0.005, 0.005
MEAN_ABS, MEAN_REL = 0.01, 0.01
GRAD_NORM_MEAN_REL = 0.10
BAND_K = 4.0
STAY_OUT = 0.9
LR_REL = 1e-4
PRINT_REL = 1e-6  # the noise floor: logs print 7 significant digits


class CurvesError(DumpstoreError):
    """Curves that cannot be compared (no common steps, a missing tag, no consumed samples)."""


@dataclass
class Series:
    x: np.ndarray  # steps (int64)
    v: np.ndarray  # values (float64)
    samples: np.ndarray | None = None  # consumed samples per step (float64, NaN where unknown)


def series(scalars: pa.Table, tag: str, rank: int | None = None) -> Series | None:
    """One tag's points of one rank (default: the lowest rank that logged the tag), sorted by step."""
    t = _by_tag(scalars).get(tag)
    if t is None or len(t["step"]) == 0:
        return None
    r = int(t["rank"].min()) if rank is None else rank
    keep = t["rank"] == r
    if not keep.any():
        return None
    step = t["step"][keep]
    order = np.argsort(step, kind="stable")
    samples = t["consumed_samples"][keep][order]
    return Series(
        step[order],
        t["value"][keep][order],
        None if np.all(np.isnan(samples)) else samples,
    )


def align(target: Series, ref: Series, by: str, names: tuple[str, str] = ("target", "ref")) -> tuple:
    """(x, target values, ref values) on the common axis: iterations both logged, or the target's consumed samples
    within the reference's range (the reference linearly interpolated)."""
    if by == "iteration":
        x, it, ir = np.intersect1d(target.x, ref.x, assume_unique=True, return_indices=True)
        if len(x) == 0:
            raise CurvesError(
                f"runs {names[0]} and {names[1]} share no step (steps {_span(target.x)} and {_span(ref.x)}); "
                "align by consumed samples (--by samples) or check the runs"
            )
        return x, target.v[it], ref.v[ir]
    for s, name in ((target, names[0]), (ref, names[1])):
        if s.samples is None:
            raise CurvesError(f"run {name} logged no consumed samples; align by iteration (--by iteration)")
    assert target.samples is not None and ref.samples is not None
    ok_r = np.isfinite(ref.samples) & np.isfinite(ref.v)
    rs, rv = ref.samples[ok_r], ref.v[ok_r]
    order = np.argsort(rs, kind="stable")
    rs, rv = rs[order], rv[order]
    keep = np.isfinite(target.samples) & (target.samples >= rs[0]) & (target.samples <= rs[-1])
    if not keep.any():
        raise CurvesError(f"runs {names[0]} and {names[1]} share no range of consumed samples")
    x = target.samples[keep]
    return x.astype(np.int64), target.v[keep], np.interp(x, rs, rv)


def _span(x: np.ndarray) -> str:
    return f"{int(x[0])}..{int(x[-1])}" if len(x) else "-"


def block_sigma(v: np.ndarray, block: int) -> np.ndarray:
    """Per point: 1.4826 MAD of the first differences / sqrt(2) in its block of `block` points (the curve's
    step-to-step noise, robust to spikes and to the trend)."""
    n = len(v)
    dv = np.diff(v, prepend=v[0] if n else 0.0)
    dv = np.where(np.isfinite(dv), dv, np.nan)
    nb = max(1, math.ceil(n / block))
    out = np.empty(n)
    for b in range(nb):
        seg = dv[b * block : (b + 1) * block]
        seg = seg[np.isfinite(seg)]
        if b == 0:
            seg = seg[1:]
        med = np.median(seg) if len(seg) else 0.0
        out[b * block : (b + 1) * block] = 1.4826 * np.median(np.abs(seg - med)) / math.sqrt(2) if len(seg) else 0
    return out


def held_sigma(d: np.ndarray, block: int) -> np.ndarray:
    """block_sigma of the difference, never widening from one block to the next: a divergence makes the
    difference noisier, and the band must not follow it."""
    sig = block_sigma(d, block)
    starts = sig[::block]
    held = np.minimum.accumulate(starts)
    return np.repeat(held, block)[: len(d)]


def rolling_sigma(d: np.ndarray, block: int) -> np.ndarray:
    """Per point: 1.4826 MAD of `d` itself in its block (the noise of a rerun-to-rerun difference)."""
    n = len(d)
    out = np.empty(n)
    for b in range(max(1, math.ceil(n / block))):
        seg = d[b * block : (b + 1) * block]
        seg = seg[np.isfinite(seg)]
        out[b * block : (b + 1) * block] = 1.4826 * np.median(np.abs(seg - np.median(seg))) if len(seg) else 0
    return out


def centred_mean(d: np.ndarray, w: int) -> np.ndarray:
    """Mean of the finite values in a centred window of w points."""
    ok = np.isfinite(d)
    z = np.where(ok, d, 0.0)
    c = np.concatenate([[0.0], np.cumsum(z)])
    k = np.concatenate([[0], np.cumsum(ok)])
    n = len(d)
    lo = np.clip(np.arange(n) - w // 2, 0, n)
    hi = np.clip(np.arange(n) + (w - w // 2), 0, n)
    cnt = k[hi] - k[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (c[hi] - c[lo]) / np.maximum(cnt, 1), np.nan)


@dataclass
class Divergence:
    step: int | None  # where the difference starts to move (change point), None: stays in the band
    crossed: int | None  # the first point out of the band after which it stays out
    kind: str | None  # offset / noise
    mean_diff: float | None
    std_diff: float | None
    sigma: float | None  # median noise sigma before the onset
    change_points: list[int] = field(default_factory=list)


def leave_band(x: np.ndarray, d: np.ndarray, sigma: np.ndarray, w: int, k: float = BAND_K) -> tuple:
    """(Divergence, smoothed difference, band half-width, out mask)."""
    n = len(d)
    s = centred_mean(d, w)
    band = k * sigma / math.sqrt(w)
    out = ~(np.abs(s) <= band)  # NaN (a non-finite stretch) counts as out
    suffix = np.cumsum(out[::-1])[::-1] / np.arange(n, 0, -1)
    cand = np.flatnonzero(out & (suffix >= STAY_OUT) & (np.arange(n) <= n - w))
    apart = _parted(d, w)
    if len(cand) == 0 and apart is None:
        return Divergence(None, None, None, None, None, float(np.median(sigma)) if n else None), s, band, out
    cps = change_points(d, sigma)
    if apart is not None:
        i = j = apart  # equal curves that then differ for good: they part where they first differ
    else:
        i = int(cand[0])
        near = [c for c in cps if i - w <= c <= i + w]  # the centred window reaches w/2 ahead of the onset
        j = near[0] if near else i
    post = d[j:][np.isfinite(d[j:])]
    mean, std = (float(post.mean()), float(post.std())) if len(post) else (math.nan, math.nan)
    kind = "offset" if _significant_mean(post, w) else "noise"
    pre_sigma = float(np.median(sigma[: max(j, 1)]))
    div = Divergence(int(x[j]), int(x[i]), kind, mean, std, pre_sigma, [int(x[c]) for c in cps])
    return div, s, band, out


def _parted(d: np.ndarray, w: int) -> int | None:
    """The first index where d is not exactly 0, when d is exactly 0 on at least w points before it (the runs
    printed the same values: a bitwise-identical start) and non-zero (or non-finite) on >= STAY_OUT of the points
    from it on; else None. After an identical start any lasting difference is a divergence, even one that is
    noise around zero (which the smoothed difference does not see)."""
    differ = ~(d == 0)
    if not differ.any():
        return None
    p = int(np.argmax(differ))
    if p < w or differ[p:].mean() < STAY_OUT or len(d) - p < w:
        return None
    return p


def _significant_mean(post: np.ndarray, w: int) -> bool:
    """The mean of `post` is non-zero at 3 standard errors, the error from means of blocks of w points (the
    difference is correlated from step to step)."""
    nb = len(post) // w
    if nb < 3:
        return bool(len(post) and abs(post.mean()) > 3 * post.std() / math.sqrt(len(post)))
    bm = post[: nb * w].reshape(nb, w).mean(axis=1)
    se = bm.std(ddof=1) / math.sqrt(nb)
    return bool(abs(bm.mean()) > 3 * se) if se > 0 else bool(bm.mean() != 0)


def change_points(d: np.ndarray, sigma: np.ndarray, max_blocks: int = 2000) -> list[int]:
    """Indices (into d) where the mean of d changes: ruptures' KernelCPD (linear kernel: the L2 cost of a change
    in the mean, solved by Pelt) on means of blocks of d, penalty 6 log(blocks) per change in units of the block
    means' noise."""
    n = len(d)
    block = max(1, math.ceil(n / max_blocks))
    nb = n // block
    if nb < 4:
        return []
    z = np.where(np.isfinite(d), d, np.nan)[: nb * block].reshape(nb, block)
    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN block: its mean is NaN, filled below
        means = np.nanmean(z, axis=1) if block > 1 else z[:, 0]
    fill = np.nanmax(np.abs(means)) * 10 if np.isfinite(means).any() else 1.0
    means = np.where(np.isfinite(means), means, fill)  # a non-finite block: far out
    sig_b = float(np.median(sigma)) / math.sqrt(block)
    scale = sig_b if sig_b > 0 else (float(np.std(means)) or 1.0)
    sig = (means / scale).reshape(-1, 1)
    try:
        bkps = kernel_cpd_l2(sig, pen=3.0 * math.log(nb) * 2)
    except ImportError:
        raise CurvesError(
            "change-point detection needs ruptures: pip install 'dumpstore[longrun]' (or pip install ruptures)"
        ) from None
    return [b * block for b in bkps[:-1]]


@dataclass
class Criterion:
    name: str
    passed: bool | None  # None: not measurable (a tag missing)
    value: str
    rule: str


@dataclass
class Event:
    run: str
    kind: str  # nonfinite_loss / skipped_iterations / nan_iterations / overflow / loss_scale_drop
    steps: list[int]
    detail: str


@dataclass
class LrMismatch:
    step: int
    target_lr: float
    ref_lr: float
    ratio: float
    ratio_after: float  # median ratio from that step on
    share_after: float  # share of the later common steps that differ


@dataclass
class CurvesReport:
    target: str
    ref: str
    ref2: str | None
    tag: str
    by: str
    n_points: int
    first_x: int
    last_x: int
    band_source: str
    window: int
    criteria: list[Criterion]
    divergence: Divergence
    spikes: list[Spike]
    events: list[Event]
    lr_mismatch: LrMismatch | None
    max_abs_diff: float
    mean_abs_diff: float
    culprit: dict[str, Any] | None = None
    coverage: Coverage | None = None  # None: monitor data only
    dump_verdict: dict[str, Any] | None = None  # the verdict of a dump pair of the flagged steps (--dump-target)
    msprobe_flagged: list[dict[str, Any]] = field(default_factory=list)  # msprobe's own alarms, per run
    points: dict[str, np.ndarray] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("points")
        return d

    def rows(self) -> list[dict[str, Any]]:
        """One row per aligned point (the CSV)."""
        p = self.points or {}
        cols = list(p)
        arrays = [p[c].tolist() for c in cols]
        return [dict(zip(cols, vals)) for vals in zip(*arrays)]


def _nan_to_none(v: float) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def compare_curves(
    target: pa.Table,
    ref: pa.Table,
    ref2: pa.Table | None = None,
    *,
    names: tuple[str, str, str | None] = ("target", "ref", None),
    tag: str = "loss",
    by: str = "iteration",
    rank: int | None = None,
    k: float = BAND_K,
) -> CurvesReport:
    """Compare the `tag` curves of two long runs' scalars tables (see the module doc)."""
    if by not in ("iteration", "samples"):
        raise CurvesError(f"--by {by!r}: give iteration or samples")
    st, sr = series(target, tag, rank), series(ref, tag, rank)
    for s, name, table in ((st, names[0], target), (sr, names[1], ref)):
        if s is None:
            tags = sorted(set(table.column("tag").to_pylist()))
            raise CurvesError(f"run {name} has no {tag!r} points (tags: {', '.join(tags) or 'none'}); pick --tag")
    assert st is not None and sr is not None
    x, t, r = align(st, sr, by, (names[0], names[1]))
    n = len(x)
    d = t - r
    w = max(5, n // 200)
    block = max(50, 10 * w)
    r2v = None
    if ref2 is not None:
        s2 = series(ref2, tag, rank)
        if s2 is None:
            raise CurvesError(f"run {names[2]} has no {tag!r} points; pick --tag or drop --ref2")
        x2, r2, rr = align(s2, sr, by, (str(names[2]), names[1]))
        d2 = np.interp(x, x2, r2 - rr)
        r2v = np.interp(x, x2, r2)
        sigma = rolling_sigma(d2, block)
        band_source = f"rerun: the difference of {names[2]} from {names[1]} (robust spread per {block} points)"
    else:
        sigma = held_sigma(d, block)
        band_source = (
            f"the difference's own high-frequency residual (first differences, robust spread per {block} points, "
            "never widening)"
        )
    sigma = np.maximum(sigma, PRINT_REL * float(np.nanmedian(np.abs(r))))
    div, s, band, out = leave_band(x, d, sigma, w, k)
    cov = coverage(st, sr, x, by, (names[0], names[1]), tag)
    crit = criteria(x, t, r, target, ref, div, band_source, by, rank, names, cov)
    spikes = find_spikes(st, names[0]) + find_spikes(sr, names[1])
    events = find_events(target, names[0], rank) + find_events(ref, names[1], rank)
    lr = lr_mismatch(target, ref, rank)
    fin = np.isfinite(d)
    points = {"x": x, "target": t, "ref": r}
    if r2v is not None:
        points["ref2"] = r2v
    points.update({"diff": d, "smoothed": s, "band": band, "out": out})
    return CurvesReport(
        names[0],
        names[1],
        names[2],
        tag,
        by,
        n,
        int(x[0]),
        int(x[-1]),
        band_source,
        w,
        crit,
        div,
        spikes,
        events,
        lr,
        float(np.max(np.abs(d[fin]))) if fin.any() else math.nan,
        float(np.mean(np.abs(d[fin]))) if fin.any() else math.nan,
        coverage=cov,
        points=points,
    )


def criteria(x, t, r, target, ref, div, band_source, by, rank, names, cov=None) -> list[Criterion]:
    fin = np.isfinite(t) & np.isfinite(r)
    out = []
    if fin.any():
        i = int(np.flatnonzero(fin)[0])
        ae = abs(t[i] - r[i])
        re_ = ae / abs(r[i]) if r[i] != 0 else math.inf
        out.append(
            Criterion(
                "first_step_loss",
                bool(ae < FIRST_STEP_ABS or re_ < FIRST_STEP_REL),
                f"step {int(x[i])}: abs err {ae:.3g}, rel err {re_:.3g}",
                "abs err < 0.005 or rel err < 0.5 %",
            )
        )
        ae_all = np.abs(t[fin] - r[fin])
        with np.errstate(divide="ignore", invalid="ignore"):
            re_all = ae_all / np.abs(r[fin])
        mae, mre = (
            float(ae_all.mean()),
            float(np.mean(re_all[np.isfinite(re_all)])) if np.isfinite(re_all).any() else math.inf,
        )
        out.append(
            Criterion(
                "mean_loss_error",
                bool(mae < MEAN_ABS or mre < MEAN_REL),
                f"mean abs err {mae:.3g}, mean rel err {mre:.3g} over {int(fin.sum())} points",
                "mean abs err < 0.01 or mean rel err < 1 %",
            )
        )
    gt, gr = series(target, "grad_norm", rank), series(ref, "grad_norm", rank)
    if gt is not None and gr is not None:
        try:
            _, a, b = align(gt, gr, by, (names[0], names[1]))
        except CurvesError:
            a = b = np.array([])
        ok = np.isfinite(a) & np.isfinite(b) & (b != 0)
        if ok.any():
            gre = float(np.mean(np.abs(a[ok] - b[ok]) / np.abs(b[ok])))
            out.append(
                Criterion(
                    "grad_norm_mean_rel_error",
                    bool(gre <= GRAD_NORM_MEAN_REL),
                    f"{gre:.3g} over {int(ok.sum())} points",
                    "mean rel err <= 10 %",
                )
            )
    else:
        out.append(Criterion("grad_norm_mean_rel_error", None, "no grad_norm in both runs", "mean rel err <= 10 %"))
    inside = div.step is None
    # never an all-clear about points one run lacks
    stays = "the difference stays inside the band" + (cov.only() if cov is not None else "")
    out.append(
        Criterion(
            "within_noise_band",
            inside,
            stays if inside else f"leaves the band from step {div.step} ({div.kind}, mean diff {div.mean_diff:.3g})",
            f"noise band from {band_source}",
        )
    )
    return out


def find_events(scalars: pa.Table, run: str, rank: int | None = None) -> list[Event]:
    out = []
    loss = series(scalars, "loss", rank)
    if loss is not None:
        bad = loss.x[~np.isfinite(loss.v)]
        if len(bad):
            out.append(Event(run, "nonfinite_loss", bad.tolist(), f"{len(bad)} steps with a NaN/Inf loss"))
    for tag, kind in (("skipped_iterations", "skipped_iterations"), ("nan_iterations", "nan_iterations")):
        s = series(scalars, tag, rank)
        if s is not None:
            hit = s.x[np.nan_to_num(s.v) > 0]
            if len(hit):
                out.append(Event(run, kind, hit.tolist(), f"{len(hit)} steps report {tag.replace('_', ' ')}"))
    s = series(scalars, "overflow", rank)
    if s is not None:
        hit = s.x[np.nan_to_num(s.v) > 0]
        if len(hit):
            out.append(Event(run, "overflow", hit.tolist(), f"{len(hit)} steps with overflow cond True"))
    s = series(scalars, "loss_scale", rank)
    if s is not None and len(s.v) > 1:
        drop = np.flatnonzero(s.v[1:] < s.v[:-1]) + 1
        if len(drop):
            out.append(
                Event(
                    run,
                    "loss_scale_drop",
                    s.x[drop].tolist(),
                    f"{len(drop)} drops, {s.v[0]:.4g} -> {s.v[-1]:.4g} (min {np.nanmin(s.v):.4g})",
                )
            )
    return out


def lr_mismatch(target: pa.Table, ref: pa.Table, rank: int | None = None) -> LrMismatch | None:
    a, b = series(target, "lr", rank), series(ref, "lr", rank)
    if a is None or b is None:
        return None
    x, ia, ib = np.intersect1d(a.x, b.x, assume_unique=True, return_indices=True)
    if not len(x):
        return None
    ta, tb = a.v[ia], b.v[ib]
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(ta - tb) / np.maximum(np.abs(tb), 1e-30)
    bad = np.flatnonzero(rel > LR_REL)
    if not len(bad):
        return None
    i = int(bad[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = ta[i:] / tb[i:]
    fin = ratio[np.isfinite(ratio)]
    return LrMismatch(
        int(x[i]),
        float(ta[i]),
        float(tb[i]),
        float(ta[i] / tb[i]) if tb[i] else math.inf,
        float(np.median(fin)) if len(fin) else math.nan,
        float(np.mean(rel[i:] > LR_REL)),
    )

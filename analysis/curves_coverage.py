"""Which points of the compared tag each run has, and which `curves` compared: a run whose losses stop before the
other's (a crashed or shorter run; skipped iterations print no loss) or start after them is said in words, so
that no verdict reads as an all-clear about points one run does not have (curves.py's module doc, coverage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .curves import Series


@dataclass
class Coverage:
    """Which points of the tag each run has and which were compared (the aligned ones)."""

    unit: str  # iteration / consumed samples
    target: list[int]  # [first, last] point of the target's tag
    ref: list[int]
    compared: list[int]  # [first, last] aligned point
    only_target: int  # the target's points not compared (outside the common range, or gaps of the other run)
    only_ref: int
    note: str | None  # None: both runs have the same points; else what one run lacks, in words

    def only(self) -> str:
        """'' when both runs have the same points, else ' over <unit> a..b only (<note>)'."""
        return f" over {self.unit} {self.compared[0]}..{self.compared[1]} only ({self.note})" if self.note else ""


def coverage(target: Series, ref: Series, x: np.ndarray, by: str, names: tuple[str, str], tag: str) -> Coverage:
    """Each run's extent of the tag against the aligned points `x` (see the module doc, coverage)."""
    if by == "iteration":
        unit, tx, rx = "iteration", target.x, ref.x
    else:
        assert target.samples is not None and ref.samples is not None
        unit = "consumed samples"
        tx = target.samples[np.isfinite(target.samples)].astype(np.int64)
        rx = ref.samples[np.isfinite(ref.samples)].astype(np.int64)
    c0, c1 = int(x[0]), int(x[-1])
    t0, t1, r0, r1 = int(tx.min()), int(tx.max()), int(rx.min()), int(rx.max())
    tn, rn = f"target {names[0]}", f"the reference {names[1]}"
    parts = []
    if t1 < r1:
        parts.append(f"{tn} stops at {unit} {t1}, {rn} goes on to {r1}")
    elif r1 < t1:
        parts.append(f"{rn} stops at {unit} {r1}, the {tn} goes on to {t1}")
    if t0 > r0:
        parts.append(f"{tn} starts at {unit} {t0}, {rn} at {r0}")
    elif r0 > t0:
        parts.append(f"{rn} starts at {unit} {r0}, the {tn} at {t0}")
    if by == "iteration":  # points inside the common range that one run lacks (skipped iterations print no loss)
        for s, other, name in ((rx, "target", names[1]), (tx, "reference", names[0])):
            gap = int(np.count_nonzero((s >= c0) & (s <= c1))) - len(x)
            if gap > 0:
                parts.append(f"{gap} {unit}s of {name} within {c0}..{c1} have no {other} {tag}")
    only_t = len(tx) - len(x) if by == "iteration" else int(np.count_nonzero((tx < c0) | (tx > c1)))
    only_r = len(rx) - len(x) if by == "iteration" else int(np.count_nonzero((rx < c0) | (rx > c1)))
    return Coverage(unit, [t0, t1], [r0, r1], [c0, c1], only_t, only_r, "; ".join(parts) or None)

"""The jumps the spike rules see on the long runs of a store, against the loss's level over the run: what the
spike floor of `curves` (analysis/curves_spikes.py: SPIKE_LEVEL x the largest 10-step median so far) is set by.

    python validation/longrun/spike_levels.py --store DIR      # a store score.py ingested the runs into

Per run: every step Megatron's factor-10 rule flags (above 10 x the median of the previous 100 steps), with its
jump (value - that median) divided by the loss's level over the run before it; `kept` where that is at least
SPIKE_LEVEL."""

from __future__ import annotations

import argparse

import numpy as np

from dumpstore.analysis.curves import series
from dumpstore.analysis.curves_spikes import (
    SPIKE_FACTOR,
    SPIKE_LEVEL,
    SPIKE_WINDOW,
    _ffill,
    _previous_median,
    spike_level,
)
from dumpstore.longrun.store import catalog, read
from dumpstore.store import open_store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    st = open_store(ap.parse_args().store)
    for run in sorted(catalog(st).column("run").to_pylist()):
        s = series(read(st, "scalars", run, dictionary=["tag"]), "loss")
        if s is None:
            continue
        v = _ffill(s.v)
        base, level = _previous_median(v, SPIKE_WINDOW), spike_level(v)
        with np.errstate(invalid="ignore"):
            hit = np.flatnonzero(np.isfinite(s.v) & (base > 0) & (s.v > SPIKE_FACTOR * base))
        hit = hit[hit >= 10]
        ratio = (v[hit] - base[hit]) / level[hit]
        kept, dropped = hit[ratio >= SPIKE_LEVEL], hit[ratio < SPIKE_LEVEL]
        line = f"{run}: {len(hit)} steps over 10 x the median"
        if len(kept):
            low = ratio[ratio >= SPIKE_LEVEL].min()
            line += f"; kept {len(kept)} (from step {int(s.x[kept[0]])}), jump / level >= {low:.3g}"
        if len(dropped):
            line += f"; dropped {len(dropped)}, jump / level <= {ratio[ratio < SPIKE_LEVEL].max():.3g}"
        print(line)


if __name__ == "__main__":
    main()

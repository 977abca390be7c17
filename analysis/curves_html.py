"""`curves --html`: one self-contained page with both runs' curves and their difference against the noise band,
the divergence step, the lr mismatch and the spikes marked; zoomable (plotly.js, embedded as in the report).

Each curve is drawn downsampled, the minimum and the maximum of each of at most MAX_BUCKETS buckets of steps (a
spike stays visible at any zoom-out); the CSV (`--csv`) has every point. Names from the store are untrusted:
the data goes in as JSON with `<`, `>`, `&` escaped, markup is escaped, and the page's Content-Security-Policy
runs only its own scripts, by hash, with no network access.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from .curves import CurvesReport
from .report.page import _json_for_script, _sha, plotly_js
from .report.text import esc, write_text

MAX_BUCKETS = 2000

_JS = r"""
(function () {
  var t0 = performance.now();
  var d = JSON.parse(document.getElementById("curves-data").textContent);
  var cfg = {responsive: true, displaylogo: false};
  var marks = [];
  if (d.divergence !== null) {
    marks.push({type: "line", xref: "x", yref: "paper", x0: d.divergence, x1: d.divergence, y0: 0, y1: 1,
                line: {color: "#d62728", dash: "dash"}});
  }
  if (d.lr_step !== null) {
    marks.push({type: "line", xref: "x", yref: "paper", x0: d.lr_step, x1: d.lr_step, y0: 0, y1: 1,
                line: {color: "#9467bd", dash: "dot"}});
  }
  var curves = d.curves.map(function (c) {
    return {x: c.x, y: c.y, name: c.name, mode: "lines", line: {width: 1}};
  });
  if (d.spikes.x.length) {
    curves.push({x: d.spikes.x, y: d.spikes.y, text: d.spikes.text, name: "spikes", mode: "markers",
                 marker: {color: "#d62728", size: 8, symbol: "x"}});
  }
  Plotly.newPlot("curves", curves, {title: d.title, xaxis: {title: d.xlabel}, yaxis: {title: d.tag},
                                     shapes: marks, height: 420}, cfg);
  var b = d.band;
  var diff = [
    {x: b.x, y: b.hi, mode: "lines", line: {width: 0}, name: "band +", showlegend: false, hoverinfo: "skip"},
    {x: b.x, y: b.lo, mode: "lines", line: {width: 0}, fill: "tonexty", fillcolor: "rgba(31,119,180,0.2)",
     name: "noise band (smoothed diff)", hoverinfo: "skip"},
    {x: d.diff.x, y: d.diff.y, mode: "lines", line: {width: 1, color: "#7f7f7f"}, name: "target - ref"},
    {x: d.smoothed.x, y: d.smoothed.y, mode: "lines", line: {width: 2, color: "#ff7f0e"}, name: "smoothed"}
  ];
  Plotly.newPlot("difference", diff, {title: "difference and noise band", xaxis: {title: d.xlabel},
                                       shapes: marks, height: 380}, cfg);
  document.getElementById("render-ms").textContent = Math.round(performance.now() - t0);
})();
"""

_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}pre{background:#f6f6f6;padding:.6em;"
    "white-space:pre-wrap}h1{font-size:1.3em}.sub{color:#666}"
)


def minmax(x: np.ndarray, y: np.ndarray, buckets: int = MAX_BUCKETS) -> tuple[list, list]:
    """At most 2 x `buckets` points: in each bucket of consecutive points its minimum and maximum, in x order."""
    n = len(x)
    if n <= 2 * buckets:
        return x.tolist(), [None if not np.isfinite(v) else float(v) for v in y]
    size = -(-n // buckets)
    xs: list = []
    ys: list = []
    for a in range(0, n, size):
        seg = y[a : a + size]
        fin = np.flatnonzero(np.isfinite(seg))
        if not len(fin):
            xs.append(int(x[a]))
            ys.append(None)
            continue
        i, j = fin[np.argmin(seg[fin])], fin[np.argmax(seg[fin])]
        for k in sorted({int(i), int(j)}):
            xs.append(int(x[a + k]))
            ys.append(float(seg[k]))
    return xs, ys


def page_data(rep: CurvesReport) -> dict[str, Any]:
    p = rep.points or {}
    x = p.get("x", np.array([], dtype=np.int64))
    curves = []
    for key, name in (("target", rep.target), ("ref", rep.ref), ("ref2", rep.ref2)):
        if key in p:
            cx, cy = minmax(x, p[key])
            curves.append({"name": name, "x": cx, "y": cy})
    dx, dy = minmax(x, p.get("diff", np.array([])))
    sx, sy = minmax(x, p.get("smoothed", np.array([])))
    band = p.get("band", np.array([]))
    bx, hi = minmax(x, band)
    lo = [None if v is None else -v for v in hi]
    spikes = [s for s in rep.spikes if s.run == rep.target] + [s for s in rep.spikes if s.run != rep.target]
    return {
        "title": f"{rep.tag}: {rep.target} vs {rep.ref}",
        "tag": rep.tag,
        "xlabel": "consumed samples" if rep.by == "samples" else "iteration",
        "curves": curves,
        "diff": {"x": dx, "y": dy},
        "smoothed": {"x": sx, "y": sy},
        "band": {"x": bx, "hi": hi, "lo": lo},
        "divergence": rep.divergence.step,
        "lr_step": rep.lr_mismatch.step if rep.lr_mismatch is not None else None,
        "spikes": {
            "x": [s.step for s in spikes],
            "y": [s.value for s in spikes],
            "text": [f"{s.run}: {s.rule}" for s in spikes],
        },
    }


def render(rep: CurvesReport, summary: str) -> str:
    from dumpstore import __version__

    plotly = plotly_js()
    csp = (
        f"default-src 'none'; script-src {_sha(plotly)} {_sha(_JS)}; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'"
    )
    title = esc(f"dumpstore curves: {rep.target} vs {rep.ref}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        f"<title>{title}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n<h1>{title}</h1>\n"
        f'<p class="sub">generated {esc(when)} by dumpstore {esc(__version__)} · self-contained, works offline · '
        "curves drawn as the min and max of each of at most 2000 buckets (every point: --csv)</p>\n"
        f"<pre>{esc(summary)}</pre>\n"
        '<div id="curves"></div>\n<div id="difference"></div>\n'
        '<footer>Charts drawn in <span id="render-ms"></span> ms. plotly.js (MIT) is embedded.</footer>\n'
        f'<script type="application/json" id="curves-data">{_json_for_script(page_data(rep))}</script>\n'
        f"<script>{plotly}</script>\n<script>{_JS}</script>\n</body>\n</html>\n"
    )


def write(rep: CurvesReport, summary: str, path: str | Path) -> int:
    """Write the page; returns its size in bytes."""
    return write_text(render(rep, summary), path)

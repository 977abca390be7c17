"""Text shared by the reports: the verdict line, numbers and HTML escaping, and writing a report file."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from dumpstore.errors import DumpstoreError

from ..verdict import Finding, Verdict

__all__ = ["counts_text", "esc", "finding_metric", "fmt", "summary_line", "write_text"]


def summary_line(verdict: Verdict) -> str:
    """One line with the verdict and its threshold, for a terminal."""
    f, c = verdict.first_divergence, verdict.culprit
    if f is None:
        return f"PASS | {verdict.target} vs {verdict.ref} | no divergence ({counts_text(verdict.counts)})"
    line = f"DIVERGED | step {f.step} rank {f.rank} {f.op} | {finding_metric(f)}"
    if c is not None:
        line += f" | culprit {c.kind}: {c.op}"
    return line


def counts_text(counts: dict[str, int]) -> str:
    """Leaf counts by status, e.g. '3 diverged, 40 pass'."""
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "nothing compared"


def finding_metric(f: Finding) -> str:
    """A finding's metric against its threshold, e.g. 'rel_l2=1.2e-02 > tol=1.0e-04 (float32)'."""
    if f.value is None:
        return f.detail or f.kind
    op = ">" if f.threshold is not None and f.value > f.threshold else "<="
    text = f"{f.metric or 'rel_l2'}={fmt(f.value)} {op} tol={fmt(f.threshold)}"
    return text + (f" ({f.dtype})" if f.dtype else "")


def esc(v: Any) -> str:
    """HTML-escape anything for markup (None -> an em dash)."""
    return "—" if v is None else html.escape(str(v), quote=True)


def fmt(v: Any) -> str:
    """A number for people: 4 significant digits, exponent form when tiny or huge; None -> an em dash."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.2e}" if (v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4)) else f"{v:.4g}"
    return str(v)


def write_text(text: str, path: str | Path) -> int:
    """Write a report file (making its folder), or a one-line error naming it."""
    data = text.encode("utf-8")
    p = Path(path)
    part = p.with_name(p.name + ".part")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(data)
        part.replace(p)  # whole or not at all
    except OSError as exc:
        _gone(part)
        raise DumpstoreError(f"{p}: cannot write the report ({exc.strerror or exc}); pick another path") from None
    except BaseException:  # Ctrl-C, SIGTERM: no half file left
        _gone(part)
        raise
    return len(data)


def _gone(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass

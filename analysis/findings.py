"""The parts of a verdict: `Finding` (one located event) and `Verdict` (first divergence, culprit, timeline, ...).

Kept apart from analysis/verdict.py (the question and its memoized answer) and analysis/_divergence.py (how a
verdict is reached), so that both import these without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Finding:
    """One located event of a verdict: where (step, rank, op, leaf name), what kind, and its measure."""

    step: int
    rank: int
    op: str
    name: str | None
    kind: str
    metric: str | None = None
    value: float | None = None
    threshold: float | None = None
    source: str | None = None
    dtype: str | None = None
    severity: float | None = None
    detail: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Finding | None:
        if d is None:
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Verdict:
    """First divergence, culprit, per-step timeline, per-rank view and unmatched records of two runs."""

    target: str
    ref: str
    first_divergence: Finding | None
    culprit: Finding | None
    steps: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    unmatched: list[dict[str, Any]]
    precision: dict[str, str]
    counts: dict[str, int]
    coverage: dict[str, list[int]]
    noise: dict[str, Any] = field(default_factory=dict)  # the pair's own noise (analysis/noise.py)
    # what could not be judged beyond the `unknown` count: `exact_unavailable` pairs whose tensor files --exact
    # could not read again (missing, changed since ingest), with the `first` reason
    not_judged: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["first_divergence"] = Finding.from_dict(d.get("first_divergence"))
        kw["culprit"] = Finding.from_dict(d.get("culprit"))
        return cls(**kw)

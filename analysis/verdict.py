"""The divergence verdict as a library answer: a question (runs, steps, ranks, tolerances, maps, exact) in, a
`Verdict` out, through the store's memo.

`answer(store, Question(...))` is what `dumpstore divergence` and `dumpstore report` call: it returns the memoized
verdict when the store holds one for the same question and the same live ingests of both runs (one stat and a
JSON read: no pyarrow, Polars or DuckDB import), and otherwise computes it with
`analysis.divergence.divergence_by_steps` (memory bounded by a batch of steps) and memoizes it.

This module stays light: the heavy analysis is imported only when a verdict has to be computed.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import memo
from .findings import Finding, Verdict
from .tolerance import Tolerances

__all__ = ["Finding", "Question", "Verdict", "answer", "live_ingests"]


@dataclass(frozen=True)
class Question:
    """A divergence question.  `steps`/`ranks` None: all common ones; `maps`: mapping YAML files (msprobe's forms)
    applied in order; `exact`: read both runs' tensor files for msprobe's exact metrics."""

    target: str
    ref: str
    steps: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None
    tolerances: Tolerances = field(default_factory=Tolerances)
    maps: tuple[str, ...] = ()
    exact: bool = False
    noise_ref: str | None = None  # a second reference run: an empirical noise band per tensor

    def compare_options(self) -> dict[str, Any]:
        """Keyword arguments of `compare_runs` / `divergence_by_steps` (mapping files parsed here)."""
        from .mapping import load_mapping

        return {
            "steps": list(self.steps) if self.steps else None,
            "ranks": list(self.ranks) if self.ranks else None,
            "tolerances": self.tolerances,
            "exact": self.exact,
            "mapping": load_mapping(list(self.maps)),
            **({"noise_ref": self.noise_ref} if self.noise_ref else {}),
        }

    def key(self) -> str:
        """The memo key: the question (mapping files by content) and the code answering it."""
        t = self.tolerances
        return memo.key(
            {
                "command": "divergence",
                "target": self.target,
                "ref": self.ref,
                "steps": sorted(set(self.steps)) if self.steps else None,
                "ranks": sorted(set(self.ranks)) if self.ranks else None,
                "exact": self.exact,
                "maps": [memo.file_digest(m) for m in self.maps],
                "tol": [t.rel_l2, t.all_dtypes, t.amplification],
                **({"noise_ref": self.noise_ref} if self.noise_ref else {}),
            }
        )


def answer(
    store: Any,
    question: Question,
    *,
    use_memo: bool = True,
    comparison: Any = None,
    cluster: dict[str, Any] | None = None,
) -> Verdict:
    """The verdict of `question` over `store` (a Store, or a store path; None: the default store).

    `comparison`: the question's `compare_runs` result when the caller holds it already (the report does); the
    verdict is then taken from it instead of comparing the runs again."""
    from dumpstore.store import Store, default_store_path

    options = question.compare_options()  # mapping files are parsed (one-line errors) before they are hashed
    key = question.key()
    root = Path(store.root) if isinstance(store, Store) else Path(store) if store is not None else default_store_path()
    if use_memo:
        hit = memo.lookup(root, key, lambda: live_ingests(_opened(store, root), question))
        if hit is not None:
            return Verdict.from_dict(hit)
    from ._divergence import divergence, divergence_by_steps

    st = _opened(store, root)
    before = memo.catalog_signature(st.root)
    files = None
    with ExitStack() as stack:
        unavailable: list[str] = []
        if question.exact:  # the answer holds while the tensor files it read are as they were (memo.folders_digest)
            from . import exact

            dirs = exact.tensor_dirs(st, [question.target, question.ref])
            files = {"dirs": dirs, "digest": memo.folders_digest(dirs)}
            unavailable = stack.enter_context(exact.unavailable_pairs())
        if comparison is not None:
            verdict = divergence(comparison)
        elif cluster is not None and not question.noise_ref:  # (a noise reference is compared here, in one process)
            from .distributed import divergence_by_steps as on_cluster

            verdict = on_cluster(st, question.target, question.ref, **options, **cluster)
        else:
            verdict = divergence_by_steps(st, question.target, question.ref, **options)
    if unavailable:
        verdict.not_judged = {"exact_unavailable": len(unavailable), "first": unavailable[0]}
    memo.save(st.root, key, live_ingests(st, question), before, verdict.to_dict(), files)
    return verdict


def _opened(store: Any, root: Path) -> Any:
    from dumpstore.store import Store, open_store

    return store if isinstance(store, Store) else open_store(root)


def live_ingests(st: Any, question: Question) -> dict[str, Any]:
    """The live ingest id of each run of the question (None for a run not in the catalog), one catalog read."""
    live = {row["run"]: row["ingest_id"] for row in st.runs().to_pylist()}
    runs = (question.target, question.ref) + ((question.noise_ref,) if question.noise_ref else ())
    return {run: live.get(run) for run in runs}

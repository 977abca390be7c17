"""The one check of step and rank selectors: a selector that matches nothing is an error naming what exists.

Every library entry point that takes `steps` / `ranks` (compare_runs, divergence_by_steps, overflow) calls
`check_selection` first, so a typo'd `--step 99` is `Error: step 99 is not in run 'target' (steps: 0, 1, 2)`
and never an empty table or a clean verdict.  An unknown run is refused by `Store.run_info`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dumpstore.errors import SelectionError


def check_selection(
    store, runs: Sequence[str | None], *, steps: Iterable[int] | None = None, ranks: Iterable[int] | None = None
) -> None:
    """Raise SelectionError unless every asked step and rank is in every run of `runs` (None entries skipped)."""
    for run in runs:
        if run is None:
            continue
        info = store.run_info(run)
        for what, asked, have in (("step", steps, info["steps"]), ("rank", ranks, info["ranks"])):
            missing = sorted(set(asked or ()) - set(have))
            if missing:
                raise SelectionError(_message(what, missing, run, list(have)))


def _message(what: str, missing: list[int], run: str, have: list[int]) -> str:
    asked = ", ".join(str(x) for x in missing)
    plural = "s" if len(missing) > 1 else ""
    verb = "are" if len(missing) > 1 else "is"
    exists = ", ".join(str(x) for x in sorted(have)) or "none"
    return f"{what}{plural} {asked} {verb} not in run {run!r} ({what}s: {exists})"

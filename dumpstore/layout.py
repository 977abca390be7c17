"""Find the ingest units under a path (msprobe step/rank trees, lone dump.json files, plain tensor folders): each
folder is offered to the readers (dumpstore.readers), which say what it holds."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import readers
from .errors import DumpFormatError

_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^rank(\d+)$")
_PROC = re.compile(r"^proc(\d+)$")
_SPLITS = ("graph", "pynative")
_INT64_MAX = (1 << 63) - 1  # step and rank are int64 partition columns


@dataclass(frozen=True)
class Unit:
    """One ingest unit: a dump.json (or debug.json) or a plain folder of tensor files, for one step and rank."""

    path: Path  # dump.json / debug.json, or the folder of tensor files
    kind: str  # "dump", "files", or the NAME of a reader with rows of its own (see dumpstore.readers)
    step: int
    rank: int
    rank_dir: str
    source: str  # '' / graph / pynative


def find_units(root: str | os.PathLike, *, quiet: bool = False) -> list[Unit]:
    """All ingest units under `root` (a dump root, a step or rank folder, or one dump.json). A step, rank or proc
    folder that yields nothing (no dump.json, empty, or a link, which is not followed) is skipped with a notice
    (none when `quiet`)."""
    root = Path(root)
    if not root.exists():
        raise DumpFormatError(f"{root}: no such file or directory")
    if root.is_file():
        got = readers.claim(root.parent, [root.name])
        if got is None or got[1].path != root:
            raise DumpFormatError(f"{root}: not a dump file; expected {_record_files()} or a dump folder")
        return [_unit(root, got[1].kind, root.parent)]
    units = [_unit(c.path, c.kind, folder) for c, folder in _walk(root, None if quiet else _skipped)]
    units = _drop_proc_beside_rank(units)
    if not units:
        raise DumpFormatError(
            f"{root}: no {_record_files()} or {'/'.join(readers.tensor_suffixes())} tensor files found; "
            "point at an msprobe dump root, a step/rank folder, or a dump.json"
        )
    units = _assign_proc_ranks(units)
    _check_unique(units)
    return sorted(units, key=lambda u: (u.source, u.step, u.rank, u.rank_dir, str(u.path)))


def _record_files() -> str:
    """The names of the record files the readers know ("dump.json, debug.json")."""
    return ", ".join(f for r in readers.READERS for f in getattr(r, "FILES", ()))


def _skipped(folder: Path, why: str) -> None:
    import warnings

    from .errors import DumpstoreWarning

    warnings.warn(f"{folder}: {why}; skipped", DumpstoreWarning, stacklevel=4)


def _is_unit_folder_name(name: str) -> bool:
    return bool(_STEP.match(name) or _RANK.match(name) or _PROC.match(name))


def _walk(root: Path, skipped=None) -> list[tuple[readers.Claim, Path]]:
    """What the readers claim under `root`, with the folder of each claim. With `skipped`, each step, rank or proc
    folder that yields nothing (empty, no record file, a link: not followed) is passed to it with the reason."""
    found: list[tuple[readers.Claim, Path]] = []
    folders: list[Path] = []  # step / rank / proc folders seen, to tell those that gave nothing
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        d = Path(dirpath)
        if skipped is not None:
            for name in dirnames:
                if _is_unit_folder_name(name) and (d / name).is_symlink():
                    skipped(d / name, "is a link (not followed)")
            if d != root and _is_unit_folder_name(d.name):
                folders.append(d)
        got = readers.claim(d, filenames)
        if got is not None:
            found.append((got[1], d))
            if got[1].whole:
                dirnames[:] = []  # e.g. dump_tensor_data belongs to this dump.json
    if skipped is not None and found:
        _report_idle(found, folders, skipped)
    return found


def _report_idle(found: list[tuple[readers.Claim, Path]], folders: list[Path], skipped) -> None:
    """Pass to `skipped` the deepest step/rank/proc folders under which nothing was claimed."""
    covered: set[Path] = set()
    for _, unit_dir in found:
        covered.add(unit_dir)
        covered.update(unit_dir.parents)
    idle = [f for f in folders if f not in covered]
    inner = {parent for f in idle for parent in f.parents}
    for folder in idle:
        if folder not in inner:  # the deepest only: step8/rank0, not step8 as well
            empty = not any(folder.iterdir())
            skipped(folder, "is empty" if empty else f"holds no {_record_files()} or tensor files")


def _unit(path: Path, kind: str, folder: Path) -> Unit:
    place = getattr(readers.reader(kind), "place", None) if kind not in ("dump", "files") else None
    if place is not None:  # a format with folders of its own (MindSpore graph dumps: rank_{r}/.../{iteration})
        return Unit(path, kind, *place(path))
    step, rank, rank_dir, source = 0, 0, "", ""
    parts = folder.resolve().parts if folder.exists() else folder.parts
    for part in parts:
        if part in _SPLITS:
            source = part
        elif m := _STEP.match(part):
            step = _number(m[1], folder)
    name = folder.name
    if m := _RANK.match(name):
        rank, rank_dir = _number(m[1], folder), name
    elif _PROC.match(name):
        rank, rank_dir = -1, name
    return Unit(path, kind, step, rank, rank_dir, source)


def _number(digits: str, folder: Path) -> int:
    n = int(digits)
    if n > _INT64_MAX:
        raise DumpFormatError(f"{folder}: step or rank number {digits} does not fit in int64; rename the folder")
    return n


def _drop_proc_beside_rank(units: list[Unit]) -> list[Unit]:
    """msprobe ignores proc<pid> folders that sit beside rank<N> folders of the same step."""
    with_rank = {(u.source, u.step) for u in units if u.rank_dir.startswith("rank")}
    return [u for u in units if not (u.rank_dir.startswith("proc") and (u.source, u.step) in with_rank)]


def _assign_proc_ranks(units: list[Unit]) -> list[Unit]:
    """proc<pid> folders get ranks 0..n-1 by sorted pid within their step (pids differ between runs)."""
    out: list[Unit] = []
    groups: dict[tuple[str, int], list[Unit]] = {}
    for u in units:
        if u.rank == -1:
            groups.setdefault((u.source, u.step), []).append(u)
        else:
            out.append(u)
    for members in groups.values():
        members.sort(key=lambda u: int(u.rank_dir[4:]))
        out.extend(Unit(u.path, u.kind, u.step, i, u.rank_dir, u.source) for i, u in enumerate(members))
    return out


def _check_unique(units: list[Unit]) -> None:
    seen: dict[tuple[str, int, int], Unit] = {}
    for u in units:
        key = (u.source, u.step, u.rank)
        if key in seen:
            raise DumpFormatError(
                f"{u.path}: step {u.step} rank {u.rank} appears twice (also {seen[key].path}); "
                "ingest one dump tree per run, or point at one of the folders"
            )
        seen[key] = u

"""Find the dump files under a path: msprobe step/rank trees, lone dump.json files, plain tensor folders."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import msgraph
from .errors import DumpFormatError

DUMP_FILES = ("dump.json", "debug.json")
TENSOR_SUFFIXES = (".pt", ".npy")
_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^rank(\d+)$")
_PROC = re.compile(r"^proc(\d+)$")
_SPLITS = ("graph", "pynative")
_INT64_MAX = (1 << 63) - 1  # step and rank are int64 partition columns


@dataclass(frozen=True)
class Unit:
    """One ingest unit: a dump.json (or debug.json) or a plain folder of tensor files, for one step and rank."""

    path: Path  # dump.json / debug.json, the folder of tensor files, or a graph dump's rank_{r} folder
    kind: str  # "dump", "files" or "msgraph"
    step: int
    rank: int
    rank_dir: str
    source: str  # '' / graph / pynative


def find_units(root: str | os.PathLike) -> list[Unit]:
    """All ingest units under `root` (a dump root, a step or rank folder, or one dump.json)."""
    root = Path(root)
    if not root.exists():
        raise DumpFormatError(f"{root}: no such file or directory")
    if root.is_file():
        if root.name not in DUMP_FILES:
            raise DumpFormatError(f"{root}: not a dump file; expected dump.json, debug.json or a dump folder")
        return [_unit(root, "dump", root.parent)]
    if msgraph.is_graph_dump(root):  # MindSpore graph-mode / kernel-level dump: one unit per rank and iteration
        return [Unit(path, msgraph.KIND, it, rank, rank_dir, "") for path, it, rank, rank_dir in msgraph.units(root)]
    found = _walk(root)
    units = [_unit(p, k, p.parent if k == "dump" else p) for p, k in found]
    units = _drop_proc_beside_rank(units)
    if not units:
        raise DumpFormatError(
            f"{root}: no dump.json, debug.json or .pt/.npy tensor files found; "
            "point at an msprobe dump root, a step/rank folder, or a dump.json"
        )
    units = _assign_proc_ranks(units)
    _check_unique(units)
    return sorted(units, key=lambda u: (u.source, u.step, u.rank, u.rank_dir, str(u.path)))


def _walk(root: Path) -> list[tuple[Path, str]]:
    found: list[tuple[Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        d = Path(dirpath)
        dump = next((f for f in DUMP_FILES if f in filenames), None)
        if dump is not None:
            if (d / dump).is_symlink():  # it could lead anywhere; tensor files that are links are refused too
                raise DumpFormatError(f"{d / dump}: is a link; refusing to read it (copy the file instead)")
            found.append((d / dump, "dump"))
            dirnames[:] = []  # dump_tensor_data belongs to this dump.json
        elif d.name != "dump_tensor_data" and any(f.lower().endswith(TENSOR_SUFFIXES) for f in filenames):
            found.append((d, "files"))
    return found


def _unit(path: Path, kind: str, folder: Path) -> Unit:
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

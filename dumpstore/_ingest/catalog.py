"""The run's catalog row and totals, from its units' results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..layout import Unit
from .model import IngestOptions, IngestResult, UnitResult, utf8


def _combine(run: str, ingest_id: str, results: list[UnitResult]) -> IngestResult:
    first = next((r.first_error for r in results if r.first_error), None)
    return IngestResult(
        run,
        ingest_id,
        len(results),
        sum(r.records for r in results),
        sum(r.rows for r in results),
        sum(r.tensors for r in results),
        sum(r.tensor_files for r in results),
        sum(r.errors for r in results),
        first,
        sorted({r.step for r in results}),
        sorted({r.rank for r in results}),
    )


def _catalog_row(
    run: str,
    ingest_id: str,
    path,
    units: list[Unit],
    results: list[UnitResult],
    total: IngestResult,
    opts: IngestOptions,
) -> dict[str, Any]:
    from datetime import datetime, timezone

    from .. import __version__
    from ..schema import SCHEMA_VERSION

    metas = [r.meta for r in results if r.meta]

    def joined(key: str, default: str) -> str:
        vals = sorted({utf8(str(m[key])) for m in metas if m.get(key)})
        return ",".join(vals) if vals else default

    task = joined("task", "files" if all(u.kind == "files" for u in units) else "")
    return {
        "run": run,
        "ingest_id": ingest_id,
        "schema_version": SCHEMA_VERSION,
        "source_path": utf8(str(Path(path).resolve())),
        "framework": joined("framework", "files"),
        "task": task,
        "level": joined("level", ""),
        "dump_mode": _dump_mode(task, metas),
        "generation": _generation(metas),
        "steps": total.steps,
        "ranks": total.ranks,
        "n_files": sum(r.files for r in results) + total.tensor_files,
        "n_records": total.records,
        "n_rows": total.rows,
        "n_tensors": total.tensors,
        "n_tensor_files": total.tensor_files,
        "n_errors": total.errors,
        "sample_k": opts.sample_k,
        "sketch_m": opts.sketch_m,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dumpstore_version": __version__,
    }


def _dump_mode(task: str, metas: list[dict[str, Any]]) -> str:
    """msprobe's compare mode: tensor, md5 (CRC-32), xor, statistics; 'files' for plain tensor folders."""
    if task in ("files", "tensor"):
        return task
    kinds = {m["checksum"] for m in metas if m.get("checksum")}
    if kinds:
        return "md5" if kinds == {"crc32"} else ",".join(sorted(kinds))
    return "statistics" if task else ""


def _generation(metas: list[dict[str, Any]]) -> str:
    if not any(m.get("task") for m in metas):
        return ""
    return "8.x" if any(m.get("generation") == "8.x" for m in metas) else "26.x"

"""msprobe monitor's own anomaly alarms: `{output}/anomaly_detected/rank{r}/anomaly.json`, read into the
`monitor_anomalies` table.

TrainerMon writes it when its config has `"alert": {"rules": [...], "dump": true}`: one JSON object, a key per
alarm (`<tag_name>_step_<s>_call_<c>`: a later alarm of the same tensor, step and call replaces an earlier one)
and a value per alarm: rank, step, micro_step, pp_stage, vpp_stage, call_id, tag_name
(`<vpp>:<name>[:<micro>]/rank<r>/<kind>`, kind actv, actv_grad, pre_grad / acc_grad (the gradient before the
all-reduce), post_grad, param_origin, param_updated, exp_avg, exp_avg_sq), message (`Rule <rule> reports anomaly
signal in ('<tag_name>', '<stat>') at step <s>, current value <v>, history mean <m>.`), group_mates.
The table: rank, step, micro_step, vpp_stage, pp_stage, call_id, prefix (the CSV prefix of that tensor, so an
alarm joins the `monitor` rows: grad_unreduced, grad_reduced, actv, ...), name (as in the CSV), stat, rule, value,
history (the rule's running mean of |x|), tag, message; in msprobe's own order (step, micro step, train stage:
forward, backward, optimizer; call id).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import DumpstoreError
from .walk import Listing, sorted_paths, walk

FILE = "anomaly.json"
SCHEMA = pa.schema(
    [(c, pa.int64()) for c in ("rank", "step", "micro_step", "vpp_stage", "pp_stage", "call_id")]
    + [(c, pa.string()) for c in ("prefix", "name", "stat", "rule")]
    + [("value", pa.float64()), ("history", pa.float64()), ("tag", pa.string()), ("message", pa.string())]
)
# the kind at the end of a tag name -> the CSV prefix its statistics are written under
KIND_PREFIX = {
    "actv": "actv",
    "actv_grad": "actv_grad",
    "pre_grad": "grad_unreduced",
    "acc_grad": "grad_unreduced",
    "post_grad": "grad_reduced",
    "param_origin": "param_origin",
    "param_updated": "param_updated",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
}
_STAGE = {"actv": 0, "actv_grad": 1, "pre_grad": 1, "acc_grad": 1, "post_grad": 1, "exp_avg": 2, "exp_avg_sq": 2}
_RANK_DIR = re.compile(r"^rank(\d+)$")
_MESSAGE = re.compile(
    r"Rule (?P<rule>\w+) reports anomaly signal in \('(?P<tag>[^']*)', '(?P<stat>[^']*)'\) at step -?\d+, "
    r"current value (?P<value>\S+), history mean (?P<history>[^\s,]+?)\.?$"
)


class AnomalyFileError(DumpstoreError):
    """An anomaly.json that is not msprobe's."""


def anomaly_files(root: Path, listing: Listing | None = None) -> list[tuple[Path, int]]:
    """(file, rank) of each `rank<r>/anomaly.json` under `root` (a monitor output folder, its anomaly_detected
    folder, or the file; `listing`: its walk.walk when made)."""
    if root.is_file():
        paths = [root]
    else:
        paths = sorted_paths([f for f in (walk(root) if listing is None else listing) if f[1] == FILE])
    out = []
    for p in paths:
        m = _RANK_DIR.match(p.parent.name)
        if p.name == FILE and m:
            out.append((p, int(m.group(1))))
    return out


def read_anomalies(files: list[tuple[Path, int]]) -> pa.Table:
    """The alarms of the given anomaly.json files as one table of SCHEMA, in msprobe's order."""
    rows: list[dict[str, Any]] = []
    for path, rank in files:
        rows += _read(path, rank)
    rows.sort(key=_order)
    for r in rows:
        r.pop("_stage")
    return pa.Table.from_pylist(rows, SCHEMA)


def _read(path: Path, rank: int) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_bytes())
    except OSError as exc:
        raise AnomalyFileError(f"{path}: cannot read ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise AnomalyFileError(
            f"{path}: not JSON ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); msprobe monitor "
            "writes anomaly.json as one object; regenerate it or remove it"
        ) from None
    if not isinstance(doc, dict):
        raise AnomalyFileError(f"{path}: not msprobe's anomaly.json (a JSON object of alarms); remove it")
    out = []
    for key, rec in doc.items():
        if not isinstance(rec, dict) or not isinstance(rec.get("tag_name"), str) or not _is_int(rec.get("step")):
            raise AnomalyFileError(
                f"{path}: alarm {str(key)[:80]!r} has no tag_name and integer step; not msprobe's anomaly.json "
                "(regenerate it or remove it)"
            )
        tag = rec["tag_name"]
        head, _, rest = tag.partition("/")
        kind = rest.rsplit("/", 1)[-1] if rest else ""
        parts = head.split(":")
        vpp, name, micro = None, head, None
        if len(parts) >= 2 and parts[0].lstrip("-").isdigit():
            vpp, name = int(parts[0]), parts[1]
            if len(parts) >= 3 and parts[2].isdigit():
                micro = int(parts[2])
        msg = rec["message"] if isinstance(rec.get("message"), str) else ""
        m = _MESSAGE.search(msg)
        out.append(
            {
                "rank": rec["rank"] if _is_int(rec.get("rank")) else rank,
                "step": rec["step"],
                "micro_step": rec["micro_step"] if _is_int(rec.get("micro_step")) else micro,
                "vpp_stage": rec["vpp_stage"] if _is_int(rec.get("vpp_stage")) else vpp,
                "pp_stage": rec["pp_stage"] if _is_int(rec.get("pp_stage")) else None,
                "call_id": rec["call_id"] if _is_int(rec.get("call_id")) else None,
                "prefix": KIND_PREFIX.get(kind, kind or None),
                "name": name,
                "stat": m.group("stat") if m else None,
                "rule": m.group("rule") if m else None,
                "value": _float(m.group("value")) if m else None,
                "history": _float(m.group("history")) if m else None,
                "tag": tag,
                "message": msg,
                "_stage": _STAGE.get(kind, 3),
            }
        )
    return out


def _order(r: dict[str, Any]) -> tuple:
    """msprobe's GradAnomalyData order: step, micro step, train stage, vpp and pp (ascending forward, descending
    after), call id."""
    sign = 1 if r["_stage"] == 0 else -1
    return (
        r["step"],
        r["micro_step"] or 0,
        r["_stage"],
        sign * (r["vpp_stage"] or 0),
        sign * (r["pp_stage"] or 0),
        r["call_id"] if r["call_id"] is not None else -1,
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None

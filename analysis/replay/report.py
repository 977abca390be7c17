"""The replay table in the shape of msprobe acc_check's two CSVs.

- result (`accuracy_checking_result_*.csv`, columns of `compare/compare.py::Comparator.write_csv_title`): one row per
  API call, `API name` as acc_check names it (`Functional.gelu.0`), `Forward Test Success` and `Backward Test
  Success` (pass / error / SKIP, or a space when the call has no backward record), `Message` (the first failure's
  reason, or why the call was skipped);
- details (`accuracy_checking_details_*.csv`, columns of `compare/compare_utils.py::DETAIL_TEST_ROWS`): one row per
  replayed output (`Functional.gelu.0.forward.output.0`, `.backward.output.<i>` for gradients). "Bench" is the
  float64 replay on the CPU, "DEVICE" the run's recorded output; Status is replay's verdict, Message the standard
  and the deciding ratio, or the reason. Columns replay does not compute are empty.
"""

from __future__ import annotations

import csv
import math
import os
from typing import Any

import polars as pl

from dumpstore import csvsafe

ACC_CHECK_COLUMNS = [
    "API Name",
    "Bench Dtype",
    "DEVICE Dtype",
    "Shape",
    "余弦相似度",
    "最大绝对误差",
    "双百指标",
    "双千指标",
    "双万指标",
    "二进制一致错误率",
    "误差均衡性",
    "均方根误差",
    "小值域错误占比",
    "相对误差最大值",
    "相对误差平均值",
    "inf/nan错误率",
    "相对误差错误率",
    "绝对误差错误率",
    "ULP误差最大值",
    "ULP误差平均值",
    "ULP误差大于阈值占比",
    "Status",
    "Message",
]
_FROM = {
    "余弦相似度": "cosine",
    "最大绝对误差": "max_abs_err",
    "二进制一致错误率": "error_rate",
    "误差均衡性": "eb",
    "均方根误差": "rmse",
    "小值域错误占比": "small_value_err",
    "相对误差最大值": "max_rel_err",
    "相对误差平均值": "mean_rel_err",
}
RESULT_COLUMNS = ["API name", "Forward Test Success", "Backward Test Success", "Message"]
_STATUS = {"pass": "pass", "fail": "error", "skipped": "SKIP", "error": "error", "no_standard": "SKIP"}
_RANK = {"SKIP": 0, "pass": 1, "error": 2}


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.14f}" if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    return v


def _api_name(record: str) -> str:
    return record.rsplit(".", 1)[0]  # Functional.gelu.0.forward -> Functional.gelu.0


def acc_check_rows(df: pl.DataFrame) -> list[list[Any]]:
    """The details CSV's rows."""
    rows = []
    for r in df.filter(pl.col("output").is_not_null()).iter_rows(named=True):
        name = f"{_api_name(r['record'])}.{r['direction']}.output.{r['output']}"
        message = r["reason"] or (f"{r['standard']}: {r['metric']} ratio {r['ratio']:.3g}" if r["standard"] else "")
        base = {
            "API Name": name,
            "Bench Dtype": "torch.float64",
            "DEVICE Dtype": f"torch.{r['dtype']}",
            "Shape": str(tuple(r["shape"] or ())),
            "Status": _STATUS.get(r["status"], r["status"]),
            "Message": message,
        }
        rows.append([_cell(base[c]) if c in base else _cell(r.get(_FROM.get(c, ""))) for c in ACC_CHECK_COLUMNS])
    return rows


def result_rows(df: pl.DataFrame) -> list[list[Any]]:
    """The result CSV's rows: per call, the worst status of its forward and of its backward outputs."""
    calls: dict[str, dict[str, Any]] = {}
    for r in df.iter_rows(named=True):
        c = calls.setdefault(f"{r['step']}.{r['rank']}.{_api_name(r['record'])}", {"name": _api_name(r["record"])})
        status = _STATUS.get(r["status"], "error")
        prev = c.get(r["direction"])
        if prev is None or _RANK.get(status, 2) > _RANK.get(prev, 2):  # the worst of the call's outputs
            c[r["direction"]] = status
        if r["status"] != "pass" and r["reason"] and not c.get("message"):
            c["message"] = r["reason"]
    return [[c["name"], c.get("forward", " "), c.get("backward", " "), c.get("message", "")] for c in calls.values()]


def details_path(path: str | os.PathLike) -> str:
    """Where the details CSV goes beside the result CSV `path`: `result` in its name becomes `details`, else
    `_details` before the suffix."""
    head, name = os.path.split(os.fspath(path))
    stem, suffix = os.path.splitext(name)
    new = stem.replace("result", "details") if "result" in stem else f"{stem}_details"
    return os.path.join(head, new + (suffix or ".csv"))


def write_acc_check_csv(df: pl.DataFrame, path: str | os.PathLike) -> tuple[str, str]:
    """Write the result CSV at `path` and the details CSV beside it (`details_path`); returns both paths."""
    details = details_path(path)
    for where, columns, rows in (
        (path, RESULT_COLUMNS, result_rows(df)),
        (details, ACC_CHECK_COLUMNS, acc_check_rows(df)),
    ):
        with open(where, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(columns)
            w.writerows(csvsafe.row(r) for r in rows)
    return os.fspath(path), details

"""The replay table in msprobe acc_check's details-CSV shape (`accuracy_checking_details_*.csv`).

Column names are those of msprobe 26.2.0 `api_accuracy_checker/compare/compare_utils.py::DETAIL_TEST_ROWS`. One
row per replayed output, named as acc_check names it (`<record prefix>.forward.output.<i>`). "Bench" is the
float64 replay on the CPU, "DEVICE" the run's recorded output; Status is replay's verdict (pass / error, or
skip), Message the standard and the deciding ratio. Columns replay does not compute are empty.
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
_STATUS = {"pass": "pass", "fail": "error", "skipped": "skip", "error": "error", "no_standard": "skip"}


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.14f}" if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    return v


def acc_check_rows(df: pl.DataFrame) -> list[list[Any]]:
    rows = []
    for r in df.filter(pl.col("output").is_not_null()).iter_rows(named=True):
        name = r["record"].rsplit(".forward", 1)[0] + f".forward.output.{r['output']}"
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


def write_acc_check_csv(df: pl.DataFrame, path: str | os.PathLike) -> int:
    """Write the details CSV; returns the number of rows."""
    rows = acc_check_rows(df)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(ACC_CHECK_COLUMNS)
        w.writerows(csvsafe.row(r) for r in rows)
    return len(rows)

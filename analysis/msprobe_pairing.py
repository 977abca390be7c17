"""msprobe 26.2.0's own pairing of NPU and bench rows, for the CSV's msprobe-named columns.

dumpstore pairs records by name, then by sequence where the names disagree (an extra or missing call renumbers
the later ones); `msprobe compare` (without -fm, a mapping or -cc; `core/compare/acc_compare.py`) pairs leaves by
a compare key instead:

  * each dump.json record `{op}.{n}.{forward|backward}` (API) or `{op}.{forward|backward}.{n}` (module) is split
    into its name without the call (`op`) and its call part; a record without `forward`/`backward` as its last or
    second-to-last part keeps its name (`parameters_grad`);
  * a backward record's call number(s) become its backward call order: how many backward records of the same
    `op` came before it in the dump (msprobe's `update_backward_call`); forward numbers stay as dumped;
  * the key is `op.{call part}` + the leaf's suffix (`.input.0`, `.output.0`, ...); an NPU leaf pairs with the
    bench leaf of the same key (an outer merge on the key), rows of the bench alone are dropped, and a pair whose
    dtypes differ (outside msprobe's float groups) is unmatched (`dtype_match`).

`msprobe_pairs` returns, for the rows whose msprobe pair is not dumpstore's, the row holding the bench leaf
msprobe pairs them with (or none); the CSV fills msprobe's columns from that pair and keeps dumpstore's own
columns (and `dumpstore_paired_with`) from its own pairing.  Only for two msprobe dumps of the same framework
compared without a mapping: with a mapping or across frameworks dumpstore's pairing is msprobe's mapped one.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dumpstore.names import CALL_DIRECTION_SQL, DIRECTION_CALL_SQL

GROUP = ["step", "rank", "source"]
# msprobe's CompareConst.DTYPE_MATCH_GROUPS: dtypes in one group pair with each other
_FLOAT_GROUPS = (
    frozenset(("Float16", "Float32", "Float64", "BFloat16")),
    frozenset(("torch.float16", "torch.float32", "torch.float64", "torch.bfloat16")),
)
_API = CALL_DIRECTION_SQL  # {op}.{n}.{direction}
_MODULE = DIRECTION_CALL_SQL  # {op}.{direction}.{n}


def applies(cmp, store) -> bool:
    """msprobe's default pairing is the one to reproduce: two msprobe dumps of one framework, no mapping."""
    if store is None:
        return False
    infos = [store.run_info(run) for run in (cmp.target, cmp.ref)]
    if any(not i.get("task") or i.get("framework") not in ("pytorch", "mindspore") for i in infos):
        return False
    if infos[0]["framework"] != infos[1]["framework"]:
        return False
    return "how" not in cmp.rows.columns or not (cmp.rows["how"] == "mapped").any()


def dtype_match(npu: str, bench: str) -> bool:
    """msprobe's gen_dtype_condition: equal dtype cells, or both in one of its float groups."""
    return npu == bench or any(npu in g and bench in g for g in _FLOAT_GROUPS)


def _keys(rows: pl.DataFrame, pre: str) -> pl.DataFrame:
    """(row index, step, rank, source, key) of every row holding a leaf on side `pre` ('' or 'ref_')."""
    rec, name, seq = f"{pre}record", f"{pre}name", f"{pre}seq"
    side = rows.select(
        pl.int_range(pl.len(), dtype=pl.Int64).alias("_row"),
        *GROUP,
        pl.col(rec).alias("rec"),
        pl.col(name).alias("nm"),
        pl.col(seq).alias("sq"),
    ).filter(pl.col("nm").is_not_null() & pl.col("rec").is_not_null())
    recs = side.group_by([*GROUP, "rec"]).agg(pl.col("sq").min()).sort([*GROUP, "sq"])
    api = pl.col("rec").str.extract_groups(_API)
    mod = pl.col("rec").str.extract_groups(_MODULE)
    recs = recs.with_columns(
        pl.coalesce(api.struct.field("1"), mod.struct.field("1")).alias("op"),
        pl.coalesce(api.struct.field("3"), mod.struct.field("2")).alias("dir"),
        api.struct.field("1").is_not_null().alias("is_api"),
    )
    backward = pl.col("dir") == "backward"
    order = pl.when(backward).then(backward.cast(pl.Int64).cum_sum().over([*GROUP, "op"]) - 1)
    recs = recs.with_columns(order.alias("bw"))
    call = pl.when(backward).then(pl.col("bw").cast(pl.String))
    key = (
        pl.when(pl.col("op").is_null())
        .then(pl.col("rec"))
        .when(pl.col("is_api"))
        .then(
            pl.concat_str(
                [pl.col("op"), call.otherwise(pl.col("rec").str.extract(_API, 2)), pl.col("dir")], separator="."
            )
        )
        .otherwise(
            pl.concat_str(
                [pl.col("op"), pl.col("dir"), call.otherwise(pl.col("rec").str.extract(_MODULE, 3))], separator="."
            )
        )
    )
    recs = recs.select([*GROUP, "rec", key.alias("rkey")])
    side = side.join(recs, on=[*GROUP, "rec"], how="left")
    suffix = pl.col("nm").str.slice(pl.col("rec").str.len_chars())
    return side.select("_row", *GROUP, pl.concat_str([pl.col("rkey"), suffix]).alias("key"))


def msprobe_pairs(rows: pl.DataFrame) -> dict[int, int | None]:
    """{row index: index of the row whose bench leaf msprobe pairs this row's NPU leaf with, None for none} for the
    rows (with an NPU leaf) where that differs from dumpstore's pairing (the row's own bench leaf)."""
    if rows.height == 0 or "record" not in rows.columns or "ref_record" not in rows.columns:
        return {}
    same = (pl.col("name") == pl.col("ref_name")) & (pl.col("seq") == pl.col("ref_seq"))
    if rows.select(same.fill_null(False).all()).item():
        return {}  # every leaf paired by name, the records in the same order: msprobe's keys are the same too
    t = _keys(rows, "")
    r = _keys(rows, "ref_").unique([*GROUP, "key"], keep="first").rename({"_row": "_ms"})
    own = rows.select(pl.col("ref_name").is_not_null().alias("_has")).with_row_index("_row")
    joined = (
        t.join(r, on=[*GROUP, "key"], how="left")
        .join(own.with_columns(pl.col("_row").cast(pl.Int64)), on="_row", how="left")
        .with_columns(pl.when(pl.col("_has")).then(pl.col("_row")).alias("_own"))
    )
    differ = joined.filter(~pl.col("_ms").eq_missing(pl.col("_own")))
    return dict(zip(differ["_row"].to_list(), differ["_ms"].to_list(), strict=True))


def repaired(r: dict[str, Any], bench: dict[str, Any] | None, pair_cols: tuple[str, ...]) -> dict[str, Any]:
    """Row `r` with its bench side (`ref_*`) replaced by `bench`'s (a row's `ref_*` values; None: no bench leaf)
    and its pair metrics (`pair_cols`) unknown: what msprobe's columns are filled from."""
    out = dict(r)
    for c in r:
        if c.startswith("ref_"):
            out[c] = bench.get(c) if bench is not None else None
    for c in pair_cols:
        if c in out:
            out[c] = None
    return out


def exact_cells(store, cmp, pairs: dict[int, int | None]) -> dict[int, dict[str, Any]]:
    """msprobe's six tensor-mode cells (`msprobe_cosine`, ...) of the msprobe pairs of `pairs` (row -> bench row),
    read from the two tensor files as `--exact` reads them; {} when the comparison holds no exact cells."""
    from .exact import MSPROBE_COLUMNS, add_exact_metrics

    both = {i: j for i, j in pairs.items() if j is not None}
    if not both or "msprobe_cosine" not in cmp.rows.columns:
        return {}
    rows = cmp.rows
    ref_cols = [c for c in rows.columns if c.startswith("ref_")]
    own = rows[list(both)].drop(ref_cols)
    bench = rows[list(both.values())].select(ref_cols)
    frame = add_exact_metrics(store, cmp.target, cmp.ref, pl.concat([own, bench], how="horizontal"), None, "", jobs=1)
    cols = list(MSPROBE_COLUMNS.values())
    return dict(zip(both, frame.select(cols).iter_rows(named=True), strict=True))

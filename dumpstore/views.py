"""Derived SQL views over `tensors` for watchpoints: parameters, weight change, gradients, loss, activations.

Created in every DuckDB connection of the store (`dumpstore.query.connect`), `dumpstore query` included:

  param_stats       one row per parameter per step, rank and source (the first call's `parameters` leaf of its
                    module record); `param` is the module path plus the parameter name (`layers.0.qkv.weight`)
  weight_change     param_stats between consecutive dumped steps: differences of the statistics and
                    `ratio_est`, an estimate (a lower bound) of ||w_t - w_prev|| / ||w_prev||: the statistics
                    bound of analysis/rules.py's `stats_bound` with w_prev as the reference (`stats_bound_sql`;
                    tests/test_one_home.py checks the two agree), NULL where ||w_prev|| is 0 or null;
                    `ratio_sketch` the same ratio from the linear sketches when both steps have tensor files
                    (exact when numel <= M, else within sqrt(2/M)); `unchanged` when all four statistics are
                    equal and finite
  grad_norms        parameter gradients (`kind` 'parameter', from parameters_grad records) and backward
                    outputs (`kind` 'backward') with their norms, per step, rank and `layer` (module path)
  layer_grad_norms  per step, rank and layer: sqrt(sum of squared parameter-gradient norms)
  loss              0-d forward outputs of loss ops (cross_entropy, nll_loss, mse_loss, CrossEntropyLoss, ...)
  activations       forward outputs (the optimizer's calls excluded) with their statistics
"""

from __future__ import annotations

from typing import Any

import duckdb

from .names import MODULE_PATH_SQL

LOSS_OPS = (
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "ctc_loss",
    "poisson_nll_loss",
    "gaussian_nll_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "multilabel_soft_margin_loss",
    "cosine_embedding_loss",
    "crossentropyloss",
    "nllloss",
    "mseloss",
    "l1loss",
    "smoothl1loss",
    "huberloss",
    "bceloss",
    "bcewithlogitsloss",
    "kldivloss",
    "ctcloss",
    "softmax_cross_entropy_with_logits",
    "softmaxcrossentropywithlogits",
    "sparse_softmax_cross_entropy_with_logits",
    "sparsesoftmaxcrossentropywithlogits",
)

# module path of a Module/Cell record: api minus its class name (layers.0.qkv.Linear -> layers.0.qkv)
MODULE_PATH = (
    "CASE WHEN op_type IS NOT NULL AND api LIKE '%.' || op_type "
    "THEN left(api, length(api) - length(op_type) - 1) ELSE api END"
)
# module path of the parent module record (Module.layers.0.fc1.Linear.forward.0 -> layers.0.fc1)
_PARENT_PATH = f"nullif(regexp_extract(module, {MODULE_PATH_SQL}, 1), '')"

PARAM_STATS = f"""
CREATE OR REPLACE VIEW param_stats AS
SELECT run, step, rank, source, seq, leaf, record, module_path, module_path || '.' || index_path AS param,
       name, dtype, shape, numel, min, max, mean, norm, has_nan, has_posinf, has_neginf, has_sat, checksum,
       sketch
FROM (
    SELECT *, {MODULE_PATH} AS module_path,
           row_number() OVER (PARTITION BY run, step, rank, source, {MODULE_PATH}, index_path
                              ORDER BY seq, leaf) AS call_rank
    FROM tensors
    WHERE io = 'parameters' AND kind = 'tensor'
)
WHERE call_rank = 1
"""


def stats_bound_sql(t: str, r: str, sqrt_n: str, nonfinite: str) -> str:
    """analysis/rules.py's `stats_bound` as a SQL expression (tested equal to it on a grid of null, NaN, +-Inf, 0
    and finite values): the lower bound of ||x - y|| / ||y|| from the statistics `{t}norm`, `{t}mean`, `{t}max`,
    `{t}min` of x and `{r}...` of y (column prefixes), `sqrt_n` and `nonfinite` (the non-finite flags differ).
    NULL where no rule applies (stats_bound's `known` false)."""

    def d(s: str) -> str:  # |x_s - y_s| where both are finite (else NULL: no difference known)
        return f"CASE WHEN isfinite({t}{s}) AND isfinite({r}{s}) THEN abs({t}{s} - {r}{s}) END"

    def v(s: str) -> str:  # a value, NaN as NULL (numpy's fmax passes over NaN as greatest passes over NULL)
        return f"CASE WHEN NOT isnan({r}{s}) THEN {r}{s} END"

    num = (
        f"greatest({d('norm')}, {d('max')}, {d('min')}, ({d('mean')}) * {sqrt_n}, "
        f"CASE WHEN NOT isfinite({t}norm) AND NOT {nonfinite} THEN 'inf'::DOUBLE END)"
    )
    ext = f"greatest({d('max')}, {d('min')}, {d('mean')})"  # an integer tensor's mean differing is a value differing
    scale = f"greatest(abs({v('max')}), abs({v('min')}))"
    same = " AND ".join(f"{t}{s} = {r}{s}" for s in ("norm", "mean", "max", "min"))  # NaN = NaN in DuckDB
    return f"""(CASE
        WHEN {t}norm IS NOT NULL AND {r}norm IS NOT NULL THEN (CASE
            WHEN isfinite({r}norm) AND ({num}) IS NOT NULL THEN (CASE
                WHEN {r}norm > 0 THEN ({num}) / {r}norm WHEN ({num}) = 0 THEN 0.0 ELSE 'inf'::DOUBLE END)
            WHEN NOT isfinite({r}norm) AND coalesce({same} AND isinf({t}max) AND {t}max = {t}min, false) THEN 0.0 END)
        WHEN {d("max")} IS NOT NULL AND {d("min")} IS NOT NULL THEN (CASE
            WHEN {scale} > 0 THEN ({ext}) / {scale} WHEN ({ext}) = 0 THEN 0.0 ELSE 'inf'::DOUBLE END)
    END)"""


_FLAGS = ("has_nan", "has_posinf", "has_neginf", "has_sat")
_NONFINITE_DIFFERS = "coalesce(" + " OR ".join(f"{f} <> prev_{f}" for f in _FLAGS) + ", false)"

WEIGHT_CHANGE = f"""
CREATE OR REPLACE VIEW weight_change AS
WITH p AS (
    SELECT *, lag(step) OVER w AS prev_step, lag(norm) OVER w AS prev_norm, lag(mean) OVER w AS prev_mean,
           lag(max) OVER w AS prev_max, lag(min) OVER w AS prev_min, lag(sketch) OVER w AS prev_sketch,
           {", ".join(f"lag({f}) OVER w AS prev_{f}" for f in _FLAGS)}
    FROM param_stats
    WINDOW w AS (PARTITION BY run, rank, source, param ORDER BY step)
)
SELECT run, step, prev_step, rank, source, seq, leaf, param, record, name, dtype, shape, numel, norm,
       prev_norm, norm - prev_norm AS d_norm, mean - prev_mean AS d_mean, max - prev_max AS d_max,
       min - prev_min AS d_min,
       CASE WHEN prev_norm <> 0 THEN
           {stats_bound_sql("", "prev_", "sqrt(coalesce(numel, 1))", _NONFINITE_DIFFERS)} END AS ratio_est,
       CASE WHEN len(sketch) > 0 AND len(sketch) = len(prev_sketch)
            THEN list_distance(sketch, prev_sketch) / nullif(prev_norm, 0) END AS ratio_sketch,
       coalesce(isfinite(norm) AND isfinite(max) AND isfinite(min) AND norm = prev_norm AND max = prev_max
                AND min = prev_min AND mean IS NOT DISTINCT FROM prev_mean, false) AS unchanged
FROM p
WHERE prev_step IS NOT NULL
"""

GRAD_NORMS = f"""
CREATE OR REPLACE VIEW grad_norms AS
SELECT run, step, rank, source, seq, leaf, 'parameter' AS kind, {MODULE_PATH} AS layer,
       {MODULE_PATH} || '.' || index_path AS tensor, record, name, dtype, shape, numel, norm, max, min, mean
FROM tensors
WHERE io = 'parameters_grad' AND kind = 'tensor'
UNION ALL
SELECT run, step, rank, source, seq, leaf, 'backward' AS kind,
       CASE WHEN prefix IN ('Module', 'Cell') THEN {MODULE_PATH} ELSE {_PARENT_PATH} END AS layer,
       name AS tensor, record, name, dtype, shape, numel, norm, max, min, mean
FROM tensors
WHERE direction = 'backward' AND io = 'output' AND kind = 'tensor'
"""

LAYER_GRAD_NORMS = """
CREATE OR REPLACE VIEW layer_grad_norms AS
SELECT run, step, rank, source, layer, count(*) AS n_params, sqrt(sum(norm * norm)) AS norm
FROM grad_norms
WHERE kind = 'parameter'
GROUP BY ALL
"""

LOSS = f"""
CREATE OR REPLACE VIEW loss AS
SELECT run, step, rank, source, seq, record, op_type, name, dtype, coalesce(mean, max) AS value,
       has_nan, has_posinf, has_neginf
FROM tensors
WHERE direction = 'forward' AND io = 'output' AND kind = 'tensor' AND len(shape) = 0
  AND lower(op_type) IN ({", ".join("'" + op + "'" for op in LOSS_OPS)})
"""

ACTIVATIONS = """
CREATE OR REPLACE VIEW activations AS
SELECT run, step, rank, source, seq, leaf, record, module, name, dtype, shape, numel, min, max, mean, norm,
       zero_count, has_nan, has_posinf, has_neginf, has_sat
FROM tensors
WHERE direction = 'forward' AND io = 'output' AND kind = 'tensor' AND coalesce(module, '') <> 'optimizer'
"""

VIEWS = (PARAM_STATS, WEIGHT_CHANGE, GRAD_NORMS, LAYER_GRAD_NORMS, LOSS, ACTIVATIONS)
VIEW_NAMES = ("param_stats", "weight_change", "grad_norms", "layer_grad_norms", "loss", "activations")


def partitioned_view(con: duckdb.DuckDBPyConnection, name: str, paths: list[str], empty: Any) -> None:
    """The view `name` over Parquet files laid out as `.../run=NAME/part-*.parquet` (with a `run` column), or an
    empty view of the pyarrow schema `empty` (with a `run` column) when there are none."""
    if paths:
        lst = "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"
        con.execute(
            f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM read_parquet({lst}, hive_partitioning=true, "
            "union_by_name=true, hive_types={'run': 'VARCHAR'})"
        )
    else:
        con.register(f"__empty_{name}", empty.empty_table())
        con.execute(
            f"CREATE OR REPLACE VIEW {name} AS SELECT CAST(NULL AS VARCHAR) AS run, * FROM __empty_{name} WHERE false"
        )


def create_views(con: duckdb.DuckDBPyConnection) -> None:
    """Create the derived views in `con` (which must already have the `tensors` view)."""
    for sql in VIEWS:
        con.execute(sql)

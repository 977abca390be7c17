"""Top-N mismatching leaves of a comparison by any metric, filterable by step, rank, direction, module, op type.

The default order is `significance`: a leaf's error relative to the noise the pair measured where it stands,
so that what merely carries earlier error, and rounding residue, does not top the list:
  output leaves   err / max(tol, the record's largest input error): error the op made, not the one it got
                  (backward records and records without inputs: also the error carried before them, which
                  the forward's saved tensors and parameters_grad's backward op hold);
  input leaves    err / max(tol, the largest output error of the records before it in its step and rank):
                  an input is significant when no earlier op showed that much error (a weight, data, an
                  argument, a tensor made by an op in one run only);
  ints and bools  differ (err > 0) where nothing before them did: inf; an integer or boolean output, any
                  tensor of another shape, or an output made from one, after float error (an index, a mask, the
                  tokens an expert got and what they make, downstream of it): 1, it carries; an integer input:
                  err / the carried error;
  gathers         an output of an op that copies values (embedding, gather, indexing) at its own dtype's
                  tolerance where that is finer than the run's compute floor (a copy is not autocast-noisy);
  one run only    a leaf in one run only (an extra or missing record, a keyword argument of one run): inf.
`tol` is the leaf's tolerance after the prior (analysis/prior.py) and any noise reference (`--noise-ref`).
Each step is judged on its own (the Ray engine ranks a step per task): compare `--step S` to rank one step.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dumpstore.dtypes import DISCRETE_DTYPES
from dumpstore.names import MODULE_PREFIXES

from .compare import Comparison
from .lone_precision import lone_records

METRICS = ("significance", "severity", "rel_l2", "max_abs_err", "max_rel_err", "cosine")
COLUMNS = [
    "step",
    "rank",
    "seq",
    "name",
    "dtype",
    "ref_dtype",
    "rel_l2",
    "err_source",
    "err_bound",
    "cosine",
    "max_abs_err",
    "tol",
    "tol_dtype",
    "severity",
    "significance",
    "status",
    "detail",
]


def rank_rows(
    cmp: Comparison,
    *,
    by: str = "significance",
    top: int | None = 20,
    direction: str | None = None,
    module: str | None = None,
    op_type: str | None = None,
    io: str | None = None,
    status: str | None = None,
    include_pass: bool = True,
    culprit: Any = None,
) -> pl.DataFrame:
    """Rows sorted worst first by `by` (cosine: lowest first); filters match substrings of module / op type.

    `culprit`: the verdict's culprit (a `Finding` or its dict); sorting by significance, its row comes first
    (`culprit_first`).  The comparison's `err` column (relative L2 error) is shown as `rel_l2`, its name in every
    output."""
    if by not in METRICS:
        from dumpstore.errors import DumpstoreError

        raise DumpstoreError(f"unknown metric {by!r}; choose one of {', '.join(METRICS)}")
    if top is not None and top < 0:
        from dumpstore.errors import DumpstoreError

        raise DumpstoreError(f"top {top} is negative: give the number of rows to show (0 or None: all)")
    rows = cmp.rows if "significance" in cmp.rows.columns else significance(cmp.rows)  # (Ray: the tasks')
    df = rows.with_columns(pl.coalesce(pl.col("name"), pl.col("ref_name")).alias("name"), pl.col("err").alias("rel_l2"))
    filters = []
    if direction:
        filters.append(pl.col("direction") == direction)
    if module:
        filters.append(
            pl.col("module").str.contains(module, literal=True) | pl.col("record").str.contains(module, literal=True)
        )
    if op_type:
        filters.append(pl.col("op_type").str.contains(op_type, literal=True))
    if io:
        filters.append(pl.col("io") == io)
    if status:
        filters.append(pl.col("status") == status)
    if not include_pass:
        filters.append(pl.col("status") != "pass")
    if filters:
        df = df.filter(*filters)
    df = df.filter(pl.col(by).is_not_null()) if by not in ("severity", "significance") else df
    df = df.sort(by, descending=by != "cosine", nulls_last=True, maintain_order=True)  # ties: execution order
    if by == "significance" and culprit is not None:
        df = culprit_first(df, culprit)
    cols = [c for c in COLUMNS if c in df.columns]
    return df.select(cols).head(top) if top else df.select(cols)


CULPRIT_NOTE = "the verdict's culprit"


def culprit_first(df: pl.DataFrame, culprit: Any) -> pl.DataFrame:
    """`df` (ranked rows) with the verdict's culprit's row moved first and `detail` saying so: the first row of
    its record (its most significant leaf).  The verdict weighs what a leaf's ratio
    cannot (a dtype or argument that differs, an update's size, the record graph): where it names an op, that
    op tops the list whatever its own error.  Unchanged when no row of the record is among `df`."""
    c = culprit if isinstance(culprit, dict) else vars(culprit)
    rec = pl.coalesce(pl.col("record"), pl.col("ref_record")) if "record" in df.columns else pl.col("name")
    at = (pl.col("step") == c.get("step")) & (pl.col("rank") == c.get("rank"))
    mine = (
        at & (rec == c.get("op")) if "record" in df.columns else at & pl.col("name").str.starts_with(f"{c.get('op')}.")
    )
    hits = df.with_row_index("_i").filter(mine.fill_null(False))
    if not hits.height:
        return df
    i = int(hits["_i"][0])
    row = df.slice(i, 1).with_columns(
        pl.concat_str([pl.lit(CULPRIT_NOTE), pl.col("detail")], separator="; ", ignore_nulls=True).alias("detail")
    )
    return pl.concat([row, df.slice(0, i), df.slice(i + 1)], how="vertical_relaxed")


# what `significance` reads of each leaf's record, joined onto its leaves and dropped from its answer (the
# record's `_inside` is joined too and stays in the answer)
_PER_RECORD = (
    "_in_err",
    "_in_unknown",
    "_before",
    "_in_shape",
    "_flipped",
    "_in_bound",
    "lone_tol",
    "_in_dtol",
    "_out_rms",
    "_after_choice",
)


def significance(rows: pl.DataFrame) -> pl.DataFrame:
    """`rows` with a `significance` column (see the module doc), in their own order."""
    from .order import INPUT_IO, OUTPUT_IO, with_phase

    group = ["step", "rank", "source"]
    key = group + ["_rec"]
    df = with_phase(
        rows.with_columns(
            pl.int_range(pl.len()).alias("_row"),
            pl.coalesce(pl.col("record"), pl.col("ref_record")).alias("_rec"),
            pl.coalesce(pl.col("seq"), pl.col("ref_seq")).alias("_seq"),
            pl.coalesce(pl.col("direction"), pl.col("ref_direction")).alias("_dir"),
            pl.coalesce(pl.col("io"), pl.col("ref_io")).alias("_io"),
        ),
        "_seq",
        "_dir",
    )
    is_out, is_in = pl.col("_io").is_in(OUTPUT_IO), pl.col("_io").is_in(INPUT_IO)
    tensor = pl.col("kind") == "tensor"
    finite = pl.col("err").is_finite()
    by_stats = (pl.col("err_source") == "stats") if "err_source" in df.columns else pl.lit(False)
    # a tensor holding a mask's fill (finfo.min, +-finfo.max: rules.small_value_scale) has the fill's norm: its
    # relative error says nothing of the rest of it
    filled = pl.col("ref_has_sat").fill_null(False) if "ref_has_sat" in df.columns else pl.lit(False)
    recs = (
        df.group_by(key)
        .agg(
            pl.col("_phase").first(),
            pl.col("_seq").min(),
            pl.col("err").filter(is_in & tensor & finite).max().alias("_in_err"),
            # an input whose error is not known (NaN, a non-finite part that differs, a mask's fill): nor is what
            # it carried in
            (is_in & tensor & (~finite.fill_null(False) | filled)).any().fill_null(False).alias("_in_unknown"),
            pl.col("err").filter(is_out & tensor & finite).max().alias("_out_err"),
            pl.col("detail").str.starts_with("shape").filter(is_in).any().fill_null(False).alias("_in_shape"),
            (
                is_out
                & (
                    (pl.col("tol_dtype").is_in(DISCRETE_DTYPES) & (pl.col("err") > 0))
                    | pl.col("detail").str.starts_with("shape").fill_null(False)
                )
            )
            .any()
            .fill_null(False)
            .alias("_discrete"),
            # a choice (an argmax, a top-k, a comparison) made from float inputs that differ, whose discrete
            # output is compared by statistics that agree (msprobe keeps an index's max and min: a flip hides)
            (is_out & tensor & pl.col("tol_dtype").is_in(DISCRETE_DTYPES) & by_stats & (pl.col("err") == 0))
            .any()
            .fill_null(False)
            .alias("_choice"),
            (is_in & tensor & ~pl.col("tol_dtype").is_in(DISCRETE_DTYPES) & (pl.col("err") > 0))
            .any()
            .fill_null(False)
            .alias("_in_differs"),
            (pl.col("err_source") == "stats").filter(is_in & tensor).all().fill_null(False).alias("_in_bound"),
            pl.col("tol").filter(is_out & tensor).max().alias("_out_tol"),
            _ref_rms().filter(is_out & tensor).max().alias("_out_rms"),
            # statistics of an input agree only to its dtype's rounding (msprobe keeps a bf16 tensor's in bf16)
            _dtype_tol_of("dtype").filter(is_in & tensor & by_stats).max().alias("_in_dtol"),
            *([pl.col("module").first().alias("_parent")] if "module" in df.columns else []),
        )
        .sort(group + ["_phase", "_seq"], nulls_last=True)
        .with_columns(
            pl.col("_out_err").fill_null(0.0).cum_max().shift(1).over(group).fill_null(0.0).alias("_before"),
            (pl.col("_discrete").cast(pl.Int32).cum_sum().shift(1).over(group).fill_null(0) > 0).alias("_flipped"),
            (
                (pl.col("_discrete") | (pl.col("_choice") & pl.col("_in_differs")))
                .cast(pl.Int32)
                .cum_sum()
                .shift(1)
                .over(group)
                .fill_null(0)
                > 0
            ).alias("_after_choice"),
        )
    )

    recs = recs.join(_inside(recs, group), on=key, how="left", nulls_equal=True)
    lone = lone_records(df, "_rec", "_io", "_dir").filter("lone_low").select(*key, "lone_tol")
    recs = recs.join(lone, on=key, how="left", nulls_equal=True)
    df = df.join(recs.select(*key, *_PER_RECORD, "_inside"), on=key, how="left", nulls_equal=True)
    module = _is_module()
    own_inputs = (
        is_out
        & pl.col("_in_err").is_not_null()
        & (pl.col("_dir") == "forward")
        & ~pl.col("_in_unknown").fill_null(False)
        # after a discrete change before it in its step (a routing choice), rows move between tokens in ways a
        # statistics bound of its inputs' error need not show (norm, mean, max, min kept)
        & ~(pl.col("_flipped") & pl.col("_in_bound")).fill_null(False)
    )
    carried = (
        pl.when(own_inputs & module)  # a module's output: also what the records inside it made (_inside)
        .then(pl.max_horizontal(pl.col("_in_err"), pl.col("_inside").fill_null(0.0)))
        .when(own_inputs)
        .then(pl.col("_in_err"))
        .when(is_out)  # backward (the forward's saved tensors), an input of unknown error, after a discrete change
        .then(pl.max_horizontal(pl.col("_in_err").fill_null(0.0), pl.col("_before")))
        .otherwise(pl.max_horizontal(pl.col("_before"), _sibling_inputs(is_in & tensor & finite)))
    )
    # one call lowered below its siblings' dtype (analysis/lone_precision.py): its outputs at their tolerance;
    # an op whose tensor inputs agree exactly made all of its error: at its own output dtype's tolerance
    exact_in = own_inputs & ~module & (pl.col("_in_err") == 0)
    own_tol = (
        pl.when(is_out & (pl.col("lone_tol") > 0))
        .then(pl.min_horizontal(_own_tol(), pl.col("lone_tol")))
        .when(exact_in)
        .then(pl.min_horizontal(_own_tol(), pl.max_horizontal(_dtype_tol(df.columns), pl.col("_in_dtol"))))
        .otherwise(_own_tol())
    )
    denom = pl.max_horizontal(own_tol, carried)
    one_run = pl.col("match").is_in(["target_only", "ref_only"])
    # a discrete change: an integer or boolean output, or a tensor of another shape (data-dependent shapes: the
    # tokens an expert got); after float error was carried it is that error's consequence
    discrete_out = (
        (is_out & pl.col("tol_dtype").is_in(DISCRETE_DTYPES))
        | pl.col("detail").str.starts_with("shape").fill_null(False)
        | (is_out & pl.col("_in_shape").fill_null(False))  # made from a tensor of another shape
    )
    err = _bias_err(_residue_err(df.columns), df.columns)
    carries_flip = is_in & pl.col("_after_choice").fill_null(False) & _whole_moved(df)
    sig = (
        pl.when(one_run)
        .then(float("inf"))  # a record, or an argument of one, in one run only
        .when(pl.col("err").is_null())
        .then(None)
        .when(discrete_out & ((carried > 0) | (pl.col("_before") > 0)) & (pl.col("err") > 0))
        .then(1.0)  # an index, mask or shape changed downstream of float error: carries it (no ratio means anything)
        .when(carries_flip)
        .then(1.0)  # whole numbers a flipped choice before it moved: carries the flip
        .when(is_out & carries_flip.any().over(key) & (err > 0) & ~(err / denom).is_finite().fill_null(False))
        .then(1.0)  # made from them, unbounded (an indicator's mean on a reference of zeros): carries it too
        .when(denom > 0)
        .then(err / denom)
        .when(err > 0)
        .then(float("inf"))
        .otherwise(0.0)
    )
    out = df.with_columns(sig.alias("significance")).sort("_row")
    return out.drop("_row", "_rec", "_seq", "_dir", "_io", "_phase", *_PER_RECORD)


def _inside(recs: pl.DataFrame, group: list[str]) -> pl.DataFrame:
    """Per module record (`_rec`), `_inside`: the largest output error of the records directly inside it (their
    `module` is it; msprobe dumps them before it) judged at its output's tolerance or finer.  A module's output is
    what they made: an MoE block after a routing flip inside it, a whole model's last hidden state.  An inner
    record judged at a coarser tolerance (a LayerNorm computed in bf16 inside an fp32 module: 0.06 of bf16's
    tolerance, 1.6 of fp32's at the module's output) does not explain it: the module's output shows what the
    coarser tolerance hides."""
    if "_parent" not in recs.columns:
        return recs.select(*group, "_rec", pl.lit(None, pl.Float64).alias("_inside")).head(0)
    children = recs.select(*group, pl.col("_parent").alias("_rec"), "_out_err", pl.col("_out_tol").alias("_ctol"))
    return (
        recs.select(*group, "_rec", "_out_tol")
        .join(children.drop_nulls("_rec"), on=[*group, "_rec"], how="inner", nulls_equal=True)
        .filter(pl.col("_ctol") <= pl.col("_out_tol"))
        .group_by([*group, "_rec"])
        .agg(pl.col("_out_err").max().alias("_inside"))
    )


RESIDUE_ROUNDINGS = 3.0  # noise.STAND_OUT: a reference within this many roundings of its record's scale is residue


def _residue_err(columns: list[str]) -> pl.Expr:
    """The error a leaf is ranked by: its relative error, except for residue (the module doc): a tensor whose
    reference RMS is within RESIDUE_ROUNDINGS x eps(judged dtype) of its record's scale (the largest reference
    RMS among the record's tensors, `context_rms` of rules.apply_small_values) is what rounding of that record
    leaves where the exact result is (near) zero, e.g. an attention key bias's gradient; its relative error
    means nothing, so it is ranked by its absolute error on the record's scale, ||x - y|| / (sqrt(n) x scale),
    as the small-value rule judges the tensors below one rounding."""
    from . import rules as R

    err = pl.col("err")
    if not {"context_rms", "ref_norm", "ref_numel", "kind", "tol_dtype"} <= set(columns):
        return err
    n = pl.col("ref_numel").cast(pl.Float64)
    rms = _ref_rms()
    ctx = pl.col("context_rms")
    eps = R.dtype_eps(pl.col("tol_dtype"))
    residue = (
        (pl.col("kind") == "tensor")
        & (pl.col("ref_norm") > 0)
        & (ctx > 0)
        & (rms < RESIDUE_ROUNDINGS * eps * ctx)
        & err.is_finite()
    ).fill_null(False)
    return pl.when(residue).then(err * pl.col("ref_norm") / (n.sqrt() * ctx)).otherwise(err)


def _whole_moved(df: pl.DataFrame) -> pl.Expr:
    """Whether a differing float leaf holds whole numbers in both runs, as its statistics show, that moved by
    no more than one flipped choice makes (analysis/flipflow.py `units_moved`: an accuracy indicator 1 -> 0,
    a token count moved between experts; made from an argmax or a mask by a cast msprobe does not record)."""
    from .flipflow import units_moved

    need = ["_row", "err", "tol_dtype", "numel", "ref_numel", "min", "max", "mean", "norm"]
    need += ["ref_min", "ref_max", "ref_mean", "ref_norm"]
    if not set(need) <= set(df.columns):
        return pl.lit(False)
    whole = [(pl.col(c) == pl.col(c).round()) for c in ("min", "max", "ref_min", "ref_max")]
    cand = df.filter((pl.col("err") > 0) & ~pl.col("tol_dtype").is_in(DISCRETE_DTYPES).fill_null(False), *whole).select(
        need
    )
    rows = [r["_row"] for r in cand.iter_rows(named=True) if units_moved(r) is not None]
    return pl.col("_row").is_in(rows).fill_null(False)


def _is_module() -> pl.Expr:
    """Whether a row's record is a module's or a cell's (its `prefix`); false where unknown."""
    return pl.col("prefix").is_in(list(MODULE_PREFIXES)).fill_null(False)


def _ref_rms() -> pl.Expr:
    """The reference's RMS of a tensor leaf (its norm over the square root of its element count)."""
    return pl.col("ref_norm") / pl.col("ref_numel").cast(pl.Float64).sqrt()


def _bias_position() -> dict[str, str]:
    """Per op type, the position msprobe records an op's bias at (`input.N`, analysis/arguments.py's
    signatures: linear, conv, the norms), its keyword `bias`, and a module's `parameters.bias`."""
    from .arguments import SIGNATURES

    return {op: str(sig.index("bias")) for op, sig in SIGNATURES.items() if "bias" in sig}


def _bias_err(err: pl.Expr, columns: list[str]) -> pl.Expr:
    """The error a bias is ranked by: the error it adds to its record's output, ||b - b'|| / ||b|| x RMS(b) /
    RMS(output) (a bias is added to every row of the output: its difference is the output's, on the output's
    scale), where that is below its own relative error.  A bias the output does not need (an attention key
    bias: softmax is invariant to it; its gradient is rounding residue that Adam scales to full-size updates)
    differs between runs at every step after the first while it moves the output by far less than a
    rounding; a corrupted bias moves the output by its whole difference, and ranks by it."""
    if not {"index_path", "op_type", "prefix", "ref_norm", "ref_numel"} <= set(columns):
        return err
    pos = _bias_position()
    op = pl.col("op_type").str.to_lowercase()
    module = _is_module()
    idx = pl.col("index_path")
    bias = (
        (pl.col("kind") == "tensor")
        & (pl.col("_dir") == "forward")
        & pl.when(module)
        .then((pl.col("_io") == "parameters") & (idx == "bias"))
        .otherwise((pl.col("_io") == "input") & ((idx == "bias") | (idx == op.replace_strict(pos, default=None))))
    ).fill_null(False)
    effect = err * _ref_rms() / pl.col("_out_rms")
    usable = bias & (pl.col("_out_rms") > 0) & effect.is_finite()
    return pl.when(usable).then(pl.min_horizontal(err, effect)).otherwise(err)


SIBLING_Q = 0.75  # noise.SIBLING_Q: the quantile of the siblings' error an input is measured against ...
MIN_SIBLINGS = 3  # ... of at least noise.MIN_SIBLINGS of them


def _sibling_inputs(known: pl.Expr) -> pl.Expr:
    """The error an input leaf's siblings show: the SIBLING_Q quantile of the errors of the same input of the
    same op type and direction at the same step and rank (itself included; a linear's weight against every
    linear's weight, a norm's bias against every norm's bias), 0 with fewer than MIN_SIBLINGS.  After an update
    the optimizer carries noise into every parameter (Adam scales a noisy gradient to a full step); a fault in
    one parameter stands out of its kind, the optimizer's noise does not."""
    kind = ["step", "rank", "_dir", "_io", "op_type", "index_path"]
    errs = pl.when(known).then(pl.col("err"))
    q = errs.quantile(SIBLING_Q, interpolation="lower").over(kind)
    n = errs.count().over(kind)
    return pl.when(n > MIN_SIBLINGS).then(q).otherwise(0.0).fill_null(0.0)


def _own_tol() -> pl.Expr:
    """The leaf's tolerance; a leaf of a gather-class op's forward (embedding, gather, index_select, indexing: it
    copies values and does no arithmetic) at its own dtype's tolerance where that is finer (a bf16 autocast run's
    compute floor does not make a copy noisy: analysis/hidden_index.py)."""
    from .hidden_index import GATHERS
    from .tolerance import REL_L2_DEFAULT

    tol = pl.col("tol").fill_null(0.0)
    module = _is_module()
    forward = (pl.col("_dir") == "forward").fill_null(False)  # (an embedding's backward sums gradients)
    gather = pl.col("op_type").str.to_lowercase().is_in(list(GATHERS)).fill_null(False) & ~module & forward
    own = pl.col("dtype").replace_strict(REL_L2_DEFAULT, default=None, return_dtype=pl.Float64)
    return pl.when(gather & own.is_not_null() & (own < tol)).then(own).otherwise(tol)


def _dtype_tol_of(col: str) -> pl.Expr:
    """tolerance.REL_L2_DEFAULT of the dtype in `col` (null for others)."""
    from .tolerance import REL_L2_DEFAULT

    return pl.col(col).replace_strict(REL_L2_DEFAULT, default=None, return_dtype=pl.Float64)


def _dtype_tol(columns: list[str]) -> pl.Expr:
    """The tolerance of the leaf's own float dtypes (tolerance.REL_L2_DEFAULT; the coarser of the two runs': a
    softmax output in float32 where the reference's is bfloat16 carries bfloat16's rounding), where it is judged
    at another float dtype (a float32 tensor of a bfloat16-autocast run: the run's compute floor); else its
    tolerance.  A class's inferred precision (`tf32`: matmuls with 10-bit-mantissa inputs) is kept."""
    from dumpstore.dtypes import FLOAT_DTYPES

    of = _dtype_tol_of
    ref = "ref_dtype" if "ref_dtype" in columns else "dtype"  # (hand-made rows may lack the reference's)
    own = pl.max_horizontal(of("dtype"), of(ref))
    both = of("dtype").is_not_null() & of(ref).is_not_null()
    storage = pl.col("tol_dtype").is_in(list(FLOAT_DTYPES)).fill_null(False)
    return pl.when(storage & both).then(own).otherwise(pl.col("tol").fill_null(0.0))


def _module_filter(module: str) -> pl.Expr:
    return pl.col("module").str.contains(module, literal=True) | pl.col("record").str.contains(module, literal=True)


def check_filters(cmp: Comparison, *, module: str | None = None, op_type: str | None = None) -> None:
    """A --module or --op-type that matches no row of the comparison is an error listing what exists (never an
    empty table that reads as 'no mismatch')."""
    from dumpstore.errors import SelectionError

    rows = cmp.rows
    for flag, value, expr, column in (
        ("--module", module, _module_filter, "module"),
        ("--op-type", op_type, lambda v: pl.col("op_type").str.contains(v, literal=True), "op_type"),
    ):
        if not value or column not in rows.columns or rows.filter(expr(value)).height:
            continue
        known = rows.select(pl.col(column).drop_nulls().unique().sort()).to_series().to_list()
        shown = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20 else "")
        raise SelectionError(
            f"{flag} {value!r} matches nothing in this comparison ({column} values: {shown or 'none'})"
        )

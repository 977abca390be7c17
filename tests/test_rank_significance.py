"""analysis/rank.py: significance in units of each tensor's expected noise, pinned on hand-made rows."""

from __future__ import annotations

import polars as pl
import pytest

from dumpstore.analysis.rank import culprit_first, significance

TOL = 2.0**-13


def _rows(rows: list[dict]) -> pl.DataFrame:
    """Compared rows with the columns significance reads; each dict gives record, seq, io, err and any other."""
    base = {
        "step": 1,
        "rank": 0,
        "source": None,
        "direction": "forward",
        "prefix": "Functional",
        "op_type": "linear",
        "index_path": "0",
        "kind": "tensor",
        "match": "both",
        "detail": None,
        "tol": TOL,
        "tol_dtype": "float32",
        "dtype": "float32",
        "ref_has_sat": False,
        "ref_norm": 1.0,
        "ref_numel": 16,
        "context_rms": 0.25,
        "err_source": "stats",
    }
    out = []
    for r in rows:
        d = {**base, **r}
        d["name"] = f"{d['record']}.{d['io']}.{d['index_path']}"
        out.append(d)
    df = pl.DataFrame(out, infer_schema_length=None)
    if "module" not in df.columns:
        df = df.with_columns(pl.lit(None, pl.String).alias("module"))
    return df.with_columns(
        pl.col("module").cast(pl.String),
        pl.col("detail").cast(pl.String),
        pl.col("source").cast(pl.String),
        pl.lit(None, pl.String).alias("ref_record"),
        pl.lit(None, pl.Int64).alias("ref_seq"),
        pl.lit(None, pl.String).alias("ref_direction"),
        pl.lit(None, pl.String).alias("ref_io"),
        pl.lit(None, pl.String).alias("ref_name"),
    )


def _sig(df: pl.DataFrame) -> dict[str, float]:
    return dict(zip(*significance(df).select("name", "significance")))


def test_an_input_is_measured_against_its_siblings_after_an_update():
    """Five linear weights at step 1: four carry the optimizer's noise (1e-2), one stands out (0.2); the 0.75
    quantile of the five (lower) is 1e-2: the noisy ones rank 1, the outlier 20."""
    errs = [0.01, 0.01, 0.01, 0.01, 0.2]
    rows = [
        {"record": f"Functional.linear.{i}.forward", "seq": i, "io": "input", "index_path": "1", "err": e}
        for i, e in enumerate(errs)
    ]
    sig = _sig(_rows(rows))
    assert [sig[f"Functional.linear.{i}.forward.input.1"] for i in range(5)] == pytest.approx([1, 1, 1, 1, 20])


def test_three_siblings_are_too_few():
    rows = [
        {"record": f"Functional.linear.{i}.forward", "seq": i, "io": "input", "index_path": "1", "err": 0.01}
        for i in range(3)
    ]
    assert list(_sig(_rows(rows)).values()) == pytest.approx([0.01 / TOL] * 3)


def test_residue_is_ranked_on_its_records_scale():
    """A key bias's gradient (reference RMS 1e-9 / 4, within 3 float32 roundings of its record's scale 0.25)
    at relative error 1800: ranked by ||x - y|| / (sqrt(n) x scale) = 1800 x 1e-9 / (4 x 0.25)."""
    rows = [
        {"record": "Module.k.Linear.parameters_grad.0", "seq": 5, "direction": "parameters_grad", "prefix": "Module"}
        | {"io": "parameters_grad", "index_path": "bias", "err": 1800.0, "ref_norm": 1e-9},
        {"record": "Module.k.Linear.parameters_grad.0", "seq": 5, "direction": "parameters_grad", "prefix": "Module"}
        | {"io": "parameters_grad", "index_path": "weight", "err": 1e-5, "ref_norm": 4.0},
    ]
    sig = _sig(_rows(rows))
    assert sig["Module.k.Linear.parameters_grad.0.parameters_grad.bias"] == pytest.approx(1800 * 1e-9 / 1.0 / TOL)
    assert sig["Module.k.Linear.parameters_grad.0.parameters_grad.weight"] == pytest.approx(1e-5 / TOL)


def test_a_module_output_is_measured_against_the_records_inside_it():
    """An MoE block's inputs agree; a routing flip inside it makes 0.2 at an expert (dumped before the block):
    the block's output carries it (significance 1), it does not top the list at 0.2 / tol.  An inner record
    judged at a coarser tolerance (bf16 inside an fp32 module) does not explain the module's output."""
    block = "Module.m.Block.forward.0"
    rows = [
        {"record": "Functional.linear.3.forward", "seq": 3, "io": "input", "err": 0.0, "module": block},
        {"record": "Functional.linear.3.forward", "seq": 3, "io": "output", "err": 0.2, "module": block},
        {"record": block, "seq": 4, "io": "input", "prefix": "Module", "err": 0.0, "module": None},
        {"record": block, "seq": 4, "io": "output", "prefix": "Module", "err": 0.2, "module": None},
    ]
    rows = [{**r, "err_source": "exact"} for r in rows]
    assert _sig(_rows(rows))[f"{block}.output.0"] == pytest.approx(1.0)
    coarse = [{**r, "tol": 2.0**-6} if r["record"].startswith("Functional") else r for r in rows]
    assert _sig(_rows(coarse))[f"{block}.output.0"] == pytest.approx(0.2 / TOL)


def test_an_input_holding_a_masks_fill_says_nothing_of_what_was_carried():
    """softmax after where(mask, finfo.min, x): the input's norm is the fill's (relative error 1e-40); the
    output is measured against the error carried before it (0.3 at the scores), not against the tolerance."""
    rows = [
        {"record": "Tensor.matmul.0.forward", "seq": 1, "io": "output", "err": 0.3},
        {"record": "Functional.softmax.0.forward", "seq": 2, "io": "input", "err": 1e-40, "ref_has_sat": True},
        {"record": "Functional.softmax.0.forward", "seq": 2, "io": "output", "err": 0.1},
    ]
    sig = _sig(_rows(rows))
    assert sig["Functional.softmax.0.forward.output.0"] == pytest.approx(0.1 / 0.3)


def test_the_verdicts_culprit_comes_first_with_a_note():
    df = _rows(
        [
            {"record": "Functional.gelu.0.forward", "seq": 1, "io": "output", "err": 0.5},
            {"record": "Tensor.pow.3.forward", "seq": 2, "io": "input", "err": 1e-4},
            {"record": "Tensor.pow.3.forward", "seq": 2, "io": "output", "err": 2e-4},
        ]
    )
    culprit = {"step": 1, "rank": 0, "op": "Tensor.pow.3.forward", "name": "Tensor.pow.3.forward.input.0"}
    out = culprit_first(df, culprit)
    assert out["name"].to_list() == [
        "Tensor.pow.3.forward.input.0",
        "Functional.gelu.0.forward.output.0",
        "Tensor.pow.3.forward.output.0",
    ]
    assert out["detail"][0] == "the verdict's culprit"
    assert culprit_first(df, {**culprit, "step": 2}).equals(df)  # another step: unchanged


def test_after_a_discrete_change_an_output_carries_the_error_before_it():
    """A near-tie routing flip (an index output that differs) moves tokens between experts; a later mean's
    input, bounded from statistics at 7e-6, does not show it, its output differs by 0.0167: measured against
    the largest error before it in its step (the index's 0.33), not against the tolerance (137 before this rule)."""
    rows = [
        {"record": "Torch.topk.0.forward", "seq": 1, "io": "input", "err": 1.6e-5},
        {"record": "Torch.topk.0.forward", "seq": 1, "io": "output", "index_path": "1", "err": 0.33}
        | {"tol_dtype": "int64", "dtype": "int64", "tol": 0.0},
        {"record": "Functional.linear.2.forward", "seq": 2, "io": "input", "err": 1e-5},
        {"record": "Functional.linear.2.forward", "seq": 2, "io": "output", "err": 0.2},
        {"record": "Tensor.mean.0.forward", "seq": 3, "io": "input", "err": 7e-6},
        {"record": "Tensor.mean.0.forward", "seq": 3, "io": "output", "err": 0.0167},
    ]
    sig = _sig(_rows(rows))
    assert sig["Tensor.mean.0.forward.output.0"] == pytest.approx(0.0167 / 0.33)
    # exact input errors (tensor mode) show the moved rows: the op is measured against them
    exact = _sig(_rows([{**r, "err_source": "exact"} for r in rows]))
    assert exact["Tensor.mean.0.forward.output.0"] == pytest.approx(0.0167 / TOL)  # 7e-6 is under the tolerance


def test_the_reports_table_is_in_compares_order():
    """The report's table of every row (analysis/report/rows.py): the verdict's culprit first, then by
    significance (not by severity: the noisy weight at 20 tolerances comes after the op at 8 on agreeing inputs)."""
    from dumpstore.analysis.report.figures import prepared
    from dumpstore.analysis.report.rows import table_data

    rows = [
        {"record": f"Functional.linear.{i}.forward", "seq": i, "io": "input", "index_path": "1", "err": e}
        for i, e in enumerate([20 * TOL, 20 * TOL, 20 * TOL, 20 * TOL])
    ] + [
        {"record": "Functional.gelu.0.forward", "seq": 5, "io": "input", "err": 0.0},
        {"record": "Functional.gelu.0.forward", "seq": 5, "io": "output", "err": 8 * TOL},
        {"record": "Tensor.pow.0.forward", "seq": 6, "io": "output", "err": 0.0},
    ]
    df = _rows(rows).with_columns(
        pl.lit("pass").alias("status"),
        pl.lit(None, pl.String).alias("ref_module"),
        pl.lit(None, pl.String).alias("ref_op_type"),
        pl.lit(None, pl.String).alias("ref_dtype"),
        pl.lit(None, pl.List(pl.Int64)).alias("shape"),
        pl.lit(None, pl.List(pl.Int64)).alias("ref_shape"),
        (pl.col("err") / pl.col("tol")).alias("severity"),
    )
    table = table_data(prepared(significance(df)), {"step": 1, "rank": 0, "op": "Tensor.pow.0.forward"})
    ops = [table["dicts"]["op"][i] for i in table["cols"]["op"]]
    assert ops[:3] == ["Tensor.pow.0.forward", "Functional.gelu.0.forward", "Functional.linear.0.forward"]


def _linear_with_bias(bias: dict, *, module: bool = False) -> list[dict]:
    """A linear whose output has reference RMS 1 (norm 4 over 16 elements) and whose input and weight agree to
    1e-8; `bias` overrides its bias leaf (reference RMS 1e-6: norm 4e-6 over 16)."""
    rec = "Module.k_proj.Linear.forward.0" if module else "Functional.linear.7.forward"
    pre = {"prefix": "Module", "op_type": "Linear"} if module else {}
    return [
        {"record": rec, "seq": 1, "io": "input", "index_path": "0", "err": 1e-8, "ref_norm": 4.0} | pre,
        {"record": rec, "seq": 1, "io": "parameters" if module else "input", "index_path": "weight" if module else "1"}
        | {"err": 1e-8, "ref_norm": 4.0}
        | pre,
        {"record": rec, "seq": 1, "io": "parameters" if module else "input", "index_path": "bias" if module else "2"}
        | {"ref_norm": 4e-6}
        | pre
        | bias,
        {"record": rec, "seq": 1, "io": "output", "index_path": "0", "err": 1e-8, "ref_norm": 4.0} | pre,
    ]


def test_a_bias_is_ranked_by_what_it_adds_to_the_output():
    """An attention key bias Adam moved from a residue gradient (the clean combinations' vit_fp32_N at step 2:
    relative error 0.27, RMS 1e-6 against its output's RMS 1): it adds 0.27 x 1e-6 / 1 to the output's relative
    error, significance 2.2e-3 (2.2e3 by its own relative error).  A corrupted bias on the output's scale
    (RMS 1, relative error 0.5) moves the output by its whole difference: 0.5 / tol.  A module's
    `parameters.bias` is measured the same way; an op's input that is no bias (the weight) is not."""
    sig = _sig(_rows(_linear_with_bias({"err": 0.27})))
    assert sig["Functional.linear.7.forward.input.2"] == pytest.approx(0.27 * 1e-6 / TOL)
    assert sig["Functional.linear.7.forward.input.1"] == pytest.approx(1e-8 / TOL)
    bad = _sig(_rows(_linear_with_bias({"err": 0.5, "ref_norm": 4.0})))
    assert bad["Functional.linear.7.forward.input.2"] == pytest.approx(0.5 / TOL)
    mod = _sig(_rows(_linear_with_bias({"err": 0.27}, module=True)))
    assert mod["Module.k_proj.Linear.forward.0.parameters.bias"] == pytest.approx(0.27 * 1e-6 / TOL)
    # the same leaf as an add's second operand: no bias, ranked by its own relative error
    add = [{**r, "op_type": "add"} for r in _linear_with_bias({"err": 0.27})]
    assert _sig(_rows(add))["Functional.linear.7.forward.input.2"] == pytest.approx(0.27 / TOL)


def _accuracy(choice_err: float, target_mean: float) -> list[dict]:
    """argmax(logits) (the logits differ by `choice_err`; its int64 index agrees by statistics), then the mean
    of the float indicator `pred == labels` over 8 samples: 1 correct in the reference, `target_mean` x 8 in
    the target (whole numbers: min 0, max 1, sum and sum of squares whole)."""
    ind = {"numel": 8, "ref_numel": 8, "min": 0.0, "max": 1.0, "ref_min": 0.0, "ref_max": 1.0, "ref_mean": 0.125}
    tgt = {"mean": target_mean, "norm": (8 * target_mean) ** 0.5, "ref_norm": 1.0}
    err = abs((8 * target_mean) ** 0.5 - 1.0)  # the norms' relative difference: what the statistics bound shows
    int_leaf = {"tol_dtype": "int64", "dtype": "int64", "tol": 0.0}
    return [
        {"record": "Torch.argmax.0.forward", "seq": 1, "io": "input", "err": choice_err},
        {"record": "Torch.argmax.0.forward", "seq": 1, "io": "output", "err": 0.0} | int_leaf,
        {"record": "Tensor.mean.0.forward", "seq": 2, "io": "input", "err": err} | ind | tgt,
    ]


def test_whole_numbers_a_hidden_flip_moved_carry_it():
    """The set 4 resnet_flip clean pair at step 2: logits agree to 2.6e-7, the argmax's index agrees by its
    statistics (a flip hides in them), the accuracy indicator's mean moved one unit of 8 (relative error 0.414,
    significance 3.4e3 before): whole numbers one flipped choice moves carry that flip, significance 1.  When
    the logits agree exactly no choice can have flipped; two units moved are more than one flip makes."""
    sig = _sig(_rows(_accuracy(2.6e-7, 0.25)))
    assert sig["Tensor.mean.0.forward.input.0"] == 1.0
    assert _sig(_rows(_accuracy(0.0, 0.25)))["Tensor.mean.0.forward.input.0"] == pytest.approx((2**0.5 - 1) / TOL)
    two = _sig(_rows(_accuracy(2.6e-7, 0.375)))["Tensor.mean.0.forward.input.0"]
    assert two == pytest.approx((3**0.5 - 1) / TOL)


def test_an_output_made_from_whole_numbers_a_flip_moved_carries_it_when_unbounded():
    """Clean combinations falcon_bf16_F: no correct prediction in the reference, one in the target; the
    indicator (reference all zeros) and its mean differ at relative error inf: both carry the flip (1), they
    do not top a clean pair's list at inf.  Without a float input that differs before, the mean stays inf."""
    rows = _accuracy(2.6e-7, 0.125)
    rows[-1] |= {"ref_mean": 0.0, "ref_norm": 0.0, "ref_max": 0.0, "err": float("inf")}
    mean_out = {"record": "Tensor.mean.0.forward", "seq": 2, "io": "output", "err": float("inf"), "ref_norm": 0.0}
    sig = _sig(_rows([*rows, mean_out]))
    assert sig["Tensor.mean.0.forward.input.0"] == 1.0 and sig["Tensor.mean.0.forward.output.0"] == 1.0
    rows[0] |= {"err": 0.0}
    assert _sig(_rows([*rows, mean_out]))["Tensor.mean.0.forward.output.0"] == float("inf")

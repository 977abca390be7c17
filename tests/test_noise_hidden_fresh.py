"""A fresh op (inputs agree) whose inputs agree by their statistics only is judged against what those
statistics can hide (noise.statistics_hidden), as a carrying op is (analysis/culprit.py `_Judge._fresh`): a batch
norm's output statistics are pinned by the normalisation whatever error its input carried, and the op after it
looks fresh."""

from __future__ import annotations

from test_stats_blind import _chain, _f32, _pair


def _hidden_chain(target: bool, fault: float) -> dict:
    """test_stats_blind's chain with the fresh op's input 5e-6 off in the target (its statistics show 5e-6, times
    the op's conditioning |x| / |y| = 2, under a tenth of the float32 tolerance: fresh; they can hide
    sqrt(2 x 5e-6) x 2 = 6.3e-3) and its output off by `fault`."""
    recs = _chain(target, 0.0)
    y = recs["Tensor.mul.0.forward"]["input_args"][0]
    ref = _chain(False, 0.0)["Tensor.mul.0.forward"]["output"][0]
    if target:
        recs["Tensor.mul.0.forward"] = {
            "input_args": [_f32(y * (1 + 5e-6)), {"type": "float", "value": 0.5}],
            "output": [_f32(ref * (1 + fault))],
        }
    return recs


def test_a_fresh_op_within_what_its_inputs_statistics_hide_is_quiet(dump_writer, store_dir):
    """Output 1e-3 off (8 tolerances, 10x the 1e-4 the pair carries) on inputs whose statistics differ by 5e-6:
    within 6.3e-3, quiet in statistics mode; named in tensor mode, where the input error is exact."""
    v = _pair(dump_writer, store_dir, "statistics", [_hidden_chain(False, 0.0)], [_hidden_chain(True, 1e-3)])
    assert v.culprit is None
    v = _pair(dump_writer, store_dir / "t", "tensor", [_hidden_chain(False, 0.0)], [_hidden_chain(True, 1e-3)])
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mul.0.forward", "op")


def test_a_fresh_op_beyond_what_its_inputs_statistics_hide_is_named(dump_writer, store_dir):
    """Output 2e-2 off: beyond 6.3e-3, named in statistics mode."""
    v = _pair(dump_writer, store_dir, "statistics", [_hidden_chain(False, 0.0)], [_hidden_chain(True, 2e-2)])
    assert v.culprit is not None and (v.culprit.op, v.culprit.kind) == ("Tensor.mul.0.forward", "op")

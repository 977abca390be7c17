"""msprobe compare's own pairing (analysis/msprobe_pairing.py) and the graph-mode module walk
(analysis/graph_modules.py) on small hand-made rows: the cases the real-dump tests (test_msprobe_cells.py,
test_msgraph.py, markers msprobe and msgraph) cover end to end, here without msprobe or MindSpore.
"""

from __future__ import annotations

import polars as pl

from dumpstore.analysis.graph_modules import _segments, _strip_depth, _unit_modules
from dumpstore.analysis.msprobe_pairing import dtype_match, msprobe_pairs


def _rows(pairs: list[tuple[str | None, str | None]]) -> pl.DataFrame:
    """Aligned rows (target record, reference record), one output leaf each, in dump order on both sides."""
    t = [p[0] for p in pairs]
    r = [p[1] for p in pairs]
    return pl.DataFrame(
        {
            "step": [0] * len(pairs),
            "rank": [0] * len(pairs),
            "source": [""] * len(pairs),
            "record": t,
            "name": [f"{x}.output.0" if x else None for x in t],
            "seq": [i if x else None for i, x in enumerate(t)],
            "ref_record": r,
            "ref_name": [f"{x}.output.0" if x else None for x in r],
            "ref_seq": [i if x else None for i, x in enumerate(r)],
        }
    )


def test_an_extra_forward_call_pairs_by_name_in_msprobe():
    """dumpstore pairs the target's second gelu with the reference's first (by sequence); msprobe by name."""
    rows = _rows(
        [
            ("Functional.gelu.0.forward", None),  # dumpstore: the extra call
            ("Functional.gelu.1.forward", "Functional.gelu.0.forward"),
            ("Functional.gelu.2.forward", "Functional.gelu.1.forward"),
        ]
    )
    # msprobe: gelu.0 <-> gelu.0 (row 1's reference), gelu.1 <-> gelu.1 (row 2's), gelu.2 <-> none
    assert msprobe_pairs(rows) == {0: 1, 1: 2, 2: None}


def test_backward_calls_pair_by_backward_order():
    """Backward call numbers are replaced by the backward order of the same op: the extra forward call's
    backward (first in backward order) pairs with the reference's first backward, whatever its number."""
    rows = _rows(
        [
            ("Functional.gelu.2.backward", "Functional.gelu.1.backward"),
            ("Functional.gelu.1.backward", "Functional.gelu.0.backward"),
            ("Functional.gelu.0.backward", None),
            ("Module.fc.Linear.backward.3", "Module.fc.Linear.backward.0"),
        ]
    )
    assert msprobe_pairs(rows) == {}  # dumpstore's sequence pairing is msprobe's here


def test_parameters_grad_and_modules_keep_their_names():
    rows = _rows(
        [
            ("Module.fc.Linear.forward.1", "Module.fc.Linear.forward.0"),
            ("Module.fc.Linear.parameters_grad", "Module.fc.Linear.parameters_grad"),
        ]
    )
    assert msprobe_pairs(rows) == {0: None}


def test_dtype_groups():
    assert dtype_match("torch.float32", "torch.bfloat16")
    assert dtype_match("Float16", "Float32")
    assert not dtype_match("torch.float32", "Float32")
    assert not dtype_match("torch.int64", "torch.float32")
    assert dtype_match("<class 'int'>", "<class 'int'>")


ROOT = "Default/network-WithLossCell/_backbone-Net"
PATHS = {p: f"Module.{p}.X" for p in ("b0", "b0.fc", "b0.act", "b1", "b1.fc", "b1.act", "head")}


def test_shared_compiled_body_goes_to_the_running_sibling():
    """The second block's GELU and residual Add carry the first block's scope (MindSpore shares the compiled
    body): they are counted in the block running when they run."""
    scopes = [
        f"{ROOT}/b0-Block/fc-Dense",
        f"{ROOT}/b0-Block/act-GELU",
        f"{ROOT}/b0-Block",
        f"{ROOT}/b1-Block/fc-Dense",
        f"{ROOT}/b0-Block/act-GELU",  # b1's GELU under b0's scope
        f"{ROOT}/b0-Block",  # b1's Add
        "Expand/_Muls",  # outside the network: no module, no break
        f"{ROOT}/head-Dense",
    ]
    segs = [_segments(s) for s in scopes]
    k = _strip_depth(segs, PATHS)
    assert k == 3  # Default, network, _backbone dropped
    got = _unit_modules(segs, k, PATHS)
    assert got == {
        "Module.b0.fc.X.forward.0": (0, 0),
        "Module.b0.act.X.forward.0": (1, 1),
        "Module.b0.X.forward.0": (0, 2),
        "Module.b1.fc.X.forward.0": (3, 3),
        "Module.b1.act.X.forward.0": (4, 4),
        "Module.b1.X.forward.0": (3, 5),
        "Module.head.X.forward.0": (7, 7),
    }


def test_a_module_called_twice_in_a_row_counts_two_calls():
    scopes = [f"{ROOT}/b0-Block/fc-Dense", f"{ROOT}/head-Dense", f"{ROOT}/head-Dense"]
    segs = [_segments(s) for s in scopes]
    got = _unit_modules(segs, 3, PATHS)
    # consecutive kernels of one scope are one call: a second call needs another module in between
    assert got["Module.head.X.forward.0"] == (1, 2)
    scopes = [f"{ROOT}/head-Dense", f"{ROOT}/b0-Block/fc-Dense", f"{ROOT}/head-Dense"]
    got = _unit_modules([_segments(s) for s in scopes], 3, PATHS)
    assert got["Module.head.X.forward.0"] == (0, 0) and got["Module.head.X.forward.1"] == (2, 2)

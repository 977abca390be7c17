"""TrainerMon's per-step layout (a CSV per step per prefix, its default) against the same run written several
steps a file: the same store, rows in the canonical order (steps in numeric order, not the files' name order);
bad input among per-step files named by file and line; a file of another header read as its own group."""

from __future__ import annotations

import pytest

from dumpstore.longrun import monitor
from dumpstore.longrun.monitor import MonitorFormatError, iter_monitor_tables, read_monitor
from dumpstore.longrun.store import LongRun, read, write
from dumpstore.store import open_store

HEAD = "vpp_stage,name,step,micro_step,norm,min,max,zeros,nans,mean,shape,dtype\n"
GRAD_HEAD = "vpp_stage,name,step,norm,min,max,zeros,nans,mean\n"
STEPS = 12  # steps 10 and 11 sort before 2 by file name


def _actv(s: int) -> str:
    names = ["layers.0.output", "layers.0.input"] + (["layers.1.output"] if s >= 3 else [])  # a module from step 3
    out = []
    for k, n in enumerate(names):
        if s == 5 and k == 1:  # a tensor missing at a step: a row of nan strings
            out.append(f"0,{n},{s},0,nan,nan,nan,nan,nan,nan,nan,nan\n")
        else:
            out.append(f'0,{n},{s},0,{s + k / 4},-{k}.5,{k}.5,0.25,0.0,{s / 8},"[4, {k + 1}]",torch.bfloat16\n')
    return "".join(out)


def _grad(s: int) -> str:
    return "".join(f"0,layers.{k}.weight,{s},{s * 2 + k},-0.1,0.1,0.0,0.0,{k / 10}\n" for k in range(3))


def _write(root, per_file: int, rank: int = 0):
    d = root / f"Dec01_00-00-00-rank{rank}-0123abcd"
    d.mkdir(parents=True)
    for a in range(0, STEPS, per_file):
        steps = range(a, min(a + per_file, STEPS))
        b = steps[-1]
        (d / f"actv_{a}-{b}.csv").write_text(HEAD + "".join(_actv(s) for s in steps))
        (d / f"grad_reduced_{a}-{b}.csv").write_text(GRAD_HEAD + "".join(_grad(s) for s in steps))
    return d


def _rows(table):
    return [{k: "nan" if v != v else v for k, v in r.items()} for r in table.to_pylist()]


@pytest.mark.parametrize("per_file", [4, 5])
def test_per_step_files_store_what_multi_step_files_store(tmp_path, per_file):
    one = tmp_path / "one"
    many = tmp_path / "many"
    for rank in (0, 1):
        _write(one, 1, rank)
        _write(many, per_file, rank)
    store = tmp_path / "store"
    a = write(store, LongRun("one", monitor_roots=[one]))
    b = write(store, LongRun("many", monitor_roots=[many]))
    keep = ("n_monitor", "first_step", "last_step", "ranks", "kinds")
    assert {k: a[k] for k in keep} == {k: b[k] for k in keep}
    assert a["n_monitor"] == 2 * (sum(3 if s >= 3 else 2 for s in range(STEPS)) + 3 * STEPS)
    st = open_store(store)
    got_one, got_many = _rows(read(st, "monitor", "one")), _rows(read(st, "monitor", "many"))
    assert got_one == got_many
    # the canonical order: rank, prefix (the files' order), then steps in numeric order, rows as written
    keys = [(r["rank"], r["prefix"], r["step"]) for r in got_one]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1], k[2]))
    actv0 = [r for r in got_one if r["rank"] == 0 and r["prefix"] == "actv"]
    assert [r["step"] for r in actv0[:7]] == [0, 0, 1, 1, 2, 2, 3]
    assert [(r["name"], r["seq"]) for r in actv0[6:9]] == [
        ("layers.0.output", 0),
        ("layers.0.input", 1),
        ("layers.1.output", 2),
    ]
    missing = [r for r in actv0 if r["missing"]]
    assert [(r["step"], r["name"], r["norm"], r["shape"], r["dtype"]) for r in missing] == [
        (5, "layers.0.input", "nan", None, None)
    ]
    # the same rows with batches of a file or two (each batch its own text and dictionaries)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(monitor, "_BLOCK", 200)
        assert _rows(read_monitor(one)) == _rows(read_monitor(many))


def test_bad_rows_among_per_step_files_name_file_and_line(tmp_path):
    d = _write(tmp_path / "mon", 1)
    bad = d / "grad_reduced_7-7.csv"
    bad.write_text(GRAD_HEAD + _grad(7) + "0,layers.3.weight,7,1.0,-0.1\n")  # a short row, line 5
    with pytest.raises(MonitorFormatError, match=r"grad_reduced_7-7.csv, line 5: not a monitor CSV \(Expected 9 col"):
        read_monitor(tmp_path / "mon")
    bad.write_text(GRAD_HEAD + "0,layers.0.weight,7,1.0,-0.1,0.1,0.0,zero,0.0\n")  # not a number, line 2
    with pytest.raises(MonitorFormatError, match=r"grad_reduced_7-7.csv, line 2: not a monitor CSV \(.*'zero'"):
        read_monitor(tmp_path / "mon")
    bad.write_text("vpp_stage,module,step,norm\n0,layers.0.weight,7,1.0\n")  # a header without `name`
    with pytest.raises(MonitorFormatError, match=r"grad_reduced_7-7.csv, line 1: header .* lacks name"):
        read_monitor(tmp_path / "mon")
    bad.write_text("")  # an empty file
    with pytest.raises(MonitorFormatError, match=r"grad_reduced_7-7.csv, line 1: header  lacks name, step"):
        read_monitor(tmp_path / "mon")


def test_a_file_of_another_header_is_its_own_group(tmp_path):
    """A file whose header differs from its group's (a resumed job with other ops) is read as a group of its
    own, after its group's files: no row lost, its missing columns null, seq counted apart."""
    d = _write(tmp_path / "mon", 1)
    other = "vpp_stage,name,step,max,norm,min\n"  # other ops, another order
    for s in (4, 9):
        (d / f"grad_reduced_{s}-{s}.csv").write_text(
            other + "".join(f"0,layers.{k}.weight,{s},{k},{s}.5,-{k}\n" for k in (2, 0))
        )
    for block in (monitor._BLOCK, 200):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(monitor, "_BLOCK", block)
            pieces = list(iter_monitor_tables(tmp_path / "mon", workers=2, window=1))
        keys = list(dict.fromkeys(k for k, _ in pieces))
        assert [(k[2], k[3][3:]) for k in keys] == [
            ("actv", ("micro_step", "norm", "min", "max", "zeros", "nans", "mean", "shape", "dtype")),
            ("grad_reduced", ("norm", "min", "max", "zeros", "nans", "mean")),
            ("grad_reduced", ("max", "norm", "min")),
        ]
        rows = [r for k, t in pieces if k == keys[2] for r in _rows(t)]
        assert [(r["step"], r["name"], r["norm"], r["min"], r["max"], r["mean"], r["seq"]) for r in rows] == [
            (4, "layers.2.weight", 4.5, -2.0, 2.0, None, 0),
            (4, "layers.0.weight", 4.5, -0.0, 0.0, None, 1),
            (9, "layers.2.weight", 9.5, -2.0, 2.0, None, 0),
            (9, "layers.0.weight", 9.5, -0.0, 0.0, None, 1),
        ]
        main = [r for k, t in pieces if k == keys[1] for r in _rows(t)]
        assert sorted({r["step"] for r in main}) == [s for s in range(STEPS) if s not in (4, 9)]

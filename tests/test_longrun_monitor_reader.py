"""The monitor CSV reader on hand-written TrainerMon and monitor_v2 folders: the values of each derived column,
seq over a group's files, a file read in several batches, rows without a name or dtype, and bad files; msprobe's
anomaly.json (its format from msprobe's AnomalyDataWriter) read in msprobe's order, ingested, and bad ones named."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from dumpstore.cli.main import main
from dumpstore.longrun import monitor
from dumpstore.longrun.anomalies import anomaly_files, read_anomalies
from dumpstore.longrun.monitor import MonitorFormatError, iter_monitor_tables, read_monitor
from dumpstore.longrun.store import LongRun, catalog, read, write
from dumpstore.store import open_store

V1_HEAD = "vpp_stage,name,step,micro_step,norm,min,max,zeros,nans,mean,shape,dtype\n"


def _v1(tmp_path):
    d = tmp_path / "mon" / "Dec01_00-00-00-rank2-0123abcd"
    d.mkdir(parents=True)
    (d / "actv_0-1.csv").write_text(
        V1_HEAD
        + "0,.input,0,0,nan,nan,nan,nan,nan,nan,nan,nan\n"
        + '0,layers.0.output,0,0,1.5,-1.0,1.0,0.25,0.0,0.1,"[4, 8]",torch.float32\n'
        + '0,layers.0.output.1,0,0,1.5,-1.0,1.0,0.25,0.0,0.1,"[4, 8]",torch.bfloat16\n'
        + '0,,1,0,2.0,-1.0,1.0,0.0,0.0,0.0,"[4, 8]",\n'  # no name, no dtype
        + '0,layers.0.output,1,0,2.5,-1.0,1.0,0.0,0.0,0.0,"[x, 8]",float16\n'
    )
    (d / "actv_2-3.csv").write_text(
        V1_HEAD
        + '0,layers.1.grad_input,2,0,3.0,-1.0,1.0,0.0,0.0,0.0,"(2,)",torch.float32\n'  # first seen in a later file
        + '0,layers.0.output,2,0,3.5,-1.0,1.0,0.0,0.0,0.0,"[]",torch.float32\n'
    )
    (d / "grad_reduced_0-1.csv").write_text(  # no micro_step, no shape/dtype columns
        "vpp_stage,name,step,norm,min,max,zeros,nans,mean\n"
        "0,layers.0.bias,0,0.5,-0.1,0.1,0.0,0.0,0.0\n"
        "0,layers.0.weight,0,0.7,-0.1,0.1,0.0,0.0,0.0\n"
        "0,layers.0.weight,1,0.8,-0.1,0.1,0.0,0.0,0.0\n"
    )
    return tmp_path / "mon"


def _rows(table):
    """Rows as dicts, NaN as the string "nan" (comparable)."""
    return [{k: "nan" if v != v else v for k, v in r.items()} for r in table.to_pylist()]


def test_trainermon_derived_columns(tmp_path):
    rows = _rows(read_monitor(_v1(tmp_path)))
    assert [(r["prefix"], r["name"], r["step"], r["seq"]) for r in rows] == [
        ("actv", ".input", 0, 0),
        ("actv", "layers.0.output", 0, 1),
        ("actv", "layers.0.output.1", 0, 2),
        ("actv", None, 1, None),
        ("actv", "layers.0.output", 1, 1),
        ("actv", "layers.1.grad_input", 2, 3),  # seq counts on over the group's files
        ("actv", "layers.0.output", 2, 1),
        ("grad_reduced", "layers.0.bias", 0, 0),
        ("grad_reduced", "layers.0.weight", 0, 1),
        ("grad_reduced", "layers.0.weight", 1, 1),
    ]
    assert all(r["rank"] == 2 for r in rows)
    first = rows[0]
    assert first["missing"] and first["shape"] is None and first["dtype"] is None and first["norm"] == "nan"
    assert first["module"] == "" and first["io"] == "input" and first["param"] is None
    out = rows[1]
    assert (out["module"], out["param"], out["direction"], out["io"]) == ("layers.0", None, "forward", "output")
    assert (out["shape"], out["dtype"], out["missing"], out["zeros"]) == ([4, 8], "float32", False, 0.25)
    assert (rows[2]["module"], rows[2]["io"], rows[2]["dtype"]) == ("layers.0", "output", "bfloat16")
    assert rows[3]["missing"] and rows[3]["shape"] is None and rows[3]["module"] is None  # no dtype: missing
    assert rows[4]["shape"] == [None, 8] and rows[4]["dtype"] == "float16"
    assert (rows[5]["module"], rows[5]["io"], rows[5]["shape"]) == ("layers.1", "input", [2])
    assert rows[6]["shape"] is None  # `[]`: no shape
    g = rows[8]
    assert (g["module"], g["param"], g["direction"], g["io"]) == ("layers.0", "layers.0.weight", "parameters_grad",
                                                                  "parameters_grad")  # fmt: skip
    assert g["micro_step"] is None and g["missing"] and g["shape"] is None  # no dtype column: missing, as before


def test_v2_scopes_mapped_and_kept(tmp_path):
    d = tmp_path / "mon" / "rank_1"
    d.mkdir(parents=True)
    (d / "module_step0-0.csv").write_text(
        "vpp_stage,step,module_name,scope,min,max,mean,norm,nans\n"
        "-1,0,layers.0.input.0,forward,-1.0,1.0,0.0,2.0,0.0\n"
        "-1,0,layers.0.output.0,backward,-1.0,1.0,0.0,3.0,0.0\n"
        "-1,0,layers.0.input.0,backward,-1.0,1.0,0.0,4.0,0.0\n"
        "-1,0,layers.0.output.0,,-1.0,1.0,0.0,5.0,0.0\n"
    )
    (d / "optimizer_step0-0.csv").write_text(
        "vpp_stage,step,module_name,scope,min,max,mean,norm,nans\n-1,0,layers.0.weight,exp_avg,0.0,0.1,0.0,0.3,0.0\n"
    )
    rows = _rows(read_monitor(tmp_path / "mon"))
    assert [(r["prefix"], r["name"], r["seq"], r["io"], r["direction"]) for r in rows] == [
        ("actv", "layers.0.input.0", 0, "input", "forward"),
        ("actv_grad", "layers.0.output.0", 0, "output", "backward"),
        ("actv_grad", "layers.0.input.0", 1, "input", "backward"),
        (None, "layers.0.output.0", 0, None, "other"),  # no scope: no prefix
        ("exp_avg", "layers.0.weight", 0, "exp_avg", "optimizer"),
    ]
    assert all(r["rank"] == 1 and r["zeros"] is None for r in rows)


def test_batches_and_workers_give_the_same_table(tmp_path, monkeypatch):
    root = _v1(tmp_path)
    one = read_monitor(root)
    monkeypatch.setattr(monitor, "_BLOCK", 160)  # a batch of a line or two: dictionaries and seq per batch
    pieces = list(iter_monitor_tables(root, workers=3, window=1))
    assert len(pieces) > 3
    assert _rows(read_monitor(root)) == _rows(one)


def test_store_parts_roundtrip(tmp_path):
    root = _v1(tmp_path)
    lr = LongRun("m", monitor_roots=[root])
    row = write(tmp_path / "store", lr)
    assert (row["n_monitor"], row["first_step"], row["last_step"], row["ranks"]) == (10, 0, 2, [2])
    back = read(open_store(tmp_path / "store"), "monitor", "m")
    assert _rows(back) == _rows(read_monitor(root))


def test_bad_files_name_the_file(tmp_path):
    d = tmp_path / "Dec01_00-00-00-rank0-0123abcd"
    d.mkdir()
    (d / "actv_0-0.csv").write_text(V1_HEAD + "0,a.output,0,0,1,2,3\n")  # a short row
    with pytest.raises(MonitorFormatError, match=r"actv_0-0.csv, line 2: not a monitor CSV \(.*[Ee]xpected 12 columns"):
        read_monitor(tmp_path)
    (d / "actv_0-0.csv").write_text(V1_HEAD + "0,a.output,zero,0,1,2,3,4,5,6,[1],float32\n")
    with pytest.raises(MonitorFormatError, match=r"actv_0-0.csv, line 2: not a monitor CSV \(.*int64"):
        read_monitor(tmp_path)


def _alarm(tag: str, stat: str, step: int, call: int, value: str = "2.5", **extra) -> dict:
    msg = (
        f"Rule AnomalyTurbulence reports anomaly signal in ('{tag}', '{stat}') at step {step}, "
        f"current value {value}, history mean 1.25."
    )
    return {"rank": 1, "step": step, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "call_id": call,
            "tag_name": tag, "message": msg, "group_mates": [0, 1], **extra}  # fmt: skip


def test_anomaly_json_in_msprobes_order(tmp_path):
    d = tmp_path / "monitor" / "anomaly_detected" / "rank1"
    d.mkdir(parents=True)
    alarms = [
        _alarm("0:layers.0.weight/rank1/exp_avg", "norm", 3, 0),  # optimizer stage
        _alarm("0:layers.0.weight/rank1/post_grad", "mean", 3, 1, value="nan"),  # backward stage
        _alarm("0:layers.1.output:0/rank1/actv", "norm", 3, 5),  # forward stage: first of step 3
        _alarm("0:layers.0.weight/rank1/acc_grad", "norm", 2, 7),
    ]
    (d / "anomaly.json").write_text(json.dumps({f"k{i}": a for i, a in enumerate(alarms)}))
    files = anomaly_files(tmp_path / "monitor")
    assert files == [(d / "anomaly.json", 1)]
    rows = read_anomalies(files).to_pylist()
    assert [(r["step"], r["prefix"], r["name"], r["stat"], r["call_id"]) for r in rows] == [
        (2, "grad_unreduced", "layers.0.weight", "norm", 7),
        (3, "actv", "layers.1.output", "norm", 5),
        (3, "grad_reduced", "layers.0.weight", "mean", 1),
        (3, "exp_avg", "layers.0.weight", "norm", 0),
    ]
    assert rows[0]["value"] == 2.5 and rows[0]["history"] == 1.25 and rows[0]["rule"] == "AnomalyTurbulence"
    assert math.isnan(rows[2]["value"]) and rows[1]["micro_step"] == 0 and rows[1]["rank"] == 1


def test_anomaly_json_ingested_and_bad_one_named(tmp_path):
    d = tmp_path / "monitor" / "anomaly_detected" / "rank0"
    d.mkdir(parents=True)
    (d / "anomaly.json").write_text(json.dumps({"a": _alarm("0:x.weight/rank0/post_grad", "norm", 4, 0)}))
    store = str(tmp_path / "store")
    r = CliRunner().invoke(main, ["longrun-ingest", str(tmp_path / "monitor"), "--run", "m", "--store", store])
    assert r.exit_code == 0 and "msprobe_anomalies" in r.output, r.output
    r = CliRunner().invoke(
        main, ["query", "select step, prefix, name from monitor_anomalies", "--store", store, "--json"]
    )
    assert json.loads(r.output) == [{"step": 4, "prefix": "grad_reduced", "name": "x.weight"}]
    r = CliRunner().invoke(main, ["curves", "--run", "m", "--health", "--store", store])
    assert "msprobe flagged (its own alarms, not this verdict): run m: 1 alarms" in r.output, r.output
    for text, why in (
        ("{", "not JSON"),
        ("[1]", "a JSON object of alarms"),
        ('{"a": {"step": 1}}', "alarm 'a' has no"),
    ):
        (d / "anomaly.json").write_text(text)
        r = CliRunner().invoke(main, ["longrun-ingest", str(tmp_path / "monitor"), "--run", "m", "--store", store])
        assert r.exit_code == 1 and len(r.output.splitlines()) == 1, r.output
        assert f"{d / 'anomaly.json'}: " in r.output and why in r.output, r.output


def test_a_bad_file_among_many_ranks_leaves_no_part(tmp_path):
    """Files of 3 ranks parsed on several threads: one bad file in the middle stops the ingest with its name, and
    the parts written before it are removed (the catalog never names the run)."""
    for rank in range(3):
        d = tmp_path / "mon" / f"Dec01_00-00-00-rank{rank}-0123abcd"
        d.mkdir(parents=True)
        for a in range(0, 40, 4):
            rows = "".join(
                f"0,layers.{k}.weight,{s},0.5,-0.1,0.1,0.0,0.0,0.0\n" for s in range(a, a + 4) for k in range(3)
            )
            (d / f"grad_reduced_{a}-{a + 3}.csv").write_text(
                "vpp_stage,name,step,norm,min,max,zeros,nans,mean\n" + rows
            )
    store = tmp_path / "store"
    row = write(store, LongRun("m", monitor_roots=[tmp_path / "mon"]))
    assert (row["n_monitor"], row["ranks"], row["first_step"], row["last_step"]) == (360, [0, 1, 2], 0, 39)
    back = read(open_store(store), "monitor", "m")
    assert back.num_rows == 360 and sorted(set(back.column("seq").to_pylist())) == [0, 1, 2]
    bad = tmp_path / "mon" / "Dec01_00-00-00-rank1-0123abcd" / "grad_reduced_20-23.csv"
    bad.write_text("vpp_stage,name,step,norm,min,max,zeros,nans,mean\n0,layers.0.weight,x,1,1,1,0,0,0\n")
    with pytest.raises(MonitorFormatError, match="grad_reduced_20-23.csv, line 2: not a monitor CSV"):
        write(store, LongRun("n", monitor_roots=[tmp_path / "mon"]))
    assert not (store / "longrun" / "monitor" / "run=n").exists() or not any(
        (store / "longrun" / "monitor" / "run=n").iterdir()
    )
    assert [r["run"] for r in catalog(open_store(store)).to_pylist()] == ["m"]


def test_small_files_read_as_one_text(tmp_path, monkeypatch):
    """TrainerMon's default is one file per step: files of a group are parsed as one text (the header once),
    which gives the rows that reading them one by one gives, a file without a final newline or without rows
    included; a bad one among them is still named."""
    d = tmp_path / "mon" / "Dec01_00-00-00-rank0-0123abcd"
    d.mkdir(parents=True)
    head = "vpp_stage,name,step,norm,min,max,zeros,nans,mean\n"
    for s in range(12):
        rows = "".join(f"0,layers.{k}.weight,{s},{s + k / 10},-0.1,0.1,0.0,0.0,0.0\n" for k in range(3 + s % 2))
        text = head + (rows if s != 5 else "")  # step 5: a header only
        (d / f"grad_reduced_{s}-{s}.csv").write_text(text.rstrip("\n") if s == 7 else text)  # 7: no final newline
    together = _rows(read_monitor(tmp_path / "mon"))
    assert len(together) == sum(3 + s % 2 for s in range(12) if s != 5)
    monkeypatch.setattr(monitor, "_BLOCK", 300)  # every file its own batch
    assert _rows(read_monitor(tmp_path / "mon")) == together
    monkeypatch.undo()
    (d / "grad_reduced_9-9.csv").write_text(head + "0,layers.0.weight,nine,1,1,1,0,0,0\n")
    with pytest.raises(MonitorFormatError, match=r"grad_reduced_9-9.csv, line 2: not a monitor CSV"):
        read_monitor(tmp_path / "mon")

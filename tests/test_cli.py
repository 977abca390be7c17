"""CLI: exact output of ingest/runs/query, one switch for every format, lazy heavy imports, docs coverage."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from dumpstore.cli.main import main
from helpers import MSPROBE, ROOT


def test_ingest_runs_query_roundtrip(store_dir):
    r = CliRunner()
    res = r.invoke(main, ["ingest", str(MSPROBE / "v26_L0"), "--run", "l0", "--store", str(store_dir)])
    assert res.exit_code == 0, res.output
    assert res.output == (
        "run l0: 43 records, 110 rows (110 tensors, 0 tensor files) from 1 dump files; steps 0, ranks 0\n"
    )
    out = json.loads(r.invoke(main, ["runs", "--json", "--store", str(store_dir)]).output)
    assert [(o["run"], o["n_rows"], o["level"], o["dump_mode"]) for o in out] == [("l0", 110, "L0", "statistics")]
    res = r.invoke(
        main, ["query", "select count(*) as n from tensors where run='l0'", "--csv", "--store", str(store_dir)]
    )
    assert res.output == "n\n110\n"


def test_store_from_environment(store_dir, monkeypatch):
    monkeypatch.setenv("DUMPSTORE_STORE", str(store_dir))
    r = CliRunner()
    assert r.invoke(main, ["ingest", str(MSPROBE / "v26_L0"), "--run", "x"]).exit_code == 0
    assert r.invoke(main, ["query", "select run from runs", "--csv"]).output == "run\nx\n"


def test_query_refuses_writes_and_outside_files(store_dir):
    r = CliRunner()
    r.invoke(main, ["ingest", str(MSPROBE / "v26_L0"), "--run", "x", "--store", str(store_dir)])
    for sql, msg in [
        ("copy (select 1) to '/tmp/x.csv'", "Error: COPY is not allowed"),
        ("attach '/tmp/x.db'", "Error: ATTACH is not allowed"),
        ("install httpfs", "Error: INSTALL is not allowed"),
        ("select * from read_csv('/etc/passwd')", "Error: Permission Error"),
        ("select 1; select 2", "Error: give exactly one SQL statement"),
    ]:
        res = r.invoke(main, ["query", sql, "--store", str(store_dir)])
        assert res.exit_code == 1 and res.output.startswith(msg), (sql, res.output)


def test_missing_store_is_one_line_error(tmp_path):
    res = CliRunner().invoke(main, ["runs", "--store", str(tmp_path / "nope")])
    assert res.exit_code == 1
    assert res.output == (
        f"Error: {tmp_path / 'nope'}: no store here; ingest a dump first (dumpstore ingest PATH "
        "--run NAME), or point --store / $DUMPSTORE_STORE at an existing store\n"
    )


def test_help_and_queries_do_not_import_torch(store_dir):
    CliRunner().invoke(main, ["ingest", str(MSPROBE / "v26_L0"), "--run", "x", "--store", str(store_dir)])
    code = (
        "import sys; from dumpstore.cli.main import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    for args in (
        ["--help"],
        ["query", "select count(*) from tensors", "--store", str(store_dir)],
        ["ingest", str(MSPROBE / "ms_tensor"), "--run", "t", "--store", str(store_dir)],
    ):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_every_command_documented_in_readme():
    """The README names the everyday commands; docs/commands.md, which it links, is the reference of every one."""
    readme = (ROOT / "README.md").read_text()
    assert "docs/commands.md" in readme
    reference = (ROOT / "docs" / "commands.md").read_text()
    for name in main.commands:
        assert re.search(rf"dumpstore {name}\b", reference), name
        assert CliRunner().invoke(main, [name, "--help"]).exit_code == 0


def test_console_script_never_imports_what_answers_do_not_need(store_dir):
    """pyarrow imports pandas on its first array (half a second); `pa.array(ndarray)` and `pl.Series(ndarray)`
    import numpy.ma (20-60 ms), `pl.from_arrow` pyarrow.compute (45-65 ms): the `dumpstore` script needs none.
    A lone statistics dump has no tensor files for a process pool (concurrent.futures: ~25 ms); local Parquet
    files need no filesystem layer (pyarrow.parquet: ~28 ms); a verdict needs no DuckDB."""
    code = (  # the script ends by os._exit: what is loaded is printed then
        "import os, sys; from dumpstore.cli.main import run\n"
        "end, unwanted = os._exit, os.environ['UNWANTED'].split()\n"
        "os._exit = lambda c: (print('LOADED', [m for m in unwanted if m in sys.modules]), sys.stdout.flush(), end(c))"
        "\n"
        "run()\n"
    )
    lone = ROOT / "sample_dumps" / "ref_stats" / "step0" / "rank0"
    for args, more in (
        (["ingest", str(MSPROBE / "ms_tensor"), "--run", "t", "--store", str(store_dir)], ""),
        (["ingest", str(lone), "--run", "lone", "--store", str(store_dir)], "concurrent.futures dumpstore.ptfile"),
        (["ingest", str(ROOT / "sample_dumps" / "ref_stats"), "--run", "ref", "--store", str(store_dir)], ""),
        (
            ["ingest", str(ROOT / "sample_dumps" / "weight_1pct_stats"), "--run", "target", "--store", str(store_dir)],
            "",
        ),
        (["divergence", "--target", "t", "--ref", "t", "--store", str(store_dir), "--no-cache"], "duckdb"),
        # the explanation of a verdict reads its partition files through pyarrow: no DuckDB (~70-90 ms)
        (["divergence", "--target", "target", "--ref", "ref", "--store", str(store_dir), "--no-cache"], "duckdb"),
    ):
        env = {**os.environ, "UNWANTED": f"pandas numpy.ma pyarrow.compute pyarrow.parquet {more}"}
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().endswith("LOADED []"), (args[:2], proc.stdout[-500:])


def test_ingest_several_dumps_at_once(store_dir, tmp_path):
    """`ingest A B --run a --run b` stores exactly what two separate ingests store."""
    from helpers import SAMPLES

    res = CliRunner().invoke(
        main,
        [
            "ingest",
            str(SAMPLES / "ref_stats"),
            str(SAMPLES / "lr_stats"),
            "--run",
            "ref",
            "--run",
            "lr",
            "--store",
            str(store_dir),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    summaries = json.loads(res.output)["runs"]
    assert [s["run"] for s in summaries] == ["ref", "lr"]
    one = tmp_path / "one"
    for path, run in ((SAMPLES / "ref_stats", "ref"), (SAMPLES / "lr_stats", "lr")):
        assert CliRunner().invoke(main, ["ingest", str(path), "--run", run, "--store", str(one)]).exit_code == 0
    sql = "select run, step, rank, leaf, name, min, max, mean, norm from tensors order by all"
    both = CliRunner().invoke(main, ["query", sql, "--store", str(store_dir), "--csv"])
    apart = CliRunner().invoke(main, ["query", sql, "--store", str(one), "--csv"])
    assert both.output == apart.output and both.output.count("\n") > 1000


def test_ingest_several_dumps_ends_when_the_last_ends(store_dir, monkeypatch):
    """The side-by-side ingest returns as its last run is published, not at its progress wait's next timeout (it
    waited up to 0.1 s for nothing): with a wait of a minute it still returns in seconds."""
    import time

    from dumpstore.cli import main as cli_main
    from helpers import SAMPLES

    monkeypatch.setattr(cli_main, "_POLL_S", 60.0)
    began = time.monotonic()
    res = CliRunner().invoke(
        main,
        ["ingest", str(SAMPLES / "ref_stats"), str(SAMPLES / "lr_stats"), "--run", "ref", "--run", "lr"]
        + ["--store", str(store_dir)],
    )
    assert res.exit_code == 0, res.output
    assert time.monotonic() - began < 30


def test_ingest_several_dumps_errors(store_dir):
    from helpers import SAMPLES

    res = CliRunner().invoke(main, ["ingest", "a", "b", "--run", "x", "--store", str(store_dir)])
    assert res.exit_code == 2 and "one --run per PATH" in res.output
    res = CliRunner().invoke(main, ["ingest", "a", "b", "--run", "x", "--run", "x", "--store", str(store_dir)])
    assert res.exit_code == 2 and "once" in res.output
    res = CliRunner().invoke(
        main,
        [
            "ingest",
            str(SAMPLES / "ref_stats"),
            str(store_dir / "missing"),
            "--run",
            "ok",
            "--run",
            "bad",
            "--store",
            str(store_dir),
        ],
    )
    assert res.exit_code == 1
    assert res.output.count("\n") == 1 and "missing" in res.output and "(ingested: ok)" in res.output


def test_console_script_exits_normally_under_a_profiler(store_dir, tmp_path):
    """The script skips the interpreter's teardown (os._exit), except where something reports at exit."""
    prof = tmp_path / "runs.prof"
    script = Path(sys.executable).parent / "dumpstore"
    proc = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(prof), str(script), "runs", "--store", str(store_dir)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert prof.stat().st_size > 0

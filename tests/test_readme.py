"""The README's example block runs as written: every command succeeds and prints its `#` lines."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT

BLOCK = re.compile(r"Examples \(on the bundled samples.*?```\n(.*?)```", re.S)


def _steps(readme: str) -> list[tuple[str, list[str]]]:
    steps: list[tuple[str, list[str]]] = []
    for line in BLOCK.search(readme).group(1).splitlines():
        if line.startswith("dumpstore "):
            steps.append((line, []))
        elif line.startswith("#   "):
            steps[-1][1].append(line[4:])
    return steps


def test_readme_examples_run(tmp_path):
    steps = _steps((ROOT / "README.md").read_text())
    assert len(steps) >= 10
    env = dict(os.environ, DUMPSTORE_STORE=str(tmp_path / "store"))
    out_dir = tmp_path / "work"
    out_dir.mkdir()
    (out_dir / "sample_dumps").symlink_to(ROOT / "sample_dumps")
    for command, expected in steps:
        args = shlex.split(command)[1:]
        proc = subprocess.run(
            [sys.executable, "-m", "dumpstore.cli.main", *args],
            cwd=out_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        ok = (3,) if "--check" in args else (0,)
        assert proc.returncode in ok, (command, proc.stderr)
        for line in expected:
            assert line in proc.stdout, (command, line, proc.stdout)
    assert (out_dir / "out" / "report.html").stat().st_size > 100_000


def test_readme_python_api_runs(tmp_path):
    """The README's Python block runs as written and prints what its comment says."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Python API\n\n```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "sample_dumps").symlink_to(ROOT / "sample_dumps")
    env = {k: v for k, v in os.environ.items() if k != "DUMPSTORE_STORE"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    expected = re.search(r"print\(.*\)\s+# (.*)", code).group(1)
    assert proc.stdout.strip() == expected


JOURNAL = re.compile(r"\b[Ss]ession \d|\b[Ii]ssue \d+|\b[0-9a-f]{7,40}\b(?<![0-9]{7})(?![+-]\d)")


def test_readme_is_for_users_and_docs_hold_no_journal():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 180
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
    pages.append(ROOT / "sample_dumps" / "README.md")
    for path in pages:
        hits = [m.group(0) for m in JOURNAL.finditer(path.read_text())]
        assert not hits, (path.name, hits)
    for link in ("docs/commands.md", "docs/store.md", "docs/scale-out.md", "docs/performance.md"):
        assert f"]({link}" in readme and (ROOT / link).is_file(), link


@pytest.mark.msprobe
def test_readme_msprobe_config_is_accepted_by_msprobe(tmp_path):
    """The config.json the README tells users to write passes msprobe's own config classes."""
    pytest.importorskip("msprobe")
    import json

    from msprobe.pytorch.dump.pt_config import parse_json_config

    readme = (ROOT / "README.md").read_text()
    cfg = json.loads(re.search(r"```json\n(.*?)```", readme, re.S).group(1))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    common, task = parse_json_config(str(path), None)
    assert (common.task, common.level, common.step) == ("statistics", "mix", [0, 1, 2])
    assert task.data_mode == ["all"]

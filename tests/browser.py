"""Headless Chromium for tests: load a local HTML file, return the DOM after its scripts ran, or a screenshot.

`chromium()` finds the browser (`/usr/bin/chromium` or on PATH); when it is missing and we run as root it
installs the Debian package once (`apt-get update`, `apt-get install -y chromium`); otherwise it returns
None with the reason in `why_no_chromium()`, for `pytest.skip`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
    "--enable-logging=stderr",
    "--v=0",
)
CONSOLE_ERROR = re.compile(r"Uncaught|CONSOLE.*(error|Error|violates)|Refused to", re.IGNORECASE)

_state: dict[str, str | None] = {}


def _find() -> str | None:
    for p in CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium() -> str | None:
    """Path of a Chromium binary, installing the Debian package when root; None (see why_no_chromium)."""
    if "path" in _state:
        return _state["path"]
    path = _find()
    if path is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            _state["why"] = (
                "headless Chromium not found (/usr/bin/chromium) and not root with apt-get; "
                "install it: apt-get install -y chromium"
            )
        else:
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
                res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
                if res.returncode != 0:
                    _state["why"] = f"`{' '.join(cmd)}` failed: {(res.stderr or res.stdout)[-300:]}"
                    break
            path = _find()
            if path is None and "why" not in _state:
                _state["why"] = "apt-get install chromium ran but no chromium binary appeared"
    _state["path"] = path
    return path


def why_no_chromium() -> str:
    return _state.get("why") or "headless Chromium is not available"


@dataclass
class Page:
    dom: str  # document.documentElement.outerHTML after scripts ran (virtual time budget)
    stderr: str  # Chromium's log, including console messages
    console_errors: list[str]
    screenshot: Path | None


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


def load(
    html_file: Path,
    *,
    screenshot: Path | None = None,
    window: tuple[int, int] = (1400, 2000),
    budget_ms: int = 5000,
    timeout: float = 60.0,
) -> Page:
    """Open `html_file` in headless Chromium: dump the DOM and, if asked, write a PNG screenshot."""
    exe = chromium()
    if exe is None:
        raise RuntimeError(why_no_chromium())
    url = Path(html_file).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        base = [
            exe,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
            f"--window-size={window[0]},{window[1]}",
        ]
        if screenshot is not None:  # one run does both: the DOM on stdout, the PNG after the budget
            base.append(f"--screenshot={screenshot}")
        res = _run(base + ["--dump-dom", url], timeout)
        shot = screenshot if screenshot is not None and screenshot.exists() else None
        err = res.stderr
    if res.returncode != 0 and not res.stdout:
        raise RuntimeError(f"chromium exited {res.returncode}: {res.stderr[-2000:]}")
    errors = [line for line in err.splitlines() if CONSOLE_ERROR.search(line)]
    return Page(res.stdout, err, errors, shot)

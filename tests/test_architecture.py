"""The shape of the code (docs/ARCHITECTURE.md): no import cycle, modules of a readable size, a light repository.

Read from the sources with `ast`, nothing imported: an import inside a function counts as much as one at the top
of a module (it runs as surely, only later); an import under `if TYPE_CHECKING:` does not (it never runs).
"""

from __future__ import annotations

import ast
import functools
import subprocess
from pathlib import Path

import pytest

from helpers import ROOT

# the installed package names of the three source folders (pyproject's package-dir)
PACKAGES = {"dumpstore": "dumpstore", "analysis": "dumpstore.analysis", "cli": "dumpstore.cli"}
MAX_LINES = 600
MAX_TRACKED_FILES = 1500


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the three folders."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, but those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                for sub in child.orelse:
                    walk(sub)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def _known(name: str) -> str | None:
    """`name` if it is one of our modules, else the longest of its prefixes that is (an attribute import)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges(name: str) -> set[str]:
    """The modules of ours that module `name` imports."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    here = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        out.update(t for t in (_known(t) for t in targets) if t and t != name)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, every module parsed once for the tests that read the graph."""
    return {m: _edges(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read():
    graph = _graph()
    assert "dumpstore.store" in graph["dumpstore._ingest.driver"]
    assert "dumpstore.readers" in graph["dumpstore.layout"]
    assert "dumpstore.engine_ray" in graph["dumpstore._ingest.driver"]  # an import inside a function
    assert "dumpstore.ptfile.reader" in graph["dumpstore.ptfile"]


def test_no_import_cycle():
    graph = _graph()
    assert _cycles(graph) == []


def test_the_library_never_imports_the_cli():
    """(`python -m dumpstore`, dumpstore/__main__.py, is the command's other entry point.)"""
    graph = _graph()
    library = [m for m in graph if not m.startswith("dumpstore.cli") and m != "dumpstore.__main__"]
    upward = [(m, t) for m in library for t in graph[m]]
    assert [(m, t) for m, t in upward if t.startswith("dumpstore.cli")] == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_long_module_says_why(name):
    """A module over MAX_LINES lines gives its reason on a `Size:` line of its docstring."""
    text = MODULES[name].read_text()
    if text.count("\n") <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert any(line.startswith("Size:") for line in doc.splitlines()), (
        f"{MODULES[name].relative_to(ROOT)} has {text.count(chr(10))} lines: split it, or say why not on a "
        "'Size:' line of its docstring"
    )


def test_every_package_is_installed():
    """pyproject's setuptools `packages` is an explicit list: a package folder missing from it is not installed."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m in MODULES if _is_package(m)}
    assert packages - listed == set()


def test_the_repository_holds_few_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    if not out:
        pytest.skip("not a git checkout")
    assert len(out.splitlines()) < MAX_TRACKED_FILES

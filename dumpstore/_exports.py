"""Lazy package exports (PEP 562): a package's `__getattr__` and `__dir__` that import a name's module on first
use, so `import dumpstore` loads neither pyarrow nor DuckDB and a command answered from the memo stays light."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, exporting each name of `exports` (name -> submodule)."""

    def __getattr__(name: str) -> Any:
        sub = exports.get(name)
        if sub is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{sub}"), name)
        setattr(sys.modules[package], name, value)  # later lookups find it without this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__

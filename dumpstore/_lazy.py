"""Lazy package exports: `dumpstore.ingest` and friends are imported on first use, not with the package.

Every CLI command is a fresh process, and a command that answers from the store's memo (or prints --help)
must not pay for pyarrow, DuckDB and Polars (~0.5 s together).  A package calls `lazy_exports(__name__,
{name: submodule})`; `package.name` then imports `package.submodule` and returns its `name` on first access.

Several exported functions share their name with the submodule that defines them (`dumpstore.ingest`,
`dumpstore.analysis.divergence`).  Importing such a submodule makes Python set it as an attribute of the
package, which would replace the function; the package's module class keeps the function instead.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _LazyPackage(types.ModuleType):
    _exports: dict[str, str]

    def __getattr__(self, name: str) -> Any:  # only called for names not set yet
        sub = type(self)._exports.get(name)
        if sub is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{sub}"), name)
        self.__dict__[name] = value
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in type(self)._exports:
            return  # the import system announcing submodule `name`: the package exports the function instead
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(type(self)._exports))


def lazy_exports(package: str, exports: dict[str, str]) -> None:
    """Make `exports` (name -> submodule) of `package` resolve on first access."""
    module = sys.modules[package]
    cls = type(f"_Lazy_{package.replace('.', '_')}", (_LazyPackage,), {"_exports": dict(exports)})
    module.__class__ = cls
    for name in exports:  # a submodule imported before under an exported name: drop it
        if isinstance(module.__dict__.get(name), types.ModuleType):
            del module.__dict__[name]

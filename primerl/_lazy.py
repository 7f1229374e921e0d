"""Lazy re-exports for package ``__init__``s (runtime, parallel): a name is imported from its module on
first access, so importing one room (e.g. the vLLM worker extension) does not load the others."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` whose ``exports`` map a public name to the
    submodule that defines it; a resolved name is cached in ``namespace`` (the package's globals)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    # a name that is also its submodule's (``primerl.models.parallelize``): importing the submodule binds
    # the package's attribute to the module; the public name is the object (as an eager ``from .x import
    # x`` left it), so that binding is skipped and the attribute resolves through __getattr__
    shadowed = {name for name, module in exports.items() if name == module}
    if shadowed:
        class _Package(types.ModuleType):
            def __setattr__(self, name, value):
                if name in shadowed and isinstance(value, types.ModuleType):
                    return
                super().__setattr__(name, value)

        sys.modules[package].__class__ = _Package
    return __getattr__, __dir__

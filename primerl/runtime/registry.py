"""Named extension points of the runtime: a name in the config -> the object that serves it.

An inference backend (``inference.backend``) and a launcher (``deployment.kind``) are each looked up
in a ``Registry``. A name is found, in this order:

1. registered already (the built-in modules register themselves when imported, and the registry
   imports them on its first lookup);
2. an entry point of the registry's group (``[project.entry-points."primerl.inference_backends"]``
   in a package's pyproject.toml: ``name = "package.module:Attr"``), loaded on first use;
3. a name of the form ``"package.module:Attr"``: the module is imported (it may register itself)
   and ``Attr`` is registered under that full name.

An unknown name is a ``ConfigError`` naming the config key and listing the registered names:

>>> r = Registry("colour", "paint.colour", (), "primerl.colours")
>>> r.register("red", "RED")
'RED'
>>> r.get("red")
'RED'
>>> r.get("blue")   # doctest: +SKIP
ConfigError: paint.colour: unknown colour 'blue'; registered: red

``register`` also decorates a class (the class itself is registered). Registering a name twice
with another object raises ``ValueError`` (two plugins claiming one name is a bug, not a choice).
This module imports nothing of the runtime besides ``ConfigError``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from typing import Callable, Generic, TypeVar

from primerl.runtime.config import ConfigError

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """Names -> objects for one extension point.

    what: the kind of object in messages ("inference backend"); key: the config key whose value is
    looked up ("inference.backend"); builtin_modules: modules imported on the first lookup (they call
    ``register``); entry_point_group: the ``importlib.metadata`` entry-point group searched for
    names not registered.
    """

    def __init__(self, what: str, key: str, builtin_modules: tuple[str, ...], entry_point_group: str):
        self.what = what
        self.key = key
        self.builtin_modules = tuple(builtin_modules)
        self.entry_point_group = entry_point_group
        self._items: dict[str, T] = {}
        self._builtins_loaded = False
        self._lock = threading.RLock()

    def register(self, name: str, obj: T | None = None) -> T | Callable[[T], T]:
        """Register ``obj`` under ``name`` and return it; without ``obj``, a decorator that does so.

        Registering the same object again is a no-op (a module imported twice); another object
        under a taken name raises ValueError.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} name must be a non-empty string, got {name!r}")
        if obj is None:
            def decorate(o: T) -> T:
                self.register(name, o)
                return o
            return decorate
        with self._lock:
            old = self._items.get(name)
            if old is not None and old is not obj:
                raise ValueError(f"{self.what} {name!r} is registered already ({old!r}); "
                                 f"refusing to replace it with {obj!r}")
            self._items[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plug-in's test cleaning up after itself); an unknown name raises KeyError."""
        with self._lock:
            if name not in self._items:
                raise KeyError(f"{self.what} {name!r} is not registered")
            del self._items[name]

    def _load_builtins(self) -> None:
        with self._lock:
            if self._builtins_loaded:
                return
            self._builtins_loaded = True
            try:
                for module in self.builtin_modules:
                    importlib.import_module(module)
            except BaseException:
                self._builtins_loaded = False
                raise

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.entry_point_group)}

    def _unknown(self, name: str) -> ConfigError:
        names = self.names()
        return ConfigError(f"{self.key}: unknown {self.what} {name!r}; "
                           f"registered: {', '.join(names) if names else '(none)'}")

    def get(self, name: str) -> T:
        """The object registered as ``name`` (see the module docstring for the lookup order)."""
        self._load_builtins()
        with self._lock:
            if name in self._items:
                return self._items[name]
        ep = self._entry_points().get(name)
        if ep is not None:
            obj = ep.load()
            with self._lock:
                # loading may have registered it (a module that registers itself on import)
                return self._items[name] if name in self._items else self.register(name, obj)
        if isinstance(name, str) and ":" in name:
            module, _, attr = name.partition(":")
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name is not None and module.startswith(e.name):
                    raise ConfigError(f"{self.key}: {name!r}: no module named {module!r}") from e
                raise
            try:
                obj = getattr(mod, attr)
            except AttributeError:
                raise ConfigError(f"{self.key}: {name!r}: module {module!r} has no attribute {attr!r}") from None
            with self._lock:
                return self._items[name] if name in self._items else self.register(name, obj)
        raise self._unknown(name)

    def names(self) -> list[str]:
        """Every name this registry can serve now: registered ones and entry points, sorted."""
        self._load_builtins()
        with self._lock:
            names = set(self._items)
        names.update(self._entry_points())
        return sorted(names)

    def __contains__(self, name: str) -> bool:
        return name in self.names()

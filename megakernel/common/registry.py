"""One mechanism for the project's registries (model families, layer kinds, reference layers,
executor op functions): things registered by name from the modules of one package, the package's
modules imported on first use, so adding one is adding a module."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """name -> registered thing; `find(name)` imports `<package>.<name>` (then every module of
    the package) when the name is not registered yet."""

    def __init__(self, package: str, what: str, skip: Iterable[str] = ()) -> None:
        super().__init__()
        self.package, self.what, self.skip = package, what, set(skip)
        self._loaded = False

    def add(self, name: str, item: T) -> T:
        if not name:
            raise ValueError(f"a {self.what} needs a name")
        if name in self and self[name] is not item:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self[name] = item
        return item

    def load_all(self) -> Registry[T]:
        """Import every module of the package (once) and return the registry."""
        if not self._loaded:
            pkg = importlib.import_module(self.package)
            for m in pkgutil.iter_modules(pkg.__path__):
                if m.name not in self.skip:
                    importlib.import_module(f"{self.package}.{m.name}")
            self._loaded = True
        return self

    def find(self, name: str) -> T:
        if name not in self:
            try:
                importlib.import_module(f"{self.package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{self.package}.{name}":
                    raise
        if name not in self:
            self.load_all()
        if name not in self:
            raise KeyError(f"unknown {self.what} {name!r}; known: {', '.join(sorted(self))}")
        return self[name]

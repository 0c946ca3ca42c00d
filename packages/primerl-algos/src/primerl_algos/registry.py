"""Small registries of built-in implementations, with plugins by import path.

    LOSSES = Registry("loss")

    @LOSSES.register("aipo")
    def aipo(...): ...

    LOSSES.get("aipo")                          # built-in
    LOSSES.get("my_package.losses:my_loss")     # a plugin: any importable callable

A name that is neither registered nor importable fails with the registered names listed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar, cast

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return add

    @property
    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> F:
        if name in self._items:
            return self._items[name]
        if ":" not in name:
            raise ValueError(
                f"unknown {self.kind} {name!r}: built-in ones are {', '.join(self.names)}; "
                "a plugin is given as 'package.module:function'"
            )
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{self.kind} plugin {name!r}: cannot import {module_name!r} ({err})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"{self.kind} plugin {name!r}: {module_name} has no callable {attr!r}")
        return cast(F, fn)  # a plugin's signature is checked where it is called

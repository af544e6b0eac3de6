"""Caches of pure functions of records (meshes, layouts, shapes) that ``torch.compile`` traces.

Dynamo does not look inside a ``functools.lru_cache``: it traces the wrapped function and warns
that the cache may hide a silent incorrectness. :func:`cached` keeps the cache for eager calls
and calls the function itself while compiling, where it runs once, when the graph is traced.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["cached", "Bounded", "Numbered", "cache_sizes", "clear_caches"]

_caches: list = []  # every cache made by :func:`cached`, for :func:`cache_sizes`
_tables: dict = {}  # every Bounded table, by name


def cached(maxsize: int):
    """``functools.lru_cache(maxsize)``, bypassed while compiling (a function decorator)."""

    def decorate(fn):
        hit = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return hit(*args, **kwargs)

        call.cache_clear = hit.cache_clear
        call.cache_info = hit.cache_info
        _caches.append(call)
        return call

    return decorate


class Bounded(dict):
    """A dict of at most ``maxsize`` entries, for a table the hot path reads with a plain
    ``get``: storing a new key into a full table drops the oldest entry first."""

    __slots__ = ("maxsize",)

    def __init__(self, maxsize: int, name: str) -> None:
        super().__init__()
        self.maxsize = maxsize
        _tables[name] = self

    def __setitem__(self, key, value) -> None:
        if len(self) >= self.maxsize and key not in self:
            del self[next(iter(self))]
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


class Numbered:
    """Values by number, at most ``maxsize`` of them (the oldest dropped first): how a compiled
    graph names a decision or a plan made outside it, by a constant it can hold. A value keeps
    its number while held; a number is never reused."""

    def __init__(self, maxsize: int, name: str) -> None:
        self._numbers = Bounded(maxsize, f"{name} (numbers)")
        self._values = Bounded(maxsize, f"{name} (values)")
        self._next = 0

    def number(self, key, make):
        """The number of the value held for ``key``, made by ``make()`` where there is none."""
        found = self._numbers.get(key)
        if found is None or found not in self._values:
            found, self._next = self._next, self._next + 1
            self._values[found] = make()
            self._numbers[key] = found
        return found

    def __getitem__(self, number: int):
        return self._values[number]


def cache_sizes() -> dict[str, tuple[int, int]]:
    """The entries and the bound of every cache made by :func:`cached` (by function name,
    ``module.qualname``) and of every :class:`Bounded` table (by its name): what a long run
    watches to see that the caches stay bounded."""
    sizes = {
        f"{c.__module__}.{c.__qualname__}": (c.cache_info().currsize, c.cache_info().maxsize) for c in _caches
    }
    sizes.update({name: (len(t), t.maxsize) for name, t in _tables.items()})
    return sizes


def clear_caches() -> None:
    """Empty every cache made by :func:`cached` and every :class:`Bounded` table (a long run
    that measures its own entries)."""
    for c in _caches:
        c.cache_clear()
    for t in _tables.values():
        t.clear()

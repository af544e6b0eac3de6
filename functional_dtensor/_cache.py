"""Caches of pure functions of records (meshes, layouts, shapes) that ``torch.compile`` traces.

Dynamo does not look inside a ``functools.lru_cache``: it traces the wrapped function and warns
that the cache may hide a silent incorrectness. :func:`cached` keeps the cache for eager calls
and calls the function itself while compiling, where it runs once, when the graph is traced.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["cached", "cache_sizes", "clear_caches"]

_caches: list = []  # every cache made by :func:`cached`, for :func:`cache_sizes`


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


def cache_sizes() -> dict[str, tuple[int, int]]:
    """The entries and the bound of every cache made by :func:`cached`, by function name
    (``module.qualname``): what a long run watches to see that the caches stay bounded."""
    return {
        f"{c.__module__}.{c.__qualname__}": (c.cache_info().currsize, c.cache_info().maxsize) for c in _caches
    }


def clear_caches() -> None:
    """Empty every cache made by :func:`cached` (a long run that measures its own entries)."""
    for c in _caches:
        c.cache_clear()

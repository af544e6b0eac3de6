"""Caches of pure functions of records (meshes, layouts, shapes) that ``torch.compile`` traces.

Dynamo does not look inside a ``functools.lru_cache``: it traces the wrapped function and warns
that the cache may hide a silent incorrectness. :func:`cached` keeps the cache for eager calls
and calls the function itself while compiling, where it runs once, when the graph is traced.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["cached"]


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
        return call

    return decorate

"""Public classes carry the public module path, so that what they pickle (and what tracebacks
print) names ``functional_dtensor.P``, not the private module that defines it: saved objects
survive a reorganisation of the private modules."""

from __future__ import annotations

__all__ = ["public"]

PACKAGE = "functional_dtensor"


def public(cls: type) -> type:
    """Name ``cls`` by the package it is exported from (a class decorator)."""
    cls.__module__ = PACKAGE
    return cls

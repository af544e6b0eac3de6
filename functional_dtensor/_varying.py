"""Which mesh axes a local value varies over (JAX's "vma"), recorded on the tensor itself.

Inside a ``shard_map`` with ``check_rep`` every local tensor carries the set of mesh axes along
which devices may hold different values; a tensor without the record is the same on every device
(a constant, a captured value). Collectives and the tracker in :mod:`._tracking` set it.
"""

from __future__ import annotations

import torch

__all__ = ["axes_varying", "tag"]

_ATTRIBUTE = "_fd_varying"
_NONE: frozenset[str] = frozenset()


def axes_varying(x: torch.Tensor) -> frozenset[str]:
    return getattr(x, _ATTRIBUTE, _NONE)


def tag(x: torch.Tensor, axes: frozenset[str] | None) -> torch.Tensor:
    """Record that ``x`` varies over ``axes`` (``None``: tracking is off; leave ``x`` alone)."""
    if axes is not None and (axes or hasattr(x, _ATTRIBUTE)):
        setattr(x, _ATTRIBUTE, frozenset(axes))
    return x

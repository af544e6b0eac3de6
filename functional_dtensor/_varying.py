"""Which mesh axes a local value varies over (JAX's "vma"), recorded on the tensor itself.

Inside a ``shard_map`` with ``check_rep`` every local tensor carries the set of mesh axes along
which devices may hold different values; a tensor without the record is the same on every device
(a constant, a captured value). Collectives and the tracker in :mod:`._tracking` set it.

On a simulated mesh of one axis the device vmap keeps this record itself: a value batched over
the devices varies over the axis, an unbatched one is the same on every device (held once).
A function run there without the tracker (``Frame.batched_varying``) is read by
:func:`varying_in`.
"""

from __future__ import annotations

import torch

from ._functorch import batched_at, level_of_eager

__all__ = ["axes_varying", "tag", "varying_in"]

_ATTRIBUTE = "_fd_varying"
_NONE: frozenset[str] = frozenset()


def axes_varying(x: torch.Tensor) -> frozenset[str]:
    return getattr(x, _ATTRIBUTE, _NONE)


def varying_in(frame, x: torch.Tensor) -> frozenset[str]:
    """The axes ``x`` varies over in ``frame``'s per-device function (a collective's input, an
    output): its record, or where no tracker runs, whether the device vmap batches it."""
    axes = frame.batched_varying
    if axes is None:
        return axes_varying(x)
    level = frame.device_level  # (never while compiling: the first test is functorch's own)
    return axes if level_of_eager(x) == level or batched_at(x, level) else _NONE


def tag(x: torch.Tensor, axes: frozenset[str] | None) -> torch.Tensor:
    """Record that ``x`` varies over ``axes`` (``None``: tracking is off; leave ``x`` alone)."""
    if axes is not None and (axes or hasattr(x, _ATTRIBUTE)):
        setattr(x, _ATTRIBUTE, frozenset(axes))
    return x

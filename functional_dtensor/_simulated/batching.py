"""Batching rules of the simulated device vmap that beat functorch's generic ones.

A replicated activation times column blocks of a weight (tensor parallelism's column-parallel
matmul) is, over all devices, one matmul with the whole weight: ``x @ [w_0 | w_1 | ...]``. When the
device dim of the stacked blocks folds into their columns without a copy (the storage of a
column-split weight is a view of it), the rule runs that one matmul and views its result per
device. Functorch's rule instead runs ``x`` against a batch of blocks, whose 2-D @ 3-D matmul
transposes its result into a copy; its backward copies again.

Each rule in :data:`RULES` takes the device vmap level and the op's arguments (the device level
the innermost transform) and returns the batched result, or ``None`` where it does not apply.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .functorch import add_batch_dim, below_current_level, level_of, unwrap_batched

__all__ = ["by_rule", "BatchingRules"]


def _replicated_times_blocks(level: int, args, kwargs, *, matrix_only: bool):
    """``x @ w`` for ``x`` not batched over the devices and ``w`` a device-batched matrix."""
    if kwargs or len(args) != 2:
        return None
    x, w = args
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return None
    if level_of(x) >= level or level_of(w) != level:
        return None
    if w.dim() != 2 or x.dim() == 0 or (matrix_only and x.dim() != 2) or x.shape[-1] != w.shape[0]:
        return None
    blocks, device_dim = unwrap_batched(w, level)
    if blocks.dim() != 3:  # batched at this level over more than the devices
        return None
    blocks = blocks.movedim(device_dim, 1)  # (k, n, m)
    k, n, m = blocks.shape
    if blocks.stride(1) != m * blocks.stride(2):  # the device dim does not fold into the columns
        return None
    out = below_current_level(lambda: torch.matmul(x, blocks.reshape(k, n * m)).unflatten(-1, (n, m)))
    return add_batch_dim(out, out.dim() - 2, level)


def _matmul(level, args, kwargs):
    return _replicated_times_blocks(level, args, kwargs, matrix_only=False)


def _mm(level, args, kwargs):
    return _replicated_times_blocks(level, args, kwargs, matrix_only=True)


RULES = {
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.mm: _mm,
    torch.Tensor.mm: _mm,
}


def by_rule(func, level: int, args, kwargs):
    """``func(*args, **kwargs)`` computed by its rule, or ``None`` where no rule applies."""
    rule = RULES.get(func)
    if rule is None or torch.compiler.is_compiling():  # the compiler plans its own matmuls
        return None
    return rule(level, args, kwargs)


class BatchingRules(TorchFunctionMode):
    """Apply :data:`RULES` to the ops of a per-device function running at the device ``level``
    (the replication tracker applies them itself)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = by_rule(func, self.level, args, kwargs)
        return func(*args, **kwargs) if out is None else out

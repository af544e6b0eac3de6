"""Batching rules of the simulated device vmap that beat functorch's generic ones.

A replicated activation times column blocks of a weight (tensor parallelism's column-parallel
matmul) is, over all devices, one matmul with the whole weight: ``x @ [w_0 | w_1 | ...]``. When the
device dim of the stacked blocks folds into their columns without a copy (the storage of a
column-split weight is a view of it), the rule runs that one matmul and views its result per
device. Functorch's rule instead runs ``x`` against a batch of blocks, whose 2-D @ 3-D matmul
transposes its result into a copy; its backward copies again.

Under ``torch.compile`` the result leads with its device dim, and a product of two device-batched
matrices (the row-parallel matmul after it) runs as one ``bmm`` of them: functorch's rule traces
``matmul``'s broadcast (a view) between the operand and the ``bmm``, and AOT autograd's partitioner,
which reads a value used only through views as free to recompute, then saves the activation's
``relu`` mask for the backward as a ``bool`` tensor instead of the activation (inductor's CPU kernel
that stores such a mask took 20 times eager torch's comparison).

``scaled_dot_product_attention`` has no batching rule in torch (it would run once per device,
with a warning): its rule runs it once, the device dim leading as one more batch dim.

Each rule in :data:`RULES` takes the device vmap's level and size and the op's arguments (the
device level the innermost transform) and returns the batched result, or ``None`` where it does
not apply. The matmul rules run under ``torch.compile`` too (:data:`TRACED`)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .._functorch import add_batch_dim, below_current_level, level_of, remove_batch_dim, unwrap_batched

__all__ = ["by_rule", "BatchingRules"]


def _replicated_times_blocks(level: int, size: int, args, kwargs, *, matrix_only: bool):
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
    if torch.compiler.is_compiling():  # (functorch's unwrapping is not traced)
        blocks = remove_batch_dim(w, level, size).movedim(0, 1)
    else:
        blocks, device_dim = unwrap_batched(w, level)
        if blocks.dim() != 3:  # batched at this level over more than the devices
            return None
        blocks = blocks.movedim(device_dim, 1)  # (k, n, m)
    k, n, m = blocks.shape
    if blocks.stride(1) != m * blocks.stride(2):  # the device dim does not fold into the columns
        return None
    out = below_current_level(
        lambda: torch.matmul(x, blocks.reshape(k, n * m)).unflatten(-1, (n, m)).movedim(-2, 0)
    )
    return add_batch_dim(out, 0, level)


def _blocks_times_blocks(level: int, size: int, args, kwargs):
    """``x @ w`` for two device-batched matrices, traced as one ``bmm`` of them (eagerly,
    functorch's rule runs the same ``bmm``)."""
    if not torch.compiler.is_compiling() or kwargs or len(args) != 2:
        return None
    x, w = args
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return None
    if level_of(x) != level or level_of(w) != level or x.dim() != 2 or w.dim() != 2:
        return None
    if x.shape[1] != w.shape[0] or x.dtype != w.dtype or not x.is_floating_point():
        return None  # (torch's own error, or functorch's rule)
    x, w = remove_batch_dim(x, level, size), remove_batch_dim(w, level, size)
    return add_batch_dim(below_current_level(torch.bmm, x, w), 0, level)


def _matrix_product(level, size, args, kwargs, *, matrix_only: bool):
    out = _replicated_times_blocks(level, size, args, kwargs, matrix_only=matrix_only)
    return _blocks_times_blocks(level, size, args, kwargs) if out is None else out


def _matmul(level, size, args, kwargs):
    return _matrix_product(level, size, args, kwargs, matrix_only=False)


def _mm(level, size, args, kwargs):
    return _matrix_product(level, size, args, kwargs, matrix_only=True)


def _attention(level, size, args, kwargs):
    """``scaled_dot_product_attention`` of device-batched values (torch has no batching rule for
    it and would loop over the devices): the device dim leads as one more batch dim."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args)) | kwargs
    if bound.get("dropout_p", 0.0) or not all([isinstance(bound.get(n), torch.Tensor) for n in names[:3]]):
        return None
    tensors = [n for n in names[:4] if isinstance(bound.get(n), torch.Tensor)]
    levels = [level_of(bound[n]) for n in tensors]
    if level not in levels or max(levels) > level:
        return None
    below, dim = unwrap_batched(bound[tensors[levels.index(level)]], level)
    size = below.shape[dim]

    def lead(x):  # the value below the vmap, the device dim first
        if level_of(x) == level:
            below, dim = unwrap_batched(x, level)
            if dim is not None:
                return below.movedim(dim, 0)
            x = below
        return x.expand(size, *x.shape)

    def run():
        inputs = {n: lead(bound[n]) for n in tensors}
        query = inputs["query"]
        mask, ndim = inputs.get("attn_mask"), query.dim()
        if mask is not None:  # broadcast against (devices, ..., L, S)
            mask = mask.reshape(mask.shape[0], *[1] * (ndim - mask.dim()), *mask.shape[1:])
            inputs["attn_mask"] = mask.expand(*query.shape[:-2], *mask.shape[-2:])
        fold = _fold_dim(query) if ndim > 4 else None  # torch's fused kernels take 4 dims
        if fold is not None:
            inputs = {n: x.movedim(0, fold).flatten(fold, fold + 1) for n, x in inputs.items()}
        rest = {n: v for n, v in bound.items() if n not in inputs}
        out = torch.nn.functional.scaled_dot_product_attention(**inputs, **rest)
        if fold is None:
            return out
        return out.unflatten(fold, (query.shape[0], query.shape[fold + 1])).movedim(fold, 0)

    return add_batch_dim(below_current_level(run), 0, level)


def _fold_dim(x: torch.Tensor) -> int:
    """The batch dim (0 or 1, of one device's value) that the device dim folds into: where the
    two make one dim of the storage without a copy (the heads, for a value split over them)."""
    for dim in (1, 0):
        moved = x.movedim(0, dim)
        if moved.stride(dim) == moved.stride(dim + 1) * moved.shape[dim + 1]:
            return dim
    return 0


RULES = {
    torch.nn.functional.scaled_dot_product_attention: _attention,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.mm: _mm,
    torch.Tensor.mm: _mm,
}


#: the rules that trace under ``torch.compile`` (the others unwrap functorch's wrappers, which
#: Dynamo does not trace; the compiled graph then batches those ops by functorch's rules)
TRACED = frozenset([_matmul, _mm])


def by_rule(func, level: int, size: int, args, kwargs):
    """``func(*args, **kwargs)`` computed by its rule, or ``None`` where no rule applies (the
    device vmap at ``level`` over ``size`` devices)."""
    rule = RULES.get(func)
    if rule is None or (rule not in TRACED and torch.compiler.is_compiling()):
        return None
    return rule(level, size, args, kwargs)


class BatchingRules(TorchFunctionMode):
    """Apply :data:`RULES` to the ops of a per-device function running at the device ``level``
    (the replication tracker applies them itself)."""

    def __init__(self, level: int, size: int) -> None:
        super().__init__()
        self.level, self.size = level, size
        self.ruled_seen = False  # whether a rule's op ran (see shard_map's bare calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in RULES:  # (most ops: vmap's own batching)
            return func(*args, **kwargs)
        self.ruled_seen = True
        out = by_rule(func, self.level, self.size, args, kwargs)
        return func(*args, **kwargs) if out is None else out

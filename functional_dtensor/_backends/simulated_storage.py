"""How the simulated backend stores a global value: one stacked tensor for all devices.

A value laid out by ``layout`` on a simulated mesh of ``n`` devices is a tensor of shape
``(n, *padded_shape)``: row ``k`` is device ``k``'s shard (flat, row-major mesh order), padded
with zeros at the end of each dim up to the largest shard. True shard sizes come from the
layout and the global shape (:func:`shard_table`), so one tensor op serves every device and the
Python work per op does not grow with the mesh.

Evenly split values are built from views (reshape, permute, expand), so a replicated value costs
no copy; unevenly split ones by one gather through cached index tables.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .._layout import Layout
from .._placements import Partial, Shard
from .._sharding import shard_table

__all__ = [
    "stack",
    "unstack",
    "assemble",
    "shard",
    "from_shards",
    "reduce_partial",
    "distinct_shards",
    "materialize",
]


def stack(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Every device's shard of the global ``tensor``, stacked: ``(n, *padded_shape)``."""
    shape = tuple(tensor.shape)
    steps = _stack_steps(layout, shape)
    if steps is not None:
        return _run_steps(tensor, steps)
    table = shard_table(layout, shape)
    mesh = layout.mesh
    if table.is_even:
        blocks = _split_even(tensor, layout, table.padded_shape)
    else:
        blocks = _gather_uneven(tensor, layout).reshape(*mesh.shape, *table.padded_shape)
    blocks = _partition_partial(blocks, layout)
    return blocks.reshape(mesh.size, *table.padded_shape)


def unstack(stacked: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor: Partial axes reduced, replicas read from coordinate 0."""
    steps = _unstack_steps(layout, global_shape)
    if steps is not None:
        return _run_steps(stacked, steps)
    table = shard_table(layout, global_shape)
    mesh = layout.mesh
    blocks = stacked.reshape(*mesh.shape, *table.padded_shape)
    blocks = reduce_partial(blocks, layout)
    for axis, placement in enumerate(layout.placements):
        if not isinstance(placement, Shard):
            blocks = blocks.narrow(axis, 0, 1)
    return assemble(blocks, layout, global_shape)


def _run_steps(tensor: torch.Tensor, steps) -> torch.Tensor:
    for method, args in steps:
        tensor = method(tensor, *args)
    return tensor


def _steps(shape: tuple[int, ...], ops) -> tuple:
    """``(Tensor method, args)`` pairs for ``ops``, without those that leave the tensor as is."""
    steps = []
    for method, args in ops:
        if method is torch.Tensor.reshape and tuple(args) == shape:
            continue
        if method is torch.Tensor.permute and tuple(args) == tuple(range(len(shape))):
            continue
        if method is torch.Tensor.reshape:
            shape = tuple(args)
        elif method is torch.Tensor.permute:
            shape = tuple(shape[i] for i in args)
        elif method is torch.Tensor.expand:
            shape = tuple(args)
        elif method is torch.Tensor.select:
            shape = shape[: args[0]] + shape[args[0] + 1 :]
        steps.append((method, tuple(args)))
    return tuple(steps)


@lru_cache(maxsize=1024)
def _stack_steps(layout: Layout, shape: tuple[int, ...]):
    """The view ops from an evenly split global value without Partial axes to its storage
    (None for the other layouts), computed once per layout and shape."""
    table = shard_table(layout, shape)
    if not table.is_even or layout.has_partial:
        return None
    n, local = layout.mesh.size, table.padded_shape
    if layout.is_replicated:
        return ((torch.Tensor.expand, (n, *shape)),)
    view, order, blocks, expanded = _split_recipe(layout, local)
    ops = [(torch.Tensor.reshape, view), (torch.Tensor.permute, order)]
    if not layout.is_fully_sharded:
        ops += [(torch.Tensor.reshape, blocks), (torch.Tensor.expand, expanded)]
    return _steps(shape, [*ops, (torch.Tensor.reshape, (n, *local))])


@lru_cache(maxsize=1024)
def _unstack_steps(layout: Layout, shape: tuple[int, ...]):
    """The view ops from the storage of an evenly split value without Partial axes to the
    global value, replicas read from coordinate 0 (None for the other layouts)."""
    table = shard_table(layout, shape)
    if not table.is_even or layout.has_partial:
        return None
    mesh, local = layout.mesh, table.padded_shape
    if layout.is_replicated:
        return ((torch.Tensor.select, (0, 0)),)
    ops = [(torch.Tensor.reshape, (*mesh.shape, *local))]
    for axis in reversed(range(mesh.ndim)):
        if not isinstance(layout.placements[axis], Shard):
            ops.append((torch.Tensor.select, (axis, 0)))
    view, order = _merge_recipe(layout, local, len(shape))
    ops += [(torch.Tensor.permute, order), (torch.Tensor.reshape, shape)]
    return _steps((mesh.size, *local), ops)


def assemble(blocks: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor from ``(*mesh.shape, *padded_shape)`` blocks whose non-Shard mesh axes
    have size 1 (one device per distinct shard)."""
    table = shard_table(layout, global_shape)
    if table.is_even:
        return _merge_even(blocks, layout, table.padded_shape, global_shape)
    return _scatter_uneven(blocks, layout, global_shape)


def shard(stacked: torch.Tensor, layout: Layout, global_shape: tuple[int, ...], device: int) -> torch.Tensor:
    """Device ``device``'s shard, without padding."""
    local_shape = shard_table(layout, global_shape).local_shapes[device]
    return stacked[device][tuple(slice(0, s) for s in local_shape)]


def from_shards(shards, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """Stack per-device shards (already checked against the layout), padding short ones."""
    padded = shard_table(layout, global_shape).padded_shape
    rows = []
    for local in shards:
        pad = []
        for size, target in zip(reversed(local.shape), reversed(padded)):
            pad += [0, target - size]
        rows.append(torch.nn.functional.pad(local, pad) if any(pad) else local)
    return torch.stack(rows)


def reduce_partial(blocks: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Reduce the Partial mesh axes of ``(*mesh.shape, ...)`` blocks (keeping them, size 1)."""
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            if placement.op == "sum":
                blocks = blocks.sum(axis, keepdim=True, dtype=blocks.dtype)
            elif placement.op == "avg":
                total = blocks.sum(axis, keepdim=True, dtype=blocks.dtype)
                size = layout.mesh.shape[axis]
                floating = blocks.is_floating_point() or blocks.is_complex()
                blocks = total / size if floating else total.div(size, rounding_mode="floor")
            elif placement.op == "max":
                blocks = blocks.amax(axis, keepdim=True)
            else:
                blocks = blocks.amin(axis, keepdim=True)
    return blocks


def _partition_partial(blocks: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Split replicated blocks into partial values that reduce back to them (as DTensor: a sum
    is divided evenly for floating dtypes, held by coordinate 0 for integer dtypes)."""
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial) and placement.op == "sum":
            size = layout.mesh.shape[axis]
            if blocks.is_floating_point() or blocks.is_complex():
                blocks = blocks / size
            else:
                mask = torch.zeros(size, dtype=blocks.dtype, device=blocks.device)
                mask[0] = 1
                blocks = blocks * mask.view(-1, *[1] * (blocks.dim() - axis - 1))
    return blocks


def _split_even(tensor: torch.Tensor, layout: Layout, local_shape) -> torch.Tensor:
    """``(*mesh.shape, *local_shape)`` views of an evenly split tensor."""
    view, order, blocks, expanded = _split_recipe(layout, tuple(local_shape))
    return tensor.reshape(view).permute(order).reshape(blocks).expand(expanded)


@lru_cache(maxsize=1024)
def _split_recipe(layout: Layout, local_shape: tuple[int, ...]):
    """The view ops of :func:`_split_even`: each dim split into its mesh axes and its block,
    the mesh axes moved to the front in mesh order, the replicated axes inserted as size 1."""
    mesh = layout.mesh
    view, axis_at = [], {}
    for dim in range(len(local_shape)):
        for axis in layout.sharding_axes(dim):
            axis_at[axis] = len(view)
            view.append(mesh.shape[axis])
        view.append(local_shape[dim])
    local_at = [i for i in range(len(view)) if i not in axis_at.values()]
    order = (*[axis_at[a] for a in sorted(axis_at)], *local_at)
    sizes = [mesh.shape[a] if a in axis_at else 1 for a in range(mesh.ndim)]
    return tuple(view), order, (*sizes, *local_shape), (*mesh.shape, *local_shape)


def _merge_even(blocks, layout, local_shape, global_shape) -> torch.Tensor:
    """Inverse of :func:`_split_even` on blocks whose non-Shard axes have size 1."""
    view, order = _merge_recipe(layout, tuple(local_shape), len(global_shape))
    return blocks.reshape(view).permute(order).reshape(global_shape)


@lru_cache(maxsize=1024)
def _merge_recipe(layout: Layout, local_shape: tuple[int, ...], ndim: int):
    sharding = [a for a, p in enumerate(layout.placements) if isinstance(p, Shard)]
    order = []
    for dim in range(ndim):
        order += [sharding.index(a) for a in layout.sharding_axes(dim)]
        order.append(len(sharding) + dim)
    return (*[layout.mesh.shape[a] for a in sharding], *local_shape), tuple(order)


@lru_cache(maxsize=256)
def _index_tables(layout: Layout, global_shape: tuple[int, ...], devices: tuple[int, ...], device: str):
    """Per-dim gather indices ``(len(devices), padded)`` into the global tensor padded by one
    slot per dim (the slot at index ``size`` stands for padding)."""
    table = shard_table(layout, global_shape)
    tables = []
    for dim, size in enumerate(global_shape):
        rows = []
        for k in devices:
            length, start = table.local_shapes[k][dim], table.offsets[k][dim]
            rows.append([start + j if j < length else size for j in range(table.padded_shape[dim])])
        index = torch.tensor(rows, dtype=torch.long, device=device).reshape(len(devices), -1)
        shape = [len(devices)] + [1] * len(global_shape)
        shape[dim + 1] = table.padded_shape[dim]
        tables.append(index.view(shape))
    return tuple(tables)


def _gather_uneven(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    devices = tuple(range(layout.mesh.size))
    index = _index_tables(layout, tuple(tensor.shape), devices, str(tensor.device))
    padded = torch.nn.functional.pad(tensor, [0, 1] * tensor.dim())
    return padded[index]


def _scatter_uneven(blocks: torch.Tensor, layout: Layout, global_shape) -> torch.Tensor:
    """Write blocks whose non-Shard axes have size 1 back into a global tensor."""
    mesh = layout.mesh
    sharding = [a for a, p in enumerate(layout.placements) if isinstance(p, Shard)]
    devices = tuple(
        d
        for d in range(mesh.size)
        if all(c == 0 for a, c in enumerate(mesh.coordinate(d)) if a not in sharding)
    )
    index = _index_tables(layout, global_shape, devices, str(blocks.device))
    values = blocks.reshape(len(devices), *blocks.shape[mesh.ndim :])
    out = values.new_zeros([s + 1 for s in global_shape]).index_put(index, values)
    return out[tuple(slice(0, s) for s in global_shape)]


def distinct_shards(layout: Layout, global_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sizes of the mesh axes that split the value (1 for the others) and the padded shard
    shape: ``(*sizes, *padded)`` holds one block per distinct shard, replicas sharing theirs."""
    sizes = tuple(
        layout.mesh.shape[a] if isinstance(p, Shard) else 1 for a, p in enumerate(layout.placements)
    )
    return sizes, shard_table(layout, global_shape).padded_shape


def materialize(layout: Layout, global_shape: tuple[int, ...], blocks: torch.Tensor) -> torch.Tensor:
    """Storage from ``blocks`` of shape :func:`distinct_shards` (one per distinct shard), with
    padding zeroed and Partial axes partitioned as :func:`stack` does."""
    mesh = layout.mesh
    table = shard_table(layout, global_shape)
    blocks = blocks.expand(*mesh.shape, *table.padded_shape)
    blocks = _partition_partial(blocks, layout).reshape(mesh.size, *table.padded_shape)
    if not table.is_even:
        blocks = blocks * _valid_mask(layout, global_shape, str(blocks.device))
    return blocks


@lru_cache(maxsize=256)
def _valid_mask(layout: Layout, global_shape: tuple[int, ...], device: str) -> torch.Tensor:
    """``(n, *padded_shape)``: True where a device's padded shard holds real data."""
    table = shard_table(layout, global_shape)
    n, ndim = layout.mesh.size, len(global_shape)
    sizes = torch.tensor(table.local_shapes, dtype=torch.long, device=device).reshape(n, ndim)
    mask = torch.ones((n, *table.padded_shape), dtype=torch.bool, device=device)
    for dim, padded in enumerate(table.padded_shape):
        shape = [1] * (ndim + 1)
        shape[dim + 1] = padded
        positions = torch.arange(padded, device=device).view(shape)
        mask = mask & (positions < sizes[:, dim].view(n, *[1] * ndim))
    return mask

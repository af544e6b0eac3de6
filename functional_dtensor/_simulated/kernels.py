"""The kernels of the simulated backend: batched tensor ops across the device dim.

Every kernel takes the stacked per-device values ``x`` of shape ``(n, *local)`` (row-major mesh
order) and returns the stacked results. The mesh axes a collective runs over are brought next
to each other and flattened, giving the canonical form ``(rest, group, *local)``: ``group``
indexes a device within its group (major axis first, in the order the axes are given) and
``rest`` the groups. Each kernel is then one or two tensor ops, whatever the number of devices.
"""

from __future__ import annotations

import math

import torch

from .. import _blocks as blocks
from .._autograd import differentiated
from .._cache import cached
from .._mesh import DeviceMesh

__all__ = [
    "all_reduce",
    "all_gather",
    "all_reduce_held",
    "all_gather_held",
    "spread_held",
    "slice_held",
    "reduce_scatter",
    "all_to_all",
    "permute",
    "axis_index",
    "slice_blocks",
    "partition",
    "reduce_broadcast",
]


@cached(1024)
def _grouping(mesh: DeviceMesh, axes: tuple[str, ...]):
    """The mesh axes reordered as (the others, ``axes`` in the order given), and the sizes of
    the two groups: ``(order, rest, group)``."""
    positions = [mesh.axis_position(a) for a in axes]
    others = [p for p in range(mesh.ndim) if p not in positions]
    order = tuple(others + positions)
    rest = math.prod([mesh.shape[p] for p in others])
    return order, rest, math.prod([mesh.shape[p] for p in positions])


def _to_groups(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...]):
    order, rest, group = _grouping(mesh, axes)
    local = x.shape[1:]
    grid = x.reshape(*mesh.shape, *local)
    if order != tuple(range(mesh.ndim)):
        grid = grid.permute(*order, *range(mesh.ndim, grid.dim()))
    return grid.reshape(rest, group, *local), order


def _from_groups(y: torch.Tensor, mesh: DeviceMesh, order: tuple[int, ...], block=None) -> torch.Tensor:
    """``y`` in the canonical form, any strides (an expanded or moved view) -> the stacked
    storage in mesh order, its blocks reshaped to ``block`` (default: as they are): one copy
    at most, made by the last reshape, contiguous."""
    local = y.shape[2:]
    grid = y.reshape(*[mesh.shape[p] for p in order], *local)  # splits dims: a view
    if order != tuple(range(mesh.ndim)):
        inverse = sorted(range(mesh.ndim), key=order.__getitem__)
        grid = grid.permute(*inverse, *range(mesh.ndim, grid.dim()))
    return grid.reshape(mesh.size, *(local if block is None else block)).contiguous()


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str = "sum") -> torch.Tensor:
    """Reduced on the mesh grid over the axes' dims, then one copy to every device, in ``x``'s
    memory order (a transposed gradient stays transposed: no transposing copy)."""
    order = blocks.memory_order(x)  # None: x is in memory order already
    if order is not None:  # the device dim stays first (it may not be outermost for views)
        x = x.permute(0, *[d for d in order if d != 0])
    grid = x.reshape(*mesh.shape, *x.shape[1:])
    dims = tuple(sorted([mesh.axis_position(a) for a in axes]))
    if op == "sum" and blocks.block_numel(x) < _ONE_SUM_BELOW and x.dtype != torch.bool:
        # small blocks: one sum, one copy to every device (the fewest kernels)
        out = grid.sum(dims, keepdim=True, dtype=x.dtype).expand(grid.shape).contiguous().view(x.shape)
    elif op == "sum" and len(dims) == 1 and x.dtype != torch.bool and not differentiated(x):  # (out= is not)
        out = _summed_into_first(grid, dims[0]).view(x.shape)
    else:
        out = blocks.reduce(grid, op, dims, keepdim=True).expand(grid.shape).contiguous().view(x.shape)
    if order is None:
        return out
    return out.permute(sorted(range(x.dim()), key=[0, *[d for d in order if d != 0]].__getitem__))


#: elements of a device's block below which an all-reduce's sum is one kernel: there the kernels'
#: Python outweighs the sum's zero fill and the copies it saves
_ONE_SUM_BELOW = 1 << 12


def _summed_into_first(grid: torch.Tensor, dim: int) -> torch.Tensor:
    """``grid`` summed over ``dim``, the sum on every coordinate of it: written once into the
    first coordinate, then copied to the others (no temporary sum written, then copied to all)."""
    out = torch.empty(grid.shape, dtype=grid.dtype, device=grid.device)
    first, size = out.narrow(dim, 0, 1), grid.shape[dim]
    if size == 2:  # one add (as blocks.reduce)
        torch.add(grid.narrow(dim, 0, 1), grid.narrow(dim, 1, 1), out=first)
    else:
        torch.sum(grid, dim, keepdim=True, dtype=grid.dtype, out=first)
    rest = out.narrow(dim, 1, size - 1)
    rest.copy_(first.expand(rest.shape))
    return out


# Blocks held once (see .storage.Held) lie on a ``grid``: the mesh's shape, one at the axes
# they are held along. The kernels below write each distinct result once.


def all_reduce_held(
    held: torch.Tensor, grid: tuple[int, ...], mesh: DeviceMesh, axes, op: str
) -> torch.Tensor:
    """Held blocks reduced over the axes' dims of their grid."""
    x = held.reshape(*grid, *held.shape[1:])
    dims = tuple(sorted([mesh.axis_position(a) for a in axes]))
    out = blocks.reduce(x, op, dims, keepdim=True)
    return out.reshape(math.prod(out.shape[: len(grid)]), *held.shape[1:])


def spread_held(held: torch.Tensor, grid: tuple[int, ...], mesh: DeviceMesh, axes) -> torch.Tensor:
    """The transpose of :func:`all_reduce_held`'s sum: each result for every part of it."""
    reduced = tuple([1 if mesh.axis_names[a] in axes else n for a, n in enumerate(grid)])
    x = held.reshape(*reduced, *held.shape[1:]).expand(*grid, *held.shape[1:])
    return x.reshape(math.prod(grid), *held.shape[1:])


def all_gather_held(
    held: torch.Tensor, grid: tuple[int, ...], mesh: DeviceMesh, axes, dim: int
) -> torch.Tensor:
    """Held blocks concatenated at ``dim`` over the one axis of ``axes``."""
    x = held.reshape(*grid, *held.shape[1:])
    moved = x.movedim(mesh.axis_position(axes[0]), len(grid) - 1 + dim)
    block = list(held.shape[1:])
    block[dim] *= mesh.axis_size(axes)
    return moved.reshape(held.shape[0] // mesh.axis_size(axes), *block)


def slice_held(held: torch.Tensor, grid: tuple[int, ...], mesh: DeviceMesh, axes, dim: int) -> torch.Tensor:
    """The transpose of :func:`all_gather_held`: each device's slice at ``dim``."""
    axis, k = mesh.axis_position(axes[0]), mesh.axis_size(axes)
    block = list(held.shape[1:])
    block[dim : dim + 1] = [k, block[dim] // k]
    rest = [n for a, n in enumerate(grid) if a != axis]
    x = held.reshape(*rest, *block).movedim(len(rest) + dim, axis)
    return x.reshape(math.prod(grid), *x.shape[len(grid) :])


def all_gather(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool
) -> torch.Tensor:
    """Every device gets the blocks of its group stacked (or, tiled, concatenated) at ``dim``."""
    groups, order = _to_groups(x, mesh, axes)
    rest, size, local = groups.shape[0], groups.shape[1], groups.shape[2:]
    gathered = groups.movedim(1, 1 + dim)  # (rest, *local[:dim], size, *local[dim:])
    gathered = gathered.unsqueeze(1).expand(rest, size, *gathered.shape[1:])  # a view
    block = (*local[:dim], size * local[dim], *local[dim + 1 :]) if tiled else None
    return _from_groups(gathered, mesh, order, block)  # the one copy


def reduce_scatter(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool
) -> torch.Tensor:
    """Sum over the group; device ``i`` keeps block ``i`` of dim ``dim`` (removed unless tiled).
    Where autograd does not see it, the sum is written straight into the devices' blocks (no
    sum written first, then copied into them)."""
    groups, order = _to_groups(x, mesh, axes)
    rest, size, local = groups.shape[0], groups.shape[1], groups.shape[2:]
    if tiled:  # (rest, size: the parts summed, *local with size blocks of dim)
        groups = groups.reshape(rest, size, *local[:dim], size, local[dim] // size, *local[dim + 1 :])
    kept = groups.movedim(2 + dim, 2)  # (rest, parts, device's block index, *block)
    if x.is_contiguous() and x.dtype != torch.bool and not differentiated(x):
        out = x.new_empty((mesh.size, *kept.shape[3:]))
        into = _canonical_view(out, mesh, order, rest, size)
        if into is not None:
            if size == 2:  # (one add, as blocks.reduce)
                torch.add(kept[:, 0], kept[:, 1], out=into)
            else:
                torch.sum(kept, 1, dtype=x.dtype, out=into)
            return out
    return _from_groups(blocks.reduce(kept, "sum", 1), mesh, order)


def _canonical_view(out: torch.Tensor, mesh: DeviceMesh, order, rest: int, group: int):
    """``out``, stacked in mesh order, as a view in the canonical form ``(rest, group,
    *block)``; None where that form is no view of it (groups interleaved on a mesh of three
    or more axes)."""
    grid = out.view(*mesh.shape, *out.shape[1:])
    if order != tuple(range(mesh.ndim)):
        grid = grid.permute(*order, *range(mesh.ndim, grid.dim()))
    try:
        return grid.view(rest, group, *out.shape[1:])
    except RuntimeError:
        return None


def all_to_all(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], split: int, concat: int, tiled: bool
) -> torch.Tensor:
    """Device ``i`` sends block ``j`` of dim ``split`` to device ``j``, which puts the blocks it
    receives in source order at dim ``concat`` (a new dim unless tiled)."""
    groups, order = _to_groups(x, mesh, axes)
    rest, size, local = groups.shape[0], groups.shape[1], list(groups.shape[2:])
    if tiled:
        groups = groups.reshape(rest, size, *local[:split], size, local[split] // size, *local[split + 1 :])
    swapped = groups.movedim(2 + split, 1)  # (rest, dst, src, *local without the block index)
    received = swapped.movedim(2, 2 + concat)
    block = list(received.shape[2:])
    if tiled:
        block[concat : concat + 2] = [block[concat] * block[concat + 1]]
    return _from_groups(received, mesh, order, block)


def permute(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """Device ``dst`` receives the value of ``src`` for each pair; the others receive zeros."""
    groups, order = _to_groups(x, mesh, axes)
    padded = torch.cat([groups, groups.new_zeros(groups[:, :1].shape)], dim=1)
    index = _sources(perm, groups.shape[1], str(x.device))
    return _from_groups(padded.index_select(1, index), mesh, order)


@cached(1024)
def _sources(perm: tuple[tuple[int, int], ...], size: int, device: str) -> torch.Tensor:
    """For each device of a group, where its value comes from (``size``: nowhere, zeros)."""
    source = [size] * size
    for src, dst in perm:
        source[dst] = src
    return torch.tensor(source, device=device)


def axis_index(mesh: DeviceMesh, axes: tuple[str, ...], device: str) -> torch.Tensor:
    """``(n,)``: each device's index within its group over ``axes`` (major axis first)."""
    return _axis_index(mesh, axes, str(device)).clone()


@cached(1024)
def _axis_index(mesh: DeviceMesh, axes: tuple[str, ...], device: str) -> torch.Tensor:
    index = torch.zeros(mesh.shape, dtype=torch.long, device=device)
    for axis in axes:
        position = mesh.axis_position(axis)
        shape = [1] * mesh.ndim
        shape[position] = mesh.shape[position]
        index = index * mesh.shape[position] + torch.arange(mesh.shape[position], device=device).view(shape)
    return index.reshape(mesh.size)


def slice_blocks(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int) -> torch.Tensor:
    """Each device keeps block ``i`` of dim ``dim``, ``i`` its index along ``axes``."""
    k = mesh.axis_size(axes)
    d = dim + 1
    grouped = x.reshape(*x.shape[:d], k, x.shape[d] // k, *x.shape[d + 1 :]).movedim(d, 1)
    index = _axis_index(mesh, axes, str(x.device))
    return grouped[torch.arange(x.shape[0], device=x.device), index]


def partition(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str) -> torch.Tensor:
    """Each device's part of a value replicated along ``axes`` (see ``_blocks.partition``)."""
    first = (_axis_index(mesh, axes, str(x.device)) == 0).view(-1, *[1] * (x.dim() - 1))
    return blocks.partition(x, op, mesh.axis_size(axes), first)


def reduce_broadcast(x: torch.Tensor, mesh: DeviceMesh, a: int, b: int, op: str) -> torch.Tensor:
    """Partial on axis ``a``, Shard on axis ``b`` (equal sizes) -> Shard on ``a``, Replicate on
    ``b``: the group along ``a`` of column ``j`` reduces into the device at ``a = j``, which
    broadcasts along its row (``b``)."""
    grid = x.reshape(*mesh.shape, *x.shape[1:])
    reduced = blocks.reduce(grid, "sum", a, keepdim=True)  # column j's total
    moved = reduced.transpose(a, b).expand(grid.shape)  # device (i, j) gets column i's
    out = moved.reshape(x.shape)
    return blocks.average(out, mesh.shape[a]) if op == "avg" else out

"""How collectives execute on the simulated backend: batched tensor ops across the device dim.

Every function takes the stacked per-device values ``x`` of shape ``(n, *local)`` (row-major mesh
order) and returns the stacked results. The mesh axes a collective runs over are brought next
to each other and flattened, giving the canonical form ``(rest, group, *local)``: ``group``
indexes a device within its group (major axis first, as the axis names are given) and ``rest``
the groups. Each op is then one or two tensor ops, whatever the number of devices.
"""

from __future__ import annotations

import math

import torch

from .._mesh import DeviceMesh

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "axis_index"]


def _to_groups(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...]):
    positions = [mesh.axis_position(a) for a in axes]
    others = [p for p in range(mesh.ndim) if p not in positions]
    order = others + positions
    local = x.shape[1:]
    blocks = x.reshape(*mesh.shape, *local)
    if order != list(range(mesh.ndim)):
        blocks = blocks.permute(*order, *range(mesh.ndim, blocks.dim()))
    rest = math.prod([mesh.shape[p] for p in others])
    group = math.prod([mesh.shape[p] for p in positions])
    return blocks.reshape(rest, group, *local), order


def _from_groups(y: torch.Tensor, mesh: DeviceMesh, order: list[int]) -> torch.Tensor:
    local = y.shape[2:]
    blocks = y.reshape(*[mesh.shape[p] for p in order], *local)
    if order != list(range(mesh.ndim)):
        inverse = sorted(range(mesh.ndim), key=order.__getitem__)
        blocks = blocks.permute(*inverse, *range(mesh.ndim, blocks.dim()))
    return blocks.reshape(mesh.size, *local)


_REDUCTIONS = {
    "sum": lambda g: g.sum(1, keepdim=True, dtype=g.dtype),
    "avg": lambda g: g.mean(1, keepdim=True),
    "max": lambda g: g.amax(1, keepdim=True),
    "min": lambda g: g.amin(1, keepdim=True),
}


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str = "sum") -> torch.Tensor:
    groups, order = _to_groups(x, mesh, axes)
    reduced = _REDUCTIONS[op](groups)
    return _from_groups(reduced.expand(groups.shape).contiguous(), mesh, order)


def all_gather(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool
) -> torch.Tensor:
    """Every device gets the blocks of its group stacked (or, tiled, concatenated) at ``dim``."""
    groups, order = _to_groups(x, mesh, axes)
    rest, size, local = groups.shape[0], groups.shape[1], groups.shape[2:]
    gathered = groups.movedim(1, 1 + dim)  # (rest, *local[:dim], size, *local[dim:])
    if tiled:
        gathered = gathered.reshape(rest, *local[:dim], size * local[dim], *local[dim + 1 :])
    gathered = gathered.unsqueeze(1).expand(rest, size, *gathered.shape[1:])
    return _from_groups(gathered.contiguous(), mesh, order)


def reduce_scatter(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool
) -> torch.Tensor:
    """Sum over the group; device ``i`` keeps block ``i`` of dim ``dim`` (removed unless tiled)."""
    groups, order = _to_groups(x, mesh, axes)
    rest, size, local = groups.shape[0], groups.shape[1], groups.shape[2:]
    summed = groups.sum(1, dtype=groups.dtype)  # (rest, *local)
    if tiled:
        summed = summed.reshape(rest, *local[:dim], size, local[dim] // size, *local[dim + 1 :])
    return _from_groups(summed.movedim(1 + dim, 1).contiguous(), mesh, order)


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
    if tiled:
        shape = list(received.shape)
        shape[2 + concat : 2 + concat + 2] = [shape[2 + concat] * shape[3 + concat]]
        received = received.reshape(shape)
    return _from_groups(received.contiguous(), mesh, order)


def permute(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """Device ``dst`` receives the value of ``src`` for each pair; the others receive zeros."""
    groups, order = _to_groups(x, mesh, axes)
    size = groups.shape[1]
    source = [size] * size
    for src, dst in perm:
        source[dst] = src
    padded = torch.cat([groups, groups.new_zeros(groups[:, :1].shape)], dim=1)
    index = torch.tensor(source, device=x.device)
    return _from_groups(padded.index_select(1, index), mesh, order)


def axis_index(mesh: DeviceMesh, axes: tuple[str, ...], device: str) -> torch.Tensor:
    """``(n,)``: each device's index within its group over ``axes`` (major axis first)."""
    index = torch.zeros(mesh.shape, dtype=torch.long, device=device)
    for axis in axes:
        position = mesh.axis_position(axis)
        shape = [1] * mesh.ndim
        shape[position] = mesh.shape[position]
        index = index * mesh.shape[position] + torch.arange(mesh.shape[position], device=device).view(shape)
    return index.reshape(mesh.size)

"""How collectives execute on the distributed backend: ``torch.distributed`` functional
collectives (traceable by ``torch.compile``) on this rank's local tensor.

Groups come from :mod:`.distributed` (one per mesh axis, one per flattened tuple of axes). A
group orders its ranks in mesh order; when a tuple of axes is given in another order, the
blocks are reordered around the collective so that block ``i`` is the ``i``-th device in the
order the names were given (major first), as on the simulated backend.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from .._mesh import DeviceMesh
from . import distributed

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "axis_index"]

_REDUCE_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min"}


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _group_order(mesh: DeviceMesh, axes: tuple[str, ...]):
    """Sizes of ``axes`` in mesh order, and the permutation from mesh order to given order."""
    in_mesh_order = sorted(axes, key=mesh.axis_position)
    sizes = [mesh.axis_size(a) for a in in_mesh_order]
    return sizes, [in_mesh_order.index(a) for a in axes]


def _reorder_blocks(x: torch.Tensor, dim: int, mesh: DeviceMesh, axes: tuple[str, ...], to_mesh_order: bool):
    """Reorder the group-sized block index at ``dim`` between given and mesh order."""
    sizes, perm = _group_order(mesh, axes)
    if perm == sorted(perm):
        return x
    rest = x.shape[dim + 1 :]
    if to_mesh_order:  # blocks indexed in given order -> mesh order
        given_sizes = [sizes[p] for p in perm]
        blocks = x.reshape(*x.shape[:dim], *given_sizes, *rest)
        inverse = sorted(range(len(perm)), key=perm.__getitem__)
        order = [dim + i for i in inverse]
    else:
        blocks = x.reshape(*x.shape[:dim], *sizes, *rest)
        order = [dim + p for p in perm]
    lead = list(range(dim))
    tail = list(range(dim + len(sizes), blocks.dim()))
    return blocks.permute(*lead, *order, *tail).reshape(x.shape)


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str = "sum") -> torch.Tensor:
    return _wait(funcol.all_reduce(x, _REDUCE_OPS[op], distributed.group(mesh, axes)))


def all_gather(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool) -> torch.Tensor:
    group = distributed.group(mesh, axes)
    size = mesh.axis_size(axes)
    stacked = _wait(funcol.all_gather_single(x.contiguous(), 0, group))  # (size * x0, ...)
    stacked = stacked.reshape(size, *x.shape)
    stacked = _reorder_blocks(stacked, 0, mesh, axes, to_mesh_order=False)
    gathered = stacked.movedim(0, dim)
    if tiled:
        gathered = gathered.reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])
    return gathered


def reduce_scatter(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool) -> torch.Tensor:
    group = distributed.group(mesh, axes)
    size = mesh.axis_size(axes)
    if tiled:
        x = x.reshape(*x.shape[:dim], size, x.shape[dim] // size, *x.shape[dim + 1 :])
    blocks = x.movedim(dim, 0)  # (size, ...): block i goes to device i (given order)
    blocks = _reorder_blocks(blocks, 0, mesh, axes, to_mesh_order=True)
    flat = blocks.reshape(size * blocks.shape[1] if blocks.dim() > 1 else size, *blocks.shape[2:])
    out = _wait(funcol.reduce_scatter_single(flat.contiguous(), "sum", 0, group))
    return out.reshape(blocks.shape[1:])


def all_to_all(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], split: int, concat: int, tiled: bool
) -> torch.Tensor:
    group = distributed.group(mesh, axes)
    size = mesh.axis_size(axes)
    if tiled:
        x = x.reshape(*x.shape[:split], size, x.shape[split] // size, *x.shape[split + 1 :])
    blocks = x.movedim(split, 0)  # (dst, ...)
    blocks = _reorder_blocks(blocks, 0, mesh, axes, to_mesh_order=True).contiguous()
    received = _wait(funcol.all_to_all_single(blocks.reshape(-1), None, None, group))
    received = received.reshape(blocks.shape)  # (src in mesh order, ...)
    received = _reorder_blocks(received, 0, mesh, axes, to_mesh_order=False)
    out = received.movedim(0, concat)
    if tiled:
        out = out.reshape(*out.shape[:concat], size * out.shape[concat + 1], *out.shape[concat + 2 :])
    return out


def permute(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Send to ``dst`` and receive from ``src`` for each pair (zeros where nothing arrives)."""
    group = distributed.group(mesh, axes)
    size = mesh.axis_size(axes)
    me = distributed.group_index(mesh, axes)
    to_mesh = _mesh_positions(mesh, axes)
    numel = x.numel()
    send = [0] * size
    recv = [0] * size
    for src, dst in perm:
        if src == me:
            send[to_mesh[dst]] = numel
        if dst == me:
            recv[to_mesh[src]] = numel
    flat = x.contiguous().reshape(-1)
    if not any(send):
        flat = flat[:0]
    received = _wait(funcol.all_to_all_single(flat, recv, send, group))
    if received.numel() == 0:
        return torch.zeros_like(x)
    return received.reshape(x.shape)


def _mesh_positions(mesh: DeviceMesh, axes: tuple[str, ...]) -> list[int]:
    """For each index in given order, the index of the same device in the group (mesh order)."""
    sizes, perm = _group_order(mesh, axes)
    index = torch.arange(len(sizes) and int(torch.tensor(sizes).prod())).reshape(sizes)
    return index.permute(*perm).reshape(-1).tolist()


def axis_index(mesh: DeviceMesh, axes: tuple[str, ...], device: str) -> torch.Tensor:
    return torch.tensor(distributed.group_index(mesh, axes), device=device)

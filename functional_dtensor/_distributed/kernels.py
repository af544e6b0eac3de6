"""The kernels of the distributed backend, on this rank's local tensor: c10d calls when eager
(the lightest path; a failure or a timeout becomes a :class:`CommunicationError`, see
:mod:`.errors`), ``torch.distributed`` functional collectives while traced (``torch.compile``,
``torch.func.linearize``).

Groups come from :mod:`.runtime` (one per mesh axis, one per flattened tuple of axes). A group
orders its ranks in mesh order; when a tuple of axes is given in another order, the blocks are
reordered around the collective so that block ``i`` is the ``i``-th device in the order the
names were given (major first), as on the simulated backend.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.node import has_side_effect

from .. import _blocks as blocks
from .._mesh import DeviceMesh
from . import checks, runtime
from .errors import c10d

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "permute",
    "axis_index",
    "slice_blocks",
    "partition",
    "reduce_broadcast",
    "broadcast",
]

#: the library's name of an all-reduce of each op, as errors and the collective checks say it
_REDUCE_NAMES = {"sum": "psum", "avg": "pmean", "max": "pmax", "min": "pmin"}

_C10D_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


# A collective is a side effect across ranks: no graph pass may fold it into a constant or drop it
# on one rank alone. torch marks the functional collectives' wait so; torch.func.linearize
# const-folds its graph, and would fold a collective of constant inputs apart from its wait.
for _collective in (
    torch.ops._c10d_functional.all_reduce,
    torch.ops._c10d_functional.all_gather_into_tensor,
    torch.ops._c10d_functional.reduce_scatter_tensor,
    torch.ops._c10d_functional.all_to_all_single,
    torch.ops._c10d_functional.broadcast,
):
    has_side_effect(_collective.default)


def _traced() -> bool:
    """Whether the call is being traced into a graph (``torch.compile``, or ``make_fx`` as
    ``torch.func.linearize`` traces): then the functional collectives, which a trace records;
    c10d's own calls would be left out of it, and the graph would run without them."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _all_reduce(x: torch.Tensor, op: str, group, axes: tuple[str, ...]) -> torch.Tensor:
    if op == "avg" and not (x.is_floating_point() or x.is_complex()):
        # the average of _blocks.reduce, rounded down (gloo averages integers in float), summed
        # in int64 as there (a narrow integer's sum would wrap)
        total = _all_reduce(x.to(torch.int64), "sum", group, axes)
        return blocks.average(total, dist.get_world_size(group)).to(x.dtype)
    if _traced():
        return _wait(funcol.all_reduce(x, op, group))
    out = x.clone(memory_format=torch.contiguous_format)
    c10d(all_reduce_in_place, out, op=_C10D_OPS[op], group=group, name=_REDUCE_NAMES[op], axes=axes)
    return out


def all_reduce_in_place(tensor: torch.Tensor, *, op, group) -> None:
    """``dist.all_reduce`` on the process group itself, without the wrapper's checks (the
    groups are the library's, the tensor a fresh contiguous one): the hot path of psum."""
    group.allreduce([tensor], _allreduce_options(op)).wait()


_OPTIONS: dict = {}


def _allreduce_options(op) -> dist.AllreduceOptions:
    options = _OPTIONS.get(op)
    if options is None:
        options = _OPTIONS[op] = dist.AllreduceOptions()
        options.reduceOp = op
    return options


def _all_gather(x: torch.Tensor, size: int, group, axes: tuple[str, ...]) -> torch.Tensor:
    """``(size * x.shape[0], ...)``: every rank's ``x`` concatenated along dim 0."""
    x = x.contiguous()
    if _traced():
        return _wait(funcol.all_gather_single(x, 0, group))
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    c10d(dist.all_gather_single, out, x, group=group, name="all_gather", axes=axes)
    return out


def _reduce_scatter(x: torch.Tensor, size: int, group, axes: tuple[str, ...]) -> torch.Tensor:
    """Sum over ranks of ``x``; rank ``i`` keeps block ``i`` of dim 0."""
    x = x.contiguous()
    if _traced():
        return _wait(funcol.reduce_scatter_single(x, "sum", 0, group))
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    c10d(dist.reduce_scatter_single, out, x, group=group, name="psum_scatter", axes=axes)
    return out


def _all_to_all(
    x: torch.Tensor, out_splits, in_splits, group, name: str, axes: tuple[str, ...]
) -> torch.Tensor:
    x = x.contiguous()
    if _traced():
        return _wait(funcol.all_to_all_single(x, out_splits, in_splits, group))
    out = x.new_empty((sum(out_splits) if out_splits is not None else x.shape[0], *x.shape[1:]))
    c10d(dist.all_to_all_single, out, x, out_splits, in_splits, group=group, name=name, axes=axes)
    return out


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


# Each kernel first asks the collective checks (``checks.on``, one test when they are off) to
# compare what every rank is about to call: eager only, a trace records no check.


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str = "sum") -> torch.Tensor:
    group = runtime.group(mesh, axes)
    if checks.on and not _traced():
        checks.check(_REDUCE_NAMES[op], x, mesh, axes, group, {})
    return _all_reduce(x, op, group, axes)


def all_gather(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool
) -> torch.Tensor:
    group = runtime.group(mesh, axes)
    if checks.on and not _traced():
        checks.check("all_gather", x, mesh, axes, group, {"dim": dim, "tiled": tiled})
    size = mesh.axis_size(axes)
    stacked = _all_gather(x, size, group, axes)  # (size * x0, ...)
    stacked = stacked.reshape(size, *x.shape)
    stacked = _reorder_blocks(stacked, 0, mesh, axes, to_mesh_order=False)
    gathered = stacked.movedim(0, dim)
    if tiled:
        gathered = gathered.reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])
    return gathered


def reduce_scatter(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool
) -> torch.Tensor:
    group = runtime.group(mesh, axes)
    if checks.on and not _traced():
        checks.check("psum_scatter", x, mesh, axes, group, {"dim": dim, "tiled": tiled})
    size = mesh.axis_size(axes)
    if tiled:
        x = x.reshape(*x.shape[:dim], size, x.shape[dim] // size, *x.shape[dim + 1 :])
    blocks = x.movedim(dim, 0)  # (size, ...): block i goes to device i (given order)
    blocks = _reorder_blocks(blocks, 0, mesh, axes, to_mesh_order=True)
    flat = blocks.reshape(size * blocks.shape[1] if blocks.dim() > 1 else size, *blocks.shape[2:])
    out = _reduce_scatter(flat, size, group, axes)
    return out.reshape(blocks.shape[1:])


def all_to_all(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], split: int, concat: int, tiled: bool
) -> torch.Tensor:
    group = runtime.group(mesh, axes)
    if checks.on and not _traced():
        checks.check("all_to_all", x, mesh, axes, group, {"split": split, "concat": concat, "tiled": tiled})
    size = mesh.axis_size(axes)
    if tiled:
        x = x.reshape(*x.shape[:split], size, x.shape[split] // size, *x.shape[split + 1 :])
    blocks = x.movedim(split, 0)  # (dst, ...)
    blocks = _reorder_blocks(blocks, 0, mesh, axes, to_mesh_order=True).contiguous()
    received = _all_to_all(blocks.reshape(-1), None, None, group, "all_to_all", axes)
    received = received.reshape(blocks.shape)  # (src in mesh order, ...)
    received = _reorder_blocks(received, 0, mesh, axes, to_mesh_order=False)
    out = received.movedim(0, concat)
    if tiled:
        out = out.reshape(*out.shape[:concat], size * out.shape[concat + 1], *out.shape[concat + 2 :])
    return out


def broadcast(x: torch.Tensor, mesh: DeviceMesh, axis: str, src: int) -> torch.Tensor:
    """The tensor the device at index ``src`` along ``axis`` holds, on every device of it."""
    group = runtime.group(mesh, (axis,))
    root = dist.get_global_rank(group, src)
    if _traced():  # (the functional collective takes the source by its rank in the group)
        return _wait(funcol.broadcast(x, src, group))
    if checks.on:
        checks.check("broadcast", x, mesh, (axis,), group, {"src": src})
    source = dist.get_rank() == root
    out = x.contiguous() if source else torch.empty_like(x, memory_format=torch.contiguous_format)
    c10d(dist.broadcast, out, src=root, group=group, name="broadcast", axes=(axis,))
    return out  # the source's own tensor, as it passed it where contiguous (broadcast only reads it)


def permute(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """Send to ``dst`` and receive from ``src`` for each pair (zeros where nothing arrives)."""
    group = runtime.group(mesh, axes)
    if checks.on and not _traced():
        checks.check("ppermute", x, mesh, axes, group, {"perm": perm})
    size = mesh.axis_size(axes)
    me = runtime.group_index(mesh, axes)
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
    received = _all_to_all(flat, recv, send, group, "ppermute", axes)
    if received.numel() == 0:
        return torch.zeros_like(x)
    return received.reshape(x.shape)


def _mesh_positions(mesh: DeviceMesh, axes: tuple[str, ...]) -> list[int]:
    """For each index in given order, the index of the same device in the group (mesh order)."""
    sizes, perm = _group_order(mesh, axes)
    given_sizes = [sizes[p] for p in perm]
    positions = []
    for index in range(math.prod(sizes)):
        coordinate = [0] * len(sizes)  # in mesh order
        for p, size in zip(reversed(perm), reversed(given_sizes)):
            index, coordinate[p] = divmod(index, size)
        flat = 0
        for c, size in zip(coordinate, sizes):
            flat = flat * size + c
        positions.append(flat)
    return positions


def axis_index(mesh: DeviceMesh, axes: tuple[str, ...], device: str) -> torch.Tensor:
    return torch.tensor(runtime.group_index(mesh, axes), device=device)


def _reduce(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], root: int) -> torch.Tensor:
    """The sum over the group into the device at flat mesh index ``root`` (the others' results
    are not meaningful); under compile, an all-reduce."""
    group = runtime.group(mesh, axes)
    if _traced():
        return _wait(funcol.all_reduce(x, "sum", group))
    out = x.clone(memory_format=torch.contiguous_format)
    c10d(dist.reduce, out, runtime.group_ids(mesh)[root], group=group, name="reduce", axes=axes)
    return out


def _broadcast(
    x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], root: int, *, donate: bool = False
) -> torch.Tensor:
    """The value of the device at flat mesh index ``root``, on every device of the group
    (``donate``: ``x`` is a private buffer and may be overwritten)."""
    group = runtime.group(mesh, axes)
    if _traced():
        coordinate = mesh.coordinate(root)
        group_rank = 0  # the root's rank within the group: its index along the axes, mesh order
        for axis in sorted(axes, key=mesh.axis_position):
            position = mesh.axis_position(axis)
            group_rank = group_rank * mesh.shape[position] + coordinate[position]
        return _wait(funcol.broadcast(x, group_rank, group))
    out = x if donate and x.is_contiguous() else x.contiguous().clone()
    c10d(dist.broadcast, out, runtime.group_ids(mesh)[root], group=group, name="broadcast", axes=axes)
    return out


def slice_blocks(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], dim: int) -> torch.Tensor:
    """Keep block ``i`` of dim ``dim``, ``i`` this rank's index along ``axes``."""
    size = x.shape[dim] // mesh.axis_size(axes)
    return x.narrow(dim, runtime.group_index(mesh, axes) * size, size)


def partition(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], op: str) -> torch.Tensor:
    """This rank's part of a value replicated along ``axes`` (see ``_blocks.partition``)."""
    return blocks.partition(x, op, mesh.axis_size(axes), runtime.group_index(mesh, axes) == 0)


def reduce_broadcast(x: torch.Tensor, mesh: DeviceMesh, a: int, b: int, op: str) -> torch.Tensor:
    """Partial on axis ``a``, Shard on axis ``b`` (equal sizes) -> Shard on ``a``, Replicate on
    ``b``: the group along ``a`` of column ``j`` reduces into the device at ``a = j``, which
    broadcasts along its row (``b``)."""
    if checks.on and not _traced():
        axes = (mesh.axis_names[a], mesh.axis_names[b])
        checks.check("reduce+broadcast", x, mesh, axes, runtime.group(mesh, axes), {"op": op})
    here = list(runtime.coordinate(mesh))
    root = list(here)
    root[a] = here[b]  # the device of my column on the diagonal
    out = _reduce(x, mesh, (mesh.axis_names[a],), mesh.flat_index(root))
    source = list(here)
    source[b] = here[a]  # the device of my row on the diagonal
    out = _broadcast(out, mesh, (mesh.axis_names[b],), mesh.flat_index(source), donate=True)
    return blocks.average(out, mesh.shape[a]) if op == "avg" else out

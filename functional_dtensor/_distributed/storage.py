"""How the distributed backend stores a global value: this rank's shard, unpadded (as DTensor)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .. import _autograd as autograd
from .. import _blocks as blocks
from .._errors import InputTypeError, MeshError, ShapeError, explain
from .._layout import Layout
from .._placements import Partial, Shard
from .._sharding import shard_table
from . import kernels, runtime

__all__ = [
    "distribute",
    "gather",
    "shard",
    "shards",
    "from_local",
    "shard_infos",
    "padded",
    "unpadded",
    "differing_replicas",
    "materialize",
    "splits_as_views",
    "saved",
    "restored",
    "replica",
    "replicated",
    "from_source",
]


def _partitioned(block: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's part of a block replicated along the Partial axes."""
    coordinate = runtime.coordinate(layout.mesh)
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            block = blocks.partition(block, placement.op, layout.mesh.shape[axis], coordinate[axis] == 0)
    return block


def distribute(tensor: torch.Tensor, layout: Layout, *, copy: bool = False) -> torch.Tensor:
    """This rank's block of the global ``tensor`` (a slice, or a copy of it with ``copy``;
    Partial axes partitioned)."""
    table = shard_table(layout, tuple(tensor.shape))
    k = runtime.device_index(layout.mesh)
    block = tensor[tuple([slice(o, o + s) for o, s in zip(table.offsets[k], table.local_shapes[k])])]
    return _partitioned(block.clone() if copy else block, layout)


def gather(local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The global value on every rank: the padded shard all-reduced over each Partial axis (in
    mesh order), then all-gathered over the Shard axes in one collective and assembled."""
    mesh = layout.mesh
    padded = shard_table(layout, tuple(global_shape)).padded_shape
    value = blocks.pad(local, padded)
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            value = kernels.all_reduce(value, mesh, (mesh.axis_names[axis],), placement.op)
    sharding = tuple([n for n, p in zip(mesh.axis_names, layout.placements) if isinstance(p, Shard)])
    if sharding:
        value = kernels.all_gather(value, mesh, sharding, 0, tiled=False)
    sizes, _ = blocks.distinct_shards(layout, tuple(global_shape))
    return blocks.assemble(value.reshape(*sizes, *padded), layout, tuple(global_shape))


def splits_as_views(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Never: a rank's shard is a slice, and gathering communicates."""
    return False


def shard(local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...], device) -> torch.Tensor:
    """This rank's shard (``device``: None, or this rank's index or coordinate)."""
    if device is not None:
        mesh = layout.mesh
        mine = runtime.device_index(mesh)
        index = mesh.flat_index(device) if isinstance(device, (tuple, list)) else device
        if index != mine:
            raise InputTypeError(
                explain(
                    "fd.DTensor.to_local(device)",
                    "a rank holds its own shard only",
                    expected=f"None or this rank's device {mine} (coordinate {mesh.coordinate(mine)})",
                    got=repr(device),
                    fix="omit device on the distributed backend, or fd.redistribute to gather",
                )
            )
    return local


def shards(local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The shards this rank holds: its own."""
    return (local,)


def from_local(shards, layout: Layout, global_shape, *, copy: bool, where: str) -> torch.Tensor:
    """This rank's shard, checked against the layout (a copy of it, with ``copy``)."""
    _check_one(shards, where)
    local = shards[0]
    expected = shard_table(layout, tuple(global_shape)).local_shapes[runtime.device_index(layout.mesh)]
    if tuple(local.shape) != tuple(expected):
        raise ShapeError(
            explain(
                f"{where}(local_tensor)",
                f"this rank's shard does not fit global shape {tuple(global_shape)}",
                expected=f"local shape {expected}",
                got=f"{tuple(local.shape)}",
                fix="pass shape= with the true global shape, or a shard of the right size",
            )
        )
    return local.clone() if copy else local


def shard_infos(shards, layout: Layout, *, where: str) -> tuple[blocks.ShardInfo, ...]:
    """Every device's shard metadata, in flat mesh order: one all-gather over the mesh of a
    fixed-length code, so that every rank sees every shard and reaches the same verdict."""
    _check_one(shards, where)
    mesh = layout.mesh
    code = blocks.encode_shard_info(blocks.shard_info(shards[0])).to(mesh.device_type)
    codes = kernels.all_gather(code, mesh, mesh.axis_names, 0, tiled=False).cpu()
    return tuple([blocks.decode_shard_info(c) for c in codes])


def _check_one(shards, where: str) -> None:
    if len(shards) != 1:
        raise InputTypeError(
            explain(
                f"{where}(local_tensor)",
                "on the distributed backend each rank passes its own shard",
                expected="one tensor",
                got=f"a list of {len(shards)}",
                fix="pass this rank's shard alone",
            )
        )


def differing_replicas(local: torch.Tensor, layout: Layout) -> list[str]:
    """The Replicate axes of ``layout`` along which the ranks' shards differ. Every rank runs
    the same collectives and all agree on the verdict: a rank must not raise while the others
    wait for it in a collective."""
    mesh = layout.mesh
    names = [n for n, p in zip(mesh.axis_names, layout.placements) if p.is_replicate()]
    differs = []
    for name in names:
        low = kernels.all_reduce(local, mesh, (name,), "min")
        high = kernels.all_reduce(local, mesh, (name,), "max")
        differs.append(not (torch.equal(low, local) and torch.equal(high, local)))
    flags = torch.tensor([float(d) for d in differs], device=local.device)  # NCCL: on the device
    if names:
        flags = kernels.all_reduce(flags, mesh, mesh.axis_names, "max")
    return [n for n, flag in zip(names, flags.tolist()) if flag]


def materialize(layout: Layout, global_shape: tuple[int, ...], make_blocks) -> torch.Tensor:
    """This rank's shard from ``make_blocks(padded_shape, shard)``: the padded block of its
    distinct shard ``shard`` (its flat index over the splitting axes); Partial axes
    partitioned."""
    mesh = layout.mesh
    index = 0
    for axis, c in enumerate(runtime.coordinate(mesh)):
        if isinstance(layout.placements[axis], Shard):
            index = index * mesh.shape[axis] + c
    table = shard_table(layout, tuple(global_shape))
    block = make_blocks(table.padded_shape, index)
    return _partitioned(blocks.unpad(block, table.local_shapes[runtime.device_index(mesh)]), layout)


def saved(local: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, int]:
    """This rank's shard (detached) and its device: each rank saves its own."""
    return local.detach(), runtime.device_index(layout.mesh)


def restored(local, layout: Layout, global_shape: tuple[int, ...], device: int) -> torch.Tensor:
    """This rank's saved shard, loaded by the device that saved it in a world of the size it was
    saved in: resharding to another world size goes through the global value."""
    mesh = layout.mesh
    world = dist.get_world_size() if dist.is_initialized() else None
    if world != len(mesh.device_ids):
        raise MeshError(
            explain(
                "fd.DTensor (loading)",
                f"a distributed value saved by device {device} of a {len(mesh.device_ids)}-rank world",
                expected=f"a torch.distributed world of {len(mesh.device_ids)} ranks",
                got="no process group" if world is None else f"{world} ranks",
                fix=f"load each rank's file under torchrun with {len(mesh.device_ids)} ranks; to change "
                "the world size, reshard through the global value (save x.full_tensor(), then "
                "fd.distribute_tensor it on the new mesh) or with torch.distributed.checkpoint",
            )
        )
    here = runtime.device_index(mesh)
    expected = shard_table(layout, tuple(global_shape)).local_shapes[here]
    if device != here:
        raise MeshError(
            explain(
                "fd.DTensor (loading)",
                f"the file holds device {device}'s shard",
                expected=f"the file this rank (device {here}) saved",
                got=f"device {device}'s",
                fix="load on every rank the file that rank saved",
            )
        )
    if not isinstance(local, torch.Tensor) or tuple(local.shape) != tuple(expected):
        raise ShapeError(
            explain(
                "fd.DTensor (loading)",
                "the saved shard does not fit the saved layout",
                expected=f"local shape {tuple(expected)}",
                got=repr(getattr(local, "shape", local)),
                fix="load a file written by pickle or torch.save of an fd.DTensor, unchanged",
            )
        )
    return local


def padded(local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's shard padded with zeros to the layout's padded block shape."""
    return blocks.pad(local, shard_table(layout, tuple(global_shape)).padded_shape)


def unpadded(block: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's shard of its padded block."""
    table = shard_table(layout, tuple(global_shape))
    return blocks.unpad(block, table.local_shapes[runtime.device_index(layout.mesh)])


def replica(storage: torch.Tensor) -> torch.Tensor:
    """This rank's copy of a replicated value: its storage."""
    return storage


def replicated(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The storage, in the replicated ``layout``, of ``tensor`` this rank computed."""
    return tensor


@autograd.compilable
class _SourceData(torch.autograd.Function):
    """The source rank's values; the gradient is this rank's, to its own tensor (each rank's
    tensor stands for the one global value, as in the single-device program)."""

    @staticmethod
    def forward(tensor, data):
        return data

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None

    @staticmethod
    def jvp(ctx, t, _data_t):
        return t


def from_source(tensor: torch.Tensor, mesh, src: int) -> torch.Tensor:
    """The tensor the devices at index ``src`` of every mesh axis hold, on every rank: one
    broadcast per axis of more than one device (torch's ``src_data_rank``)."""
    if not torch.compiler.is_compiling() and get_proxy_mode() is not None:
        return tensor  # traced by torch.func.linearize: a transform's tensor, as the tangent's
    data = tensor.detach()
    for name, size in zip(mesh.axis_names, mesh.shape):
        if size > 1:
            data = kernels.broadcast(data, mesh, name, src)
    return autograd.apply(_SourceData, tensor, data) if tensor.requires_grad else data

"""How the distributed backend stores a global value: this rank's shard, unpadded (as DTensor)."""

from __future__ import annotations

import torch

from .. import _blocks as blocks
from .._errors import InputTypeError, ShapeError, explain
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
]


def _partitioned(block: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's part of a block replicated along the Partial axes."""
    coordinate = runtime.coordinate(layout.mesh)
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            block = blocks.partition(block, placement.op, layout.mesh.shape[axis], coordinate[axis] == 0)
    return block


def distribute(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's block of the global ``tensor`` (a slice; Partial axes partitioned)."""
    table = shard_table(layout, tuple(tensor.shape))
    k = runtime.device_index(layout.mesh)
    block = tensor[tuple([slice(o, o + s) for o, s in zip(table.offsets[k], table.local_shapes[k])])]
    return _partitioned(block, layout)


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


def from_local(shards, layout: Layout, global_shape, *, where: str) -> torch.Tensor:
    """This rank's shard, checked against the layout."""
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
    return local


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
    flags = torch.tensor([float(d) for d in differs])
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


def padded(local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's shard padded with zeros to the layout's padded block shape."""
    return blocks.pad(local, shard_table(layout, tuple(global_shape)).padded_shape)


def unpadded(block: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's shard of its padded block."""
    table = shard_table(layout, tuple(global_shape))
    return blocks.unpad(block, table.local_shapes[runtime.device_index(layout.mesh)])

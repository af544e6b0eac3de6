"""How the distributed backend stores a global value: this rank's shard, unpadded (as DTensor)."""

from __future__ import annotations

import torch

from .._errors import LayoutError, ShapeError, explain
from .._layout import Layout
from .._placements import Partial, Shard
from .._sharding import shard_table
from . import distributed, simulated_storage
from . import distributed_collectives as comm

__all__ = ["local_shape", "local_shard", "full_tensor", "check_local", "materialize"]


def _my_device(layout: Layout) -> int:
    mesh = layout.mesh
    return mesh.flat_index(distributed.coordinate(mesh))


def local_shape(layout: Layout, global_shape: tuple[int, ...]) -> tuple[int, ...]:
    return shard_table(layout, tuple(global_shape)).local_shapes[_my_device(layout)]


def local_shard(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's block of the global ``tensor`` (a slice; Partial axes partitioned)."""
    table = shard_table(layout, tuple(tensor.shape))
    k = _my_device(layout)
    block = tensor[tuple(slice(o, o + s) for o, s in zip(table.offsets[k], table.local_shapes[k]))]
    coordinate = layout.mesh.coordinate(k)
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial) and placement.op == "sum":
            size = layout.mesh.shape[axis]
            if block.is_floating_point() or block.is_complex():
                block = block / size
            elif coordinate[axis] != 0:
                block = torch.zeros_like(block)
    return block


def full_tensor(local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The global value on every rank: Partial axes all-reduced, the padded shards of the
    Shard axes all-gathered in one collective and assembled as on the simulated backend."""
    mesh = layout.mesh
    value = local
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            value = comm.all_reduce(value, mesh, (mesh.axis_names[axis],), placement.op)
    sharding = tuple(n for n, p in zip(mesh.axis_names, layout.placements) if isinstance(p, Shard))
    if not sharding:
        return value
    padded = shard_table(layout, tuple(global_shape)).padded_shape
    pad = []
    for size, target in zip(reversed(value.shape), reversed(padded)):
        pad += [0, target - size]
    if any(pad):
        value = torch.nn.functional.pad(value, pad)
    gathered = comm.all_gather(value, mesh, sharding, 0, tiled=False)
    sizes = [mesh.shape[a] if isinstance(p, Shard) else 1 for a, p in enumerate(layout.placements)]
    return simulated_storage.assemble(gathered.reshape(*sizes, *padded), layout, tuple(global_shape))


def check_local(local: torch.Tensor, layout: Layout, global_shape, *, run_check: bool, where: str) -> torch.Tensor:
    expected = local_shape(layout, global_shape)
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
    if run_check:
        mesh = layout.mesh
        for axis, placement in enumerate(layout.placements):
            if placement.is_replicate():
                name = (mesh.axis_names[axis],)
                low = comm.all_reduce(local, mesh, name, "min")
                high = comm.all_reduce(local, mesh, name, "max")
                if not (torch.equal(low, local) and torch.equal(high, local)):
                    raise LayoutError(
                        explain(
                            f"{where}(local_tensor)",
                            f"shards differ along mesh axis {name[0]!r}, placed Replicate",
                            expected="equal shards on every rank of a Replicate axis",
                            got="different values",
                            fix="pass equal shards, or place that axis fd.Partial / fd.Shard",
                        )
                    )
    return local


def materialize(layout: Layout, shape: tuple[int, ...], make) -> torch.Tensor:
    """This rank's shard drawn by ``make(shape)``, Partial axes partitioned."""
    block = make(shape)
    coordinate = layout.mesh.coordinate(_my_device(layout))
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial) and placement.op == "sum":
            if block.is_floating_point() or block.is_complex():
                block = block / layout.mesh.shape[axis]
            elif coordinate[axis] != 0:
                block = torch.zeros_like(block)
    return block

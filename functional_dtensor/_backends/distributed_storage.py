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
    block = tensor[tuple([slice(o, o + s) for o, s in zip(table.offsets[k], table.local_shapes[k])])]
    return _partitioned(block, layout, k)


def _partitioned(block: torch.Tensor, layout: Layout, device: int) -> torch.Tensor:
    """Split a replicated block into parts that reduce back to it, as the simulated backend
    does: a sum divided evenly (floating dtypes) or held by coordinate 0 (integer dtypes)."""
    coordinate = layout.mesh.coordinate(device)
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial) and placement.op == "sum":
            if block.is_floating_point() or block.is_complex():
                block = block / layout.mesh.shape[axis]
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
    sharding = tuple([n for n, p in zip(mesh.axis_names, layout.placements) if isinstance(p, Shard)])
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


def check_local(
    local: torch.Tensor, layout: Layout, global_shape, *, run_check: bool, where: str
) -> torch.Tensor:
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
        # every rank runs the same collectives, then all agree on the verdict: a rank must
        # not raise while the others wait for it in a collective
        mesh = layout.mesh
        names = [n for n, p in zip(mesh.axis_names, layout.placements) if p.is_replicate()]
        differs = []
        for name in names:
            low = comm.all_reduce(local, mesh, (name,), "min")
            high = comm.all_reduce(local, mesh, (name,), "max")
            differs.append(not (torch.equal(low, local) and torch.equal(high, local)))
        flags = torch.tensor([float(d) for d in differs])
        if names:
            flags = comm.all_reduce(flags, mesh, mesh.axis_names, "max")
        bad = [n for n, flag in zip(names, flags.tolist()) if flag]
        if bad:
            raise LayoutError(
                explain(
                    f"{where}(local_tensor)",
                    f"shards differ along mesh axis {bad[0]!r}, placed Replicate",
                    expected="equal shards on every rank of a Replicate axis",
                    got="different values",
                    fix="pass equal shards, or place that axis fd.Partial / fd.Shard",
                )
            )
    return local


def shard_index(layout: Layout) -> int:
    """This rank's distinct shard: its flat (row-major) coordinate over the splitting axes."""
    mesh = layout.mesh
    index = 0
    for axis, c in enumerate(distributed.coordinate(mesh)):
        if isinstance(layout.placements[axis], Shard):
            index = index * mesh.shape[axis] + c
    return index


def materialize(layout: Layout, global_shape: tuple[int, ...], padded_block: torch.Tensor) -> torch.Tensor:
    """This rank's shard from its block padded to the largest shard, Partial axes partitioned."""
    k = _my_device(layout)
    local = shard_table(layout, tuple(global_shape)).local_shapes[k]
    return _partitioned(padded_block[tuple([slice(0, s) for s in local])], layout, k)

"""How the simulated backend stores a global value: one stacked tensor for all devices.

A value laid out by ``layout`` on a simulated mesh of ``n`` devices is a tensor of shape
``(n, *padded_shape)``: row ``k`` is device ``k``'s shard (flat, row-major mesh order), padded
with zeros at the end of each dim up to the largest shard. True shard sizes come from the
layout and the global shape (:func:`shard_table`), so one tensor op serves every device and the
Python work per op does not grow with the mesh.

Evenly split values without Partial axes are views of the global tensor (reshape, permute,
expand: a replicated value is held once), by view steps cached per layout and shape; the other
layouts go through the block grid of :mod:`.._blocks`.

A value replicated over some mesh axes and split over others cannot be a view of one copy in
that form (the copies' stride-0 dim does not merge into the flat device dim). Such a value may
be **held** instead: ``(r, *padded_shape)``, one block per coordinate of the other axes (``r``
their product, in row-major order), :func:`fold` from the stacked form and :func:`unfold` back
to it. Global ops whose output is replicated where every input is run on the held blocks, once
per distinct block, not once per device (:class:`Held`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import _autograd as autograd
from .. import _blocks as blocks
from .._cache import cached
from .._errors import InputTypeError, ShapeError, explain
from .._layout import Layout
from .._placements import Replicate, Shard
from .._sharding import shard_table

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
    "Held",
    "HELD_MIN_ELEMENTS",
    "held_plan",
    "fold",
    "unfold",
]


def distribute(tensor: torch.Tensor, layout: Layout, *, copy: bool = False) -> torch.Tensor:
    """Every device's shard of the global ``tensor``, stacked: ``(n, *padded_shape)``. An even
    split is views of ``tensor`` (of a copy of it, with ``copy``); an uneven one is a copy."""
    shape = tuple(tensor.shape)
    if copy and shard_table(layout, shape).is_even:
        tensor = tensor.clone()
    steps = _distribute_steps(layout, shape)
    if steps is not None:
        return _run_steps(tensor, steps)
    table = shard_table(layout, shape)
    return blocks.split(tensor, layout).reshape(layout.mesh.size, *table.padded_shape)


def gather(storage: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor: Partial axes reduced, replicas read from coordinate 0."""
    steps = _gather_steps(layout, global_shape)
    if steps is not None:
        return _run_steps(storage, steps)
    table = shard_table(layout, global_shape)
    mesh = layout.mesh
    grid = blocks.reduce_partial(storage.reshape(*mesh.shape, *table.padded_shape), layout)
    for axis, placement in enumerate(layout.placements):
        if not isinstance(placement, Shard):
            grid = grid.narrow(axis, 0, 1)
    return blocks.assemble(grid, layout, global_shape)


def splits_as_views(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether the storage is a permutation of the global value's elements (every mesh axis a
    Shard, even blocks): then plain view ops carry the right gradient both ways."""
    return layout.is_fully_sharded and shard_table(layout, shape).is_even


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


@cached(1024)
def _distribute_steps(layout: Layout, shape: tuple[int, ...]):
    """The view ops from an evenly split global value without Partial axes to its storage
    (None for the other layouts), computed once per layout and shape."""
    table = shard_table(layout, shape)
    if not table.is_even or layout.has_partial:
        return None
    n, local = layout.mesh.size, table.padded_shape
    if layout.is_replicated:
        return ((torch.Tensor.expand, (n, *shape)),)
    view, order, grid, expanded = blocks.split_recipe(layout, local)
    ops = [(torch.Tensor.reshape, view), (torch.Tensor.permute, order)]
    if not layout.is_fully_sharded:
        ops += [(torch.Tensor.reshape, grid), (torch.Tensor.expand, expanded)]
    return _steps(shape, [*ops, (torch.Tensor.reshape, (n, *local))])


@cached(1024)
def _gather_steps(layout: Layout, shape: tuple[int, ...]):
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
    view, order = blocks.merge_recipe(layout, local, len(shape))
    ops += [(torch.Tensor.permute, order), (torch.Tensor.reshape, shape)]
    return _steps((mesh.size, *local), ops)


def shard(storage: torch.Tensor, layout: Layout, global_shape: tuple[int, ...], device) -> torch.Tensor:
    """Device ``device``'s shard, without padding (``device``: a flat index or a coordinate)."""
    index = _device_index(layout.mesh, device)
    return blocks.unpad(storage[index], shard_table(layout, global_shape).local_shapes[index])


def shards(storage: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Every device's shard, in flat mesh order, without padding."""
    local_shapes = shard_table(layout, global_shape).local_shapes
    return tuple([blocks.unpad(storage[k], s) for k, s in enumerate(local_shapes)])


def _device_index(mesh, device) -> int:
    where = "fd.DTensor.to_local(device)"
    if device is None:
        raise InputTypeError(
            explain(
                where,
                f"a simulated mesh holds the shards of all {mesh.size} devices",
                expected=f"a device index in [0, {mesh.size}) or a coordinate of shape {mesh.shape}",
                got="None",
                fix="pass device=k, or call local_shards() for every shard",
            )
        )
    if not isinstance(device, (bool, tuple, list)) and hasattr(device, "__index__"):
        device = device.__index__()
    if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < mesh.size:
        return device
    if (
        isinstance(device, (tuple, list))
        and len(device) == mesh.ndim
        and all([isinstance(c, int) and 0 <= c < s for c, s in zip(device, mesh.shape)])
    ):
        return mesh.flat_index(device)
    raise InputTypeError(
        explain(
            where,
            "no such device on the mesh",
            expected=f"an index in [0, {mesh.size}) or a coordinate within {mesh.shape}",
            got=repr(device),
            fix="count devices in row-major mesh order, or give the mesh coordinate",
        )
    )


def from_local(shards, layout: Layout, global_shape: tuple[int, ...], *, copy: bool, where: str):
    """Storage from every device's shard (a list in flat mesh order: stacked, a copy) or from
    one shard that every device holds (what each rank passes in an SPMD program: held once, a
    copy of it with ``copy``)."""
    mesh = layout.mesh
    table = shard_table(layout, global_shape)
    _check_count(shards, mesh, where)
    shards = [t.to(mesh.device_type) for t in shards]
    if len(shards) == 1:
        _check_shape(shards[0].shape, table.local_shapes[0], 0, where, global_shape)
        if not table.is_even:
            raise ShapeError(
                explain(
                    f"{where}(local_tensor)",
                    f"global shape {global_shape} splits unevenly: devices hold shards of different shapes",
                    expected=f"a list of {mesh.size} shards",
                    got="one tensor for every device",
                    fix="pass each device's shard in a list",
                )
            )
        held = shards[0].clone() if copy else shards[0]
        storage = held.unsqueeze(0).expand(mesh.size, *held.shape)
    else:
        for k, (t, expected) in enumerate(zip(shards, table.local_shapes)):
            _check_shape(t.shape, expected, k, where, global_shape)
        storage = torch.stack([blocks.pad(t, table.padded_shape) for t in shards])
    return storage


def _check_count(shards, mesh, where: str) -> None:
    if len(shards) not in (1, mesh.size):
        raise ShapeError(
            explain(
                f"{where}(local_tensor)",
                "one shard per device",
                expected=f"{mesh.size} tensors for mesh {mesh.shape}",
                got=f"{len(shards)}",
                fix="pass a list with every device's shard in row-major mesh order",
            )
        )


def shard_infos(shards, layout: Layout, *, where: str) -> tuple[blocks.ShardInfo, ...]:
    """Every device's shard metadata, in flat mesh order (one shard given: every device's)."""
    _check_count(shards, layout.mesh, where)
    infos = tuple([blocks.shard_info(t) for t in shards])
    return infos * layout.mesh.size if len(infos) == 1 else infos


def _check_shape(got, expected, device: int, where: str, shape) -> None:
    if tuple(got) != tuple(expected):
        raise ShapeError(
            explain(
                f"{where}(local_tensor)",
                f"device {device}'s shard does not fit global shape {tuple(shape)}",
                expected=f"local shape {tuple(expected)}",
                got=f"{tuple(got)}",
                fix="pass shape= with the true global shape, or shards of the right size",
            )
        )


def differing_replicas(storage: torch.Tensor, layout: Layout) -> list[str]:
    """The Replicate axes of ``layout`` along which the devices' shards differ."""
    grid = storage.reshape(*layout.mesh.shape, *storage.shape[1:])
    return [
        name
        for axis, (name, placement) in enumerate(zip(layout.mesh.axis_names, layout.placements))
        if isinstance(placement, Replicate) and not torch.equal(grid, grid.narrow(axis, 0, 1).expand_as(grid))
    ]


def materialize(layout: Layout, global_shape: tuple[int, ...], make_blocks) -> torch.Tensor:
    """Storage from ``make_blocks(grid_shape, None)``: a grid with one padded block per
    distinct shard (:func:`.._blocks.distinct_shards`); padding zeroed, Partial axes
    partitioned as :func:`distribute` does."""
    mesh = layout.mesh
    sizes, padded, plain = _grid_of(layout, tuple(global_shape))
    grid = make_blocks((*sizes, *padded), None).expand(*mesh.shape, *padded)
    if plain:
        return grid.reshape(mesh.size, *padded)
    storage = blocks.partition_partial(grid, layout).reshape(mesh.size, *padded)
    if not shard_table(layout, global_shape).is_even:
        storage = storage * blocks.valid_mask(layout, global_shape, str(storage.device))
    return storage


@cached(1024)
def _grid_of(layout: Layout, global_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """The grid of :func:`materialize` (:func:`.._blocks.distinct_shards`), and whether its
    blocks are the storage's as they are: no Partial axis to partition, no padding to zero."""
    sizes, padded = blocks.distinct_shards(layout, global_shape)
    return sizes, padded, not layout.has_partial and shard_table(layout, global_shape).is_even


def saved(storage: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, None]:
    """Every device's shard (a value held once stays held once): the storage, detached."""
    return storage.detach(), None


def restored(storage, layout: Layout, global_shape: tuple[int, ...], device) -> torch.Tensor:
    """The storage of a loaded value, checked to hold every device's padded block."""
    expected = (layout.mesh.size, *shard_table(layout, global_shape).padded_shape)
    if not isinstance(storage, torch.Tensor) or tuple(storage.shape) != expected or device is not None:
        raise ShapeError(
            explain(
                "fd.DTensor (loading)",
                "the saved shards do not fit the saved layout",
                expected=f"stacked blocks of shape {expected}",
                got=repr(getattr(storage, "shape", storage)),
                fix="load a file written by pickle or torch.save of an fd.DTensor, unchanged",
            )
        )
    return storage


def padded(storage: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """Every device's block at the layout's padded shape: the storage itself."""
    return storage


def unpadded(storage: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The storage of padded blocks: itself (a simulated storage holds them padded)."""
    return storage


class _Replica(torch.autograd.Function):
    """One device's copy of a replicated value's storage; every device's cotangent is the
    same, the one computed on this copy (as each rank computes its own on the distributed
    backend)."""

    @staticmethod
    def forward(storage):
        return storage[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.devices = inputs[0].shape[0]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_HeldOnce, g, ctx.devices)  # (its own derivative takes one replica again)


class _HeldOnce(torch.autograd.Function):
    """The storage of a replicated value computed once: ``tensor`` held for every device; its
    cotangent is one device's (they are equal). The two functions are each other's derivative,
    to any order."""

    @staticmethod
    def forward(tensor, devices):
        return tensor.unsqueeze(0).expand(devices, *tensor.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_Replica, g), None


def replica(storage: torch.Tensor) -> torch.Tensor:
    """One device's block of the storage of a replicated value (all are equal)."""
    return autograd.apply(_Replica, storage) if storage.requires_grad else storage[0]


def replicated(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The storage, in the replicated ``layout``, of ``tensor``: every device's value, computed
    once."""
    if tensor.requires_grad:
        return autograd.apply(_HeldOnce, tensor, layout.mesh.size)
    return tensor.unsqueeze(0).expand(layout.mesh.size, *tensor.shape)


def from_source(tensor: torch.Tensor, mesh, src: int) -> torch.Tensor:
    """The one tensor every simulated device holds: already the source's."""
    return tensor


class Held(NamedTuple):
    """How a layout's blocks are held once along its Replicate axes (of more than one
    device): the mesh grid with those axes kept at one coordinate, ``axes`` their positions,
    ``rows`` the distinct blocks, ``devices`` the device (flat index) that stands for each."""

    grid: tuple[int, ...]
    axes: tuple[int, ...]
    rows: int
    devices: tuple[int, ...]


#: elements of a block from which a value moved into a Replicate axis is held once: below, the
#: Python of holding it outweighs the work it saves
HELD_MIN_ELEMENTS = 1 << 14


@cached(1024)
def held_plan(layout: Layout) -> Held | None:
    """How ``layout``'s blocks are held once (None where no axis of more than one device
    replicates them)."""
    mesh = layout.mesh
    axes = tuple(
        [
            a
            for a, (p, n) in enumerate(zip(layout.placements, mesh.shape))
            if isinstance(p, Replicate) and n > 1
        ]
    )
    if not axes:
        return None
    grid = tuple([1 if a in axes else n for a, n in enumerate(mesh.shape)])
    devices = tuple(
        [d for d in range(mesh.size) if all(c == 0 for a, c in enumerate(mesh.coordinate(d)) if a in axes)]
    )
    return Held(grid, axes, math.prod(grid), devices)


def _taken(full: torch.Tensor, mesh_shape, plan: Held, summed: tuple[int, ...], reduce: bool):
    """Every device's blocks -> the held ones: the copy at coordinate 0 along the plan's axes,
    or with ``reduce`` the sum of the copies along the ``summed`` ones."""
    grid = full.reshape(*mesh_shape, *full.shape[1:])
    for axis in plan.axes:
        grid = grid.sum(axis, keepdim=True) if reduce and axis in summed else grid.narrow(axis, 0, 1)
    return grid.reshape(plan.rows, *full.shape[1:])


def _spread(held: torch.Tensor, mesh_shape, plan: Held, summed: tuple[int, ...], pad: bool):
    """The held blocks -> every device's: a copy for every device, or with ``pad`` the block at
    coordinate 0 and zeros at the others along the ``summed`` axes."""
    grid = held.reshape(*plan.grid, *held.shape[1:])
    for axis in summed if pad else ():
        zeros = list(grid.shape)
        zeros[axis] = mesh_shape[axis] - 1
        grid = torch.cat([grid, grid.new_zeros(zeros)], axis)
    grid = grid.expand(*mesh_shape, *held.shape[1:])
    return grid.reshape(math.prod(mesh_shape), *held.shape[1:])


# A held value's cotangent is the whole one along the axes it is replicated over (every copy's
# is that one: the copy at coordinate 0 is taken), and along the ``summed`` axes, those it is
# varied over (see .._varied: each device's cotangent is a part), the sum of the parts. The
# function below moves values and cotangents between the two forms by these rules; each way
# is the other's derivative, to any order.


@autograd.compilable
class _Moved(torch.autograd.Function):
    """Every device's blocks -> the held ones (``to_held``: :func:`_taken`, with ``flag`` its
    ``reduce``), or back (:func:`_spread`, with ``flag`` its ``pad``). Backward: the other
    way, with the other ``flag``: the held cotangent for every copy, or at coordinate 0 with
    zeros at the others along the summed axes (parts that sum to it); the copy at coordinate
    0, or the sum of the parts along the summed axes."""

    @staticmethod
    def forward(x, mesh_shape, plan, summed, to_held, flag):
        return (_taken if to_held else _spread)(x, mesh_shape, plan, summed, flag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        mesh_shape, plan, summed, to_held, flag = ctx.args
        back = autograd.apply(_Moved, g, mesh_shape, plan, summed, not to_held, not flag)
        return back, None, None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return autograd.apply(_Moved, t, *ctx.args)


def fold(storage: torch.Tensor, layout: Layout, plan: Held, summed: tuple[int, ...] = ()) -> torch.Tensor:
    """The held blocks of a stacked storage in ``layout`` (a view where the storage allows);
    ``summed``: the plan's axes the value is varied over."""
    if storage.requires_grad:
        return autograd.apply(_Moved, storage, layout.mesh.shape, plan, summed, True, False)
    return _taken(storage, layout.mesh.shape, plan, summed, False)


def unfold(
    held: torch.Tensor, layout: Layout, summed: tuple[int, ...] = (), *, parts: bool = False
) -> torch.Tensor:
    """Every device's block of a held value in ``layout`` (``summed``: as :func:`fold`'s);
    with ``parts``, parts that sum to it along the ``summed`` axes (the block at coordinate 0,
    zeros at the others)."""
    plan = held_plan(layout)
    if held.requires_grad:
        return autograd.apply(_Moved, held, layout.mesh.shape, plan, summed, False, parts)
    return _spread(held, layout.mesh.shape, plan, summed, parts)

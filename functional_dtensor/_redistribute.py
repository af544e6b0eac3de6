"""``redistribute``: the same global value in another layout, by the planned steps.

The planner (:mod:`._redistribute_plan`) picks the steps; this module only runs them, on the
simulated backend's stacked shards or on this rank's shard. The whole change is one autograd
node: its backward redistributes the cotangent back to the source layout (Partial axes as
Replicate, as DTensor).

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> rows = fd.distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, fd.P("x"))
>>> cols = fd.redistribute(rows, fd.P(None, "x"))
>>> cols.to_local(device=1).flatten().tolist()
[1.0, 5.0, 9.0, 13.0]
"""

from __future__ import annotations

import math

import torch

from . import _autograd as autograd
from . import _comm_log as comm_log
from ._backends import distributed, distributed_collectives, simulated_collectives
from ._dtensor import DTensor, _global_of, _storage_of, _without_partial, layout_for
from ._errors import InputTypeError, explain
from ._layout import Layout, PlacementsOrSpec
from ._mesh import DeviceMesh
from ._placements import Partial, Replicate, Shard
from ._redistribute_plan import (
    AllGather,
    AllReduce,
    AllToAll,
    Partition,
    ReduceBroadcast,
    ReduceScatter,
    Regather,
    Slice,
    Step,
    Swap,
    plan,
)
from ._sharding import shard_table

__all__ = ["redistribute"]


def redistribute(x: DTensor, placements: PlacementsOrSpec, /) -> DTensor:
    """``x`` laid out by ``placements`` (one per mesh axis, or an ``fd.P``), moved by the
    cheapest planned collectives (see :func:`explain_redistribute`). Pure and differentiable:
    the gradient comes back in the source layout (a Partial source gets a Replicate gradient,
    as DTensor)."""
    if not isinstance(x, DTensor):
        raise InputTypeError(
            explain(
                "fd.redistribute(x)",
                "redistribute changes the layout of a distributed value",
                expected="an fd.DTensor",
                got=type(x).__name__,
                fix="lay a tensor out with fd.distribute_tensor(t, mesh, placements)",
            )
        )
    target = layout_for(x.device_mesh, placements, x.ndim, "fd.redistribute")
    if target == x.layout:
        return x
    storage = autograd.apply(_Redistribute, x._storage, x.layout, target, tuple(x.shape))
    return DTensor(storage, target, x.shape)


class _Redistribute(torch.autograd.Function):
    """Storage in one layout -> storage in another. Backward: the cotangent, laid out like the
    result, redistributed to the source layout (Partial axes as Replicate)."""

    @staticmethod
    def forward(storage, source, target, shape):
        index = _plan_index(_key(source), _key(target), shape, storage.element_size())
        for step in _PLANS[index]:
            storage = run(step, storage, shape)
        return storage

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.source, ctx.target, ctx.shape = inputs

    @staticmethod
    def vmap(info, in_dims, storage, source, target, shape):
        # a mapped batch becomes one more trailing dim of the value, whole on every device
        moved = storage.movedim(in_dims[0], -1)
        return autograd.apply(_Redistribute, moved, source, target, (*shape, moved.shape[-1])), -1

    @staticmethod
    def backward(ctx, g):
        source, target = _without_partial(ctx.target), _without_partial(ctx.source)
        if source == target:
            return g, None, None, None
        return autograd.apply(_Redistribute, g, source, target, ctx.shape), None, None, None


# Under torch.compile the planner is not traced: it runs eagerly, from primitive keys of the
# layouts, and the graph keeps the index of its plan here.
_PLANS: list[tuple[Step, ...]] = []
_PLAN_INDEX: dict[tuple[Step, ...], int] = {}


def _key(layout: Layout) -> tuple:
    mesh = layout.mesh
    placements = tuple(
        [
            ("S", p.dim) if isinstance(p, Shard) else ("P", p.op) if isinstance(p, Partial) else ("R",)
            for p in layout.placements
        ]
    )
    return (mesh.shape, mesh.axis_names, mesh.device_type, mesh.backend, mesh.device_ids, placements)


def _layout(key: tuple) -> Layout:
    shape, names, device_type, backend, ids, placements = key
    rebuilt = [
        Shard(v[1]) if v[0] == "S" else Partial(v[1]) if v[0] == "P" else Replicate() for v in placements
    ]
    return Layout(DeviceMesh(shape, names, device_type, backend, ids), tuple(rebuilt))


@torch._dynamo.assume_constant_result
def _plan_index(source_key: tuple, target_key: tuple, shape: tuple[int, ...], itemsize: int) -> int:
    steps = plan(_layout(source_key), _layout(target_key), shape, itemsize)
    if steps not in _PLAN_INDEX:
        _PLAN_INDEX[steps] = len(_PLANS)
        _PLANS.append(steps)
    return _PLAN_INDEX[steps]


# --- the executor: one function per step ------------------------------------------------------


def run(step: Step, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Run one planned step on a storage (stacked shards, or this rank's shard)."""
    mesh = step.source.mesh
    simulated = mesh.backend == "simulated"
    ops = simulated_collectives if simulated else distributed_collectives
    lead = 1 if simulated else 0  # the stacked device dim
    names = step.names
    if step.collective and not isinstance(step, Regather) and comm_log.active():
        per_device = x[0] if simulated else x
        if not torch.compiler.is_compiling():
            comm_log.record(step.collective, names, per_device.numel() * per_device.element_size())
    if isinstance(step, AllGather):
        gathered = ops.all_gather(x, mesh, names, 0, False)  # (k, *local), k over names, major first
        return _merge_blocks(gathered, step, lead)
    if isinstance(step, AllReduce):
        return ops.all_reduce(x, mesh, names, step.op)
    if isinstance(step, ReduceScatter):
        out = ops.reduce_scatter(x, mesh, names, step.dim, True)
        return out / step.group_size if step.op == "avg" else out
    if isinstance(step, AllToAll):
        return ops.all_to_all(x, mesh, names, step.split, step.concat, True)
    if isinstance(step, Swap):
        k = mesh.shape[step.axes[0]]
        pairs = tuple([(i * k + j, j * k + i) for i in range(k) for j in range(k)])  # the diagonal stays
        return ops.permute(x, mesh, names, pairs)
    if isinstance(step, ReduceBroadcast):
        return _reduce_broadcast(x, step, simulated)
    if isinstance(step, Slice):
        return _slice(x, step, simulated)
    if isinstance(step, Partition):
        return _partition(x, step, simulated)
    return _regather(x, step, shape)


def _merge_blocks(gathered: torch.Tensor, step: AllGather, lead: int) -> torch.Tensor:
    """Gathered blocks ``(*lead, k, *local)`` -> the local block of the layout after the step:
    each gathered axis widens the dim it split (as its innermost split)."""
    mesh = step.source.mesh
    sizes = [mesh.shape[a] for a in step.axes]
    local = list(gathered.shape[lead + 1 :])
    blocks = gathered.reshape(*gathered.shape[:lead], *sizes, *local)
    order, shape = list(range(lead)), list(gathered.shape[:lead])
    first_local = lead + len(sizes)
    for dim in range(len(local)):
        parts = [i for i, a in enumerate(step.axes) if step.source.placements[a] == Shard(dim)]
        order += [lead + i for i in parts] + [first_local + dim]
        shape.append(local[dim] * math.prod([sizes[i] for i in parts]))
    return blocks.permute(order).reshape(shape)


def _slice(x: torch.Tensor, step: Slice, simulated: bool) -> torch.Tensor:
    mesh, names, k = step.source.mesh, step.names, step.group_size
    if simulated:
        d = step.dim + 1
        blocks = x.reshape(*x.shape[:d], k, x.shape[d] // k, *x.shape[d + 1 :]).movedim(d, 1)
        index = simulated_collectives.axis_index(mesh, names, str(x.device))
        return blocks[torch.arange(x.shape[0], device=x.device), index]
    size = x.shape[step.dim] // k
    return x.narrow(step.dim, distributed.group_index(mesh, names) * size, size)


def _partition(x: torch.Tensor, step: Partition, simulated: bool) -> torch.Tensor:
    if step.op != "sum":
        return x  # avg, max, min of copies of a value are the value
    if x.is_floating_point() or x.is_complex():
        return x / step.group_size
    mesh, names = step.source.mesh, step.names
    if simulated:
        first = simulated_collectives.axis_index(mesh, names, str(x.device)) == 0
        return x * first.view(-1, *[1] * (x.dim() - 1)).to(x.dtype)
    return x if distributed.group_index(mesh, names) == 0 else torch.zeros_like(x)


def _reduce_broadcast(x: torch.Tensor, step: ReduceBroadcast, simulated: bool) -> torch.Tensor:
    """Partial on axis a, Shard on axis b (equal sizes) -> Shard on a, Replicate on b: the
    group along a of column j reduces into the device at a = j; that device broadcasts along
    its row (b)."""
    mesh = step.source.mesh
    a, b = step.axes
    k = mesh.shape[a]
    if simulated:
        blocks = x.reshape(*mesh.shape, *x.shape[1:])
        reduced = blocks.sum(a, keepdim=True)  # (.., 1 at a, .., k at b, ..): column j's total
        moved = reduced.transpose(a, b).expand(blocks.shape)  # device (i, j) gets column i's
        out = moved.reshape(x.shape)
    else:
        here = list(distributed.coordinate(mesh))
        root = list(here)
        root[a] = here[b]  # the device of my column on the diagonal
        out = distributed_collectives.reduce(x, mesh, (mesh.axis_names[a],), mesh.flat_index(root))
        source = list(here)
        source[b] = here[a]  # the device of my row on the diagonal
        out = distributed_collectives.broadcast(
            out, mesh, (mesh.axis_names[b],), mesh.flat_index(source), donate=True
        )
    return out / k if step.op == "avg" else out


def _regather(x: torch.Tensor, step: Regather, shape: tuple[int, ...]) -> torch.Tensor:
    source, target = step.source, step.target
    if comm_log.active() and not torch.compiler.is_compiling():
        mesh = source.mesh
        nbytes = math.prod(shard_table(source, shape).padded_shape) * x.element_size()
        for name, placement in zip(mesh.axis_names, source.placements):
            if isinstance(placement, Partial):
                comm_log.record("all_reduce", (name,), nbytes)
        sharding = tuple([n for n, p in zip(mesh.axis_names, source.placements) if isinstance(p, Shard)])
        if sharding:
            comm_log.record("all_gather", sharding, nbytes)
    return _storage_of(_global_of(x, source, shape), target)

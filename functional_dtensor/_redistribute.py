"""``redistribute``: the same global value in another layout.

This first version moves data the simple way: it assembles the global value from the shards
(all-reduce over Partial axes, all-gather over Shard axes) and keeps each device's block of the
target layout. It is correct for every pair of layouts, uneven shards and Partial sources
included, on both backends; it is not the cheapest plan for most of them.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> rows = fd.distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, fd.P("x"))
>>> cols = fd.redistribute(rows, fd.P(None, "x"))
>>> cols.to_local(device=1).flatten().tolist()
[1.0, 5.0, 9.0, 13.0]
"""

from __future__ import annotations

import torch

from . import _autograd as autograd
from . import _comm_log as comm_log
from ._dtensor import DTensor, _global_of, _storage_of, _without_partial, layout_for
from ._errors import InputTypeError, explain
from ._layout import Layout, PlacementsOrSpec
from ._placements import Partial, Shard
from ._sharding import shard_table

__all__ = ["redistribute"]


def redistribute(x: DTensor, placements: PlacementsOrSpec, /) -> DTensor:
    """``x`` laid out by ``placements`` (one per mesh axis, or an ``fd.P``). Pure and
    differentiable: the gradient comes back in the source layout (a Partial source gets a
    Replicate gradient, as DTensor)."""
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


def _record(layout: Layout, shape: tuple[int, ...], itemsize: int) -> None:
    """Count the collectives that assembling a value of ``layout`` runs (on the simulated
    backend too, where they are virtual)."""
    if not comm_log.active():
        return
    mesh = layout.mesh
    local = shard_table(layout, shape).padded_shape
    nbytes = itemsize
    for size in local:
        nbytes *= size
    for name, placement in zip(mesh.axis_names, layout.placements):
        if isinstance(placement, Partial):
            comm_log.record("all_reduce", (name,), nbytes)
    sharding = tuple(n for n, p in zip(mesh.axis_names, layout.placements) if isinstance(p, Shard))
    if sharding:
        comm_log.record("all_gather", sharding, nbytes)


class _Redistribute(torch.autograd.Function):
    """Storage in one layout -> storage in another. Backward: the cotangent, laid out like the
    result, redistributed to the source layout (Partial axes as Replicate)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(storage, source, target, shape):
        if not torch.compiler.is_compiling():
            _record(source, shape, storage.element_size())
        return _storage_of(_global_of(storage, source, shape), target)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.source, ctx.target, ctx.shape = inputs

    @staticmethod
    def backward(ctx, g):
        source, target = _without_partial(ctx.target), _without_partial(ctx.source)
        if source == target:
            return g, None, None, None
        return autograd.apply(_Redistribute, g, source, target, ctx.shape), None, None, None

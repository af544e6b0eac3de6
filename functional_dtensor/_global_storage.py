"""A value's storage to and from its global tensor, differentiably: :func:`distribute_storage`
and :func:`gather_storage`, the autograd functions behind them (:class:`Distribute` and
:class:`FullTensor`, each the other's transpose), and :func:`without_partial`, the layout of a
gradient."""

from __future__ import annotations

import torch

from . import _autograd as autograd
from ._backend import backend_of
from ._cache import cached
from ._layout import Layout
from ._placements import Replicate

__all__ = ["distribute_storage", "gather_storage", "without_partial", "Distribute", "FullTensor"]


def distribute_storage(tensor: torch.Tensor, layout: Layout, *, copy: bool = False) -> torch.Tensor:
    """The storage of the global ``tensor``, differentiably (``copy``: sharing no memory with
    it). Where storage and value are views of each other, their own backward reassembles the
    cotangent; every other case goes through :class:`Distribute`, where anything differentiates
    (:func:`._autograd.differentiated`: else the kernel alone, as ``Distribute`` would run it)."""
    backend = backend_of(layout.mesh)
    if not autograd.differentiated(tensor) or backend.splits_as_views(layout, tuple(tensor.shape)):
        return backend.distribute(tensor, layout, copy=copy)
    return autograd.apply(Distribute, tensor, layout, copy, without_partial(layout))


def gather_storage(storage: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """The global value of ``storage``, differentiably (the inverse of :func:`distribute_storage`;
    :class:`FullTensor` where anything differentiates)."""
    backend = backend_of(layout.mesh)
    if not autograd.differentiated(storage) or backend.splits_as_views(layout, shape):
        return backend.gather(storage, layout, shape)
    return autograd.apply(FullTensor, storage, layout, shape, without_partial(layout))


@cached(1024)
def without_partial(layout: Layout) -> Layout:
    """``layout`` with its Partial axes Replicate: the layout of a gradient (as DTensor)."""
    if not layout.has_partial:
        return layout
    return Layout(
        layout.mesh,
        tuple([Replicate() if p.is_partial() else p for p in layout.placements]),
        layout.shard_order,
    )


@autograd.compilable
class Distribute(torch.autograd.Function):
    """Global tensor -> storage. The gradient of a global value is global: its cotangent is the
    same on every replica (and every Partial part), so the backward reassembles the global
    cotangent from one replica of each shard, read in layout ``back`` (DTensor: a Partial
    source gets a Replicate gradient). That backward's own backward is this forward again
    (each is the other's transpose, to every order)."""

    @staticmethod
    def forward(tensor, layout, copy, back):
        return backend_of(layout.mesh).distribute(tensor, layout, copy=copy)

    @staticmethod
    def vmap(info, in_dims, tensor, layout, copy, back):
        # a mapped batch becomes one more trailing dim of the value, whole on every device
        return autograd.apply(Distribute, tensor.movedim(in_dims[0], -1), layout, copy, back), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.shape, ctx.copy, ctx.back = inputs[1], tuple(inputs[0].shape), inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(FullTensor, g, ctx.back, ctx.shape, ctx.layout), None, None, None

    @staticmethod
    def jvp(ctx, t, _layout, _copy, _back):
        return autograd.apply(Distribute, t, ctx.layout, ctx.copy, ctx.back)


@autograd.compilable
class FullTensor(torch.autograd.Function):
    """Storage -> global tensor. Backward: every device gets its block of the (replicated)
    global cotangent, laid out by ``back``, with no communication; its own backward is this
    forward again."""

    @staticmethod
    def forward(storage, layout, shape, back):
        return backend_of(layout.mesh).gather(storage, layout, shape)

    @staticmethod
    def vmap(info, in_dims, storage, layout, shape, back):
        moved = storage.movedim(in_dims[0], -1)
        return autograd.apply(FullTensor, moved, layout, (*shape, moved.shape[-1]), back), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.shape, ctx.back = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(Distribute, g, ctx.back, False, ctx.layout), None, None, None

    @staticmethod
    def jvp(ctx, t, _layout, _shape, _back):
        return autograd.apply(FullTensor, t, ctx.layout, ctx.shape, ctx.back)

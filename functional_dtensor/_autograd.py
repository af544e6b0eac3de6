"""Autograd plumbing of the collectives: one autograd function that runs any collective, and a
cheap way to call autograd functions.

A collective is described by an op record (see :mod:`._collectives`) with ``run(x)`` (the
kernel, on storage-form values: a simulated mesh's stacked shards, or a rank's own shard),
``transpose(g, stacked, saved)`` (its gradient, itself collectives, so that it can be
differentiated again), ``tangent(t, stacked, saved)`` (its forward-mode derivative) and
``shifted()`` (the same op on values with one more leading dim). :class:`Collective` runs it
under autograd and every ``torch.func`` transform, to any order.

``Function.apply`` binds the arguments to ``forward``'s signature on every call when the
function defines ``setup_context`` (to fill in default arguments, which ours never have): about
20 us a call, more than the ops of a small collective. :func:`apply` skips that where no
``torch.func`` transform is active and nothing is being compiled.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from ._functorch import current_level, transforms_active

__all__ = ["apply", "compilable", "Collective", "differentiated", "run_collective"]


def apply(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, skipping the signature binding where it is not needed; with its
    forward-mode rule (see :func:`compilable`), where it has one, except while compiling."""
    if torch.compiler.is_compiling():
        return function.apply(*args)
    function = getattr(function, "with_jvp", function)
    if transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)


def compilable(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Class decorator of an autograd function with a forward-mode rule (``jvp``): Dynamo does
    not trace such functions, so the rule moves to a twin, ``function.with_jvp``, which
    :func:`apply` runs except while compiling (a compiled graph is differentiated in reverse
    mode)."""
    jvp = function.__dict__["jvp"]
    del function.jvp
    function.with_jvp = type(
        function.__name__,
        (function,),
        {"jvp": jvp, "__module__": function.__module__, "__qualname__": function.__qualname__},
    )
    return function


def differentiated(x: torch.Tensor) -> bool:
    """Whether autograd (reverse or forward mode, or a ``torch.func`` transform, or the
    compiler) may see ``x``."""
    return (
        (x.requires_grad and torch.is_grad_enabled())
        or transforms_active()
        or forward_ad._current_level >= 0  # dual tensors may be about (torch.func.linearize)
        or torch.compiler.is_compiling()
    )


def run_collective(op, x: torch.Tensor, stacked: bool) -> torch.Tensor:
    """``op`` on ``x`` (``stacked``: in storage form): through :class:`Collective` where
    autograd, a transform or the compiler may see it; else its kernel directly, as in a
    backward not differentiated again (a new tensor either way)."""
    if differentiated(x):
        return apply(Collective, x, op, stacked)
    out = op.run(x)
    return x.view_as(x) if out is x else out


@compilable
class Collective(torch.autograd.Function):
    """Run the collective ``op`` on ``x``; ``stacked``: ``x`` carries the simulated device dim
    in front (storage form), else it is a per-device value.

    Forward runs the kernel; backward runs the op's transpose, and forward mode its tangent
    rule (both made of collectives, so every order of differentiation works). Under vmap: at the level of a
    simulated mesh's device vmap, the batch dim is the device dim, so the op runs once on the
    stacked values of all devices; at any other level (a user's own vmap) the batch dim moves
    out of the way and the op runs with its dims shifted.
    """

    @staticmethod
    def forward(x: torch.Tensor, op, stacked: bool) -> torch.Tensor:
        return op.run(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, op, stacked = inputs
        ctx.op, ctx.stacked = op, stacked
        if op.saves_input:
            ctx.save_for_backward(x, output)
            ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors if ctx.op.saves_input else ()
        return ctx.op.transpose(g, ctx.stacked, saved), None, None

    @staticmethod
    def jvp(ctx, t, _op, _stacked):
        saved = ctx.saved_tensors if ctx.op.saves_input else ()
        return ctx.op.tangent(t, ctx.stacked, saved)

    @staticmethod
    def vmap(info, in_dims, x, op, stacked: bool):
        (batch_dim,) = in_dims[:1]
        level = (current_level() or 0) + 1  # the rule runs one level below its own
        if not stacked and level == op.frame.device_level:
            return apply(Collective, x.movedim(batch_dim, 0), op, True), 0
        front = 1 if stacked else 0
        out = apply(Collective, x.movedim(batch_dim, front), op.shifted(), stacked)
        return out, front if op.keeps_device_dim or not stacked else 0

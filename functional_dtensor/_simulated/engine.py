"""The simulated backend's device vmap: a per-device function runs once for all devices, under a
vmap over the stacked device dim.

* :func:`run_per_device` runs the function; inputs and outputs that are the same on every
  device are held once, not batched (a replicated argument, a ``psum`` over every device).
* :func:`on_devices` makes such a value per-device copies where it meets per-device values.
* :func:`apply` runs a collective on a per-device value: where the device vmap is the
  innermost transform, the device dim is unwrapped and the kernel runs once on the stacked
  values, below the vmap; under a user's transform inside the function, through the vmap rule
  of :class:`.._autograd.Collective`.
"""

from __future__ import annotations

import math

import torch

from .. import _autograd as autograd
from .._cache import cached
from .._errors import BatchedFunctionError, FunctionalDTensorError, explain
from .._functorch import (
    add_batch_dim,
    batched_at,
    below_current_level,
    current_level,
    level_of,
    over_devices,
    remove_batch_dim,
)
from .._op_args import replace_inputs, tensors_of
from .._varying import varying_in
from . import kernels
from .batching import RULES, BatchingRules, by_rule

__all__ = [
    "run_per_device",
    "on_devices",
    "apply",
    "apply_to_storage",
    "axis_index",
    "run_op",
    "RULED_OPS",
    "ops_mode",
    "leave",
]


def run_per_device(per_device, size: int, in_dims, inputs):
    """``per_device(level, device_level, *inputs)`` for all ``size`` devices at once, under a
    vmap over ``in_dims`` (both levels: the vmap's); returns the outputs and whether each is
    batched over the devices (an unbatched output is the same on all)."""
    try:
        if in_dims.count(None) == len(in_dims):  # vmap needs one mapped input to know the device count
            return over_devices(
                lambda level, device_level, *a: per_device(level, device_level, *a[:-1]),
                size,
                (*in_dims, 0),
                (*inputs, torch.arange(size)),
            )
        return over_devices(per_device, size, in_dims, inputs)
    except RuntimeError as error:
        if _READS_A_VALUE not in str(error):
            raise
        raise BatchedFunctionError(
            explain(
                "fd.shard_map(f)",
                "the per-device function reads a tensor's value into Python (.item(), float(), "
                "if or while on a tensor), but on a simulated mesh it runs once, batched over "
                f"all {size} devices, whose values differ",
                expected="tensor operations on the local values",
                got=str(error).splitlines()[0],
                fix="keep values as tensors: torch.where(cond, a, b) for a branch, a mask for a "
                "loop's condition; or run it on the distributed backend (fd.init_device_mesh)",
            )
        ) from error


#: what functorch says when a batched function reads a value (``.item()``, data-dependent ``if``)
_READS_A_VALUE = "vmap: It looks like you're"


@autograd.compilable
class _Replicate(torch.autograd.Function):
    """A value that is the same on every device, as stacked copies (an expand view). Backward:
    :class:`_FromCopies`, whose backward is this again (so that it differentiates to any
    order)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, mesh_shape, summed):
        return x.expand(math.prod(mesh_shape), *x.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh_shape, ctx.summed = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_FromCopies, g, ctx.mesh_shape, ctx.summed), None, None

    @staticmethod
    def jvp(ctx, t, _mesh_shape, _summed):
        return autograd.apply(_Replicate, t, ctx.mesh_shape, ctx.summed)


@autograd.compilable
class _FromCopies(torch.autograd.Function):
    """The cotangent of :class:`_Replicate`'s copies as the value's: along the mesh axes at
    positions ``summed`` the copies' cotangents are contributions and are summed; along the
    others the value is replicated, every copy's cotangent is already the whole one, and the
    copy at coordinate 0 is taken. Backward: :class:`_Replicate` (a replicated cotangent is
    whole on every copy)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(g, mesh_shape, summed):
        grid = g.reshape(*mesh_shape, *g.shape[1:])
        for axis in range(len(mesh_shape)):
            if axis in summed:
                grid = grid.sum(axis, keepdim=True)
            else:
                grid = grid.narrow(axis, 0, 1)
        return grid.reshape(g.shape[1:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh_shape, ctx.summed = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_Replicate, g, ctx.mesh_shape, ctx.summed), None, None

    @staticmethod
    def jvp(ctx, t, _mesh_shape, _summed):
        return autograd.apply(_FromCopies, t, ctx.mesh_shape, ctx.summed)


def on_devices(x: torch.Tensor, frame) -> torch.Tensor:
    """``x`` as per-device values. A value that is not batched over the devices (created inside
    the per-device function, captured, or replicated) is the same on every device: it becomes
    stacked copies (a view) with :class:`_Replicate`'s gradient, summed along the axes the value
    is treated as varying over (all of them with ``check_rep=False``) and taken from one copy
    along the others."""
    level = frame.device_level
    if level_of(x) == level or batched_at(x, level):  # (the first: the common case, cheaply)
        return x
    mesh = frame.mesh
    varying = varying_in(frame, x)
    summed = tuple([a for a, name in enumerate(mesh.axis_names) if not frame.check_rep or name in varying])
    if current_level() == level:
        if len(summed) == mesh.ndim:  # expand's own backward sums the copies
            stacked = below_current_level(x.expand, mesh.size, *x.shape)
        else:
            stacked = below_current_level(autograd.apply, _Replicate, x, mesh.shape, summed)
        return add_batch_dim(stacked, 0, level)
    # under a transform of the user's inside the per-device function: the same, with ops
    _refuse_while_compiling()
    first = _first_copies(mesh, summed, str(x.device))
    return torch.where(add_batch_dim(first, 0, level), x, x.detach())


@cached(256)
def _first_copies(mesh, summed: tuple[int, ...], device: str) -> torch.Tensor:
    """``(n,)``: True for the devices at coordinate 0 along every axis not in ``summed``."""
    return torch.tensor(
        [all(c == 0 for a, c in enumerate(mesh.coordinate(d)) if a not in summed) for d in range(mesh.size)],
        device=device,
    )


def apply_to_storage(op, x: torch.Tensor) -> torch.Tensor:
    """Run ``op`` on stacked values (outside shard_map, or in a transpose)."""
    if op.native:  # the kernel's own autograd is the transpose
        return op.run(x)
    return autograd.run_collective(op, x, True)


def apply(op, x: torch.Tensor) -> torch.Tensor:
    """Run ``op`` on a per-device value. A reduction over every device gives one unbatched
    value, and an op on an unbatched value may keep it unbatched (``op.on_unbatched``)."""
    frame = op.frame
    level = frame.device_level
    with torch._C.DisableTorchFunction():
        direct = current_level() == level
        if direct and not batched_at(x, level):
            unbatched = op.on_unbatched(x)
            if unbatched is not None:
                return below_current_level(apply_to_storage, unbatched, x)
        x = on_devices(x, frame)
        if direct and level_of(x) == level:
            op = op.held_once()
            out = below_current_level(apply_to_storage, op, remove_batch_dim(x, level, frame.mesh.size))
            return add_batch_dim(out, 0, level) if op.keeps_device_dim else out
        _refuse_while_compiling()
        return autograd.apply(autograd.Collective, x, op, False)


def _refuse_while_compiling() -> None:
    """A collective under a ``torch.func`` transform inside the per-device function runs by
    the transform's vmap rules, which ``torch.compile`` cannot trace on a simulated mesh."""
    if torch.compiler.is_compiling():
        raise FunctionalDTensorError(
            explain(
                "torch.compile of fd.shard_map on a simulated mesh",
                "a collective runs under a torch.func transform inside the per-device function",
                expected="torch.func transforms applied to the shard_map'd function, not inside it",
                got="a collective under torch.func.grad/vmap/jvp within the per-device function",
                fix="apply the transform outside fd.shard_map, or run this function uncompiled",
            )
        )


def axis_index(frame, axes: tuple[str, ...]) -> torch.Tensor:
    """Each device's index along ``axes``, as a per-device 0-d value."""
    return add_batch_dim(kernels.axis_index(frame.mesh, axes, frame.mesh.device_type), 0, frame.device_level)


#: ops that :func:`run_op` runs otherwise than as they are (unless lifting): by their batching rules
RULED_OPS = RULES


def run_op(frame, func, args, kwargs, lift: bool):
    """Run a torch op of the per-device function (for the replication tracker). ``lift``: its
    inputs do not all vary over every axis; then values the same on every device that meet
    per-device values become per-device copies first (broadcasting alone would sum their
    gradient over the devices along which they are replicated). The batching rules apply."""
    level = frame.device_level
    if lift:
        tensors = tensors_of(args, kwargs)
        levels = [level_of(t) == level for t in tensors]
        if any(levels) and not all(levels):
            args, kwargs = replace_inputs(
                func, args, kwargs, lambda v: v if level_of(v) == level else on_devices(v, frame)
            )
    out = by_rule(func, level, frame.mesh.size, args, kwargs)
    return func(*args, **kwargs) if out is None else out


def ops_mode(frame):
    """The torch-function mode that applies the batching rules to a per-device function run
    without replication tracking."""
    return BatchingRules(frame.device_level, frame.mesh.size)


def leave(value, replicated: bool, frame):
    """An output of the per-device function, as the device vmap returns it: a replicated
    output that is the same on every device (``check_rep``) stays one value."""
    if not isinstance(value, torch.Tensor) or level_of(value) == frame.device_level:
        return value  # (the common case: an output per device already)
    if frame.check_rep and replicated:
        return value
    return on_devices(value, frame)

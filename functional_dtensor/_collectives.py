"""Collectives: explicit, differentiable functional ops over named mesh axes (``jax.lax``
names and shapes), valid inside :func:`shard_map`.

Each collective is a frozen op record next to its public function: its shape rule, how each
backend runs it (stacked batched ops on the simulated backend, functional collectives on the
distributed one), its transpose, and its rule for which mesh axes the result varies over. One
autograd function runs any op record:

* on the distributed backend, ``forward`` runs the op on the local tensor;
* on the simulated backend the per-device function runs under ``torch.func.vmap`` over the
  device dim; the op's vmap rule, at the device level, re-runs the op on the stacked values of
  all devices at once; at any other vmap level (a user's own vmap) it moves that batch dim out
  of the way and re-runs the op with its dims shifted;
* ``backward`` runs the transpose op, so gradients are collectives too, on either backend.

With ``check_rep`` (the default) a value's type includes the set of mesh axes it varies over
(see :mod:`._varying`); transposes use it: the cotangent of a replicated result is replicated,
so ``psum`` transposes to a broadcast with no communication. Without it, ``psum`` transposes to
``psum``, as in JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch._C._functorch import (
    _add_batch_dim,
    _unwrap_batched,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    maybe_current_level,
    maybe_get_level,
)

from . import _autograd as autograd
from . import _comm_log as comm_log
from ._backends import distributed_collectives as on_ranks
from ._backends import simulated_collectives as stacked_ops
from ._backends.simulated_batching import below_device_level
from ._context import Frame, frame_for
from ._errors import InputTypeError, ShapeError, explain
from ._varying import axes_varying, tag

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pvary",
    "vary",
    "axis_index",
    "axis_size",
]

AxisName = str | tuple[str, ...]


# --- the machinery shared by every collective ------------------------------------------------


@dataclass(frozen=True)
class _Op:
    """A collective call: the frame it runs in and the mesh axes it runs over."""

    frame: Frame
    axes: tuple[str, ...]
    saves_input: ClassVar[bool] = False
    needs_varying: ClassVar[bool] = True  # run on values that vary over the axes (pvary first)
    keeps_device_dim: ClassVar[bool] = True  # run_stacked returns (n, ...), not one value
    name: ClassVar[str] = ""  # the collective it runs, as counted by CommDebugMode
    # run_stacked's own autograd is the transpose, with nothing to count (no Function needed)
    native: ClassVar[bool] = False

    def run_stacked(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_local(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def transpose(self, g: torch.Tensor, stacked: bool, saved) -> torch.Tensor:
        raise NotImplementedError

    def shifted(self) -> _Op:
        """The same op on values with one more leading per-device dim."""
        return self

    def varying(self, axes: frozenset[str]) -> frozenset[str]:
        """The axes the result varies over, given those the input varies over."""
        return axes

    @property
    def size(self) -> int:
        return self.frame.mesh.axis_size(self.axes)


def _log(op: _Op, x: torch.Tensor, stacked: bool) -> None:
    if op.name and not torch.compiler.is_compiling() and comm_log.active():
        per_device = x.numel() // (x.shape[0] if stacked else 1) * x.element_size()
        comm_log.record(op.name, op.axes, per_device)


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, op: _Op, stacked: bool) -> torch.Tensor:
        _log(op, x, stacked)
        return op.run_stacked(x) if stacked else op.run_local(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, op, stacked = inputs
        ctx.op, ctx.stacked = op, stacked
        if op.saves_input:
            ctx.save_for_backward(x, output)

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors if ctx.op.saves_input else ()
        return ctx.op.transpose(g, ctx.stacked, saved), None, None

    @staticmethod
    def vmap(info, in_dims, x, op: _Op, stacked: bool):
        (batch_dim,) = in_dims[:1]
        level = (maybe_current_level() or 0) + 1  # the rule runs one level below its own
        if not stacked and level == op.frame.device_level:
            return _Collective.apply(x.movedim(batch_dim, 0), op, True), 0
        front = 1 if stacked else 0
        out = _Collective.apply(x.movedim(batch_dim, front), op.shifted(), stacked)
        return out, front if op.keeps_device_dim or not stacked else 0


def _run_stacked(x: torch.Tensor, op: _Op) -> torch.Tensor:
    if op.native:
        _log(op, x, True)
        return op.run_stacked(x)
    return autograd.apply(_Collective, x, op, True)


class _Replicate(torch.autograd.Function):
    """A value that is the same on every device, as stacked copies (an expand view). Backward:
    along the mesh axes at positions ``summed`` the copies' cotangents are contributions and are
    summed; along the others the value is replicated, every copy's cotangent is already the
    whole one, and the copy at coordinate 0 is taken."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, mesh_shape, summed):
        return x.expand(math.prod(mesh_shape), *x.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh_shape, ctx.summed = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        blocks = g.reshape(*ctx.mesh_shape, *g.shape[1:])
        for axis in range(len(ctx.mesh_shape)):
            if axis in ctx.summed:
                blocks = blocks.sum(axis, keepdim=True)
            else:
                blocks = blocks.narrow(axis, 0, 1)
        return blocks.reshape(g.shape[1:]), None, None


def _batched_at(x: torch.Tensor, level: int) -> bool:
    while is_functorch_wrapped_tensor(x):
        current = maybe_get_level(x)
        if current == level:
            return is_batchedtensor(x)
        if current < level:
            return False
        x = get_unwrapped(x)
    return False


def on_devices(x: torch.Tensor, frame: Frame) -> torch.Tensor:
    """``x`` as per-device values of the simulated mesh. A value that is not batched over the
    devices (created inside the per-device function, captured, or replicated) is the same on
    every device: it becomes stacked copies (a view) with :class:`_Replicate`'s gradient, summed
    along the axes the value is treated as varying over (all of them with ``check_rep=False``)
    and taken from one copy along the others."""
    level = frame.device_level
    if level is None or _batched_at(x, level):
        return x
    mesh = frame.mesh
    varying = axes_varying(x)
    summed = tuple([a for a, name in enumerate(mesh.axis_names) if not frame.check_rep or name in varying])
    if maybe_current_level() == level:
        if len(summed) == mesh.ndim:  # expand's own backward sums the copies
            stacked = below_device_level(x.expand, mesh.size, *x.shape)
        else:
            stacked = below_device_level(autograd.apply, _Replicate, x, mesh.shape, summed)
        return _add_batch_dim(stacked, 0, level)
    # under a transform of the user's inside the per-device function: the same, with ops
    first = _first_copies(mesh, summed, str(x.device))
    return torch.where(_add_batch_dim(first, 0, level), x, x.detach())


@functools.lru_cache(maxsize=256)
def _first_copies(mesh, summed: tuple[int, ...], device: str) -> torch.Tensor:
    """``(n,)``: True for the devices at coordinate 0 along every axis not in ``summed``."""
    return torch.tensor(
        [all(c == 0 for a, c in enumerate(mesh.coordinate(d)) if a not in summed) for d in range(mesh.size)],
        device=device,
    )


def _apply(x: torch.Tensor, op: _Op, stacked: bool = False) -> torch.Tensor:
    """Run ``op`` on ``x``: per-device values, or stacked ones (in a transpose, or outside
    shard_map). On the simulated backend, when the device vmap is the innermost transform, the
    device dim is unwrapped and the stacked op runs directly, below the vmap; a reduction over
    every device then gives one unbatched value, and a ``pvary`` of an unbatched value stays
    unbatched (broadcasting sums its gradient over the devices)."""
    if stacked:
        return _run_stacked(x, op)
    level = op.frame.device_level
    with torch._C.DisableTorchFunction():
        if level is None:  # the distributed backend
            if _differentiated(x):
                return autograd.apply(_Collective, x, op, False)
            _log(op, x, False)  # a transpose in backward, or no gradient wanted: just run it
            out = op.run_local(x)
            return x.view_as(x) if out is x else out
        direct = maybe_current_level() == level
        if (
            direct
            and isinstance(op, Pvary)
            and axes_varying(x) | set(op.axes) == set(op.frame.mesh.axis_names)
            and not _batched_at(x, level)
        ):
            return below_device_level(_run_stacked, x, VaryUnbatched(op.frame, op.axes))
        x = on_devices(x, op.frame)
        if direct and maybe_get_level(x) == level:
            value, batch_dim = _unwrap_batched(x, level)
            if type(op) is AllReduce and op.size == op.frame.mesh.size:
                op = _ReduceAll(op.frame, op.axes, op.op, op.transpose_psum)
            out = below_device_level(_run_stacked, value.movedim(batch_dim, 0), op)
            return _add_batch_dim(out, 0, level) if op.keeps_device_dim else out
        return autograd.apply(_Collective, x, op, False)


def _differentiated(x: torch.Tensor) -> bool:
    """Whether autograd (or a ``torch.func`` transform, or the compiler) may see ``x``."""
    return (
        (x.requires_grad and torch.is_grad_enabled())
        or torch._C._are_functorch_transforms_active()
        or torch.compiler.is_compiling()
    )


def on_storage(
    storage: torch.Tensor, mesh, op_type: type[_Op], axes: tuple[str, ...], **params
) -> torch.Tensor:
    """Run a collective on a global value's storage, outside any shard_map: the stacked shards
    on the simulated backend, this rank's shard on the distributed one."""
    op = op_type(Frame(mesh, False, None), axes, **params)
    return _apply(storage, op, stacked=mesh.backend == "simulated")


def _call(x, axis_name, where: str, make_op) -> torch.Tensor:
    """The public entry of every collective: check, make ``x`` vary over the axes, run, tag."""
    frame, axes = frame_for(axis_name, where)
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(
            explain(
                f"{where}(x)",
                "collectives act on tensors",
                expected="a torch.Tensor (a local value inside shard_map)",
                got=type(x).__name__,
                fix="apply the collective to each tensor, e.g. with optree.tree_map",
            )
        )
    op = make_op(frame, axes)
    if frame.check_rep and op.needs_varying and not set(axes) <= axes_varying(x):
        x = vary(x, frame, tuple(a for a in axes if a not in axes_varying(x)))
    out = _apply(x, op)
    return tag(out, op.varying(axes_varying(x)) if frame.check_rep else None)


# --- pvary: a replicated value seen as varying ----------------------------------------------


@dataclass(frozen=True)
class Pvary(_Op):
    """Identity forward; its transpose sums the cotangents over the axes (JAX's ``pvary``)."""

    needs_varying: ClassVar[bool] = False
    name: ClassVar[str] = ""  # no communication

    def run_stacked(self, x):
        return x

    def run_local(self, x):
        return x

    def transpose(self, g, stacked, saved):
        return _apply(g, AllReduce(self.frame, self.axes, "sum", transpose_psum=True), stacked)

    def varying(self, axes):
        return axes | set(self.axes)


def pvary(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Mark a replicated value as varying over ``axis_name``: no communication forward; the
    gradient is summed over the axes. Inserted automatically where replicated and varying values
    meet when ``check_rep`` is on.
    """
    frame, axes = frame_for(axis_name, "fd.pvary")
    return vary(x, frame, axes)


def vary(x: torch.Tensor, frame: Frame, axes: tuple[str, ...]) -> torch.Tensor:
    """:func:`pvary` in a known frame, over checked axes (as the tracker inserts it)."""
    out = _apply(x, Pvary(frame, axes))
    return tag(out, (axes_varying(x) | set(axes)) if frame.check_rep else None)


# --- psum, pmean, pmax, pmin ------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduce(_Op):
    """Shape rule: unchanged. Varying: the input's axes minus ``axes``. Transpose: ``sum`` and
    ``avg`` broadcast the (replicated) cotangent with ``check_rep``, else reduce it again;
    ``max``/``min`` route it to the devices that hold the extremum."""

    op: str = "sum"
    transpose_psum: bool = False  # the transpose of pvary: always a real all-reduce
    needs_varying: ClassVar[bool] = True
    name: ClassVar[str] = "all_reduce"

    @property
    def saves_input(self) -> bool:  # type: ignore[override]
        return self.op in ("max", "min")

    def run_stacked(self, x):
        return stacked_ops.all_reduce(x, self.frame.mesh, self.axes, self.op)

    def run_local(self, x):
        return on_ranks.all_reduce(x, self.frame.mesh, self.axes, self.op)

    def transpose(self, g, stacked, saved):
        if self.frame.check_rep and not self.transpose_psum:
            g_in = g  # the cotangent of a replicated value is replicated: broadcast to varying
        else:
            g_in = _apply(g, AllReduce(self.frame, self.axes, "sum"), stacked)
        if self.op == "avg":
            return g_in / self.size
        if self.op in ("max", "min"):
            x, out = saved
            winners = (x == out).to(g.dtype)
            count = _apply(winners, AllReduce(self.frame, self.axes, "sum"), stacked)
            return g_in * winners / count
        return g_in

    def varying(self, axes):
        return axes - set(self.axes)


@dataclass(frozen=True)
class _ReduceAll(AllReduce):
    """:class:`AllReduce` over every device of a simulated mesh, computed once: the result is
    one unbatched value (the same on every device), not a copy per device. Its cotangent
    arrives unbatched too (summed over the devices where they broadcast), so the transpose
    broadcasts it."""

    keeps_device_dim: ClassVar[bool] = False

    @property
    def native(self) -> bool:  # type: ignore[override]
        # sum(0) and mean(0) backward broadcast the cotangent, as the transpose does
        return self.op in ("sum", "avg") and self.frame.check_rep and not self.transpose_psum

    def run_stacked(self, x):
        if self.op == "sum":
            return x.sum(0, dtype=x.dtype)
        if self.op == "avg":
            floating = x.is_floating_point() or x.is_complex()
            return x.mean(0) if floating else x.sum(0).div(self.size, rounding_mode="floor")
        return x.amax(0) if self.op == "max" else x.amin(0)

    def transpose(self, g, stacked, saved):
        if not self.frame.check_rep or self.transpose_psum:
            _log(AllReduce(self.frame, self.axes), g.unsqueeze(0), True)  # summed by broadcasting
        g_in = g.expand(self.size, *g.shape)
        if self.op == "avg":
            return g_in / self.size
        if self.op in ("max", "min"):
            x, out = saved
            winners = (x == out).to(g.dtype)
            _log(AllReduce(self.frame, self.axes), winners, True)
            return g_in * winners / winners.sum(0)
        return g_in


@dataclass(frozen=True)
class VaryUnbatched(Pvary):
    """:class:`Pvary` of a value not batched over the simulated devices, to vary over every mesh
    axis: it stays unbatched; where it meets per-device values, broadcasting sums its gradient
    over all the devices, which is the all-reduce of pvary's transpose."""

    def run_stacked(self, x):
        return x.view_as(x)

    def transpose(self, g, stacked, saved):
        _log(AllReduce(self.frame, self.axes), g.unsqueeze(0), True)
        return g


def psum(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Sum ``x`` over the devices of ``axis_name``; every device gets the total.

    Shape: unchanged. Gradient: the cotangent, broadcast (``check_rep``) or summed.

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(4, "x")
    >>> total = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())
    >>> total(torch.arange(4.0)).full_tensor()
    tensor([6.])
    """
    return _call(x, axis_name, "fd.psum", lambda f, a: AllReduce(f, a, "sum"))


def pmean(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Average ``x`` over the devices of ``axis_name``. Shape: unchanged."""
    return _call(x, axis_name, "fd.pmean", lambda f, a: AllReduce(f, a, "avg"))


def pmax(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Elementwise maximum over the devices of ``axis_name``. The gradient goes to the devices
    holding the maximum (split evenly among ties)."""
    return _call(x, axis_name, "fd.pmax", lambda f, a: AllReduce(f, a, "max"))


def pmin(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """Elementwise minimum over the devices of ``axis_name``; gradient as :func:`pmax`."""
    return _call(x, axis_name, "fd.pmin", lambda f, a: AllReduce(f, a, "min"))


# --- all_gather and psum_scatter --------------------------------------------------------------


@dataclass(frozen=True)
class AllGather(_Op):
    """Shape rule: a new dim of size ``n`` at ``dim`` (``tiled``: dim ``dim`` grows ``n``-fold).
    Varying: unchanged (as JAX). Transpose: :class:`ReduceScatter` at the same dim."""

    dim: int = 0
    tiled: bool = False
    needs_varying: ClassVar[bool] = True
    name: ClassVar[str] = "all_gather"

    def run_stacked(self, x):
        return stacked_ops.all_gather(x, self.frame.mesh, self.axes, self.dim, self.tiled)

    def run_local(self, x):
        return on_ranks.all_gather(x, self.frame.mesh, self.axes, self.dim, self.tiled)

    def transpose(self, g, stacked, saved):
        return _apply(g, ReduceScatter(self.frame, self.axes, self.dim, self.tiled), stacked)

    def shifted(self):
        return dataclasses.replace(self, dim=self.dim + 1)


def _dim(x: torch.Tensor, dim: int, where: str, argument: str, extra: int = 0) -> int:
    rank = x.dim() + extra
    if not -rank <= dim < rank:
        raise ShapeError(
            explain(
                f"{where}({argument})",
                f"dim {dim} is out of range for a local value of shape {tuple(x.shape)}",
                expected=f"a dim in [{-rank}, {rank})",
                got=str(dim),
                fix="count dims of the local (per-device) value",
            )
        )
    return dim % rank


def _divisible(size: int, parts: int, where: str, argument: str) -> None:
    if size % parts:
        raise ShapeError(
            explain(
                f"{where}({argument})",
                f"a dim of size {size} cannot be split into {parts} equal blocks",
                expected=f"a multiple of {parts}",
                got=f"{size} = {size // parts} * {parts} + {size % parts}",
                fix="pad the dim, or split another one",
            )
        )


def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> torch.Tensor:
    """Every device gets the values of all devices of ``axis_name``, stacked at a new dim
    ``axis`` (``tiled=True``: concatenated along ``axis``). Gradient: :func:`psum_scatter`.

    Shapes (``n`` devices, local ``(a, b)``, ``axis=0``): ``(n, a, b)``; tiled ``(n*a, b)``.
    """
    where = "fd.all_gather"
    axis = _dim(x, axis, where, "axis", extra=0 if tiled else 1)
    return _call(x, axis_name, where, lambda f, a: AllGather(f, a, axis, tiled))


@dataclass(frozen=True)
class ReduceScatter(_Op):
    """Shape rule: dim ``dim`` of size ``n`` is removed (``tiled``: shrinks ``n``-fold).
    Varying: unchanged. Transpose: :class:`AllGather` at the same dim."""

    dim: int = 0
    tiled: bool = False
    needs_varying: ClassVar[bool] = True
    name: ClassVar[str] = "reduce_scatter"

    def run_stacked(self, x):
        return stacked_ops.reduce_scatter(x, self.frame.mesh, self.axes, self.dim, self.tiled)

    def run_local(self, x):
        return on_ranks.reduce_scatter(x, self.frame.mesh, self.axes, self.dim, self.tiled)

    def transpose(self, g, stacked, saved):
        return _apply(g, AllGather(self.frame, self.axes, self.dim, self.tiled), stacked)

    def shifted(self):
        return dataclasses.replace(self, dim=self.dim + 1)


def psum_scatter(
    x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False
) -> torch.Tensor:
    """Sum over the devices of ``axis_name`` and give device ``i`` block ``i`` of
    ``scatter_dimension`` (removed; ``tiled=True``: kept, ``n`` times smaller).
    Gradient: :func:`all_gather`.

    Shapes (``n`` devices, dim 0 split): ``(n, b) -> (b,)``; tiled ``(n*a, b) -> (a, b)``.
    """
    where = "fd.psum_scatter"
    dim = _dim(x, scatter_dimension, where, "scatter_dimension")
    frame, axes = frame_for(axis_name, where)
    size = frame.mesh.axis_size(axes)
    if tiled:
        _divisible(x.shape[dim], size, where, "scatter_dimension")
    elif x.shape[dim] != size:
        raise ShapeError(
            explain(
                f"{where}(scatter_dimension)",
                f"untiled psum_scatter gives one block of dim {dim} to each of {size} devices",
                expected=f"dim {dim} of size {size}",
                got=f"{x.shape[dim]}",
                fix="pass tiled=True to split the dim into equal blocks",
            )
        )
    return _call(x, axis_name, where, lambda f, a: ReduceScatter(f, a, dim, tiled))


# --- all_to_all -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllToAll(_Op):
    """Shape rule: dim ``split`` (size ``n``) is removed and a dim of size ``n`` inserted at
    ``concat`` (``tiled``: ``split`` shrinks and ``concat`` grows ``n``-fold).
    Varying: unchanged. Transpose: the same op with ``split`` and ``concat`` swapped."""

    split: int = 0
    concat: int = 0
    tiled: bool = False
    needs_varying: ClassVar[bool] = True
    name: ClassVar[str] = "all_to_all"

    def run_stacked(self, x):
        return stacked_ops.all_to_all(x, self.frame.mesh, self.axes, self.split, self.concat, self.tiled)

    def run_local(self, x):
        return on_ranks.all_to_all(x, self.frame.mesh, self.axes, self.split, self.concat, self.tiled)

    def transpose(self, g, stacked, saved):
        op = dataclasses.replace(self, split=self.concat, concat=self.split)
        return _apply(g, op, stacked)

    def shifted(self):
        return dataclasses.replace(self, split=self.split + 1, concat=self.concat + 1)


def all_to_all(
    x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> torch.Tensor:
    """Device ``i`` sends block ``j`` of ``split_axis`` to device ``j``, which stacks what it
    receives, in device order, at ``concat_axis``. Gradient: the same with the axes swapped.

    Shapes (``n`` devices): untiled ``x.shape[split_axis] == n``, the result is
    ``insert(delete(shape, split_axis), concat_axis, n)``; tiled, ``split_axis`` shrinks and
    ``concat_axis`` grows ``n``-fold.
    """
    where = "fd.all_to_all"
    frame, axes = frame_for(axis_name, where)
    size = frame.mesh.axis_size(axes)
    split = _dim(x, split_axis, where, "split_axis")
    concat = _dim(x, concat_axis, where, "concat_axis")
    if tiled:
        _divisible(x.shape[split], size, where, "split_axis")
    elif x.shape[split] != size:
        raise ShapeError(
            explain(
                f"{where}(split_axis)",
                f"untiled all_to_all sends one block of dim {split} to each of {size} devices",
                expected=f"dim {split} of size {size}",
                got=f"{x.shape[split]}",
                fix="pass tiled=True to split the dim into equal blocks",
            )
        )
    return _call(x, axis_name, where, lambda f, a: AllToAll(f, a, split, concat, tiled))


# --- ppermute ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Permute(_Op):
    """Shape rule: unchanged. Varying: unchanged. Transpose: the inverse permutation."""

    perm: tuple[tuple[int, int], ...] = ()
    needs_varying: ClassVar[bool] = True
    name: ClassVar[str] = "ppermute"

    def run_stacked(self, x):
        return stacked_ops.permute(x, self.frame.mesh, self.axes, self.perm)

    def run_local(self, x):
        return on_ranks.permute(x, self.frame.mesh, self.axes, self.perm)

    def transpose(self, g, stacked, saved):
        inverse = tuple((dst, src) for src, dst in self.perm)
        return _apply(g, Permute(self.frame, self.axes, inverse), stacked)


def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send each device's value to another along ``axis_name``: for every ``(src, dst)`` pair,
    device ``dst`` receives the value of ``src``; devices that receive nothing get zeros.
    Gradient: the inverse permutation.
    """
    where = "fd.ppermute"
    frame, axes = frame_for(axis_name, where)
    size = frame.mesh.axis_size(axes)
    pairs = tuple((int(s), int(d)) for s, d in perm)
    sources, targets = [s for s, _ in pairs], [d for _, d in pairs]
    if (
        any(not 0 <= i < size for i in sources + targets)
        or len(set(sources)) < len(sources)
        or len(set(targets)) < len(targets)
    ):
        raise ShapeError(
            explain(
                f"{where}(perm)",
                "a permutation sends from and to each device at most once",
                expected=f"(src, dst) pairs of distinct indices in [0, {size})",
                got=repr(perm),
                fix="e.g. a ring shift: [(i, (i + 1) % n) for i in range(n)]",
            )
        )
    return _call(x, axis_name, where, lambda f, a: Permute(f, a, pairs))


# --- axis_index and axis_size -----------------------------------------------------------------


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """This device's index along ``axis_name`` (a tuple: the flat index, major axis first), as a
    0-d int64 tensor that varies over those axes."""
    frame, axes = frame_for(axis_name, "fd.axis_index")
    mesh = frame.mesh
    if frame.device_level is None:
        index = on_ranks.axis_index(mesh, axes, mesh.device_type)
    else:
        stacked = stacked_ops.axis_index(mesh, axes, mesh.device_type)
        index = _add_batch_dim(stacked, 0, frame.device_level)
    return tag(index, frozenset(axes) if frame.check_rep else None)


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (a tuple: the product)."""
    frame, axes = frame_for(axis_name, "fd.axis_size")
    return frame.mesh.axis_size(axes)

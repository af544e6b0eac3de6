"""Collectives: explicit, differentiable functional ops over named mesh axes (``jax.lax``
names and shapes), valid inside :func:`shard_map`.

Each collective is a frozen op record next to its public function: its shape rule, the kernel
it runs (``run``, through the mesh's backend), its transpose (collectives too, so gradients
communicate as the forward does), and its rule for which mesh axes the result varies over. The
backend's engine runs the record on a per-device value (see :mod:`._backend`), under autograd
through :class:`._autograd.Collective`.

With ``check_rep`` (the default) a value's type includes the set of mesh axes it varies over
(see :mod:`._varying`); transposes use it: the cotangent of a replicated result is replicated,
so ``psum`` transposes to ``pvary``, a broadcast with no communication. Without it, ``psum``
transposes to ``psum``, as in JAX.

Every transpose is itself made of collectives whose own transposes close the pair (``psum`` of
a replicated result and ``pvary``; ``all_gather`` and ``psum_scatter``; ``all_to_all`` and its
swap; a permutation and its inverse), so gradients of gradients are right to any order.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import _blocks as blocks
from ._autograd import differentiated
from ._backend import backend_of
from ._context import Frame, frame_for
from ._errors import InputTypeError, ShapeError, explain
from ._varying import tag, varying_in

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
    keeps_device_dim: ClassVar[bool] = True  # on stacked values, the result keeps the device dim
    # the kernel's own autograd is the transpose, with nothing to count (no autograd function)
    native: ClassVar[bool] = False

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel, on storage-form values (stacked shards, or this rank's)."""
        raise NotImplementedError

    def transpose(self, g: torch.Tensor, stacked: bool, saved) -> torch.Tensor:
        raise NotImplementedError

    def tangent(self, t: torch.Tensor, stacked: bool, saved) -> torch.Tensor:
        """The forward-mode derivative: a linear op runs on the tangent as on the value."""
        return _apply(t, self, stacked)

    def shifted(self) -> _Op:
        """The same op on values with one more leading per-device dim."""
        return self

    def varying(self, axes: frozenset[str]) -> frozenset[str]:
        """The axes the result varies over, given those the input varies over."""
        return axes

    def on_unbatched(self, x: torch.Tensor) -> _Op | None:
        """The op to run on ``x``, a value held once for every simulated device, that keeps it
        held once (None: ``x`` becomes per-device copies first)."""
        return None

    def held_once(self) -> _Op:
        """The op to run on the stacked values of every simulated device (a variant whose
        result is held once, where it is the same on every device)."""
        return self

    @property
    def size(self) -> int:
        return self.frame.mesh.axis_size(self.axes)


def _apply(x: torch.Tensor, op: _Op, stacked: bool = False) -> torch.Tensor:
    """Run ``op`` on per-device values, or on storage-form ones (``stacked``: in a transpose,
    or outside shard_map)."""
    backend = op.frame.backend
    return backend.apply_to_storage(op, x) if stacked else backend.apply(op, x)


def on_storage(
    storage: torch.Tensor, mesh, op_type: type[_Op], axes: tuple[str, ...], **params
) -> torch.Tensor:
    """Run a collective on a global value's storage, outside any shard_map."""
    backend = backend_of(mesh)
    return backend.apply_to_storage(op_type(Frame(mesh, False, backend), axes, **params), storage)


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
    if frame.check_rep and op.needs_varying:
        varying = varying_in(frame, x)
        if not set(axes) <= varying:
            x = vary(x, frame, tuple(a for a in axes if a not in varying))
    out = frame.backend.apply(op, x)
    if not frame.check_rep or frame.batched_varying is not None:  # (no record kept)
        return out
    return tag(out, op.varying(varying_in(frame, x)))


# --- pvary: a replicated value seen as varying ----------------------------------------------


@dataclass(frozen=True)
class Pvary(_Op):
    """Identity forward; its transpose sums the cotangents over the axes (JAX's ``pvary``)."""

    needs_varying: ClassVar[bool] = False

    def run(self, x):
        return x

    def transpose(self, g, stacked, saved):
        return _apply(g, AllReduce(self.frame, self.axes, "sum", transpose_psum=True), stacked)

    def varying(self, axes):
        return axes | set(self.axes)

    def on_unbatched(self, x):
        if self.frame.batched_varying is not None:  # varying is batched there: per-device copies
            return None
        everything = varying_in(self.frame, x) | set(self.axes) == set(self.frame.mesh.axis_names)
        return VaryHeldOnce(self.frame, self.axes) if everything else None


@dataclass(frozen=True)
class SplitCotangent(_Op):
    """Identity forward: values taken to be the same on every device of the axes (an unchecked
    function's replicated output) seen as one replicated value. Transpose: the replicated
    cotangent split evenly among the devices (a pvary, divided by their number), whose own
    transpose is the mean over them."""

    needs_varying: ClassVar[bool] = False

    def run(self, x):
        return x

    def transpose(self, g, stacked, saved):
        return _apply(g, Pvary(self.frame, self.axes), stacked) / self.size

    def varying(self, axes):
        return axes - set(self.axes)


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
    if not frame.check_rep or frame.batched_varying is not None:  # (no record kept)
        return out
    return tag(out, varying_in(frame, x) | set(axes))


# --- psum, pmean, pmax, pmin ------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduce(_Op):
    """Shape rule: unchanged. Varying: the input's axes minus ``axes``. Transpose: ``sum`` and
    ``avg`` broadcast the (replicated) cotangent with ``check_rep`` (a :class:`Pvary`), else
    reduce it again; ``max``/``min`` route it to the devices that hold the extremum, and so
    does their tangent."""

    op: str = "sum"
    # the transpose of pvary: the result is replicated whatever the frame, and transposes to pvary
    transpose_psum: bool = False

    @property
    def saves_input(self) -> bool:  # type: ignore[override]
        return self.op in ("max", "min")

    def run(self, x):
        return self.frame.backend.all_reduce(x, self.frame.mesh, self.axes, self.op)

    def transpose(self, g, stacked, saved):
        if self.frame.check_rep or self.transpose_psum:
            g_in = _broadcast(g, self.frame, self.axes, stacked)
        else:
            g_in = _apply(g, AllReduce(self.frame, self.axes, "sum"), stacked)
        if self.op == "avg":
            return g_in / self.size
        if self.op in ("max", "min"):
            return g_in * _share_of_winners(saved, self.frame, self.axes, stacked)
        return g_in

    def tangent(self, t, stacked, saved):
        if self.op in ("max", "min"):  # the tangent of the devices that hold the extremum
            share = _share_of_winners(saved, self.frame, self.axes, stacked)
            return _apply(t * share, AllReduce(self.frame, self.axes, "sum", self.transpose_psum), stacked)
        return _apply(t, self, stacked)

    def varying(self, axes):
        return axes - set(self.axes)

    def held_once(self):
        if self.size == self.frame.mesh.size:
            return _ReduceAll(self.frame, self.axes, self.op, self.transpose_psum)
        return self


def _broadcast(g: torch.Tensor, frame: Frame, axes: tuple[str, ...], stacked: bool) -> torch.Tensor:
    """The cotangent of a replicated result as its input's: the same value on every device. Where
    it may be differentiated again, recorded as :class:`Pvary`, whose transpose sums."""
    return _apply(g, Pvary(frame, axes), stacked) if differentiated(g) else g


def _share_of_winners(saved, frame: Frame, axes: tuple[str, ...], stacked: bool) -> torch.Tensor:
    """``pmax``/``pmin``: each device's share of the derivative, from the saved input and
    result: 1 / (the number of devices holding the extremum) where this one does, else 0."""
    x, out = saved
    winners = (x == out).to(x.dtype)
    return winners / _apply(winners, AllReduce(frame, axes, "sum"), stacked)


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

    def held_once(self):
        return self

    def run(self, x):
        if self.size > 1:  # a group of one device communicates nothing
            self.frame.backend.count("all_reduce", self.axes, x, self.size)
        return blocks.reduce(x, self.op, 0)

    def transpose(self, g, stacked, saved):
        backend = self.frame.backend
        if (not self.frame.check_rep or self.transpose_psum) and self.size > 1:
            # by broadcasting
            backend.count_bytes("all_reduce", self.axes, g.numel() * g.element_size(), self.size)
        g_in = g.expand(self.size, *g.shape)  # its own transpose sums over the devices
        if self.op == "avg":
            return g_in / self.size
        if self.op in ("max", "min"):
            return g_in * self._share_of_winners(saved)
        return g_in

    def tangent(self, t, stacked, saved):
        if self.op in ("max", "min"):
            if self.size > 1:
                self.frame.backend.count("all_reduce", self.axes, t, self.size)
            return (t * self._share_of_winners(saved)).sum(0)
        return _apply(t, self, stacked)

    def _share_of_winners(self, saved) -> torch.Tensor:
        x, out = saved
        winners = (x == out).to(x.dtype)
        if self.size > 1:  # a group of one device communicates nothing
            self.frame.backend.count("all_reduce", self.axes, winners, self.size)
        return winners / winners.sum(0)


@dataclass(frozen=True)
class VaryHeldOnce(Pvary):
    """:class:`Pvary` of a value held once for every simulated device, to vary over every mesh
    axis: it stays held once; where it meets per-device values, broadcasting sums its gradient
    over all the devices, which is the all-reduce of pvary's transpose."""

    def run(self, x):
        return x.view_as(x)

    def transpose(self, g, stacked, saved):
        if self.size > 1:
            self.frame.backend.count_bytes("all_reduce", self.axes, g.numel() * g.element_size(), self.size)
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

    def run(self, x):
        return self.frame.backend.all_gather(x, self.frame.mesh, self.axes, self.dim, self.tiled)

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

    def run(self, x):
        return self.frame.backend.reduce_scatter(x, self.frame.mesh, self.axes, self.dim, self.tiled)

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

    def run(self, x):
        return self.frame.backend.all_to_all(
            x, self.frame.mesh, self.axes, self.split, self.concat, self.tiled
        )

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

    def run(self, x):
        return self.frame.backend.permute(x, self.frame.mesh, self.axes, self.perm)

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
    pairs = _pairs(perm, f"{where}(perm)")
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


def _pairs(perm, where: str) -> tuple[tuple[int, int], ...]:
    """``perm`` as ``(src, dst)`` int pairs: a list or tuple of pairs, nothing else (a dict or
    an iterator would be read differently, or once, where a plan needs it again)."""
    try:
        pairs = isinstance(perm, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in perm)
        if pairs and all(len(p) == 2 for p in perm):
            return tuple((operator.index(s), operator.index(d)) for s, d in perm)
    except TypeError:
        pass
    raise InputTypeError(
        explain(
            where,
            "a permutation is a list of (source, destination) pairs of device indices",
            expected="a list or tuple of int pairs such as [(0, 1), (1, 0)]",
            got=repr(perm),
            fix="write each move as a pair, e.g. [(i, p[i]) for i in range(n)] for a list p of destinations",
        )
    )


# --- axis_index and axis_size -----------------------------------------------------------------


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """This device's index along ``axis_name`` (a tuple: the flat index, major axis first), as a
    0-d int64 tensor that varies over those axes."""
    frame, axes = frame_for(axis_name, "fd.axis_index")
    index = frame.backend.axis_index_per_device(frame, axes)
    return tag(index, frozenset(axes) if frame.check_rep and frame.batched_varying is None else None)


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (a tuple: the product)."""
    frame, axes = frame_for(axis_name, "fd.axis_size")
    return frame.mesh.axis_size(axes)

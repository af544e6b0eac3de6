"""The redistribute planner: layouts in, a tuple of frozen steps out. Pure: no tensors.

``plan(source, target, shape, itemsize)`` searches the layouts between ``source`` and ``target``
(placements per mesh axis, every intermediate one a valid DTensor layout that splits the shape
evenly) for the sequence of steps that moves the fewest bytes per device, then takes the fewest
collectives. The steps:

==================  =====================================  ======================================
step                what it does                           bytes received per device (block b)
==================  =====================================  ======================================
``AllGather``       Shard -> Replicate on axes G, one      ``(k-1) b``
                    collective over their flattened group
``AllReduce``       Partial -> Replicate on axes G          ``2 (k-1)/k b``
``ReduceScatter``   Partial -> Shard(d) on axes G           ``(k-1)/k b``
``AllToAll``        Shard(i) -> Shard(j) on axes G          ``(k-1)/k b``
``Swap``            exchange the placements of two axes     ``b`` (a block permutation)
                    of equal size (a point-to-point move)
``ReduceBroadcast`` (Partial, Shard(d)) -> (Shard(d), R)    ``(k-1) b``: a reduce to the device on
                    on two axes of equal size               the diagonal, a broadcast from it
``Slice``           Replicate -> Shard(d): a local slice    0
``Partition``       Replicate -> Partial: local             0
``Regather``        any -> any, uneven shards: assemble     ``2 (p-1)/p b + (s-1) b`` (padded
                    the value, keep the target block       blocks, ``p`` partial, ``s`` shard)
==================  =====================================  ======================================

(``k``: the number of devices in the step's group, ``b``: the bytes of a device's block before
the step.) Plans are cached by value in a bounded cache.

>>> import functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> rows_cols = fd.Layout(mesh, (fd.Shard(0), fd.Shard(1)))
>>> steps = plan(rows_cols, fd.Layout(mesh, (fd.Shard(1), fd.Shard(0))), (8, 8), 4)
>>> [str(s) for s in steps]
['ppermute(x, y)']
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from ._layout import Layout
from ._placements import Partial, Placement, Replicate, Shard
from ._sharding import shard_table

__all__ = [
    "Step",
    "AllGather",
    "AllReduce",
    "ReduceScatter",
    "AllToAll",
    "Swap",
    "ReduceBroadcast",
    "Slice",
    "Partition",
    "Regather",
    "plan",
    "step_bytes",
    "lower_bound",
]

Placements = tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class Step:
    """One step: the layout before and after, on the mesh axes ``axes`` (positions)."""

    source: Layout
    target: Layout
    axes: tuple[int, ...]

    collective = ""  # what runs ("" for local steps)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple([self.source.mesh.axis_names[a] for a in self.axes])

    @property
    def group_size(self) -> int:
        return math.prod([self.source.mesh.shape[a] for a in self.axes])

    def __str__(self) -> str:
        name = self.collective or type(self).__name__.lower()
        return f"{name}({', '.join(self.names)})"


@dataclass(frozen=True, slots=True)
class AllGather(Step):
    collective = "all_gather"


@dataclass(frozen=True, slots=True)
class AllReduce(Step):
    op: str = "sum"
    collective = "all_reduce"


@dataclass(frozen=True, slots=True)
class ReduceScatter(Step):
    dim: int = 0
    op: str = "sum"
    collective = "reduce_scatter"


@dataclass(frozen=True, slots=True)
class AllToAll(Step):
    split: int = 0  # the dim that becomes sharded
    concat: int = 0  # the dim that becomes whole
    collective = "all_to_all"


@dataclass(frozen=True, slots=True)
class Swap(Step):
    collective = "ppermute"


@dataclass(frozen=True, slots=True)
class ReduceBroadcast(Step):
    """``axes = (a, b)``: Partial(op) on ``a`` and Shard(dim) on ``b`` become Shard(dim) on
    ``a`` and Replicate on ``b``."""

    dim: int = 0
    op: str = "sum"
    collective = "reduce+broadcast"


@dataclass(frozen=True, slots=True)
class Slice(Step):
    dim: int = 0


@dataclass(frozen=True, slots=True)
class Partition(Step):
    op: str = "sum"


@dataclass(frozen=True, slots=True)
class Regather(Step):
    collective = "all_reduce+all_gather"


# --- costs ------------------------------------------------------------------------------------


def _block_bytes(layout: Layout, shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shard_table(layout, shape).padded_shape) * itemsize


def step_bytes(step: Step, shape: tuple[int, ...], itemsize: int) -> int:
    """The most bytes any one device receives in ``step`` (and, these patterns being
    symmetric, sends)."""
    b = _block_bytes(step.source, shape, itemsize)
    k = step.group_size
    if isinstance(step, AllGather):
        return (k - 1) * b
    if isinstance(step, AllReduce):
        return 2 * (k - 1) * b // k
    if isinstance(step, (ReduceScatter, AllToAll)):
        return (k - 1) * b // k
    if isinstance(step, Swap):
        return b
    if isinstance(step, ReduceBroadcast):
        return (step.source.mesh.shape[step.axes[0]] - 1) * b
    if isinstance(step, Regather):  # what it runs: padded blocks all-reduced, then all-gathered
        mesh, placements = step.source.mesh, step.source.placements
        partial = math.prod([mesh.shape[a] for a, p in enumerate(placements) if isinstance(p, Partial)])
        sharded = math.prod([mesh.shape[a] for a, p in enumerate(placements) if isinstance(p, Shard)])
        return 2 * (partial - 1) * b // partial + (sharded - 1) * b
    return 0


def lower_bound(source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int) -> int:
    """A lower bound on the bytes some device must receive: every element of its target block
    that it does not hold (all of them, where a Partial source must be reduced over ``k > 1``
    devices); and the standard bounds of that reduction, on target blocks of ``d`` bytes:
    ``2 (k-1)/k d`` where the reduced axes become Replicate (an all-reduce), ``(k-1) d`` where
    they become Shard (a reduce-scatter); these for even splits only."""
    mesh = source.mesh
    reduced = [
        a
        for a, (p, q) in enumerate(zip(source.placements, target.placements))
        if isinstance(p, Partial) and p != q and mesh.shape[a] > 1
    ]
    src, dst = shard_table(source, shape), shard_table(target, shape)
    need = 0
    for device in range(mesh.size):
        size = math.prod(dst.local_shapes[device])
        if not reduced:
            size -= _overlap(src, dst, device)
        need = max(need, size * itemsize)
    if not reduced or not (src.is_even and dst.is_even):
        return need  # the collective bounds below assume equal blocks
    k = math.prod([mesh.shape[a] for a in reduced])
    d = _block_bytes(target, shape, itemsize)
    if all(isinstance(target.placements[a], Replicate) for a in reduced):
        return max(need, 2 * (k - 1) * d // k)
    if all(isinstance(target.placements[a], Shard) for a in reduced):
        return max(need, (k - 1) * d)
    return need


def _overlap(src, dst, device: int) -> int:
    size = 1
    for (s_off, s_len), (d_off, d_len) in zip(
        zip(src.offsets[device], src.local_shapes[device]), zip(dst.offsets[device], dst.local_shapes[device])
    ):
        size *= max(0, min(s_off + s_len, d_off + d_len) - max(s_off, d_off))
    return size


# --- the search -------------------------------------------------------------------------------


def _splitters(placements: Placements, dim: int) -> list[int]:
    return [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]


def _even(layout_shape, placements: Placements, mesh) -> bool:
    for dim, size in enumerate(layout_shape):
        if size % math.prod(mesh.shape[a] for a in _splitters(placements, dim)):
            return False
    return True


def _subsets(items):
    items = list(items)
    for r in range(1, len(items) + 1):
        yield from itertools.combinations(items, r)


def _replace(placements: Placements, axes, placement) -> Placements:
    out = list(placements)
    for a in axes:
        out[a] = placement
    return tuple(out)


def _moves(placements: Placements, target: Placements, mesh, ndim: int):
    """Every step from ``placements``: (step type, axes, extra fields, placements after)."""
    axes = range(len(placements))
    ops = sorted({p.op for p in placements if isinstance(p, Partial)})  # the same order on every rank
    for op in ops:
        partial = [a for a in axes if placements[a] == Partial(op)]
        for group in _subsets(partial):
            yield AllReduce, group, {"op": op}, _replace(placements, group, Replicate())
            if op in ("sum", "avg"):
                for dim in range(ndim):
                    if min(group) > max(_splitters(placements, dim), default=-1):
                        yield (
                            ReduceScatter,
                            group,
                            {"dim": dim, "op": op},
                            _replace(placements, group, Shard(dim)),
                        )
    suffixes = []  # per dim: the groups of innermost axes that can be gathered
    for dim in range(ndim):
        splitters = _splitters(placements, dim)
        suffixes.append([()] + [tuple(splitters[start:]) for start in range(len(splitters))])
    for choice in itertools.product(*suffixes):
        group = tuple(sorted(a for part in choice for a in part))
        if group:  # one all_gather over the flattened group, across dims
            yield AllGather, group, {}, _replace(placements, group, Replicate())
    for dim in range(ndim):
        splitters = _splitters(placements, dim)
        for start in range(len(splitters)):
            group = tuple(splitters[start:])
            for other in range(ndim):
                if other != dim and min(group) > max(_splitters(placements, other), default=-1):
                    yield (
                        AllToAll,
                        group,
                        {"split": other, "concat": dim},
                        _replace(placements, group, Shard(other)),
                    )
    replicated = [a for a in axes if isinstance(placements[a], Replicate)]
    for group in _subsets(replicated):
        for dim in range(ndim):
            if min(group) > max(_splitters(placements, dim), default=-1):
                yield Slice, group, {"dim": dim}, _replace(placements, group, Shard(dim))
        wanted = {target[a] for a in group}
        if len(wanted) == 1 and isinstance(next(iter(wanted)), Partial):
            (want,) = wanted
            yield Partition, group, {"op": want.op}, _replace(placements, group, want)
    for a, b in itertools.combinations(axes, 2):
        pa, pb = placements[a], placements[b]
        if mesh.shape[a] != mesh.shape[b] or pa == pb:
            continue
        if isinstance(pa, Partial) and isinstance(pb, Shard) and len(_splitters(placements, pb.dim)) == 1:
            if pa.op in ("sum", "avg"):
                after = _replace(_replace(placements, (a,), Shard(pb.dim)), (b,), Replicate())
                yield ReduceBroadcast, (a, b), {"dim": pb.dim, "op": pa.op}, after
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            continue
        if all(len(_splitters(placements, p.dim)) == 1 for p in (pa, pb) if isinstance(p, Shard)):
            yield Swap, (a, b), {}, _replace(_replace(placements, (a,), pb), (b,), pa)


@lru_cache(maxsize=1024)
def plan(source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int) -> tuple[Step, ...]:
    """The cheapest steps from ``source`` to ``target`` for a value of ``shape``: fewest bytes
    received per device (summed over steps), then fewest collectives."""
    if source == target:
        return ()
    mesh = source.mesh
    if not (shard_table(source, shape).is_even and shard_table(target, shape).is_even):
        return (Regather(source, target, tuple(range(mesh.ndim))),)
    start, goal = source.placements, target.placements
    best = {start: (0, 0)}
    queue = [(0, 0, 0, start, ())]
    tie = itertools.count(1)
    while queue:
        cost, count, _, placements, steps = heapq.heappop(queue)
        if placements == goal:
            return steps
        if best.get(placements, (cost, count)) < (cost, count):
            continue
        for kind, axes, fields, after in _moves(placements, goal, mesh, len(shape)):
            if not _even(shape, after, mesh):
                continue
            step = kind(Layout(mesh, placements), Layout(mesh, after), tuple(axes), **fields)
            price = (cost + step_bytes(step, shape, itemsize), count + (1 if kind.collective else 0))
            if price < best.get(after, (math.inf, math.inf)):
                best[after] = price
                heapq.heappush(queue, (*price, next(tie), after, (*steps, step)))
    return (Regather(source, target, tuple(range(mesh.ndim))),)

"""The redistribute planner: layouts in, a tuple of frozen steps out. Pure: no tensors.

``plan(source, target, shape, itemsize, integral)`` searches the layouts between ``source`` and
``target`` (every intermediate one a valid layout that splits the shape evenly, the axes of a
dim in any order) for the sequence of steps that moves the fewest bytes per device, then takes
the fewest collectives. The steps:

==================  =====================================  ======================================
step                what it does                           bytes received per device (block b)
==================  =====================================  ======================================
``AllGather``       Shard -> Replicate on axes G (the      ``(k-1) b``
                    innermost of their dims), one
                    collective over their flattened group
``AllReduce``       Partial -> Replicate on axes G          ``2 (k-1)/k b``
``ReduceScatter``   Partial -> Shard(d) on axes G (an       ``(k-1)/k b`` (``b`` padded to a
                    uneven d: on one axis, padded)          multiple of ``k`` along d)
``AllToAll``        Shard(i) -> Shard(j) on axes G          ``(k-1)/k b``
``Swap``            exchange the placements of two axes     ``b`` (a block permutation)
                    of equal size (a point-to-point move)
``Permute``         the same blocks on other devices (an    ``b`` (a block permutation)
                    order of a dim's axes changed, say)
``ReduceBroadcast`` (Partial, Shard(d)) -> (Shard(d), R)    ``(k-1) b``: a reduce to the device on
                    on two axes of equal size               the diagonal, a broadcast from it
``Slice``           Replicate -> Shard(d): a local slice    0
``Partition``       Replicate -> Partial: local             0
``Relabel``         placements on axes of size 1 change:    0
                    every device keeps its block
``Regather``        any -> any, uneven shards: assemble     ``2 (p-1)/p b + (s-1) b`` (padded
                    the value, keep the target block       blocks, ``p`` partial, ``s`` shard)
==================  =====================================  ======================================

(``k``: the number of devices in the step's group, ``b``: the bytes of a device's block before
the step; costs are exact fractions, never rounded. A collective that would move nothing, over
axes of size 1 or a permutation of each device to itself, is planned as a ``Relabel``.) A new
Shard axis becomes the innermost of its dim. Partial axes reduce as the global value defines
them, one at a time in mesh order: an axis is reduced before one that comes
earlier only where their reductions commute (``sum`` and ``avg`` of floating values; equal
``max`` or ``min``); an integer ``avg`` is reduced one axis at a time. Plans are cached by value
in a bounded cache.

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
from fractions import Fraction

from ._cache import cached
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
    "Permute",
    "ReduceBroadcast",
    "Slice",
    "Partition",
    "Relabel",
    "Regather",
    "plan",
    "step_bytes",
    "collective_bytes",
    "lower_bound",
    "permutation_pairs",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One step: the layout before and after, on the mesh axes ``axes`` (positions, in the
    order the step's collective takes them)."""

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
class Permute(Step):
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
class Relabel(Step):
    """Every device keeps its block: only placements on mesh axes of size 1 (or the order of
    such axes in a dim) change. Local, no communication."""


@dataclass(frozen=True, slots=True)
class Regather(Step):
    collective = "all_reduce+all_gather"


# --- costs ------------------------------------------------------------------------------------


def _block_bytes(layout: Layout, shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shard_table(layout, shape).padded_shape) * itemsize


def collective_bytes(collective: str, group_size: int, nbytes: int) -> Fraction:
    """The bytes each device receives (and, these patterns being symmetric, sends) in one
    ``collective`` over a group of ``group_size`` devices (``k``), each contributing ``nbytes``
    (``b``): an ``all_gather`` ``(k-1) b``, an ``all_reduce`` (ring) ``2 (k-1)/k b``, a
    ``reduce_scatter`` or ``all_to_all`` ``(k-1)/k b``, a ``ppermute`` or a ``broadcast``
    (the root's ``b`` bytes, which every other device receives) ``b``, a ``reduce+broadcast``
    ``(k-1) b`` (``k`` the size of either of its two axes). Exact: a fraction where ``k`` does
    not divide ``b``.

    >>> collective_bytes("all_reduce", 4, 8), collective_bytes("all_gather", 4, 8)
    (Fraction(12, 1), Fraction(24, 1))
    """
    k = group_size
    if collective in ("all_gather", "reduce+broadcast"):
        return Fraction((k - 1) * nbytes)
    if collective == "all_reduce":
        return Fraction(2 * (k - 1) * nbytes, k)
    if collective in ("reduce_scatter", "all_to_all"):
        return Fraction((k - 1) * nbytes, k)
    if collective in ("ppermute", "broadcast"):
        return Fraction(nbytes)
    raise ValueError(f"collective_bytes: no byte count for the collective {collective!r}")


def step_bytes(step: Step, shape: tuple[int, ...], itemsize: int) -> Fraction:
    """The most bytes any one device receives in ``step`` (and, these patterns being
    symmetric, sends): exact, a fraction where the group size does not divide the block (an
    all-reduce of 4 bytes over 3 devices receives 16/3 bytes per device, on average). Each
    collective's count is :func:`collective_bytes`'s."""
    b = _block_bytes(step.source, shape, itemsize)
    k = step.group_size
    if isinstance(step, (AllGather, AllReduce, AllToAll, Swap, Permute)):
        return collective_bytes(step.collective, k, b)
    if isinstance(step, ReduceScatter):  # the dim scattered padded to a multiple of k
        size = shard_table(step.source, shape).padded_shape[step.dim]
        return collective_bytes(step.collective, k, (b // size if size else 0) * -(-size // k) * k)
    if isinstance(step, ReduceBroadcast):
        return collective_bytes(step.collective, step.source.mesh.shape[step.axes[0]], b)
    if isinstance(step, Regather):  # what it runs: padded blocks all-reduced, then all-gathered
        mesh, placements = step.source.mesh, step.source.placements
        partial = math.prod([mesh.shape[a] for a, p in enumerate(placements) if isinstance(p, Partial)])
        sharded = math.prod([mesh.shape[a] for a, p in enumerate(placements) if isinstance(p, Shard)])
        return collective_bytes("all_reduce", partial, b) + collective_bytes("all_gather", sharded, b)
    return Fraction(0)


def lower_bound(source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int) -> Fraction:
    """A lower bound on the bytes some device must receive: every element of its target block
    that it does not hold (all of them, where a Partial source must be reduced over ``k > 1``
    devices); and the standard bounds of that reduction, on target blocks of ``d`` bytes:
    ``2 (k-1)/k d`` where the reduced axes become Replicate (an all-reduce), ``(k-1) d`` where
    they become Shard (a reduce-scatter); these for even splits only, where every other mesh
    axis keeps a Shard or Partial placement (a replica, or a value whose other axes change too,
    lets devices off the reduction share its work, and then these bounds do not hold)."""
    mesh = source.mesh
    reduced = [
        a
        for a, (p, q) in enumerate(zip(source.placements, target.placements))
        if isinstance(p, Partial) and p != q and mesh.shape[a] > 1
    ]
    src, dst = shard_table(source, shape), shard_table(target, shape)
    need = Fraction(0)
    for device in range(mesh.size):
        size = math.prod(dst.local_shapes[device])
        if not reduced:
            size -= _overlap(src, dst, device)
        need = max(need, size * itemsize)
    others = [a for a in range(mesh.ndim) if a not in reduced and mesh.shape[a] > 1]
    if (
        not reduced
        or not (src.is_even and dst.is_even)  # the collective bounds below assume equal blocks
        or any(isinstance(source.placements[a], Replicate) for a in others)
        or any(source.placements[a] != target.placements[a] for a in others)
    ):
        return need
    k = math.prod([mesh.shape[a] for a in reduced])
    d = _block_bytes(target, shape, itemsize)
    if all(isinstance(target.placements[a], Replicate) for a in reduced):
        return max(need, Fraction(2 * (k - 1) * d, k))
    if all(isinstance(target.placements[a], Shard) for a in reduced):
        return max(need, Fraction((k - 1) * d))
    return need


def _overlap(src, dst, device: int) -> int:
    size = 1
    for (s_off, s_len), (d_off, d_len) in zip(
        zip(src.offsets[device], src.local_shapes[device]), zip(dst.offsets[device], dst.local_shapes[device])
    ):
        size *= max(0, min(s_off + s_len, d_off + d_len) - max(s_off, d_off))
    return size


# --- the states of the search: placements and each dim's axes, major first --------------------


Placements = tuple[Placement, ...]
Orders = tuple[tuple[int, ...], ...]


def _state(layout: Layout, ndim: int) -> tuple[Placements, Orders]:
    return layout.placements, tuple(layout.sharding_axes(d) for d in range(ndim))


@cached(8192)
def _layout(mesh, placements: Placements, orders: Orders) -> Layout:
    return Layout(mesh, placements, tuple((d, axes) for d, axes in enumerate(orders) if len(axes) > 1))


def _set(placements: Placements, axes, placement) -> Placements:
    out = list(placements)
    for a in axes:
        out[a] = placement
    return tuple(out)


def _drop(orders: Orders, axes) -> Orders:
    return tuple(tuple(a for a in order if a not in axes) for order in orders)


def _append(orders: Orders, dim: int, axes) -> Orders:
    return tuple((*order, *axes) if d == dim else order for d, order in enumerate(orders))


def _commutes(first: str, second: str, integral: bool) -> bool:
    """Whether reducing by ``first`` then ``second`` equals the other way round."""
    if integral and "avg" in (first, second):
        return False
    return first == second or {first, second} <= {"sum", "avg"}


def _reducible(placements: Placements, group, op: str, integral: bool) -> bool:
    """Whether the Partial axes ``group`` (all ``op``) may be reduced now: every other Partial
    axis before one of them commutes with ``op``; an integer ``avg`` one axis at a time."""
    if integral and op == "avg" and len(group) > 1:
        return False
    last = max(group)
    return all(
        _commutes(p.op, op, integral)
        for a, p in enumerate(placements[:last])
        if isinstance(p, Partial) and a not in group
    )


def _subsets(items):
    items = list(items)
    for r in range(1, len(items) + 1):
        yield from itertools.combinations(items, r)


def _moves(placements: Placements, orders: Orders, goal: Layout, mesh, integral: bool):
    """Every step from a state: (step type, axes, extra fields, placements and orders after)."""
    axes = range(len(placements))
    ndim = len(orders)
    ops = sorted({p.op for p in placements if isinstance(p, Partial)})  # the same order on every rank
    for op in ops:
        partial = [a for a in axes if placements[a] == Partial(op)]
        for group in _subsets(partial):
            if not _reducible(placements, group, op, integral):
                continue
            yield AllReduce, group, {"op": op}, _set(placements, group, Replicate()), orders
            if op in ("sum", "avg"):
                for dim in range(ndim):
                    after = _set(placements, group, Shard(dim))
                    yield ReduceScatter, group, {"dim": dim, "op": op}, after, _append(orders, dim, group)
    suffixes = [[()] + [order[start:] for start in range(len(order))] for order in orders]
    for choice in itertools.product(*suffixes):
        group = tuple(a for part in choice for a in part)
        if group:  # one all_gather over the flattened group, across dims
            yield AllGather, group, {}, _set(placements, group, Replicate()), _drop(orders, group)
    for dim, order in enumerate(orders):
        for start in range(len(order)):
            group = order[start:]
            for other in range(ndim):
                if other != dim:
                    after = _set(placements, group, Shard(other))
                    moved = _append(_drop(orders, group), other, group)
                    yield AllToAll, group, {"split": other, "concat": dim}, after, moved
    replicated = [a for a in axes if isinstance(placements[a], Replicate)]
    for group in _subsets(replicated):
        for dim in range(ndim):
            yield Slice, group, {"dim": dim}, _set(placements, group, Shard(dim)), _append(orders, dim, group)
        wanted = {goal.placements[a] for a in group}
        if len(wanted) == 1 and isinstance(next(iter(wanted)), Partial):
            (want,) = wanted
            yield Partition, group, {"op": want.op}, _set(placements, group, want), orders
    for a, b in itertools.combinations(axes, 2):
        pa, pb = placements[a], placements[b]
        if mesh.shape[a] != mesh.shape[b] or pa == pb:
            continue
        if isinstance(pa, Partial) and isinstance(pb, Shard) and orders[pb.dim] == (b,):
            if pa.op in ("sum", "avg") and _reducible(placements, (a,), pa.op, integral):
                after = _set(_set(placements, (a,), Shard(pb.dim)), (b,), Replicate())
                moved = tuple((a,) if d == pb.dim else order for d, order in enumerate(orders))
                yield ReduceBroadcast, (a, b), {"dim": pb.dim, "op": pa.op}, after, moved
        if isinstance(pa, Partial) or isinstance(pb, Partial):
            continue
        swapped = {a: b, b: a}
        after = tuple(tuple(swapped.get(x, x) for x in order) for order in orders)
        yield Swap, (a, b), {}, _set(_set(placements, (a,), pb), (b,), pa), after
    for dim, order in enumerate(orders):  # the same blocks, the axes of a dim in another order
        for other in itertools.permutations(order):  # (Partial parts keep their coordinates)
            if other != order:
                reordered = tuple(other if d == dim else o for d, o in enumerate(orders))
                yield Permute, tuple(axes), {}, placements, reordered


def _same_blocks(
    placements: Placements, orders: Orders, goal_placements: Placements, goal_orders: Orders, mesh
) -> bool:
    """Whether two layouts without Partial axes cut the value into the same blocks (then one
    block permutation moves one to the other)."""
    if any(isinstance(p, Partial) for p in (*placements, *goal_placements)):
        return False
    return all(
        math.prod([mesh.shape[a] for a in o]) == math.prod([mesh.shape[a] for a in g])
        for o, g in zip(orders, goal_orders)
    )


def _even(shape, orders: Orders, mesh) -> bool:
    return all(size % math.prod([mesh.shape[a] for a in order]) == 0 for size, order in zip(shape, orders))


@cached(1024)
def plan(
    source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int, integral: bool = False
) -> tuple[Step, ...]:
    """The cheapest steps from ``source`` to ``target`` for a value of ``shape`` (``integral``:
    of an integer dtype): fewest bytes received per device (summed over steps), then fewest
    collectives."""
    if source == target:
        return ()
    mesh = source.mesh
    if not (shard_table(source, shape).is_even and shard_table(target, shape).is_even):
        scatter = _uneven_reduce_scatter(source, target, len(shape), integral)
        return (scatter or Regather(source, target, tuple(range(mesh.ndim))),)
    ndim = len(shape)
    start, goal = _state(source, ndim), _state(target, ndim)
    replicated_goal = (tuple(Replicate() if p.is_partial() else p for p in goal[0]), goal[1])
    best = {start: (0, 0)}
    queue = [(0, 0, 0, start, ())]
    tie = itertools.count(1)
    all_axes = tuple(range(mesh.ndim))
    while queue:
        cost, count, _, state, steps = heapq.heappop(queue)
        if state == goal:
            return steps
        if best.get(state, (cost, count)) < (cost, count):
            continue
        placements, orders = state
        moves = list(_moves(placements, orders, target, mesh, integral))
        if state != replicated_goal and _same_blocks(*state, *replicated_goal, mesh):
            moves.append((Permute, all_axes, {}, *replicated_goal))
        for kind, axes, fields, after, after_orders in moves:
            if not _even(shape, after_orders, mesh):
                continue
            step = kind(
                _layout(mesh, placements, orders), _layout(mesh, after, after_orders), tuple(axes), **fields
            )
            if kind.collective and _moves_nothing(step):
                step = Relabel(step.source, step.target, step.axes)
            price = (cost + step_bytes(step, shape, itemsize), count + (1 if step.collective else 0))
            key = (after, after_orders)
            if price < best.get(key, (math.inf, math.inf)):
                best[key] = price
                heapq.heappush(queue, (*price, next(tie), key, (*steps, step)))
    return (Regather(source, target, tuple(range(mesh.ndim))),)


def _uneven_reduce_scatter(source: Layout, target: Layout, ndim: int, integral: bool) -> ReduceScatter | None:
    """Partial(op) -> Shard(d) on one axis, every other placement kept, where ``d`` splits
    unevenly and was whole: one reduce_scatter of blocks padded to a multiple of the axis size
    (torch.chunk's blocks are the first rows of each padded block), or None."""
    changed = [a for a, (p, q) in enumerate(zip(source.placements, target.placements)) if p != q]
    if len(changed) != 1:  # over several axes torch.chunk nests: no padded flat split
        return None
    sources = {source.placements[a] for a in changed}
    targets = {target.placements[a] for a in changed}
    if len(sources) != 1 or len(targets) != 1:
        return None
    (p,), (q,) = sources, targets
    if not (isinstance(p, Partial) and p.op in ("sum", "avg") and isinstance(q, Shard)):
        return None
    if source.sharding_axes(q.dim) or not _reducible(source.placements, tuple(changed), p.op, integral):
        return None
    if any(target.sharding_axes(d) != source.sharding_axes(d) for d in range(ndim) if d != q.dim):
        return None
    return ReduceScatter(source, target, target.sharding_axes(q.dim), dim=q.dim, op=p.op)


def _moves_nothing(step: Step) -> bool:
    """Whether every device keeps its block in ``step``: a collective over mesh axes of size 1,
    or a permutation whose pairs are all a device to itself."""
    if isinstance(step, (Permute, Swap)):
        return all(src == dst for src, dst in permutation_pairs(step.source, step.target))
    return step.group_size == 1


# --- block permutations ------------------------------------------------------------------------


def _block_of(layout: Layout, device: int, ndim: int) -> tuple[int, ...]:
    """The block a device holds, per dim: its flat index over the dim's axes, major first; then
    its coordinates along the Partial axes (which part of the block it holds)."""
    mesh = layout.mesh
    coordinate = mesh.coordinate(device)
    block = []
    for dim in range(ndim):
        index = 0
        for axis in layout.sharding_axes(dim):
            index = index * mesh.shape[axis] + coordinate[axis]
        block.append(index)
    parts = [coordinate[a] for a, p in enumerate(layout.placements) if isinstance(p, Partial)]
    return (*block, *parts)


@cached(256)
def permutation_pairs(source: Layout, target: Layout) -> tuple[tuple[int, int], ...]:
    """``(src, dst)`` flat device pairs that move ``source``'s blocks to ``target``'s (layouts
    that cut the value into the same blocks): each device sends its block once and receives its
    target block once, from itself where it holds it already."""
    mesh = source.mesh
    ndim = 1 + max(
        [p.dim for p in (*source.placements, *target.placements) if isinstance(p, Shard)], default=-1
    )
    holders: dict[tuple[int, ...], list[int]] = {}
    wanted = [_block_of(target, d, ndim) for d in range(mesh.size)]
    for device in range(mesh.size):
        holders.setdefault(_block_of(source, device, ndim), []).append(device)
    pairs, waiting = [], []
    for device, block in enumerate(wanted):
        if device in holders.get(block, ()):
            holders[block].remove(device)
            pairs.append((device, device))
        else:
            waiting.append(device)
    for device in waiting:
        pairs.append((holders[wanted[device]].pop(0), device))
    return tuple(sorted(pairs, key=lambda pair: pair[1]))

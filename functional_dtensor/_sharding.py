"""Sharding math: which block of a global tensor each device holds.

Blocks follow ``torch.chunk`` (as DTensor): a dim of size ``s`` split over ``n`` devices gives
ceil-sized chunks ``c = ceil(s / n)``; device ``i`` holds ``[i*c, min((i+1)*c, s))``, so trailing
devices may be short or empty (5 over 4 -> 2, 2, 1, 0; 6 over 4 -> 2, 2, 2, 0). When several
mesh axes split one dim, they apply in the layout's order for that dim, major first (the mesh's
unless the layout says otherwise), each splitting the block the previous ones left.

``shard_table`` answers for every device at once and is cached by value, so callers pay the
per-device loop once per (layout, shape), never per op.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ._cache import cached
from ._errors import ShapeError, explain
from ._layout import Layout

__all__ = [
    "chunk",
    "ShardTable",
    "shard_table",
    "global_shape_of_even_local",
    "global_shape_of_local",
    "check_rank",
    "check_divisible",
]


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """The length and start of block ``index`` when ``size`` is split into ``parts`` chunks.

    >>> [chunk(5, 4, i) for i in range(4)]
    [(2, 0), (2, 2), (1, 4), (0, 5)]
    """
    step = -(-size // parts)
    start = min(step * index, size)
    return max(0, min(size, start + step) - start), start


class ShardTable(NamedTuple):
    """The shards of every device, in flat (row-major) mesh order."""

    local_shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    padded_shape: tuple[int, ...]
    is_even: bool

    def __str__(self) -> str:
        rows = (f"{i}: {s} @ {o}" for i, (s, o) in enumerate(zip(self.local_shapes, self.offsets)))
        return "\n".join(rows)


@cached(4096)
def shard_table(layout: Layout, global_shape: tuple[int, ...]) -> ShardTable:
    """Local shapes and global offsets of every device's shard (offset of an empty shard:
    the dim's size, as torch's ``compute_local_shape_and_global_offset``)."""
    mesh = layout.mesh
    shapes, offsets = [], []
    for device in range(mesh.size):
        coordinate = mesh.coordinate(device)
        shape, offset = list(global_shape), [0] * len(global_shape)
        for d in range(len(global_shape)):
            for axis in layout.sharding_axes(d):
                length, start = chunk(shape[d], mesh.shape[axis], coordinate[axis])
                shape[d] = length
                offset[d] = global_shape[d] if length == 0 else offset[d] + start
        shapes.append(tuple(shape))
        offsets.append(tuple(offset))
    padded = tuple(max(s[d] for s in shapes) for d in range(len(global_shape)))
    is_even = all([s == padded for s in shapes])
    return ShardTable(tuple(shapes), tuple(offsets), padded, is_even)


def global_shape_of_even_local(layout: Layout, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape whose even split gives ``local_shape`` on every device: the one rule
    for the global shape of local shards (``from_local``, ``shard_map`` outputs)."""
    sizes = layout.mesh.shape
    return tuple(
        [n * math.prod([sizes[a] for a in layout.sharding_axes(d)]) for d, n in enumerate(local_shape)]
    )


def global_shape_of_local(layout: Layout, local_shapes) -> tuple[int, ...] | None:
    """The global shape whose split gives device ``k`` the local shape ``local_shapes[k]`` (every
    device's, in flat mesh order), or None where no shape does: along each dim, the sizes of
    its distinct blocks added up (the devices at coordinate 0 of the axes that do not split it)."""
    mesh = layout.mesh
    if len({len(s) for s in local_shapes}) != 1 or len(local_shapes) != mesh.size:
        return None
    shape = []
    for dim in range(len(local_shapes[0])):
        axes = layout.sharding_axes(dim)
        total = 0
        for device, local in enumerate(local_shapes):
            coordinate = mesh.coordinate(device)
            if all(c == 0 for a, c in enumerate(coordinate) if a not in axes):
                total += local[dim]
        shape.append(total)
    shape = tuple(shape)
    fits = shard_table(layout, shape).local_shapes == tuple(tuple(s) for s in local_shapes)
    return shape if fits else None


def check_rank(shape: tuple[int, ...], ndim: int, where: str) -> None:
    """Raise unless the global ``shape`` has the rank ``ndim`` of the local shards."""
    if len(shape) != ndim:
        raise ShapeError(
            explain(
                where,
                "the global shape has the rank of the local shards",
                expected=f"{ndim} sizes",
                got=repr(shape),
                fix="give the global shape of the value the shards make up",
            )
        )


@cached(4096)
def check_divisible(layout: Layout, global_shape: tuple[int, ...], *, where: str) -> None:
    """Raise unless every sharded dim splits evenly (``shard_map``'s requirement)."""
    for dim, size in enumerate(global_shape):
        axes = layout.sharding_axes(dim)
        parts = math.prod([layout.mesh.shape[a] for a in axes])
        if size % parts:
            names = tuple([layout.mesh.axis_names[a] for a in axes])
            multiple = -(-size // parts) * parts
            raise ShapeError(
                explain(
                    where,
                    f"dim {dim} of size {size} does not split evenly over mesh axes {names}",
                    expected=f"a multiple of {parts}",
                    got=f"{size} = {size // parts} * {parts} + {size % parts}",
                    fix=f"pad dim {dim} to {multiple}, or fd.redistribute the value first",
                )
            )

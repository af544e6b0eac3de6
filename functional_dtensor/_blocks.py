"""Tensor rules that both backends share: reductions, partitions and block grids.

* :func:`reduce` and :func:`partition` are the value rules of ``Partial`` placements and of the
  reducing collectives, each written once: a reduction by ``sum``, ``avg``, ``max`` or ``min``
  (an integer average rounds down), and the split of a value into parts that reduce back to it
  (a floating sum divided evenly; an integer sum held by the first device; copies otherwise).
* A *block grid* is a tensor ``(*mesh.shape, *padded)``: the shard of every device, padded at
  the end of each dim to the largest shard, indexed by mesh coordinate. A mesh axis of size 1
  in the grid stands for all the devices along it (their blocks are the same).
  :func:`split` cuts a global tensor into its grid; :func:`assemble` puts a grid whose
  non-splitting axes have size 1 back together. Evenly split values take view ops only (the
  recipes are cached per layout and shape); uneven ones one gather or scatter through cached
  index tables.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._cache import cached
from ._layout import Layout
from ._placements import Partial, Shard
from ._sharding import shard_table

__all__ = [
    "reduce",
    "average",
    "partition",
    "reduce_partial",
    "partition_partial",
    "split",
    "assemble",
    "split_recipe",
    "merge_recipe",
    "pad",
    "unpad",
    "valid_mask",
    "block_numel",
    "outside",
    "outside_mask",
    "distinct_shards",
    "ShardInfo",
    "shard_info",
    "encode_shard_info",
    "decode_shard_info",
]


# --- the value rules ---------------------------------------------------------------------------


def _floating(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def reduce(x: torch.Tensor, op: str, dim: int | tuple[int, ...], *, keepdim: bool = False) -> torch.Tensor:
    """Reduce dim ``dim`` (or dims) of ``x`` by ``op``: ``sum``, ``avg`` (rounded down for
    integer dtypes), ``max`` or ``min``; the dtype is kept. A tensor whose dims are not in
    memory order (a transposed gradient) is reduced along its memory, not across it (torch's
    reductions run ten times slower across it on a CPU); the result keeps its layout."""
    order = memory_order(x)
    if order is None:
        return _reduce(x, op, dim, keepdim)
    dims = (dim,) if isinstance(dim, int) else dim
    dims = tuple([d % x.dim() for d in dims])
    reduced = _reduce(x.permute(order), op, tuple([order.index(d) for d in dims]), True)
    out = reduced.permute(sorted(range(x.dim()), key=order.__getitem__))
    return out if keepdim else out.squeeze(dims)


def memory_order(x: torch.Tensor) -> list[int] | None:
    """The dims of ``x`` from the largest stride to the smallest, where that is not their
    order (None for a contiguous tensor, and where it is; and while compiling: the compiler
    lays out its own loops, and Dynamo does not sort by symbolic strides)."""
    if torch.compiler.is_compiling() or x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return None if order == list(range(x.dim())) else order


def _reduce(x: torch.Tensor, op: str, dim, keepdim: bool) -> torch.Tensor:
    if op == "sum":
        one = dim if isinstance(dim, int) else dim[0] if len(dim) == 1 else None
        if one is not None and x.shape[one] == 2 and x.dtype != torch.bool:
            # two parts (a pair of devices): one add, without a sum's zero fill and its loop
            total = torch.add(x.narrow(one, 0, 1), x.narrow(one, 1, 1))
            return total if keepdim else total.squeeze(one)
        return x.sum(dim, keepdim=keepdim, dtype=x.dtype)
    if op == "avg":
        if _floating(x):
            return x.mean(dim, keepdim=keepdim)
        # summed in int64: a narrow dtype would wrap (64 devices' uint8 4s sum to 0)
        total = x.sum(dim, keepdim=keepdim, dtype=torch.int64)
        count = x.shape[dim] if isinstance(dim, int) else math.prod([x.shape[d] for d in dim])
        return total.div(count, rounding_mode="floor").to(x.dtype)
    return x.amax(dim, keepdim=keepdim) if op == "max" else x.amin(dim, keepdim=keepdim)


def block_numel(storage: torch.Tensor) -> int:
    """The elements of one device's block of stacked ``storage`` (read from its shape: no op)."""
    return storage.numel() // storage.shape[0]


def outside(indices: torch.Tensor, size: int, ignored: int | None = None) -> bool:
    """Whether some of the integer ``indices`` fall outside ``[0, size)`` (``ignored``: an index
    allowed anywhere, as ``ignore_index``): their extremes read in one reduction, each index
    tested (:func:`outside_mask`) only where those fall outside."""
    if not indices.numel():
        return False
    low, high = torch.stack(torch.aminmax(indices)).tolist()
    if 0 <= low and high < size:
        return False
    return ignored is None or bool(outside_mask(indices, size, ignored).any())


def outside_mask(indices: torch.Tensor, size: int, ignored: int | None = None) -> torch.Tensor:
    """Where the integer ``indices`` fall outside ``[0, size)`` (``ignored`` allowed anywhere)."""
    mask = (indices < 0) | (indices >= size)
    return mask if ignored is None else mask & (indices != ignored)


def average(total: torch.Tensor, size: int) -> torch.Tensor:
    """``total / size`` as :func:`reduce` averages: rounded down for integer dtypes."""
    return total / size if _floating(total) else total.div(size, rounding_mode="floor")


def partition(x: torch.Tensor, op: str, size: int, first) -> torch.Tensor:
    """The part of ``x`` that one of ``size`` devices holds, so that reducing the parts by
    ``op`` gives ``x`` back: a floating sum divided evenly, an integer sum held by the first
    device (``first``: a bool, or a bool tensor that broadcasts against ``x``), and for
    ``avg``, ``max`` and ``min`` the value itself."""
    if op != "sum" or size == 1:
        return x
    if _floating(x):
        return x / size
    if isinstance(first, bool):
        return x if first else torch.zeros_like(x)
    return x * first.to(x.dtype)


def reduce_partial(grid: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Reduce the Partial mesh axes of a block grid (kept, of size 1), one axis at a time in
    mesh order: the global value of a layout with Partial axes."""
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            grid = reduce(grid, placement.op, axis, keepdim=True)
    return grid


def partition_partial(grid: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Split a grid replicated along the Partial axes into parts that reduce back to it."""
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Partial) and placement.op == "sum":
            size = layout.mesh.shape[axis]
            first = _first_along(axis, size, grid.dim(), str(grid.device))
            grid = partition(
                grid.expand(*grid.shape[:axis], size, *grid.shape[axis + 1 :]), "sum", size, first
            )
    return grid


@cached(256)
def _first_along(axis: int, size: int, ndim: int, device: str) -> torch.Tensor:
    first = torch.zeros(size, dtype=torch.bool, device=device)
    first[0] = True
    return first.view(size, *[1] * (ndim - axis - 1))


# --- padding ----------------------------------------------------------------------------------


def pad(x: torch.Tensor, padded: tuple[int, ...]) -> torch.Tensor:
    """``x`` with zeros appended at the end of each dim up to ``padded``."""
    widths = []
    for size, target in zip(reversed(x.shape), reversed(padded)):
        widths += [0, target - size]
    return torch.nn.functional.pad(x, widths) if any(widths) else x


def unpad(x: torch.Tensor, local: tuple[int, ...]) -> torch.Tensor:
    """The first ``local`` elements of each dim of ``x`` (a view)."""
    return x[tuple([slice(0, s) for s in local])]


# --- block grids ------------------------------------------------------------------------------


def split(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The block grid ``(*mesh.shape, *padded)`` of the global ``tensor`` (Partial axes
    partitioned). Even splits are views (replicas share their memory)."""
    shape = tuple(tensor.shape)
    table = shard_table(layout, shape)
    mesh = layout.mesh
    if table.is_even:
        view, order, blocks, expanded = split_recipe(layout, table.padded_shape)
        grid = tensor.reshape(view).permute(order).reshape(blocks).expand(expanded)
    else:
        index = _index_tables(layout, shape, tuple(range(mesh.size)), str(tensor.device))
        grid = pad(tensor, [s + 1 for s in shape])[index].reshape(*mesh.shape, *table.padded_shape)
    return partition_partial(grid, layout)


def assemble(grid: torch.Tensor, layout: Layout, global_shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor from a block grid whose non-Shard mesh axes have size 1 (one block
    per distinct shard)."""
    table = shard_table(layout, global_shape)
    if table.is_even:
        view, order = merge_recipe(layout, table.padded_shape, len(global_shape))
        return grid.reshape(view).permute(order).reshape(global_shape)
    mesh = layout.mesh
    sharding = [a for a, p in enumerate(layout.placements) if isinstance(p, Shard)]
    devices = tuple(
        d
        for d in range(mesh.size)
        if all(c == 0 for a, c in enumerate(mesh.coordinate(d)) if a not in sharding)
    )
    index = _index_tables(layout, global_shape, devices, str(grid.device))
    values = grid.reshape(len(devices), *grid.shape[mesh.ndim :])
    out = values.new_zeros([s + 1 for s in global_shape]).index_put(index, values)
    return out[tuple(slice(0, s) for s in global_shape)]


@cached(1024)
def split_recipe(layout: Layout, local_shape: tuple[int, ...]):
    """The view ops that cut an evenly split tensor into its grid: each dim viewed as its
    splitting axes (major first) and its block, the axes moved to the front in mesh order, the
    other axes inserted with size 1 and expanded. Returns ``(view, order, blocks, expanded)``."""
    mesh = layout.mesh
    view, axis_at = [], {}
    for dim in range(len(local_shape)):
        for axis in layout.sharding_axes(dim):
            axis_at[axis] = len(view)
            view.append(mesh.shape[axis])
        view.append(local_shape[dim])
    local_at = [i for i in range(len(view)) if i not in axis_at.values()]
    order = (*[axis_at[a] for a in sorted(axis_at)], *local_at)
    sizes = [mesh.shape[a] if a in axis_at else 1 for a in range(mesh.ndim)]
    return tuple(view), order, (*sizes, *local_shape), (*mesh.shape, *local_shape)


@cached(1024)
def merge_recipe(layout: Layout, local_shape: tuple[int, ...], ndim: int):
    """The inverse of :func:`split_recipe` on a grid whose non-Shard axes have size 1:
    ``(view, order)``, then a reshape to the global shape."""
    sharding = [a for a, p in enumerate(layout.placements) if isinstance(p, Shard)]
    order = []
    for dim in range(ndim):
        order += [sharding.index(a) for a in layout.sharding_axes(dim)]
        order.append(len(sharding) + dim)
    return (*[layout.mesh.shape[a] for a in sharding], *local_shape), tuple(order)


@cached(256)
def _index_tables(layout: Layout, global_shape: tuple[int, ...], devices: tuple[int, ...], device: str):
    """Per-dim gather indices ``(len(devices), padded)`` into the global tensor padded by one
    slot per dim (the slot at index ``size`` stands for padding)."""
    table = shard_table(layout, global_shape)
    tables = []
    for dim, size in enumerate(global_shape):
        rows = []
        for k in devices:
            length, start = table.local_shapes[k][dim], table.offsets[k][dim]
            rows.append([start + j if j < length else size for j in range(table.padded_shape[dim])])
        index = torch.tensor(rows, dtype=torch.long, device=device).reshape(len(devices), -1)
        shape = [len(devices)] + [1] * len(global_shape)
        shape[dim + 1] = table.padded_shape[dim]
        tables.append(index.view(shape))
    return tuple(tables)


def distinct_shards(layout: Layout, global_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sizes of the mesh axes that split the value (1 for the others) and the padded shard
    shape: a grid ``(*sizes, *padded)`` holds one block per distinct shard."""
    sizes = tuple(
        layout.mesh.shape[a] if isinstance(p, Shard) else 1 for a, p in enumerate(layout.placements)
    )
    return sizes, shard_table(layout, global_shape).padded_shape


@cached(256)
def valid_mask(layout: Layout, global_shape: tuple[int, ...], device: str) -> torch.Tensor:
    """``(n, *padded)``: True where a device's padded shard holds real data."""
    table = shard_table(layout, global_shape)
    n, ndim = layout.mesh.size, len(global_shape)
    sizes = torch.tensor(table.local_shapes, dtype=torch.long, device=device).reshape(n, ndim)
    mask = torch.ones((n, *table.padded_shape), dtype=torch.bool, device=device)
    for dim, padded in enumerate(table.padded_shape):
        shape = [1] * (ndim + 1)
        shape[dim + 1] = padded
        positions = torch.arange(padded, device=device).view(shape)
        mask = mask & (positions < sizes[:, dim].view(n, *[1] * ndim))
    return mask


# --- what a device's shard is, for the checks of from_local -----------------------------------


class ShardInfo(NamedTuple):
    """A shard's metadata: what ``from_local`` compares across devices."""

    shape: tuple[int, ...]
    dtype: str
    device: str  # the device type
    requires_grad: bool


def shard_info(t: torch.Tensor) -> ShardInfo:
    return ShardInfo(tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad)


#: every dtype and device type, in an order the same in every process of one torch version
_DTYPES = tuple(sorted({str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}))
_DEVICES = ("cpu", "cuda", "meta", "mps", "xpu", "hpu", "mtia", "privateuseone")
_MAX_DIMS = 64  # torch's limit on the rank of a tensor


def encode_shard_info(info: ShardInfo) -> torch.Tensor:
    """``info`` as a fixed-length int64 vector (every rank's has the same length, so that one
    all-gather collects them whatever the shards are)."""
    shape = [*info.shape, *[-1] * (_MAX_DIMS - len(info.shape))]
    dtype = _DTYPES.index(info.dtype) if info.dtype in _DTYPES else -1
    device = _DEVICES.index(info.device) if info.device in _DEVICES else -1
    return torch.tensor([len(info.shape), dtype, device, int(info.requires_grad), *shape], dtype=torch.int64)


def decode_shard_info(code: torch.Tensor) -> ShardInfo:
    ndim, dtype, device, requires_grad, *shape = code.tolist()
    return ShardInfo(
        tuple(shape[:ndim]),
        _DTYPES[dtype] if dtype >= 0 else "another dtype",
        _DEVICES[device] if device >= 0 else "another device type",
        bool(requires_grad),
    )

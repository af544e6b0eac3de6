"""Where each element of a random draw comes from (:mod:`functional_dtensor.random`): one kind
of draw, its values for boxes of the global tensor (a fused kernel on the CPU, else tensor ops),
as a local tensor or as the storage of a value of any layout."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import _functorch as functorch
from . import _philox, _philox_native
from ._backend import backend_of
from ._blocks import distinct_shards
from ._dtensor import DTensor
from ._layout import Layout
from ._sharding import shard_table
from ._varying import axes_varying, tag

__all__ = ["Draw", "draw_local", "draw_sharded"]


def _strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _runs(offset, local, shape, padded, base: int):
    """The contiguous runs of a box (``local`` elements from ``offset`` of the global ``shape``)
    written into a block of shape ``padded`` at element ``base``: int64 tensors of the runs'
    first global indices, first elements in the block, and lengths."""
    offset, local, shape, padded = list(offset), list(local), list(shape), list(padded)
    while len(local) > 1 and local[-1] == shape[-1] == padded[-1]:  # whole rows: one run
        offset[-2:] = [offset[-2] * shape[-1] + offset[-1]]
        for values in (local, shape, padded):
            values[-2:] = [values[-2] * values[-1]]
    if not local:
        local, offset, shape, padded = [1], [0], [1], [1]
    starts, firsts = torch.zeros(1, dtype=torch.int64), torch.full((1,), base, dtype=torch.int64)
    for d, (g, p) in enumerate(zip(_strides(shape[:-1]), _strides(padded[:-1]))):
        step = torch.arange(local[d], dtype=torch.int64)
        starts = (starts[:, None] + (offset[d] + step) * g * shape[-1]).flatten()
        firsts = (firsts[:, None] + step * p * padded[-1]).flatten()
    lengths = torch.full_like(starts, local[-1])
    return starts + offset[-1], firsts, lengths


def _index(offset, local, shape, device) -> torch.Tensor:
    """The global flat indices of a box, as a tensor of shape ``local``."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, stride in enumerate(_strides(shape)):
        view = [1] * len(shape)
        view[d] = local[d]
        index = index + ((offset[d] + torch.arange(local[d], device=device)) * stride).view(view)
    return index.expand(tuple(local))


class Draw:
    """One kind of draw: its name in :mod:`._philox`, its parameter, the dtype it yields and the
    one its kernel computes in, and the affine map applied after (``scale``, ``shift``)."""

    def __init__(self, kind: str, dtype: torch.dtype, param=None, scale=1.0, shift=0.0) -> None:
        self.kind, self.dtype, self.param, self.scale, self.shift = kind, dtype, param, scale, shift
        if kind in ("uniform", "normal"):
            wide = dtype == torch.float64
            self.native = f"{kind}{64 if wide else 32}"
            self.buffer = torch.float64 if wide else torch.float32
            self.extra = (_philox.DIGITS[dtype],) if self.native == "uniform32" else ()
        elif kind == "bernoulli":
            self.native, self.buffer = "bernoulli", torch.bool
            self.extra = (float(param),) if not isinstance(param, torch.Tensor) else None
        else:
            low, high = param
            self.native, self.buffer, self.extra = "randint", torch.int64, (low, high - low)

    def finish(self, values: torch.Tensor) -> torch.Tensor:
        values = values.to(self.dtype)
        if self.scale != 1.0:
            values = values * self.scale
        if self.shift != 0.0:
            values = values + self.shift
        return values

    def uses_native(self, key: torch.Tensor, device: torch.device) -> bool:
        return (
            device.type == "cpu"
            and key.device.type == "cpu"
            and self.extra is not None
            and not torch.compiler.is_compiling()
            and not functorch.is_transformed(key)
            and _philox_native.available()
        )

    def per_key(self, key: torch.Tensor, shape: tuple[int, ...], device) -> torch.Tensor | None:
        """A local draw with a key that a vmap maps (the simulated mesh's over devices): the
        fused kernel once per key, through its op's vmap rule; None where it cannot run."""
        if not (
            device.type == "cpu"
            and key.device.type == "cpu"
            and self.extra is not None
            and not torch.compiler.is_compiling()
            and functorch.is_transformed(key)
            and _philox_native.available()
        ):
            return None
        p = self.extra[0] if self.native == "bernoulli" else 0.0
        a, b = (self.extra + (0, 0))[:2] if self.native in ("uniform32", "randint") else (0, 0)
        return self.finish(_philox_native.philox_fill(key, list(shape), self.native, p, int(a), int(b)))

    def boxes(self, key: torch.Tensor, boxes, shape, padded, device) -> torch.Tensor:
        """``(len(boxes), *padded)``: box ``b`` (offset, local shape) drawn into block ``b``;
        padding zero."""
        even = all(tuple(local) == tuple(padded) for _, local in boxes)
        if self.uses_native(key, device):
            size = math.prod(padded)
            out = (torch.empty if even else torch.zeros)((len(boxes), *padded), dtype=self.buffer)
            runs = [_runs(offset, local, shape, padded, b * size) for b, (offset, local) in enumerate(boxes)]
            starts, firsts, lengths = (torch.cat(parts) for parts in zip(*runs))
            k0, k1 = (int(w) & _philox.MASK for w in key.tolist())
            _philox_native.fill(self.native, (k0, k1), starts, firsts, lengths, out, *self.extra)
            return self.finish(out)
        key = key.to(device)
        blocks = []
        for offset, local in boxes:
            values = _philox.draw(
                key, _index(offset, local, shape, device), self.kind, self.dtype, self.param
            )
            values = self.finish(values)
            pad = [p for size, full in zip(reversed(local), reversed(padded)) for p in (0, full - size)]
            blocks.append(torch.nn.functional.pad(values, pad) if not even else values)
        return torch.stack(blocks) if blocks else torch.empty((0, *padded), dtype=self.dtype, device=device)


def draw_local(draw: Draw, key: torch.Tensor, shape: tuple[int, ...], device) -> torch.Tensor:
    device = key.device if device is None else torch.device(device)
    out = draw.per_key(key, shape, device)
    if out is None:
        out = draw.boxes(key, [((0,) * len(shape), shape)], shape, shape, device)[0]
    return tag(out, axes_varying(key))


def draw_sharded(draw: Draw, key: torch.Tensor, shape: tuple[int, ...], layout: Layout) -> DTensor:
    mesh = layout.mesh
    device = torch.device(mesh.device_type)
    table = shard_table(layout, shape)
    sizes, padded = distinct_shards(layout, shape)
    strides = _strides(mesh.shape)

    def box(shard: int):  # a distinct shard's box: the one of a device at its coordinates
        coordinate = [0] * mesh.ndim
        for axis in reversed(range(mesh.ndim)):
            shard, coordinate[axis] = divmod(shard, sizes[axis])
        device_index = sum(c * s for c, s in zip(coordinate, strides))
        return table.offsets[device_index], table.local_shapes[device_index]

    def blocks(block_shape, shard):
        chosen = range(math.prod(sizes)) if shard is None else [shard]
        return draw.boxes(key, [box(s) for s in chosen], shape, padded, device).reshape(block_shape)

    return DTensor(backend_of(mesh).materialize(layout, shape, blocks), layout, shape)

"""Factories that materialize only the local shards of a global value (as DTensor's).

Random values depend on the layout's shards, not on the backend: each distinct shard is drawn
from its own generator, seeded from one number drawn from torch's default generator (so
``torch.manual_seed`` makes them reproducible, and equally seeded ranks agree). The simulated
and the distributed backend give the same values.

>>> import functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> fd.ones((5, 4), mesh=mesh, placements=fd.P("x", "y")).to_local(device=(1, 1)).shape
torch.Size([2, 2])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._backend import backend_of
from ._dtensor import DTensor, layout_for
from ._layout import Layout, PlacementsOrSpec
from ._mesh import DeviceMesh

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn"]


def _shape(size) -> tuple[int, ...]:
    return (
        tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
    )


def _build(
    layout: Layout, shape: tuple[int, ...], blocks: Callable[[tuple[int, ...], int | None], torch.Tensor]
):
    """Storage from ``blocks(block_shape, shard)``: the padded blocks of the distinct shard
    ``shard`` (``None``: of every distinct shard, as a grid)."""
    return backend_of(layout.mesh).materialize(layout, shape, blocks)


def _factory(name: str, doc: str, blocks_for):
    """A factory whose blocks come from ``blocks_for(layout, dtype)`` (see :func:`_build`)."""

    def factory(
        *size: int | Sequence[int],
        mesh: DeviceMesh,
        placements: PlacementsOrSpec,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
    ) -> DTensor:
        shape = _shape(size)
        layout = layout_for(mesh, placements, len(shape), f"fd.{name}")
        storage = _build(layout, shape, blocks_for(layout, dtype))
        return DTensor(storage.requires_grad_(requires_grad), layout, shape)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


def _filled(name: str, fill: Callable[..., torch.Tensor]):
    def blocks_for(layout: Layout, dtype):
        return lambda block_shape, shard: fill(block_shape, dtype=dtype, device=layout.mesh.device_type)

    doc = f"A global value of shape ``size`` filled as ``torch.{name}``, materializing only local shards."
    return _factory(name, doc, blocks_for)


def _random(name: str, draw: Callable[..., torch.Tensor]):
    def blocks_for(layout: Layout, dtype):
        device = layout.mesh.device_type
        seed = int(torch.randint(0, 2**62, ()))  # the same on equally seeded ranks

        def one(block_shape, shard: int) -> torch.Tensor:
            generator = torch.Generator(device=device).manual_seed(seed + shard)
            return draw(block_shape, generator=generator, dtype=dtype, device=device)

        def blocks(block_shape, shard):
            if shard is not None:
                return one(block_shape, shard)
            sizes, inner = block_shape[: layout.mesh.ndim], block_shape[layout.mesh.ndim :]
            return torch.stack([one(inner, i) for i in range(math.prod(sizes))]).reshape(block_shape)

        return blocks

    doc = (
        f"A global value of shape ``size`` drawn as ``torch.{name}``, materializing only local shards; "
        "each distinct shard from its own generator (the same values on either backend)."
    )
    return _factory(name, doc, blocks_for)


zeros = _filled("zeros", torch.zeros)
ones = _filled("ones", torch.ones)
empty = _filled("empty", torch.empty)
rand = _random("rand", torch.rand)
randn = _random("randn", torch.randn)


def full(
    size: Sequence[int],
    fill_value,
    *,
    mesh: DeviceMesh,
    placements: PlacementsOrSpec,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """A global value of shape ``size`` filled with ``fill_value``, materializing only shards."""
    shape = tuple(size)
    layout = layout_for(mesh, placements, len(shape), "fd.full")
    device = layout.mesh.device_type
    storage = _build(layout, shape, lambda s, shard: torch.full(s, fill_value, dtype=dtype, device=device))
    return DTensor(storage.requires_grad_(requires_grad), layout, shape)

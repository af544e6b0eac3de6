"""Factories that materialize only the local shards of a global value (as DTensor's).

>>> import functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> fd.ones((5, 4), mesh=mesh, placements=fd.P("x", "y")).to_local(device=(1, 1)).shape
torch.Size([2, 2])
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ._backends import simulated_storage as simulated
from ._dtensor import DTensor, layout_for
from ._layout import PlacementsOrSpec
from ._mesh import DeviceMesh

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn"]


def _factory(name: str, fill: Callable[..., torch.Tensor]):
    def factory(
        *size: int | Sequence[int],
        mesh: DeviceMesh,
        placements: PlacementsOrSpec,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
    ) -> DTensor:
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        layout = layout_for(mesh, placements, len(shape), f"fd.{name}")
        options = {"dtype": dtype, "device": layout.mesh.device_type}
        if layout.mesh.backend == "simulated":
            storage = simulated.materialize(layout, shape, lambda s: fill(s, **options))
        else:
            from ._backends import distributed_storage

            local_shape = distributed_storage.local_shape(layout, shape)
            storage = distributed_storage.materialize(layout, local_shape, lambda s: fill(s, **options))
        return DTensor(storage.requires_grad_(requires_grad), layout, shape)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = (
        f"A global value of shape ``size`` filled as ``torch.{name}``, materializing only local shards."
    )
    return factory


zeros = _factory("zeros", torch.zeros)
ones = _factory("ones", torch.ones)
empty = _factory("empty", torch.empty)
rand = _factory("rand", torch.rand)
randn = _factory("randn", torch.randn)


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
    make = lambda s: torch.full(s, fill_value, dtype=dtype, device=layout.mesh.device_type)  # noqa: E731
    if layout.mesh.backend == "simulated":
        storage = simulated.materialize(layout, shape, make)
    else:
        from ._backends import distributed_storage

        storage = distributed_storage.materialize(layout, distributed_storage.local_shape(layout, shape), make)
    return DTensor(storage.requires_grad_(requires_grad), layout, shape)



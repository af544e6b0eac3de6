"""Factories that materialize only the local shards of a global value (as DTensor's); the
random ones, ``rand`` and ``randn``, are in :mod:`.random`.

>>> import functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> fd.ones((5, 4), mesh=mesh, placements=fd.P("x", "y")).to_local(device=(1, 1)).shape
torch.Size([2, 2])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from ._backend import backend_of
from ._dtensor import DTensor, layout_for
from ._errors import InputTypeError, ShapeError, explain
from ._layout import Layout, PlacementsOrSpec
from ._mesh import DeviceMesh

__all__ = ["zeros", "ones", "empty", "full", "global_shape", "check_dtype", "on_meta"]


def global_shape(size: tuple, api: str) -> tuple[int, ...]:
    """The global shape from a factory's sizes: ints (``zeros(2, 3)``) or one sequence of them
    (``zeros((2, 3))``), each at least 0."""
    sizes = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    try:
        shape = tuple(operator.index(n) for n in sizes)
    except TypeError:
        shape = None
    if shape is None or any(n < 0 for n in shape):
        raise (InputTypeError if shape is None else ShapeError)(
            explain(
                f"{api}(size)",
                "a global shape is a sequence of sizes of 0 or more",
                expected="ints of 0 or more, given as separate arguments or as one tuple",
                got=repr(sizes if len(size) == 1 else size),
                fix=f"e.g. {api}((4, 8), mesh=..., placements=...)",
            )
        )
    return shape


def check_dtype(dtype, api: str) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InputTypeError(
            explain(
                f"{api}(dtype)",
                "a dtype is a torch.dtype",
                expected="None or a torch.dtype such as torch.float32",
                got=repr(dtype),
                fix=f"pass torch.{dtype}" if isinstance(dtype, str) else "pass a torch.dtype",
            )
        )


def on_meta(device, mesh: DeviceMesh, api: str) -> bool:
    """Whether a factory builds a meta value (shapes and layout, no memory): ``device`` is
    ``"meta"``; ``None`` or the mesh's device type build a real one."""
    if device is None:
        return False
    kind = device.type if isinstance(device, torch.device) else device
    if kind == "meta":
        return True
    if kind == mesh.device_type:
        return False
    raise InputTypeError(
        explain(
            f"{api}(device)",
            "a value lives on its mesh's devices, or on the meta device (shapes, no memory)",
            expected=f"None, {mesh.device_type!r} or 'meta'",
            got=repr(device),
            fix="leave device out, or build the mesh on the device you want",
        )
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
        device: str | torch.device | None = None,
    ) -> DTensor:
        shape = global_shape(size, f"fd.{name}")
        check_dtype(dtype, f"fd.{name}")
        layout = layout_for(mesh, placements, len(shape), f"fd.{name}")
        if on_meta(device, layout.mesh, f"fd.{name}"):
            storage = backend_of(layout.mesh).meta(layout, shape, dtype)
        else:
            storage = _build(layout, shape, blocks_for(layout, dtype))
        return DTensor(storage.requires_grad_(requires_grad), layout, shape)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


def _filled(name: str, fill: Callable[..., torch.Tensor]):
    def blocks_for(layout: Layout, dtype):
        return lambda block_shape, shard: fill(block_shape, dtype=dtype, device=layout.mesh.device_type)

    doc = (
        f"A global value of shape ``size`` filled as ``torch.{name}``, materializing only local shards "
        "(none with ``device='meta'``: a value of shapes and layout only)."
    )
    return _factory(name, doc, blocks_for)


zeros = _filled("zeros", torch.zeros)
ones = _filled("ones", torch.ones)
empty = _filled("empty", torch.empty)


def full(
    size: int | Sequence[int],
    fill_value,
    *,
    mesh: DeviceMesh,
    placements: PlacementsOrSpec,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    device: str | torch.device | None = None,
) -> DTensor:
    """A global value of shape ``size`` filled with ``fill_value``, materializing only shards
    (none with ``device='meta'``: a value of shapes and layout only)."""
    shape = global_shape((size,), "fd.full")
    check_dtype(dtype, "fd.full")
    layout = layout_for(mesh, placements, len(shape), "fd.full")
    device = "meta" if on_meta(device, layout.mesh, "fd.full") else layout.mesh.device_type
    storage = _build(layout, shape, lambda s, shard: torch.full(s, fill_value, dtype=dtype, device=device))
    return DTensor(storage.requires_grad_(requires_grad), layout, shape)

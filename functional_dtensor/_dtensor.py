"""``DTensor``: an immutable global value, its layout and its local shards.

Not a ``torch.Tensor`` subclass: a small record holding the layout, the global shape and the
backend's storage (on the simulated backend every device's shard, stacked; on the distributed
backend this rank's shard), read and written through the backend only. Everything that
computes on it is a pure function returning a new value: :func:`shard_map`,
:func:`redistribute`.

A value owns its memory: :func:`distribute_tensor` and :func:`from_local` copy what they would
otherwise share with the caller's tensor (``copy=False`` opts out), and it has no in-place
methods. It saves and loads with ``pickle``, ``copy.deepcopy`` and ``torch.save``/``torch.load``
(``weights_only=True`` too: importing the package registers its classes with
``torch.serialization.add_safe_globals``); a distributed value saves this rank's shard.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> x = fd.distribute_tensor(torch.arange(10.0), mesh, fd.P("x"))
>>> x
DTensor(shape=(10,), dtype=torch.float32, sharding=S(0) on DeviceMesh(shape=(4,), axis_names=('x',)))
>>> [shard.tolist() for shard in x.local_shards()]
[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0]]
>>> torch.equal(x.full_tensor(), torch.arange(10.0))
True

The class is :mod:`._dtensor_core`, storage to and from the global value
:mod:`._global_storage`, the mesh and layout checks :mod:`._layout_checks`; this module builds
values from tensors and is where the modules above import the value's names from.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ._backend import backend_of
from ._dtensor_core import (
    DTensor,
    data_of,
    global_value,
    held_of,
    held_varied,
    new_held,
    new_value,
    new_value_eager,
    parts_of,
    storage_of,
    with_grad_layout,
)
from ._errors import InputTypeError, ShapeError, explain
from ._global_storage import distribute_storage, gather_storage, without_partial
from ._layout import PlacementsOrSpec
from ._layout_checks import check_mesh, check_partial_dtype, layout_for
from ._mesh import DeviceMesh
from ._sharding import check_rank

__all__ = [
    "DTensor",
    "distribute_tensor",
    "check_partial_dtype",
    "from_local",
    "distribute_storage",
    "gather_storage",
    "layout_for",
    "without_partial",
    "check_mesh",
    "storage_of",
    "with_grad_layout",
    "check_tensor",
    "TORCH_DTENSOR_FIX",
    "new_value",
    "new_value_eager",
    "parts_of",
    "new_held",
    "held_of",
    "data_of",
    "global_value",
    "held_varied",
]


#: how to bring a torch.distributed.tensor.DTensor over
TORCH_DTENSOR_FIX = (
    "convert it with fd.from_torch(x) (its layout kept), or pass its global value x.full_tensor()"
)


def check_tensor(value, where: str, *, torch_dtensor_fix: str) -> torch.Tensor:
    """``value`` if it is a plain tensor; otherwise an error that names the conversion
    (``torch_dtensor_fix``: the one for a ``torch.distributed.tensor.DTensor``)."""
    if isinstance(value, torch.Tensor) and not _is_torch_dtensor(value):
        if value.layout != torch.strided:
            raise InputTypeError(
                explain(
                    where,
                    "an fd.DTensor holds dense (strided) tensors",
                    expected="a tensor of layout torch.strided",
                    got=f"a tensor of layout {value.layout}",
                    fix="convert it with tensor.to_dense() first",
                )
            )
        return value
    if isinstance(value, DTensor):
        what, fix = (
            "the value is already an fd.DTensor",
            "use it as it is, fd.redistribute(x, placements) for another layout, or x.local_shards() "
            "(x.to_local() on the distributed backend) for its shards",
        )
    elif _is_torch_dtensor(value):
        what, fix = "a torch DTensor is not a plain tensor", torch_dtensor_fix
    else:
        what, fix = "a tensor is needed", "convert it with torch.as_tensor(...) first"
    got = f"{type(value).__module__}.{type(value).__name__}" if isinstance(value, torch.Tensor) else None
    raise InputTypeError(
        explain(where, what, expected="a torch.Tensor", got=got or type(value).__name__, fix=fix)
    )


def _is_torch_dtensor(value) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (a torch.Tensor subclass
    whose data is its local shard alone)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: PlacementsOrSpec,
    *,
    copy: bool = True,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay out the global ``tensor`` on ``device_mesh`` (differentiable in ``tensor``).

    ``placements`` is one placement per mesh axis, or an ``fd.P`` spec. A Partial placement
    splits the value into parts that reduce back to it (as DTensor).

    The value shares no memory with ``tensor``: changing ``tensor`` in place later leaves it
    as it is. Where the layout lets shards be views of ``tensor`` (an even split; a replicated
    value, held once on the simulated backend), that takes a copy; ``copy=False`` skips it
    when you hand over a tensor you will not modify again (the value may then share its
    memory).

    On the distributed backend the value is the tensor that the device at index
    ``src_data_rank`` of every mesh axis passed (default 0: rank 0's, broadcast), so replicas
    agree whatever each rank passed, as torch's ``src_data_rank``; ``src_data_rank=None``
    takes each rank's own tensor, with no communication (every rank must then pass the same
    values; so too inside ``torch.func`` transforms). On the simulated backend one tensor is
    every device's.
    """
    api = "fd.distribute_tensor"
    if isinstance(tensor, DTensor):
        raise InputTypeError(
            explain(
                f"{api}(tensor)",
                "the value is already distributed",
                expected="a torch.Tensor holding the global value",
                got=repr(tensor),
                fix="use fd.redistribute(x, placements) to change its layout",
            )
        )
    tensor = check_tensor(tensor, f"{api}(tensor)", torch_dtensor_fix=TORCH_DTENSOR_FIX)
    layout = layout_for(device_mesh, placements, tensor.dim(), api)
    if src_data_rank is not None and (
        type(src_data_rank) is not int or not 0 <= src_data_rank < min(layout.mesh.shape, default=1)
    ):
        raise InputTypeError(
            explain(
                f"{api}(src_data_rank)",
                "the source is the device at this index of every mesh axis",
                expected=f"an int in [0, {min(layout.mesh.shape, default=1)}) or None",
                got=repr(src_data_rank),
                fix="leave it at 0 (rank 0's data, as torch), or None to take each rank's own tensor",
            )
        )
    if layout.has_partial:
        check_partial_dtype(layout, tensor.dtype, f"{api}(placements)")
    if tensor.is_meta and layout.mesh.device_type != "meta":
        raise InputTypeError(
            explain(
                f"{api}(tensor)",
                "a meta tensor holds shapes, no values to lay out",
                expected=f"a tensor with values (the mesh's devices are {layout.mesh.device_type!r})",
                got=f"a meta tensor of shape {tuple(tensor.shape)}",
                fix="for a value of shapes only: fd.empty(shape, mesh=mesh, placements=..., device='meta'); "
                "for a module made on the meta device: module.to_empty(device='cpu'), initialized, first",
            )
        )
    moved = tensor.to(layout.mesh.device_type)
    copy = copy and moved is tensor  # (a tensor moved to the mesh's devices is a copy already)
    if src_data_rank is not None:  # the source rank's data: its own tensor's memory
        moved = backend_of(layout.mesh).from_source(moved, layout.mesh, src_data_rank)
    storage = distribute_storage(moved, layout, copy=copy)
    return DTensor(storage, layout, tensor.shape)


def from_local(
    local_tensor,
    device_mesh: DeviceMesh,
    placements: PlacementsOrSpec,
    *,
    shape: Sequence[int] | None = None,
    run_check: bool = False,
    copy: bool = True,
) -> DTensor:
    """A global value from local shards, as DTensor's ``from_local``.

    On the distributed backend pass this rank's shard. On the simulated backend pass one tensor
    per device (a list in flat mesh order), or a single tensor that every device holds (what each
    rank would pass in an SPMD program). Without ``shape`` the global shape is found from every
    device's shard (on the distributed backend, by one small all-gather: every rank agrees, uneven
    splits included); give ``shape`` to skip that. ``run_check`` verifies
    that the shards agree with each other and with the layout: their dtype, device type, rank,
    shapes and ``requires_grad``, and equal values across Replicate axes.

    The value shares no memory with the local tensors given (differentiably: gradients flow
    back to them); ``copy=False`` skips that copy where the backend can hold a given tensor as
    it is (this rank's shard; one tensor every simulated device holds), for a tensor you will
    not modify again.
    """
    api = "fd.from_local"
    fix = "pass its shard, x.to_local(), with shape=tuple(x.shape)"
    mesh = check_mesh(device_mesh, f"{api}(device_mesh)")
    if isinstance(local_tensor, (list, tuple)):
        shards = [
            check_tensor(t, f"{api}(local_tensor[{k}])", torch_dtensor_fix=fix)
            for k, t in enumerate(local_tensor)
        ]
        if not shards:
            raise ShapeError(
                explain(
                    f"{api}(local_tensor)",
                    "no shard given",
                    expected="a tensor, or a list of every device's shard",
                    got="an empty list",
                    fix="pass the local shards",
                )
            )
    else:
        shards = [check_tensor(local_tensor, f"{api}(local_tensor)", torch_dtensor_fix=fix)]
    ndim = shards[0].dim()
    layout = layout_for(mesh, placements, ndim, api)
    if layout.has_partial:
        check_partial_dtype(layout, shards[0].dtype, f"{api}(placements)")
    shape = None if shape is None else tuple(shape)
    if shape is not None and not run_check:  # with run_check, every process checks every shard
        check_rank(shape, ndim, f"{api}(shape)")
    backend = backend_of(mesh)
    storage, shape = backend.from_local(shards, layout, shape, run_check=run_check, copy=copy, where=api)
    return DTensor(storage, layout, shape)

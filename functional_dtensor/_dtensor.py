"""``DTensor``: an immutable global value, its layout and its local shards.

Not a ``torch.Tensor`` subclass: a small record holding the layout, the global shape and the
backend's storage (on the simulated backend every device's shard, stacked; on the distributed
backend this rank's shard), read and written through the backend only. Everything that
computes on it is a pure function returning a new value: :func:`shard_map`,
:func:`redistribute`.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> x = fd.distribute_tensor(torch.arange(10.0), mesh, fd.P("x"))
>>> x
DTensor(shape=(10,), dtype=torch.float32, layout=S(0) on DeviceMesh(shape=(4,), axis_names=('x',)))
>>> [shard.tolist() for shard in x.local_shards()]
[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0]]
>>> torch.equal(x.full_tensor(), torch.arange(10.0))
True
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch

from . import _autograd as autograd
from ._backend import backend_of
from ._errors import InputTypeError, LayoutError, ShapeError, explain
from ._layout import Layout, PlacementsOrSpec, as_layout
from ._mesh import DeviceMesh
from ._placements import Placement, Replicate
from ._public import public
from ._sharding import check_rank
from ._spec import P

__all__ = [
    "DTensor",
    "distribute_tensor",
    "from_local",
    "distribute_storage",
    "gather_storage",
    "layout_for",
    "without_partial",
    "check_mesh",
    "storage_of",
    "check_tensor",
    "TORCH_DTENSOR_FIX",
]


#: how to bring a torch.distributed.tensor.DTensor over: its global value, or its shard
TORCH_DTENSOR_FIX = (
    "pass its global value x.full_tensor(), or its shard: "
    "fd.from_local(x.to_local(), mesh, placements, shape=tuple(x.shape))"
)


@public
class DTensor:
    """A global tensor laid out on a device mesh. Build one with :func:`distribute_tensor`,
    :func:`from_local`, a factory such as :func:`zeros`, or as the output of
    :func:`shard_map`."""

    __slots__ = ("_layout", "_shape", "_storage")

    _layout: Layout
    _shape: torch.Size
    _storage: torch.Tensor

    def __init__(self, storage: torch.Tensor, layout: Layout, shape: Sequence[int]) -> None:
        """Internal: use :func:`distribute_tensor` or :func:`from_local`."""
        object.__setattr__(self, "_storage", storage)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_shape", torch.Size(shape))

    def __setattr__(self, name, value):
        raise AttributeError(f"fd.DTensor is immutable: cannot set {name!r}; build a new value instead")

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return self._shape

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._storage.dtype

    @property
    def requires_grad(self) -> bool:
        return self._storage.requires_grad

    @property
    def grad(self) -> DTensor | None:
        """The gradient accumulated on this value's storage by ``backward()``, laid out like the
        value (Partial axes as Replicate), or ``None``. Storage is a leaf when the value was
        made by a factory with ``requires_grad=True`` or by :func:`from_local` of leaves."""
        grad = self._storage.grad
        return None if grad is None else DTensor(grad, without_partial(self._layout), self._shape)

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._layout.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._layout.mesh

    @property
    def spec(self):
        """The partition spec of the layout (an error for Partial layouts)."""
        return self._layout.spec

    def local_shards(self) -> tuple[torch.Tensor, ...]:
        """The shards this process holds, unpadded: on the simulated backend one per device, in
        flat (row-major) mesh order; on the distributed backend, this rank's alone."""
        return backend_of(self.device_mesh).shards(self._storage, self._layout, tuple(self._shape))

    def to_local(self, device: int | Sequence[int] | None = None) -> torch.Tensor:
        """The local shard of one device.

        On the distributed backend, this rank's shard (``device`` may be omitted). On the
        simulated backend, name the device by flat index or mesh coordinate: every shard is
        held here (use :meth:`local_shards` for all of them).
        """
        return backend_of(self.device_mesh).shard(self._storage, self._layout, tuple(self._shape), device)

    def full_tensor(self) -> torch.Tensor:
        """The global value on every device (Partial axes reduced). Differentiable."""
        return gather_storage(self._storage, self._layout, tuple(self._shape))

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={tuple(self._shape)}, dtype={self.dtype}, "
            f"layout={self._layout} on {self.device_mesh!r})"
        )

    def __len__(self) -> int:
        return self._shape[0]


def storage_of(x: DTensor) -> torch.Tensor:
    """The backend's storage of ``x`` (for the transformations above this module)."""
    return x._storage


def distribute_storage(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The storage of the global ``tensor``, differentiably. Where storage and value are views
    of each other, their own backward reassembles the cotangent; every other case goes
    through :class:`_Distribute`."""
    backend = backend_of(layout.mesh)
    if backend.splits_as_views(layout, tuple(tensor.shape)):
        return backend.distribute(tensor, layout)
    return autograd.apply(_Distribute, tensor, layout)


def gather_storage(storage: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """The global value of ``storage``, differentiably (the inverse of :func:`distribute_storage`)."""
    backend = backend_of(layout.mesh)
    if backend.splits_as_views(layout, shape):
        return backend.gather(storage, layout, shape)
    return autograd.apply(_FullTensor, storage, layout, shape)


@functools.lru_cache(maxsize=1024)
def without_partial(layout: Layout) -> Layout:
    """``layout`` with its Partial axes Replicate: the layout of a gradient (as DTensor)."""
    if not layout.has_partial:
        return layout
    return Layout(
        layout.mesh,
        tuple([Replicate() if p.is_partial() else p for p in layout.placements]),
        layout.shard_order,
    )


class _Distribute(torch.autograd.Function):
    """Global tensor -> storage. The gradient of a global value is global: its cotangent is the
    same on every replica (and every Partial part), so the backward reassembles the global
    cotangent from one replica of each shard (DTensor: a Partial source gets a Replicate
    gradient)."""

    @staticmethod
    def forward(tensor, layout):
        return backend_of(layout.mesh).distribute(tensor, layout)

    @staticmethod
    def vmap(info, in_dims, tensor, layout):
        # a mapped batch becomes one more trailing dim of the value, whole on every device
        return autograd.apply(_Distribute, tensor.movedim(in_dims[0], -1), layout), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.shape = inputs[1], tuple(inputs[0].shape)

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_FullTensor, g, without_partial(ctx.layout), ctx.shape), None


class _FullTensor(torch.autograd.Function):
    """Storage -> global tensor. Backward: every device gets its block of the (replicated)
    global cotangent, with no communication."""

    @staticmethod
    def forward(storage, layout, shape):
        return backend_of(layout.mesh).gather(storage, layout, shape)

    @staticmethod
    def vmap(info, in_dims, storage, layout, shape):
        moved = storage.movedim(in_dims[0], -1)
        return autograd.apply(_FullTensor, moved, layout, (*shape, moved.shape[-1])), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_Distribute, g, without_partial(ctx.layout)), None, None


def check_tensor(value, where: str, *, torch_dtensor_fix: str) -> torch.Tensor:
    """``value`` if it is a plain tensor; otherwise an error that names the conversion
    (``torch_dtensor_fix``: the one for a ``torch.distributed.tensor.DTensor``)."""
    if isinstance(value, torch.Tensor) and not _is_torch_dtensor(value):
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


def check_mesh(mesh, where: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise InputTypeError(
            explain(
                where,
                "a device mesh is needed",
                expected="an fd.DeviceMesh",
                got=type(mesh).__name__,
                fix="build one with fd.simulated_mesh(...) or fd.init_device_mesh(...)",
            )
        )
    return mesh


def layout_for(mesh, placements: PlacementsOrSpec, ndim: int, api: str) -> Layout:
    """The normalized layout that ``api`` was given for an ``ndim``-d tensor on ``mesh``."""
    mesh = check_mesh(mesh, f"{api}(device_mesh)")
    if isinstance(placements, P) and len(placements) > ndim:
        raise LayoutError(
            explain(
                f"{api}(placements)",
                "the spec has more entries than the tensor has dims",
                expected=f"at most {ndim} entries, one per dim",
                got=f"{placements!r} ({len(placements)} entries) for a {ndim}-d tensor",
                fix="drop the extra entries, or reshape the tensor first",
            )
        )
    layout = as_layout(mesh, placements, where=f"{api}(placements)")
    return layout.normalized(ndim, where=api)


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh, placements: PlacementsOrSpec) -> DTensor:
    """Lay out the global ``tensor`` on ``device_mesh`` (differentiable in ``tensor``).

    ``placements`` is one placement per mesh axis, or an ``fd.P`` spec. A Partial placement
    splits the value into parts that reduce back to it (as DTensor).
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
    storage = distribute_storage(tensor.to(layout.mesh.device_type), layout)
    return DTensor(storage, layout, tensor.shape)


def from_local(
    local_tensor,
    device_mesh: DeviceMesh,
    placements: PlacementsOrSpec,
    *,
    shape: Sequence[int] | None = None,
    run_check: bool = False,
) -> DTensor:
    """A global value from local shards, as DTensor's ``from_local``.

    On the distributed backend pass this rank's shard. On the simulated backend pass one tensor
    per device (a list in flat mesh order), or a single tensor that every device holds (what each
    rank would pass in an SPMD program). Without ``shape`` the global shape is found from every
    device's shard (on the distributed backend, by one small all-gather: every rank agrees, uneven
    splits included); give ``shape`` to skip that. ``run_check`` verifies
    that the shards agree with each other and with the layout: their dtype, device type, rank,
    shapes and ``requires_grad``, and equal values across Replicate axes.
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
    shape = None if shape is None else tuple(shape)
    if shape is not None and not run_check:  # with run_check, every process checks every shard
        check_rank(shape, ndim, f"{api}(shape)")
    storage, shape = backend_of(mesh).from_local(shards, layout, shape, run_check=run_check, where=api)
    return DTensor(storage, layout, shape)

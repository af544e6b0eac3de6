"""``DTensor``: an immutable global value, its layout and its local shards.

Not a ``torch.Tensor`` subclass: a small record holding the layout, the global shape and the
backend's storage (on the simulated backend every device's shard, stacked; on the distributed
backend this rank's shard). Everything that computes on it is a pure function returning a new
value: :func:`shard_map`, :func:`redistribute`.

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

import operator
from collections.abc import Sequence

import torch

from . import _autograd as autograd
from ._backends import simulated_storage as simulated
from ._errors import InputTypeError, LayoutError, ShapeError, explain
from ._layout import Layout, PlacementsOrSpec, as_layout
from ._mesh import DeviceMesh
from ._placements import Placement, Replicate
from ._sharding import global_shape_of_even_local, shard_table

__all__ = ["DTensor", "distribute_tensor", "from_local"]


class DTensor:
    """A global tensor laid out on a device mesh. Build one with :func:`distribute_tensor`,
    :func:`from_local`, a factory such as :func:`zeros`, or as the output of
    :func:`shard_map`."""

    __slots__ = ("_layout", "_shape", "_stored", "_replica")

    _layout: Layout
    _shape: torch.Size
    _stored: torch.Tensor | None
    _replica: torch.Tensor | None

    def __init__(self, storage: torch.Tensor, layout: Layout, shape: Sequence[int]) -> None:
        """Internal: use :func:`distribute_tensor` or :func:`from_local`."""
        object.__setattr__(self, "_stored", storage)
        object.__setattr__(self, "_replica", None)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_shape", torch.Size(shape))

    @classmethod
    def _of_replica(cls, value: torch.Tensor, layout: Layout) -> DTensor:
        """Internal: a replicated value held once (its storage is built when first needed), as
        a simulated ``shard_map`` returns a value that is the same on every device."""
        out = cls(None, layout, value.shape)
        object.__setattr__(out, "_replica", value)
        return out

    @property
    def _storage(self) -> torch.Tensor:
        stored = self._stored
        if stored is None:
            stored = distribute_storage(self._replica, self._layout)
            object.__setattr__(self, "_stored", stored)
        return stored

    @property
    def _value(self) -> torch.Tensor:
        """Any tensor of this value's dtype and autograd state."""
        return self._storage if self._replica is None else self._replica

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
        return self._value.dtype

    @property
    def requires_grad(self) -> bool:
        return self._value.requires_grad

    @property
    def grad(self) -> DTensor | None:
        """The gradient accumulated on this value's storage by ``backward()``, laid out like the
        value (Partial axes as Replicate), or ``None``. Storage is a leaf when the value was
        made by a factory with ``requires_grad=True`` or by :func:`from_local` of leaves."""
        grad = self._storage.grad
        return None if grad is None else DTensor(grad, _without_partial(self._layout), self._shape)

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
        if self.device_mesh.backend == "simulated":
            return tuple([self.to_local(device=k) for k in range(self.device_mesh.size)])
        return (self._storage,)

    def to_local(self, device: int | Sequence[int] | None = None) -> torch.Tensor:
        """The local shard of one device.

        On the distributed backend, this rank's shard (``device`` may be omitted). On the
        simulated backend, name the device by flat index or mesh coordinate: every shard is
        held here (use :meth:`local_shards` for all of them).
        """
        mesh = self.device_mesh
        if mesh.backend == "distributed":
            return self._storage
        if device is None:
            raise InputTypeError(
                explain(
                    "fd.DTensor.to_local(device)",
                    f"a simulated mesh holds the shards of all {mesh.size} devices",
                    expected=f"a device index in [0, {mesh.size}) or a coordinate of shape {mesh.shape}",
                    got="None",
                    fix="pass device=k, or call local_shards() for every shard",
                )
            )
        index = _device_index(mesh, device, "fd.DTensor.to_local(device)")
        return simulated.shard(self._storage, self._layout, tuple(self._shape), index)

    def full_tensor(self) -> torch.Tensor:
        """The global value on every device (Partial axes reduced). Differentiable."""
        if self._replica is not None:
            return self._replica.view_as(self._replica)
        return gather_storage(self._storage, self._layout, tuple(self._shape))

    def redistribute(self, placements) -> DTensor:
        """This value in another layout: :func:`fd.redistribute(self, placements) <redistribute>`."""
        from ._redistribute import redistribute

        return redistribute(self, placements)

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={tuple(self._shape)}, dtype={self.dtype}, "
            f"layout={self._layout} on {self.device_mesh!r})"
        )

    def __len__(self) -> int:
        return self._shape[0]


def _storage_of(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout.mesh.backend == "simulated":
        return simulated.stack(tensor, layout)
    from ._backends import distributed_storage

    return distributed_storage.local_shard(tensor, layout)


def _global_of(storage: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    if layout.mesh.backend == "simulated":
        return simulated.unstack(storage, layout, shape)
    from ._backends import distributed_storage

    return distributed_storage.full_tensor(storage, layout, shape)


def distribute_storage(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The storage of the global ``tensor``, differentiably. On the simulated backend an evenly
    split value over every mesh axis is views of the tensor, whose own backward reassembles the
    cotangent; every other case goes through :class:`_Distribute`."""
    if _is_split_view(layout, tuple(tensor.shape)):
        return simulated.stack(tensor, layout)
    return autograd.apply(_Distribute, tensor, layout)


def gather_storage(storage: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """The global value of ``storage``, differentiably (the inverse of :func:`distribute_storage`)."""
    if _is_split_view(layout, shape):
        return simulated.unstack(storage, layout, shape)
    return autograd.apply(_FullTensor, storage, layout, shape)


def _is_split_view(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether the storage is a permutation of the global value's elements: simulated, every
    mesh axis a Shard, even blocks. Then plain view ops carry the right gradient both ways."""
    return (
        layout.mesh.backend == "simulated" and layout.is_fully_sharded and shard_table(layout, shape).is_even
    )


def _without_partial(layout: Layout) -> Layout:
    return Layout(layout.mesh, tuple([Replicate() if p.is_partial() else p for p in layout.placements]))


class _Distribute(torch.autograd.Function):
    """Global tensor -> storage. The gradient of a global value is global: its cotangent is the
    same on every replica (and every Partial part), so the backward reassembles the global
    cotangent from one replica of each shard (DTensor: a Partial source gets a Replicate
    gradient)."""

    @staticmethod
    def forward(tensor, layout):
        return _storage_of(tensor, layout)

    @staticmethod
    def vmap(info, in_dims, tensor, layout):
        # a mapped batch becomes one more trailing dim of the value, whole on every device
        return autograd.apply(_Distribute, tensor.movedim(in_dims[0], -1), layout), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.shape = inputs[1], tuple(inputs[0].shape)

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_FullTensor, g, _without_partial(ctx.layout), ctx.shape), None


class _FullTensor(torch.autograd.Function):
    """Storage -> global tensor. Backward: every device gets its block of the (replicated)
    global cotangent, with no communication."""

    @staticmethod
    def forward(storage, layout, shape):
        return _global_of(storage, layout, shape)

    @staticmethod
    def vmap(info, in_dims, storage, layout, shape):
        moved = storage.movedim(in_dims[0], -1)
        return autograd.apply(_FullTensor, moved, layout, (*shape, moved.shape[-1])), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_Distribute, g, _without_partial(ctx.layout)), None, None


def _device_index(mesh: DeviceMesh, device, where: str) -> int:
    if not isinstance(device, (bool, tuple, list)) and hasattr(device, "__index__"):
        device = operator.index(device)
    if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < mesh.size:
        return device
    if (
        isinstance(device, (tuple, list))
        and len(device) == mesh.ndim
        and all([isinstance(c, int) and 0 <= c < s for c, s in zip(device, mesh.shape)])
    ):
        return mesh.flat_index(device)
    raise InputTypeError(
        explain(
            where,
            "no such device on the mesh",
            expected=f"an index in [0, {mesh.size}) or a coordinate within {mesh.shape}",
            got=repr(device),
            fix="count devices in row-major mesh order, or give the mesh coordinate",
        )
    )


def _check_tensor(value, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InputTypeError(
            explain(
                where,
                "a tensor is needed",
                expected="a torch.Tensor",
                got=type(value).__name__,
                fix="convert it with torch.as_tensor(...) first",
            )
        )
    return value


def _check_mesh(mesh, where: str) -> DeviceMesh:
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
    mesh = _check_mesh(mesh, f"{api}(device_mesh)")
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
    tensor = _check_tensor(tensor, f"{api}(tensor)")
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
    rank would pass in an SPMD program). Without ``shape`` the split is taken to be even; give
    ``shape`` for uneven layouts. ``run_check`` verifies that the shards agree with the layout
    (shapes, and equal values across Replicate axes).
    """
    api = "fd.from_local"
    mesh = _check_mesh(device_mesh, f"{api}(device_mesh)")
    if mesh.backend == "simulated" and isinstance(local_tensor, (list, tuple)):
        if len(local_tensor) != mesh.size:
            raise ShapeError(
                explain(
                    f"{api}(local_tensor)",
                    "one shard per device",
                    expected=f"{mesh.size} tensors for mesh {mesh.shape}",
                    got=f"{len(local_tensor)}",
                    fix="pass a list with every device's shard in row-major mesh order",
                )
            )
        shards = [_check_tensor(t, f"{api}(local_tensor[{k}])") for k, t in enumerate(local_tensor)]
    else:
        shards = [_check_tensor(local_tensor, f"{api}(local_tensor)")]
    ndim = shards[0].dim()
    layout = layout_for(mesh, placements, ndim, api)
    if shape is None:
        shape = global_shape_of_even_local(layout, tuple(shards[0].shape))
    shape = tuple(shape)
    if len(shape) != ndim:
        raise ShapeError(
            explain(
                f"{api}(shape)",
                "the global shape has the rank of the local shards",
                expected=f"{ndim} sizes",
                got=repr(shape),
                fix="give the global shape of the value the shards make up",
            )
        )
    table = shard_table(layout, shape)
    if mesh.backend == "simulated":
        shards = [t.to(mesh.device_type) for t in shards]
        if len(shards) == 1:
            _check_local_shape(shards[0].shape, table.local_shapes[0], 0, api, shape)
            if not table.is_even:
                raise ShapeError(
                    explain(
                        f"{api}(local_tensor)",
                        f"global shape {shape} splits unevenly, so devices hold shards of different shapes",
                        expected=f"a list of {mesh.size} shards",
                        got="one tensor for every device",
                        fix="pass each device's shard in a list",
                    )
                )
            storage = shards[0].unsqueeze(0).expand(mesh.size, *shards[0].shape)
        else:
            for k, (t, expected) in enumerate(zip(shards, table.local_shapes)):
                _check_local_shape(t.shape, expected, k, api, shape)
            storage = simulated.from_shards(shards, layout, shape)
        if run_check:
            _check_replicas_equal(storage, layout, api)
        return DTensor(storage, layout, shape)
    from ._backends import distributed_storage

    storage = distributed_storage.check_local(shards[0], layout, shape, run_check=run_check, where=api)
    return DTensor(storage, layout, shape)


def _check_local_shape(got, expected, device: int, api: str, shape) -> None:
    if tuple(got) != tuple(expected):
        raise ShapeError(
            explain(
                f"{api}(local_tensor)",
                f"device {device}'s shard does not fit global shape {tuple(shape)}",
                expected=f"local shape {tuple(expected)}",
                got=f"{tuple(got)}",
                fix="pass shape= with the true global shape, or shards of the right size",
            )
        )


def _check_replicas_equal(storage: torch.Tensor, layout: Layout, api: str) -> None:
    blocks = storage.reshape(*layout.mesh.shape, *storage.shape[1:])
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Replicate) and not torch.equal(
            blocks, blocks.narrow(axis, 0, 1).expand_as(blocks)
        ):
            raise LayoutError(
                explain(
                    f"{api}(local_tensor)",
                    f"shards differ along mesh axis {layout.mesh.axis_names[axis]!r}, placed Replicate",
                    expected="equal shards on every device of a Replicate axis",
                    got="different values",
                    fix="pass equal shards, or place that axis fd.Partial / fd.Shard",
                )
            )

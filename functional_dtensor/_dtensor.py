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
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence

import torch

from . import _autograd as autograd
from ._backend import backend_of, is_transformed
from ._cache import cached
from ._errors import ImmutableError, InputTypeError, LayoutError, ShapeError, explain
from ._layout import Layout, PlacementsOrSpec, as_layout
from ._mesh import DeviceMesh
from ._placements import Partial, Placement, Replicate, Shard
from ._public import public
from ._sharding import check_rank
from ._spec import P

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
]


#: how to bring a torch.distributed.tensor.DTensor over
TORCH_DTENSOR_FIX = (
    "convert it with fd.from_torch(x) (its layout kept), or pass its global value x.full_tensor()"
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
        raise ImmutableError(
            explain(
                f"fd.DTensor.{name}",
                "an fd.DTensor is immutable",
                expected="no attribute set on it",
                got=f"an assignment to {name!r}",
                fix="build a new value instead",
            )
        )

    def __setitem__(self, index, value):
        raise ImmutableError(
            explain(
                "fd.DTensor.__setitem__",
                "an fd.DTensor is immutable",
                expected="no element assigned",
                got=f"x[{index!r}] = ...",
                fix="compute the new value out of place (torch.where, or index_put without the _), "
                "or inside fd.shard_map on a tensor of your own",
            )
        )

    def __getattr__(self, name: str):
        """Only reached for names a DTensor does not have: an in-place method gets an error
        that names its out-of-place form."""
        if name.endswith("_") and not name.endswith("__") and hasattr(torch.Tensor, name):
            out_of_place = name[:-1]
            fix = (
                f"use the out-of-place form, y = x.{out_of_place}(...), which returns a new value"
                if callable(getattr(torch.Tensor, out_of_place, None))
                else "build a new value instead"
            )
            raise ImmutableError(
                explain(
                    f"fd.DTensor.{name}",
                    "an fd.DTensor has no in-place methods",
                    expected="an out-of-place operation",
                    got=f"x.{name}(...)",
                    fix=fix,
                )
            )
        raise AttributeError(f"'fd.DTensor' object has no attribute {name!r}")

    def __copy__(self) -> DTensor:
        return self  # immutable: a shallow copy is the value itself

    def __getstate__(self) -> dict:
        """What pickle, ``copy.deepcopy`` and ``torch.save`` keep: the layout, the global shape
        and the shards this process holds (see :meth:`Backend.saved`)."""
        if is_transformed(self._storage) or torch.compiler.is_compiling():
            raise InputTypeError(
                explain(
                    "fd.DTensor (saving)",
                    "a value inside a torch.func transform or torch.compile exists only while it runs",
                    expected="a value outside every transform",
                    got=repr(self),
                    fix="save the value the transformed function returns, outside the transform",
                )
            )
        storage, device = backend_of(self.device_mesh).saved(self._storage, self._layout)
        return {
            "layout": self._layout,
            "shape": tuple(self._shape),
            "storage": storage,
            "requires_grad": self._storage.requires_grad,
            "device": device,
        }

    def __setstate__(self, state: dict) -> None:
        layout, shape = state["layout"], tuple(state["shape"])
        storage = backend_of(layout.mesh).restored(state["storage"], layout, shape, state["device"])
        object.__setattr__(self, "_storage", storage.requires_grad_(state["requires_grad"]))
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_shape", torch.Size(shape))

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
    def is_meta(self) -> bool:
        """Whether this is a meta value: shapes, dtype and layout, with no memory (factories
        with ``device="meta"``); its shards, global value and redistributions are meta too."""
        return self._storage.is_meta

    @property
    def grad(self) -> DTensor | None:
        """The gradient accumulated on this value's storage by ``backward()``, laid out like the
        value (Partial axes as Replicate), or ``None``. Storage is a leaf when the value was
        made by a factory with ``requires_grad=True`` or loaded with it; a value made from
        tensors (:func:`distribute_tensor`, :func:`from_local`) passes gradients to them."""
        grad = self._storage.grad
        return None if grad is None else DTensor(grad, without_partial(self._layout), self._shape)

    @property
    def sharding(self) -> Layout:
        """How the value is laid out on its mesh: an ``fd.Layout`` (JAX's ``x.sharding``)."""
        return self._layout

    @property
    def layout(self) -> torch.layout:
        """torch's meaning: the memory layout of the global value, ``torch.strided`` (fd's
        layout record is :attr:`sharding`)."""
        return torch.strided

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

    def to_local(
        self, device: int | Sequence[int] | None = None, *, grad_placements: PlacementsOrSpec | None = None
    ) -> torch.Tensor:
        """The local shard of one device. Differentiable.

        On the distributed backend, this rank's shard (``device`` may be omitted). On the
        simulated backend, name the device by flat index or mesh coordinate: every shard is
        held here (use :meth:`local_shards` for all of them).

        ``grad_placements`` (placements or an ``fd.P``, as DTensor) is the layout of the
        gradient that will flow into the returned shard; the backward converts it to this
        value's layout. With ``[fd.Partial()]`` on a Replicate value, each rank may pass back a
        partial gradient: they are summed. It may differ from the value's placements only by
        Replicate for Partial (the shard's shape stays), and a Partial in it sums. Default: the
        value's own placements (a Partial value's gradient is read as Replicate). On the
        simulated backend the gradient of ``to_local(device=k)`` is device ``k``'s gradient,
        every other device contributing zero: summing ``to_local(device=k)`` terms over ``k``
        differentiates as the same SPMD program on the distributed backend.
        """
        value = (
            self
            if grad_placements is None
            else with_grad_layout(self, grad_placements, "fd.DTensor.to_local")
        )
        return backend_of(self.device_mesh).shard(value._storage, self._layout, tuple(self._shape), device)

    def full_tensor(self, *, grad_placements: PlacementsOrSpec | None = None) -> torch.Tensor:
        """The global value on every device (Partial axes reduced). Differentiable.

        ``grad_placements`` (Replicate or Partial per mesh axis, or an ``fd.P``) is the layout
        of the gradient that will flow into the full tensor, as DTensor: with ``[fd.Partial()]``
        every rank's gradient is a partial one, summed (reduce-scattered back to a Shard value).
        On the simulated backend the one global gradient stands for every device's: with a
        Partial axis it counts once per device of that axis, as the same program's gradients
        summed over the ranks of the distributed backend. Default: the gradient is the same on
        every device.
        """
        shape = tuple(self._shape)
        if not self._storage.is_meta:  # a meta value's global value moves nothing
            backend_of(self._layout.mesh).count_gather(self._layout, shape, self._storage.element_size())
        if grad_placements is None:
            return _unaliased(gather_storage(self._storage, self._layout, shape), self._storage)
        mesh = self.device_mesh
        replicated = Layout(mesh, (Replicate(),) * mesh.ndim)
        grad = self._grad_layout(grad_placements, "fd.DTensor.full_tensor", expected=replicated)
        out = autograd.apply(_FullTensorWithGrad, self._storage, self._layout, grad, shape)
        return _unaliased(out, self._storage)

    def _grad_layout(
        self,
        grad_placements: PlacementsOrSpec,
        api: str,
        *,
        expected: Layout,
        argument: str = "grad_placements",
    ) -> Layout:
        """The normalized layout of ``grad_placements`` given to ``api`` (as ``argument``): one
        whose Partial axes sum, equal to ``expected`` once they read as Replicate."""
        where = f"{api}({argument})"
        grad = layout_for(self.device_mesh, grad_placements, self.ndim, api, argument=argument)
        for name, placement in zip(grad.mesh.axis_names, grad.placements):
            if placement.is_partial() and placement.op != "sum":
                raise LayoutError(
                    explain(
                        f"{where} on mesh axis {name!r}",
                        f"a gradient's partial parts are summed, it cannot be Partial({placement.op!r})",
                        expected="fd.Partial() (sum), Replicate, or the value's own Shard",
                        got=str(placement),
                        fix="use fd.Partial()",
                    )
                )
        if without_partial(grad) != expected:
            wanted = ", ".join(map(str, expected.placements))
            raise LayoutError(
                explain(
                    where,
                    "the gradient is laid out as the tensor returned: it may differ from "
                    "that layout only by Partial for Replicate",
                    expected=f"{wanted} (a Replicate may be Partial)",
                    got=", ".join(map(str, grad.placements)),
                    fix=f"start from {wanted}; make Partial the axes whose gradients are partial",
                )
            )
        return grad

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={tuple(self._shape)}, dtype={self.dtype}, "
            f"sharding={self._layout} on {self.device_mesh!r})"
        )

    def __len__(self) -> int:
        return self._shape[0]


def _unaliased(out: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
    """``out``, copied where it shares memory with ``storage`` (a replicated value's global
    value is its stored block; an even split's, a view of its blocks): the caller may change
    the tensor it is given, never the value."""
    if torch.compiler.is_compiling() or is_transformed(out) or out.is_meta:
        return out  # functional there: nothing changes a tensor in place
    if out.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr():
        return out.clone()
    return out


def with_grad_layout(
    x: DTensor, grad_placements: PlacementsOrSpec, api: str, *, argument: str = "grad_placements"
) -> DTensor:
    """``x``, whose gradient comes in ``grad_placements`` (given to ``api`` as ``argument``):
    the backward converts it to ``x``'s layout, as :meth:`DTensor.to_local` does."""
    target = without_partial(x._layout)
    grad = x._grad_layout(grad_placements, api, expected=target, argument=argument)
    if grad == target:
        return x
    storage = autograd.apply(_GradLayout, x._storage, grad, target, tuple(x._shape))
    return DTensor(storage, x._layout, x._shape)


def storage_of(x: DTensor) -> torch.Tensor:
    """The backend's storage of ``x`` (for the transformations above this module)."""
    return x._storage


#: ``parts_of(x)``: ``x``'s storage, layout and global shape, in one C call (the global ops'
#: hot path)
parts_of = operator.attrgetter("_storage", "_layout", "_shape")


def new_value(storage: torch.Tensor, layout: Layout, shape: torch.Size) -> DTensor:
    """A value from checked parts (``shape`` a ``torch.Size``): the global ops' hot path."""
    value = object.__new__(DTensor)
    object.__setattr__(value, "_storage", storage)
    object.__setattr__(value, "_layout", layout)
    object.__setattr__(value, "_shape", shape)
    return value


def new_value_eager(storage: torch.Tensor, layout: Layout, shape: torch.Size) -> DTensor:
    """:func:`new_value` through the slots' own setters: faster, for eager code only (Dynamo
    does not trace a slot's setter)."""
    value = _new_object(DTensor)
    _set_storage(value, storage)
    _set_layout(value, layout)
    _set_shape(value, shape)
    return value


_new_object = object.__new__
_set_storage = DTensor._storage.__set__
_set_layout = DTensor._layout.__set__
_set_shape = DTensor._shape.__set__


def distribute_storage(tensor: torch.Tensor, layout: Layout, *, copy: bool = False) -> torch.Tensor:
    """The storage of the global ``tensor``, differentiably (``copy``: sharing no memory with
    it). Where storage and value are views of each other, their own backward reassembles the
    cotangent; every other case goes through :class:`_Distribute`."""
    backend = backend_of(layout.mesh)
    if backend.splits_as_views(layout, tuple(tensor.shape)):
        return backend.distribute(tensor, layout, copy=copy)
    return autograd.apply(_Distribute, tensor, layout, copy, without_partial(layout))


def gather_storage(storage: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """The global value of ``storage``, differentiably (the inverse of :func:`distribute_storage`)."""
    backend = backend_of(layout.mesh)
    if backend.splits_as_views(layout, shape):
        return backend.gather(storage, layout, shape)
    return autograd.apply(_FullTensor, storage, layout, shape, without_partial(layout))


@cached(1024)
def without_partial(layout: Layout) -> Layout:
    """``layout`` with its Partial axes Replicate: the layout of a gradient (as DTensor)."""
    if not layout.has_partial:
        return layout
    return Layout(
        layout.mesh,
        tuple([Replicate() if p.is_partial() else p for p in layout.placements]),
        layout.shard_order,
    )


@autograd.compilable
class _Distribute(torch.autograd.Function):
    """Global tensor -> storage. The gradient of a global value is global: its cotangent is the
    same on every replica (and every Partial part), so the backward reassembles the global
    cotangent from one replica of each shard, read in layout ``back`` (DTensor: a Partial
    source gets a Replicate gradient). That backward's own backward is this forward again
    (each is the other's transpose, to every order)."""

    @staticmethod
    def forward(tensor, layout, copy, back):
        return backend_of(layout.mesh).distribute(tensor, layout, copy=copy)

    @staticmethod
    def vmap(info, in_dims, tensor, layout, copy, back):
        # a mapped batch becomes one more trailing dim of the value, whole on every device
        return autograd.apply(_Distribute, tensor.movedim(in_dims[0], -1), layout, copy, back), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.shape, ctx.copy, ctx.back = inputs[1], tuple(inputs[0].shape), inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_FullTensor, g, ctx.back, ctx.shape, ctx.layout), None, None, None

    @staticmethod
    def jvp(ctx, t, _layout, _copy, _back):
        return autograd.apply(_Distribute, t, ctx.layout, ctx.copy, ctx.back)


@autograd.compilable
class _FullTensor(torch.autograd.Function):
    """Storage -> global tensor. Backward: every device gets its block of the (replicated)
    global cotangent, laid out by ``back``, with no communication; its own backward is this
    forward again."""

    @staticmethod
    def forward(storage, layout, shape, back):
        return backend_of(layout.mesh).gather(storage, layout, shape)

    @staticmethod
    def vmap(info, in_dims, storage, layout, shape, back):
        moved = storage.movedim(in_dims[0], -1)
        return autograd.apply(_FullTensor, moved, layout, (*shape, moved.shape[-1]), back), -1

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.shape, ctx.back = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_Distribute, g, ctx.back, False, ctx.layout), None, None, None

    @staticmethod
    def jvp(ctx, t, _layout, _shape, _back):
        return autograd.apply(_FullTensor, t, ctx.layout, ctx.shape, ctx.back)


@autograd.compilable
class _GradLayout(torch.autograd.Function):
    """Storage -> the same storage, whose cotangent comes in ``grad`` layout: the backward
    redistributes it to ``target`` (the value's layout, Partial read as Replicate) through
    the installed :meth:`DTensor.redistribute`."""

    @staticmethod
    def forward(storage, grad, target, shape):
        return storage.view_as(storage)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.grad, ctx.target, ctx.shape = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        return _relayout(g, ctx.grad, ctx.target, ctx.shape), None, None, None

    @staticmethod
    def jvp(ctx, t, _grad, _target, _shape):
        return t.view_as(t)


@autograd.compilable
class _FullTensorWithGrad(torch.autograd.Function):
    """Storage -> global tensor, whose cotangent is every device's gradient in ``grad`` layout
    (Replicate or Partial on every axis): each device holds the global cotangent, which the
    backward redistributes to the value's layout (Partial read as Replicate)."""

    @staticmethod
    def forward(storage, layout, grad, shape):
        return backend_of(layout.mesh).gather(storage, layout, shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout, ctx.grad, ctx.shape = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        held = backend_of(ctx.grad.mesh).distribute(g, without_partial(ctx.grad), copy=False)
        return _relayout(held, ctx.grad, without_partial(ctx.layout), ctx.shape), None, None, None

    @staticmethod
    def jvp(ctx, t, _layout, _grad, _shape):
        return autograd.apply(_FullTensor, t, ctx.layout, ctx.shape, without_partial(ctx.layout))


def _relayout(storage: torch.Tensor, source: Layout, target: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """``storage`` read in ``source`` layout, redistributed to ``target``."""
    return storage_of(DTensor(storage, source, shape).redistribute(target))


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


def check_partial_dtype(layout: Layout, dtype: torch.dtype, where: str) -> None:
    """A Partial reduction must be defined on the dtype: complex values have no order (no
    ``max``/``min``), and the average of bools is no bool."""
    for placement in layout.placements:
        if not isinstance(placement, Partial):
            continue
        op = placement.op
        if (dtype.is_complex and op in ("max", "min")) or (dtype == torch.bool and op == "avg"):
            kind = "complex values have no order" if dtype.is_complex else "an average of bools is no bool"
            raise LayoutError(
                explain(
                    where,
                    f"Partial({op!r}) does not reduce {dtype} values ({kind})",
                    expected="Partial('sum') or Partial('avg') for complex values, "
                    "Partial('sum'|'max'|'min') for bool",
                    got=f"Partial({op!r}) for a {dtype} value",
                    fix="convert the value first (x.real, x.abs(), x.to(torch.int64)), or choose another "
                    "reduction",
                )
            )


def layout_for(
    mesh, placements: PlacementsOrSpec, ndim: int, api: str, *, argument: str = "placements"
) -> Layout:
    """The normalized layout that ``api`` was given (as ``argument``) for an ``ndim``-d tensor
    on ``mesh``."""
    mesh = check_mesh(mesh, f"{api}(device_mesh)")
    if isinstance(placements, P) and len(placements) > ndim:
        raise LayoutError(
            explain(
                f"{api}({argument})",
                "the spec has more entries than the tensor has dims",
                expected=f"at most {ndim} entries, one per dim",
                got=f"{placements!r} ({len(placements)} entries) for a {ndim}-d tensor",
                fix="drop the extra entries, or reshape the tensor first",
            )
        )
    layout = as_layout(mesh, placements, where=f"{api}({argument})")
    return layout.normalized(ndim, where=api)


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


# what a saved value holds, loadable with torch.load(weights_only=True)
torch.serialization.add_safe_globals([DTensor, DeviceMesh, Layout, P, Shard, Replicate, Partial])

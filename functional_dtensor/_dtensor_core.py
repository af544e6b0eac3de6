"""The ``DTensor`` class: a layout, a global shape and the backend's storage (see
:mod:`._dtensor`); its properties, its shards and global value (differentiable, with
``grad_placements``), saving and loading; and, for the modules above, the accessors of its
parts (:func:`storage_of`, :func:`parts_of`, :func:`new_value`) and :func:`with_grad_layout`."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from . import _autograd as autograd
from ._backend import backend_of, is_transformed
from ._errors import ImmutableError, InputTypeError, LayoutError, explain
from ._global_storage import FullTensor, gather_storage, without_partial
from ._layout import Layout, PlacementsOrSpec
from ._layout_checks import layout_for
from ._mesh import DeviceMesh
from ._placements import Partial, Placement, Replicate, Shard
from ._public import public
from ._spec import P

__all__ = [
    "DTensor",
    "with_grad_layout",
    "storage_of",
    "parts_of",
    "new_value",
    "new_value_eager",
    "new_held",
    "held_of",
    "data_of",
    "global_value",
    "held_varied",
]


@public
class DTensor:
    """A global tensor laid out on a device mesh. Build one with :func:`distribute_tensor`,
    :func:`from_local`, a factory such as :func:`zeros`, or as the output of
    :func:`shard_map`."""

    # ``_held``: on a simulated mesh, the blocks of a value held once along its Replicate axes
    # (see ._simulated.storage), else None; ``_storage`` is then None until made from them,
    # when first read (storage_of). ``_varied``: the axes such a value is varied over (see
    # ._varied)
    __slots__ = ("_layout", "_shape", "_storage", "_held", "_varied")

    _layout: Layout
    _shape: torch.Size
    _storage: torch.Tensor
    _held: torch.Tensor | None
    _varied: frozenset

    def __init__(self, storage: torch.Tensor, layout: Layout, shape: Sequence[int]) -> None:
        """Internal: use :func:`distribute_tensor` or :func:`from_local`."""
        object.__setattr__(self, "_storage", storage)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_shape", torch.Size(shape))
        object.__setattr__(self, "_held", None)

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
        if is_transformed(storage_of(self)) or torch.compiler.is_compiling():
            raise InputTypeError(
                explain(
                    "fd.DTensor (saving)",
                    "a value inside a torch.func transform or torch.compile exists only while it runs",
                    expected="a value outside every transform",
                    got=repr(self),
                    fix="save the value the transformed function returns, outside the transform",
                )
            )
        storage, device = backend_of(self.device_mesh).saved(storage_of(self), self._layout)
        return {
            "layout": self._layout,
            "shape": tuple(self._shape),
            "storage": storage,
            "requires_grad": self._data.requires_grad,
            "device": device,
        }

    def __setstate__(self, state: dict) -> None:
        layout, shape = state["layout"], tuple(state["shape"])
        storage = backend_of(layout.mesh).restored(state["storage"], layout, shape, state["device"])
        object.__setattr__(self, "_storage", storage.requires_grad_(state["requires_grad"]))
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_shape", torch.Size(shape))
        object.__setattr__(self, "_held", None)

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
        return self._data.dtype

    @property
    def requires_grad(self) -> bool:
        return self._data.requires_grad

    @property
    def _data(self) -> torch.Tensor:
        """A tensor of the value's dtype, device and autograd state: the held blocks or the
        storage."""
        held = self._held
        return self._storage if held is None else held

    @property
    def is_meta(self) -> bool:
        """Whether this is a meta value: shapes, dtype and layout, with no memory (factories
        with ``device="meta"``); its shards, global value and redistributions are meta too."""
        return self._data.is_meta

    @property
    def grad(self) -> DTensor | None:
        """The gradient accumulated on this value's storage by ``backward()``, laid out like the
        value (Partial axes as Replicate), or ``None``. Storage is a leaf when the value was
        made by a factory with ``requires_grad=True`` or loaded with it; a value made from
        tensors (:func:`distribute_tensor`, :func:`from_local`) passes gradients to them."""
        grad = self._data.grad
        if grad is not None and self._held is not None:  # the gradient of the blocks held once
            grad = backend_of(self._layout.mesh).unfold(grad, self._layout)
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
        return backend_of(self.device_mesh).shards(storage_of(self), self._layout, tuple(self._shape))

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
        return backend_of(self.device_mesh).shard(storage_of(value), self._layout, tuple(self._shape), device)

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
        if grad_placements is None:
            return _unaliased(global_value(self), storage_of(self))
        shape = _gathered_shape(self)
        mesh = self.device_mesh
        replicated = Layout(mesh, (Replicate(),) * mesh.ndim)
        grad = self._grad_layout(grad_placements, "fd.DTensor.full_tensor", expected=replicated)
        out = autograd.apply(_FullTensorWithGrad, storage_of(self), self._layout, grad, shape)
        return _unaliased(out, storage_of(self))

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


def global_value(x: DTensor) -> torch.Tensor:
    """``x``'s global value, differentiably, counted as a gather: for a computation that only
    reads it (autograd starting from it). It may share memory with ``x``'s storage, which
    :meth:`DTensor.full_tensor` copies for a caller who may write into what it is given."""
    return gather_storage(storage_of(x), x._layout, _gathered_shape(x))


def _gathered_shape(x: DTensor) -> tuple[int, ...]:
    """``x``'s global shape, its gather to the global value recorded (a meta value's moves
    nothing)."""
    shape = tuple(x._shape)
    if not storage_of(x).is_meta:
        backend_of(x._layout.mesh).count_gather(x._layout, shape, storage_of(x).element_size())
    return shape


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
    storage = autograd.apply(_GradLayout, storage_of(x), grad, target, tuple(x._shape))
    return DTensor(storage, x._layout, x._shape)


def storage_of(x: DTensor) -> torch.Tensor:
    """The backend's storage of ``x`` (for the transformations above this module); that of a
    value held once is made from its blocks when first read, and kept (in a compiled graph,
    made at each read)."""
    if x._held is None:
        return x._storage
    if torch.compiler.is_compiling():  # (made in the graph: what eager code kept is no guard)
        return _made_from_blocks(x)
    storage = x._storage
    return _made_from_blocks(x) if storage is None else storage


def _made_from_blocks(x: DTensor) -> torch.Tensor:
    layout, varied = x._layout, x._varied
    summed = tuple([a for a, name in enumerate(layout.mesh.axis_names) if name in varied])
    held = x._held
    storage = backend_of(layout.mesh).unfold(held, layout, summed)
    # kept, but not where made outside autograd from blocks that need a gradient: a later
    # differentiated use must reach the blocks (and a compiled graph makes it again)
    if not torch.compiler.is_compiling() and (torch.is_grad_enabled() or not held.requires_grad):
        object.__setattr__(x, "_storage", storage)
    return storage


#: ``parts_of(x)``: ``x``'s storage, layout and global shape, in one C call (the global ops'
#: hot path)
parts_of = operator.attrgetter("_storage", "_layout", "_shape")


def new_value(storage: torch.Tensor, layout: Layout, shape: torch.Size) -> DTensor:
    """A value from checked parts (``shape`` a ``torch.Size``): the global ops' hot path."""
    value = object.__new__(DTensor)
    object.__setattr__(value, "_storage", storage)
    object.__setattr__(value, "_layout", layout)
    object.__setattr__(value, "_shape", shape)
    object.__setattr__(value, "_held", None)
    return value


def new_held(
    held: torch.Tensor, layout: Layout, shape: torch.Size, varied: frozenset = frozenset()
) -> DTensor:
    """A value from its blocks held once (see :meth:`.Backend.held_plan`), varied over the
    axes named in ``varied`` (see :mod:`._varied`: its held cotangent is the sum of the
    devices' parts there); its storage is made when first read."""
    value = object.__new__(DTensor)
    object.__setattr__(value, "_storage", None)
    object.__setattr__(value, "_held", held)
    object.__setattr__(value, "_varied", varied)
    object.__setattr__(value, "_layout", layout)
    object.__setattr__(value, "_shape", shape)
    return value


def held_varied(x: DTensor) -> frozenset:
    """The axes a value held once is varied over."""
    return x._varied


def held_of(x: DTensor) -> torch.Tensor | None:
    """``x``'s blocks held once, or None (for the global ops and redistribute)."""
    return x._held


def data_of(x: DTensor) -> torch.Tensor:
    """A tensor of ``x``'s dtype, device and autograd state, made for nothing: its blocks held
    once, or its storage."""
    return x._data


def new_value_eager(storage: torch.Tensor, layout: Layout, shape: torch.Size) -> DTensor:
    """:func:`new_value` through the slots' own setters: faster, for eager code only (Dynamo
    does not trace a slot's setter)."""
    value = _new_object(DTensor)
    _set_storage(value, storage)
    _set_layout(value, layout)
    _set_shape(value, shape)
    _set_held(value, None)
    return value


_new_object = object.__new__
_set_storage = DTensor._storage.__set__
_set_layout = DTensor._layout.__set__
_set_shape = DTensor._shape.__set__
_set_held = DTensor._held.__set__


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
        return autograd.apply(FullTensor, t, ctx.layout, ctx.shape, without_partial(ctx.layout))


def _relayout(storage: torch.Tensor, source: Layout, target: Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """``storage`` read in ``source`` layout, redistributed to ``target``."""
    return storage_of(DTensor(storage, source, shape).redistribute(target))


# what a saved value holds, loadable with torch.load(weights_only=True)
torch.serialization.add_safe_globals([DTensor, DeviceMesh, Layout, P, Shard, Replicate, Partial])

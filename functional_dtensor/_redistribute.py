"""``redistribute``: the same global value in another layout, by the planned steps.

The planner (:mod:`._plan`) picks the steps; this module only runs them, on the
simulated backend's stacked shards or on this rank's shard. The whole change is one autograd
node: its backward redistributes the cotangent back to the source layout (Partial axes as
Replicate, as DTensor), itself differentiable; forward mode redistributes the tangent as the
value.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> rows = fd.distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, fd.P("x"))
>>> cols = fd.redistribute(rows, fd.P(None, "x"))
>>> cols.to_local(device=1).flatten().tolist()
[1.0, 5.0, 9.0, 13.0]
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from . import _autograd as autograd
from . import _blocks as blocks
from . import _log as log
from . import _varied as varied
from ._backend import backend_of
from ._cache import Bounded, Numbered, cached
from ._dtensor import (
    DTensor,
    check_partial_dtype,
    data_of,
    held_of,
    layout_for,
    new_held,
    storage_of,
    without_partial,
)
from ._errors import InputTypeError, MeshError, explain
from ._functorch import is_transformed
from ._layout import Layout, PlacementsOrSpec
from ._mesh import DeviceMesh
from ._placements import Partial, Replicate, Shard
from ._plan import (
    AllGather,
    AllReduce,
    AllToAll,
    Partition,
    Permute,
    ReduceBroadcast,
    ReduceScatter,
    Regather,
    Relabel,
    Slice,
    Step,
    Swap,
    permutation_pairs,
    plan,
    step_bytes,
)
from ._sharding import shard_table

__all__ = [
    "redistribute",
    "gather_varied",
    "held_move",
    "HeldAllGather",
    "HeldAllReduce",
    "layout_key",
    "layout_of_key",
]


def redistribute(x: DTensor, placements: PlacementsOrSpec, /) -> DTensor:
    """``x`` laid out by ``placements`` (one per mesh axis, or an ``fd.P``), moved by the
    cheapest planned collectives (see :func:`explain_redistribute`). Pure and differentiable:
    the gradient comes back in the source layout (a Partial source gets a Replicate gradient,
    as DTensor)."""
    if not isinstance(x, DTensor):
        raise InputTypeError(
            explain(
                "fd.redistribute(x)",
                "redistribute changes the layout of a distributed value",
                expected="an fd.DTensor",
                got=type(x).__name__,
                fix="lay a tensor out with fd.distribute_tensor(t, mesh, placements)",
            )
        )
    target = layout_for(x.device_mesh, placements, x.ndim, "fd.redistribute")
    if target == x.sharding:
        return x
    if target.has_partial:
        check_partial_dtype(target, x.dtype, "fd.redistribute(placements)")
    axes = varied.axes_of_value(x)
    # a data-parallel parameter in a sharded forward (see ._varied): it stays varied where its
    # axes keep their placements, and is made invariant first where they change
    mesh = x.device_mesh
    if any(a != b and n in axes for n, a, b in zip(mesh.axis_names, x.placements, target.placements)):
        return redistribute(varied.invariant_value(x), target)
    held = _held_moved(x, target, axes)
    if held is not None:
        return held
    out = _moved(x, target)
    if axes:
        varied.mark(storage_of(out), axes)
    return out


def _moved(x: DTensor, target: Layout) -> DTensor:
    """``x`` in ``target`` by the planned steps, one autograd node whose backward moves the
    cotangent back."""
    storage, shape = storage_of(x), tuple(x.shape)
    back_source, back_target, same = _back(x.sharding, target)
    steps = _steps(x.sharding, target, shape, storage)
    back = (back_source, back_target, () if same else _steps(back_source, back_target, shape, storage, True))
    storage = autograd.apply(_Redistribute, storage, x.sharding, target, shape, steps, back)
    return DTensor(storage, target, x.shape)


def _held_moved(x: DTensor, target: Layout, axes: frozenset = frozenset()) -> DTensor | None:
    """On a simulated mesh, ``x`` in ``target`` held once along its Replicate axes (see
    :meth:`.Backend.held_plan`), where one all-reduce (a sum: a mean's parts take the whole
    cotangent, as a Partial value's, not its share) or one all-gather over one axis of even
    blocks moves it, and its blocks are large (:func:`held_move`): each distinct result
    computed and written once, not once per device. The gradients are the transposes, counted
    as the distributed backend's communicate (:class:`HeldAllReduce`, :class:`HeldAllGather`).
    The result is varied over ``axes`` (see :mod:`._varied`). None where it does not apply."""
    mesh = target.mesh
    data, source, shape = data_of(x), x.sharding, x.shape
    integral = not (data.is_floating_point() or data.is_complex())
    threshold = backend_of(mesh).held_min_elements
    compiling = torch.compiler.is_compiling()
    if compiling:
        move = _traced_held_move(source, target, tuple(shape), data.element_size(), integral, threshold)
    else:
        move = held_move(source, target, tuple(shape), data.element_size(), integral, threshold)
    # (no transform's check while compiling: Dynamo traces no functorch wrapper)
    if move is None or data.is_meta or not compiling and is_transformed(data):
        return None
    if not compiling and log.plans.isEnabledFor(logging.INFO):  # as _moved logs them
        back_source, back_target, same = _back(source, target)
        _steps(source, target, tuple(shape), data)
        if not same:
            _steps(back_source, back_target, tuple(shape), data, True)
    reduce, names, dim, source_plan, grid = move
    held = held_of(x)
    if held is None:
        held = storage_of(x)
        if source_plan is not None:
            summed = tuple([a for a in source_plan.axes if mesh.axis_names[a] in axes])
            held = backend_of(mesh).fold(held, source, source_plan, summed)
    if reduce:
        out = autograd.apply(HeldAllReduce, held, grid, mesh, names, False, True)
    else:
        out = autograd.apply(HeldAllGather, held, grid, mesh, names, dim, names[0] in axes, False, True)
    return new_held(varied.mark(out, axes), target, shape, frozenset(axes))


@cached(1024)
def held_move(
    source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int, integral: bool, _threshold
):
    """The one step that moves a value from ``source`` to ``target`` held once, the plan of
    the source's held blocks and their grid; None where :func:`_held_moved` does not apply
    (``_threshold``: the current :meth:`.Backend.holds`, which decides with it)."""
    backend = backend_of(target.mesh)
    if backend.held_plan(target) is None or not backend.holds(target, shape):
        return None
    steps = _eager_steps(source, target, shape, itemsize, integral)
    if len(steps) != 1:
        return None
    (step,) = steps
    if isinstance(step, AllReduce):
        if step.op != "sum" or integral:
            return None
    elif not (
        isinstance(step, AllGather)
        and len(step.axes) == 1
        and shard_table(source, shape).is_even
        and shard_table(target, shape).is_even
    ):
        return None
    source_plan = backend.held_plan(source)
    reduce = isinstance(step, AllReduce)
    dim = None if reduce else source.placements[step.axes[0]].dim
    return (
        reduce,
        step.names,
        dim,
        source_plan,
        source.mesh.shape if source_plan is None else source_plan.grid,
    )


def _traced_held_move(source: Layout, target: Layout, shape: tuple, itemsize: int, integral: bool, threshold):
    """:func:`held_move` while Dynamo traces: decided outside the graph, as the plans are
    (:func:`_held_move_key`), the source's plan made again in the graph."""
    move = _held_move_key(layout_key(source), layout_key(target), shape, itemsize, integral, threshold)
    if move is None:
        return None
    reduce, names, dim, planned, grid = move
    return reduce, names, dim, backend_of(target.mesh).held_plan(source) if planned else None, grid


@torch._dynamo.assume_constant_result
def _held_move_key(source_key: tuple, target_key: tuple, shape, itemsize: int, integral: bool, threshold):
    """:func:`held_move` as constants: whether the source has a plan, not the plan."""
    move = held_move(
        layout_of_key(source_key), layout_of_key(target_key), shape, itemsize, integral, threshold
    )
    return None if move is None else (*move[:3], move[3] is not None, move[4])


# The held moves, as autograd functions: each, forward or transposed, is the other's
# derivative, to every order, and counts what the distributed backend's redistribute and its
# transposes communicate.


@autograd.compilable
class HeldAllReduce(torch.autograd.Function):
    """A Partial sum made Replicate on held blocks, or (``transposed``) its transpose: the whole
    cotangent for every part, with no communication, as the distributed backend's. ``moved``
    False: the blocks are summed already (a product written summed, ``reduced_linear``),
    counted the same and left as they are. Backward: the other one."""

    @staticmethod
    def forward(held, grid, mesh, names, transposed, moved):
        backend = backend_of(mesh)
        if not moved:
            backend.count_reduced(held, mesh, names, transposed)
            return held.view_as(held)
        return (backend.spread_held if transposed else backend.all_reduce_held)(held, grid, mesh, names)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        grid, mesh, names, transposed, moved = ctx.args
        back = autograd.apply(HeldAllReduce, g, grid, mesh, names, not transposed, moved)
        return back, None, None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return autograd.apply(HeldAllReduce, t, *ctx.args)


@autograd.compilable
class HeldAllGather(torch.autograd.Function):
    """Shards made Replicate over one axis on held blocks, or (``transposed``) its transpose:
    each device's slice (``summed``, of a varied value, counted as the reduce-scatter of the
    parts the distributed backend runs). ``moved`` False: the blocks are gathered already (a
    product written gathered, :mod:`._gathered_linear`), counted the same and left as they are.
    Backward: the other one."""

    @staticmethod
    def forward(held, grid, mesh, names, dim, summed, transposed, moved):
        backend = backend_of(mesh)
        if not moved:
            backend.count_gathered(held, mesh, names, summed, transposed)
            return held.view_as(held)
        if transposed:
            return backend.slice_held(held, grid, mesh, names, dim, summed)
        return backend.all_gather_held(held, grid, mesh, names, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        *args, transposed, moved = ctx.args
        back = autograd.apply(HeldAllGather, g, *args, not transposed, moved)
        return back, None, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return autograd.apply(HeldAllGather, t, *ctx.args)


def gather_varied(x: DTensor, placements: PlacementsOrSpec, axes: tuple[str, ...]) -> DTensor:
    """``x`` gathered to ``placements`` over the mesh ``axes`` (where it is sharded), varied
    over them (see :mod:`._varied`): the gradient comes back as each device's part and the
    backward sums the parts into ``x``'s shards, a reduce-scatter. For a fully-sharded
    parameter in a sharded forward."""
    mesh = x.device_mesh
    target = layout_for(mesh, placements, x.ndim, "fd.redistribute")
    held = _held_moved(x, target, frozenset([*axes, *varied.axes_of_value(x)]))
    if held is not None:
        return held
    storage, shape = storage_of(x), tuple(x.shape)
    parts = Layout(
        mesh,
        tuple(Partial() if name in axes else p for name, p in zip(mesh.axis_names, target.placements)),
        target.shard_order,
    )
    source = without_partial(x.sharding)
    back = (parts, source, _steps(parts, source, shape, storage, True))
    out = autograd.apply(
        _Redistribute, storage, x.sharding, target, shape, _steps(x.sharding, target, shape, storage), back
    )
    return DTensor(varied.mark(out, {*axes, *varied.axes_of(storage)}), target, x.shape)


def _steps(
    source: Layout, target: Layout, shape: tuple[int, ...], storage: torch.Tensor, gradient: bool = False
) -> tuple[Step, ...]:
    """The planned steps from ``source`` to ``target``, found outside any compiled graph (the
    planner is not traced: under ``torch.compile`` it runs eagerly from keys, and the graph
    rebuilds the steps from constants). ``gradient``: a cotangent's way back (for the log)."""
    integral = not (storage.is_floating_point() or storage.is_complex())
    if not torch.compiler.is_compiling():
        steps = _eager_steps(source, target, shape, storage.element_size(), integral)
        if log.plans.isEnabledFor(logging.INFO):
            _log_plan((source, target, shape, storage.element_size(), integral), steps, gradient)
        return steps
    keys = _plan_key(layout_key(source), layout_key(target), shape, storage.element_size(), integral)
    return tuple(
        [
            _STEP_KINDS[kind](layout_of_key(a), layout_of_key(b), axes, *extra)
            for kind, a, b, axes, extra in keys
        ]
    )


def _redistribute_method(self: DTensor, *args, device_mesh=None, placements=None) -> DTensor:
    """This value in another layout: :func:`fd.redistribute(self, placements) <redistribute>`.
    Torch DTensor's form, ``x.redistribute(device_mesh, placements)``, is taken too (the mesh
    must be the value's own)."""
    if args and isinstance(args[0], DeviceMesh):
        device_mesh, args = args[0], args[1:]
    if args:
        placements = args[0]
    if device_mesh is not None and device_mesh != self.device_mesh:
        raise MeshError(
            explain(
                "fd.DTensor.redistribute(device_mesh)",
                "redistribute changes the layout on the value's own mesh",
                expected=f"{self.device_mesh} (or no mesh)",
                got=repr(device_mesh),
                fix="to move a value to another mesh: fd.distribute_tensor(x.full_tensor(), mesh, ...)",
            )
        )
    return redistribute(self, placements)


DTensor.redistribute = _redistribute_method  # installed from above: _dtensor does not import this module


@autograd.compilable
class _Redistribute(torch.autograd.Function):
    """Storage in one layout -> storage in another. Backward: the cotangent, laid out like the
    result, redistributed to the source layout (Partial axes as Replicate)."""

    @staticmethod
    def forward(storage, source, target, shape, steps, back):
        if storage.is_meta:  # shapes only: nothing to move
            return backend_of(target.mesh).meta(target, shape, storage.dtype)
        for step in steps:
            storage = run(step, storage, shape)
        return storage

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.source, ctx.target, ctx.shape, ctx.steps, ctx.back = inputs

    @staticmethod
    def vmap(info, in_dims, storage, source, target, shape, steps, back):
        # a mapped batch becomes one more trailing dim of the value, whole on every device: the
        # value's shape changes, so the plans are made again for it
        moved = storage.movedim(in_dims[0], -1)
        return storage_of(redistribute(DTensor(moved, source, (*shape, moved.shape[-1])), target)), -1

    @staticmethod
    def backward(ctx, g):
        # the cotangent moves to the source (Partial as Replicate: a part's cotangent is the
        # whole cotangent); the move is itself a redistribute whose backward is this one's
        # forward (each the other's transpose, as JAX's psum and pvary, all_gather and
        # psum_scatter), so every order of differentiation holds. Where the forward only sums
        # parts (Partial -> Replicate), the move changes no storage but is still a node: its
        # transpose, in a second derivative, sums the devices' contributions
        source, target, steps = ctx.back
        again = (ctx.source, ctx.target, ctx.steps)
        return (
            autograd.apply(_Redistribute, g, source, target, ctx.shape, steps, again),
            None,
            None,
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx, t, _source, _target, _shape, _steps, _back):
        return autograd.apply(_Redistribute, t, ctx.source, ctx.target, ctx.shape, ctx.steps, ctx.back)


# Under torch.compile the planner is not traced: it runs eagerly, from primitive keys of the
# layouts, and the graph keeps the number of its plan here.
_PLANS = Numbered(4096, "redistribute: plans by number")
_STEP_KINDS = {
    kind.__name__: kind
    for kind in (
        AllGather,
        AllReduce,
        ReduceScatter,
        AllToAll,
        Swap,
        Permute,
        ReduceBroadcast,
        Slice,
        Partition,
        Relabel,
        Regather,
    )
}


def _back(source: Layout, target: Layout) -> tuple[Layout, Layout, bool]:
    """The layouts the cotangent of a redistribute moves between (Partial axes as Replicate),
    and whether they are one: decided eagerly, outside a compiled graph."""
    if torch.compiler.is_compiling():
        back_source, back_target, same = _reverse_key(layout_key(source), layout_key(target))
        return layout_of_key(back_source), layout_of_key(back_target), same
    return _reverse(source, target)


@cached(1024)
def _reverse(source: Layout, target: Layout) -> tuple[Layout, Layout, bool]:
    back_source, back_target = without_partial(target), without_partial(source)
    return back_source, back_target, back_source == back_target


@torch._dynamo.assume_constant_result
def _reverse_key(source_key: tuple, target_key: tuple) -> tuple:
    back_source, back_target, same = _reverse(layout_of_key(source_key), layout_of_key(target_key))
    return layout_key(back_source), layout_key(back_target), same


@torch._dynamo.assume_constant_result
def _plan_key(source_key: tuple, target_key: tuple, shape: tuple, itemsize: int, integral: bool) -> tuple:
    """A plan as constants: per step its kind, its layouts' keys, its axes and other fields."""
    steps = _PLANS[_plan_index(source_key, target_key, shape, itemsize, integral)]
    if log.compiling.isEnabledFor(logging.INFO):
        source, target = layout_of_key(source_key), layout_of_key(target_key)
        log.compiling.info(
            "redistribute %s -> %s on %s planned outside the graph: %s",
            source,
            target,
            shape,
            ", ".join(str(s) for s in steps) or "no steps",
        )
    return tuple(
        [
            (
                type(step).__name__,
                layout_key(step.source),
                layout_key(step.target),
                step.axes,
                tuple([getattr(step, f.name) for f in dataclasses.fields(step)[3:]]),
            )
            for step in steps
        ]
    )


def layout_key(layout: Layout) -> tuple:
    """A layout as nested tuples of primitives (what Dynamo takes as a constant)."""
    mesh = layout.mesh
    placements = tuple(
        [
            ("S", p.dim) if isinstance(p, Shard) else ("P", p.op) if isinstance(p, Partial) else ("R",)
            for p in layout.placements
        ]
    )
    mesh_key = (mesh.shape, mesh.axis_names, mesh.device_type, mesh.backend, mesh.device_ids)
    return (mesh_key, placements, layout.shard_order)


def layout_of_key(key: tuple) -> Layout:
    """The layout of :func:`layout_key`'s tuples."""
    (shape, names, device_type, backend, ids), placements, shard_order = key
    rebuilt = [
        Shard(v[1]) if v[0] == "S" else Partial(v[1]) if v[0] == "P" else Replicate() for v in placements
    ]
    return Layout(DeviceMesh(shape, names, device_type, backend, ids), tuple(rebuilt), shard_order)


@torch._dynamo.assume_constant_result
def _plan_index(
    source_key: tuple, target_key: tuple, shape: tuple[int, ...], itemsize: int, integral: bool
) -> int:
    steps = plan(layout_of_key(source_key), layout_of_key(target_key), shape, itemsize, integral)
    return _PLANS.number(steps, lambda: steps)


@cached(4096)
def _eager_steps(source: Layout, target: Layout, shape: tuple[int, ...], itemsize: int, integral: bool):
    """The planned steps, by the layouts themselves (a compiled graph finds them by number, from
    keys Dynamo can hold as constants: :func:`_plan_index`)."""
    return _PLANS[_plan_index(layout_key(source), layout_key(target), shape, itemsize, integral)]


_LOGGED_PLANS = Bounded(4096, "redistribute: plans logged")  # the plans logged: each once


def _log_plan(key: tuple, steps: tuple[Step, ...], gradient: bool) -> None:
    """``S(0)R -> RR on (8, 4): all_gather(x); 96 B per device`` (at DEBUG, a line per step),
    once per plan; ``gradient``: the plan of a cotangent's way back."""
    if (key, gradient) in _LOGGED_PLANS:
        return
    _LOGGED_PLANS[(key, gradient)] = True
    source, target, shape, itemsize, _ = key
    costs = [step_bytes(step, shape, itemsize) for step in steps]
    moved = sum(costs, 0)
    log.plans.info(
        "%s -> %s on %s%s: %s; %s",
        source,
        target,
        shape,
        " (the gradient's way back)" if gradient else "",
        ", ".join(str(step) for step in steps) or "no steps",
        f"{log.size(moved)} per device" if moved else "no communication",
    )
    if log.plans.isEnabledFor(logging.DEBUG):
        for i, (step, cost) in enumerate(zip(steps, costs), 1):
            log.plans.debug(
                "  step %d %s: %s -> %s, %s per device", i, step, step.source, step.target, log.size(cost)
            )


# --- the executor: one function per step ------------------------------------------------------


def run(step: Step, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Run one planned step on a storage (stacked shards, or this rank's shard)."""
    if getattr(step, "op", None) == "avg" and x.dtype in _NARROW_INTEGERS:
        # an integer average is summed in int64: a narrow dtype would wrap in the sum
        return _run(step, x.to(torch.int64), shape).to(x.dtype)
    return _run(step, x, shape)


_NARROW_INTEGERS = frozenset([torch.int8, torch.uint8, torch.int16, torch.int32, torch.uint16, torch.uint32])


def _run(step: Step, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    mesh = step.source.mesh
    backend = backend_of(mesh)
    names = step.names
    if isinstance(step, AllGather):
        if len(step.axes) == 1:  # the blocks of one axis, concatenated along the dim it splits
            return backend.all_gather(x, mesh, names, step.source.placements[step.axes[0]].dim, True)
        gathered = backend.all_gather(x, mesh, names, 0, False)  # (k, *local), k over names, major first
        return _merge_blocks(gathered, step, backend.block_dim(0))
    if isinstance(step, AllReduce):
        return backend.all_reduce(x, mesh, names, step.op)
    if isinstance(step, ReduceScatter):  # an uneven dim: padded to a multiple of the group
        padded = list(backend.padded(x, step.source, shape).shape)
        k, lead = step.group_size, len(padded) - len(shape)
        padded[lead + step.dim] = -(-padded[lead + step.dim] // k) * k
        x = blocks.pad(backend.padded(x, step.source, shape), tuple(padded))
        out = backend.reduce_scatter(x, mesh, names, step.dim, True)
        out = blocks.average(out, step.group_size) if step.op == "avg" else out
        return backend.unpadded(out, step.target, shape)
    if isinstance(step, AllToAll):
        return backend.all_to_all(x, mesh, names, step.split, step.concat, True)
    if isinstance(step, Swap):
        k = mesh.shape[step.axes[0]]
        pairs = tuple([(i * k + j, j * k + i) for i in range(k) for j in range(k)])  # the diagonal stays
        return backend.permute(x, mesh, names, pairs)
    if isinstance(step, Permute):
        return backend.permute(x, mesh, names, permutation_pairs(step.source, step.target))
    if isinstance(step, ReduceBroadcast):
        return backend.reduce_broadcast(x, mesh, *step.axes, step.op)
    if isinstance(step, Slice):
        return backend.slice(x, mesh, names, step.dim)
    if isinstance(step, Partition):
        return backend.partition(x, mesh, names, step.op)
    if isinstance(step, Relabel):
        return x
    return backend.regather(x, step.source, step.target, shape)


def _merge_blocks(gathered: torch.Tensor, step: AllGather, lead: int) -> torch.Tensor:
    """Gathered blocks ``(*lead, k, *local)`` -> the local block of the layout after the step:
    each gathered axis widens the dim it split (the innermost of it, in the dim's order)."""
    mesh = step.source.mesh
    sizes = [mesh.shape[a] for a in step.axes]
    local = list(gathered.shape[lead + 1 :])
    grid = gathered.reshape(*gathered.shape[:lead], *sizes, *local)
    order, shape = list(range(lead)), list(gathered.shape[:lead])
    first_local = lead + len(sizes)
    for dim in range(len(local)):
        parts = [i for i, a in enumerate(step.axes) if step.source.placements[a] == Shard(dim)]
        order += [lead + i for i in parts] + [first_local + dim]
        shape.append(local[dim] * math.prod([sizes[i] for i in parts]))
    return grid.permute(order).reshape(shape)

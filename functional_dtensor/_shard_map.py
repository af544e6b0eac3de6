"""``shard_map``: run a per-device function on the local blocks of global values (JAX semantics).

Specs are pytree prefixes of the arguments and outputs with :class:`P` leaves; ``None`` passes an
argument through untouched. The mesh's backend runs the function (see :mod:`._backend`): on the
simulated backend once for all devices, under a vmap over the stacked device dim; on the
distributed backend once per rank on the local shard.

Gradients treat global values as global: the cotangent of a replicated value is replicated.
With ``check_rep`` (the default) local values carry the mesh axes they vary over (see
:mod:`._tracking`); an output spec that claims replication the function does not guarantee is an
error, and transposes need no defensive all-reduce. Without it, every local value is taken to
vary over every axis: inputs' gradients are summed over their replicas, and outputs' cotangents
are split evenly among theirs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias, overload

import optree
import torch

from . import _autograd as autograd
from ._backend import backend_of
from ._collectives import AllReduce, VaryHeldOnce, on_storage, pvary
from ._context import Frame, bound_axes, current_frame
from ._dtensor import DTensor, check_mesh, distribute_storage, gather_storage, storage_of
from ._errors import FunctionalDTensorError, InputTypeError, MeshError, SpecError, explain
from ._layout import Layout
from ._mesh import DeviceMesh
from ._placements import Shard
from ._sharding import check_divisible, global_shape_of_even_local
from ._spec import P
from ._tracking import ReplicationTracker
from ._varying import axes_varying, tag

__all__ = ["shard_map", "NAMESPACE", "Specs"]

NAMESPACE = "functional_dtensor"
Specs: TypeAlias = Any  # a pytree of P (or None) leaves, a prefix of the arguments or outputs


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


@overload
def shard_map(
    f: None = None, /, *, mesh: DeviceMesh, in_specs: Specs, out_specs: Specs, check_rep: bool = True
) -> Callable[[Callable], Callable[..., Any]]: ...


@overload
def shard_map(
    f: Callable, /, *, mesh: DeviceMesh, in_specs: Specs, out_specs: Specs, check_rep: bool = True
) -> Callable[..., Any]: ...


def shard_map(f=None, /, *, mesh, in_specs, out_specs, check_rep=True):
    """Map ``f`` over the shards of its arguments on ``mesh``.

    ``f`` sees local blocks: an argument of global shape ``(8, 4)`` with spec ``P("x")`` on a
    mesh with ``x=4`` arrives as ``(2, 4)`` on every device. Its outputs are local blocks too,
    assembled by ``out_specs`` into :class:`DTensor` results. Sharded dims must split evenly.
    Usable as a decorator: ``@fd.shard_map(mesh=mesh, in_specs=..., out_specs=...)``.

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(4, "x")
    >>> @fd.shard_map(mesh=mesh, in_specs=(fd.P("x"), fd.P()), out_specs=fd.P("x"))
    ... def scale(x_rows, w):
    ...     return x_rows * w
    >>> scale(torch.ones(8, 2), torch.tensor([1.0, 2.0])).full_tensor()[0]
    tensor([1., 2.])
    """
    check_mesh(mesh, "fd.shard_map(mesh)")
    for name, specs in (("in_specs", in_specs), ("out_specs", out_specs)):
        for accessor, leaf in zip(*optree.tree_flatten_with_accessor(specs, _is_spec, none_is_leaf=True)[:2]):
            if not _is_spec(leaf):
                raise InputTypeError(
                    explain(
                        f"fd.shard_map({accessor.codify(name)})",
                        "spec leaves are partition specs",
                        expected="fd.P(...) or None",
                        got=repr(leaf),
                        fix="wrap the entries in fd.P(...), e.g. fd.P('x', None)",
                    )
                )
    if f is None:
        return functools.partial(
            shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_rep
        )

    plans: tuple[dict, dict] = ({}, {})  # per argument / output structure: what the specs say

    @functools.wraps(f)
    def mapped(*args):
        return _run(f, args, mesh, in_specs, out_specs, check_rep, plans)

    return mapped


def _broadcast(specs, tree, name: str):
    try:
        return optree.tree_broadcast_prefix(specs, tree, _is_spec, none_is_leaf=True, namespace=NAMESPACE)
    except ValueError:
        errors = optree.prefix_errors(specs, tree, _is_spec, none_is_leaf=True, namespace=NAMESPACE)
        detail = str(errors[0](name)) if errors else "the structures differ"
        raise SpecError(
            explain(
                f"fd.shard_map({name})",
                "specs must be a pytree prefix of the values they describe",
                expected="a matching structure (or a single fd.P for everything below a node)",
                got=detail,
                fix="give one spec per argument/output, or one spec for a whole subtree",
            )
        ) from None


class _EntryPlan(NamedTuple):
    """What ``in_specs`` says of each leaf of one argument structure, worked out once."""

    specs: tuple[P | None, ...]
    axes: tuple[frozenset[str] | None, ...]  # the mesh axes each argument varies over
    wheres: tuple[str, ...]  # the spec's path, for errors
    arguments: tuple[str, ...]  # the argument's path, for errors

    @classmethod
    def of(cls, in_specs, args, treedef) -> _EntryPlan:
        specs = treedef.flatten_up_to(_broadcast(in_specs, args, "in_specs"))
        paths = [accessor.codify("") for accessor in treedef.accessors()]
        return cls(
            tuple(specs),
            tuple([None if spec is None else frozenset(spec.axis_names) for spec in specs]),
            tuple([f"fd.shard_map(in_specs{path})" for path in paths]),
            tuple([f"args{path}" for path in paths]),
        )


@functools.lru_cache(maxsize=1024)
def _layout(mesh: DeviceMesh, spec: P, value_ndim: int, where: str) -> Layout:
    if len(spec) > value_ndim:
        raise SpecError(
            explain(
                where,
                "the spec has more entries than the value has dims",
                expected=f"at most {value_ndim} entries",
                got=f"{spec} ({len(spec)} entries) for a {value_ndim}-d value",
                fix="drop the extra entries",
            )
        )
    return Layout.from_spec(mesh, spec, where=where)


def _run(f, args, mesh: DeviceMesh, in_specs, out_specs, check_rep: bool, plans: tuple[dict, dict]):
    if current_frame() is not None:
        raise FunctionalDTensorError(
            explain(
                "fd.shard_map",
                "nested shard_map is not supported yet",
                expected="a shard_map called outside any other",
                got="a call inside the per-device function of another shard_map",
                fix="map over all the axes you need in the outer shard_map",
            )
        )
    backend = backend_of(mesh)
    leaves, treedef = optree.tree_flatten(args, none_is_leaf=True, namespace=NAMESPACE)
    plan = _cached(plans[0], treedef, lambda: _EntryPlan.of(in_specs, args, treedef))
    inputs, in_dims = [], []
    for value, spec, where, argument in zip(leaves, plan.specs, plan.wheres, plan.arguments):
        if spec is None:
            inputs.append(value)
            in_dims.append(None)
            continue
        value, batched = _enter(value, spec, mesh, backend, check_rep, where, argument)
        inputs.append(value)
        in_dims.append(0 if batched else None)
    in_axes = plan.axes
    out_layouts: list = []
    out_treedef: list = []

    def per_device(level, device_level, *local_leaves):
        frame = Frame(mesh, check_rep, backend, level, device_level)
        with bound_axes(frame):
            if check_rep:
                local_leaves = [
                    v if axes is None or not isinstance(v, torch.Tensor) else tag(v, axes)
                    for v, axes in zip(local_leaves, in_axes)
                ]
            local_args = treedef.unflatten(local_leaves)
            mode = ReplicationTracker(frame) if check_rep else backend.ops_mode(frame)
            if mode is None:
                outputs = f(*local_args)
            else:
                with mode:
                    outputs = f(*local_args)
            flat, layouts, tree = _leave(outputs, out_specs, mesh, check_rep, plans[1])
            flat = [
                v if layout is None else backend.leave(v, layout.is_replicated, frame)
                for v, layout in zip(flat, layouts)
            ]
        out_layouts[:] = layouts  # vmap returns tensors only: the layouts come back this way
        out_treedef[:] = [tree]
        return tuple(flat)

    results, batched = backend.run_per_device(per_device, mesh.size, tuple(in_dims), inputs)
    values = []
    for storage, is_batched, layout in zip(results, batched, out_layouts):
        if layout is None:
            values.append(storage)
        elif not is_batched:  # the same on every device, held once
            values.append(DTensor(distribute_storage(storage, layout), layout, storage.shape))
        else:
            shape = global_shape_of_even_local(layout, backend.block_shape(storage))
            if not check_rep:
                replicas = math.prod(
                    [s for s, p in zip(mesh.shape, layout.placements) if not isinstance(p, Shard)]
                )
                if replicas > 1:
                    storage = autograd.apply(_SplitCotangent, storage, replicas)
            values.append(DTensor(storage, layout, shape))
    return out_treedef[0].unflatten(values)


def _enter(value, spec: P, mesh: DeviceMesh, backend, check_rep: bool, where: str, argument: str):
    """One argument as the per-device function's input, and whether it is per-device: its
    storage (stacked shards, or this rank's shard). Where the backend holds values the same on
    every device once, a replicated argument enters as one value."""
    if isinstance(value, DTensor):
        layout = _checked_layout(mesh, spec, value.layout, value.shape, where, argument)
        storage = storage_of(value)
        if layout.is_replicated and backend.holds_replicas_once:
            return _replicated(gather_storage(storage, layout, tuple(value.shape)), mesh, check_rep), False
    elif isinstance(value, torch.Tensor):
        layout = _checked_layout(mesh, spec, None, value.shape, where, argument)
        if value.device.type != mesh.device_type:
            value = value.to(mesh.device_type)
        if layout.is_replicated:  # every device's block is the whole value
            if backend.holds_replicas_once:
                return _replicated(value, mesh, check_rep), False
            storage = value
        else:
            storage = distribute_storage(value, layout)
    else:
        raise InputTypeError(
            explain(
                f"fd.shard_map({argument})",
                f"an argument with spec {spec} must be a tensor",
                expected="a torch.Tensor or an fd.DTensor",
                got=type(value).__name__,
                fix="give it the spec None to pass it through untouched",
            )
        )
    if not check_rep and not layout.is_fully_sharded:
        storage = autograd.apply(_SumOverReplicas, storage, layout)
    return storage, True


@functools.lru_cache(maxsize=1024)
def _checked_layout(mesh: DeviceMesh, spec: P, value_layout, shape, where: str, argument: str) -> Layout:
    """The layout ``spec`` gives an argument of ``shape`` (``value_layout``: a DTensor's own,
    which must match it; None for a tensor), checked once per distinct argument."""
    layout = _layout(mesh, spec, len(shape), where)
    if value_layout is not None:
        if value_layout.mesh != mesh:
            raise MeshError(
                explain(
                    f"fd.shard_map({argument})",
                    "the value lives on another mesh",
                    expected=repr(mesh),
                    got=repr(value_layout.mesh),
                    fix="distribute it on the shard_map's mesh",
                )
            )
        if value_layout != layout:
            raise SpecError(
                explain(
                    f"fd.shard_map({argument})",
                    f"the DTensor's layout does not match its spec {spec}",
                    expected=f"{layout}",
                    got=f"{value_layout}",
                    fix=f"call fd.redistribute(x, {spec}) first, or change the spec",
                )
            )
    check_divisible(layout, tuple(shape), where=where)
    return layout


def _replicated(value: torch.Tensor, mesh: DeviceMesh, check_rep: bool) -> torch.Tensor:
    """A replicated argument held once. Unchecked, its gradient is the sum of every device's
    contribution, which broadcasting computes; counted as the all-reduce the distributed
    backend runs for it."""
    if check_rep:
        return value
    return on_storage(value, mesh, VaryHeldOnce, mesh.axis_names)


def _exit_plan(out_specs, outputs, tree):
    """What ``out_specs`` says of each leaf of one output structure: the specs and paths."""
    specs = tree.flatten_up_to(_broadcast(out_specs, outputs, "out_specs"))
    wheres = [f"fd.shard_map({accessor.codify('out_specs')})" for accessor in tree.accessors()]
    axes = [None if spec is None else frozenset(spec.axis_names) for spec in specs]
    return specs, wheres, axes


def _cached(plans: dict, treedef, make):
    """``plans[treedef]``, made on first use (made afresh while compiling: tracing happens once,
    and Dynamo cannot hash a treedef)."""
    if torch.compiler.is_compiling():
        return make()
    plan = plans.get(treedef)
    if plan is None:
        plan = plans[treedef] = make()
    return plan


def _leave(outputs, out_specs, mesh: DeviceMesh, check_rep: bool, plans: dict):
    leaves, tree = optree.tree_flatten(outputs, none_is_leaf=True, namespace=NAMESPACE)
    plan = _cached(plans, tree, lambda: _exit_plan(out_specs, outputs, tree))
    flat, layouts = [], []
    for value, spec, where, allowed in zip(leaves, *plan):
        if spec is None or value is None:
            if value is not None and spec is None:
                raise SpecError(
                    explain(
                        where,
                        "every output needs a spec",
                        expected="an fd.P for each output tensor",
                        got="None",
                        fix="give the output a spec, e.g. fd.P() if it is replicated",
                    )
                )
            flat.append(value)
            layouts.append(None)
            continue
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(
                explain(
                    where,
                    "the per-device function must return local tensors",
                    expected="a torch.Tensor",
                    got=type(value).__name__,
                    fix="return tensors; compute other values outside shard_map",
                )
            )
        layout = _layout(mesh, spec, value.dim(), where)
        if check_rep:
            varying = axes_varying(value)
            extra = varying - allowed
            if extra:
                names = tuple(sorted(extra, key=mesh.axis_position))
                shown = repr(names[0]) if len(names) == 1 else repr(names)
                raise SpecError(
                    explain(
                        where,
                        f"{spec} claims the output is replicated over {names}, "
                        "but the function does not guarantee it",
                        expected=f"an output that does not vary over {names}",
                        got=f"a value that may vary over {tuple(sorted(axes_varying(value)))}",
                        fix=f"reduce it (e.g. fd.psum(y, {shown})), name those axes in the spec, "
                        "or pass check_rep=False",
                    )
                )
            missing = () if allowed <= varying else tuple(a for a in spec.axis_names if a not in varying)
            if missing:
                value = pvary(value, missing)
        flat.append(value)
        layouts.append(layout)
    return flat, layouts, tree


class _SumOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the cotangent over the replicated mesh axes (used when
    replication is not tracked, so each replica's cotangent is only its own contribution)."""

    @staticmethod
    def forward(storage, layout):
        return storage

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layout = inputs[1]

    @staticmethod
    def vmap(info, in_dims, storage, layout):
        # a mapped batch becomes one more trailing dim of the local values
        return autograd.apply(_SumOverReplicas, storage.movedim(in_dims[0], -1), layout), -1

    @staticmethod
    def backward(ctx, g):
        mesh = ctx.layout.mesh
        axes = tuple([n for n, p in zip(mesh.axis_names, ctx.layout.placements) if not isinstance(p, Shard)])
        return on_storage(g, mesh, AllReduce, axes, op="sum"), None


class _SplitCotangent(torch.autograd.Function):
    """Identity forward; backward divides the cotangent among ``replicas`` copies."""

    generate_vmap_rule = True

    @staticmethod
    def forward(storage, replicas):
        return storage

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.replicas = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g / ctx.replicas, None

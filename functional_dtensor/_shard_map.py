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

What the specs say of one structure of arguments (or outputs) is worked out once and kept in a
plan, so that a call does little more than flatten its arguments and run the function.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeAlias, overload

import optree
import torch
from torch._C import _pop_torch_function_stack, _push_on_torch_function_stack

from . import _log as log
from ._backend import backend_of, memory_of
from ._cache import Bounded, cached
from ._collectives import Pvary, SplitCotangent, VaryHeldOnce, on_storage, pvary
from ._context import Frame, frame_stack
from ._dtensor import (
    TORCH_DTENSOR_FIX,
    DTensor,
    check_mesh,
    check_tensor,
    distribute_storage,
    gather_storage,
    new_value,
    parts_of,
    storage_of,
)
from ._errors import FunctionalDTensorError, InputTypeError, MeshError, SpecError, explain
from ._functorch import transforms_active
from ._input_guard import InputGuard, own_copies, written
from ._layout import Layout
from ._mesh import DeviceMesh
from ._placements import Shard
from ._sharding import check_divisible, global_shape_of_even_local
from ._spec import P
from ._tracking import ReplicationTracker
from ._varying import tag, varying_in

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
    mapping = _Mapping(f, mesh, in_specs, out_specs, check_rep)

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        if kwargs:
            raise _keyword_arguments_error(kwargs)
        return _run(mapping, args)

    return mapped


def _keyword_arguments_error(kwargs: dict) -> InputTypeError:
    names = ", ".join(kwargs)
    return InputTypeError(
        explain(
            "fd.shard_map(f)(**kwargs)",
            "a shard_map'd function takes positional arguments only (in_specs describes them)",
            expected="no keyword arguments",
            got=f"keyword arguments {names}",
            fix=f"pass them positionally, or bind them first: functools.partial(f, {names}=...)",
        )
    )


class _Mapping:
    """One ``shard_map``: the function, its mesh and backend, its specs, and the plans and
    frames worked out so far (per argument and output structure; per functorch level).

    ``bare``: whether eager calls run the function with no torch-function mode, no Python
    between its ops (None: not known before the first call). On a simulated mesh of one axis
    the device vmap records which values vary, the batched ones, so no tracker is needed. The
    mode then serves the backend's own batching rules (products, attention: large kernels),
    and marks where a replicated value meets per-device values: its gradient is the sum of the
    devices' parts, an all-reduce on ranks that CommDebugMode counts, where the vmap's
    broadcasting would sum unseen. A first call under the mode notes both; a function that did
    neither runs bare after, outside torch.func transforms. A function whose ops change from
    call to call gets the same values and gradients either way."""

    __slots__ = (
        "f", "mesh", "backend", "in_specs", "out_specs", "check_rep", "entries", "exits", "frames", "bare"
    )  # fmt: skip

    def __init__(self, f, mesh: DeviceMesh, in_specs, out_specs, check_rep: bool) -> None:
        self.f, self.mesh, self.backend = f, mesh, backend_of(mesh)
        self.in_specs, self.out_specs, self.check_rep = in_specs, out_specs, check_rep
        self.entries: dict = {}
        self.exits: dict = {}
        self.frames: dict = {}
        self.bare = None if self.backend.holds_replicas_once and mesh.ndim == 1 else False

    def frame(self, level, device_level, compiling: bool, bare: bool) -> tuple[Frame, object]:
        """The frame of a call at these levels, and the torch-function mode it runs under: in
        eager mode an :class:`.InputGuard` around the tracker's or the backend's, one per
        thread (it holds the running call's inputs), or none (``bare``); made afresh while
        compiling."""
        if compiling:
            frame = Frame(self.mesh, self.check_rep, self.backend, level, device_level)
            return frame, ReplicationTracker(frame) if self.check_rep else self.backend.ops_mode(frame)
        key = (level, device_level, None if bare else threading.get_ident())
        found = self.frames.get(key)
        if found is None:
            if bare:
                axes = frozenset(self.mesh.axis_names)
                frame = Frame(
                    self.mesh, self.check_rep, self.backend, level, device_level, batched_varying=axes
                )
                found = self.frames[key] = (frame, None)
            else:
                frame = Frame(self.mesh, self.check_rep, self.backend, level, device_level)
                mode = ReplicationTracker(frame) if self.check_rep else self.backend.ops_mode(frame)
                found = self.frames[key] = (frame, InputGuard(mode, self.f))
        return found

    def learn(self, guard: InputGuard) -> None:
        """After a first call under ``guard``: run bare from now on unless it applied a rule of
        the backend's or the tracker marked a value whose gradient sums devices' parts."""
        inner = guard.inner
        self.bare = not (inner.ruled_seen or getattr(inner, "pvaried_seen", False))


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


class _Plan:
    """What the specs say of each leaf of one argument (or output) structure: the spec, the
    axes it names, and the paths for errors; the layouts it gives values of each shape."""

    __slots__ = ("specs", "axes", "wheres", "paths", "layouts")

    def __init__(self, specs, wheres, paths) -> None:
        self.specs = tuple(specs)
        self.axes = tuple([None if s is None else frozenset(s.axis_names) for s in self.specs])
        self.wheres, self.paths = tuple(wheres), tuple(paths)
        self.layouts: list[dict] = [{} for _ in self.specs]

    @classmethod
    def of_arguments(cls, in_specs, args, treedef) -> _Plan:
        specs = treedef.flatten_up_to(_broadcast(in_specs, args, "in_specs"))
        paths = [accessor.codify("") for accessor in treedef.accessors()]
        return cls(specs, [f"fd.shard_map(in_specs{p})" for p in paths], [f"args{p}" for p in paths])

    @classmethod
    def of_outputs(cls, out_specs, outputs, tree) -> _Plan:
        specs = tree.flatten_up_to(_broadcast(out_specs, outputs, "out_specs"))
        wheres = [f"fd.shard_map({accessor.codify('out_specs')})" for accessor in tree.accessors()]
        return cls(specs, wheres, wheres)


def _flattened(tree, compiling: bool) -> tuple[list, optree.PyTreeSpec, object]:
    """``optree.tree_flatten(tree)`` in the library's namespace, and the key of its structure
    in a mapping's plans; eagerly, a tensor or a tuple of tensors (a warm call's usual
    arguments and outputs) without optree's pass over it, keyed by its length (hashing a
    structure is optree's pass again)."""
    if compiling:
        leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
        return leaves, treedef, treedef
    kind = type(tree)
    if kind is DTensor or kind is torch.Tensor:
        return [tree], _LEAF, -1
    if kind is tuple and len(tree) < len(_TUPLES):
        for leaf in tree:
            if type(leaf) is not DTensor and type(leaf) is not torch.Tensor:
                break
        else:
            return list(tree), _TUPLES[len(tree)], len(tree)
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
    return leaves, treedef, treedef


def _unflattened(treedef: optree.PyTreeSpec, leaves: list):
    """``treedef.unflatten(leaves)``; a tensor's or a tuple's structure without optree's pass."""
    if treedef is _LEAF:
        return leaves[0]
    if len(leaves) < len(_TUPLES) and treedef is _TUPLES[len(leaves)]:
        return tuple(leaves)
    return treedef.unflatten(leaves)


#: the structures of a tensor and of tuples of 0 to 7 tensors
_LEAF = optree.tree_structure(0, none_is_leaf=True, namespace=NAMESPACE)
_TUPLES = [optree.tree_structure((0,) * n, none_is_leaf=True, namespace=NAMESPACE) for n in range(8)]


def _planned(plans: dict, key, make, compiling: bool) -> _Plan:
    """``plans[key]``, made on first use (made afresh while compiling: tracing happens once,
    and Dynamo cannot hash a treedef)."""
    if compiling:
        return make()
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = make()
    return plan


def _log_plan(m: _Mapping, what: str, plan: _Plan) -> None:
    """``f: in_specs (P('x'), P()) on simulated mesh [x=4] on cpu``: a plan built (once per
    argument or output structure)."""
    name = getattr(m.f, "__qualname__", None) or repr(m.f)
    specs = ", ".join("None" if s is None else repr(s) for s in plan.specs)
    specs = specs if len(plan.specs) == 1 else f"({specs})"
    log.shard_map.info("%s: %s %s on %s", name, what, specs, m.mesh)


def _run(m: _Mapping, args):
    if frame_stack():
        raise FunctionalDTensorError(
            explain(
                "fd.shard_map",
                "nested shard_map is not supported yet",
                expected="a shard_map called outside any other",
                got="a call inside the per-device function of another shard_map",
                fix="map over all the axes you need in the outer shard_map",
            )
        )
    compiling = torch.compiler.is_compiling()
    leaves, treedef, key = _flattened(args, compiling)
    plan = None if compiling else m.entries.get(key)
    if plan is None:
        plan = _planned(m.entries, key, lambda: _Plan.of_arguments(m.in_specs, args, treedef), compiling)
        if not compiling and log.shard_map.isEnabledFor(logging.INFO):
            _log_plan(m, "in_specs", plan)
    if m.bare and not compiling and not transforms_active():  # (wrapped inputs: no lazy clone)
        try:
            out = _call(m, plan, leaves, treedef, False, bare=True)
        except Exception:  # (run again under the mode, whose error names the cause)
            out = _AGAIN
        if out is not _AGAIN:
            return out
    return _call(m, plan, leaves, treedef, compiling, bare=False)


#: what a bare call returns where it must run again under the mode
_AGAIN = object()


def _call(m: _Mapping, plan: _Plan, leaves, treedef, compiling: bool, bare: bool):
    """One call of ``m``'s function on the flat ``leaves``, bare or under the mode (see
    :class:`_Mapping`). A bare call runs on the inputs' own copies, and returns :data:`_AGAIN`
    if the function wrote into one: the mode then refuses the write before it happens."""
    frames = frame_stack()
    inputs, in_dims, callers = [], [], set()
    for i, value in enumerate(leaves):
        if plan.specs[i] is None:
            inputs.append(value)
            in_dims.append(None)
        else:
            if not compiling and not bare and isinstance(value, torch.Tensor):
                callers.add(memory_of(value))  # an output must not share the caller's memory
            value, batched = _enter(m, plan, i, value, compiling)
            inputs.append(value)
            in_dims.append(0 if batched else None)
    callers.discard(0)
    if bare:  # the function's own copies: an output may be one (copy-on-write)
        inputs = own_copies(inputs)
    exits: list = []

    def per_device(level, device_level, *local_leaves):
        frame, mode = m.frame(level, device_level, compiling, bare)
        frames.append(frame)  # the axes bound while the function runs
        try:
            if m.check_rep and not bare:  # (plain loops: a comprehension is one more frame per call)
                tagged = []
                for v, axes in zip(local_leaves, plan.axes):
                    tagged.append(v if axes is None or not isinstance(v, torch.Tensor) else tag(v, axes))
                local_leaves = tagged
            local_args = _unflattened(treedef, local_leaves)
            if mode is None:
                outputs = m.f(*local_args)
            elif compiling:
                with mode:
                    outputs = m.f(*local_args)
            else:
                mode.inputs, mode.paths = inputs, plan.paths
                _push_on_torch_function_stack(mode)  # ``with mode:``, without its Python frames
                try:
                    outputs = m.f(*local_args)
                finally:
                    _pop_torch_function_stack()
                    mode.inputs = mode.paths = ()  # (not held past the call)
                if m.bare is None:
                    m.learn(mode)
            flat, layouts, tree = _leave(m, frame, outputs, compiling)
            left = []
            for v, lay in zip(flat, layouts):
                left.append(v if lay is None else m.backend.leave(v, lay.is_replicated, frame))
        finally:
            frames.pop()
        exits[:] = [layouts, tree]  # vmap returns tensors only: the layouts come back this way
        return left

    results, batched = m.backend.run_per_device(per_device, m.mesh.size, in_dims, inputs)
    if bare and written(inputs):
        return _AGAIN
    layouts, tree = exits
    values = []
    for storage, is_batched, layout in zip(results, batched, layouts):
        if layout is None:
            values.append(storage)
            continue
        if callers and memory_of(storage) in callers:  # an input returned as it is, or a view of one
            storage = storage.clone()
        if not is_batched:  # the same on every device, held once
            values.append(DTensor(distribute_storage(storage, layout), layout, storage.shape))
        else:
            shape = None if compiling else _GLOBAL_SHAPES.get((layout, storage.shape))
            if shape is None:
                shape = _global_shape(layout, m.backend.block_shape(storage), storage.shape, compiling)
            if not m.check_rep and not layout.is_fully_sharded:
                storage = on_storage(storage, m.mesh, SplitCotangent, _replica_axes(layout))
            values.append(new_value(storage, layout, shape))
    return _unflattened(tree, values)


#: (layout, the storage's shape) -> the global shape of its even blocks
_GLOBAL_SHAPES = Bounded(1024, "shard_map: global shapes of outputs")


def _global_shape(layout: Layout, block_shape: tuple[int, ...], storage_shape, compiling: bool) -> torch.Size:
    shape = torch.Size(global_shape_of_even_local(layout, block_shape))
    if not compiling:
        _GLOBAL_SHAPES[layout, storage_shape] = shape
    return shape


def _enter(m: _Mapping, plan: _Plan, i: int, value, compiling: bool):
    """Argument ``i`` as the per-device function's input, and whether it is per-device: its
    storage (stacked shards, or this rank's shard). Where the backend holds values the same on
    every device once, a replicated argument enters as one value."""
    mesh, backend, check_rep = m.mesh, m.backend, m.check_rep
    if isinstance(value, DTensor):
        if compiling:  # (Dynamo traces the properties)
            storage, own, shape = storage_of(value), value.sharding, value.shape
        else:  # one call for a warm call's inputs
            storage, own, shape = parts_of(value)
        key = None if compiling else (own, shape)  # (unhashable there)
        layout = None if key is None else plan.layouts[i].get(key)
        if layout is None:
            layout = _checked_layout(mesh, plan, i, own, shape)
            if key is not None:
                plan.layouts[i][key] = layout
        if storage is None:  # held once: made from its blocks
            storage = storage_of(value)
        if layout.is_replicated and backend.holds_replicas_once:
            return _replicated(gather_storage(storage, layout, tuple(shape)), mesh, check_rep), False
    elif isinstance(value, (bool, int, float, complex)) and not plan.specs[i]:  # spec P(): 0-d (as JAX)
        return _enter(m, plan, i, torch.tensor(value), compiling)
    elif isinstance(value, torch.Tensor):
        check_tensor(value, f"fd.shard_map({plan.paths[i]})", torch_dtensor_fix=TORCH_DTENSOR_FIX)
        key = value.shape
        layout = plan.layouts[i].get(key)
        if layout is None:
            layout = plan.layouts[i][key] = _checked_layout(mesh, plan, i, None, value.shape)
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
                f"fd.shard_map({plan.paths[i]})",
                f"an argument with spec {plan.specs[i]} must be a tensor",
                expected="a torch.Tensor or an fd.DTensor",
                got=type(value).__name__,
                fix="give it the spec None to pass it through untouched",
            )
        )
    if not check_rep and not layout.is_fully_sharded:  # each replica's gradient is a contribution
        storage = on_storage(storage, mesh, Pvary, _replica_axes(layout))
    return storage, True


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


def _checked_layout(mesh: DeviceMesh, plan: _Plan, i: int, value_layout, shape) -> Layout:
    """The layout spec ``i`` gives an argument of ``shape`` (``value_layout``: a DTensor's own,
    which must match it; None for a tensor)."""
    spec, where, argument = plan.specs[i], plan.wheres[i], plan.paths[i]
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


def _leave(m: _Mapping, frame: Frame, outputs, compiling: bool):
    """The outputs of the per-device function, checked against ``out_specs``: flat, with
    their layouts (None where passed through) and their structure."""
    leaves, tree, key = _flattened(outputs, compiling)
    plan = None if compiling else m.exits.get(key)
    if plan is None:
        plan = _planned(m.exits, key, lambda: _Plan.of_outputs(m.out_specs, outputs, tree), compiling)
        if not compiling and log.shard_map.isEnabledFor(logging.INFO):
            _log_plan(m, "out_specs", plan)
    flat, layouts = [], []
    for i, value in enumerate(leaves):
        spec, where = plan.specs[i], plan.wheres[i]
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
            if not isinstance(value, (bool, int, float, complex)) or spec:
                raise InputTypeError(
                    explain(
                        where,
                        "the per-device function must return local tensors",
                        expected="a torch.Tensor",
                        got=type(value).__name__,
                        fix="return tensors; compute other values outside shard_map",
                    )
                )
            value = torch.tensor(value, device=m.mesh.device_type)  # with spec P(): 0-d (as JAX)
        layout = plan.layouts[i].get(value.dim())
        if layout is None:
            layout = plan.layouts[i][value.dim()] = _layout(m.mesh, spec, value.dim(), where)
        if m.check_rep:
            value = _checked_replication(frame, value, spec, plan.axes[i], where)
        flat.append(value)
        layouts.append(layout)
    return flat, layouts, tree


def _checked_replication(frame: Frame, value: torch.Tensor, spec: P, allowed, where: str) -> torch.Tensor:
    """``value``, refused if it may vary over axes its spec says it is replicated over, and
    made to vary over the axes the spec names that it does not vary over yet."""
    mesh, varying = frame.mesh, varying_in(frame, value)
    if varying == allowed:  # (the usual case: no set to build)
        return value
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
                got=f"a value that may vary over {tuple(sorted(varying))}",
                fix=f"reduce it (e.g. fd.psum(y, {shown})), name those axes in the spec, "
                "or pass check_rep=False",
            )
        )
    if allowed <= varying:
        return value
    return pvary(value, tuple(a for a in spec.axis_names if a not in varying))


@cached(1024)
def _replica_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes along which ``layout`` holds copies (not shards) of each block."""
    mesh = layout.mesh
    return tuple([n for n, p in zip(mesh.axis_names, layout.placements) if not isinstance(p, Shard)])

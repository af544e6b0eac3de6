"""``local_map``: a per-device function applied to global values (DTensor's semantics).

``fd.local_map(func, out_placements, in_placements)`` returns a function of ``fd.DTensor``
arguments: each is checked against (or, with ``redistribute_inputs``, redistributed to) its
placements, ``func`` runs once per device on the local shards, and each output becomes an
``fd.DTensor`` with its ``out_placements`` (as ``torch.distributed.tensor.experimental.local_map``).

Unlike :func:`shard_map`, shards may be uneven (each device's ``func`` sees its true shard, as
``torch.chunk`` cuts it) and gradients follow DTensor's ``to_local``/``from_local``: the local
gradient of an input is read in its ``in_grad_placements`` (default: its own placements, so a
replicated input's gradient is each device's own; say ``fd.Partial()`` where each device
computes a part of it), and each output's cotangent comes to every device in the output's
layout (a Partial output's as Replicate).

How it runs:

* **simulated backend**, every input split evenly: ``func`` runs once, batched over the
  devices by the same device vmap as ``shard_map`` (its cost does not grow with the mesh in
  Python; it is differentiable and traces under ``torch.compile``). A replicated input enters
  as per-device copies (its gradient is each device's, as DTensor's), so ``func`` computes on
  it once per device.
* **simulated backend**, an uneven input (or a ``func`` that reads values into Python, which
  a batched function cannot): ``func`` runs in a Python loop, once per device, on
  ``x.local_shards()``, and the outputs are put together by :func:`from_local` (their global
  shapes found from the shards). Dispatch then grows with the number of devices.
* **distributed backend**: ``func`` runs on this rank's shard. An output sharded on some mesh
  axis learns its global shape by one small all-gather of the local shapes (so uneven outputs
  are right); a Replicate or Partial one needs none.

A plain argument (not an ``fd.DTensor``) reaches every device as it is; a tensor among them is
global, and its gradient sums every device's contribution on both backends (as ``shard_map``
treats captured values).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import optree
import torch
from torch.overrides import TorchFunctionMode

from ._backend import backend_of, memory_of
from ._context import Frame, current_frame
from ._dtensor import DTensor, check_mesh, from_local, layout_for, storage_of, with_grad_layout
from ._errors import (
    BatchedFunctionError,
    FunctionalDTensorError,
    InputTypeError,
    LayoutError,
    MeshError,
    ShapeError,
    SpecError,
    explain,
)
from ._input_guard import check_inputs_not_written
from ._layout import Layout
from ._mesh import DeviceMesh
from ._placements import Placement, Shard
from ._redistribute import redistribute
from ._shard_map import NAMESPACE
from ._sharding import global_shape_of_even_local, shard_table
from ._spec import P

__all__ = ["local_map", "Placements"]

API = "fd.local_map"
#: a pytree prefix of the arguments (or outputs) whose leaves are placements (a sequence of
#: ``fd.Placement``, one per mesh axis), an ``fd.P`` spec, an ``fd.Layout``, or None
Placements: TypeAlias = Any


def _is_entry(x) -> bool:
    """Whether ``x`` is a leaf of ``in_placements``/``out_placements``/``in_grad_placements``."""
    if x is None or isinstance(x, (P, Layout, Placement)):
        return True
    return isinstance(x, (tuple, list)) and len(x) > 0 and all(isinstance(p, Placement) for p in x)


def local_map(
    func: Callable,
    out_placements: Placements,
    in_placements: Placements = None,
    in_grad_placements: Placements = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Callable[..., Any]:
    """``func``, a function of local tensors, as a function of ``fd.DTensor`` values.

    ``in_placements`` gives each argument's placements (one ``fd.Placement`` per mesh axis, or
    an ``fd.P``; ``None`` for an argument that is not a DTensor): a tuple with an entry per
    positional argument, or any pytree prefix of the arguments, or one entry per argument leaf
    (as torch). ``None`` takes every DTensor as it is. A DTensor laid out otherwise is an error,
    or with ``redistribute_inputs=True`` is redistributed first. ``out_placements`` does the
    same for the outputs: a tensor output becomes an ``fd.DTensor``; an output whose entry is
    ``None`` is returned as it is (device 0's on the simulated backend: it must be the same on
    every device). ``in_grad_placements`` gives the layout of each input's local gradient, as
    ``DTensor.to_local(grad_placements=...)``. ``device_mesh`` defaults to the DTensor
    arguments' mesh. Shards may be uneven; see the module docstring for the cost.

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(4, "x")
    >>> x = fd.distribute_tensor(torch.arange(10.0), mesh, [fd.Shard(0)])
    >>> def scaled_by_shard_length(x_shard):
    ...     return x_shard * len(x_shard)
    >>> y = fd.local_map(scaled_by_shard_length, [fd.Shard(0)], ([fd.Shard(0)],))(x)
    >>> y.full_tensor().tolist()
    [0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0, 24.0, 9.0]
    """
    if not callable(func):
        raise InputTypeError(
            explain(
                f"{API}(func)",
                "local_map wraps a function of local tensors",
                expected="a callable",
                got=type(func).__name__,
                fix="pass the per-device function first: fd.local_map(f, out_placements, in_placements)",
            )
        )
    if device_mesh is not None:
        check_mesh(device_mesh, f"{API}(device_mesh)")
    for name, tree in (
        ("out_placements", out_placements),
        ("in_placements", in_placements),
        ("in_grad_placements", in_grad_placements),
    ):
        _check_leaves(tree, name)
    mapping = _LocalMap(
        func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs
    )

    @functools.wraps(func)
    def mapped(*args, **kwargs):
        return _call(mapping, args, kwargs)

    return mapped


def _check_leaves(tree, name: str) -> None:
    accessors, leaves = optree.tree_flatten_with_accessor(tree, _is_entry, none_is_leaf=True)[:2]
    for accessor, leaf in zip(accessors, leaves):
        if not _is_entry(leaf):
            raise InputTypeError(
                explain(
                    f"{API}({accessor.codify(name)})",
                    "each entry is the placements of one value",
                    expected="a sequence of fd.Placement (one per mesh axis), an fd.P spec, or None",
                    got=repr(leaf),
                    fix="write e.g. [fd.Shard(0), fd.Replicate()] or fd.P('x'); None for a non-DTensor",
                )
            )


class _LocalMap:
    """One ``local_map``: the function and what it was told."""

    __slots__ = ("func", "out_placements", "in_placements", "in_grad_placements", "mesh", "redistribute")

    def __init__(self, func, out_placements, in_placements, in_grad_placements, mesh, redistribute_inputs):
        self.func, self.out_placements = func, out_placements
        self.in_placements, self.in_grad_placements = in_placements, in_grad_placements
        self.mesh, self.redistribute = mesh, bool(redistribute_inputs)


def _entries(tree, values, treedef, name: str) -> list:
    """One entry of ``tree`` (``name``) per leaf of ``values`` (flattened as ``treedef``):
    ``tree`` a pytree prefix of ``values``, or (as torch) a flat sequence with one entry per
    leaf."""
    try:
        full = optree.tree_broadcast_prefix(tree, values, _is_entry, none_is_leaf=True, namespace=NAMESPACE)
        return treedef.flatten_up_to(full)
    except ValueError:
        if isinstance(tree, (tuple, list)) and not _is_entry(tree) and len(tree) == treedef.num_leaves:
            return list(tree)
        errors = optree.prefix_errors(tree, values, _is_entry, none_is_leaf=True, namespace=NAMESPACE)
        detail = str(errors[0](name)) if errors else "the structures differ"
        count = len(tree) if isinstance(tree, (tuple, list)) else 1
        raise SpecError(
            explain(
                f"{API}({name})",
                f"{name} must have an entry per {'argument' if name.startswith('in') else 'output'}",
                expected=f"one entry per {'positional argument' if name.startswith('in') else 'output'}, "
                f"a pytree prefix of them, or one entry per leaf ({treedef.num_leaves})",
                got=f"{count} entries: {detail}",
                fix="give one entry (placements, fd.P or None) per value, or one for a whole subtree",
            )
        ) from None


def _call(m: _LocalMap, args: tuple, kwargs: dict):
    if current_frame() is not None:
        raise FunctionalDTensorError(
            explain(
                API,
                "local_map maps global values; inside a per-device function values are local",
                expected="a call outside fd.shard_map",
                got="a call inside the per-device function of a shard_map",
                fix="call the local function directly on the local tensors",
            )
        )
    if kwargs:  # (Dynamo cannot flatten a dict with optree)
        _check_kwargs(kwargs)
    leaves, treedef = optree.tree_flatten(args, none_is_leaf=True, namespace=NAMESPACE)
    paths = [accessor.codify("") for accessor in treedef.accessors()]
    wanted = None if m.in_placements is None else _entries(m.in_placements, args, treedef, "in_placements")
    grads = None
    if m.in_grad_placements is not None:
        grads = _entries(m.in_grad_placements, args, treedef, "in_grad_placements")
    for i, value in enumerate(leaves):
        for name, entries in (("in_placements", wanted), ("in_grad_placements", grads)):
            if entries is not None and entries[i] is not None and not isinstance(value, DTensor):
                raise _not_a_dtensor(value, name, paths[i], entries[i])
    mesh = _mesh_of(m.mesh, leaves, paths)
    inputs = []
    for i, value in enumerate(leaves):
        if isinstance(value, DTensor):
            if wanted is not None:
                value = _checked_input(m, mesh, value, wanted[i], paths[i])
            if grads is not None and grads[i] is not None:
                value = with_grad_layout(value, grads[i], API, argument=f"in_grad_placements{paths[i]}")
        inputs.append(value)
    backend = backend_of(mesh)
    run = _run_distributed
    if backend.one_process:
        even = all(
            [shard_table(v.sharding, tuple(v.shape)).is_even for v in inputs if isinstance(v, DTensor)]
        )
        run = _run_batched if even else _run_looped
    try:
        flat, tree = run(m, mesh, inputs, treedef, paths, kwargs)
    except BatchedFunctionError:  # func reads values into Python: run it device by device
        if run is not _run_batched:
            raise
        flat, tree = _run_looped(m, mesh, inputs, treedef, paths, kwargs)
    return tree.unflatten(flat)


def _check_kwargs(kwargs: dict) -> None:
    """Keyword arguments pass through to ``func`` as they are: no DTensor among them."""
    for accessor, leaf in zip(*optree.tree_flatten_with_accessor(kwargs, namespace=NAMESPACE)[:2]):
        if isinstance(leaf, DTensor):
            raise InputTypeError(
                explain(
                    f"{API}(func)({accessor.codify('kwargs')})",
                    "keyword arguments pass through to func as they are",
                    expected="DTensors among the positional arguments",
                    got="an fd.DTensor keyword argument",
                    fix="pass it positionally, with its entry in in_placements",
                )
            )


def _mesh_of(given: DeviceMesh | None, leaves, paths) -> DeviceMesh:
    """``device_mesh``, or the mesh of the DTensor arguments; every DTensor on it."""
    mesh, first = given, "device_mesh"
    for value, path in zip(leaves, paths):
        if not isinstance(value, DTensor):
            continue
        if mesh is None:
            mesh, first = value.device_mesh, f"args{path}"
        elif value.device_mesh != mesh:
            raise MeshError(
                explain(
                    f"{API}(func)(args{path})",
                    f"the DTensor lives on another mesh than {first}",
                    expected=repr(mesh),
                    got=repr(value.device_mesh),
                    fix="lay every DTensor argument out on one mesh (fd.distribute_tensor on it)",
                )
            )
    if mesh is None:
        raise MeshError(
            explain(
                f"{API}(device_mesh)",
                "no mesh to run on: no argument is an fd.DTensor and no device_mesh was given",
                expected="an fd.DTensor argument or device_mesh=mesh",
                got="neither",
                fix="pass device_mesh=mesh to fd.local_map",
            )
        )
    return mesh


def _checked_input(m: _LocalMap, mesh: DeviceMesh, value: DTensor, entry, path: str) -> DTensor:
    """The DTensor argument at ``path`` in the layout of its ``in_placements`` entry."""
    where = f"in_placements{path}"
    if entry is None:
        raise LayoutError(
            explain(
                f"{API}({where})",
                "the argument is an fd.DTensor, but its entry is None",
                expected="its placements (one per mesh axis) or an fd.P",
                got=f"None for a DTensor laid out {value.sharding}",
                fix=f"give its placements, e.g. {list(value.placements)!r}",
            )
        )
    layout = layout_for(mesh, entry, value.ndim, API, argument=where)
    if value.sharding == layout:
        return value
    if m.redistribute:
        return redistribute(value, layout)
    return _raise_layout(value, layout, path)


def _raise_layout(value: DTensor, layout: Layout, path: str):
    raise LayoutError(
        explain(
            f"{API}(func)(args{path})",
            "the DTensor's layout differs from its in_placements entry",
            expected=f"{layout} ({list(layout.placements)!r})",
            got=f"{value.sharding}",
            fix="pass redistribute_inputs=True to fd.local_map, "
            f"or x.redistribute({list(layout.placements)!r}) first",
        )
    )


def _not_a_dtensor(value, name: str, path: str, entry) -> InputTypeError:
    kind = type(value).__name__
    return InputTypeError(
        explain(
            f"{API}(func)(args{path})",
            f"{name}{path} is {entry!r}, which describes an fd.DTensor",
            expected="an fd.DTensor",
            got=f"a {kind}" if not isinstance(value, torch.Tensor) else "a plain torch.Tensor",
            fix=f"lay it out first with fd.distribute_tensor(t, mesh, {entry!r}), or give it the entry None",
        )
    )


class _Guard(TorchFunctionMode):
    """``mode`` (or none), refusing first every op that would write into an input of ``func``:
    inputs are views of immutable values' shards."""

    def __init__(self, mode, func, inputs, paths) -> None:
        super().__init__()
        self.mode, self.func, self.inputs, self.paths = mode, func, inputs, paths

    def __torch_function__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check_inputs_not_written(op, args, kwargs, self.func, self.inputs, self.paths, api=API)
        if self.mode is None:
            return op(*args, **kwargs)
        return self.mode.__torch_function__(op, types, args, kwargs)


def _apply(m: _LocalMap, mode, local_leaves, treedef, paths, kwargs):
    """``func`` on one device's (or every device's, batched) local leaves, under ``mode``:
    its outputs flat, and their structure."""
    if not torch.compiler.is_compiling():
        mode = _Guard(mode, m.func, local_leaves, [f"args{p}" for p in paths])
    local_args = treedef.unflatten(local_leaves)
    if mode is None:
        outputs = m.func(*local_args, **kwargs)
    else:
        with mode:
            outputs = m.func(*local_args, **kwargs)
    return optree.tree_flatten(outputs, none_is_leaf=True, namespace=NAMESPACE)


def _out_layouts(m: _LocalMap, mesh: DeviceMesh, flat, tree) -> list:
    """Each output's layout (None: returned as it is), checked against the output."""
    entries = _entries(m.out_placements, tree.unflatten(flat), tree, "out_placements")
    layouts = []
    for value, entry, accessor in zip(flat, entries, tree.accessors()):
        where = accessor.codify("out_placements")
        if entry is None:
            layouts.append(None)
            continue
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(
                explain(
                    f"{API}({where})",
                    "an output with placements must be a local tensor",
                    expected="a torch.Tensor",
                    got=type(value).__name__,
                    fix="return a tensor there, or give the output the entry None",
                )
            )
        layouts.append(layout_for(mesh, entry, value.dim(), API, argument=where))
    return layouts


def _callers_memory(inputs) -> frozenset[int]:
    """The memory of the plain tensor arguments: the caller's, which an output must not share."""
    return frozenset([memory_of(v) for v in inputs if isinstance(v, torch.Tensor)]) - {0}


def _run_batched(m: _LocalMap, mesh: DeviceMesh, inputs, treedef, paths, kwargs):
    """Simulated, every input even: ``func`` once, under the device vmap, on stacked shards."""
    backend = backend_of(mesh)
    exits: list = []

    def per_device(level, device_level, *local_leaves):
        mode = backend.ops_mode(Frame(mesh, False, backend, level, device_level))
        flat, tree = _apply(m, mode, local_leaves, treedef, paths, kwargs)
        exits[:] = [flat, tree]  # vmap returns tensors only: the rest comes back this way
        return tuple([v if isinstance(v, torch.Tensor) else None for v in flat])

    storages = [storage_of(v) if isinstance(v, DTensor) else v for v in inputs]
    in_dims = [0 if isinstance(v, DTensor) else None for v in inputs]
    results, batched = backend.run_per_device(per_device, mesh.size, in_dims, storages)
    local_flat, tree = exits
    layouts = _out_layouts(m, mesh, local_flat, tree)
    callers = () if torch.compiler.is_compiling() else _callers_memory(inputs)
    flat = []
    for local, value, is_batched, layout in zip(local_flat, results, batched, layouts):
        if not isinstance(local, torch.Tensor):
            flat.append(local)
        elif layout is None:
            flat.append(value[0] if is_batched else value)  # device 0's
        else:
            if callers and memory_of(value) in callers:  # a plain argument returned as it is
                value = value.clone()
            if not is_batched:  # the same on every device
                value = value.unsqueeze(0).expand(mesh.size, *value.shape)
            shape = global_shape_of_even_local(layout, tuple(value.shape[1:]))
            flat.append(DTensor(value, layout, shape))
    return flat, tree


def _run_looped(m: _LocalMap, mesh: DeviceMesh, inputs, treedef, paths, kwargs):
    """Simulated, some input uneven: ``func`` once per device, in a loop, on its true shards."""
    shards = [v.local_shards() if isinstance(v, DTensor) else None for v in inputs]
    per_device, tree = [], None
    for device in range(mesh.size):
        local = [v if s is None else s[device] for v, s in zip(inputs, shards)]
        flat, device_tree = _apply(m, None, local, treedef, paths, kwargs)
        if tree is None:
            tree = device_tree
        elif device_tree != tree:
            raise SpecError(
                explain(
                    f"{API}(func)",
                    "every device's outputs must have the same structure",
                    expected=f"{tree} (device 0's)",
                    got=f"{device_tree} on device {device}",
                    fix="return the same structure on every device",
                )
            )
        per_device.append(flat)
    layouts = _out_layouts(m, mesh, per_device[0], tree)
    callers = _callers_memory(inputs)
    flat = []
    for j, layout in enumerate(layouts):
        if layout is None:
            flat.append(per_device[0][j])
            continue
        values = [outputs[j] for outputs in per_device]
        for k, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                raise _not_a_tensor(value, tree, j, k)
        if callers and len(values) == 1 and memory_of(values[0]) in callers:
            values[0] = values[0].clone()
        flat.append(_from_local(values, mesh, layout, tree, j))
    return flat, tree


def _not_a_tensor(value, tree, j: int, device: int) -> InputTypeError:
    where = tree.accessors()[j].codify("out_placements")
    return InputTypeError(
        explain(
            f"{API}({where})",
            f"an output with placements must be a local tensor on every device (device {device})",
            expected="a torch.Tensor",
            got=type(value).__name__,
            fix="return a tensor there on every device, or give the output the entry None",
        )
    )


def _from_local(local, mesh: DeviceMesh, layout: Layout, tree, j: int) -> DTensor:
    """The output made of ``local`` shards (every device's, or this rank's), its global shape
    found from them where a Shard placement splits it (Replicate and Partial keep the shape)."""
    sharded = any([isinstance(p, Shard) for p in layout.placements])
    one = local if isinstance(local, torch.Tensor) else local[0]
    shape = None if sharded else tuple(one.shape)
    try:
        return from_local(local, mesh, layout, shape=shape, copy=False)
    except ShapeError as error:
        where = tree.accessors()[j].codify("out_placements")
        raise ShapeError(
            explain(
                f"{API}({where})",
                f"the devices' outputs make up no global value laid out {layout}",
                expected="each device's output the block of one global value (torch.chunk's split)",
                got=str(error),
                fix="check the output's placements, or the shapes func returns on each device",
            )
        ) from None


def _run_distributed(m: _LocalMap, mesh: DeviceMesh, inputs, treedef, paths, kwargs):
    """Distributed: ``func`` on this rank's shards."""
    backend = backend_of(mesh)
    exits: list = []

    def per_device(level, device_level, *local_leaves):
        mode = backend.ops_mode(Frame(mesh, False, backend, level, device_level))
        flat, tree = _apply(m, mode, local_leaves, treedef, paths, kwargs)
        exits[:] = [tree]
        return tuple(flat)

    local = [v.to_local() if isinstance(v, DTensor) else v for v in inputs]
    in_dims = [0 if isinstance(v, DTensor) else None for v in inputs]
    results, _ = backend.run_per_device(per_device, mesh.size, in_dims, local)
    (tree,) = exits
    results = list(results)
    layouts = _out_layouts(m, mesh, results, tree)
    callers = () if torch.compiler.is_compiling() else _callers_memory(inputs)
    flat = []
    for j, (value, layout) in enumerate(zip(results, layouts)):
        if layout is None:
            flat.append(value)
            continue
        if callers and memory_of(value) in callers:
            value = value.clone()
        flat.append(_from_local(value, mesh, layout, tree, j))
    return flat, tree

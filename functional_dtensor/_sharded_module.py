"""A module laid out on a mesh: :class:`ShardedModule`, its parameters as ``fd.DTensor`` and
its own forward as a pure function, built from per-module styles (:func:`fd.parallelize_module`)
or per-parameter layouts (:func:`fd.distribute_module`).

:func:`build_sharded_module` lays out every parameter and buffer (the tensor-parallel styles of
the module holding it, then the :class:`~._styles.FullyShard` above it), and copies the module
without its tensors; forward hooks on that copy make the styles' layout changes at module
boundaries and gather the ``FullyShard`` parameters; ``apply`` puts the parameters in place
for the call only.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import _varied as varied
from ._backend import backend_of
from ._dtensor import DTensor, data_of, distribute_tensor, held_of, new_held, new_value, storage_of
from ._errors import InputTypeError, LayoutError, explain
from ._folded_linear import reduced_linear
from ._functorch import is_transformed
from ._gathered_linear import gathered_linear
from ._global_ops import implicit_replication
from ._layout import Layout
from ._mesh import DeviceMesh
from ._placements import Partial, Placement, Replicate, Shard
from ._public import public
from ._redistribute import gather_varied, held_move, redistribute
from ._spec import P
from ._styles import ColwiseParallel, FullyShard, ReplicateParallel, RowwiseParallel, SequenceParallel

__all__ = ["ShardedModule", "build_sharded_module"]


@public
class ShardedModule(NamedTuple):
    """A module laid out on a mesh: ``params`` (a dict of ``fd.DTensor`` by parameter name, its
    trainable state) and ``apply(params, *inputs, **kwargs)``, the module's forward on them.
    Unpacks as ``params, apply = fd.parallelize_module(...)``."""

    params: dict[str, DTensor]
    apply: Callable[..., Any]


def _entries(spec_entries: list, dim: int, axis: str) -> None:
    current = spec_entries[dim]
    names = () if current is None else (current,) if isinstance(current, str) else tuple(current)
    spec_entries[dim] = axis if not names else (*names, axis)


def build_sharded_module(module, mesh, styles_of, layouts, root_fns, api) -> ShardedModule:
    """``module`` laid out on ``mesh``: by ``styles_of`` (module name -> its styles), or by
    ``layouts`` (parameter name -> layout) where not None; ``root_fns`` is None or the
    ``(input_fn, output_fn)`` of the root module; ``api`` names the caller in errors."""
    # every parameter and buffer, by identity, with the first name it has (as named_parameters)
    params: dict[str, torch.Tensor] = {}
    # its places: (module name, attribute) pairs (a tied weight has several)
    bindings: dict[str, list[tuple[str, str]]] = {}
    owner: dict[str, str] = {}  # parameter name -> the name of the module holding it first
    first_name: dict[int, str] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(sub, kind).items():
                if tensor is None:
                    continue
                name = first_name.setdefault(id(tensor), f"{mod_name}.{attr}" if mod_name else attr)
                if name not in bindings:
                    bindings[name] = []
                    params[name] = tensor
                    owner[name] = mod_name
                bindings[name].append((mod_name, attr))
    trainable = {name for name, t in params.items() if isinstance(t, nn.Parameter)}

    # layouts: tensor-parallel styles of the owning module, then the FullyShard above it. A
    # unit is a module's name, or a tuple of module names gathered together (torch's
    # fully_shard of a list of modules)
    unit_axis: dict = {}  # unit -> its FullyShard axis
    unit_of_module: dict[str, str | tuple[str, ...]] = {}  # module name -> the unit it begins
    for key, styles in styles_of.items():
        for style in styles:
            if isinstance(style, FullyShard):
                unit_axis[key] = style.axis
                for member in key if isinstance(key, tuple) else (key,):
                    unit_of_module[member] = key
    specs: dict[str, Layout] = {}
    managed: dict = {}  # FullyShard unit -> the parameters it gathers
    modules = dict(module.named_modules(remove_duplicate=False))
    for name, tensor in params.items():
        if layouts is not None:
            specs[name] = layouts.get(name) or Layout(mesh, (Replicate(),) * mesh.ndim)
            continue
        entries: list = [None] * tensor.dim()
        mod_name = owner[name]
        attr = name.rsplit(".", 1)[-1]
        for style in styles_of.get(mod_name, ()):
            if isinstance(style, FullyShard):
                continue
            dim = style.param_dims(modules[mod_name], attr) if name in trainable else None
            if dim is not None:
                _entries(entries, dim % tensor.dim(), style.axis)
        if name in trainable and tensor.dim() > 0:
            unit = _unit_of(mod_name, unit_of_module)
            if unit is not None:
                _entries(entries, 0, unit_axis[unit])
                managed.setdefault(unit, []).append(name)
        specs[name] = Layout.from_spec(mesh, P(*entries), where=f"{api} (parameter {name!r})")
    # gradients summed once per step: the parameters under a ReplicateParallel (torch's
    # replicate on a data axis) or a SequenceParallel (Megatron's one all-reduce of the
    # sequence-parallel norms' gradients), replicated over its axis, have their gradients summed
    # over it in one all-reduce per step, not one per use; one bucket per set of axes
    summed_over: dict[str, set[str]] = {}
    for mod_name, styles in styles_of.items():
        for style in styles:
            if isinstance(style, (ReplicateParallel, SequenceParallel)) and isinstance(mod_name, str):
                index = mesh.axis_names.index(style.axis)
                for name in (n for n in params if n in trainable):
                    owned = owner[name]
                    inside = mod_name in ("", owned) or owned.startswith(f"{mod_name}.")
                    if inside and specs[name].placements[index].is_replicate():
                        summed_over.setdefault(name, set()).add(style.axis)
    summed_once: dict[tuple[str, ...], list[str]] = {}
    for name in (n for n in params if n in summed_over):  # one order on every rank
        axes = tuple(a for a in mesh.axis_names if a in summed_over[name])
        summed_once.setdefault(axes, []).append(name)

    values = {}
    backend = backend_of(mesh)
    for name, tensor in params.items():
        value = distribute_tensor(tensor.detach(), mesh, specs[name], copy=True)
        storage = storage_of(value).detach()
        layout, shape = value.sharding, value.shape
        if name in trainable and backend.holds_leaf(layout, tuple(shape)):  # (as fd.Optimizer's)
            held = backend.fold(storage, layout, backend.held_plan(layout)).clone()
            values[name] = new_held(held.requires_grad_(tensor.requires_grad), layout, shape)
            continue
        if name in trainable:
            storage = storage.requires_grad_(tensor.requires_grad)
        values[name] = new_value(storage, layout, shape)
    sharded_params = {name: values[name] for name in params if name in trainable}
    buffers = {name: values[name] for name in params if name not in trainable}

    skeleton = _skeleton(module, params)
    skel_modules = dict(skeleton.named_modules(remove_duplicate=False))
    places = {name: [(skel_modules[m], attr) for m, attr in pairs] for name, pairs in bindings.items()}
    _install_hooks(skeleton, mesh, styles_of, managed, places, root_fns)
    apply = _Apply(skeleton, mesh, places, set(sharded_params), buffers, summed_once)
    return ShardedModule(sharded_params, apply)


def _unit_of(mod_name: str, units: dict):
    """The FullyShard unit of the nearest module at or above ``mod_name`` that has one."""
    parts = mod_name.split(".") if mod_name else []
    for cut in range(len(parts), -1, -1):
        candidate = ".".join(parts[:cut])
        if candidate in units:
            return units[candidate]
    return None


def _skeleton(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``module`` without its parameters and buffers (set per call by ``apply``)."""
    memo = {id(t): None for t in tensors.values()}
    return copy.deepcopy(module, memo)


def _on_axis(x, mesh: DeviceMesh, axis: str, placement: Placement | None, where: str):
    """``x`` with ``placement`` on mesh axis ``axis`` (others kept); a plain tensor becomes a
    replicated value first; anything else passes."""
    if placement is None:
        return x
    if isinstance(x, torch.Tensor):
        x = distribute_tensor(x, mesh, (Replicate(),) * mesh.ndim)
    if not isinstance(x, DTensor):
        return x
    index = mesh.axis_names.index(axis)
    if isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim % max(x.ndim, 1))
    current = x.placements
    if current[index] == placement:
        return x
    if isinstance(placement, Partial):
        raise LayoutError(
            explain(
                where,
                "a style cannot make a value Partial",
                expected="Shard or Replicate",
                got=str(placement),
                fix="name a Shard or Replicate placement (a Partial output comes from the op itself)",
            )
        )
    wanted = (*current[:index], placement, *current[index + 1 :])
    if isinstance(current[index], Shard) and placement.is_replicate() and x.requires_grad:
        # a sequence-parallel gather: varied over the axis (see ._varied), so that the
        # gradients of its uses are summed on each device and reduce-scattered once, as
        # Megatron's; a plain gather would sum each use's gradient in an all-reduce
        return gather_varied(x, wanted, (axis,))
    return redistribute(x, wanted)


def _install_hooks(skeleton, mesh, styles_of, managed, places, root_fns) -> None:
    modules = dict(skeleton.named_modules(remove_duplicate=False))
    for mod_name, styles in styles_of.items():
        if isinstance(mod_name, tuple):  # a unit of several modules: FullyShard alone
            continue
        sub = modules[mod_name]
        for style in styles:
            where = f"{type(style).__name__} on module {mod_name or 'the root'!r}"
            wanted_in, wanted_kw, arity = style.inputs(sub), style.kwarg_inputs(sub), style.arity()
            if wanted_in is not None or wanted_kw is not None or arity is not None:
                hook = _input_hook(mesh, style.axis, wanted_in or (), wanted_kw or {}, arity, where)
                sub.register_forward_pre_hook(hook, with_kwargs=True)
            wanted_out = style.outputs(sub)
            if wanted_out is not None:
                sub.register_forward_hook(_output_hook(mesh, style.axis, wanted_out, where))
            at_once = _at_once(style, sub) if backend_of(mesh).holds_replicas_once else None
            apart = _plain_linear
            if _bias_after_reduction(style, sub, places):
                reduce = functools.partial(
                    _on_axis, mesh=mesh, axis=style.axis, placement=wanted_out[0], where=where
                )
                apart = functools.partial(_bias_after, reduce)
            if at_once is not None or apart is not _plain_linear:
                sub.forward = functools.partial(_linear_forward, at_once, apart, sub, style.axis)
    for unit, names in managed.items():
        axis = next(s.axis for s in styles_of[unit] if isinstance(s, FullyShard))
        hook = _gather_hook(names, places, mesh, axis)
        for member in unit if isinstance(unit, tuple) else (unit,):  # the first to run gathers
            modules[member].register_forward_pre_hook(hook)
    if root_fns is not None:
        input_fn, output_fn = root_fns
        if input_fn is not None:
            skeleton.register_forward_pre_hook(lambda m, inputs: _as_args(input_fn(m, inputs, mesh)))
        if output_fn is not None:
            skeleton.register_forward_hook(lambda m, inputs, out: output_fn(m, out, mesh))


def _as_args(value):
    return value if isinstance(value, tuple) else (value,)


def _input_hook(mesh, axis, wanted, wanted_kw, arity, where):
    """Before the module's forward: its positional inputs laid out by ``wanted`` (one placement
    or None each), its keyword inputs by ``wanted_kw``; ``arity``: the positional inputs the
    style names, checked as torch checks them."""

    def hook(module, inputs, kwargs):
        if arity is not None and len(inputs) != arity:
            raise InputTypeError(
                explain(
                    where,
                    "the module is called with as many positional inputs as input_layouts names",
                    expected=f"{arity} positional inputs",
                    got=f"{len(inputs)}",
                    fix="give one placement (or None) per positional input in input_layouts and "
                    "desired_input_layouts; keyword inputs go in input_kwarg_layouts",
                )
            )
        inputs = tuple(
            _on_axis(x, mesh, axis, wanted[i] if i < len(wanted) else None, where)
            for i, x in enumerate(inputs)
        )
        kwargs = {k: _on_axis(v, mesh, axis, wanted_kw.get(k), where) for k, v in kwargs.items()}
        return inputs, kwargs

    return hook


def _output_hook(mesh, axis, wanted, where):
    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return tuple(
                _on_axis(x, mesh, axis, wanted[i] if i < len(wanted) else None, where)
                for i, x in enumerate(output)
            )
        return _on_axis(output, mesh, axis, wanted[0], where)

    return hook


def _at_once(style, module: nn.Module):
    """How an ``nn.Linear`` and the collective its style runs on its output are computed at
    once from blocks held once: a column-parallel layer whose output is gathered
    (:func:`._gathered_linear.gathered_linear`), a row-parallel one whose output is all-reduced
    or reduce-scattered (:func:`._folded_linear.reduced_linear`); None for other modules and
    styles."""
    if type(module) is not nn.Linear:
        return None
    if isinstance(style, ColwiseParallel) and style.output_layouts.is_replicate():
        return gathered_linear
    if isinstance(style, RowwiseParallel) and not style.output_layouts.is_partial():
        return functools.partial(reduced_linear, placement=style.output_layouts)
    return None


def _linear_forward(at_once, apart, module: nn.Linear, axis: str, input):
    """``nn.Linear.forward`` under its style: the product and the style's gather
    (``gathered_linear``) or reduction (``reduced_linear``) of it at once where ``at_once``
    applies, else ``apart(module, input)`` (the output hook finds the collective done or
    runs it)."""
    out = None if at_once is None else at_once(input, module.weight, module.bias, axis)
    return apart(module, input) if out is None else out


def _plain_linear(module: nn.Linear, input):
    return F.linear(input, module.weight, module.bias)


def _bias_after(reduce, module: nn.Linear, input):
    """A row-parallel layer's product reduced by its style (``reduce``), then the bias added
    once (see :func:`_bias_after_reduction`)."""
    return torch.add(reduce(F.linear(input, module.weight)), module.bias)


def _bias_after_reduction(style, module: nn.Module, places) -> bool:
    """Whether a row-parallel ``nn.Linear`` with a bias (one of the tensors ``places`` binds)
    all-reduces its output before adding the bias, as Megatron's RowParallelLinear: the bias,
    replicated, added once to the sum (not kept on one device of the axis as a Partial part).
    Not where the output is reduce-scattered: there the bias's gradient, summed over a split
    sequence, would take an all-reduce of its own."""
    return (
        type(module) is nn.Linear
        and any([(module, "bias") in bound for bound in places.values()])
        and isinstance(style, RowwiseParallel)
        and style.output_layouts.is_replicate()
    )


def _gather_hook(names, places, mesh, axis):
    """Before the forward of a FullyShard unit's first module to run (a unit may span several
    modules): its parameters, gathered over the data axis, replace the sharded ones for this
    call (their gradients flow back to the shards). Those whose blocks have one shape on every
    device go in one all-gather (their gradients in one reduce-scatter), the others one by one."""

    def hook(module, inputs):
        values = {}
        for name in names:
            sub, attr = places[name][0]
            value = sub._parameters[attr]
            if isinstance(value, DTensor) and _sharded_over(value.sharding, axis):  # not gathered yet
                values[name] = value
        even = [n for n, v in values.items() if _even_on_dim0(v)]
        # on a simulated mesh, a large one's gathered blocks held once (one per position off
        # the data axis), where its gather reads held blocks or stacked storage
        sources = [_held_gather_source(values[n], _gathered(values[n].sharding), axis) for n in even]
        storages = varied.gather_unit(
            [varied.marked_storage(values[n]) if s is None else s[0] for n, s in zip(even, sources)],
            mesh,
            axis,
            [None if s is None else s[1] for s in sources],
        )
        gathered = {}
        for n, s, source in zip(even, storages, sources):
            layout, shape = _gathered(values[n].sharding), values[n].shape
            if source is None:
                gathered[n] = new_value(s, layout, shape)
            else:
                gathered[n] = new_held(s, layout, shape, frozenset([axis, *varied.axes_of(s)]))
        for name, value in values.items():
            if name not in gathered:
                gathered[name] = gather_varied(value, _gathered(value.sharding), (axis,))
            for sub, attr in places[name]:
                sub._parameters[attr] = gathered[name]

    return hook


def _held_gather_source(x: DTensor, target: Layout, axis: str) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """Where a fully-sharded parameter ``x`` (varied over ``axis``) moves to ``target`` held
    once by one all-gather over ``axis`` along dim 0 (see :func:`._redistribute.held_move`):
    the held blocks (or stacked storage) the gather reads and their grid, for its unit's
    bucket, eagerly. None where it does not."""
    data = data_of(x)
    if torch.compiler.is_compiling() or data.is_meta or is_transformed(data):
        return None
    integral = not (data.is_floating_point() or data.is_complex())
    threshold = backend_of(target.mesh).held_min_elements
    move = held_move(x.sharding, target, tuple(x.shape), data.element_size(), integral, threshold)
    if move is None or move[0] or move[1] != (axis,) or move[2] != 0:
        return None
    _, _, _, source_plan, grid = move
    held = held_of(x)
    if held is None:
        held = varied.marked_storage(x)
        if source_plan is not None:
            mesh, axes = target.mesh, {axis, *varied.axes_of(held)}
            summed = tuple([a for a in source_plan.axes if mesh.axis_names[a] in axes])
            held = backend_of(mesh).fold(held, x.sharding, source_plan, summed)
    return held, grid


def _sharded_over(layout: Layout, axis: str) -> bool:
    """Whether dim 0 of ``layout`` is split over ``axis`` last (minor): a FullyShard parameter
    not gathered yet in this call."""
    first = layout.spec[0] if layout.spec else None
    return first == axis or (isinstance(first, tuple) and first[-1] == axis)


def _even_on_dim0(value: DTensor) -> bool:
    """Whether every device's block of ``value`` has the same length along dim 0."""
    first = value.sharding.spec[0]
    names = (first,) if isinstance(first, str) else tuple(first)
    return value.shape[0] % value.device_mesh.axis_size(names) == 0


def _gathered(layout: Layout) -> Layout:
    """``layout`` with its dim-0 entry's last (minor) axis replicated: a FullyShard gather."""
    entries = list(layout.spec)
    first = entries[0]
    names = (first,) if isinstance(first, str) else tuple(first)
    entries[0] = None if len(names) == 1 else names[0] if len(names) == 2 else names[:-1]
    return Layout.from_spec(layout.mesh, P(*entries))


def map_values(fn, value):
    """``value`` with ``fn`` applied to every ``fd.DTensor`` in it, in any container a forward
    returns: tuples, lists and dicts, and their subclasses (transformers' ``ModelOutput``, an
    ``OrderedDict`` and a dataclass; named tuples), and dataclasses. A container holding no
    changed value is returned as it is; others are copied, never changed in place."""
    if isinstance(value, DTensor):
        return fn(value)
    if isinstance(value, Mapping):
        changed = {k: v2 for k, v in value.items() if (v2 := map_values(fn, v)) is not v}
        if not changed:
            return value
        out = copy.copy(value)
        for k, v in changed.items():
            out[k] = v
        return out
    if isinstance(value, (tuple, list)):
        items = [map_values(fn, v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {
            f.name: v2
            for f in dataclasses.fields(value)
            if (v2 := map_values(fn, v := getattr(value, f.name))) is not v
        }
        if not changed:
            return value
        out = copy.copy(value)
        for k, v in changed.items():
            object.__setattr__(out, k, v)  # (a frozen dataclass too)
        return out
    return value


class _Apply:
    """``apply(params, *args, **kwargs)``: the module's forward with ``params`` (and the
    module's buffers, replicated) in place of its tensors, for the call only."""

    def __init__(self, skeleton, mesh, places, names, buffers, summed_once) -> None:
        self._skeleton = skeleton
        self._mesh = mesh
        self._summed_once = summed_once
        self._places = places
        self._names = frozenset(names)
        self._buffers = buffers
        self._lock = threading.RLock()
        self.__name__ = f"apply_{type(skeleton).__name__}"
        self.__qualname__ = self.__name__

    def __repr__(self) -> str:
        return f"<pure forward of {type(self._skeleton).__name__} ({len(self._names)} parameters)>"

    @property
    def buffers(self) -> dict[str, DTensor]:
        """The module's buffers, replicated on the mesh (constants of ``apply``)."""
        return dict(self._buffers)

    def _invariant(self, value):
        if isinstance(value, DTensor) and varied.axes_of_value(value):
            return varied.invariant_value(value)
        return value

    def _check(self, params) -> None:
        where = "fd.ShardedModule.apply(params)"
        if not isinstance(params, Mapping):
            raise InputTypeError(
                explain(
                    where,
                    "params is the dict of fd.DTensor the sharded module was made with",
                    expected="a dict {parameter name: fd.DTensor}",
                    got=type(params).__name__,
                    fix="pass model.params, or the dict an fd.Optimizer step returned",
                )
            )
        if params.keys() != self._names:
            missing, extra = sorted(self._names - params.keys()), sorted(params.keys() - self._names)
            raise InputTypeError(
                explain(
                    where,
                    "params must name every parameter of the module, and only those",
                    expected=f"{len(self._names)} parameters",
                    got=f"missing {missing}, unknown {extra}",
                    fix="pass the full dict (model.params or an optimizer step's result)",
                )
            )
        for name, value in params.items():
            if not isinstance(value, DTensor):
                raise InputTypeError(
                    explain(
                        f"{where}[{name!r}]",
                        "a sharded module's parameters are fd.DTensor values",
                        expected="an fd.DTensor",
                        got=type(value).__name__,
                        fix="keep the values parallelize_module returned (or the optimizer's)",
                    )
                )

    def __call__(self, params, *args, **kwargs):
        self._check(params)
        if torch.compiler.is_compiling():  # one trace at a time: Dynamo holds its own lock
            return self._forward(params, args, kwargs)
        with self._lock:  # the skeleton holds one call's parameters at a time
            return self._forward(params, args, kwargs)

    def _forward(self, params, args, kwargs):
        with varied.scope(), implicit_replication():
            params = dict(params)
            for axes, names in self._summed_once.items():
                values = varied.vary_all([params[n] for n in names], self._mesh, axes)
                params.update(zip(names, values))
            for source in (params, self._buffers):
                for name, value in source.items():
                    for sub, attr in self._places[name]:
                        table = sub._parameters if attr in sub._parameters else sub._buffers
                        table[attr] = value
            try:
                out = self._skeleton(*args, **kwargs)
                # a value leaving the forward varied is made invariant (a loss computed inside)
                return map_values(self._invariant, out)
            finally:
                for name in self._places:
                    for sub, attr in self._places[name]:
                        table = sub._parameters if attr in sub._parameters else sub._buffers
                        table[attr] = None

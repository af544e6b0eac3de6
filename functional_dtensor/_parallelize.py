"""Module sharding: an unmodified ``nn.Module`` as sharded parameters and a pure function.

A **plan** maps fully-qualified module names (patterns: ``fnmatch`` per dot-separated part,
``"layers.*.mlp.up"``; the root module is ``""``) to DTensor's styles. From a module, a mesh and
a plan, :func:`parallelize_module` returns a :class:`ShardedModule`: ``params``, a dict of
``fd.DTensor`` by parameter name laid out as the plan says, and ``apply(params, *inputs)``,
which runs the module's own ``forward`` code on those values (global operations) with the
plan's layout changes at module boundaries. Nothing is mutated: the module keeps its tensors,
``apply`` is pure, and a training step returns new parameters.

===================== ==================================== ===================================
style                 parameters on its mesh axis          inputs -> outputs on that axis
===================== ==================================== ===================================
``ColwiseParallel``   Linear weight/bias ``S(0)``,         ``R`` -> ``S(-1)``
                      Embedding weight ``S(1)``
``RowwiseParallel``   Linear weight ``S(1)``, bias ``R``,  ``S(-1)`` (Embedding: ``R``) -> ``R``
                      Embedding weight ``S(0)``            (``Partial`` reduced)
``SequenceParallel``  replicated                           ``S(1)`` -> ``S(1)``
``ReplicateParallel`` replicated                           as they come
``FullyShard``        dim 0 sharded (after the TP styles)  gathered for the module's forward
``PrepareModuleInput``/``PrepareModuleOutput``             the layouts given
===================== ==================================== ===================================

A parameter no style names is replicated. Every style names its mesh axis (``"tp"`` by
default, ``"dp"`` for :class:`FullyShard`); the other axes of a parameter stay replicated
unless a :class:`FullyShard` above it shards them, so one plan lays out a 2-D (data x tensor
parallel) model.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
>>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
>>> plan = {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel(), "": fd.FullyShard("dp")}
>>> model = fd.parallelize_module(mlp, mesh, plan)
>>> {name: p.spec for name, p in model.params.items()}
{'0.weight': P(('tp', 'dp')), '0.bias': P(('tp', 'dp')), '2.weight': P('dp', 'tp'), '2.bias': P('dp')}
>>> x = fd.distribute_tensor(torch.randn(4, 8), mesh, fd.P("dp"))
>>> y = model.apply(model.params, x)
>>> y.placements
(Shard(dim=0), Replicate())
>>> torch.allclose(y.full_tensor(), mlp(x.full_tensor()), atol=1e-6)
True
"""

from __future__ import annotations

import copy
import fnmatch
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch
from torch import nn

from . import _varied as varied
from ._dtensor import DTensor, distribute_tensor, layout_for, new_value, storage_of
from ._errors import InputTypeError, LayoutError, explain
from ._layout import Layout, PlacementsOrSpec
from ._mesh import DeviceMesh
from ._placements import Partial, Placement, Replicate, Shard
from ._public import public
from ._redistribute import gather_varied, redistribute
from ._shard_map import NAMESPACE
from ._spec import P

__all__ = [
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "ReplicateParallel",
    "FullyShard",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "ShardedModule",
    "parallelize_module",
    "distribute_module",
]

# --- styles ----------------------------------------------------------------------------------


class _Style:
    """A style: the placements on its mesh axis of the parameters of the module it names
    (:meth:`param_entries`), and the layout changes of that module's inputs and outputs."""

    axis: str

    def param_dims(self, module: nn.Module, name: str) -> int | None:
        """The dim of parameter ``name`` (of ``module`` itself) sharded over the axis, or None."""
        return None

    def inputs(self, module: nn.Module) -> tuple[Placement | None, ...] | None:
        """Per positional input, the placement it needs on the axis (None: as it comes)."""
        return None

    def outputs(self, module: nn.Module) -> tuple[Placement | None, ...] | None:
        return None


def _kind(module: nn.Module, style: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise InputTypeError(
        explain(
            f"fd.{style}",
            f"{style} shards the weights of nn.Linear and nn.Embedding",
            expected="a plan entry naming an nn.Linear or nn.Embedding",
            got=type(module).__name__,
            fix="name the Linear or Embedding inside it, or use fd.distribute_module(partition_fn=...)",
        )
    )


@public
@dataclass(frozen=True)
class ColwiseParallel(_Style):
    """Shard an ``nn.Linear``'s output features (weight and bias ``Shard(0)``; an
    ``nn.Embedding``'s embedding dim) over ``axis``: the input is made ``Replicate`` there, the
    output comes out ``Shard(-1)`` (``output_layouts``: another placement to redistribute it
    to). ``input_layouts`` (DTensor's annotation) lays out a plain tensor input: an
    ``fd.DTensor`` input carries its own layout."""

    axis: str = "tp"
    input_layouts: Placement = Replicate()
    output_layouts: Placement = Shard(-1)

    def param_dims(self, module, name):
        kind = _kind(module, "ColwiseParallel")
        return 1 if kind == "embedding" else 0

    def inputs(self, module):
        return (Replicate(),)

    def outputs(self, module):
        return (self.output_layouts,)


@public
@dataclass(frozen=True)
class RowwiseParallel(_Style):
    """Shard an ``nn.Linear``'s input features (weight ``Shard(1)``, bias replicated; an
    ``nn.Embedding``'s rows) over ``axis``: the input is made ``Shard(-1)`` there (an
    embedding's indices ``Replicate``), the partial output reduced to ``output_layouts``
    (``Replicate``: an all-reduce; ``Shard(1)``: a reduce-scatter, for sequence parallel)."""

    axis: str = "tp"
    input_layouts: Placement = Shard(-1)
    output_layouts: Placement = Replicate()

    def param_dims(self, module, name):
        kind = _kind(module, "RowwiseParallel")
        if kind == "embedding":
            return 0
        return 1 if name == "weight" else None

    def inputs(self, module):
        return (Replicate(),) if isinstance(module, nn.Embedding) else (Shard(-1),)

    def outputs(self, module):
        return (self.output_layouts,)


@public
@dataclass(frozen=True)
class SequenceParallel(_Style):
    """Run a module whose computation is independent along the sequence (``LayerNorm``,
    ``RMSNorm``, dropout) on a sequence sharded over ``axis``: parameters replicated, the
    input made ``Shard(sequence_dim)``, the output left so."""

    axis: str = "tp"
    sequence_dim: int = 1

    def inputs(self, module):
        return (Shard(self.sequence_dim),)


@public
@dataclass(frozen=True)
class ReplicateParallel(_Style):
    """Parameters replicated over ``axis`` (the default for a module no style names); inputs
    and outputs as they come. On a data axis (``fd.ReplicateParallel("dp")`` on the root, as
    torch's ``replicate``): the gradients of every parameter of the module and of those inside
    it, replicated over ``axis``, are summed over it in one all-reduce per step, not one per
    use."""

    axis: str = "tp"


@public
@dataclass(frozen=True)
class FullyShard(_Style):
    """FSDP-style sharding over a data axis: every parameter of the module and of the modules
    inside it that no other ``FullyShard`` claims is held with dim 0 sharded over ``axis``
    (after the tensor-parallel styles: a dim 0 already sharded over ``tp`` is split further,
    ``tp`` major), gathered when the module's ``forward`` starts; its gradient comes back
    summed over ``axis`` and sharded again. Each device holds ``1/n`` of the parameters (and
    of the optimizer state that :class:`fd.Optimizer` keeps beside them)."""

    axis: str = "dp"


@public
@dataclass(frozen=True)
class PrepareModuleInput(_Style):
    """Redistribute a module's positional inputs on ``axis``: ``desired_input_layouts`` one
    placement (or None: as it comes) per input; ``input_layouts`` lays out plain tensors."""

    input_layouts: tuple[Placement | None, ...] | Placement | None = None
    desired_input_layouts: tuple[Placement | None, ...] | Placement | None = None
    axis: str = "tp"

    def inputs(self, module):
        return _as_tuple(self.desired_input_layouts)


@public
@dataclass(frozen=True)
class PrepareModuleOutput(_Style):
    """Redistribute a module's outputs on ``axis``: ``desired_output_layouts`` one placement
    (or None) per output."""

    output_layouts: tuple[Placement | None, ...] | Placement | None = None
    desired_output_layouts: tuple[Placement | None, ...] | Placement | None = None
    axis: str = "tp"

    def outputs(self, module):
        return _as_tuple(self.desired_output_layouts)


def _as_tuple(value) -> tuple | None:
    if value is None:
        return None
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


# --- the sharded module ----------------------------------------------------------------------


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


def _match(pattern: str, name: str) -> bool:
    if pattern == "":
        return name == ""
    parts, names = pattern.split("."), name.split(".") if name else []
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts))


def _check_plan(plan, module: nn.Module, mesh: DeviceMesh) -> dict[str, tuple[_Style, ...]]:
    if not isinstance(plan, Mapping):
        raise InputTypeError(
            explain(
                "fd.parallelize_module(parallelize_plan)",
                "a plan maps module names (patterns) to styles",
                expected='a dict such as {"layers.*.mlp.up": fd.ColwiseParallel()}',
                got=type(plan).__name__,
                fix="pass a dict of module-name patterns to fd styles",
            )
        )
    names = [name for name, _ in module.named_modules()]
    checked = {}
    for pattern, styles in plan.items():
        styles = tuple(styles) if isinstance(styles, (tuple, list)) else (styles,)
        where = f"fd.parallelize_module(parallelize_plan[{pattern!r}])"
        if not isinstance(pattern, str):
            raise InputTypeError(
                explain(
                    where,
                    "plan keys are module names",
                    expected="a str",
                    got=repr(pattern),
                    fix='write the name as a string: "layers.*.mlp"',
                )
            )
        for style in styles:
            if not isinstance(style, _Style):
                raise InputTypeError(
                    explain(
                        where,
                        "a plan entry is a style or a tuple of styles",
                        expected="fd.ColwiseParallel(), fd.RowwiseParallel(), fd.SequenceParallel(), "
                        "fd.ReplicateParallel(), fd.FullyShard(), fd.PrepareModuleInput/Output(...)",
                        got=repr(style),
                        fix="use one of the fd styles (torch's styles configure torch DTensor modules)",
                    )
                )
            if style.axis not in mesh.axis_names:
                raise LayoutError(
                    explain(
                        where,
                        f"{type(style).__name__} names a mesh axis the mesh does not have",
                        expected=f"one of {mesh.axis_names}",
                        got=repr(style.axis),
                        fix=f"{type(style).__name__}(axis=...) with an axis of the mesh",
                    )
                )
        if not any(_match(pattern, name) for name in names):
            raise LayoutError(
                explain(
                    where,
                    "the pattern matches no module",
                    expected="a module name of the model (fnmatch per dot-separated part)",
                    got=repr(pattern),
                    fix=f"pick from the module's names, e.g. {[n for n in names if n][:6]}",
                )
            )
        checked[pattern] = styles
    return checked


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan) -> ShardedModule:
    """``module`` laid out on ``device_mesh`` by ``parallelize_plan`` (module-name pattern ->
    style or tuple of styles): its parameters as ``fd.DTensor`` and a pure function running its
    own forward on them (see the module docstring). The module is not changed."""
    _check_module(module, "fd.parallelize_module")
    plan = _check_plan(parallelize_plan, module, device_mesh)
    styles_of: dict[str, list[_Style]] = {}
    for name, _ in module.named_modules():
        for pattern, styles in plan.items():
            if _match(pattern, name):
                styles_of.setdefault(name, []).extend(styles)
    return _build(module, device_mesh, styles_of, None, None, "fd.parallelize_module")


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    partition_fn: Callable | None = None,
    input_fn: Callable | None = None,
    output_fn: Callable | None = None,
) -> ShardedModule:
    """DTensor's ``distribute_module``, the functional way: ``partition_fn(name, submodule,
    mesh)`` returns the layout (placements or an ``fd.P``) of each of the submodule's own
    parameters it wants sharded, as a dict by parameter name (the others are replicated);
    ``input_fn(module, inputs, mesh)`` and ``output_fn(module, outputs, mesh)`` transform the
    root module's inputs (a tuple) and outputs. Returns a :class:`ShardedModule`."""
    _check_module(module, "fd.distribute_module")
    layouts: dict[str, Layout] = {}
    if partition_fn is not None:
        for name, sub in module.named_modules():
            chosen = partition_fn(name, sub, device_mesh) or {}
            if not isinstance(chosen, Mapping):
                raise InputTypeError(
                    explain(
                        "fd.distribute_module(partition_fn)",
                        "partition_fn returns the layouts of a submodule's own parameters",
                        expected="a dict {parameter name: placements or fd.P} (or None)",
                        got=type(chosen).__name__,
                        fix="return e.g. {'weight': [fd.Shard(0)]}",
                    )
                )
            own = dict(sub.named_parameters(recurse=False))
            for pname, placements in chosen.items():
                if pname not in own:
                    raise LayoutError(
                        explain(
                            f"fd.distribute_module(partition_fn) for {name or 'the root'!r}",
                            "partition_fn named a parameter the submodule does not have",
                            expected=f"one of {sorted(own)}",
                            got=repr(pname),
                            fix="name the submodule's own parameters (not its children's)",
                        )
                    )
                layouts[f"{name}.{pname}" if name else pname] = _layout(device_mesh, placements, own[pname])
    return _build(module, device_mesh, {}, layouts, (input_fn, output_fn), "fd.distribute_module")


def _layout(mesh: DeviceMesh, placements: PlacementsOrSpec, tensor: torch.Tensor) -> Layout:
    return layout_for(mesh, placements, tensor.dim(), "fd.distribute_module(partition_fn)")


def _check_module(module, api: str) -> None:
    if not isinstance(module, nn.Module):
        raise InputTypeError(
            explain(
                f"{api}(module)",
                "it shards a torch module",
                expected="an nn.Module",
                got=type(module).__name__,
                fix="wrap the computation in an nn.Module, or use fd.shard_map / fd.local_map for a function",
            )
        )


def _build(module, mesh, styles_of, layouts, root_fns, api) -> ShardedModule:
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

    # layouts: tensor-parallel styles of the owning module, then the FullyShard above it
    fsdp_units: dict[str, str] = {}  # module name -> its FullyShard axis
    for mod_name, styles in styles_of.items():
        for style in styles:
            if isinstance(style, FullyShard):
                fsdp_units[mod_name] = style.axis
    specs: dict[str, Layout] = {}
    managed: dict[str, list[str]] = {}  # FullyShard module -> the parameters it gathers
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
            unit = _unit_of(mod_name, fsdp_units)
            if unit is not None:
                _entries(entries, 0, fsdp_units[unit])
                managed.setdefault(unit, []).append(name)
        specs[name] = Layout.from_spec(mesh, P(*entries), where=f"{api} (parameter {name!r})")
    # data-parallel replication: the parameters under a ReplicateParallel, replicated over its
    # axis, have their gradients summed over it in one all-reduce per step
    replicated_over: dict[str, list[str]] = {}
    for mod_name, styles in styles_of.items():
        for style in styles:
            if isinstance(style, ReplicateParallel):
                for name in (n for n in params if n in trainable):  # one order on every rank
                    owned = owner[name]
                    inside = mod_name in ("", owned) or owned.startswith(f"{mod_name}.")
                    index = mesh.axis_names.index(style.axis)
                    chosen = replicated_over.setdefault(style.axis, [])
                    if inside and specs[name].placements[index].is_replicate() and name not in chosen:
                        chosen.append(name)

    values = {}
    for name, tensor in params.items():
        value = distribute_tensor(tensor.detach(), mesh, specs[name], copy=True)
        storage = storage_of(value).detach()
        if name in trainable:
            storage = storage.requires_grad_(tensor.requires_grad)
        values[name] = new_value(storage, value.sharding, value.shape)
    sharded_params = {name: values[name] for name in params if name in trainable}
    buffers = {name: values[name] for name in params if name not in trainable}

    skeleton = _skeleton(module, params)
    skel_modules = dict(skeleton.named_modules(remove_duplicate=False))
    places = {name: [(skel_modules[m], attr) for m, attr in pairs] for name, pairs in bindings.items()}
    _install_hooks(skeleton, mesh, styles_of, managed, places, root_fns)
    apply = _Apply(skeleton, mesh, places, set(sharded_params), buffers, replicated_over)
    return ShardedModule(sharded_params, apply)


def _unit_of(mod_name: str, units: dict[str, str]) -> str | None:
    """The nearest module at or above ``mod_name`` with a FullyShard."""
    parts = mod_name.split(".") if mod_name else []
    for cut in range(len(parts), -1, -1):
        candidate = ".".join(parts[:cut])
        if candidate in units:
            return candidate
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
        sub = modules[mod_name]
        for style in styles:
            where = f"{type(style).__name__} on module {mod_name or 'the root'!r}"
            wanted_in = style.inputs(sub)
            if wanted_in is not None:
                sub.register_forward_pre_hook(_input_hook(mesh, style.axis, wanted_in, where))
            wanted_out = style.outputs(sub)
            if wanted_out is not None:
                sub.register_forward_hook(_output_hook(mesh, style.axis, wanted_out, where))
    for unit, names in managed.items():
        axis = next(s.axis for s in styles_of[unit] if isinstance(s, FullyShard))
        modules[unit].register_forward_pre_hook(_gather_hook(names, places, mesh, axis))
    if root_fns is not None:
        input_fn, output_fn = root_fns
        if input_fn is not None:
            skeleton.register_forward_pre_hook(lambda m, inputs: _as_args(input_fn(m, inputs, mesh)))
        if output_fn is not None:
            skeleton.register_forward_hook(lambda m, inputs, out: output_fn(m, out, mesh))


def _as_args(value):
    return value if isinstance(value, tuple) else (value,)


def _input_hook(mesh, axis, wanted, where):
    def hook(module, inputs):
        return tuple(
            _on_axis(x, mesh, axis, wanted[i] if i < len(wanted) else None, where)
            for i, x in enumerate(inputs)
        )

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


def _gather_hook(names, places, mesh, axis):
    """Before a FullyShard module's forward: its parameters, gathered over the data axis,
    replace the sharded ones for this call (their gradients flow back to the shards). Those
    whose blocks have one shape on every device go in one all-gather (their gradients in one
    reduce-scatter), the others one by one."""

    def hook(module, inputs):
        values = {}
        for name in names:
            sub, attr = places[name][0]
            value = sub._parameters[attr]
            if isinstance(value, DTensor):
                values[name] = value
        even = [n for n, v in values.items() if _even_on_dim0(v)]
        storages = varied.gather_unit([storage_of(values[n]) for n in even], mesh, axis)
        gathered = {
            n: new_value(s, _gathered(values[n].sharding), values[n].shape) for n, s in zip(even, storages)
        }
        for name, value in values.items():
            if name not in gathered:
                gathered[name] = gather_varied(value, _gathered(value.sharding), (axis,))
            for sub, attr in places[name]:
                sub._parameters[attr] = gathered[name]

    return hook


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


class _Apply:
    """``apply(params, *args, **kwargs)``: the module's forward with ``params`` (and the
    module's buffers, replicated) in place of its tensors, for the call only."""

    def __init__(self, skeleton, mesh, places, names, buffers, replicated_over) -> None:
        self._skeleton = skeleton
        self._mesh = mesh
        self._replicated_over = replicated_over
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
        if isinstance(value, DTensor) and varied.axes_of(storage_of(value)):
            return new_value(varied.invariant(storage_of(value), self._mesh), value.sharding, value.shape)
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
        with self._lock, varied.scope():
            params = dict(params)
            for axis, names in self._replicated_over.items():
                storages = varied.vary_all([storage_of(params[n]) for n in names], self._mesh, (axis,))
                for name, storage in zip(names, storages):
                    params[name] = new_value(storage, params[name].sharding, params[name].shape)
            for source in (params, self._buffers):
                for name, value in source.items():
                    for sub, attr in self._places[name]:
                        table = sub._parameters if attr in sub._parameters else sub._buffers
                        table[attr] = value
            try:
                out = self._skeleton(*args, **kwargs)
                # a value leaving the forward varied is made invariant (a loss computed inside)
                return optree.tree_map(self._invariant, out, namespace=NAMESPACE)
            finally:
                for name in self._places:
                    for sub, attr in self._places[name]:
                        table = sub._parameters if attr in sub._parameters else sub._buffers
                        table[attr] = None

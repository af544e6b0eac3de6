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

import fnmatch
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ._dtensor import layout_for
from ._errors import InputTypeError, LayoutError, explain
from ._layout import Layout, PlacementsOrSpec
from ._mesh import DeviceMesh
from ._sharded_module import ShardedModule, build_sharded_module
from ._styles import (
    ColwiseParallel,
    FullyShard,
    PrepareModuleInput,
    PrepareModuleOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    Style,
    style_of_string,
)

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


def _match(pattern: str, name: str) -> bool:
    if pattern == "":
        return name == ""
    parts, names = pattern.split("."), name.split(".") if name else []
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, parts))


def _check_plan(plan, module: nn.Module, mesh: DeviceMesh) -> dict:
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
        group = isinstance(pattern, tuple) and pattern and all(isinstance(p, str) for p in pattern)
        if not isinstance(pattern, str) and not group:
            raise InputTypeError(
                explain(
                    where,
                    "plan keys are module names (a tuple of them: one FullyShard unit of several modules)",
                    expected="a str, or a tuple of str with an fd.FullyShard",
                    got=repr(pattern),
                    fix='write the name as a string: "layers.*.mlp", or group modules as '
                    '("norm", "output"): fd.FullyShard("dp")',
                )
            )
        styles = tuple(
            style_of_string(s, mesh.axis_names, where) if isinstance(s, str) else s for s in styles
        )
        for style in styles:
            if not isinstance(style, Style):
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
        if group and not all(isinstance(style, FullyShard) for style in styles):
            raise InputTypeError(
                explain(
                    where,
                    "a tuple of module names is one fully-sharded unit: its parameters gathered together",
                    expected="fd.FullyShard(axis)",
                    got=", ".join(type(s).__name__ for s in styles),
                    fix="give each module its other styles under its own name",
                )
            )
        for part in pattern if group else (pattern,):
            if not any(_match(part, name) for name in names):
                raise LayoutError(
                    explain(
                        where,
                        "the pattern matches no module",
                        expected="a module name of the model (fnmatch per dot-separated part)",
                        got=repr(part),
                        fix=f"pick from the module's names, e.g. {[n for n in names if n][:6]}",
                    )
                )
        checked[pattern] = styles
    return checked


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan) -> ShardedModule:
    """``module`` laid out on ``device_mesh`` by ``parallelize_plan`` (module-name pattern ->
    style or tuple of styles): its parameters as ``fd.DTensor`` and a pure function running its
    own forward on them (see the module docstring). The module is not changed. A style may be
    one of transformers' plan strings (``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``,
    ``"embedding_rowwise"``, ``"sequence_parallel"``, ...), on the mesh's ``"tp"`` axis, so
    ``fd.parallelize_module(model, mesh, model._tp_plan)`` lays out a transformers model by the
    plan it ships. A key may be a tuple of names with ``fd.FullyShard``: one unit of several
    modules, gathered together (torch's ``fully_shard([norm, output])``)."""
    _check_module(module, "fd.parallelize_module")
    plan = _check_plan(parallelize_plan, module, device_mesh)
    styles_of: dict = {}
    for name, _ in module.named_modules():
        for pattern, styles in plan.items():
            if isinstance(pattern, str) and _match(pattern, name):
                styles_of.setdefault(name, []).extend(styles)
    for pattern, styles in plan.items():  # a unit of several modules, keyed by their names
        if isinstance(pattern, tuple):
            members = tuple(n for n, _ in module.named_modules() if any(_match(p, n) for p in pattern))
            styles_of.setdefault(members, []).extend(styles)
    return build_sharded_module(module, device_mesh, styles_of, None, None, "fd.parallelize_module")


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
    return build_sharded_module(
        module, device_mesh, {}, layouts, (input_fn, output_fn), "fd.distribute_module"
    )


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

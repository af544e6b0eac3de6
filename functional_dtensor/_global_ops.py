"""Torch operations on ``fd.DTensor``: each call is decided by a sharding rule (:mod:`._rules`),
its inputs redistributed where the rule needs it, and the op run on every device's shard.

A call goes through four steps; the decision is cached per (op, argument structure, layouts,
shapes, dtypes, the op's other arguments), so a repeated call costs a lookup and the local op:

1. the rule lists, per mesh axis, the placements the inputs may have and the output's;
2. the combination whose redistributes cost the fewest bytes is chosen (none where the inputs
   already fit one, axis by axis);
3. the inputs are redistributed (:func:`._redistribute.redistribute`, differentiable); an input
   replicated along an axis where the output is not goes through ``pvary`` there, so that its
   gradient sums the devices' contributions, as in ``shard_map``;
4. the op runs on the storage: this rank's shard on the distributed backend, every device's at
   once on the simulated one (the device dim leading: dims are passed counted from the end, and
   lower-rank inputs get singleton dims after the device dim, so the op sees the same dims).

:func:`explain_op` shows a decision without running it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NamedTuple

import optree
import torch
import torch.nn.functional as F

from . import _fallback as fallback
from . import _log as log
from . import _rules as rules
from . import _varied as varied
from ._backend import backend_of
from ._blocks import valid_mask
from ._cache import Bounded, Numbered, cached
from ._collectives import Pvary, on_storage
from ._dtensor import DTensor, new_value, new_value_eager, parts_of, storage_of
from ._errors import FunctionalDTensorError, InputTypeError, MeshError, ShapeError, explain
from ._layout import Layout
from ._placements import Replicate
from ._plan import Step, plan, step_bytes
from ._redistribute import layout_key, layout_of_key, redistribute
from ._shard_map import NAMESPACE
from ._sharding import shard_table

__all__ = [
    "Handler",
    "Decision",
    "register",
    "register_sharding",
    "dispatch",
    "resolved",
    "decide",
    "decision_for",
    "unsupported",
    "refused",
    "no_params",
]


class Handler(NamedTuple):
    """How one op runs on ``fd.DTensor``: ``rule(call)`` its options per mesh axis (None: the op
    is a composite, ``local(func, args, kwargs, None)`` runs it on global values);
    ``params(args, kwargs, tensors)`` the rule's own arguments (hashable); ``local(func, args,
    kwargs, ctx)`` the op on storage, ``args`` holding the inputs' storages. ``by_value``:
    whether the decision depends on the values of Python numbers among the arguments (dims,
    sizes); an elementwise op's depends only on their types (``x * lr`` is decided once).
    ``valid(call, mesh, combination)``: whether a combination of options (one per mesh axis)
    holds on this mesh, where the rule's options alone cannot tell (a view that splits a
    sharded dim needs the devices along it to divide the dim's first part). ``by_grad``:
    whether the decision depends on whether some input needs a gradient (then part of the
    decision's key)."""

    rule: rules.Rule | None
    params: Callable
    local: Callable
    name: str
    by_value: bool = True
    valid: Callable | None = None
    by_grad: bool = False  # whether ``params`` reads whether an input needs a gradient
    explained_as: Callable | None = None  # a composite's op with a rule, for fd.explain


_NUMBERS = (int, float, bool)
_VARIED = varied.TABLE  # the marks of ._varied (cleared and refilled in place, never rebound)


_HANDLERS: dict[Callable, Handler] = {}


_FUNCS: list[Callable] = []  # every registered function, by a number Dynamo takes as a constant
_FUNC_IDS: dict[Callable, int] = {}


#: rules by torch's op metadata: functions from a torch function to its handler, or None
GENERIC: list[Callable[[Callable], Handler | None]] = []


@cached(4096)
def by_metadata(func) -> Handler | None:
    """The handler torch's metadata gives ``func`` (e.g. the elementwise rule for an op tagged
    ``torch.Tag.pointwise``), registered as its own; None where none does."""
    for generic in GENERIC:
        handler = generic(func)
        if handler is not None:
            register([func], handler)
            return handler
    return None


def register(funcs: Sequence[Callable | None], handler: Handler) -> None:
    for func in funcs:
        if func is not None:
            _HANDLERS[func] = handler
            if func not in _FUNC_IDS:
                _FUNC_IDS[func] = len(_FUNCS)
                _FUNCS.append(func)


# --- the decision -----------------------------------------------------------------------------


class Decision(NamedTuple):
    inputs: tuple[Layout, ...]  # the layout each DTensor input needs
    fits: tuple[bool, ...]  # per input: whether it is in that layout already
    pvary: tuple[tuple[str, ...], ...]  # per input: the axes its gradient is summed over
    output: Layout
    out_shapes: tuple[tuple[int, ...], ...]  # one per output (a tuple-returning op has several)
    out_dtypes: tuple[torch.dtype, ...]
    call: rules.Call
    steps: tuple[tuple[Step, ...], ...]  # per input: its redistribute
    cost: Fraction
    padded: tuple[bool, ...]  # per output: whether its stacked blocks have padding to zero
    context: Context  # what the local op is given
    direct: bool  # every input fits: no redistribute
    pvary_any: bool  # some input's gradient is summed over axes


class Context(NamedTuple):
    """What a local op knows: the storage's leading dims (1 on the simulated backend: the
    device dim), the decision, and whether some input has fewer dims than the output."""

    lead: int
    decision: Decision
    align: bool


def _steps(source: Layout, target: Layout, shape, dtype: torch.dtype) -> tuple[tuple[Step, ...], Fraction]:
    if source == target:
        return (), Fraction(0)
    return _planned(source, target, tuple(shape), dtype)


@cached(8192)
def _planned(source: Layout, target: Layout, shape: tuple[int, ...], dtype: torch.dtype):
    """The steps from ``source`` to ``target`` and the bytes they move per device."""
    integral = not (dtype.is_floating_point or dtype.is_complex)
    steps = plan(source, target, shape, dtype.itemsize, integral)
    return steps, sum((step_bytes(s, shape, dtype.itemsize) for s in steps), Fraction(0))


def _meta(value):
    if isinstance(value, (DTensor, torch.Tensor)):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def _ordered(mesh, placements: tuple, orders: dict) -> Layout:
    """The layout of ``placements`` whose dims split by several axes take the order (major
    first) ``orders`` gives those axes (sorted axes -> order; the inputs' own orders): an op on
    a value sharded ``P(("tp", "dp"))`` keeps that order rather than moving its blocks, and
    every input of the op and its output agree on it, so their blocks pair up."""
    split: dict[int, list[int]] = {}
    for axis, placement in enumerate(placements):
        if placement.is_shard():
            split.setdefault(placement.dim, []).append(axis)
    order = tuple(
        (dim, orders[tuple(axes)]) for dim, axes in split.items() if len(axes) > 1 and tuple(axes) in orders
    )
    return Layout(mesh, placements, order)


def decide(func, handler: Handler, args, kwargs, tensors: list[DTensor]) -> Decision:
    """The layouts ``func`` runs in: the rule's options, combined over the mesh axes, the
    cheapest in bytes redistributed (a combination the inputs already fit costs nothing)."""
    mesh = tensors[0].device_mesh
    params = handler.params(args, kwargs, tensors)  # checks the op's own arguments first
    meta_args, meta_kwargs = optree.tree_map(_meta, (args, kwargs), none_is_leaf=True, namespace=NAMESPACE)
    try:
        out = func(*meta_args, **meta_kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        raise refused(handler.name, ", ".join(str(tuple(t.shape)) for t in tensors), error) from None
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    shapes = tuple(tuple(t.shape) for t in tensors)
    call = rules.Call(shapes, tuple(outs[0].shape), params)
    options = handler.rule(call)
    current = [t.sharding for t in tensors]
    fitting = []
    for axis in range(mesh.ndim):
        here = tuple(layout.placements[axis] for layout in current)
        fitting.append(next((o for o in options if o.inputs == here), None))
    orders: dict[tuple[int, ...], tuple[int, ...]] = {}
    for layout in current:
        for _, order in layout.shard_order:
            orders.setdefault(tuple(sorted(order)), order)
    valid = handler.valid
    if all(fitting) and (valid is None or valid(call, mesh, tuple(fitting))):
        candidates = [tuple(fitting)]
    else:
        candidates = itertools.product(*[options] * mesh.ndim)
    best = None
    for combination in candidates:
        if valid is not None and not valid(call, mesh, combination):
            continue
        required = [
            _ordered(mesh, tuple(o.inputs[i] for o in combination), orders) for i in range(len(tensors))
        ]
        planned, cost = [], Fraction(0)
        for c, r, s, t in zip(current, required, shapes, tensors):
            if best is not None and cost >= best[0]:  # no cheaper than the best: plan no further
                break
            planned.append(_steps(c, r, s, t.dtype))
            cost += planned[-1][1]
        if best is None or (len(planned) == len(tensors) and cost < best[0]):
            best = (cost, combination, required, planned)
    cost, combination, required, planned = best
    output = _ordered(mesh, tuple(o.output for o in combination), orders)
    pvary = tuple(
        tuple(
            name
            for name, need, out_p in zip(mesh.axis_names, layout.placements, output.placements)
            if isinstance(need, Replicate) and not isinstance(out_p, Replicate)
        )
        for layout in required
    )
    lead = 1 if backend_of(mesh).stacked else 0
    out_shapes = tuple(torch.Size(o.shape) for o in outs)
    decision = Decision(
        tuple(required),
        tuple(c == r for c, r in zip(current, required)),
        pvary,
        output,
        out_shapes,
        tuple(o.dtype for o in outs),
        call,
        tuple(steps for steps, _ in planned),
        cost,
        tuple(bool(lead) and not shard_table(output, tuple(s)).is_even for s in out_shapes),
        None,
        all(c == r for c, r in zip(current, required)),
        any(pvary),
    )
    align = any(len(s) < len(out_shapes[0]) for s in shapes)
    return decision._replace(context=Context(lead, decision, align))


# --- dispatch ---------------------------------------------------------------------------------


def refused(name: str, inputs: str, error: Exception) -> ShapeError:
    """The library's error for arguments torch refuses on meta tensors of the global shapes
    (``inputs``: those shapes, as the message says them), as it would on one device."""
    return ShapeError(
        explain(
            f"torch.{name}",
            "the op does not take these arguments (as on one device)",
            expected="the shapes, dtypes and arguments the op takes on plain tensors",
            got=f"{inputs}: {str(error).splitlines()[0]}",
            fix="check the call on plain tensors of these global shapes first",
        )
    )


def _check_values(name: str, leaves, tensors: list[DTensor]) -> None:
    mesh = tensors[0].device_mesh
    for value in leaves:
        if isinstance(value, DTensor):
            if value.device_mesh != mesh:
                raise MeshError(
                    explain(
                        f"torch.{name}",
                        "the fd.DTensor inputs of one op live on one mesh",
                        expected=f"every input on {mesh}",
                        got=f"an input on {value.device_mesh}",
                        fix="move one with fd.distribute_tensor(x.full_tensor(), mesh, placements)",
                    )
                )
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise InputTypeError(
                explain(
                    f"torch.{name}",
                    "an op mixes an fd.DTensor with a plain torch.Tensor",
                    expected="fd.DTensor inputs, Python numbers or 0-d tensors",
                    got=f"a torch.Tensor of shape {tuple(value.shape)}",
                    fix="make it a global value, replicated: fd.distribute_tensor(t, mesh, fd.P()), or "
                    "sharded as you mean it: fd.distribute_tensor(t, mesh, fd.P('x')); or take the "
                    "DTensor's global value with x.full_tensor()",
                )
            )


def unsupported(func, *, strict: bool = False) -> FunctionalDTensorError:
    name = getattr(func, "__name__", repr(func))
    why = " (strict: fd.strict_ops() or FD_STRICT_OPS=1 refuses running it on replicated inputs)"
    return FunctionalDTensorError(
        explain(
            f"torch.{name}",
            f"{name} has no sharding rule for fd.DTensor" + (why if strict else ""),
            expected="an op with a rule (docs: Global operations)",
            got=f"{name} called on an fd.DTensor",
            fix="run it on each device's shard with fd.local_map or fd.shard_map, give it a rule with "
            "fd.register_sharding, compute on x.full_tensor(), or leave strict mode to run it on "
            "replicated inputs",
        )
    )


def _key_of(value):
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, tuple(value.shape))
    if isinstance(value, slice):  # unhashable before Python 3.12
        return (slice, value.start, value.stop, value.step)
    if isinstance(value, (list, dict, set)):
        return repr(value)
    return value


#: argument types of a call that needs no pytree flattening (the common case: ``a + b``, ``x.sum(0)``)
_FLAT = frozenset([DTensor, int, float, bool, type(None), torch.dtype, str])  # hashable as they are


def _is_flat(args) -> bool:
    """Whether positional ``args`` are leaves as they are: values of :data:`_FLAT` types, or
    sizes (a tuple of ints, as ``x.unflatten(1, (2, 4))`` takes)."""
    for a in args:
        if type(a) not in _FLAT and not (isinstance(a, tuple) and all([type(n) is int for n in a])):
            return False
    return True


def resolved(func) -> tuple[Handler, int]:
    """A registered function's handler and number, looked up once (for a method installed on
    ``fd.DTensor``: Dynamo does not find a Python-defined function such as ``Tensor.norm`` in a
    dictionary keyed by functions)."""
    return _HANDLERS[func], _FUNC_IDS[func]


def dispatch(func, args, kwargs, found: tuple[Handler, int] | None = None):
    """``func(*args, **kwargs)`` where some arguments are ``fd.DTensor`` (``found``: its
    :func:`resolved` handler and number, where known)."""
    handler = _HANDLERS.get(func) if found is None else found[0]
    if handler is None:
        handler = by_metadata(func)
        if handler is None:
            return _replicated(func, args, kwargs or {})
    if handler.rule is None:  # a composite of global ops, or an op on global values
        return handler.local(func, args, kwargs or {}, None)
    if kwargs or torch.compiler.is_compiling():
        return _dispatch_tree(func, handler, args, kwargs or {}, found)
    # the common case, flat arguments: one pass checks them, builds the key and the local arguments
    key = [func]
    local = []
    for value in args:
        kind = type(value)
        if kind is DTensor:
            storage, layout, shape = parts_of(value)
            key += (layout, shape, storage.dtype)
            local.append(storage)
        elif kind in _FLAT or kind is tuple and all([type(n) is int for n in value]):
            key.append(value if handler.by_value or kind not in _NUMBERS else kind)
            local.append(value)
        else:
            return _dispatch_tree(func, handler, args, {}, found)
    if handler.by_grad:  # (storages here: plain tensors, as the numbers are not)
        key.append(
            torch.is_grad_enabled() and any([type(v) is torch.Tensor and v.requires_grad for v in local])
        )
    decision = _DECISIONS.get(tuple(key))
    if (
        decision is None
        or not decision.direct
        or decision.pvary_any
        and torch.is_grad_enabled()
        or _VARIED  # a data-parallel forward runs (one dict's truth: the cost when none does)
    ):
        return _dispatch_tree(func, handler, args, {})
    try:
        out = handler.local(func, local, {}, decision.context)
    except FunctionalDTensorError:
        raise
    except _TORCH_ERRORS as error:
        raise _failed(handler.name, error) from error
    if type(out) is torch.Tensor and not decision.padded[0]:  # one output, no padding: the value
        return new_value_eager(out, decision.output, decision.out_shapes[0])
    return _wrap(out, decision)


#: what torch raises for a dtype or a value an op does not take (meta kernels, which decide the
#: output's shape and dtype, do not check every dtype)
_TORCH_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError)


def _needs_grad(values) -> bool:
    """Whether autograd records and some of ``values`` (fd.DTensors or storages) needs a gradient."""
    return torch.is_grad_enabled() and any([getattr(v, "requires_grad", False) for v in values])


def _failed(name: str, error: Exception) -> InputTypeError:
    return InputTypeError(
        explain(
            f"torch.{name}",
            "the op failed on the shards, as it does on one device for these dtypes or values",
            expected="the dtypes and values the op takes on plain tensors",
            got=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            fix="check the call on the global values first (x.full_tensor()), and convert the dtype "
            "where torch's kernel lacks it",
        )
    )


def no_params(args, kwargs, tensors):
    """A handler's ``params`` for an op whose rule takes no arguments of its own."""
    return ()


def _replicated(func, args, kwargs):
    """An op without a rule, on replicated inputs (:mod:`._fallback`)."""
    if torch.compiler.is_compiling():
        raise unsupported_while_compiling(getattr(func, "__name__", repr(func)), rule=False)
    leaves, tree = optree.tree_flatten((args, kwargs), none_is_leaf=True, namespace=NAMESPACE)
    tensors = [v for v in leaves if type(v) is DTensor]
    if not tensors:  # a DTensor inside a container optree does not walk: nothing to lay out
        raise unsupported(func)
    _check_values(getattr(func, "__name__", repr(func)), leaves, tensors)
    return fallback.run_replicated(func, tensors, leaves, tree, unsupported, _failed)


def _wrap(out, decision: Decision):
    if type(out) is torch.Tensor:
        if decision.padded[0]:
            out = _zero_padding(out, decision.output, decision.out_shapes[0])
        return new_value(out, decision.output, decision.out_shapes[0])
    values = [
        new_value(_zero_padding(o, decision.output, shape) if padded else o, decision.output, shape)
        for o, shape, padded in zip(out, decision.out_shapes, decision.padded)
    ]
    return type(out)(*values) if hasattr(out, "_fields") else type(out)(values)


def _dispatch_tree(func, handler: Handler, args, kwargs, found=None):
    """Any call: its arguments flattened as a pytree; redistributes and ``pvary`` where the
    decision needs them."""
    flat = _is_flat(args) and _is_flat(kwargs.values())  # keywords of flat values too: dim=-1
    if torch.compiler.is_compiling() and not flat:  # decided outside the graph, from constants
        raise unsupported_while_compiling(handler.name)
    names = tuple(kwargs)
    if flat:
        leaves, tree = (*args, *kwargs.values()), None
    else:
        leaves, tree = optree.tree_flatten((args, kwargs), none_is_leaf=True, namespace=NAMESPACE)
    tensors = [v for v in leaves if type(v) is DTensor]
    if torch.compiler.is_compiling():
        spec = tuple(
            [
                ("fd.DTensor", layout_key(v.sharding), tuple(v.shape), str(v.dtype), v.requires_grad)
                if type(v) is DTensor
                else (("dtype", str(v)) if isinstance(v, torch.dtype) else v)
                for v in leaves
            ]
        )
        func_id = _FUNC_IDS[func] if found is None else found[1]
        decision = _rebuilt(_decision_key(_decision_index(func_id, names, spec)))
    else:
        key = [func] if flat and not names else [func, names] if flat else [func, tree]
        for value in leaves:
            if type(value) is DTensor:
                key += (value.sharding, value.shape, storage_of(value).dtype)
            elif not handler.by_value and type(value) in _NUMBERS:
                key.append(type(value))
            else:
                key.append(value if flat else _key_of(value))
        if handler.by_grad:
            key.append(_needs_grad(tensors))
        key = tuple(key)
        decision = _DECISIONS.get(key)
        if decision is None:
            _check_values(handler.name, leaves, tensors)
            decision = _DECISIONS[key] = decide(func, handler, args, kwargs, tensors)
            if log.rules.isEnabledFor(logging.INFO):
                _log_decision(handler.name, tensors, decision)
    grad = torch.is_grad_enabled()
    storages = []
    out_varied = frozenset()
    if _VARIED and grad:
        storages, out_varied = _varied_inputs(tensors, decision)
    else:
        for t, fits, layout, axes in zip(tensors, decision.fits, decision.inputs, decision.pvary):
            storage = storage_of(t if fits else redistribute(t, layout))
            if axes and grad and storage.requires_grad:
                storage = on_storage(storage, decision.output.mesh, Pvary, axes)
            storages.append(storage)
    feed = iter(storages)
    if tree is None:
        local = [next(feed) if type(v) is DTensor else v for v in leaves]
        local_args, local_kwargs = local[: len(args)], dict(zip(names, local[len(args) :]))
    else:
        mesh = decision.output.mesh
        local_args, local_kwargs = tree.unflatten(
            [next(feed) if type(v) is DTensor else _on_mesh(v, mesh) for v in leaves]
        )
    try:
        out = handler.local(func, local_args, local_kwargs, decision.context)
    except FunctionalDTensorError:
        raise
    except _TORCH_ERRORS as error:
        raise _failed(handler.name, error) from error
    out = _wrap(out, decision)
    if out_varied:
        for value in out if isinstance(out, (tuple, list)) else (out,):
            varied.mark(storage_of(value), out_varied)
    return out


def _varied_inputs(tensors: list[DTensor], decision: Decision) -> tuple[list[torch.Tensor], frozenset]:
    """The inputs' storages where some are varied (see :mod:`._varied`), and the axes the
    output is varied over: no ``pvary`` over an input's varied axes; where the output is
    replicated over an axis an input is varied over, the output is varied there too and every
    other input needing a gradient gets ``pvary`` there."""
    mesh = decision.output.mesh
    replicated = {n for n, p in zip(mesh.axis_names, decision.output.placements) if p.is_replicate()}
    entries = []
    for t, fits, layout in zip(tensors, decision.fits, decision.inputs):
        storage = storage_of(t if fits else redistribute(t, layout))  # redistribute keeps marks
        entries.append((storage, varied.axes_of(storage)))
    out_varied = frozenset().union(*(axes for _, axes in entries)) & replicated
    storages = []
    for (storage, axes), needed in zip(entries, decision.pvary):
        need = (set(needed) | out_varied) - axes
        if need and storage.requires_grad:  # once per value and axes: its uses' gradients summed first
            storage = varied.pvaried(storage, mesh, tuple(n for n in mesh.axis_names if n in need))
        storages.append(storage)
    return storages, out_varied


#: the decisions made while Dynamo traces, by the number the graph holds
_TRACED_DECISIONS = Numbered(4096, "global ops: decisions made while compiling")


@torch._dynamo.assume_constant_result
def _decision_index(func_id: int, names: tuple[str, ...], spec: tuple) -> int:
    """The decision of a flat call described by constants (a DTensor by its layout's key,
    shape, dtype and whether it needs a gradient; the last ``len(names)`` items keywords),
    made eagerly while Dynamo traces."""
    func = _FUNCS[func_id]
    made = []

    def make() -> Decision:
        leaves = [_constant_arg(item) for item in spec]
        split = len(leaves) - len(names)
        args, kwargs = tuple(leaves[:split]), dict(zip(names, leaves[split:]))
        tensors = [a for a in leaves if type(a) is DTensor]
        handler = _HANDLERS[func]
        _check_values(handler.name, leaves, tensors)
        made.append((handler, tensors))
        return decide(func, handler, args, kwargs, tensors)

    index = _TRACED_DECISIONS.number((func, names, spec), make)
    if made:
        (handler, tensors), decision = made[0], _TRACED_DECISIONS[index]
        if log.compiling.isEnabledFor(logging.INFO):
            log.compiling.info(
                "%s: decision %d made while Dynamo traces, outside the graph (inputs %s)",
                handler.name,
                index,
                log.layouts(t.sharding for t in tensors),
            )
        if log.rules.isEnabledFor(logging.INFO):
            _log_decision(handler.name, tensors, decision)
    return index


def _log_decision(name: str, tensors: list[DTensor], decision: Decision) -> None:
    """A decision as one line on the ``functional_dtensor.rules`` logger: the inputs' layouts,
    those the rule needs where they differ, the output's, the bytes the redistributes move
    (``matmul: S(1)R, S(0)R -> P(sum)R (no communication)``); at DEBUG, the shapes and each
    input's redistribute."""
    current = log.layouts(t.sharding for t in tensors)
    needed = "" if decision.direct else f" need {log.layouts(decision.inputs)}"
    cost = f"redistributes {log.size(decision.cost)} per device" if decision.cost else "no communication"
    if not decision.direct and not decision.cost:
        cost = "local redistributes, no communication"
    log.rules.info("%s: %s%s -> %s (%s)", name, current, needed, decision.output, cost)
    if log.rules.isEnabledFor(logging.DEBUG):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        out = ", ".join(str(tuple(s)) for s in decision.out_shapes)
        log.rules.debug("  %s: shapes %s -> %s on %s", name, shapes, out, decision.output.mesh)
        for i, (t, steps) in enumerate(zip(tensors, decision.steps)):
            if steps:
                moves = ", ".join(str(step) for step in steps)
                log.rules.debug(
                    "  %s: input %d %s -> %s by %s", name, i, t.sharding, decision.inputs[i], moves
                )


@torch._dynamo.assume_constant_result
def _decision_key(index: int) -> tuple:
    """A decision as constants Dynamo takes (layouts by key, dtypes by name); rebuilt in the
    graph by :func:`_rebuilt`, so its layouts are values the graph knows."""
    d = _TRACED_DECISIONS[index]
    return (
        tuple([layout_key(layout) for layout in d.inputs]),
        d.fits,
        d.pvary,
        layout_key(d.output),
        tuple([tuple(s) for s in d.out_shapes]),
        tuple([str(t) for t in d.out_dtypes]),
        (d.call.shapes, d.call.out_shape, d.call.params),
        d.padded,
        d.context.lead,
        d.context.align,
    )


def _rebuilt(key: tuple) -> Decision:
    inputs, fits, pvary, output, out_shapes, out_dtypes, call, padded, lead, align = key
    decision = Decision(
        tuple([layout_of_key(k) for k in inputs]),
        fits,
        pvary,
        layout_of_key(output),
        tuple([torch.Size(s) for s in out_shapes]),
        tuple([_dtype(t) for t in out_dtypes]),
        rules.Call(*call),
        (),
        Fraction(0),
        padded,
        None,
        all(fits),
        any(pvary),
    )
    return decision._replace(context=Context(lead, decision, align))


def _constant_arg(item):
    if isinstance(item, tuple) and item[:1] == ("fd.DTensor",):
        _, key, shape, dtype, requires_grad = item
        storage = torch.empty(0, dtype=_dtype(dtype), device="meta").requires_grad_(requires_grad)
        return DTensor(storage, layout_of_key(key), shape)
    if isinstance(item, tuple) and item[:1] == ("dtype",):
        return _dtype(item[1])
    return item


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def unsupported_while_compiling(name: str, *, rule: bool = True) -> FunctionalDTensorError:
    if not rule:
        return FunctionalDTensorError(
            explain(
                f"torch.{name} (under torch.compile)",
                "an op without a sharding rule runs on replicated inputs in eager mode only",
                expected="an op with a rule (docs: Global operations)",
                got=f"{name} in a compiled function",
                fix="call it outside the compiled function, give it a rule with fd.register_sharding, "
                "or run it inside fd.shard_map / fd.local_map",
            )
        )
    return FunctionalDTensorError(
        explain(
            f"torch.{name} (under torch.compile)",
            "a call with nested arguments (lists, slices) is decided outside the graph only in eager mode",
            expected="values, numbers, dtypes and sizes as arguments",
            got="nested arguments",
            fix="call it outside the compiled function, or inside fd.shard_map / fd.local_map",
        )
    )


def _zero_padding(storage: torch.Tensor, layout: Layout, shape) -> torch.Tensor:
    """The padding of stacked uneven blocks zeroed (an op may have written into it)."""
    return storage.masked_fill(~valid_mask(layout, shape, str(storage.device)), 0)


#: decisions by call: (op, layouts, shapes, dtypes, other arguments) -> Decision
_DECISIONS = Bounded(16384, "global ops: decisions")


def _on_mesh(value, mesh):
    if isinstance(value, torch.Tensor) and value.device.type != mesh.device_type:
        return value.to(mesh.device_type)
    return value


# --- users' own rules -------------------------------------------------------------------------


class GlobalShape(tuple):
    """The global shape of an ``fd.DTensor`` argument, as a user's rule sees it: a tuple of
    ints (``x[0]``, ``len(x)``) that also answers ``x.ndim`` and ``x.shape``, as torch's
    ``DTensorSpec`` does in torch's own strategy style."""

    @property
    def ndim(self) -> int:
        return len(self)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self)


def register_sharding(op):
    """Give ``op`` (a torch function, or a ``torch.library`` custom op) a sharding rule, as a
    decorator of the rule (torch DTensor's ``register_sharding`` as the model).

    The rule is called with the op's arguments, each ``fd.DTensor`` replaced by its global
    shape (a tuple of ints with ``.ndim`` and ``.shape``), and returns the acceptable layouts on
    one mesh axis: a list of ``(output placement, input placements)``, one input placement per
    ``fd.DTensor`` argument in order (``None`` for other arguments may be included and is
    skipped). torch's style is taken as it is: ``([output placement], [input placements])``. The op then runs
    on each device's shard (on the simulated backend once per device, on its own unpadded
    shard), after the cheapest redistribute to one of the layouts, as every global op.

    >>> import torch, functional_dtensor as fd
    >>> @torch.library.custom_op("fd_doc::scale_rows", mutates_args=())
    ... def scale_rows(x: torch.Tensor) -> torch.Tensor:
    ...     return x * torch.arange(1, x.shape[-1] + 1, dtype=x.dtype)
    >>> @scale_rows.register_fake
    ... def _(x):
    ...     return torch.empty_like(x)
    >>> @fd.register_sharding(scale_rows)
    ... def _(x):  # rows may be split; the last dim must be whole
    ...     return [(fd.Shard(0), [fd.Shard(0)]), (fd.Replicate(), [fd.Replicate()])]
    >>> mesh = fd.simulated_mesh(2, "x")
    >>> x = fd.distribute_tensor(torch.ones(4, 3), mesh, fd.P(None, "x"))
    >>> y = scale_rows(x)
    >>> y.placements, y.full_tensor()[0]
    ((Shard(dim=0),), tensor([1., 2., 3.]))
    """

    def decorate(user_rule):
        def params(args, kwargs, tensors):
            shapes = optree.tree_map(
                lambda v: GlobalShape(v.shape) if isinstance(v, DTensor) else v,
                (args, kwargs),
                none_is_leaf=True,
                namespace=NAMESPACE,
            )
            return shapes

        def rule(call):
            args, kwargs = call.params
            options = []
            for output, inputs in user_rule(*args, **kwargs):
                if isinstance(output, (list, tuple)):  # torch's style: a placement per output
                    (output,) = output
                placements = tuple(p for p in inputs if p is not None)
                options.append(rules.Option(placements, output))
            return options

        name = getattr(op, "__name__", None) or getattr(op, "_name", None) or repr(op)
        handler = Handler(rule, params, _per_device, name)
        register(_forms_of(op), handler)
        return user_rule

    return decorate


def _forms_of(op) -> list:
    """An op and the forms it is called by (a custom op's overload packet and default)."""
    forms = [op]
    for name in ("_opoverload", "default"):
        form = getattr(op, name, None)
        if form is not None:
            forms.append(form)
    packet = getattr(getattr(op, "_opoverload", None), "overloadpacket", None)
    if packet is not None:
        forms.append(packet)
    return forms


def _per_device(func, args, kwargs, ctx):
    """A user's op, run on each device's own shard: on stacked storage once per device, on
    its unpadded shard, the result padded back."""
    if not ctx.lead:
        return func(*args, **kwargs)
    decision = ctx.decision
    leaves, tree = optree.tree_flatten((args, kwargs), none_is_leaf=True, namespace=NAMESPACE)
    positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.dim() >= 1]
    tables = [shard_table(layout, shape) for layout, shape in zip(decision.inputs, decision.call.shapes)]
    out_table = shard_table(decision.output, decision.out_shapes[0])
    outs = []
    for device in range(decision.output.mesh.size):
        local = list(leaves)
        for position, table in zip(positions, tables):
            block = leaves[position][device]
            local[position] = block[tuple(slice(0, n) for n in table.local_shapes[device])]
        a, k = tree.unflatten(local)
        out = func(*a, **k)
        pad = [
            p for n, full in zip(reversed(out.shape), reversed(out_table.padded_shape)) for p in (0, full - n)
        ]
        outs.append(F.pad(out, pad) if any(pad) else out)
    return torch.stack(outs)


def decision_for(func, args, kwargs) -> tuple[str, list[DTensor], Decision]:
    """The decision ``func`` would take on these arguments (nothing runs): its name, the
    ``fd.DTensor`` inputs and the decision."""
    kwargs = kwargs or {}
    handler = _HANDLERS.get(func) or by_metadata(func)
    if handler is None:  # no rule: run on replicated inputs
        if fallback.is_strict():
            raise unsupported(func, strict=True)
        handler = Handler(fallback.all_replicated, no_params, None, fallback.name_of(func))
    if handler.rule is None and handler.explained_as is not None:
        func = handler.explained_as
        handler = _HANDLERS[func]
    if handler.rule is None:
        raise FunctionalDTensorError(
            explain(
                "fd.explain(op)",
                f"{handler.name} is a composite of other global ops",
                expected="an op with a rule of its own",
                got=handler.name,
                fix="explain the ops it is made of (e.g. matmul and add for linear)",
            )
        )
    leaves, _ = optree.tree_flatten((args, kwargs), none_is_leaf=True, namespace=NAMESPACE)
    tensors = [v for v in leaves if isinstance(v, DTensor)]
    if not tensors:
        raise InputTypeError(
            explain(
                "fd.explain(args)",
                "an op is explained for fd.DTensor inputs",
                expected="at least one fd.DTensor among the arguments",
                got="none",
                fix="pass the values you would call the op with",
            )
        )
    _check_values(handler.name, leaves, tensors)
    return handler.name, tensors, decide(func, handler, args, kwargs, tensors)

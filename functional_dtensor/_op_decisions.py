"""How a torch op on ``fd.DTensor`` is decided: the handlers by op (a rule, its parameters, the
op's local form), and the decision of one call -- the layouts the inputs need, the cheapest
redistributes to them, the output's layout, what the local form is given -- made once per
(op, argument structure, layouts, shapes, dtypes) and, while Dynamo traces, outside the graph
as constants it takes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import optree
import torch

from . import _log as log
from . import _rules as rules
from ._backend import Backend, backend_of
from ._cache import Numbered, cached
from ._dtensor import DTensor
from ._errors import InputTypeError, MeshError, ShapeError, explain
from ._layout import Layout
from ._placements import Replicate
from ._plan import Step, plan, step_bytes
from ._redistribute import layout_key, layout_of_key
from ._shard_map import NAMESPACE
from ._sharding import shard_table

__all__ = [
    "Handler",
    "Decision",
    "Context",
    "HANDLERS",
    "FUNCS",
    "FUNC_IDS",
    "GENERIC",
    "by_metadata",
    "register",
    "no_params",
    "resolved",
    "decide",
    "refused",
    "check_values",
    "log_decision",
    "traced_decision",
]


class Handler(NamedTuple):
    """How one op runs on ``fd.DTensor``: ``rule(call)`` its options per mesh axis (None: the op
    is a composite, ``local(func, args, kwargs, None)`` runs it on global values);
    ``params(args, kwargs, tensors)`` the rule's own arguments (hashable); ``local(func, args,
    kwargs, ctx)`` the op on one device's block (plain torch: ``args`` hold the inputs' blocks,
    ``ctx`` the :class:`Context`), and ``batched`` how the simulated backend runs it on every
    device's block at once. ``by_value``:
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
    # how the simulated backend runs ``local`` on every device's block at once: "leading" (the
    # local form itself: it counts dims from the end), the name of a batched form of
    # ._simulated.batched, or None (device by device)
    batched: str | None = None


HANDLERS: dict[Callable, Handler] = {}


FUNCS: list[Callable] = []  # every registered function, by a number Dynamo takes as a constant
FUNC_IDS: dict[Callable, int] = {}


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


def no_params(args, kwargs, tensors):
    """A handler's ``params`` for an op whose rule takes no arguments of its own."""
    return ()


def register(funcs: Sequence[Callable | None], handler: Handler) -> None:
    for func in funcs:
        if func is not None:
            HANDLERS[func] = handler
            if func not in FUNC_IDS:
                FUNC_IDS[func] = len(FUNCS)
                FUNCS.append(func)


def resolved(func) -> tuple[Handler, int]:
    """A registered function's handler and number, looked up once (for a method installed on
    ``fd.DTensor``: Dynamo does not find a Python-defined function such as ``Tensor.norm`` in a
    dictionary keyed by functions)."""
    return HANDLERS[func], FUNC_IDS[func]


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
    context: Context  # what the local op is given
    direct: bool  # every input fits: no redistribute
    pvary_any: bool  # some input's gradient is summed over axes


class Context(NamedTuple):
    """What a local form knows: the decision; whether some input has fewer dims than the
    output; whether every input's and output's blocks are of one size (no device's shorter);
    the device whose block it runs on (None: every device's at once, in a batched form); the
    backend that runs it; how the output is held once along its Replicate axes, where every
    input is replicated along them too (the op then runs once per distinct block: see
    :meth:`.Backend.held_plan`), else None; and for each input, whether its own blocks held
    once are held that way (replicated over no other axis)."""

    decision: Decision
    align: bool
    even: bool
    device: int | None
    backend: Backend
    held: Any = None
    held_fits: tuple[bool, ...] = ()


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
    out_shapes = tuple(torch.Size(o.shape) for o in outs)
    decision = Decision(
        inputs=tuple(required),
        fits=tuple(c == r for c, r in zip(current, required)),
        pvary=pvary,
        output=output,
        out_shapes=out_shapes,
        out_dtypes=tuple(o.dtype for o in outs),
        call=call,
        steps=tuple(steps for steps, _ in planned),
        cost=cost,
        context=None,
        direct=all(c == r for c, r in zip(current, required)),
        pvary_any=any(pvary),
    )
    return decision._replace(context=_context(decision))


def _context(decision: Decision) -> Context:
    shapes, out_shapes = decision.call.shapes, decision.out_shapes
    even = all(shard_table(layout, tuple(s)).is_even for layout, s in zip(decision.inputs, shapes))
    even = even and all(shard_table(decision.output, tuple(s)).is_even for s in out_shapes)
    backend = backend_of(decision.output.mesh)
    held = backend.held_plan(decision.output)
    if held is not None and not all(
        [isinstance(layout.placements[a], Replicate) for layout in decision.inputs for a in held.axes]
    ):
        held = None
    fits = () if held is None else tuple([backend.held_plan(layout) == held for layout in decision.inputs])
    return Context(
        decision=decision,
        align=any(len(s) < len(out_shapes[0]) for s in shapes),
        even=even,
        device=backend.device_index(decision.output.mesh),
        backend=backend,
        held=held,
        held_fits=fits,
    )


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


def check_values(name: str, leaves, tensors: list[DTensor]) -> None:
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
                    "sharded as you mean it: fd.distribute_tensor(t, mesh, fd.P('x')); take the "
                    "DTensor's global value with x.full_tensor(); or, where the tensor is the same on "
                    "every device, call the op inside fd.implicit_replication()",
                )
            )


_TRACED_DECISIONS = Numbered(4096, "global ops: decisions made while compiling")


@torch._dynamo.assume_constant_result
def _decision_index(func_id: int, names: tuple[str, ...], spec: tuple) -> int:
    """The decision of a flat call described by constants (a DTensor by its layout's key,
    shape, dtype and whether it needs a gradient; the last ``len(names)`` items keywords),
    made eagerly while Dynamo traces."""
    func = FUNCS[func_id]
    made = []

    def make() -> Decision:
        sequences = bool(spec) and type(spec[0]) is tuple and spec[0][:1] == ("sequences",)
        lengths = spec[0][1] if sequences else None
        leaves = [_constant_arg(item) for item in (spec if lengths is None else spec[1:])]
        values = leaves if lengths is None else nested(leaves, lengths)
        split = len(values) - len(names)
        args, kwargs = tuple(values[:split]), dict(zip(names, values[split:]))
        tensors = [a for a in leaves if type(a) is DTensor]
        handler = HANDLERS[func]
        check_values(handler.name, leaves, tensors)
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
            log_decision(handler.name, tensors, decision)
    return index


def log_decision(name: str, tensors: list[DTensor], decision: Decision) -> None:
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
    )


def _rebuilt(key: tuple) -> Decision:
    inputs, fits, pvary, output, out_shapes, out_dtypes, call = key
    decision = Decision(
        inputs=tuple([layout_of_key(k) for k in inputs]),
        fits=fits,
        pvary=pvary,
        output=layout_of_key(output),
        out_shapes=tuple([torch.Size(s) for s in out_shapes]),
        out_dtypes=tuple([_dtype(t) for t in out_dtypes]),
        call=rules.Call(*call),
        steps=(),
        cost=Fraction(0),
        context=None,
        direct=all(fits),
        pvary_any=any(pvary),
    )
    return decision._replace(context=_context(decision))


def nested(leaves: list, lengths: tuple) -> list:
    """The arguments whose flattened ``leaves`` were described with ``lengths`` (per
    argument, None for a leaf or ``(is_tuple, length)`` for a sequence of leaves)."""
    values, start = [], 0
    for length in lengths:
        if length is None:
            values.append(leaves[start])
            start += 1
        else:
            items = leaves[start : start + length[1]]
            values.append(tuple(items) if length[0] else list(items))
            start += length[1]
    return values


def _constant_arg(item):
    if isinstance(item, tuple) and item[:1] == ("fd.DTensor",):
        _, key, shape, dtype, requires_grad = item
        storage = torch.empty(0, dtype=_dtype(dtype), device="meta").requires_grad_(requires_grad)
        return DTensor(storage, layout_of_key(key), shape)
    if isinstance(item, tuple) and item[:1] == ("tensor",):
        return torch.empty(item[1], dtype=_dtype(item[2]), device="meta")
    if isinstance(item, tuple) and item[:1] == ("slice",):
        return slice(*item[1:])
    if isinstance(item, tuple) and item[:1] == ("dtype",):
        return _dtype(item[1])
    return item


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def traced_decision(func_id: int, names: tuple[str, ...], spec: tuple) -> Decision:
    """The decision of a flat call described by constants (see :func:`_decision_index`), as
    values the graph knows: made eagerly while Dynamo traces, rebuilt in the graph."""
    return _rebuilt(_decision_key(_decision_index(func_id, names, spec)))

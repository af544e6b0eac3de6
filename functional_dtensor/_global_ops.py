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
4. the op's local form -- plain torch on one device's block -- runs where the backend holds
   the blocks (:meth:`._backend.Backend.run_local`): on this rank's shard, or on every
   simulated device's at once by the op's batched form, or device by device.

:func:`explain_op` shows a decision without running it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import NamedTuple

import optree
import torch
from torch.overrides import TorchFunctionMode

from . import _fallback as fallback
from . import _log as log
from . import _varied as varied
from ._cache import Bounded
from ._dtensor import (
    DTensor,
    data_of,
    distribute_tensor,
    held_of,
    held_varied,
    new_held,
    new_value,
    new_value_eager,
    parts_of,
    storage_of,
)
from ._errors import FunctionalDTensorError, InputTypeError, explain
from ._op_decisions import (
    FUNC_IDS,
    HANDLERS,
    Decision,
    Handler,
    by_metadata,
    check_values,
    decide,
    log_decision,
    nested,
    no_params,
    traced_decision,
)
from ._op_inputs import held_locals, holds, input_storage, pvaried_locals, varied_inputs
from ._placements import Replicate
from ._redistribute import layout_key
from ._shard_map import NAMESPACE

__all__ = ["dispatch", "decision_for", "unsupported", "unsupported_while_compiling", "implicit_replication"]


_NUMBERS = (int, float, bool)
_VARIED = varied.TABLE  # the marks of ._varied (cleared and refilled in place, never rebound)


# --- dispatch ---------------------------------------------------------------------------------


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


def _is_flat(args, compiling: bool = False) -> bool:
    """Whether positional ``args`` are leaves as they are: values of :data:`_FLAT` types, or
    sizes (a tuple of ints, as ``x.unflatten(1, (2, 4))`` takes), or an index (``x[:, 0]``,
    described by :func:`_index_key`), or while ``compiling`` plain tensors, slices and ``...``
    (described by :func:`_described`)."""
    for a in args:
        if type(a) not in _FLAT and not (isinstance(a, tuple) and all([type(n) is int for n in a])):
            if compiling:
                if not (isinstance(a, (torch.Tensor, slice)) or a is Ellipsis):
                    return False
            elif type(a) is not tuple or _index_key(a) is None:
                return False
    return True


def _index_key(index: tuple) -> tuple | None:
    """A hashable description of ``index``, a tuple of ints, None, ``...`` and slices of ints
    (sizes and basic indexing); None where it holds anything else (a pytree then describes
    it). Slices are unhashable before Python 3.12."""
    described = []
    for item in index:
        kind = type(item)
        if kind is int or item is None or item is Ellipsis:
            described.append(item)
        elif kind is slice and all([b is None or type(b) is int for b in (item.start, item.stop, item.step)]):
            described.append((slice, item.start, item.stop, item.step))
        else:
            return None
    return tuple(described)


def dispatch(func, args, kwargs, found: tuple[Handler, int] | None = None):
    """``func(*args, **kwargs)`` where some arguments are ``fd.DTensor`` (``found``: its
    :func:`resolved` handler and number, where known)."""
    handler = HANDLERS.get(func) if found is None else found[0]
    if handler is None:
        handler = by_metadata(func)
        if handler is None:
            return _replicated(func, args, kwargs or {})
    if handler.rule is None:  # a composite of global ops, or an op on global values
        return handler.local(func, args, kwargs or {}, None)
    if torch.compiler.is_compiling():
        return _dispatch_tree(func, handler, args, kwargs or {}, found)
    # the common case, flat arguments (keywords too: dim=-1): one pass checks them, builds the key
    # and the local arguments, as _dispatch_tree builds them
    if kwargs:
        leaves, key = (*args, *kwargs.values()), [func, tuple(kwargs)]
    else:
        leaves, key = args, [func]
    local = []
    held = varies = False
    for value in leaves:
        kind = type(value)
        if kind is DTensor:
            storage = held_of(value)
            if storage is None:
                storage, layout, shape = parts_of(value)
                if _VARIED:  # (see .op_inputs.varied_inputs)
                    entry = _VARIED.get(id(storage))
                    varies = varies or entry is not None and entry[0] is storage
            else:  # held once (see .op_inputs.held_locals)
                layout, shape, held = value.sharding, value.shape, True
                varies = varies or bool(_VARIED and held_varied(value))
            key += (layout, shape, storage.dtype)
            local.append(storage)
        elif kind in _FLAT:
            key.append(value if handler.by_value or kind not in _NUMBERS else kind)
            local.append(value)
        elif kind is tuple and (described := _index_key(value)) is not None:  # sizes, an index
            key.append(described)
            local.append(value)
        else:
            return _dispatch_tree(func, handler, args, kwargs or {}, found)
    if handler.by_grad:  # (storages here: plain tensors, as the numbers are not)
        key.append(
            torch.is_grad_enabled() and any([type(v) is torch.Tensor and v.requires_grad for v in local])
        )
    decision = _DECISIONS.get(tuple(key))
    if decision is None or not decision.direct:
        return _dispatch_tree(func, handler, args, kwargs or {})
    ctx = decision.context
    plan = out_varied = None
    if (decision.pvary_any or varies) and torch.is_grad_enabled():  # (see .op_inputs.varied_inputs)
        if held:
            return _dispatch_tree(func, handler, args, kwargs or {})
        local, out_varied = pvaried_locals(leaves, local, decision)
    elif held:
        local = held_locals(leaves, local, ctx)
        if local is None:
            return _dispatch_tree(func, handler, args, kwargs or {})
        plan = ctx.held
    storages = local_kwargs = None  # (storages None: the tensors among the arguments, in order)
    if kwargs:
        local_kwargs = dict(zip(kwargs, local[len(args) :]))
        storages = [s for v, s in zip(leaves, local) if type(v) is DTensor]
        local = local[: len(args)]
    try:
        out = ctx.backend.run_local(
            handler.local, handler.batched, func, local, local_kwargs or {}, ctx, storages, plan
        )
    except FunctionalDTensorError:
        raise
    except _TORCH_ERRORS as error:
        raise _failed(handler.name, error) from error
    if plan is not None:
        return _wrap(out, decision, new_held)
    if out_varied:
        return _marked(_wrap(out, decision), out_varied)
    if type(out) is torch.Tensor:  # one output: the value
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


#: how many ``implicit_replication`` scopes are open (a list: changed in place, never rebound)
_IMPLICIT = [0]


@contextlib.contextmanager
def implicit_replication():
    """Inside, a plain ``torch.Tensor`` that meets ``fd.DTensor`` values in an op is taken as
    replicated on their mesh, as torch's ``implicit_replication`` and JAX's constants under
    ``jit`` are: a tensor made inside a sharded forward (positions, masks, a rotary table) is
    the same on every device by construction. ``fd.ShardedModule.apply`` runs the module's
    forward inside one. Outside, mixing them is an error (the library cannot know how the plain
    tensor is laid out).

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(2, "x")
    >>> x = fd.distribute_tensor(torch.ones(4, 3), mesh, fd.P("x"))
    >>> with fd.implicit_replication():
    ...     y = x + torch.arange(3.0)
    >>> y.placements, y.full_tensor()[0].tolist()
    ((Shard(dim=0),), [1.0, 2.0, 3.0])
    """
    _IMPLICIT[0] += 1
    try:
        if torch.compiler.is_compiling():
            with _SequenceArguments():
                yield
        else:
            yield
    finally:
        _IMPLICIT[0] -= 1


class _SequenceArguments(TorchFunctionMode):
    """While compiling, inside :func:`implicit_replication`: a torch call with an ``fd.DTensor``
    in a tuple argument (``torch.cat((a, b))``) goes to the global ops. Dynamo looks for
    ``__torch_function__`` on arguments and inside lists, not inside tuples."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, tuple) and any([isinstance(item, DTensor) for item in value]):
                return dispatch(func, args, kwargs)
        return func(*args, **kwargs)


def _plain(value) -> bool:
    """A plain tensor with dims (a 0-d one is a constant every op takes as it is)."""
    return isinstance(value, torch.Tensor) and type(value) is not DTensor and value.dim() > 0


def _replicas_of_plain(leaves: list, mesh) -> list:
    """``leaves`` with each plain tensor replicated on ``mesh`` (its gradient flowing back)."""
    replicated = [Replicate()] * mesh.ndim
    return [distribute_tensor(v, mesh, replicated, src_data_rank=None) if _plain(v) else v for v in leaves]


def _replicated(func, args, kwargs):
    """An op without a rule, on replicated inputs (:mod:`._fallback`)."""
    if torch.compiler.is_compiling():
        raise unsupported_while_compiling(getattr(func, "__name__", repr(func)), rule=False)
    leaves, tree = optree.tree_flatten((args, kwargs), none_is_leaf=True, namespace=NAMESPACE)
    tensors = [v for v in leaves if type(v) is DTensor]
    if not tensors:  # a DTensor inside a container optree does not walk: nothing to lay out
        raise unsupported(func)
    if _IMPLICIT[0] and any([_plain(v) for v in leaves]):
        leaves = _replicas_of_plain(leaves, tensors[0].device_mesh)
        tensors = [v for v in leaves if type(v) is DTensor]
    check_values(getattr(func, "__name__", repr(func)), leaves, tensors)
    return fallback.run_replicated(func, tensors, leaves, tree, unsupported, _failed)


def _wrap(out, decision: Decision, new=new_value):
    if type(out) is torch.Tensor:
        return new(out, decision.output, decision.out_shapes[0])
    values = [new(o, decision.output, shape) for o, shape in zip(out, decision.out_shapes)]
    return type(out)(*values) if hasattr(out, "_fields") else type(out)(values)


def _constant(value):
    """An int, or a tuple of them, as constants while Dynamo traces: a size Dynamo made dynamic
    (a second call with a new size) is specialized, so the decision, a function of constants,
    is made for it and the graph is guarded on it (``len(range(n))`` is a spelling Dynamo
    specializes)."""
    if type(value) is tuple:
        return tuple([_constant(n) for n in value])
    if type(value) is int:
        return len(range(value)) if value >= 0 else -len(range(-value))
    return value


def _described(value):
    """An argument as the constants a decision made while compiling takes (see
    :func:`._op_decisions.traced_decision`)."""
    if type(value) is DTensor:
        shape = _constant(tuple(value.shape))
        return ("fd.DTensor", layout_key(value.sharding), shape, str(value.dtype), value.requires_grad)
    if isinstance(value, torch.Tensor):  # a plain one: decided by dtype and shape, as eagerly
        return ("tensor", _constant(tuple(value.shape)), str(value.dtype))
    if isinstance(value, torch.dtype):
        return ("dtype", str(value))
    if isinstance(value, slice):
        return ("slice", _constant(value.start), _constant(value.stop), _constant(value.step))
    return _constant(value)


class _Sequences(NamedTuple):
    """Arguments (positional, then keywords) of which some are lists or tuples of leaves, as
    ``torch.cat((a, b))`` takes them: flattened and rebuilt while compiling, where optree's
    tree specs cannot be constants of a decision. ``lengths``: per argument, None for a leaf
    or ``(is_tuple, length)``."""

    lengths: tuple
    count: int  # of positional arguments
    names: tuple[str, ...]

    @staticmethod
    def of(name: str, args, kwargs) -> _Sequences:
        lengths = []
        for value in (*args, *kwargs.values()):
            if type(value) in (list, tuple) and _is_flat(value, True):
                lengths.append((type(value) is tuple, len(value)))
            elif _is_flat((value,), True):
                lengths.append(None)
            else:
                raise unsupported_while_compiling(name)
        return _Sequences(tuple(lengths), len(args), tuple(kwargs))

    def leaves(self, args, kwargs) -> list:
        out = []
        for value, length in zip((*args, *kwargs.values()), self.lengths):
            if length is None:
                out.append(value)
            else:
                out.extend(value)
        return out

    def unflatten(self, leaves) -> tuple[tuple, dict]:
        values = nested(leaves, self.lengths)
        return tuple(values[: self.count]), dict(zip(self.names, values[self.count :]))


def _dispatch_tree(func, handler: Handler, args, kwargs, found=None):
    """Any call: its arguments flattened as a pytree; redistributes and ``pvary`` where the
    decision needs them."""
    compiling = torch.compiler.is_compiling()
    flat = _is_flat(args, compiling) and _is_flat(kwargs.values(), compiling)  # keywords too: dim=-1
    names = tuple(kwargs)
    if flat:
        leaves, tree = (*args, *kwargs.values()), None
    elif compiling:  # decided outside the graph, from constants: sequences of leaves at most
        tree = _Sequences.of(handler.name, args, kwargs)
        leaves = tree.leaves(args, kwargs)
    else:
        leaves, tree = optree.tree_flatten((args, kwargs), none_is_leaf=True, namespace=NAMESPACE)
    tensors = [v for v in leaves if type(v) is DTensor]
    if _IMPLICIT[0] and tensors and any([_plain(v) for v in leaves]):
        leaves = _replicas_of_plain(leaves, tensors[0].device_mesh)
        tensors = [v for v in leaves if type(v) is DTensor]
        if tree is None:
            args, kwargs = tuple(leaves[: len(args)]), dict(zip(names, leaves[len(args) :]))
        else:
            args, kwargs = tree.unflatten(leaves)
    if compiling:
        spec = tuple([_described(v) for v in leaves])
        if tree is not None:
            spec = (("sequences", tree.lengths), *spec)
        func_id = FUNC_IDS[func] if found is None else found[1]
        decision = traced_decision(func_id, names, spec)
    else:
        key = [func] if flat and not names else [func, names] if flat else [func, tree]
        for value in leaves:
            if type(value) is DTensor:
                key += (value.sharding, value.shape, data_of(value).dtype)
            elif not handler.by_value and type(value) in _NUMBERS:
                key.append(type(value))
            elif flat:
                key.append(_index_key(value) if type(value) is tuple else value)
            else:
                key.append(_key_of(value))
        if handler.by_grad:
            key.append(_needs_grad(tensors))
        key = tuple(key)
        decision = _DECISIONS.get(key)
        if decision is None:
            check_values(handler.name, leaves, tensors)
            decision = _DECISIONS[key] = decide(func, handler, args, kwargs, tensors)
            if log.rules.isEnabledFor(logging.INFO):
                log_decision(handler.name, tensors, decision)
    grad = torch.is_grad_enabled()
    held = decision.context.held
    if held is not None and not holds(tensors):
        held = None
    if _VARIED and grad:
        storages, out_varied = varied_inputs(tensors, decision, held)
    else:
        out_varied = frozenset()
        storages = [input_storage(t, i, grad, held, decision) for i, t in enumerate(tensors)]
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
        ctx = decision.context
        out = ctx.backend.run_local(
            handler.local, handler.batched, func, local_args, local_kwargs, ctx, storages, held
        )
    except FunctionalDTensorError:
        raise
    except _TORCH_ERRORS as error:
        raise _failed(handler.name, error) from error
    if held is not None:
        return _wrap(out, decision, functools.partial(new_held, varied=out_varied))
    out = _wrap(out, decision)
    return _marked(out, out_varied) if out_varied else out


def _marked(out, axes: frozenset[str]):
    """The outputs ``out`` (a value or several), their storages marked varied over ``axes``."""
    for value in out if isinstance(out, (tuple, list)) else (out,):
        varied.mark(storage_of(value), axes)
    return out


#: the decisions made while Dynamo traces, by the number the graph holds
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
            "a call with deeply nested arguments is decided outside the graph only in eager mode",
            expected="values, plain tensors, numbers, dtypes, sizes, slices, or lists and tuples of these",
            got="arguments nested deeper (a list of lists, a dict, another container)",
            fix="call it outside the compiled function, or inside fd.shard_map / fd.local_map",
        )
    )


#: decisions by call: (op, layouts, shapes, dtypes, other arguments) -> Decision
_DECISIONS = Bounded(16384, "global ops: decisions")


def _on_mesh(value, mesh):
    if isinstance(value, torch.Tensor) and value.device.type != mesh.device_type:
        return value.to(mesh.device_type)
    return value


def decision_for(func, args, kwargs) -> tuple[str, list[DTensor], Decision]:
    """The decision ``func`` would take on these arguments (nothing runs): its name, the
    ``fd.DTensor`` inputs and the decision."""
    kwargs = kwargs or {}
    handler = HANDLERS.get(func) or by_metadata(func)
    if handler is None:  # no rule: run on replicated inputs
        if fallback.is_strict():
            raise unsupported(func, strict=True)
        handler = Handler(fallback.all_replicated, no_params, None, fallback.name_of(func))
    if handler.rule is None and handler.explained_as is not None:
        func = handler.explained_as
        handler = HANDLERS[func]
    if handler.rule is None:
        raise FunctionalDTensorError(
            explain(
                "fd.explain(op)",
                f"{handler.name} is a composite of other global ops",
                expected="an op with a rule of its own",
                got=handler.name,
                fix="explain the ops it is made of (e.g. matmul and add for addmm)",
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
    check_values(handler.name, leaves, tensors)
    return handler.name, tensors, decide(func, handler, args, kwargs, tensors)

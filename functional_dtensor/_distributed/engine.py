"""The distributed backend's per-device engine: each rank runs the per-device function once, on
its own shards; a collective runs its kernel on this rank's value.

A value the per-device function captures (a closure, a module parameter, an argument passed
through with spec ``None``) is held whole by every rank; its gradient is the sum of every
rank's contribution, as on the simulated backend (where vmap sums them) and in JAX (where
closed-over values are ``P()`` inputs). With ``check_rep`` the replication tracker sees to it;
without, :class:`CapturedValues` routes each captured tensor that may be differentiated through
:class:`_Captured` (identity forward, all-reduce backward), once per call.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .. import _autograd as autograd
from .._functorch import current_level, level_of, transforms_active
from .._op_args import replace_inputs, tensors_of
from . import kernels

__all__ = [
    "run_per_device",
    "apply",
    "apply_to_storage",
    "axis_index",
    "run_op",
    "RULED_OPS",
    "ops_mode",
    "leave",
]


def run_per_device(per_device, size: int, in_dims, inputs):
    """``per_device(level, None, *inputs)`` on this rank (``level``: that of the innermost
    transform in progress; no vmap over devices); every output is this rank's own. The mapped
    inputs (``in_dims`` not None) are the function's own values, the others captured."""
    level = current_level()
    if torch.compiler.is_compiling():  # no torch-function mode to follow the call (see ops_mode)
        outputs = per_device(level, None, *inputs)
        return outputs, [True] * len(outputs)
    _calls.append(_Call([v for v, d in zip(inputs, in_dims) if d is not None], level))
    try:
        outputs = per_device(level, None, *inputs)
    finally:
        _calls.pop()
    return outputs, [True] * len(outputs)


class _Call:
    """One call of a per-device function: the tensors that are its own values (its inputs, the
    results of its ops and collectives), the captured tensors routed so far, and the level of
    the innermost ``torch.func`` transform around the call (-1: none)."""

    __slots__ = ("own", "routed", "level")

    def __init__(self, inputs, level: int | None) -> None:
        self.own: dict[int, torch.Tensor] = {id(v): v for v in inputs if isinstance(v, torch.Tensor)}
        self.routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.level = -1 if level is None else level

    def captured(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a captured value that may be differentiated: not the function's own,
        and requiring grad, or wrapped by a transform around the call (a value wrapped by a
        transform inside the call is the function's own)."""
        if id(t) in self.routed:
            return True
        if id(t) in self.own:
            return False
        level = level_of(t)
        return t.requires_grad if level == -1 else level <= self.level

    def add(self, out) -> None:
        """Record an op's results as the function's own (held, so that no id is reused)."""
        if isinstance(out, torch.Tensor):
            self.own[id(out)] = out
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self.own[id(item)] = item


_calls: list[_Call] = []  # the calls in progress (shard_map does not nest: at most one)


def apply(op, x: torch.Tensor) -> torch.Tensor:
    """Run ``op`` on this rank's value (see :func:`.._autograd.run_collective`)."""
    with torch._C.DisableTorchFunction():
        out = autograd.run_collective(op, x, False)
    if _calls:
        _calls[-1].add(out)
    return out


apply_to_storage = apply


def axis_index(frame, axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's index along ``axes``, a 0-d value."""
    return kernels.axis_index(frame.mesh, axes, frame.mesh.device_type)


#: ops that :func:`run_op` runs otherwise than as they are: none
RULED_OPS: frozenset = frozenset()


def run_op(frame, func, args, kwargs, lift: bool):
    """Run a torch op of the per-device function: every value is this rank's own."""
    return func(*args, **kwargs)


def ops_mode(frame):
    """The torch-function mode of a per-device function run without replication tracking:
    :class:`CapturedValues` (none while compiling: ops run as they are)."""
    return None if torch.compiler.is_compiling() else CapturedValues(frame)


class CapturedValues(TorchFunctionMode):
    """Route each captured tensor that may be differentiated through :class:`_Captured` where
    an op first uses it in a call, so that its gradient sums every rank's contribution; record
    every op's results as the function's own."""

    def __init__(self, frame) -> None:
        super().__init__()
        self.frame = frame

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _calls or not (torch.is_grad_enabled() or transforms_active()):
            return func(*args, **kwargs)
        call = _calls[-1]
        own = call.own
        for t in tensors_of(args, kwargs):
            if id(t) not in own and call.captured(t):
                args, kwargs = replace_inputs(func, args, kwargs, lambda v: self._routed(call, v))
                break
        out = func(*args, **kwargs)
        if type(out) is torch.Tensor:
            own[id(out)] = out
        else:
            call.add(out)
        return out

    def _routed(self, call: _Call, v: torch.Tensor) -> torch.Tensor:
        if not call.captured(v):
            return v
        found = call.routed.get(id(v))
        if found is None:  # the captured value is held with it: its id is not reused
            found = call.routed[id(v)] = (v, autograd.apply(_Captured, v, self.frame))
        return found[1]


@autograd.compilable
class _Captured(torch.autograd.Function):
    """Identity forward: a captured value, held whole by every rank. Backward: the cotangents
    of every rank summed (:class:`_SumOverRanks`, whose own backward is this again)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, frame):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.frame = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_SumOverRanks, g, ctx.frame), None

    @staticmethod
    def jvp(ctx, t, _frame):
        return autograd.apply(_Captured, t, ctx.frame)


@autograd.compilable
class _SumOverRanks(torch.autograd.Function):
    """The sum over every rank of the mesh (an all-reduce); backward: :class:`_Captured`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(g, frame):
        mesh = frame.mesh
        return frame.backend.all_reduce(g, mesh, mesh.axis_names, "sum")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.frame = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return autograd.apply(_Captured, g, ctx.frame), None

    @staticmethod
    def jvp(ctx, t, _frame):
        return autograd.apply(_SumOverRanks, t, ctx.frame)


def leave(value, replicated: bool, frame):
    """An output of the per-device function: this rank's value as it is."""
    return value

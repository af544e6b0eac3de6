"""Replication tracking for ``shard_map(check_rep=True)``.

While the per-device function runs, a torch-function mode follows every op: the result varies
over the union of the axes its tensor inputs vary over (random ops: over every axis). Where an
op mixes a value replicated over some axis with one varying over it, the replicated input is
passed through :func:`pvary` first: nothing changes forward, and its gradient is summed over
that axis, which is exactly the communication a replicated value's gradient needs. That makes
every other transpose cheap (``psum`` transposes to a broadcast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._C._functorch import maybe_current_level, maybe_get_level
from torch.overrides import TorchFunctionMode

from ._backends.simulated_batching import by_rule
from ._collectives import on_devices, vary
from ._context import Frame
from ._errors import FunctionalDTensorError, explain
from ._varying import axes_varying, tag

__all__ = ["ReplicationTracker"]

_RANDOM = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.bernoulli,
    torch.normal,
    torch.multinomial,
    torch.poisson,
    torch.randperm,
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.bernoulli_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
}

_IN_PLACE = {
    getattr(torch.Tensor, name)
    for name in dir(torch.Tensor)
    if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.Tensor, name, None))
}


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [item for item in value if isinstance(item, torch.Tensor)]
    return found


class ReplicationTracker(TorchFunctionMode):
    """Propagate the varying axes of local values through every torch op."""

    def __init__(self, frame: Frame, level: int | None) -> None:
        super().__init__()
        self.frame = frame
        self.all_axes = frozenset(frame.mesh.axis_names)
        self.level = level  # the functorch level the per-device function runs at
        self.device_level = frame.device_level  # simulated backend: the level of the device dim
        self.compiling = torch.compiler.is_compiling()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if not self.compiling and maybe_current_level() != self.level:
            raise FunctionalDTensorError(
                explain(
                    "fd.shard_map(check_rep=True)",
                    "replication is not tracked through torch.func transforms inside the per-device function",
                    expected="torch.func.vmap/grad/vjp applied to the shard_map'd function",
                    got=f"{getattr(func, '__name__', func)} run under a transform inside it",
                    fix="pass check_rep=False, or apply the transform outside shard_map",
                )
            )
        tensors = _tensors(args, kwargs)
        varying, mixed = frozenset(), False
        if tensors:
            varying = axes_varying(tensors[0])
            for tensor in tensors:
                axes = axes_varying(tensor)
                if axes != varying:
                    mixed, varying = True, varying | axes
        if func in _RANDOM:
            varying = self.all_axes
        elif mixed:
            args, kwargs = self._pvary_inputs(func, args, kwargs, varying)
        out = None
        if self.device_level is not None:
            if varying != self.all_axes and len(tensors) > 1:
                args, kwargs = self._lift_inputs(func, args, kwargs)
            out = by_rule(func, self.device_level, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        if varying:
            if isinstance(out, torch.Tensor):
                tag(out, varying)
            elif isinstance(out, (tuple, list)):
                for item in out:
                    if isinstance(item, torch.Tensor):
                        tag(item, varying)
        return out

    def _lift_inputs(self, func, args, kwargs):
        """On the simulated backend, where values the same on every device meet per-device
        values, make them per-device copies first: broadcasting alone would sum their gradient
        over the devices along which they are replicated."""
        level = self.device_level
        levels = [maybe_get_level(t) == level for t in _tensors(args, kwargs)]
        if all(levels) or not any(levels):
            return args, kwargs

        def lift(value):
            return value if maybe_get_level(value) == level else on_devices(value, self.frame)

        return _replace_inputs(func, args, kwargs, lift)

    def _pvary_inputs(self, func, args, kwargs, varying):
        def lift(value):
            missing = varying - axes_varying(value)
            return vary(value, self.frame, tuple(sorted(missing))) if missing else value

        return _replace_inputs(func, args, kwargs, lift)


def _replace_inputs(func, args, kwargs, replace):
    """``args`` and ``kwargs`` with every tensor (also inside lists and tuples) passed through
    ``replace``, except the tensor an in-place method writes to."""

    def each(value):
        if isinstance(value, torch.Tensor):
            return replace(value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)([each(v) for v in value])
        return value

    in_place = func in _IN_PLACE
    args = tuple([a if in_place and i == 0 else each(a) for i, a in enumerate(args)])
    return args, ({k: each(v) for k, v in kwargs.items()} if kwargs else kwargs)

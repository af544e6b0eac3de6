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
from ._collectives import on_devices, pvary
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

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.compiler.is_compiling() and maybe_current_level() != self.level:
            raise FunctionalDTensorError(
                explain(
                    "fd.shard_map(check_rep=True)",
                    "replication is not tracked through torch.func transforms inside the per-device function",
                    expected="torch.func.vmap/grad/vjp applied to the shard_map'd function",
                    got=f"{getattr(func, '__name__', func)} run under a transform inside it",
                    fix="pass check_rep=False, or apply the transform outside shard_map",
                )
            )
        found = [axes_varying(t) for t in _tensors(args, kwargs)]
        varying = frozenset().union(*found) if found else frozenset()
        if func in _RANDOM:
            varying = self.all_axes
        elif varying and any(v != varying for v in found):
            args, kwargs = self._pvary_inputs(func, args, kwargs, varying)
        if self.frame.device_level is not None and varying != self.all_axes and len(found) > 1:
            args, kwargs = self._lift_inputs(func, args, kwargs)
        out = None
        if self.frame.device_level is not None:
            out = by_rule(func, self.frame.device_level, args, kwargs)
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
        level = self.frame.device_level
        levels = [maybe_get_level(t) == level for t in _tensors(args, kwargs)]
        if all(levels) or not any(levels):
            return args, kwargs

        def lift(value, position):
            if isinstance(value, torch.Tensor):
                if maybe_get_level(value) != level and not (func in _IN_PLACE and position == 0):
                    return on_devices(value, self.frame)
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                return type(value)(lift(v, -1) for v in value)
            return value

        return tuple(lift(a, i) for i, a in enumerate(args)), {k: lift(v, -1) for k, v in kwargs.items()}

    @staticmethod
    def _pvary_inputs(func, args, kwargs, varying):
        in_place = func in _IN_PLACE

        def lift(value, position):
            if isinstance(value, torch.Tensor):
                missing = varying - axes_varying(value)
                if missing and not (in_place and position == 0):
                    return pvary(value, tuple(sorted(missing)))
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                return type(value)(lift(v, -1) for v in value)
            return value

        args = tuple(lift(a, i) for i, a in enumerate(args))
        kwargs = {k: lift(v, -1) for k, v in kwargs.items()}
        return args, kwargs

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
from torch.overrides import TorchFunctionMode

from ._collectives import pvary
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


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


class ReplicationTracker(TorchFunctionMode):
    """Propagate the varying axes of local values through every torch op."""

    def __init__(self, axis_names: tuple[str, ...]) -> None:
        super().__init__()
        self.all_axes = frozenset(axis_names)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = [axes_varying(t) for t in _tensors(args, kwargs)]
        varying = frozenset().union(*found) if found else frozenset()
        if func in _RANDOM:
            varying = self.all_axes
        elif varying and any(v != varying for v in found):
            args, kwargs = self._pvary_inputs(func, args, kwargs, varying)
        out = func(*args, **kwargs)
        if varying:
            if isinstance(out, torch.Tensor):
                tag(out, varying)
            elif isinstance(out, (tuple, list)):
                for item in out:
                    if isinstance(item, torch.Tensor):
                        tag(item, varying)
        return out

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

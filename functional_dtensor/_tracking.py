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

from ._backend import current_level
from ._collectives import vary
from ._context import Frame
from ._errors import FunctionalDTensorError, explain
from ._functorch import current_level_eager
from ._op_args import replace_inputs, tensors_of
from ._varying import axes_varying, tag

__all__ = ["ReplicationTracker"]

#: a dict, not a set: a compiled graph guards one key of a dict, every member of a set
_RANDOM = dict.fromkeys(
    [
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
    ]
)

_NO_AXES: frozenset[str] = frozenset()


class ReplicationTracker(TorchFunctionMode):
    """Propagate the varying axes of local values through every torch op."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame
        self.all_axes = frozenset(frame.mesh.axis_names)
        self.level = frame.level  # the functorch level the per-device function runs at
        self.run_op, self.ruled_ops = frame.backend.run_op, frame.backend.ruled_ops
        # (for shard_map's bare calls) whether an op of ruled_ops ran, and whether a value was
        # passed through pvary where it met values varying over more axes
        self.ruled_seen = self.pvaried_seen = False
        # (made while compiling, it runs only there: levels count the layers there)
        self.level_now = current_level if torch.compiler.is_compiling() else current_level_eager

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.level_now() != self.level:
            raise FunctionalDTensorError(
                explain(
                    "fd.shard_map(check_rep=True)",
                    "replication is not tracked through torch.func transforms inside the per-device function",
                    expected="torch.func.vmap/grad/vjp applied to the shard_map'd function",
                    got=f"{getattr(func, '__name__', func)} run under a transform inside it",
                    fix="pass check_rep=False, or apply the transform outside shard_map",
                )
            )
        tensors = tensors_of(args, kwargs)
        varying, mixed = _NO_AXES, False
        if tensors:
            varying = axes_varying(tensors[0])
            if len(tensors) > 1:
                for tensor in tensors:
                    axes = axes_varying(tensor)
                    if axes != varying:
                        mixed, varying = True, varying | axes
        if func in _RANDOM:
            varying = self.all_axes
        elif mixed:
            args, kwargs = self._pvary_inputs(func, args, kwargs, varying)
        lift = len(tensors) > 1 and varying != self.all_axes
        ruled = func in self.ruled_ops
        if ruled:
            self.ruled_seen = True
        if lift or ruled:
            out = self.run_op(self.frame, func, args, kwargs, lift)
        else:  # (most ops: as they are)
            out = func(*args, **kwargs)
        if varying:
            if isinstance(out, torch.Tensor):
                tag(out, varying)
            elif isinstance(out, (tuple, list)):
                for item in out:
                    if isinstance(item, torch.Tensor):
                        tag(item, varying)
        return out

    def _pvary_inputs(self, func, args, kwargs, varying):
        def lift(value):
            missing = varying - axes_varying(value)
            if not missing:
                return value
            self.pvaried_seen = True
            return vary(value, self.frame, tuple(sorted(missing)))

        return replace_inputs(func, args, kwargs, lift)

"""The distributed backend's per-device engine: each rank runs the per-device function once, on
its own shards; a collective runs its kernel on this rank's value."""

from __future__ import annotations

import torch

from .. import _autograd as autograd
from .._simulated.functorch import current_level
from . import kernels

__all__ = ["run_per_device", "apply", "apply_to_storage", "axis_index", "run_op", "ops_mode", "leave"]


def run_per_device(per_device, size: int, in_dims, inputs):
    """``per_device(level, None, *inputs)`` on this rank (``level``: that of the innermost
    transform in progress; no vmap over devices); every output is this rank's own."""
    outputs = per_device(current_level(), None, *inputs)
    return outputs, [True] * len(outputs)


def apply(op, x: torch.Tensor) -> torch.Tensor:
    """Run ``op`` on this rank's value: under autograd (or a transform, or the compiler)
    through :class:`.._autograd.Collective`, else directly (a transpose in backward, or no
    gradient wanted)."""
    with torch._C.DisableTorchFunction():
        if autograd.differentiated(x):
            return autograd.apply(autograd.Collective, x, op, False)
        out = op.run(x)
        return x.view_as(x) if out is x else out


apply_to_storage = apply


def axis_index(frame, axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's index along ``axes``, a 0-d value."""
    return kernels.axis_index(frame.mesh, axes, frame.mesh.device_type)


def run_op(frame, func, args, kwargs, lift: bool):
    """Run a torch op of the per-device function: every value is this rank's own."""
    return func(*args, **kwargs)


def ops_mode(frame):
    """No torch-function mode: ops run as they are."""
    return None


def leave(value, replicated: bool, frame):
    """An output of the per-device function: this rank's value as it is."""
    return value

"""Every call into functorch's internals that the package makes, in one module (a torch upgrade
that moves them touches this file alone).

The simulated backend runs a per-device function under a vmap over the devices; a *level* is
functorch's number for one transform in progress (the device vmap, or a user's own
``torch.func`` transform), counted from 1 outward in.
"""

from __future__ import annotations

import torch
from torch._C._functorch import (
    _add_batch_dim,
    _remove_batch_dim,
    _unwrap_batched,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    maybe_current_level,
    maybe_get_level,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
)
from torch._functorch.vmap import lazy_load_decompositions

__all__ = [
    "transforms_active",
    "current_level",
    "level_of",
    "batched_at",
    "memory_of",
    "is_transformed",
    "add_batch_dim",
    "unwrap_batched",
    "below_current_level",
    "over_devices",
]


def transforms_active() -> bool:
    """Whether any ``torch.func`` transform is in progress."""
    return torch._C._are_functorch_transforms_active()


def current_level() -> int | None:
    """The level of the innermost transform in progress (None outside any)."""
    return maybe_current_level()


def level_of(x: torch.Tensor) -> int:
    """The level of the outermost transform that wraps ``x`` (-1 for a plain tensor)."""
    return maybe_get_level(x)


def batched_at(x: torch.Tensor, level: int) -> bool:
    """Whether ``x`` is batched by the vmap at ``level`` (looking through inner wrappers)."""
    while is_functorch_wrapped_tensor(x):
        current = maybe_get_level(x)
        if current == level:
            return is_batchedtensor(x)
        if current < level:
            return False
        x = get_unwrapped(x)
    return False


def memory_of(x: torch.Tensor) -> int:
    """The address of the memory that holds ``x``'s elements, looking through every functorch
    wrapper (a view shares its base's); 0 for a tensor without memory of its own."""
    while is_functorch_wrapped_tensor(x):
        x = get_unwrapped(x)
    try:
        return x.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass or a fake tensor
        return 0


def is_transformed(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``torch.func`` transform's wrapper (valid only while it runs)."""
    return is_functorch_wrapped_tensor(x)


def add_batch_dim(x: torch.Tensor, dim: int, level: int) -> torch.Tensor:
    """``x`` seen from inside the vmap at ``level``, batched over its dim ``dim``."""
    return _add_batch_dim(x, dim, level)


def unwrap_batched(x: torch.Tensor, level: int) -> tuple[torch.Tensor, int | None]:
    """The tensor below the vmap at ``level`` and the dim it is batched over."""
    return _unwrap_batched(x, level)


def below_current_level(fn, *args):
    """``fn(*args)`` with the innermost transform popped: run on the values below it."""
    saved = pop_dynamic_layer_stack()
    try:
        return fn(*args)
    finally:
        push_dynamic_layer_stack(saved)


def over_devices(per_device, size: int, in_dims, inputs):
    """``torch.func.vmap(per_device, in_dims, randomness="different")(*inputs)`` with
    functorch's batching primitives called directly (the inputs are flat already: vmap's pytree
    handling is pure overhead). ``per_device`` receives the vmap's level first. Outputs not
    batched over the devices come back as they are; returns the outputs and whether each was
    batched."""
    if torch.compiler.is_compiling():
        outputs = torch.func.vmap(
            lambda *a: per_device(maybe_current_level(), *a), in_dims=in_dims, randomness="different"
        )(*inputs)
        return outputs, [True] * len(outputs)
    if not _decompositions_loaded:
        _load_decompositions()
    level = _vmap_increment_nesting(size, "different")
    try:
        outputs = per_device(
            level, *[v if d is None else _add_batch_dim(v, d, level) for v, d in zip(inputs, in_dims)]
        )
        batched = [v is not None and maybe_get_level(v) == level for v in outputs]
        return [_remove_batch_dim(v, level, size, 0) if b else v for v, b in zip(outputs, batched)], batched
    finally:
        _vmap_decrement_nesting()


_decompositions_loaded = False


def _load_decompositions() -> None:
    """The Python decompositions vmap needs for some ops, registered once (as vmap does)."""
    global _decompositions_loaded
    lazy_load_decompositions()
    _decompositions_loaded = True

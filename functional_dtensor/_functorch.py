"""Every call into functorch's internals that the package makes, in one module (a torch upgrade
that moves them touches this file alone).

The simulated backend runs a per-device function under a vmap over the devices; a *level* is
functorch's number for one transform in progress (the device vmap, or a user's own
``torch.func`` transform), counted from 1 outward in.

While ``torch.compile`` traces, each function takes the calls Dynamo can trace: the device vmap
is entered by ``vmap_increment_nesting`` with functorch's predispatch wrappers, the current level
is the depth of the transform stack (levels count its layers; Dynamo folds the depth to a
constant), and a tensor is at the current level if it is batched at all: the device vmap is the
innermost transform wherever the engine asks, since it refuses collectives under a user's
transform inside the per-device function while compiling.
"""

from __future__ import annotations

import torch
from torch._C._functorch import (
    _add_batch_dim,
    _remove_batch_dim,
    _unwrap_batched,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
    get_dynamic_layer_stack_depth,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    maybe_current_level,
    maybe_get_level,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
)
from torch._functorch import predispatch
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch._functorch.vmap import lazy_load_decompositions, vmap_increment_nesting

__all__ = [
    "transforms_active",
    "current_level",
    "current_level_eager",
    "level_of",
    "level_of_eager",
    "batched_at",
    "memory_of",
    "is_transformed",
    "add_batch_dim",
    "unwrap_batched",
    "remove_batch_dim",
    "below_current_level",
    "over_devices",
]


def transforms_active() -> bool:
    """Whether any ``torch.func`` transform is in progress."""
    return torch._C._are_functorch_transforms_active()


def current_level() -> int | None:
    """The level of the innermost transform in progress (None outside any)."""
    if torch.compiler.is_compiling():  # levels count the layers: Dynamo folds the depth
        return get_dynamic_layer_stack_depth() or None
    return maybe_current_level()


#: :func:`current_level` where nothing is being compiled: functorch's own call (a tracker of
#: every op made eagerly reads it per op)
current_level_eager = maybe_current_level


def level_of(x: torch.Tensor) -> int:
    """The level of the outermost transform that wraps ``x`` (-1 for a plain tensor)."""
    if torch.compiler.is_compiling():
        return get_dynamic_layer_stack_depth() if is_batchedtensor(x) else -1
    return maybe_get_level(x)


#: :func:`level_of` where nothing is being compiled: functorch's own call
level_of_eager = maybe_get_level


def batched_at(x: torch.Tensor, level: int) -> bool:
    """Whether ``x`` is batched by the vmap at ``level`` (looking through inner wrappers)."""
    if torch.compiler.is_compiling():
        return is_batchedtensor(x)
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
    if torch.compiler.is_compiling():  # the wrapper Dynamo puts in the graph
        return predispatch._add_batch_dim(x, dim, level)
    return _add_batch_dim(x, dim, level)


def unwrap_batched(x: torch.Tensor, level: int) -> tuple[torch.Tensor, int | None]:
    """The tensor below the vmap at ``level`` and the dim it is batched over."""
    return _unwrap_batched(x, level)


def remove_batch_dim(x: torch.Tensor, level: int, size: int) -> torch.Tensor:
    """The tensor below the vmap at ``level`` (of ``size``), batched over its dim 0."""
    if torch.compiler.is_compiling():  # the wrapper Dynamo puts in the graph
        return predispatch._remove_batch_dim(x, level, size, 0)
    return _remove_batch_dim(x, level, size, 0)


def below_current_level(fn, *args):
    """``fn(*args)`` with the innermost transform popped: run on the values below it."""
    if torch.compiler.is_compiling():
        with retrieve_current_functorch_interpreter().lower():
            return fn(*args)
    saved = pop_dynamic_layer_stack()
    try:
        return fn(*args)
    finally:
        push_dynamic_layer_stack(saved)


def over_devices(per_device, size: int, in_dims, inputs):
    """``torch.func.vmap(per_device, in_dims, randomness="different")(*inputs)`` with
    functorch's batching primitives called directly (the inputs are flat already: vmap's pytree
    handling is pure overhead). ``per_device`` receives the vmap's level twice first, as the
    level the function runs at and as the level of the device vmap (the simulated engine's
    ``run_per_device`` protocol). Outputs not batched over the devices come back as they are;
    returns the outputs and whether each was batched. Eagerly the primitives are called as they
    are, in plain loops: a warm ``shard_map`` call pays for each Python frame around them."""
    if torch.compiler.is_compiling():  # the context manager and wrappers Dynamo traces
        with vmap_increment_nesting(size, "different") as level:
            entered = [v if d is None else add_batch_dim(v, d, level) for v, d in zip(inputs, in_dims)]
            outputs = per_device(level, level, *entered)
            batched = [v is not None and level_of(v) == level for v in outputs]
            return [remove_batch_dim(v, level, size) if b else v for v, b in zip(outputs, batched)], batched
    level = _vmap_increment_nesting(size, "different")
    try:
        entered = []
        for v, d in zip(inputs, in_dims):
            entered.append(v if d is None else _add_batch_dim(v, d, level))
        results, batched = [], []
        for v in per_device(level, level, *entered):
            if v is not None and maybe_get_level(v) == level:
                results.append(_remove_batch_dim(v, level, size, 0))
                batched.append(True)
            else:
                results.append(v)
                batched.append(False)
        return results, batched
    finally:
        _vmap_decrement_nesting()


lazy_load_decompositions()  # the Python decompositions vmap needs for some ops (as vmap loads them)

"""Inputs are values: a per-device function must not write into its inputs (JAX semantics).

Their memory is the caller's tensor or ``fd.DTensor`` on the distributed backend, and every
device's block at once on the simulated one. One rule, two guards:

* :class:`InputGuard`, for a function that runs under a torch-function mode anyway (the
  replication tracker's or the backend's): it refuses an op that would write into an input
  before the op runs, and names it.
* :func:`own_copies` and :func:`written`, for a function that runs with no mode (on a
  simulated mesh of one axis, see ``shard_map``): each input enters as a copy-on-write clone
  of the caller's memory (torch's lazy clone: nothing is copied unless something writes), and
  the clones' version counters tell, when the function returns, whether it wrote into one;
  the call then runs again under the mode, which refuses the write by name. Either way the
  caller's memory is never written.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ._backend import memory_of
from ._errors import ImmutableError, explain
from ._op_args import writes_first, written_tensors

__all__ = ["InputGuard", "check_inputs_not_written", "own_copies", "written"]


class InputGuard(TorchFunctionMode):
    """The torch-function mode of the per-device function's calls on one thread: ``mode``'s
    (the replication tracker's or the backend's; None: ops run as they are), refusing first
    every op that would write into one of the running call's inputs (see
    :func:`check_inputs_not_written`). One mode, not two stacked: every op of the function pays
    for one dispatch."""

    def __init__(self, mode, f) -> None:
        self.f, self.inputs, self.paths = f, (), ()  # inputs and paths: the running call's
        self.inner = mode
        self.inner_function = None if mode is None else mode.__torch_function__

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs or writes_first(func):
            check_inputs_not_written(func, args, kwargs or {}, self.f, self.inputs, self.paths)
        if self.inner_function is None:
            return func(*args, **(kwargs or {}))
        return self.inner_function(func, types, args, kwargs)


def check_inputs_not_written(func, args, kwargs, f, inputs, paths, *, api: str = "fd.shard_map") -> None:
    """Refuse the torch op ``func(*args, **kwargs)`` of ``f``'s per-device function if it writes
    in place into one of the function's ``inputs`` or a view of one, before it runs."""
    written = written_tensors(func, args, kwargs)
    if not written:
        return
    memory = {memory_of(t) for t in written} - {0}
    for value, path in zip(inputs, paths):
        if isinstance(value, torch.Tensor) and memory_of(value) in memory:
            name = getattr(func, "__name__", str(func))
            out_of_place = name[:-1] if name.endswith("_") and not name.endswith("__") else None
            raise ImmutableError(
                explain(
                    f"{api}({getattr(f, '__qualname__', 'f')})({path})",
                    f"the per-device function writes into its input in place ({name})",
                    expected="inputs used as values, computed on out of place",
                    got=f"{name} on the input or a view of it",
                    fix=(f"write x = x.{out_of_place}(...)" if out_of_place else "compute a new tensor")
                    + ", or clone the input first (x = x.clone()) to own a copy",
                )
            )


def own_copies(inputs: list) -> list:
    """``inputs`` with each tensor a copy-on-write clone of itself (a full copy where its memory
    cannot be shared so, as a NumPy array's): the function's own, whatever it writes."""
    copies = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            try:
                value = torch._lazy_clone(value)
            except (RuntimeError, NotImplementedError):
                value = value.clone()
        copies.append(value)
    return copies


def written(copies: list) -> bool:
    """Whether the function wrote into one of its inputs, the :func:`own_copies` it ran on (their
    version counters count the writes, through views too); the caller's memory was not
    touched."""
    for value in copies:
        if isinstance(value, torch.Tensor) and value._version:
            return True
    return False

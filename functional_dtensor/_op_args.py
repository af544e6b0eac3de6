"""The tensors among a torch op's arguments (as a torch-function mode receives them), and an op
run on a device's blocks."""

from __future__ import annotations

import warnings

import torch

from ._cache import Bounded

__all__ = ["tensors_of", "replace_inputs", "writes_first", "written_tensors", "quiet_if"]


def tensors_of(args, kwargs) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [item for item in value if isinstance(item, torch.Tensor)]
    return found


_IN_PLACE = {
    getattr(torch.Tensor, name)
    for name in dir(torch.Tensor)
    if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.Tensor, name, None))
}


def replace_inputs(func, args, kwargs, replace):
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


# in-place by name (``mul_``, ``torch.relu_``, ``nn.init.normal_``), except these, which change
# no element
_KEEPS_VALUES = frozenset({"requires_grad_", "share_memory_", "pin_memory_"})


def writes_first(func) -> bool:
    """Whether ``func`` writes its first tensor argument (decided once per function)."""
    found = _WRITES_FIRST.get(func)
    if found is None:
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__") and name not in _KEEPS_VALUES
        found = in_place or name == "__setitem__"
        if not torch.compiler.is_compiling():
            _WRITES_FIRST[func] = found
    return found


#: func -> whether it writes its first tensor argument
_WRITES_FIRST = Bounded(4096, "ops: whether they write their first argument")


def written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors a torch op writes in place: the first tensor argument of an in-place op
    (``x.mul_(2)``, ``x += 1``, ``x[i] = v``, ``F.relu(x, inplace=True)``) and its ``out=``."""
    if not kwargs:  # the common case: a plain op
        return tensors_of(args, kwargs)[:1] if writes_first(func) else []
    written = []
    if writes_first(func) or kwargs.get("inplace") is True:
        written += tensors_of(args, kwargs)[:1]
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        written.append(out)
    elif isinstance(out, (tuple, list)):
        written += [t for t in out if isinstance(t, torch.Tensor)]
    return written


def quiet_if(empty: bool, local, func, args, kwargs, ctx):
    """``local`` on a device's blocks; where one is empty, without torch's warnings about it
    (``var`` of no elements): on one device the op sees the whole value, and warns of nothing."""
    if not empty:
        return local(func, args, kwargs, ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return local(func, args, kwargs, ctx)

"""``fd.DTensor``'s Python surface: torch's function protocol, operators, and the methods and
attributes of ``torch.Tensor`` that mean something on a global value, with torch's signatures.

Every method runs as the torch function it names, through the global ops (:mod:`._global_ops`):
by its rule where it has one, else on replicated inputs (:mod:`._fallback`). Attributes keep
torch's meanings (``x.layout`` is ``torch.strided``; fd's layout record is ``x.sharding``).
What a global value cannot honour (its storage, strides, autograd graph node) is the library's
error, naming what to use instead; in-place methods are refused (values are immutable).
"""

from __future__ import annotations

import math

import torch

from ._dtensor import DTensor, data_of, from_local
from ._errors import InputTypeError, UnsupportedAttributeError, explain
from ._global_ops import dispatch
from ._op_decisions import resolved
from .ops import getitem
from .ops.values import run_backward

__all__ = ["install"]


# --- fd.DTensor's torch protocol, operators and methods ------------------------------------------


def _torch_function(cls, func, types, args=(), kwargs=None):
    return dispatch(func, args, kwargs)


def _method_of(func, found):
    """A Tensor method with a handler of its own, looked up once."""

    def method(self, *args, **kwargs):
        return dispatch(func, (self, *args), kwargs, found)

    method.__name__ = getattr(func, "__name__", "method")
    method.__doc__ = f"``torch.Tensor.{method.__name__}`` on the global value (see Global operations)."
    return method


def _reflected(func):
    def method(self, other):
        return dispatch(func, (other, self), {})

    return method


def _backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """Backpropagate from this value (its global value, as ``tensor.backward``). ``gradient``
    (needed unless the value has one element) is an ``fd.DTensor`` of this value's shape, in any
    layout, or a tensor of that shape; ``inputs``, the values (or tensors) whose ``.grad``
    accumulates (default: every leaf)."""
    if isinstance(inputs, (DTensor, torch.Tensor)):
        inputs = [inputs]
    gradients = None if gradient is None else [gradient]
    run_backward("fd.DTensor.backward(gradient)", [self], gradients, retain_graph, create_graph, inputs)


def _item(self):
    """The value of a one-element ``fd.DTensor``, as a Python number."""
    return self.full_tensor().item()


#: Python operators and the torch functions they are (as on torch.Tensor)
_OPERATORS = {
    "__add__": torch.add, "__sub__": torch.sub, "__mul__": torch.mul, "__truediv__": torch.div,
    "__floordiv__": torch.floor_divide, "__pow__": torch.pow, "__matmul__": torch.matmul,
    "__mod__": torch.remainder, "__eq__": torch.eq, "__ne__": torch.ne, "__lt__": torch.lt,
    "__le__": torch.le, "__gt__": torch.gt, "__ge__": torch.ge, "__and__": torch.bitwise_and,
    "__or__": torch.bitwise_or, "__xor__": torch.bitwise_xor, "__lshift__": torch.bitwise_left_shift,
    "__rshift__": torch.bitwise_right_shift,
}  # fmt: skip
_REFLECTED = {
    "__radd__": torch.add, "__rsub__": torch.sub, "__rmul__": torch.mul, "__rtruediv__": torch.div,
    "__rfloordiv__": torch.floor_divide, "__rpow__": torch.pow, "__rmatmul__": torch.matmul,
    "__rmod__": torch.remainder, "__rand__": torch.bitwise_and, "__ror__": torch.bitwise_or,
    "__rxor__": torch.bitwise_xor,
}  # fmt: skip
_UNARY_OPERATORS = {
    "__neg__": torch.neg, "__abs__": torch.abs, "__invert__": torch.bitwise_not, "__pos__": torch.positive,
}  # fmt: skip

#: torch.Tensor's attributes with no meaning on a global value, and what to use instead
_NOT_GLOBAL = {
    "data_ptr": "x.to_local().data_ptr() (a device's shard)",
    "storage": "x.to_local() (a device's shard)",
    "untyped_storage": "x.to_local() (a device's shard)",
    "storage_offset": "x.to_local() (a device's shard)",
    "stride": "x.to_local().stride() (a device's shard); a global value is strided as torch.empty(x.shape)",
    "is_contiguous": "x.to_local() (a device's shard)",
    "is_pinned": "x.to_local() (a device's shard)",
    "pin_memory": "x.to_local() (a device's shard)",
    "share_memory_": "x.to_local() (a device's shard)",
    "is_shared": "x.to_local() (a device's shard)",
    "grad_fn": "x.full_tensor().grad_fn (the global value's node)",
    "is_leaf": "x.grad after a backward (the gradient of the value, laid out like it)",
    "retain_grad": "x.grad after a backward: a value's gradient is kept",
    "register_hook": "a hook on x.full_tensor(), or on the tensor given to fd.distribute_tensor",
    "cuda": "a mesh of CUDA devices: fd.simulated_mesh(..., device_type='cuda'), fd.init_device_mesh('cuda')",
    "cpu": "x.full_tensor().cpu() (the global value), or a CPU mesh",
    "data": "x.detach()",
    "dim_order": "x.to_local().dim_order() (a device's shard)",
}

#: attributes of torch.Tensor, read on the global value
_ATTRIBUTES = {
    "itemsize": lambda self: self.dtype.itemsize,
    "nbytes": lambda self: math.prod(self.shape) * self.dtype.itemsize,
    "is_cuda": lambda self: self.device.type == "cuda",
    "is_cpu": lambda self: self.device.type == "cpu",
    "is_mps": lambda self: False,
    "is_xpu": lambda self: False,
    "is_sparse": lambda self: False,
    "is_sparse_csr": lambda self: False,
    "is_quantized": lambda self: False,
    "is_mkldnn": lambda self: False,
    "is_nested": lambda self: False,
    "names": lambda self: (None,) * len(self.shape),
    "real": lambda self: dispatch(torch.real, (self,), {}),
    "imag": lambda self: dispatch(torch.imag, (self,), {}),
    "H": lambda self: dispatch(torch.Tensor.adjoint, (self,), {}) if len(self.shape) == 2 else _refused_h(),
    "mH": lambda self: dispatch(torch.Tensor.adjoint, (self,), {}),
}


def _refused_h():
    raise InputTypeError(
        explain(
            "fd.DTensor.H",
            "x.H is the conjugate transpose of a matrix (as on a tensor)",
            expected="a 2-D value",
            got="another rank",
            fix="use x.mH for batches of matrices",
        )
    )


def _not_global(name: str, instead: str):
    def refuse(self, *args, **kwargs):
        raise UnsupportedAttributeError(
            explain(
                f"fd.DTensor.{name}",
                f"{name} describes one tensor's memory or autograd node; an fd.DTensor is a global "
                "value held as shards",
                expected="an attribute of the global value",
                got=f"x.{name}",
                fix=f"use {instead}",
            )
        )

    return property(refuse) if not callable(getattr(torch.Tensor, name, None)) else refuse


def _generic(func):
    """A Tensor method with no handler of its own: the torch function, on the global value."""

    def method(self, *args, **kwargs):
        return dispatch(func, (self, *args), kwargs)

    method.__name__ = getattr(func, "__name__", "method")
    method.__doc__ = f"``torch.Tensor.{method.__name__}`` on the global value (see Global operations)."
    return method


def _iter(self):
    """The global value's rows, as a tensor's (a 0-d value has none)."""
    if not self.shape:
        raise InputTypeError(
            explain(
                "iter(fd.DTensor)",
                "a 0-d value has no rows to iterate over (as a tensor)",
                expected="a value of at least one dim",
                got="a 0-d value",
                fix="read it with x.item()",
            )
        )
    return (self[i] for i in range(self.shape[0]))


def _format(self, spec: str) -> str:
    if not self.shape and spec:
        return format(self.item(), spec)
    return object.__format__(self, spec)


def install() -> None:
    DTensor.__torch_function__ = classmethod(_torch_function)
    for name, func in _OPERATORS.items():
        setattr(DTensor, name, lambda self, other, func=func: dispatch(func, (self, other), {}))
    for name, func in _REFLECTED.items():
        setattr(DTensor, name, _reflected(func))
    for name, func in _UNARY_OPERATORS.items():
        setattr(DTensor, name, lambda self, func=func: dispatch(func, (self,), {}))
    DTensor.__getitem__ = getitem
    DTensor.__iter__ = _iter
    DTensor.__reversed__ = lambda self: dispatch(torch.flip, (self, (0,)), {})
    DTensor.__contains__ = lambda self, element: bool(dispatch(torch.any, (self == element,), {}))
    DTensor.__hash__ = object.__hash__  # a value keyed by identity, as torch.Tensor
    DTensor.__bool__ = lambda self: bool(self.full_tensor())
    DTensor.__float__ = lambda self: float(self.full_tensor())
    DTensor.__int__ = lambda self: int(self.full_tensor())
    DTensor.__complex__ = lambda self: complex(self.full_tensor())
    DTensor.__index__ = lambda self: self.full_tensor().__index__()
    DTensor.__array__ = lambda self, dtype=None, copy=None: (
        self.full_tensor().detach().numpy().__array__(dtype)
    )
    DTensor.__format__ = _format
    DTensor.T = property(
        lambda self: (
            dispatch(torch.Tensor.t, (self,), {})
            if self.ndim == 2
            else dispatch(torch.Tensor.permute, (self, tuple(range(self.ndim))[::-1]), {})
        )
    )
    DTensor.mT = property(lambda self: dispatch(torch.Tensor.transpose, (self, -2, -1), {}))
    DTensor.numel = lambda self: math.prod(self.shape)
    DTensor.nelement = DTensor.numel
    DTensor.dim = lambda self: len(self.shape)
    DTensor.ndimension = DTensor.dim
    DTensor.element_size = lambda self: self.dtype.itemsize
    DTensor.device = property(lambda self: data_of(self).device)
    DTensor.is_floating_point = lambda self: self.dtype.is_floating_point
    DTensor.is_complex = lambda self: self.dtype.is_complex
    DTensor.is_signed = lambda self: self.dtype.is_signed
    DTensor.get_device = lambda self: data_of(self).get_device()
    DTensor.backward = _backward
    DTensor.item = _item
    DTensor.tolist = lambda self: self.full_tensor().tolist()
    DTensor.numpy = lambda self, *, force=False: self.full_tensor().detach().numpy()
    DTensor.from_local = staticmethod(from_local)  # torch DTensor's spelling
    for name, read in _ATTRIBUTES.items():
        setattr(DTensor, name, property(read))
    for name, instead in _NOT_GLOBAL.items():
        setattr(DTensor, name, _not_global(name, instead))
    for name in dir(torch.Tensor):  # every other method: its torch function, on the global value
        if name.startswith("_") or name.endswith("_") or hasattr(DTensor, name):
            continue
        func = getattr(torch.Tensor, name)
        if callable(func) and not isinstance(func, type):
            try:
                found = resolved(func)
            except KeyError:
                setattr(DTensor, name, _generic(func))
            else:
                setattr(DTensor, name, _method_of(func, found))


install()

"""Ops on values rather than layouts: ``allclose``/``equal``, the ``*_like`` factories,
``dropout`` (from ``fd.random``), ``torch.autograd.grad`` and ``backward`` of global values.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from .. import random as fd_random
from .._backend import backend_of
from .._cache import cached
from .._dtensor import DTensor, data_of, global_value, held_of, new_held, storage_of, without_partial
from .._errors import InputTypeError, ShapeError, explain
from .._factories import empty, full, ones, zeros
from .._functorch import is_transformed
from .._op_decisions import Handler, register
from .common import no_params

__all__ = ["run_backward"]


# --- values, not layouts -----------------------------------------------------------------------


def _values(compare):
    def composite(func, args, kwargs, ctx):
        a, b = args[0], args[1]
        a = a.full_tensor() if isinstance(a, DTensor) else a
        b = b.full_tensor() if isinstance(b, DTensor) else b
        return compare(a, b, *args[2:], **kwargs)

    return composite


register(
    [torch.allclose, torch.Tensor.allclose], Handler(None, no_params, _values(torch.allclose), "allclose")
)
register([torch.equal, torch.Tensor.equal], Handler(None, no_params, _values(torch.equal), "equal"))


def _like(factory):
    def composite(func, args, kwargs, ctx):
        x = args[0]
        dtype = kwargs.get("dtype") or x.dtype
        layout = without_partial(x.sharding)
        if factory is full:
            return full(tuple(x.shape), args[1], mesh=x.device_mesh, placements=layout, dtype=dtype)
        return factory(tuple(x.shape), mesh=x.device_mesh, placements=layout, dtype=dtype)

    return composite


for _factory, _name in (
    (zeros, "zeros_like"),
    (ones, "ones_like"),
    (empty, "empty_like"),
    (full, "full_like"),
):
    register([getattr(torch, _name)], Handler(None, no_params, _like(_factory), _name))
register([torch.rand_like], Handler(None, no_params, _like(fd_random.rand), "rand_like"))
register([torch.randn_like], Handler(None, no_params, _like(fd_random.randn), "randn_like"))


def _dropout(func, args, kwargs, ctx):
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    if not training or p == 0:
        return x
    return fd_random.dropout(fd_random.default_key(), x, p)


register([F.dropout], Handler(None, no_params, _dropout, "dropout"))


# --- autograd on global values ---------------------------------------------------------------


@cached(4)
def _parameters(func) -> tuple[inspect.Signature, tuple[str, ...]]:
    """``torch.autograd.grad``'s or ``backward``'s signature and its parameters' names (read
    once: reading the signature costs more than the call's own Python)."""
    signature = inspect.signature(func)
    return signature, tuple(signature.parameters)


def _arguments(func, args, kwargs) -> dict:
    """A call's arguments by name, as ``inspect.Signature.bind`` gives them; without binding
    where each argument plainly names one parameter (all of these functions' parameters are
    positional or keyword)."""
    signature, names = _parameters(func)
    if len(args) <= len(names) and all(k in names[len(args) :] for k in kwargs):
        return {**dict(zip(names, args)), **kwargs}
    return signature.bind(*args, **kwargs).arguments  # (raises the call's TypeError)


def _autograd_grad(func, args, kwargs, ctx):
    """``torch.autograd.grad`` where outputs or inputs are ``fd.DTensor``: from the outputs
    (see :func:`_roots`) to the inputs' storages; each gradient laid out like its input (Partial
    axes as Replicate), as :attr:`fd.DTensor.grad`."""
    arguments = _arguments(func, args, kwargs)
    outputs, inputs = arguments["outputs"], arguments["inputs"]
    single = not isinstance(inputs, (tuple, list))
    inputs = [inputs] if single else list(inputs)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for i, value in enumerate(inputs):
        if type(value) is DTensor and not value.requires_grad:
            raise InputTypeError(
                explain(
                    f"torch.autograd.grad(inputs[{i}])",
                    "a gradient is taken with respect to values that need one",
                    expected="an fd.DTensor with requires_grad",
                    got=f"{value!r} with requires_grad=False",
                    fix="lay out a tensor that needs one: fd.distribute_tensor(t.requires_grad_(), mesh, p), "
                    "or use fd.parallelize_module(...).params or a factory with requires_grad=True",
                )
            )
    grad_outputs = arguments.get("grad_outputs")
    if grad_outputs is not None:
        grad_outputs = list(grad_outputs) if isinstance(grad_outputs, (tuple, list)) else [grad_outputs]
        # (copies: autograd may keep a gradient it is given as .grad and accumulate into it)
        grad_outputs = [g.full_tensor() if type(g) is DTensor else g for g in grad_outputs]
    roots, cotangents = _roots(outputs, grad_outputs)
    arguments.update(
        outputs=roots,
        inputs=[data_of(i) if type(i) is DTensor else i for i in inputs],
        grad_outputs=cotangents,
    )
    grads = func(**arguments)
    return tuple(
        gradient_value(g, i) if type(i) is DTensor and g is not None else g for g, i in zip(grads, inputs)
    )


def _roots(outputs: list, gradients: list | None) -> tuple[list, list | None]:
    """Where autograd starts for ``outputs`` and their ``gradients`` (global tensors, or None:
    the implicit 1 of a one-element output): an ``fd.DTensor`` output with the implicit 1 starts
    from its storage, with the storage of a global 1 as its cotangent (what the gather of its
    value would send back), so that its value is not gathered (a Partial loss's gather is an
    all-reduce per axis); any other output from its global value."""
    gradients = [None] * len(outputs) if gradients is None else gradients
    roots, cotangents = [], []
    for output, gradient in zip(outputs, gradients):
        if type(output) is not DTensor:
            roots.append(output)
            cotangents.append(gradient)
            continue
        storage = storage_of(output)
        if gradient is None and _one_real_element(output, storage):
            layout = without_partial(output.sharding)
            one = storage.new_ones(tuple(output.shape))
            roots.append(storage)
            cotangents.append(backend_of(output.device_mesh).distribute(one, layout))
        else:
            roots.append(global_value(output))
            cotangents.append(gradient)
    return roots, None if all([c is None for c in cotangents]) else cotangents


def _one_real_element(output: DTensor, storage: torch.Tensor) -> bool:
    """Whether autograd would start ``output`` (of ``storage``) from an implicit 1: one element of
    a floating dtype (torch refuses the others itself, from the global value), outside a
    transform's wrapper or a trace."""
    return (
        math.prod(output.shape) == 1
        and output.dtype.is_floating_point
        and not torch.compiler.is_compiling()
        and not is_transformed(storage)
    )


def gradient_value(g: torch.Tensor, value: DTensor) -> DTensor:
    """The gradient ``g`` of ``value``'s storage, or of its blocks held once, as a value laid
    out like it (Partial axes as Replicate): held once as well where ``value`` is (an
    optimizer reads the blocks as they are)."""
    if held_of(value) is not None:
        if not value.sharding.has_partial:
            return new_held(g, value.sharding, value.shape)
        g = storage_of(new_held(g, value.sharding, value.shape))
    return DTensor(g, without_partial(value.sharding), value.shape)


register([torch.autograd.grad], Handler(None, no_params, _autograd_grad, "autograd.grad"))


def run_backward(where: str, outputs: list, gradients, retain_graph, create_graph, inputs) -> None:
    """``torch.autograd.backward`` from ``outputs`` (see :func:`_roots`) with the global values
    of ``gradients`` (each of its output's shape, in any layout), accumulating into the storages
    of ``inputs``: each ``.grad`` laid out like its value (:attr:`fd.DTensor.grad`). ``where``
    names a gradient in errors (``{i}``: its index)."""
    if gradients is not None:
        gradients = list(gradients)
        for i, (output, grad) in enumerate(zip(outputs, gradients)):
            shaped = [v for v in (output, grad) if isinstance(v, (DTensor, torch.Tensor))]
            global_ = any(isinstance(v, DTensor) for v in shaped)
            if len(shaped) == 2 and global_ and tuple(grad.shape) != tuple(output.shape):
                raise ShapeError(
                    explain(
                        where.format(i=i),
                        "the gradient of a value has the value's global shape (in any layout)",
                        expected=f"shape {tuple(output.shape)}",
                        got=f"shape {tuple(grad.shape)}",
                        fix="pass a gradient shaped like the value, e.g. torch.ones_like(y) for y",
                    )
                )
        gradients = [g.full_tensor() if isinstance(g, DTensor) else g for g in gradients]
    roots, cotangents = _roots(outputs, gradients)
    torch.autograd.backward(
        roots,
        cotangents,
        retain_graph=retain_graph,
        create_graph=create_graph,
        inputs=None if inputs is None else [data_of(v) if isinstance(v, DTensor) else v for v in inputs],
    )


def _autograd_backward(func, args, kwargs, ctx):
    """``torch.autograd.backward`` where outputs or inputs are ``fd.DTensor`` (torch's function
    protocol brings it here): as :func:`run_backward`."""
    arguments = _arguments(func, args, kwargs)
    tensors, grads = arguments["tensors"], arguments.get("grad_tensors")
    if grads is None:
        grads = arguments.get("grad_variables")  # torch's deprecated name
    one = isinstance(tensors, (DTensor, torch.Tensor))
    outputs = [tensors] if one else list(tensors)
    if grads is not None and isinstance(grads, (DTensor, torch.Tensor)):
        grads = [grads]
    inputs = arguments.get("inputs")
    if isinstance(inputs, (DTensor, torch.Tensor)):
        inputs = [inputs]
    run_backward(
        "torch.autograd.backward(grad_tensors[{i}])",
        outputs,
        grads,
        arguments.get("retain_graph"),
        arguments.get("create_graph", False),
        inputs,
    )


register([torch.autograd.backward], Handler(None, no_params, _autograd_backward, "autograd.backward"))

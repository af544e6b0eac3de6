"""Products: ``matmul`` (vectors as torch takes them), ``mm``, ``bmm``, ``linear``, ``addmm``,
``einsum``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _rules as rules
from .._dtensor import DTensor, held_of
from .._errors import InputTypeError, ShapeError, explain
from .._folded_linear import folded_linear
from .._global_ops import dispatch
from .._op_decisions import Handler, register, resolved
from .._placements import Shard
from .common import no_params

__all__: list[str] = []


# --- matmul ------------------------------------------------------------------------------------


def _matmul_local(func, args, kwargs, ctx):
    return torch.matmul(args[0], args[1])


def _matmul_params(args, kwargs, tensors):
    for t in tensors:
        if t.ndim < 2:
            raise ShapeError(
                explain(
                    "torch.matmul",
                    "a matmul takes vectors, matrices or batches of them (as on one device)",
                    expected="inputs of 1 dim or more",
                    got=f"an input of shape {tuple(t.shape)}",
                    fix="multiply by a 0-d value with torch.mul",
                )
            )
    if len(tensors) == 2 and tensors[0].dtype != tensors[1].dtype:
        raise InputTypeError(
            explain(
                "torch.matmul",
                "a matmul takes operands of one dtype (as on one device)",
                expected="two fd.DTensor of one dtype",
                got=f"{tensors[0].dtype} and {tensors[1].dtype}",
                fix=f"convert one first: b.to({tensors[0].dtype})",
            )
        )
    if len(tensors) != 2:
        raise InputTypeError(
            explain(
                "torch.matmul",
                "a matmul of fd.DTensor takes two global values",
                expected="two fd.DTensor",
                got=f"{len(tensors)} fd.DTensor",
                fix="distribute the other operand: fd.distribute_tensor(t, mesh, fd.P())",
            )
        )
    return ()


def _mm_local(func, args, kwargs, ctx):
    return torch.mm(args[0], args[1])


def _matmul_of_matrices(a, b):
    """``torch.matmul`` of two values of 2 dims or more (its rule's form)."""
    return torch.matmul(a, b)


def _matmul(func, args, kwargs, ctx):
    """``torch.matmul`` as torch takes it: a vector operand is a one-row (first) or one-column
    (second) matrix, and the product drops that dim (two vectors: their dot product)."""
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or min(a.ndim, b.ndim) != 1:
        return dispatch(_matmul_of_matrices, (a, b), {}, _OF_MATRICES)
    rows = a.unsqueeze(0) if a.ndim == 1 else a
    cols = b.unsqueeze(-1) if b.ndim == 1 else b
    out = dispatch(_matmul_of_matrices, (rows, cols), {}, _OF_MATRICES)
    if b.ndim == 1:
        out = out.squeeze(-1)
    return out.squeeze(-1 if b.ndim == 1 else -2) if a.ndim == 1 else out


register(
    [_matmul_of_matrices, torch.bmm, torch.Tensor.bmm],
    Handler(rules.matmul, _matmul_params, _matmul_local, "matmul", batched="matmul"),
)
_OF_MATRICES = resolved(_matmul_of_matrices)  # (Dynamo searches no dict keyed by functions)
register(
    [torch.matmul, torch.Tensor.matmul],
    Handler(None, no_params, _matmul, "matmul", explained_as=_matmul_of_matrices),
)
register(
    [torch.mm, torch.Tensor.mm], Handler(rules.matmul, _matmul_params, _mm_local, "matmul", batched="mm")
)


def _linear_layer(input, weight, bias=None):
    """``F.linear`` of fd.DTensor values of one dtype, a matrix weight and a bias of its rows
    (its rule's form: one op, as torch's ``addmm``)."""
    return F.linear(input, weight, bias)


def _linear_local(func, args, kwargs, ctx):
    return F.linear(*args)


def _linear(func, args, kwargs, ctx):
    """``F.linear`` as one op where its rule covers the call; otherwise (a plain tensor among
    the operands, a vector weight, dtypes that differ) as the matmul and add it is made of."""
    x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    operands = (x, weight) if bias is None else (x, weight, bias)
    if (
        all([type(t) is DTensor and t.dtype == x.dtype for t in operands])
        and weight.ndim == 2
        and (bias is None or bias.shape == weight.shape[:1])
    ):
        if held_of(weight) is not None:  # (a parameter held once: the simulated mesh)
            out = folded_linear(_linear_layer, x, weight, bias)
            if out is not None:
                return out
        return dispatch(_linear_layer, operands, {}, _LINEAR_LAYER)
    out = torch.matmul(x, torch.t(weight))  # torch functions, not operators: they compile
    return out if bias is None else torch.add(out, bias)


def _addmm(func, args, kwargs, ctx):
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    out = torch.matmul(a, b)
    out = out if alpha == 1 else torch.mul(out, alpha)
    return torch.add(out, bias if beta == 1 else torch.mul(bias, beta))


register([_linear_layer], Handler(rules.linear_layer, no_params, _linear_local, "linear", batched="linear"))
_LINEAR_LAYER = resolved(_linear_layer)
register([F.linear], Handler(None, no_params, _linear, "linear", explained_as=_linear_layer))
register([torch.addmm, torch.Tensor.addmm], Handler(None, no_params, _addmm, "addmm"))


# --- einsum ------------------------------------------------------------------------------------


def _einsum_params(args, kwargs, tensors):
    equation = args[0].replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise InputTypeError(
            explain(
                "torch.einsum(equation)",
                "einsum of fd.DTensor takes an explicit equation",
                expected="labels for every dim and an output after '->' (no '...')",
                got=repr(args[0]),
                fix="write every dim's label and the output, e.g. 'bij,bjk->bik'",
            )
        )
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    summed = {  # labels contracted between operands (a label of one operand alone is a sum)
        label: t.shape[term.index(label)]
        for term, t in zip(terms, tensors)
        for label in term
        if label not in output and sum(label in other for other in terms) > 1
    }
    if any(t.dtype == torch.bool for t in tensors) and any(size > 1 for size in summed.values()):
        # torch's kernel (bmm) refuses bool for a contraction longer than one; a device's block of
        # it may be one long or empty, where it would not: refused as on one device
        raise InputTypeError(
            explain(
                "torch.einsum",
                "torch's einsum contracts bool operands only over dims of length one",
                expected="numeric operands for a contraction longer than one",
                got=f"bool operands summed over {summed}",
                fix="convert first: torch.einsum(equation, a.int(), b.int())",
            )
        )
    return (tuple(terms), output)


def _einsum_rule(call):
    """A label kept in the output may be sharded on every operand that has it (the others
    replicated); a label summed over may be sharded on every operand, giving a Partial sum."""
    inputs, output = call.params
    options = [rules.Option((rules.R,) * len(inputs), rules.R)]
    labels = {label for term in inputs for label in term}
    for label in sorted(labels):
        placements = tuple(Shard(term.index(label)) if label in term else rules.R for term in inputs)
        if label in output:
            if call.out_shape[output.index(label)] > 1:
                options.append(rules.Option(placements, Shard(output.index(label))))
        elif all(label in term for term in inputs):
            options.append(rules.Option(placements, rules.SUM))
    if len(inputs) == 2:
        options += [
            rules.Option((rules.SUM, rules.R), rules.SUM),
            rules.Option((rules.R, rules.SUM), rules.SUM),
        ]
    return options


def _einsum_local(func, args, kwargs, ctx):
    inputs, output = ctx.decision.call.params
    operands = args[1:] if len(args) > 1 and not isinstance(args[1], (list, tuple)) else args[1]
    return torch.einsum(f"{','.join(inputs)}->{output}", *operands)


register([torch.einsum], Handler(_einsum_rule, _einsum_params, _einsum_local, "einsum", batched="einsum"))

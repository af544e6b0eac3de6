"""Ops along whole dims: ``softmax``, ``log_softmax``, scans, ``layer_norm``, ``rms_norm``,
``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _rules as rules
from .._errors import InputTypeError, explain
from .._op_decisions import Handler, register
from .._placements import Shard
from .common import dim_param, functions

__all__: list[str] = []


# --- ops along whole dims ----------------------------------------------------------------------


def _negative_dim_local(func, args, kwargs, ctx):
    (dims,) = ctx.decision.call.params[:1]
    dim = dims[0] - len(ctx.decision.call.shapes[0])
    if not ctx.decision.call.shapes[0]:  # a 0-d value: along a dim of its own
        args, kwargs = (args[0].unsqueeze(-1), *args[1:]), kwargs
        if "dim" in kwargs:
            return func(*args, **{**kwargs, "dim": -1}).squeeze(-1)
        return func(args[0], -1, *args[2:], **kwargs).squeeze(-1)
    if "dim" in kwargs:
        return func(args[0], *args[1:], **{**kwargs, "dim": dim})
    return func(args[0], dim, *args[2:], **kwargs)


for _name in ("softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp"):
    register(
        functions(_name),
        Handler(rules.along, dim_param(1, _name), _negative_dim_local, _name, batched="leading"),
    )


def _trailing(count_of):
    def params(args, kwargs, tensors):
        ndim = tensors[0].ndim
        return (tuple(range(ndim - count_of(args, kwargs), ndim)),)

    return params


def _normalized(args, kwargs):
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    return len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1


def _normalization(*names: str):
    """``layer_norm`` / ``rms_norm``: the op itself, on a block."""

    def local(func, args, kwargs, ctx):
        return func(**(dict(zip(("input", "normalized_shape", *names), args)) | kwargs))

    return local


register(
    [F.layer_norm],
    Handler(
        rules.along,
        _trailing(_normalized),
        _normalization("weight", "bias", "eps"),
        "layer_norm",
        batched="normalization",
    ),
)
register(
    [getattr(F, "rms_norm", None)],
    Handler(
        rules.along,
        _trailing(_normalized),
        _normalization("weight", "eps"),
        "rms_norm",
        batched="normalization",
    ),
)


def _attention_rule(call):
    """``scaled_dot_product_attention(q, k, v)``: batch and head dims sharded alike, the
    sequence and feature dims whole."""
    q = call.shapes[0]
    count = sum(s is not None for s in call.shapes)
    options = [rules.Option((rules.R,) * count, rules.R)]
    for d in range(len(q) - 2):
        if q[d] > 1:
            options.append(rules.Option((Shard(d),) * count, Shard(d)))
    return options


def _attention_local(func, args, kwargs, ctx):
    return func(*args, **kwargs)


def _attention_params(args, kwargs, tensors):
    """A dropout of the attention weights draws from torch's global generator: each device
    its own numbers (replicas would differ); refused, with the ways to draw it from a key."""
    names = ("query", "key", "value", "attn_mask", "dropout_p")
    dropout = (dict(zip(names, args)) | kwargs).get("dropout_p", 0.0)
    if dropout:
        raise InputTypeError(
            explain(
                "F.scaled_dot_product_attention(dropout_p)",
                "its dropout draws from torch's global generator: on each device its own numbers",
                expected="dropout_p=0.0 on fd.DTensor",
                got=f"dropout_p={dropout}",
                fix="pass dropout_p=0.0 (as in evaluation); for training with attention dropout, "
                "compute the weights and drop them with fd.random.dropout(key, weights, p)",
            )
        )
    return ()


register(
    [F.scaled_dot_product_attention],
    Handler(
        _attention_rule,
        _attention_params,
        _attention_local,
        "scaled_dot_product_attention",
        batched="attention",
    ),
)

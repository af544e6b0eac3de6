"""Ops along whole dims: ``softmax``, ``log_softmax``, scans, ``layer_norm``, ``rms_norm``,
``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _rules as rules
from .._errors import InputTypeError, explain
from .._global_ops import Handler, register
from .._placements import Shard
from .common import align, dim_param, functions, valid

__all__: list[str] = []


# --- ops along whole dims ----------------------------------------------------------------------


def _negative_dim_local(func, args, kwargs, ctx):
    (dims,) = ctx.decision.call.params[:1]
    dim = dims[0] - len(ctx.decision.call.shapes[0])
    if not ctx.decision.call.shapes[0]:  # a 0-d value: along a dim of its own, not the device dim
        args, kwargs = (args[0].unsqueeze(-1), *args[1:]), kwargs
        if "dim" in kwargs:
            return func(*args, **{**kwargs, "dim": -1}).squeeze(-1)
        return func(args[0], -1, *args[2:], **kwargs).squeeze(-1)
    if "dim" in kwargs:
        return func(args[0], *args[1:], **{**kwargs, "dim": dim})
    return func(args[0], dim, *args[2:], **kwargs)


for _name in ("softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp"):
    register(functions(_name), Handler(rules.along, dim_param(1, _name), _negative_dim_local, _name))


def _trailing(count_of):
    def params(args, kwargs, tensors):
        ndim = tensors[0].ndim
        return (tuple(range(ndim - count_of(args, kwargs), ndim)),)

    return params


def _normalized(args, kwargs):
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    return len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1


#: per-device elements from which a stacked op runs torch's fused kernel once per device (the
#: kernels outweigh a call per device) rather than a batched form of several kernels
PER_DEVICE_KERNEL = 1 << 14


def _normalization(*names: str):
    """``layer_norm`` / ``rms_norm``: on one rank's shard, the op itself. On stacked devices
    (each device's copy of a replicated weight takes its own gradient): large shards run the
    fused op once per device with that device's weights (forward and backward one kernel
    each); small ones are normalized at once without the affine weights, which are then
    applied elementwise in one kernel."""

    def local(func, args, kwargs, ctx):
        bound = dict(zip(("input", "normalized_shape", *names), args)) | kwargs
        if not ctx.lead:
            return func(**bound)
        x = bound.pop("input")
        padded = ctx.decision.padded[0]
        if x[0].numel() >= PER_DEVICE_KERNEL and not padded:
            per_device = {k: v.unbind(0) for k, v in bound.items() if isinstance(v, torch.Tensor)}
            return torch.stack(
                [
                    func(x_k, **(bound | {k: parts[i] for k, parts in per_device.items()}))
                    for i, x_k in enumerate(x.unbind(0))
                ]
            )
        bound["input"] = x
        affine = [bound.pop(name, None) for name in ("weight", "bias")]
        out = func(**bound)
        if padded:  # the padding's rows normalized (0 / sqrt(eps)) take no part in the weights' gradients
            out = torch.where(valid(ctx.decision.output, ctx.decision.out_shapes[0], out), out, 0.0)
        (weight, bias), _ = align(affine, {}, ctx)
        if weight is not None and bias is not None:
            return torch.addcmul(bias, out, weight)
        out = out if weight is None else out * weight
        return out if bias is None else out + bias

    return local


register(
    [F.layer_norm],
    Handler(rules.along, _trailing(_normalized), _normalization("weight", "bias", "eps"), "layer_norm"),
)
register(
    [getattr(F, "rms_norm", None)],
    Handler(rules.along, _trailing(_normalized), _normalization("weight", "eps"), "rms_norm"),
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
    """On stacked devices, the device dim folded into the batch dim: torch's fused CPU kernels
    take 4-d inputs, and a 5-d call falls back to the unfused math."""
    if ctx.lead and len(args) == 3 and not isinstance(kwargs.get("attn_mask"), torch.Tensor):
        q, k, v = args
        if q.dim() == 5 and q.shape[:2] == k.shape[:2] == v.shape[:2]:
            return func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), **kwargs).unflatten(0, q.shape[:2])
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
    Handler(_attention_rule, _attention_params, _attention_local, "scaled_dot_product_attention"),
)

"""Lookups by index: ``embedding`` (``max_norm`` too) and ``gather``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _blocks as blocks
from .. import _rules as rules
from .._backend import is_transformed
from .._errors import InputTypeError, explain
from .._op_decisions import Handler, register
from .common import block_bounds

__all__: list[str] = []


# --- embedding ---------------------------------------------------------------------------------


def _check_indices(indices, total: int, where: str, of: str, ctx) -> None:
    """Indices into a dim of ``total`` are inside it (refused as torch refuses them): a device
    that holds one block of the dim looks up only its own (an index outside it would read as
    zeros)."""
    if torch.compiler.is_compiling() or is_transformed(indices) or not indices.numel():
        return
    if blocks.outside(indices, total):
        raise InputTypeError(
            explain(
                where,
                "an index is outside the dim it indexes",
                expected=f"indices in [0, {total})",
                got=f"indices {indices[blocks.outside_mask(indices, total)].unique().tolist()[:8]} for {of}",
                fix="check the indices against the dim's size first",
            )
        )


def _into_block(indices, ctx, i: int, dim: int):
    """Global ``indices`` into dim ``dim`` of the ``i``-th input: into the block the local form
    runs on (clamped into it), and whether each falls inside it."""
    start, length = block_bounds(ctx, i, dim)
    local = indices - start
    return local.clamp(0, max(length - 1, 0)), (local >= 0) & (local < length)


def _embedding_params(args, kwargs, tensors):
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq")
    bound = dict(zip(names, args)) | kwargs
    if bound.get("scale_grad_by_freq"):
        raise InputTypeError(
            explain(
                "F.embedding(scale_grad_by_freq)",
                "the gradient of an fd.DTensor table is not scaled by the frequencies of its indices",
                expected="scale_grad_by_freq=False",
                got="scale_grad_by_freq=True",
                fix="leave it out, or look up inside fd.local_map / fd.shard_map",
            )
        )
    max_norm, padding = bound.get("max_norm"), bound.get("padding_idx")
    padding = None if padding is None else padding % tensors[-1].shape[0]  # torch's range check on meta
    return (None if max_norm is None else float(max_norm), float(bound.get("norm_type", 2.0)), padding)


def _embedding_local(func, args, kwargs, ctx):
    """``F.embedding``; with ``max_norm``, each row looked up whose ``norm_type``-norm exceeds it
    scaled to it, as torch renormalizes them. torch does so in place on the weight, outside
    autograd; a global value is never changed: the output is torch's, the weight stays as it
    was, and the gradient is torch's (the lookup's, not the scaling's). The rows looked up at
    ``padding_idx`` take no gradient, as in torch."""
    indices, table = args[0], args[1]
    layout = ctx.decision.inputs[1]
    total = ctx.decision.call.shapes[1][0]
    if math.prod(ctx.decision.call.shapes[0]):
        _check_indices(indices, total, "torch.embedding(input)", f"a table of {total} rows", ctx)
    if not layout.sharding_axes(0):
        picked = F.embedding(indices, table)
    elif table.shape[0] == 0:  # a device that holds none of the rows: zeros, connected to the
        # table (so that this rank runs the backward's collectives as the others do)
        picked = table.new_zeros(*indices.shape, table.shape[1]) + table.sum()
    else:
        local, inside = _into_block(indices, ctx, 1, 0)
        picked = F.embedding(local, table) * inside.unsqueeze(-1)
    max_norm, norm_type, padding = ctx.decision.call.params
    if padding is not None:
        picked = torch.where((indices == padding).unsqueeze(-1), picked.detach(), picked)
    if max_norm is None:
        return picked
    norms = torch.linalg.vector_norm(picked.detach(), norm_type, dim=-1, keepdim=True)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)  # torch's embedding_renorm_
    return picked.detach() * scale + (picked - picked.detach())  # the value scaled, the gradient not


register(
    [F.embedding],
    Handler(rules.embedding, _embedding_params, _embedding_local, "embedding", batched="embedding"),
)


def _gather_params(args, kwargs, tensors):
    if kwargs.get("sparse_grad"):
        raise InputTypeError(
            explain(
                "torch.gather(sparse_grad)",
                "the gradient of an fd.DTensor is dense, laid out like the value",
                expected="sparse_grad=False",
                got="sparse_grad=True",
                fix="leave sparse_grad out",
            )
        )
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    return (dim % max(tensors[0].ndim, 1),)


def _gather_local(func, args, kwargs, ctx):
    """``torch.gather`` on each device's blocks; from a block of a sharded ``dim``, the
    indices that fall in it (zeros elsewhere: the Partial sum of the devices')."""
    x, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
    (dim,) = ctx.decision.call.params
    shape = ctx.decision.call.shapes[0]
    total = shape[dim] if shape else 1
    _check_indices(index, total, "torch.gather(index)", f"a dim of {total}", ctx)
    if not shape:  # a 0-d input: along a dim of its own
        return torch.gather(x.unsqueeze(-1), -1, index.unsqueeze(-1)).squeeze(-1)
    local_dim = dim - len(shape)  # from the end (batched: the device dim leads)
    layout = ctx.decision.inputs[0]
    if not layout.sharding_axes(dim):
        return torch.gather(x, local_dim, index)
    if x.shape[local_dim] == 0:  # a device that holds none of the dim: zeros, connected to x
        return torch.zeros(index.shape, dtype=x.dtype, device=x.device) + x.sum()
    local, inside = _into_block(index, ctx, 0, dim)
    return torch.gather(x, local_dim, local) * inside


register(
    [torch.gather, torch.Tensor.gather],
    Handler(rules.gather, _gather_params, _gather_local, "gather", batched="gather"),
)

"""Lookups by index: ``embedding`` (``max_norm`` too) and ``gather``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _rules as rules
from .._backend import backend_of, is_transformed
from .._cache import cached
from .._errors import InputTypeError, explain
from .._global_ops import Handler, register
from .._sharding import shard_table

__all__: list[str] = []


# --- embedding ---------------------------------------------------------------------------------


def _check_indices(indices, total: int, where: str, of: str, ctx) -> None:
    """Indices into a dim of ``total`` are inside it (refused as torch refuses them): a device
    that holds one block of the dim looks up only its own (an index outside it would read as
    zeros), and the padding of uneven indices holds 0, an index."""
    if torch.compiler.is_compiling() or is_transformed(indices) or not indices.numel():
        return
    if total == 0 or bool(((indices < 0) | (indices >= total)).any()):
        raise InputTypeError(
            explain(
                where,
                "an index is outside the dim it indexes",
                expected=f"indices in [0, {total})",
                got=f"indices {indices.unique().tolist()[:8]} for {of}",
                fix="check the indices against the dim's size first",
            )
        )


@cached(1024)
def _block_bounds(layout, shape: tuple[int, ...], dim: int, device: str) -> torch.Tensor:
    """``(2, n)``: where each device's block of dim ``dim`` starts, and its length."""
    table = shard_table(layout, shape)
    return torch.tensor(
        [[o[dim] for o in table.offsets], [s[dim] for s in table.local_shapes]], device=device
    )


def _into_block(indices, layout, shape: tuple[int, ...], dim: int, size: int, ctx):
    """Global ``indices`` into dim ``dim`` of a value of global ``shape`` laid out by
    ``layout``, each device holding a block of ``size`` (in storage, padding included): each
    device's indices into its own block (clamped into it) and where they fall inside it."""
    mesh = layout.mesh
    device = backend_of(mesh).axis_index(mesh, mesh.axis_names, indices.device)
    start, length = _block_bounds(layout, shape, dim, str(indices.device))[:, device]
    if ctx.lead:
        start, length = (t.reshape(-1, *[1] * (indices.dim() - 1)) for t in (start, length))
    local = indices - start
    return local.clamp(0, max(size - 1, 0)), (local >= 0) & (local < length)


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
        picked = F.embedding(indices, table) if not ctx.lead else _stacked_embedding(indices, table)
    elif not ctx.lead and table.shape[0] == 0:  # a rank that holds none of the rows
        picked = table.new_zeros(*indices.shape, table.shape[1])
    else:
        local, inside = _into_block(indices, layout, ctx.decision.call.shapes[1], 0, table.shape[-2], ctx)
        picked = _stacked_embedding(local, table) if ctx.lead else F.embedding(local, table)
        picked = picked * inside.unsqueeze(-1)
    max_norm, norm_type, padding = ctx.decision.call.params
    if padding is not None:
        picked = torch.where((indices == padding).unsqueeze(-1), picked.detach(), picked)
    if max_norm is None:
        return picked
    norms = torch.linalg.vector_norm(picked.detach(), norm_type, dim=-1, keepdim=True)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)  # torch's embedding_renorm_
    return picked.detach() * scale + (picked - picked.detach())  # the value scaled, the gradient not


def _stacked_embedding(indices, table):
    """Each device's rows of its own table: ``table (n, rows, d)``, ``indices (n, ...)``."""
    n = table.shape[0]
    flat = indices.reshape(n, -1)
    picked = torch.gather(table, 1, flat.unsqueeze(-1).expand(*flat.shape, table.shape[-1]))
    return picked.reshape(*indices.shape, table.shape[-1])


register([F.embedding], Handler(rules.embedding, _embedding_params, _embedding_local, "embedding"))


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
    if not shape:  # a 0-d input: along a dim of its own, not the device dim
        return torch.gather(x.unsqueeze(-1), -1, index.unsqueeze(-1)).squeeze(-1)
    local_dim = dim - len(shape)  # from the end: the device dim leads
    layout = ctx.decision.inputs[0]
    if not layout.sharding_axes(dim):
        return torch.gather(x, local_dim, index)
    size = x.shape[local_dim]
    if size == 0:  # a rank that holds none of the dim
        return torch.zeros(index.shape, dtype=x.dtype, device=x.device)
    local, inside = _into_block(index, layout, ctx.decision.call.shapes[0], dim, size, ctx)
    return torch.gather(x, local_dim, local) * inside


register([torch.gather, torch.Tensor.gather], Handler(rules.gather, _gather_params, _gather_local, "gather"))

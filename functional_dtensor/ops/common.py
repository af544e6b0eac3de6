"""What every family of ops shares: the plain local forms, a block's bounds, a dim's checks, an
op on meta tensors.

A local form ``local(func, args, kwargs, ctx)`` is plain torch on one device's block (``args``
hold the inputs' blocks, unpadded; ``ctx`` the decision's :class:`.._op_decisions.Context`). A
handler's ``batched`` names how the simulated backend runs it on every device's block at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._errors import InputTypeError, ShapeError, explain
from .._op_decisions import no_params, refused  # noqa: F401  (no_params: for the families)
from .._sharding import shard_table

__all__: list[str] = []


def plain(func, args, kwargs, ctx):
    """The op itself, on a block: the local form of most ops."""
    return func(*args, **kwargs)


def functions(name: str):
    """The torch function, the Tensor method and the functional form named ``name``."""
    return [getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(F, name, None)]


def block_bounds(ctx, i: int, dim: int) -> tuple[int, int]:
    """Where the block a local form runs on starts in dim ``dim`` of its ``i``-th input, and its
    length there."""
    table = shard_table(ctx.decision.inputs[i], tuple(ctx.decision.call.shapes[i]))
    return table.offsets[ctx.device][dim], table.local_shapes[ctx.device][dim]


def on_meta(func, args, kwargs):
    """``func`` of a composite on a meta tensor of its first argument's global shape and dtype:
    the output torch gives, and torch's argument and dtype checks as the library's error."""
    x = args[0]
    try:
        return func(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args[1:], **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        raise refused(getattr(func, "__name__", "op"), f"{tuple(x.shape)} {x.dtype}", error) from None


def checked_dim(dim: int, ndim: int, op: str) -> int:
    """``dim`` of a value of ``ndim`` dims, counted from 0 (a 0-d value takes 0 and -1, as in
    torch); one out of range refused, as torch refuses it (some meta kernels, softmax's, do
    not check: ``dim % ndim`` would wrap it around to another dim)."""
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise ShapeError(
            explain(
                f"torch.{op}(dim)",
                "the dim is out of range (as on one device)",
                expected=f"a dim in [{-size}, {size - 1}] of a value of {ndim} dims",
                got=f"dim={dim}",
                fix=f"count dims from 0 or from the end (-1 is the last of {ndim})",
            )
        )
    return dim % size


def dim_param(position: int, op: str, name: str = "dim", default: int | None = None):
    def params(args, kwargs, tensors):
        dim = kwargs.get(name, args[position] if len(args) > position else default)
        if not isinstance(dim, int):
            raise InputTypeError(
                explain(
                    f"torch.{op}({name})",
                    "this op on an fd.DTensor needs its dim as an int",
                    expected=f"{name}=<int>",
                    got=repr(dim),
                    fix=f"pass {name} explicitly",
                )
            )
        return ((checked_dim(dim, tensors[0].ndim, op),),)

    return params

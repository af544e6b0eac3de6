"""What every family of ops shares: the local forms' helpers (broadcast alignment on stacked
storage, the padding's gradients), a dim's checks, an op on meta tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._blocks import valid_mask
from .._errors import InputTypeError, ShapeError, explain
from .._global_ops import no_params, refused  # noqa: F401  (no_params: for the families)

__all__: list[str] = []


def plain(func, args, kwargs, ctx):
    return func(*args, **kwargs)


def align(args, kwargs, ctx):
    """On stacked storage, singleton dims after the device dim for inputs of lower rank than
    the output, so broadcasting aligns tensor dims with tensor dims."""
    if not ctx.lead or not ctx.align:
        return args, kwargs
    ndim = len(ctx.decision.out_shapes[0])

    def align(value):
        if isinstance(value, torch.Tensor) and 1 <= value.dim() <= ndim:
            missing = ndim - (value.dim() - 1)
            return value.reshape(value.shape[:1] + (1,) * missing + value.shape[1:]) if missing else value
        return value

    return [align(a) for a in args], {k: align(v) for k, v in kwargs.items()}


def unpadded_gradients(args, kwargs, ctx):
    """On stacked uneven blocks, the inputs take no gradient from the output's padding: where
    the op's derivative is not finite there (``c / y``, ``y``'s padding 0), the zeroed
    cotangent times it is NaN, which an input broadcast over the padding (or replicated on a
    device that holds none of the output) would sum into its gradient."""
    shape = tuple(ctx.decision.out_shapes[0])
    mask = None

    def guarded(value):
        nonlocal mask
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            return value
        if mask is None:
            mask = valid_mask(ctx.decision.output, shape, str(value.device))
        return torch.where(mask, value, value.detach())

    return [guarded(a) for a in args], {k: guarded(v) for k, v in kwargs.items()}


def elementwise_local(func, args, kwargs, ctx):
    args, kwargs = align(args, kwargs, ctx)
    if ctx.lead and ctx.decision.padded[0] and torch.is_grad_enabled():
        args, kwargs = unpadded_gradients(args, kwargs, ctx)
    out = func(*args, **kwargs)
    if ctx.lead and out.dtype != ctx.decision.out_dtypes[0]:
        # a 0-d value's stacked storage has a dim, so torch's type promotion counted it as a
        # dimensioned tensor (int64 0-d + int32 vector is int32 on one device)
        return out.to(ctx.decision.out_dtypes[0])
    return out


def functions(name: str):
    """The torch function, the Tensor method and the functional form named ``name``."""
    return [getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(F, name, None)]


def valid(layout, shape, storage):
    return valid_mask(layout, shape, str(storage.device))


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

"""Reductions: ``sum``, ``mean``, ``amax``, ``amin``, ``prod``; ``max``/``min`` (of all, of two, along a
dim); ``argmax``/``argmin``/``sort``; the vector and matrix norms.
"""

from __future__ import annotations

import math

import torch

from .. import _rules as rules
from .._dtensor import DTensor
from .._errors import InputTypeError, explain
from .._global_ops import dispatch
from .._op_decisions import GENERIC, Handler, refused, register, resolved
from .common import checked_dim, dim_param, functions, no_params, on_meta, plain

__all__: list[str] = []


# --- reductions --------------------------------------------------------------------------------


def _dims(dim, ndim: int) -> tuple[int, ...]:
    dims = (dim,) if isinstance(dim, int) else None if dim is None else tuple(dim)
    if not dims:  # None, and an empty dim list, reduce every dim (as torch)
        return tuple(range(ndim))
    return tuple(sorted({d % max(ndim, 1) for d in dims})) if ndim else ()


def _reduction(kind: str):
    def params(args, kwargs, tensors):
        rest = [a for a in args[1:] if not isinstance(a, torch.dtype)]
        dim = kwargs.get("dim", rest[0] if rest else None)
        keepdim = kwargs.get("keepdim", rest[1] if len(rest) > 1 else False)
        if kind in ("amax", "amin") and tensors[0].dtype.is_complex:  # meta kernels let it pass
            raise InputTypeError(
                explain(
                    f"torch.{kind}",
                    "complex values have no order",
                    expected="a real dtype (as on one device)",
                    got=str(tensors[0].dtype),
                    fix="reduce x.abs() or x.real instead",
                )
            )
        grad = kind in ("amax", "amin") and tensors[0].requires_grad and torch.is_grad_enabled()
        # under autograd a max over a sharded dim gathers it: only the device holding the max
        # may take its gradient
        dims = _dims(dim, tensors[0].ndim)
        negative = tuple([d - tensors[0].ndim for d in dims])
        return ("whole" if grad else kind, dims, bool(keepdim), negative)

    def local(func, args, kwargs, ctx):
        storage = args[0]
        _, dims, keepdim, negative = ctx.decision.call.params
        dtype = kwargs.get("dtype")  # keyword-only in every reduction
        if kind == "sum" and negative:
            return torch.sum(storage, dim=negative, keepdim=keepdim, dtype=dtype)
        shape = ctx.decision.call.shapes[0]
        if not negative:
            return storage.to(ctx.decision.out_dtypes[0])
        if kind == "sum":
            return torch.sum(storage, dim=negative, keepdim=keepdim, dtype=dtype)
        if kind == "mean":
            total = torch.sum(
                storage, dim=negative, keepdim=keepdim, dtype=dtype or ctx.decision.out_dtypes[0]
            )
            return total / math.prod([shape[d] for d in dims])
        if kind in ("amax", "amin"):
            if 0 in [storage.shape[d] for d in negative]:  # an empty shard: the identity
                shape = [1 if i - storage.dim() in negative else n for i, n in enumerate(storage.shape)]
                if not keepdim:
                    shape = [n for i, n in enumerate(shape) if i - storage.dim() not in negative]
                identity = _identity(kind, storage.dtype)
                return torch.full(shape, identity, dtype=storage.dtype, device=storage.device)
            return (torch.amax if kind == "amax" else torch.amin)(storage, dim=negative, keepdim=keepdim)
        for d in sorted(negative):
            storage = torch.prod(storage, dim=d, keepdim=True, dtype=dtype)
        return storage if keepdim else storage.squeeze(tuple(negative))

    return params, local


def _identity(kind: str, dtype: torch.dtype):
    """The identity of ``amax``/``amin`` in ``dtype`` (False/True for bool, which torch.iinfo
    does not take)."""
    if dtype == torch.bool:
        return kind == "amin"
    if dtype.is_floating_point:
        return -math.inf if kind == "amax" else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind == "amax" else info.max


def _reduction_rule(call):
    kind, dims, keepdim, _ = call.params
    return rules.reduction(call._replace(params=(kind, dims, keepdim)))


def _amax_values(input, dim=(), keepdim=False):
    """``torch.amax`` (the form with a rule; :func:`_extreme` takes the calls)."""
    return torch.amax(input, dim, keepdim)


def _amin_values(input, dim=(), keepdim=False):
    return torch.amin(input, dim, keepdim)


_VALUES = {"amax": _amax_values, "amin": _amin_values}

for _kind in ("sum", "mean", "amax", "amin", "prod"):
    _params, _local = _reduction(_kind)
    by_grad = _kind in ("amax", "amin")  # with gradients, a sharded dim is gathered (see params)
    forms = [_VALUES[_kind]] if _kind in _VALUES else functions(_kind)
    register(forms, Handler(_reduction_rule, _params, _local, _kind, by_grad=by_grad, batched="leading"))


def _extreme(kind: str):
    """``amax`` / ``amin``. With gradients, over dims that may be sharded, as torch's gradient
    needs and without gathering the input: the extreme reduced locally and combined (an
    all-reduce of the small result), then the value as the extreme plus the mean of the
    elements that reach it less it (zero), whose gradient is torch's: the output's spread
    evenly over the elements equal to it (a sum of the hits, reduced as small). Where the
    extreme is not finite (or while compiling, which reads no value), the dims are gathered."""
    values = _VALUES[kind]

    def composite(func, args, kwargs, ctx):
        found = _FOUND[kind]
        x, rest = args[0], list(args[1:])
        dim = kwargs.get("dim", rest[0] if rest else ())
        keepdim = kwargs.get("keepdim", rest[1] if len(rest) > 1 else False)
        dim = () if dim is None else dim
        if not (torch.is_grad_enabled() and isinstance(x, DTensor) and x.requires_grad) or not x.ndim:
            return dispatch(values, (x, dim, keepdim), {}, found)
        if torch.compiler.is_compiling() or x.dtype.is_complex or not x.dtype.is_floating_point:
            return dispatch(values, (x, dim, keepdim), {}, found)
        dims = _dims(dim, x.ndim)
        top = dispatch(values, (x.detach(), dims, True), {}, found)
        if not bool(torch.isfinite(top).all()):
            return dispatch(values, (x, dim, keepdim), {}, found)
        hit = torch.eq(x, top)
        count = torch.sum(hit, dim=dims, keepdim=True)
        spread = torch.sum(torch.where(hit, torch.sub(x, top), 0.0), dim=dims, keepdim=True)
        out = torch.add(top, torch.div(spread, count))
        return out if keepdim else out.squeeze(dims)

    return composite


for _kind in _VALUES:
    register(functions(_kind), Handler(None, no_params, _extreme(_kind), _kind, explained_as=_VALUES[_kind]))


def _max_min(kind: str):
    """``max``/``min``: of all elements, of two values (elementwise), or along a dim (values
    and indices: the dim must be whole)."""
    elementwise = torch.maximum if kind == "max" else torch.minimum
    whole = torch.amax if kind == "max" else torch.amin

    def composite(func, args, kwargs, ctx):
        other = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("dim"))
        if isinstance(other, (DTensor, torch.Tensor)):
            return elementwise(args[0], other)
        if other is None:
            return whole(args[0])
        rest = {k: v for k, v in kwargs.items() if k != "dim"}  # the dim is passed as `other`
        return dispatch(_MAX_ALONG[kind], (args[0], other, *args[2:]), rest, _FOUND[f"{kind} along"])

    return composite


def _along_max(kind):
    def local(func, args, kwargs, ctx):
        (dims,) = ctx.decision.call.params[:1]
        ndim = len(ctx.decision.call.shapes[0])
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if not ndim:  # a 0-d value: its one element along a dim of its own
            return getattr(torch, kind)(args[0].unsqueeze(-1), -1)  # (torch's return type)
        return getattr(torch, kind)(args[0], dims[0] - ndim, keepdim=keepdim)

    return local


def _max_along(input, dim, keepdim=False):
    return torch.max(input, dim, keepdim=keepdim)


def _min_along(input, dim, keepdim=False):
    return torch.min(input, dim, keepdim=keepdim)


_MAX_ALONG = {"max": _max_along, "min": _min_along}  # the along-a-dim forms, with their own rule
for _kind in ("max", "min"):
    register(
        [_MAX_ALONG[_kind]],
        Handler(rules.along, dim_param(1, _kind), _along_max(_kind), _kind, batched="leading"),
    )
    register(functions(_kind), Handler(None, no_params, _max_min(_kind), _kind))


def _arg_params(name: str):
    """``argmax``/``argmin``: the dim they reduce must be whole; without one, every dim."""

    def params(args, kwargs, tensors):
        dim, ndim = kwargs.get("dim", args[1] if len(args) > 1 else None), tensors[0].ndim
        return (tuple(range(ndim)) if dim is None else (checked_dim(dim, ndim, name),),)

    return params


def _arg_local(func, args, kwargs, ctx):
    (whole,), ndim = ctx.decision.call.params, len(ctx.decision.call.shapes[0])
    x = args[0]
    if len(whole) != 1 or not ndim:  # of every element (or a 0-d value's one): flattened
        return func(x.reshape(-1), -1).reshape(ctx.decision.out_shapes[0])
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    return func(x, whole[0] - ndim, keepdim=keepdim)


def _sort_local(func, args, kwargs, ctx):
    ((dim,),), ndim = ctx.decision.call.params, len(ctx.decision.call.shapes[0])
    descending = args[2] if len(args) > 2 else kwargs.get("descending", False)
    rest = {k: v for k, v in kwargs.items() if k not in ("dim", "descending")}
    if not ndim:  # a 0-d value: along a dim of its own
        out = func(args[0].unsqueeze(-1), dim=-1, descending=descending, **rest)
        return type(out)([o.squeeze(-1) for o in out])
    return func(args[0], dim=dim - ndim, descending=descending, **rest)  # (keywords: stable= too)


for _name in ("argmax", "argmin"):
    register(
        functions(_name),
        Handler(rules.along, _arg_params(_name), _arg_local, _name, batched="along_flattened"),
    )
register(
    functions("sort"),
    Handler(rules.along, dim_param(1, "sort", default=-1), _sort_local, "sort", batched="leading"),
)


def _arguments(args, kwargs, **defaults) -> list:
    """The named arguments' values (``defaults`` in signature order), then the keyword ``dtype``."""
    bound = dict(zip(defaults, args)) | kwargs
    return [bound.get(name, default) for name, default in defaults.items()] + [kwargs.get("dtype")]


def _norm(func, args, kwargs, ctx):
    """``torch.norm`` / ``Tensor.norm``: a vector or a matrix norm, as torch's own code picks."""
    on_meta(func, args, kwargs)
    x, p, dim, keepdim, dtype = _arguments(args, kwargs, input=None, p="fro", dim=None, keepdim=False)
    dims = (dim,) if isinstance(dim, int) else dim
    if p == "fro" and (dims is None or len(dims) <= 2) or not isinstance(p, str):
        return torch.linalg.vector_norm(x, 2 if p in ("fro", None) else p, dims, keepdim, dtype=dtype)
    dims = tuple(range(x.ndim)) if dims is None else dims
    return torch.linalg.matrix_norm(x, p, dims, keepdim, dtype=dtype)


def _linalg_norm(func, args, kwargs, ctx):
    """``torch.linalg.norm``: a vector norm over one dim (or all, without ``ord``), else a
    matrix norm."""
    on_meta(func, args, kwargs)
    x, ord, dim, keepdim, dtype = _arguments(args, kwargs, input=None, ord=None, dim=None, keepdim=False)
    dims = tuple(range(x.ndim)) if dim is None and ord is not None else dim
    dims = (dims,) if isinstance(dims, int) else dims
    if ord is None or len(dims) == 1:
        return torch.linalg.vector_norm(x, 2 if ord is None else ord, dims, keepdim, dtype=dtype)
    return torch.linalg.matrix_norm(x, ord, dims, keepdim, dtype=dtype)


def _vector_norm(func, args, kwargs, ctx):
    """``torch.linalg.vector_norm`` as global reductions of ``|x|`` (sharded dims reduce to
    Partial values): ``inf`` / ``-inf`` its largest / smallest element, 0 the count of
    nonzeros, another ``ord`` the ``ord``-th root of the sum of its powers."""
    out = on_meta(func, args, kwargs)
    x, ord, dim, keepdim, dtype = _arguments(args, kwargs, x=None, ord=2, dim=None, keepdim=False)
    size = torch.abs(x if dtype is None else x.to(dtype))
    over = dict(dim=tuple(range(x.ndim)) if dim is None else dim, keepdim=keepdim)
    if ord in (math.inf, -math.inf):
        return (torch.amax if ord > 0 else torch.amin)(size, **over)
    if ord == 0:
        return torch.sum(torch.ne(size, 0), **over).to(out.dtype)
    if ord == 1:
        return torch.sum(size, **over)
    if ord < 0:  # a zero |x| makes the sum infinite and the norm 0, with the subgradient 0
        zero = torch.eq(size, 0)
        powered = torch.where(zero, math.inf, torch.pow(torch.where(zero, 1.0, size), ord))
        return torch.pow(torch.sum(powered, **over), 1.0 / ord)
    if ord != 2:  # |x| ** ord of a zero |x|: 0, with torch's subgradient 0 (ord < 1 has none)
        positive = torch.gt(size, 0)
        size = torch.where(positive, torch.pow(torch.where(positive, size, 1.0), ord), 0.0)
    total = torch.sum(torch.square(size) if ord == 2 else size, **over)
    # the root of a zero total has no derivative: 0 there, as torch's subgradient at zero
    nonzero = torch.gt(total, 0)
    safe = torch.where(nonzero, total, 1.0)
    return torch.where(nonzero, torch.sqrt(safe) if ord == 2 else torch.pow(safe, 1.0 / ord), 0.0)


def _matrix_norm(func, args, kwargs, ctx):
    """``torch.linalg.matrix_norm``: ``fro`` a vector norm of the matrices, ``1`` / ``inf`` (and
    their negatives) the largest (smallest) sum of ``|x|`` down a column / along a row, as global
    reductions; ``nuc``, ``2``, ``-2`` sums and extremes of singular values, which need whole
    matrices: computed on the replicated value (:func:`_singular_norm`)."""
    out = on_meta(func, args, kwargs)
    x, ord, dim, keepdim, dtype = _arguments(args, kwargs, A=None, ord="fro", dim=(-2, -1), keepdim=False)
    x = x if dtype is None else x.to(dtype)
    if ord == "fro":
        return torch.linalg.vector_norm(x, 2, dim, keepdim)
    if ord in ("nuc", 2, -2):
        dims = tuple(d % x.ndim for d in dim)
        return dispatch(_singular_norm, (x, ord, dims, keepdim), {}, _FOUND["singular norm"])
    rows, cols = dim
    summed, then = (cols, rows) if ord in (math.inf, -math.inf) else (rows, cols)
    sums = torch.sum(torch.abs(x), dim=summed, keepdim=True)
    return (torch.amax if ord > 0 else torch.amin)(sums, dim=then, keepdim=True).reshape(tuple(out.shape))


def _singular_norm(x, ord, dim, keepdim):
    """A matrix norm of singular values, over ``dim`` (two dims, counted from 0)."""
    return torch.linalg.matrix_norm(x, ord, dim, keepdim)


def _singular_norm_local(func, args, kwargs, ctx):
    x, ord, dim, keepdim = args
    ndim = len(ctx.decision.call.shapes[0])
    return torch.linalg.matrix_norm(x, ord, tuple(d - ndim for d in dim), keepdim)  # from the end


register([torch.norm, torch.Tensor.norm], Handler(None, no_params, _norm, "norm"))
register([torch.linalg.norm], Handler(None, no_params, _linalg_norm, "linalg.norm"))
register([torch.linalg.vector_norm], Handler(None, no_params, _vector_norm, "linalg.vector_norm"))
register([torch.linalg.matrix_norm], Handler(None, no_params, _matrix_norm, "linalg.matrix_norm"))
register(
    [_singular_norm],
    Handler(rules.whole, no_params, _singular_norm_local, "linalg.matrix_norm", batched="leading"),
)

# the internal forms composites dispatch to, by handler and number (a dict keyed by functions is
# not searched while Dynamo traces)
_FOUND = {
    **{kind: resolved(form) for kind, form in _VALUES.items()},
    **{f"{kind} along": resolved(form) for kind, form in _MAX_ALONG.items()},
    "singular norm": resolved(_singular_norm),
}


# --- rules from torch's op metadata ------------------------------------------------------------

#: reductions torch tags ``reduction`` whose parts combine over a sharded dim (as DTensor's
#: reduction table has them); the others take their reduced dims whole
_COMBINED = {"nansum": "sum", "count_nonzero": "sum"}

#: distinct sizes, one per dim, for a probe of the output's dims (no two dims alike)
_PROBE_SIZES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _reduced_dims(func, name: str, kind: str):
    """The dims a tagged reduction reduces and whether it keeps them: read from its output on a
    meta probe whose dims all differ in size (a kept dim is the one of its size). An output
    whose dims cannot be told apart so reduces every dim (the value replicated: always right)."""

    def params(args, kwargs, tensors):
        x = tensors[0]
        if len(tensors) != 1 or args[0] is not x or x.ndim > len(_PROBE_SIZES):
            return (kind if len(tensors) == 1 else "whole", tuple(range(x.ndim)), False)
        probe = torch.empty(_PROBE_SIZES[: x.ndim], dtype=x.dtype, device="meta")
        try:
            out = func(probe, *args[1:], **kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError) as error:
            raise refused(name, f"{tuple(x.shape)} {x.dtype}", error) from None
        shape = tuple((out[0] if isinstance(out, (tuple, list)) else out).shape)
        sizes = _PROBE_SIZES[: x.ndim]
        if len(shape) == x.ndim and all(n in (1, size) for n, size in zip(shape, sizes)):
            return (kind, tuple(d for d in range(x.ndim) if shape[d] == 1), True)
        if all(n in sizes for n in shape) and list(shape) == sorted(shape, key=sizes.index):
            return (kind, tuple(d for d in range(x.ndim) if sizes[d] not in shape), False)
        return ("whole", tuple(range(x.ndim)), False)

    return params


def _tagged_reduction(func) -> Handler | None:
    """The reduction rule for a torch function whose aten op (of the same name) torch tags
    ``reduction``: the dims it reduces whole (or combined as a Partial, for those of
    :data:`_COMBINED`), the others kept sharded. Run on each device's block as it is."""
    name = getattr(func, "__name__", None)
    packet = getattr(torch.ops.aten, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or name.endswith("_"):
        return None
    overloads = [getattr(packet, o) for o in packet.overloads()]
    if not any(torch.Tag.reduction in o.tags for o in overloads):
        return None
    if any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads):
        return None
    return Handler(rules.reduction, _reduced_dims(func, name, _COMBINED.get(name, "whole")), plain, name)


GENERIC.append(_tagged_reduction)

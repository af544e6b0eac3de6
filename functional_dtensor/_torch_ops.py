"""The torch ops an ``fd.DTensor`` takes, each with its rule (:mod:`._rules`) and its local form
on storage; Python operators and Tensor methods on ``fd.DTensor``, installed from here.

Importing this module registers the ops with :mod:`._global_ops` and gives ``fd.DTensor`` its
``__torch_function__``, operators and methods.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from . import _rules as rules
from . import random as fd_random
from ._backend import backend_of, is_transformed
from ._blocks import valid_mask
from ._cache import cached
from ._dtensor import DTensor, storage_of, without_partial
from ._errors import InputTypeError, ShapeError, explain
from ._factories import empty, full, ones, zeros
from ._global_ops import GENERIC, Handler, dispatch, refused, register
from ._placements import Shard
from ._sharding import shard_table

__all__: list[str] = []


def _none(args, kwargs, tensors):
    return ()


def _plain(func, args, kwargs, ctx):
    return func(*args, **kwargs)


def _align(args, kwargs, ctx):
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


def _unpadded_gradients(args, kwargs, ctx):
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


def _elementwise_local(func, args, kwargs, ctx):
    args, kwargs = _align(args, kwargs, ctx)
    if ctx.lead and ctx.decision.padded[0] and torch.is_grad_enabled():
        args, kwargs = _unpadded_gradients(args, kwargs, ctx)
    out = func(*args, **kwargs)
    if ctx.lead and out.dtype != ctx.decision.out_dtypes[0]:
        # a 0-d value's stacked storage has a dim, so torch's type promotion counted it as a
        # dimensioned tensor (int64 0-d + int32 vector is int32 on one device)
        return out.to(ctx.decision.out_dtypes[0])
    return out


def _functions(name: str):
    """The torch function, the Tensor method and the functional form named ``name``."""
    return [getattr(torch, name, None), getattr(torch.Tensor, name, None), getattr(F, name, None)]


# --- elementwise -------------------------------------------------------------------------------

_UNARY = (
    "abs exp exp2 expm1 log log1p log2 sqrt rsqrt tanh sigmoid relu silu gelu sin cos reciprocal "
    "sign floor ceil round trunc logical_not isnan isinf isfinite square erf softplus leaky_relu elu "
    "relu6 hardtanh mish logsigmoid clamp clip nan_to_num"
).split()
_BINARY = (
    "pow maximum minimum eq ne lt le gt ge logical_and logical_or logical_xor atan2 remainder fmod where lerp"
).split()


def _divisor_local(func, args, kwargs, ctx):
    """``remainder``, ``fmod``, ``div``: an integer divisor's padding (the zeros an uneven shard
    is padded with on stacked storage) set to one, so that the division does not fail there."""
    divisor = args[1] if len(args) > 1 else None
    count = len(ctx.decision.inputs)  # the fd.DTensor inputs (a plain 0-d tensor is none)
    if (
        ctx.lead
        and isinstance(divisor, torch.Tensor)
        and not (divisor.is_floating_point() or divisor.is_complex())
        # the divisor is a value's storage: the other operand is one too, or a number or a
        # plain 0-d tensor (a storage has the device dim)
        and (count == 2 or not (isinstance(args[0], torch.Tensor) and args[0].dim() >= 1))
    ):
        i = count - 1  # the divisor's place among the fd.DTensor inputs
        layout, shape = ctx.decision.inputs[i], ctx.decision.call.shapes[i]
        if not shard_table(layout, shape).is_even:
            args = (args[0], divisor.masked_fill(~_valid(layout, shape, divisor), 1), *args[2:])
    return _elementwise_local(func, args, kwargs, ctx)


def _gradients(args, kwargs, tensors):
    """Whether some input needs a gradient (a rule's Partial options may depend on it)."""
    return (torch.is_grad_enabled() and any([t.requires_grad for t in tensors]),)


def _masked_fill_local(func, args, kwargs, ctx):
    """``masked_fill`` as ``where``: a value given as an fd.DTensor is, on stacked storage, a
    vector of every device's value, which masked_fill does not take."""
    (x, mask, value), _ = _align([*args[:2], args[2] if len(args) > 2 else kwargs["value"]], {}, ctx)
    return torch.where(mask, value, x).to(x.dtype)


_MASKED_FILL = Handler(rules.elementwise, _none, _masked_fill_local, "masked_fill", False)
register(_functions("masked_fill"), _MASKED_FILL)
_EXTREMA = {"maximum": rules.extremum(rules.MAX), "minimum": rules.extremum(rules.MIN)}
for _name in _UNARY + _BINARY:
    local = _divisor_local if _name in ("remainder", "fmod") else _elementwise_local
    if _name in _EXTREMA:
        register(_functions(_name), Handler(_EXTREMA[_name], _gradients, local, _name, False, by_grad=True))
    else:
        register(_functions(_name), Handler(rules.elementwise, _none, local, _name, False))
for _name in ("neg", "negative"):
    register(_functions(_name), Handler(rules.linear, _none, _elementwise_local, _name, False))


def _operands(args, kwargs) -> list:
    return [*args[:2], *[kwargs[k] for k in ("input", "other") if k in kwargs]]


def _constant_operand(args, kwargs, tensors):
    """Whether a number or a plain tensor is an operand (``x + 1``): a constant added on every
    device's part of a Partial(sum) value would be counted once per device; and whether some
    input needs a gradient."""
    constant = any(not isinstance(v, DTensor) for v in _operands(args, kwargs))
    return (constant, *_gradients(args, kwargs, tensors))


def _sum(call):
    """``a + b``, ``a - b``: linear in the fd.DTensor operands together, affine with a constant."""
    constant, gradients = call.params
    return (rules.affine if constant else rules.additive)(call, gradients=gradients)


for _name in ("add", "sub", "subtract"):
    register(
        _functions(_name), Handler(_sum, _constant_operand, _elementwise_local, _name, False, by_grad=True)
    )


def _numerator_first(args, kwargs, tensors):
    return (isinstance(_operands(args, kwargs)[0], DTensor), *_gradients(args, kwargs, tensors))


def _quotient(call):
    """``a / b``: Partial(sum) passes through the numerator alone (``2 / x`` is not linear);
    Partial(avg) too where the denominator needs no gradient."""
    numerator, gradients = call.params
    return rules.elementwise(call, partial=(0,) if numerator else (), average=not gradients)


def _product(call):
    """``a * b``: Partial(sum) in one factor, the other replicated; Partial(avg) too where the
    replicated factor needs no gradient."""
    (gradients,) = call.params
    tensors = sum(s is not None for s in call.shapes)
    options = rules.elementwise(call, partial=(0,), average=not gradients)
    if tensors == 2:
        more = rules.elementwise(call, partial=(1,), average=not gradients)
        options += [o for o in more if o.output.is_partial()]
    return options


for _name in ("mul", "multiply"):
    register(_functions(_name), Handler(_product, _gradients, _elementwise_local, _name, False, by_grad=True))
for _name in ("div", "divide", "true_divide"):
    register(
        _functions(_name),
        Handler(_quotient, _numerator_first, _divisor_local, _name, False, by_grad=True),
    )


def _conversion_params(args, kwargs, tensors):
    mesh = tensors[0].device_mesh
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, (torch.device, str)) and _device_type(value) == mesh.device_type:
            continue  # the devices the value is on already: x.to("cpu") on a CPU mesh
        if isinstance(value, (torch.device, str)) or (
            isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        ):
            raise InputTypeError(
                explain(
                    "fd.DTensor.to",
                    "a global value stays on its mesh's devices",
                    expected="a dtype (x.to(torch.float64)) or an fd.DTensor (type_as)",
                    got=repr(value),
                    fix="convert the dtype only; to move a value, build it on another mesh",
                )
            )
    return ()


def _device_type(value) -> str | None:
    try:
        return torch.device(value).type
    except (RuntimeError, TypeError):
        return None


def _conversion_local(func, args, kwargs, ctx):
    # a global value is laid out as torch.empty(x.shape) is: no memory format of its own (the
    # stacked storage has a dim more than the formats take)
    kwargs = {k: v for k, v in kwargs.items() if k != "memory_format"}
    if func is torch.Tensor.type_as:
        return args[0].to(ctx.decision.out_dtypes[0])
    return func(*args, **kwargs)


register(
    [getattr(torch.Tensor, n) for n in "float double half bfloat16 clone contiguous".split()] + [torch.clone],
    Handler(rules.linear, _conversion_params, _conversion_local, "to"),
)


def _to_on_mesh(x, *args, **kwargs):
    """``Tensor.to`` without a device (or with the one the value is on)."""
    return x.to(*args, **kwargs)


def _to(func, args, kwargs, ctx):
    """``x.to(...)``: the devices the value is on already name no move (``x.to("cpu")`` on a
    CPU mesh); a dtype converts; another device is refused (see :func:`_conversion_params`)."""
    x, mesh = args[0], args[0].device_mesh

    def here(value) -> bool:
        return isinstance(value, (torch.device, str)) and _device_type(value) == mesh.device_type

    rest = [v for v in args[1:] if not here(v)]
    kwargs = {k: v for k, v in kwargs.items() if not (k == "device" and here(v))}
    return dispatch(_to_on_mesh, (x, *rest), kwargs) if rest or kwargs else x


register(
    [_to_on_mesh] + [getattr(torch.Tensor, n) for n in "int long bool type_as".split()],
    Handler(rules.elementwise, _conversion_params, _conversion_local, "to"),
)
register([torch.Tensor.to], Handler(None, _none, _to, "to"))
register([torch.Tensor.detach, torch.detach], Handler(rules.linear, _none, _plain, "detach"))


# --- matmul ------------------------------------------------------------------------------------


class _Bmm(torch.autograd.Function):
    """``torch.bmm`` whose gradient of ``b`` has ``b``'s memory order, as torch's ``mm`` gives
    it: ``b`` a transposed view (``x @ w.t()``, a linear layer's weight), its gradient is the
    transpose of a row-major product, so the weight's own gradient is row-major (an optimizer
    reads it in one pass; a transposed one it reads several times slower). The backward is
    products of the inputs, so every order of differentiation works."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return torch.bmm(a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = torch.bmm(grad, b.mT) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = torch.bmm(grad.mT, a).mT if b.mT.is_contiguous() else torch.bmm(a.mT, grad)
        return grad_a, grad_b


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One product per device (or batch); a contraction of length one is a broadcast product
    (one kernel) where the dtype is one every device multiplies matrices of."""
    if a.size(2) == 1 and a.is_floating_point():
        return a * b
    if b.requires_grad and b.mT.is_contiguous() and not b.is_contiguous():
        return _Bmm.apply(a, b)
    return torch.bmm(a, b)


def _matmul_local(func, args, kwargs, ctx):
    a, b = args[0], args[1]
    dims = a.dim(), b.dim()
    if dims == (3, 3) and (ctx.lead or a.size(0) == b.size(0)):  # a matrix per device, or per batch
        return _bmm(a, b)
    if ctx.lead and dims[1] == 3 and dims[0] > 3:
        # a batch of rows times one matrix per device: the rows folded into one product per
        # device (broadcasting the matrix over the batch would copy it and split the product)
        rows = a.reshape(a.shape[0], -1, a.shape[-1])
        return _bmm(rows, b).reshape(*a.shape[:-1], b.shape[-1])
    if ctx.lead and dims[0] != dims[1]:  # align batch dims after the device dim
        ndim = len(ctx.decision.out_shapes[0])
        a, b = [x.reshape(x.shape[:1] + (1,) * (ndim + 1 - x.dim()) + x.shape[1:]) for x in (a, b)]
    return torch.matmul(a, b)


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
    """``mm``: matrices, so on stacked devices one per device (no ranks to look at)."""
    a, b = args[0], args[1]
    return _bmm(a, b) if ctx.lead else torch.mm(a, b)


def _matmul_of_matrices(a, b):
    """``torch.matmul`` of two values of 2 dims or more (its rule's form)."""
    return torch.matmul(a, b)


def _matmul(func, args, kwargs, ctx):
    """``torch.matmul`` as torch takes it: a vector operand is a one-row (first) or one-column
    (second) matrix, and the product drops that dim (two vectors: their dot product)."""
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or min(a.ndim, b.ndim) != 1:
        return dispatch(_matmul_of_matrices, (a, b), {})
    rows = a.unsqueeze(0) if a.ndim == 1 else a
    cols = b.unsqueeze(-1) if b.ndim == 1 else b
    out = dispatch(_matmul_of_matrices, (rows, cols), {})
    if b.ndim == 1:
        out = out.squeeze(-1)
    return out.squeeze(-1 if b.ndim == 1 else -2) if a.ndim == 1 else out


register(
    [_matmul_of_matrices, torch.bmm, torch.Tensor.bmm],
    Handler(rules.matmul, _matmul_params, _matmul_local, "matmul"),
)
register(
    [torch.matmul, torch.Tensor.matmul],
    Handler(None, _none, _matmul, "matmul", explained_as=_matmul_of_matrices),
)
register([torch.mm, torch.Tensor.mm], Handler(rules.matmul, _matmul_params, _mm_local, "matmul"))


def _linear(func, args, kwargs, ctx):
    x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    out = torch.matmul(x, torch.t(weight))  # torch functions, not operators: they compile
    return out if bias is None else torch.add(out, bias)


def _addmm(func, args, kwargs, ctx):
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    out = torch.matmul(a, b)
    out = out if alpha == 1 else torch.mul(out, alpha)
    return torch.add(out, bias if beta == 1 else torch.mul(bias, beta))


register([F.linear], Handler(None, _none, _linear, "linear"))
register([torch.addmm, torch.Tensor.addmm], Handler(None, _none, _addmm, "addmm"))


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
        layout = ctx.decision.inputs[0]
        if kind in ("amax", "amin", "prod") and ctx.lead and not shard_table(layout, shape).is_even:
            identity = 1 if kind == "prod" else _identity(kind, storage.dtype)
            storage = storage.masked_fill(~_valid(layout, shape, storage), identity)
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


def _valid(layout, shape, storage):
    return valid_mask(layout, shape, str(storage.device))


def _reduction_rule(call):
    kind, dims, keepdim, _ = call.params
    return rules.reduction(call._replace(params=(kind, dims, keepdim)))


for _kind in ("sum", "mean", "amax", "amin", "prod"):
    _params, _local = _reduction(_kind)
    by_grad = _kind in ("amax", "amin")  # with gradients, a sharded dim is gathered (see params)
    register(_functions(_kind), Handler(_reduction_rule, _params, _local, _kind, by_grad=by_grad))


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
        return dispatch(_MAX_ALONG[kind], (args[0], other, *args[2:]), rest)

    return composite


def _along_max(kind):
    def local(func, args, kwargs, ctx):
        (dims,) = ctx.decision.call.params[:1]
        ndim = len(ctx.decision.call.shapes[0])
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if not ndim:  # a 0-d value: its one element along a dim of its own (not the device dim)
            return getattr(torch, kind)(args[0].unsqueeze(-1), -1)  # (torch's return type)
        return getattr(torch, kind)(args[0], dims[0] - ndim, keepdim=keepdim)

    return local


def _checked_dim(dim: int, ndim: int, op: str) -> int:
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


def _dim_param(position: int, op: str, name: str = "dim", default: int | None = None):
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
        return ((_checked_dim(dim, tensors[0].ndim, op),),)

    return params


def _max_along(input, dim, keepdim=False):
    return torch.max(input, dim, keepdim=keepdim)


def _min_along(input, dim, keepdim=False):
    return torch.min(input, dim, keepdim=keepdim)


_MAX_ALONG = {"max": _max_along, "min": _min_along}  # the along-a-dim forms, with their own rule
for _kind in ("max", "min"):
    register([_MAX_ALONG[_kind]], Handler(rules.along, _dim_param(1, _kind), _along_max(_kind), _kind))
    register(_functions(_kind), Handler(None, _none, _max_min(_kind), _kind))


def _arg_params(name: str):
    """``argmax``/``argmin``: the dim they reduce must be whole; without one, every dim."""

    def params(args, kwargs, tensors):
        dim, ndim = kwargs.get("dim", args[1] if len(args) > 1 else None), tensors[0].ndim
        return (tuple(range(ndim)) if dim is None else (_checked_dim(dim, ndim, name),),)

    return params


def _arg_local(func, args, kwargs, ctx):
    (whole,), ndim = ctx.decision.call.params, len(ctx.decision.call.shapes[0])
    x, lead = args[0], args[0].shape[: ctx.lead]
    if len(whole) != 1 or not ndim:  # of every element (or a 0-d value's one): flattened
        return func(x.reshape(*lead, -1), -1).reshape((*lead, *ctx.decision.out_shapes[0]))
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    return func(x, whole[0] - ndim, keepdim=keepdim)


def _sort_local(func, args, kwargs, ctx):
    ((dim,),), ndim = ctx.decision.call.params, len(ctx.decision.call.shapes[0])
    descending = args[2] if len(args) > 2 else kwargs.get("descending", False)
    rest = {k: v for k, v in kwargs.items() if k not in ("dim", "descending")}
    if not ndim:  # a 0-d value: along a dim of its own, not the device dim
        out = func(args[0].unsqueeze(-1), dim=-1, descending=descending, **rest)
        return type(out)([o.squeeze(-1) for o in out])
    return func(args[0], dim=dim - ndim, descending=descending, **rest)  # (keywords: stable= too)


for _name in ("argmax", "argmin"):
    register(_functions(_name), Handler(rules.along, _arg_params(_name), _arg_local, _name))
register(_functions("sort"), Handler(rules.along, _dim_param(1, "sort", default=-1), _sort_local, "sort"))


def _on_meta(func, args, kwargs):
    """``func`` of a composite on a meta tensor of its first argument's global shape and dtype:
    the output torch gives, and torch's argument and dtype checks as the library's error."""
    x = args[0]
    try:
        return func(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args[1:], **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        raise refused(getattr(func, "__name__", "op"), f"{tuple(x.shape)} {x.dtype}", error) from None


def _arguments(args, kwargs, **defaults) -> list:
    """The named arguments' values (``defaults`` in signature order), then the keyword ``dtype``."""
    bound = dict(zip(defaults, args)) | kwargs
    return [bound.get(name, default) for name, default in defaults.items()] + [kwargs.get("dtype")]


def _norm(func, args, kwargs, ctx):
    """``torch.norm`` / ``Tensor.norm``: a vector or a matrix norm, as torch's own code picks."""
    _on_meta(func, args, kwargs)
    x, p, dim, keepdim, dtype = _arguments(args, kwargs, input=None, p="fro", dim=None, keepdim=False)
    dims = (dim,) if isinstance(dim, int) else dim
    if p == "fro" and (dims is None or len(dims) <= 2) or not isinstance(p, str):
        return torch.linalg.vector_norm(x, 2 if p in ("fro", None) else p, dims, keepdim, dtype=dtype)
    dims = tuple(range(x.ndim)) if dims is None else dims
    return torch.linalg.matrix_norm(x, p, dims, keepdim, dtype=dtype)


def _linalg_norm(func, args, kwargs, ctx):
    """``torch.linalg.norm``: a vector norm over one dim (or all, without ``ord``), else a
    matrix norm."""
    _on_meta(func, args, kwargs)
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
    out = _on_meta(func, args, kwargs)
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
    out = _on_meta(func, args, kwargs)
    x, ord, dim, keepdim, dtype = _arguments(args, kwargs, A=None, ord="fro", dim=(-2, -1), keepdim=False)
    x = x if dtype is None else x.to(dtype)
    if ord == "fro":
        return torch.linalg.vector_norm(x, 2, dim, keepdim)
    if ord in ("nuc", 2, -2):
        return dispatch(_singular_norm, (x, ord, tuple(d % x.ndim for d in dim), keepdim), {})
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


register([torch.norm, torch.Tensor.norm], Handler(None, _none, _norm, "norm"))
register([torch.linalg.norm], Handler(None, _none, _linalg_norm, "linalg.norm"))
register([torch.linalg.vector_norm], Handler(None, _none, _vector_norm, "linalg.vector_norm"))
register([torch.linalg.matrix_norm], Handler(None, _none, _matrix_norm, "linalg.matrix_norm"))
register([_singular_norm], Handler(rules.whole, _none, _singular_norm_local, "linalg.matrix_norm"))


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
    register(_functions(_name), Handler(rules.along, _dim_param(1, _name), _negative_dim_local, _name))


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
            out = torch.where(_valid(ctx.decision.output, ctx.decision.out_shapes[0], out), out, 0.0)
        (weight, bias), _ = _align(affine, {}, ctx)
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


register(
    [F.scaled_dot_product_attention],
    Handler(_attention_rule, _none, _attention_local, "scaled_dot_product_attention"),
)


# --- views -------------------------------------------------------------------------------------


def _permutation_of(name: str):
    def params(args, kwargs, tensors):
        ndim = tensors[0].ndim
        if ndim == 0:  # torch takes dims 0 and -1 of a 0-d value: nothing to permute
            return ((),)
        if name == "t":
            return (tuple(range(ndim))[::-1],)
        if name == "transpose":
            d0 = args[1] if len(args) > 1 else kwargs["dim0"]
            d1 = args[2] if len(args) > 2 else kwargs["dim1"]
            order = list(range(ndim))
            order[d0 % ndim], order[d1 % ndim] = order[d1 % ndim], order[d0 % ndim]
            return (tuple(order),)
        dims = args[1:] if len(args) > 1 else (kwargs["dims"],)
        if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
            dims = dims[0]
        return (tuple(d % ndim for d in dims),)

    return params


def _permute_local(func, args, kwargs, ctx):
    (order,) = ctx.decision.call.params
    return args[0].permute(*range(ctx.lead), *[d + ctx.lead for d in order])


for _name in ("t", "transpose", "permute", "swapaxes", "swapdims"):
    key = "transpose" if _name in ("swapaxes", "swapdims") else _name
    register(_functions(_name), Handler(rules.permutation, _permutation_of(key), _permute_local, _name))


@cached(1024)
def _view_pairs_of(shape: tuple[int, ...], out: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """``(input dim, output dim, divisor)`` for every input dim a view may keep sharded: the
    shapes walked from the left in groups of dims with equal products; a dim kept as it is
    (divisor 0), or the first dim of a group merged, split or both, whose shard goes to the
    group's first output dim (divisor: the devices along the dim must divide both first dims,
    so that their blocks are the same contiguous runs of the group's elements)."""
    if 0 in shape or 0 in out:
        return ()
    pairs = []
    i = o = 0
    while True:
        while i < len(shape) and shape[i] == 1:
            i += 1
        while o < len(out) and out[o] == 1:
            o += 1
        if i == len(shape) or o == len(out):
            return tuple(pairs)
        ins, outs, size_in, size_out = [i], [o], shape[i], out[o]
        i, o = i + 1, o + 1
        while size_in != size_out:
            if size_in < size_out:
                ins.append(i)
                size_in, i = size_in * shape[i], i + 1
            else:
                outs.append(o)
                size_out, o = size_out * out[o], o + 1
        # the first dims of a group split its elements in the same contiguous runs where the
        # devices divide both (a dim kept as it is: always)
        divisor = 0 if len(ins) == len(outs) == 1 else math.gcd(shape[ins[0]], out[outs[0]])
        pairs.append((ins[0], outs[0], divisor))


def _reshape_rule(call):
    """Dims a view keeps (neither merged nor split), the first of dims it merges, and a dim it
    splits (the shard going to the first part) may stay sharded."""
    pairs = _view_pairs_of(call.shapes[0], call.out_shape)
    return rules.reshape(call._replace(params=(tuple((i, o) for i, o, _ in pairs),)))


def _reshape_valid(call, mesh, combination) -> bool:
    """A merged or split dim's first part must split evenly over the devices sharding it."""
    for in_dim, _, divisor in _view_pairs_of(call.shapes[0], call.out_shape):
        if divisor:
            shard = Shard(in_dim)
            devices = math.prod(n for n, o in zip(mesh.shape, combination) if o.inputs[0] == shard)
            if divisor % devices:
                return False
    return True


def _reshape_local(func, args, kwargs, ctx):
    """The view of a block: the output's global shape, each sharded dim as long as the block's
    part of its input dim, scaled by the view (a dim merged with whole ones after it, or split
    with the shard on its first part). Read from the block, so that a rank's short or empty
    block (unpadded on the distributed backend) views as a padded stacked one does."""
    storage, block = args[0], args[0].shape[ctx.lead :]
    (shape,), out = ctx.decision.call.shapes, ctx.decision.out_shapes[0]
    local = list(out)
    for in_dim, out_dim, _ in _view_pairs_of(shape, tuple(out)):
        if ctx.decision.output.sharding_axes(out_dim):
            local[out_dim] = block[in_dim] * out[out_dim] // shape[in_dim]
    return storage.reshape((*storage.shape[: ctx.lead], *local))  # a tuple: () is a 0-d shape


for _name in ("reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze", "ravel"):
    register(_functions(_name), Handler(_reshape_rule, _none, _reshape_local, _name, True, _reshape_valid))


def _expand_local(func, args, kwargs, ctx):
    """The block expanded to the output's global shape, its sharded dims as long as the block's
    (short or empty on a rank of an uneven dim)."""
    (storage,), _ = _align([args[0]], {}, ctx)
    block, out = storage.shape[ctx.lead :], ctx.decision.out_shapes[0]
    local = [
        block[d - len(out) + len(block)] if ctx.decision.output.sharding_axes(d) else n
        for d, n in enumerate(out)
    ]
    return storage.expand((*storage.shape[: ctx.lead], *local))


register([torch.Tensor.expand], Handler(rules.elementwise, _none, _expand_local, "expand"))


def _check_index(index) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    for item in index:
        if not (item is None or item is Ellipsis or isinstance(item, (int, slice))):
            raise InputTypeError(
                explain(
                    "fd.DTensor.__getitem__",
                    "an fd.DTensor is indexed by ints, slices, None and ...",
                    expected="basic indexing",
                    got=type(item).__name__,
                    fix="gather with torch.index_select inside fd.local_map or fd.shard_map",
                )
            )
    return index


def getitem(self, index):
    return dispatch(torch.Tensor.__getitem__, (self, _check_index(index)), {})


def _index_params(args, kwargs, tensors):
    index = _check_index(args[1])
    ndim = tensors[0].ndim
    count = sum(1 for item in index if item is not None and item is not Ellipsis)
    expanded = []
    for item in index:
        if item is Ellipsis:
            expanded.extend([slice(None)] * (ndim - count))
        else:
            expanded.append(item)
    expanded.extend([slice(None)] * (ndim - sum(1 for i in expanded if i is not None)))
    kept, out, dim = [], 0, 0
    for item in expanded:
        if item is None:
            out += 1
            continue
        if isinstance(item, slice) and item == slice(None):
            kept.append((dim, out))
        if isinstance(item, slice):
            out += 1
        dim += 1
    return (tuple(kept), tuple(repr(i) for i in expanded))


def _index_rule(call):
    kept, _ = call.params
    options = [rules.Option((rules.R,), rules.R)]
    options += [rules.Option((Shard(d),), Shard(o)) for d, o in kept if call.shapes[0][d] > 1]
    return options


def _index_local(func, args, kwargs, ctx):
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return args[0][(slice(None),) * ctx.lead + index]


register([torch.Tensor.__getitem__], Handler(_index_rule, _index_params, _index_local, "__getitem__"))


# --- joining and splitting ---------------------------------------------------------------------


def _cat_params(new: bool):
    def params(args, kwargs, tensors):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        ndim = tensors[0].ndim + (1 if new else 0)
        return (dim % max(ndim, 1), new)  # 0-d values: torch refuses them (on meta, next)

    return params


def _cat_local(func, args, kwargs, ctx):
    dim, new = ctx.decision.call.params
    ndim = len(ctx.decision.out_shapes[0])
    return func(args[0], dim - ndim)


register(
    [torch.cat, torch.concat, torch.concatenate],
    Handler(rules.concatenation, _cat_params(False), _cat_local, "cat"),
)
register([torch.stack], Handler(rules.concatenation, _cat_params(True), _cat_local, "stack"))


def _split(func, args, kwargs, ctx):
    """``split``/``chunk`` as slices of the global value, the sizes as torch gives them on a
    plain tensor of the global shape (which also checks the arguments)."""
    x = args[0]
    pieces = _on_meta(func, args, kwargs)
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    out, start = [], 0
    for piece in pieces:
        n = piece.shape[dim]
        out.append(x[(slice(None),) * dim + (slice(start, start + n),)])
        start += n
    return tuple(out)


register(
    [torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk], Handler(None, _none, _split, "split")
)


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


# --- values, not layouts -----------------------------------------------------------------------


def _values(compare):
    def composite(func, args, kwargs, ctx):
        a, b = args[0], args[1]
        a = a.full_tensor() if isinstance(a, DTensor) else a
        b = b.full_tensor() if isinstance(b, DTensor) else b
        return compare(a, b, *args[2:], **kwargs)

    return composite


register([torch.allclose, torch.Tensor.allclose], Handler(None, _none, _values(torch.allclose), "allclose"))
register([torch.equal, torch.Tensor.equal], Handler(None, _none, _values(torch.equal), "equal"))


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
    register([getattr(torch, _name)], Handler(None, _none, _like(_factory), _name))
register([torch.rand_like], Handler(None, _none, _like(fd_random.rand), "rand_like"))
register([torch.randn_like], Handler(None, _none, _like(fd_random.randn), "randn_like"))


def _dropout(func, args, kwargs, ctx):
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    if not training or p == 0:
        return x
    return fd_random.dropout(fd_random.default_key(), x, p)


register([F.dropout], Handler(None, _none, _dropout, "dropout"))


# --- autograd on global values ---------------------------------------------------------------


def _autograd_grad(func, args, kwargs, ctx):
    """``torch.autograd.grad`` where outputs or inputs are ``fd.DTensor``: from the outputs'
    global values to the inputs' storages; each gradient laid out like its input (Partial axes
    as Replicate), as :attr:`fd.DTensor.grad`."""
    bound = inspect.signature(torch.autograd.grad).bind(*args, **kwargs)
    arguments = bound.arguments
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
        grad_outputs = [g.full_tensor() if type(g) is DTensor else g for g in grad_outputs]
    arguments.update(
        outputs=[o.full_tensor() if type(o) is DTensor else o for o in outputs],
        inputs=[storage_of(i) if type(i) is DTensor else i for i in inputs],
        grad_outputs=grad_outputs,
    )
    grads = func(**arguments)
    out = tuple(
        DTensor(g, without_partial(i.sharding), i.shape) if type(i) is DTensor and g is not None else g
        for g, i in zip(grads, inputs)
    )
    return out


register([torch.autograd.grad], Handler(None, _none, _autograd_grad, "autograd.grad"))


# --- losses ------------------------------------------------------------------------------------


def _whole(value: DTensor) -> DTensor:
    """``value`` with its Partial axes reduced."""
    return value.redistribute(without_partial(value.sharding)) if value.sharding.has_partial else value


def _check_targets(target: DTensor, classes: int, ignore_index: int) -> None:
    """Class indices are classes (or ignored), as torch's kernel checks: each rank checks its
    own (the padding of uneven ones holds 0, a class)."""
    held = storage_of(target)
    if torch.compiler.is_compiling() or is_transformed(held) or target.sharding.has_partial:
        return
    outside = (held != ignore_index) & ((held < 0) | (held >= classes))
    if bool(outside.any()):
        raise InputTypeError(
            explain(
                "torch.nn.functional.cross_entropy(target)",
                "a target is a class index (or the ignore_index)",
                expected=f"targets in [0, {classes}) or {ignore_index}",
                got=f"targets {held[outside].unique().tolist()[:8]}",
                fix="check the targets against the number of classes first",
            )
        )


def _cross_entropy(func, args, kwargs, ctx):
    """``F.cross_entropy`` of class logits and integer targets, as global ops: the log of a
    stable sum of exponentials over the class dim, less the target's logit (gathered). Where
    the class dim is sharded (loss parallel), only per-row maxima, sums and the target's logit
    cross devices, never the logits."""
    names = (
        "input",
        "target",
        "weight",
        "size_average",
        "ignore_index",
        "reduce",
        "reduction",
        "label_smoothing",
    )
    bound = dict(zip(names, args)) | kwargs
    logits, target = bound["input"], bound["target"]
    unsupported_args = [n for n in ("weight", "size_average", "reduce") if bound.get(n) is not None]
    if unsupported_args or bound.get("label_smoothing", 0.0) or not isinstance(target, DTensor):
        raise InputTypeError(
            explain(
                "F.cross_entropy",
                "cross_entropy of fd.DTensor takes class indices as an fd.DTensor, without weights",
                expected="F.cross_entropy(logits, target, ignore_index=..., reduction=...)",
                got=", ".join(unsupported_args) or f"target of type {type(target).__name__}",
                fix="distribute the target (fd.distribute_tensor(t, mesh, fd.P(...))); apply class weights "
                "or label smoothing inside fd.local_map",
            )
        )
    if not logits.dtype.is_floating_point or target.dtype != torch.int64:  # as torch's kernels
        raise InputTypeError(
            explain(
                "F.cross_entropy",
                "cross_entropy takes floating logits and int64 class indices",
                expected="logits of a floating dtype, a target of torch.int64",
                got=f"logits of {logits.dtype}, a target of {target.dtype}",
                fix="convert them first: F.cross_entropy(logits.float(), target.long())",
            )
        )
    dim = 1 if logits.ndim > 1 else 0
    rows = tuple(logits.shape[:dim] + logits.shape[dim + 1 :])
    if tuple(target.shape) != rows:
        raise ShapeError(
            explain(
                "torch.nn.functional.cross_entropy(target)",
                "a target holds one class index per row of the logits",
                expected=f"shape {rows} (the logits' {tuple(logits.shape)} without the class dim {dim})",
                got=f"shape {tuple(target.shape)}",
                fix="pass the targets of these logits (flatten both alike: logits.flatten(0, 1), "
                "targets.flatten(0, 1))",
            )
        )
    ignore_index = bound.get("ignore_index", -100)
    keep = torch.ne(target, ignore_index)
    classes = logits.shape[dim]
    _check_targets(target, classes, ignore_index)
    # of a sharded class dim, the maxima and sums are Partial: each reduced once, here
    top = _whole(logits.detach().amax(dim, keepdim=True))
    log_total = torch.add(_whole(torch.sub(logits, top).exp().sum(dim)).log(), top.squeeze(dim))
    # the target's logit; an ignored target (any value) reads class 0, multiplied by 0 after
    safe = torch.where(keep, target, 0)
    picked = torch.gather(logits, dim, safe.unsqueeze(dim)).squeeze(dim)
    if picked.sharding.has_partial and picked.sharding != log_total.sharding:
        # the class dim sharded: the loss stays a Partial sum (the row totals as parts, with no
        # communication) until it is reduced
        log_total = log_total.redistribute(picked.sharding)
    losses = torch.mul(torch.sub(log_total, picked), keep)
    reduction = bound.get("reduction", "mean")
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else torch.div(losses.sum(), keep.sum())


register([F.cross_entropy], Handler(None, _none, _cross_entropy, "cross_entropy"))


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
    if ctx.lead:
        device = next(
            c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in "".join(inputs)
        )
        inputs, output = tuple(device + term for term in inputs), device + output
    return torch.einsum(f"{','.join(inputs)}->{output}", *operands)


register([torch.einsum], Handler(_einsum_rule, _einsum_params, _einsum_local, "einsum"))


# --- rules from torch's op metadata ------------------------------------------------------------

#: pointwise ops that divide by their second operand (an integer divisor's padding set to one)
_DIVIDING = frozenset(["floor_divide", "div", "divide", "true_divide", "remainder", "fmod"])


#: elementwise ops torch does not tag (DTensor lists them by hand)
_UNTAGGED = frozenset(["floor_divide"])


def _pointwise(func) -> Handler | None:
    """The elementwise rule for a torch function whose aten op (of the same name) torch tags
    ``pointwise`` (as DTensor's ``pointwise_ops`` lists them)."""
    name = getattr(func, "__name__", None)
    packet = getattr(torch.ops.aten, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or name.endswith("_"):
        return None
    overloads = [getattr(packet, o) for o in packet.overloads()]
    if name not in _UNTAGGED and not any(torch.Tag.pointwise in o.tags for o in overloads):
        return None
    if any(len(o._schema.returns) != 1 for o in overloads if not o._overloadname.endswith("out")):
        return None  # several outputs (frexp): not the one output the elementwise form returns
    if any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads):
        return None
    local = _divisor_local if name in _DIVIDING else _elementwise_local
    return Handler(rules.elementwise, _none, local, name, False)


GENERIC.append(_pointwise)

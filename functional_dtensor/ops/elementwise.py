"""Elementwise ops: unary and binary math, ``+ - * /`` with their Partial rules, conversions,
``masked_fill``, and the elementwise rule for every op torch tags ``pointwise``.
"""

from __future__ import annotations

import torch

from .. import _rules as rules
from .._dtensor import DTensor
from .._errors import InputTypeError, explain
from .._global_ops import GENERIC, Handler, dispatch, register
from .._sharding import shard_table
from .common import align, elementwise_local, functions, no_params, plain, valid

__all__: list[str] = []


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
            args = (args[0], divisor.masked_fill(~valid(layout, shape, divisor), 1), *args[2:])
    return elementwise_local(func, args, kwargs, ctx)


def _gradients(args, kwargs, tensors):
    """Whether some input needs a gradient (a rule's Partial options may depend on it)."""
    return (torch.is_grad_enabled() and any([t.requires_grad for t in tensors]),)


def _masked_fill_local(func, args, kwargs, ctx):
    """``masked_fill`` as ``where``: a value given as an fd.DTensor is, on stacked storage, a
    vector of every device's value, which masked_fill does not take."""
    (x, mask, value), _ = align([*args[:2], args[2] if len(args) > 2 else kwargs["value"]], {}, ctx)
    return torch.where(mask, value, x).to(x.dtype)


_MASKED_FILL = Handler(rules.elementwise, no_params, _masked_fill_local, "masked_fill", False)
register(functions("masked_fill"), _MASKED_FILL)
_EXTREMA = {"maximum": rules.extremum(rules.MAX), "minimum": rules.extremum(rules.MIN)}
for _name in _UNARY + _BINARY:
    local = _divisor_local if _name in ("remainder", "fmod") else elementwise_local
    if _name in _EXTREMA:
        register(functions(_name), Handler(_EXTREMA[_name], _gradients, local, _name, False, by_grad=True))
    else:
        register(functions(_name), Handler(rules.elementwise, no_params, local, _name, False))
for _name in ("neg", "negative"):
    register(functions(_name), Handler(rules.linear, no_params, elementwise_local, _name, False))


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
        functions(_name), Handler(_sum, _constant_operand, elementwise_local, _name, False, by_grad=True)
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
    register(functions(_name), Handler(_product, _gradients, elementwise_local, _name, False, by_grad=True))
for _name in ("div", "divide", "true_divide"):
    register(
        functions(_name),
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
register([torch.Tensor.to], Handler(None, no_params, _to, "to"))
register([torch.Tensor.detach, torch.detach], Handler(rules.linear, no_params, plain, "detach"))


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
    local = _divisor_local if name in _DIVIDING else elementwise_local
    return Handler(rules.elementwise, no_params, local, name, False)


GENERIC.append(_pointwise)

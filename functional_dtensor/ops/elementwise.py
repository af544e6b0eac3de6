"""Elementwise ops: unary and binary math, ``+ - * /`` with their Partial rules, conversions,
``masked_fill``, and the elementwise rule for every op torch tags ``pointwise``.
"""

from __future__ import annotations

import torch

from .. import _rules as rules
from .._dtensor import DTensor
from .._errors import InputTypeError, explain
from .._global_ops import dispatch
from .._op_decisions import GENERIC, Handler, register, resolved
from .common import functions, no_params, plain

__all__: list[str] = []


# --- elementwise -------------------------------------------------------------------------------

_UNARY = (
    "abs exp exp2 expm1 log log1p log2 sqrt rsqrt tanh sigmoid relu silu gelu sin cos reciprocal "
    "sign floor ceil round trunc logical_not isnan isinf isfinite square erf softplus leaky_relu elu "
    "relu6 hardtanh mish logsigmoid clamp clip nan_to_num"
).split()
_BINARY = (
    "pow maximum minimum eq ne lt le gt ge logical_and logical_or logical_xor atan2 remainder fmod lerp"
).split()


def _gradients(args, kwargs, tensors):
    """Whether some input needs a gradient (a rule's Partial options may depend on it)."""
    return (torch.is_grad_enabled() and any([t.requires_grad for t in tensors]),)


def _masked_fill_local(func, args, kwargs, ctx):
    """``masked_fill`` as ``where``, which takes the value as a tensor of any dims (batched, a
    value given as an fd.DTensor has one: every device's)."""
    x, mask, value = *args[:2], args[2] if len(args) > 2 else kwargs["value"]
    return torch.where(mask, value, x).to(x.dtype)


_MASKED_FILL = Handler(
    rules.elementwise, no_params, _masked_fill_local, "masked_fill", False, batched="elementwise"
)
register(functions("masked_fill"), _MASKED_FILL)
_EXTREMA = {"maximum": rules.extremum(rules.MAX), "minimum": rules.extremum(rules.MIN)}
_ELEMENTWISE = {"by_value": False, "batched": "elementwise"}
for _name in _UNARY + _BINARY:
    if _name in _EXTREMA:
        handler = Handler(_EXTREMA[_name], _gradients, plain, _name, by_grad=True, **_ELEMENTWISE)
    else:
        handler = Handler(rules.elementwise, no_params, plain, _name, **_ELEMENTWISE)
    register(functions(_name), handler)
for _name in ("neg", "negative"):
    register(functions(_name), Handler(rules.linear, no_params, plain, _name, **_ELEMENTWISE))


def _where_params(args, kwargs, tensors):
    """``torch.where(condition, input, other)``: linear in its value operands together where
    every one that is not an fd.DTensor is the number 0 (``where(keep, losses, 0)``: a
    Partial sum of losses stays one); the fd.DTensor value operands' places among the inputs,
    and whether some input needs a gradient."""
    names = ("condition", "input", "other")
    bound = dict(zip(names, args)) | kwargs
    values = [bound.get("input"), bound.get("other")]
    places = [i for i, t in enumerate(tensors) if any(t is v for v in values)]
    zero = all(isinstance(v, DTensor) or (type(v) in (int, float, bool) and v == 0) for v in values)
    condition = bound.get("condition")
    linear = zero and places and not any(t is condition for t in (tensors[i] for i in places))
    return (tuple(places) if linear else (), *_gradients(args, kwargs, tensors))


def _where(call):
    places, gradients = call.params
    return rules.elementwise(call, partial=places, average=not gradients)


register(  # (by the values of numbers: where(c, x, 0) is linear, where(c, x, 1) is not)
    functions("where"),
    Handler(_where, _where_params, plain, "where", by_grad=True, batched="elementwise"),
)


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
        functions(_name),
        Handler(_sum, _constant_operand, plain, _name, by_grad=True, **_ELEMENTWISE),
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
    register(
        functions(_name),
        Handler(_product, _gradients, plain, _name, by_grad=True, **_ELEMENTWISE),
    )
for _name in ("div", "divide", "true_divide"):
    register(
        functions(_name),
        Handler(_quotient, _numerator_first, plain, _name, by_grad=True, **_ELEMENTWISE),
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
    # a global value is laid out as torch.empty(x.shape) is: no memory format of its own
    kwargs = {k: v for k, v in kwargs.items() if k != "memory_format"}
    if func is torch.Tensor.type_as:
        return args[0].to(ctx.decision.out_dtypes[0])
    return func(*args, **kwargs)


register(
    [getattr(torch.Tensor, n) for n in "float double half bfloat16 clone contiguous".split()] + [torch.clone],
    Handler(rules.linear, _conversion_params, _conversion_local, "to", batched="leading"),
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
    dtypes = [v for v in (*rest, kwargs.get("dtype")) if isinstance(v, torch.dtype)]
    if len(dtypes) == len(rest) + len(kwargs) and all([d == x.dtype for d in dtypes]):
        return x  # nothing to convert: the value itself, as torch's (an fd.DTensor is immutable)
    return dispatch(_to_on_mesh, (x, *rest), kwargs, _TO_ON_MESH)


register(
    [_to_on_mesh] + [getattr(torch.Tensor, n) for n in "int long bool type_as".split()],
    Handler(rules.elementwise, _conversion_params, _conversion_local, "to", batched="leading"),
)
_TO_ON_MESH = resolved(_to_on_mesh)  # (Dynamo searches no dict keyed by functions)
register([torch.Tensor.to], Handler(None, no_params, _to, "to"))
register(
    [torch.Tensor.detach, torch.detach], Handler(rules.linear, no_params, plain, "detach", batched="leading")
)


# --- rules from torch's op metadata ------------------------------------------------------------

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
    return Handler(rules.elementwise, no_params, plain, name, **_ELEMENTWISE)


GENERIC.append(_pointwise)

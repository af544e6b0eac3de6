"""Views, indexing by ints and slices, joining and splitting: ``transpose``/``permute``,
``reshape`` and its kin, ``expand``, ``x[...]``, ``cat``/``stack``, ``split``/``chunk``.
"""

from __future__ import annotations

import math

import torch

from .. import _rules as rules
from .._cache import cached
from .._errors import InputTypeError, explain
from .._global_ops import dispatch
from .._op_decisions import Handler, refused, register, resolved
from .._placements import Shard
from .common import functions, no_params, on_meta, plain

__all__: list[str] = []


# --- views -------------------------------------------------------------------------------------


#: distinct sizes, one per dim, for a probe of what a view does to each dim
_PROBE_SIZES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _probed(func, args, kwargs, x, name: str) -> tuple[int, ...]:
    """The shape ``func`` gives a meta probe of ``x``'s dims, each of another size (so that an
    output dim of the size of an input dim is that dim): what the view does to the dims, read
    from torch itself, which also checks the arguments."""
    if x.ndim > len(_PROBE_SIZES):
        raise refused(name, str(tuple(x.shape)), ValueError(f"more than {len(_PROBE_SIZES)} dims"))
    probe = torch.empty(_PROBE_SIZES[: x.ndim], dtype=x.dtype, device="meta")
    try:
        return tuple(func(probe, *args[1:], **kwargs).shape)
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        raise refused(name, str(tuple(x.shape)), error) from None


def _permutation_of(func, name: str):
    """A permutation of the dims (``t``, ``transpose``, ``permute``, ``movedim``, ...): the
    output's dims as input dims, read from a probe."""

    def params(args, kwargs, tensors):
        shape = _probed(func, args, kwargs, tensors[0], name)
        return (tuple(_PROBE_SIZES.index(n) for n in shape),)

    return params


def _permute_local(func, args, kwargs, ctx):
    (order,) = ctx.decision.call.params
    return args[0].permute(order)


for _name in ("t", "transpose", "permute", "swapaxes", "swapdims", "movedim", "moveaxis"):
    for _func in functions(_name):
        if _func is not None:
            handler = Handler(rules.permutation, _permutation_of(_func, _name), _permute_local, _name)
            register([_func], handler._replace(batched="permute"))


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


#: views that give a value at least so many dims, by leading ones
_ATLEAST = ("atleast_1d", "atleast_2d", "atleast_3d")


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
    with the shard on its first part). Read from the block, so that a short or empty block
    views as the others do."""
    block = args[0]
    (shape,), out = ctx.decision.call.shapes, ctx.decision.out_shapes[0]
    local = list(out)
    for in_dim, out_dim, _ in _view_pairs_of(shape, tuple(out)):
        if ctx.decision.output.sharding_axes(out_dim):
            local[out_dim] = block.shape[in_dim] * out[out_dim] // shape[in_dim]
    return block.reshape(tuple(local))  # a tuple: () is a 0-d shape


for _name in ("reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze", "ravel", *_ATLEAST):
    register(
        functions(_name),
        Handler(_reshape_rule, no_params, _reshape_local, _name, True, _reshape_valid, batched="reshape"),
    )


def _expand_local(func, args, kwargs, ctx):
    """The block expanded to the output's global shape, its sharded dims as long as the block's
    (short or empty where the dim is uneven)."""
    block, out = args[0], ctx.decision.out_shapes[0]
    local = [
        block.shape[d - len(out) + block.dim()] if ctx.decision.output.sharding_axes(d) else n
        for d, n in enumerate(out)
    ]
    return block.expand(local)


register(
    [torch.Tensor.expand, torch.broadcast_to, torch.Tensor.broadcast_to],
    Handler(rules.elementwise, no_params, _expand_local, "expand", batched="expand"),
)


def _as(method: str):
    """``x.expand_as(y)``, ``x.view_as(y)``, ``x.reshape_as(y)``: by ``y``'s shape."""

    def composite(func, args, kwargs, ctx):
        other = args[1] if len(args) > 1 else kwargs["other"]
        return getattr(args[0], method)(tuple(other.shape))

    return composite


for _name in ("expand", "view", "reshape"):
    register([getattr(torch.Tensor, f"{_name}_as")], Handler(None, no_params, _as(_name), f"{_name}_as"))


def _complex_view_rule(call):
    """``view_as_real`` (a trailing dim of the real and imaginary parts) and
    ``view_as_complex`` (that dim taken back): the other dims may stay sharded."""
    shape = call.shapes[0]
    kept = min(len(shape), len(call.out_shape))
    options = [rules.Option((rules.R,), rules.R)]
    return options + [rules.Option((Shard(d),), Shard(d)) for d in range(kept) if shape[d] > 1]


def _complex_view_local(func, args, kwargs, ctx):
    """The view of a block in memory order (a block a redistribute assembled may be strided
    otherwise, where ``view_as_complex`` cannot pair the parts; the global value is not)."""
    return func(args[0].contiguous())


register(
    [torch.view_as_real, torch.view_as_complex],
    Handler(_complex_view_rule, no_params, _complex_view_local, "view_as_real", batched="leading"),
)


def _repeat_params(func, name: str):
    """``repeat``/``tile``: the input dims repeated once, each with its output dim (new dims
    lead the output), read from a probe."""

    def params(args, kwargs, tensors):
        x = tensors[0]
        shape = _probed(func, args, kwargs, x, name)
        new = len(shape) - x.ndim
        return (tuple((d, d + new) for d in range(x.ndim) if shape[d + new] == _PROBE_SIZES[d]),)

    return params


def _repeat_rule(call):
    (kept,) = call.params
    options = [rules.Option((rules.R,), rules.R)]
    return options + [rules.Option((Shard(d),), Shard(o)) for d, o in kept if call.shapes[0][d] > 1]


for _name, _funcs in (("repeat", [torch.Tensor.repeat]), ("tile", [torch.tile, torch.Tensor.tile])):
    for _func in _funcs:
        register([_func], Handler(_repeat_rule, _repeat_params(_func, _name), plain, _name))


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
    return args[0][index]


register(
    [torch.Tensor.__getitem__],
    Handler(_index_rule, _index_params, _index_local, "__getitem__", batched="index"),
)


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


def _cat_of_values(tensors, dim=0):
    """``torch.cat`` of values of one rank (its rule's form)."""
    return torch.cat(tensors, dim)


def _cat(func, args, kwargs, ctx):
    """``torch.cat`` as torch takes it: an empty 1-d tensor (a cache's first state) is left
    out where the others have more dims."""
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    if any(t.dim() > 1 for t in tensors):
        tensors = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]
    return dispatch(_cat_of_values, (tensors, dim), {}, _OF_VALUES)


register(
    [_cat_of_values],
    Handler(rules.concatenation, _cat_params(False), _cat_local, "cat", batched="leading"),
)
_OF_VALUES = resolved(_cat_of_values)  # (Dynamo searches no dict keyed by functions)
register(
    [torch.cat, torch.concat, torch.concatenate],
    Handler(None, no_params, _cat, "cat", explained_as=_cat_of_values),
)
register(
    [torch.stack], Handler(rules.concatenation, _cat_params(True), _cat_local, "stack", batched="leading")
)


def _split(func, args, kwargs, ctx):
    """``split``/``chunk`` as slices of the global value, the sizes as torch gives them on a
    plain tensor of the global shape (which also checks the arguments)."""
    x = args[0]
    pieces = on_meta(func, args, kwargs)
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    out, start = [], 0
    for piece in pieces:
        n = piece.shape[dim]
        out.append(x[(slice(None),) * dim + (slice(start, start + n),)])
        start += n
    return tuple(out)


register(
    [torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk],
    Handler(None, no_params, _split, "split"),
)

"""Views, indexing by ints and slices, joining and splitting: ``transpose``/``permute``,
``reshape`` and its kin, ``expand``, ``x[...]``, ``cat``/``stack``, ``split``/``chunk``.
"""

from __future__ import annotations

import math

import torch

from .. import _rules as rules
from .._cache import cached
from .._errors import InputTypeError, explain
from .._global_ops import Handler, dispatch, register
from .._placements import Shard
from .common import align, functions, no_params, on_meta

__all__: list[str] = []


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
    register(functions(_name), Handler(rules.permutation, _permutation_of(key), _permute_local, _name))


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
    register(functions(_name), Handler(_reshape_rule, no_params, _reshape_local, _name, True, _reshape_valid))


def _expand_local(func, args, kwargs, ctx):
    """The block expanded to the output's global shape, its sharded dims as long as the block's
    (short or empty on a rank of an uneven dim)."""
    (storage,), _ = align([args[0]], {}, ctx)
    block, out = storage.shape[ctx.lead :], ctx.decision.out_shapes[0]
    local = [
        block[d - len(out) + len(block)] if ctx.decision.output.sharding_axes(d) else n
        for d, n in enumerate(out)
    ]
    return storage.expand((*storage.shape[: ctx.lead], *local))


register([torch.Tensor.expand], Handler(rules.elementwise, no_params, _expand_local, "expand"))


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

"""Sharding rules of global operations: pure functions from an op's inputs to the ways one mesh
axis may lay them out.

A rule sees a :class:`Call` (the shapes of the op's tensor inputs, the output's shape and the
op's own arguments, such as the dims a reduction reduces) and returns its **options** for one
mesh axis: each an :class:`Option` naming the placement every tensor input must have on that
axis and the placement the output then has, with no communication. For ``x @ w`` on one axis:

=================== ====================== ==================
x                   w                      x @ w
=================== ====================== ==================
``Shard(0)``        ``Replicate``          ``Shard(0)``
``Replicate``       ``Shard(1)``           ``Shard(1)``
``Shard(1)``        ``Shard(0)``           ``Partial(sum)``
``Partial(sum)``    ``Replicate``          ``Partial(sum)``
``Replicate``       ``Partial(sum)``       ``Partial(sum)``
``Replicate``       ``Replicate``          ``Replicate``
=================== ====================== ==================

A layout of the whole mesh picks one option per axis; the global-op dispatcher picks the
combination whose redistributes cost the fewest bytes (:mod:`._plan`). Rules know nothing of
meshes, backends or values: they are tables, and users add their own with
``fd.register_sharding``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ._placements import Partial, Placement, Replicate, Shard

__all__ = [
    "Call",
    "Option",
    "Rule",
    "R",
    "SUM",
    "elementwise",
    "linear",
    "affine",
    "additive",
    "extremum",
    "matmul",
    "linear_layer",
    "reduction",
    "along",
    "permutation",
    "reshape",
    "concatenation",
    "embedding",
    "gather",
    "whole",
]

R = Replicate()
SUM = Partial("sum")
AVG = Partial("avg")
MAX = Partial("max")
MIN = Partial("min")


class Call(NamedTuple):
    """What a rule sees of one call: the shapes of its tensor inputs (``None`` where an input
    is not a tensor), the output's shape, and the op's arguments a rule needs (``params``)."""

    shapes: tuple[tuple[int, ...] | None, ...]
    out_shape: tuple[int, ...]
    params: tuple = ()


class Option(NamedTuple):
    """One way to lay out the op on one mesh axis: a placement per tensor input, and the
    output's."""

    inputs: tuple[Placement, ...]
    output: Placement


Rule = Callable[[Call], list[Option]]


def _aligned(shape: tuple[int, ...], out_ndim: int, dim: int) -> int | None:
    """The dim of an input of ``shape`` that broadcasting aligns with output dim ``dim``
    (None where the input has no such dim, or broadcasts it from size 1)."""
    own = dim - (out_ndim - len(shape))
    return own if own >= 0 and shape[own] != 1 else None


def elementwise(call: Call, *, partial: tuple[int, ...] = (), average: bool = True) -> list[Option]:
    """An op applied element by element, with broadcasting: every input sharded on the dims
    aligned with one output dim (replicated where it broadcasts), or every input replicated.
    ``partial``: the inputs the op is linear in; ``Partial(sum)`` on them (the others
    replicated) gives ``Partial(sum)``, and so does ``Partial(avg)`` where ``average`` (not
    where a replicated input needs a gradient: its gradient would sum, not average, the
    parts' contributions)."""
    shapes = [s for s in call.shapes if s is not None]
    out_ndim = len(call.out_shape)
    options = [Option((R,) * len(shapes), R)]
    for dim in range(out_ndim):
        if call.out_shape[dim] <= 1:
            continue
        inputs = []
        for shape in shapes:
            own = _aligned(shape, out_ndim, dim)
            inputs.append(R if own is None else Shard(own))
        options.append(Option(tuple(inputs), Shard(dim)))
    kinds = (SUM, AVG) if average or len(partial) == len(shapes) else (SUM,)
    for kind in kinds if partial else ():  # a mean of parts is a sum of parts, scaled
        options.append(Option(tuple(kind if i in partial else R for i in range(len(shapes))), kind))
    return options


def linear(call: Call) -> list[Option]:
    """An elementwise op linear in every input together (``add``, ``sub``, ``neg``)."""
    shapes = [s for s in call.shapes if s is not None]
    return elementwise(call, partial=tuple(range(len(shapes))))


def _mixed(count: int, kind: Partial) -> list[Option]:
    """``kind`` on some inputs and ``Replicate`` on the others (at least one ``kind``), giving
    ``kind``: for an op that passes its replicated operands into every part alike."""
    return [
        Option(tuple(kind if (mask >> i) & 1 else R for i in range(count)), kind)
        for mask in range(1, 1 << count)
    ]


def affine(call: Call, *, gradients: bool = False) -> list[Option]:
    """``a + b``, ``a - b`` with a constant or a replicated operand: an average of parts plus
    a constant is the average of the parts plus it (a sum of parts is not). With
    ``gradients`` (some input needs one), a replicated input stays out of the parts: its
    gradient would sum the parts' contributions, not average them."""
    count = sum(s is not None for s in call.shapes)
    mixed = [o for o in _mixed(count, AVG) if not gradients or R not in o.inputs]
    return elementwise(call) + mixed


def additive(call: Call, *, gradients: bool = False) -> list[Option]:
    """``a + b``, ``a - b`` of two values: linear in both, and affine in one where the other
    is replicated (see :func:`affine`)."""
    count = sum(s is not None for s in call.shapes)
    mixed = [] if gradients else [o for o in _mixed(count, AVG) if R in o.inputs]
    return linear(call) + mixed


def extremum(kind: Partial):
    """``maximum`` / ``minimum`` (``kind`` max / min): the largest of maxima is the maximum of
    the parts' largest, a replicated operand taken into every part; without gradients (as
    ``amax`` of a sharded dim: only the part that holds the extreme may take one)."""

    def rule(call: Call) -> list[Option]:
        (gradients,) = call.params
        count = sum(s is not None for s in call.shapes)
        return elementwise(call) + ([] if gradients else _mixed(count, kind))

    return rule


def matmul(call: Call) -> list[Option]:
    """``a @ b`` with ``a (..., m, k)`` and ``b (..., k, n)`` (batch dims broadcast; the
    vector cases are matrices of one row or column)."""
    a, b = call.shapes
    out = len(call.out_shape)
    options = [
        Option((R, R), R),
        Option((Shard(len(a) - 2), R), Shard(out - 2)),
        Option((R, Shard(len(b) - 1)), Shard(out - 1)),
        Option((Shard(len(a) - 1), Shard(len(b) - 2)), SUM),
        Option((SUM, R), SUM),
        Option((R, SUM), SUM),
    ]
    for dim in range(out - 2):  # batch dims
        if call.out_shape[dim] > 1:
            da, db = _aligned(a[:-2], out - 2, dim), _aligned(b[:-2], out - 2, dim)
            options.append(
                Option((R if da is None else Shard(da), R if db is None else Shard(db)), Shard(dim))
            )
    return options


def linear_layer(call: Call) -> list[Option]:
    """``F.linear(x, w, b)``, ``x @ w.T + b`` with ``x (..., k)``, ``w (n, k)`` and ``b (n,)``
    (or no ``b``): :func:`matmul`'s options, the bias split with the output's features, or a
    Partial sum where the output is (its parts summing to the bias: a replicated bias becomes
    that with no communication)."""
    x, out = call.shapes[0], len(call.out_shape)
    rows = [
        ((R, R, R), R),
        ((R, Shard(0), Shard(0)), Shard(out - 1)),
        ((Shard(len(x) - 1), Shard(1), SUM), SUM),
        ((SUM, R, SUM), SUM),
        ((R, SUM, SUM), SUM),
    ]
    rows += [((Shard(d), R, R), Shard(d)) for d in range(len(x) - 1) if call.out_shape[d] > 1]
    count = len(call.shapes)
    return [Option(inputs[:count], output) for inputs, output in rows]


#: the Partial a sharded reduced dim leaves, per reduction (None: the dim must be whole)
_PARTIAL_OF = {
    "sum": SUM,
    "mean": SUM,
    "amax": Partial("max"),
    "amin": Partial("min"),
    "prod": None,
    "whole": None,
}


def reduction(call: Call) -> list[Option]:
    """A reduction over ``params = (kind, dims, keepdim)``: a reduced dim may be sharded where
    the kind leaves a Partial (``sum`` and ``mean``: sum; ``amax``: max; ``amin``: min; not
    ``prod``, nor ``whole``: a reduction that needs its dims whole), the others stay sharded;
    a ``Partial(sum)`` input stays one for ``sum`` and ``mean``."""
    kind, dims, keepdim = call.params
    (shape,) = [s for s in call.shapes if s is not None]
    options = [Option((R,), R)]
    kept = [d for d in range(len(shape)) if d not in dims]
    for d in range(len(shape)):
        if shape[d] <= 1:
            continue
        if d in dims:
            if _PARTIAL_OF[kind] is not None:
                options.append(Option((Shard(d),), _PARTIAL_OF[kind]))
        else:
            options.append(Option((Shard(d),), Shard(d if keepdim else kept.index(d))))
    if kind in ("sum", "mean"):  # linear: parts reduced are the parts of the reduction
        options += [Option((SUM,), SUM), Option((AVG,), AVG)]
    elif _PARTIAL_OF[kind] in (MAX, MIN):  # the extreme of parts' extremes
        options.append(Option((_PARTIAL_OF[kind],), _PARTIAL_OF[kind]))
    return options


def along(call: Call) -> list[Option]:
    """An op that needs the dims ``params[0]`` of its first input whole (``softmax``,
    ``layer_norm``, ``max`` along a dim): the other dims may stay sharded, and every other
    tensor input (a weight over the whole dims) is replicated. Where the output has fewer
    dims (a reduction without ``keepdim``), the whole dims are the ones it drops, and a
    sharded dim moves down past them (``x.max(0)`` of ``Shard(1)`` is ``Shard(0)``)."""
    (whole,) = call.params[:1]
    shapes = call.shapes
    first = shapes[0]
    others = sum(1 for s in shapes[1:] if s is not None)
    dropped = len(first) > len(call.out_shape)
    options = [Option((R,) * (1 + others), R)]
    for d in range(len(first)):
        if d not in whole and first[d] > 1:
            out = d - sum(w < d for w in whole) if dropped else d
            options.append(Option((Shard(d),) + (R,) * others, Shard(out)))
    return options


def permutation(call: Call) -> list[Option]:
    """A permutation of the dims (``params[0]``: the output's dims as input dims)."""
    (order,) = call.params
    options = [Option((R,), R), Option((SUM,), SUM)]
    for out_dim, in_dim in enumerate(order):
        if call.out_shape[out_dim] > 1:
            options.append(Option((Shard(in_dim),), Shard(out_dim)))
    return options


def reshape(call: Call) -> list[Option]:
    """A view to another shape: an input dim may stay sharded where it is the first of a group
    of dims that the view keeps together (``params[0]``: pairs ``(input dim, output dim)``
    whose blocks correspond)."""
    (pairs,) = call.params
    options = [Option((R,), R), Option((SUM,), SUM)]
    for in_dim, out_dim in pairs:
        options.append(Option((Shard(in_dim),), Shard(out_dim)))
    return options


def concatenation(call: Call) -> list[Option]:
    """``cat`` / ``stack`` of equal-rank inputs along ``params[0]`` (an output dim), with
    ``params[1]``: whether a new dim is made (stack)."""
    dim, new = call.params
    shapes = [s for s in call.shapes if s is not None]
    options = [Option((R,) * len(shapes), R), Option((SUM,) * len(shapes), SUM)]
    for out_dim in range(len(call.out_shape)):
        if out_dim == dim:
            continue
        in_dim = out_dim - 1 if new and out_dim > dim else out_dim
        options.append(Option((Shard(in_dim),) * len(shapes), Shard(out_dim)))
    return options


def embedding(call: Call) -> list[Option]:
    """``embedding(indices, table)``: indices sharded any way (the table replicated), the
    table sharded on its embedding dim, or on its rows: each device looks up the rows it
    holds, zeros elsewhere, and the output is their ``Partial(sum)``. With a ``max_norm``
    (``params[0]``), each row looked up is scaled by its norm: the rows must be whole (the
    table not sharded on its embedding dim)."""
    indices, table = call.shapes
    out = len(call.out_shape)
    whole_rows = bool(call.params) and call.params[0] is not None
    options = [Option((R, R), R), Option((R, Shard(1)), Shard(out - 1)), Option((R, Shard(0)), SUM)]
    options = [o for o in options if not (whole_rows and o.inputs[1] == Shard(1))]
    for d in range(len(indices)):
        if indices[d] > 1:
            options.append(Option((Shard(d), R), Shard(d)))
    return options


def gather(call: Call) -> list[Option]:
    """``gather(input, dim, index)`` (``params = (dim,)``): the index sharded on ``dim`` (the
    input replicated: each device gathers its own indices); both sharded alike on another dim
    of one size; the input sharded on ``dim``: each device gathers from the block it holds,
    zeros elsewhere, and the output is their ``Partial(sum)``; a ``Partial(sum)`` input."""
    (dim,) = call.params
    x, index = call.shapes
    options = [Option((R, R), R), Option((SUM, R), SUM)]
    for d in range(len(index)):
        if d == dim and index[d] > 1:
            options.append(Option((R, Shard(d)), Shard(d)))
        elif d != dim and index[d] > 1 and x[d] == index[d]:
            options.append(Option((Shard(d), Shard(d)), Shard(d)))
    if x and x[dim] > 1:
        options.append(Option((Shard(dim), R), SUM))
    return options


def whole(call: Call) -> list[Option]:
    """An op that needs every input whole (a matrix norm of singular values): replicated."""
    count = sum(s is not None for s in call.shapes)
    return [Option((R,) * count, R)]

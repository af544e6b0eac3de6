"""Values whose gradients are summed later: data-parallel and sequence-parallel parameters
during a sharded forward.

A global op on a value replicated over a mesh axis where its output is not (a weight times a
batch split over ``dp``, a norm's weight on a sequence split over ``tp``) inserts ``pvary``
there, whose transpose sums the devices' gradients: one all-reduce per use. Data parallelism
and sequence parallelism sum them once instead. While a sharded module's forward runs
(:func:`scope`), a parameter replicated over a data axis (or under ``SequenceParallel``, over
its axis) is **varied** over it: it holds the same value on every device, but its gradient is
each device's own part, and a single backward step sums them, for all the parameters at once
(:func:`vary_all`: one all-reduce) or into a fully-sharded parameter's shards (a
reduce-scatter). The marks are kept here by storage, for the call only; the global ops read
them:

- an input varied over an axis gets no ``pvary`` there;
- an op whose output is replicated over an axis that an input is varied over makes its output
  varied over it too, and gives its other inputs ``pvary`` there (their gradients arrive as
  parts as well) — JAX's rule for values of differing ``vma``;
- a varied value redistributed over its axes, or leaving the forward, is made invariant first
  (:func:`invariant`: the transpose splits the replicated gradient among the devices).
"""

from __future__ import annotations

import contextlib

import torch

from . import _autograd as autograd
from ._backend import backend_of
from ._blocks import block_numel
from ._collectives import AllReduce, Pvary, SplitCotangent, on_storage
from ._dtensor import DTensor, held_of, held_varied, new_held, new_value, storage_of
from ._mesh import DeviceMesh

__all__ = [
    "TABLE",
    "PVARIED",
    "axes_of",
    "axes_of_value",
    "marked_storage",
    "invariant_value",
    "pvaried_held",
    "pvary_held",
    "pvaried_stacked",
    "pvaried_where_needed",
    "mark",
    "pvaried",
    "scope",
    "invariant",
    "vary_all",
]

#: id(storage) (a fresh negative key while compiling) -> (storage, the axes it is varied
#: over), while a forward runs
TABLE: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}


#: (id(storage) or a fresh key, axes) -> (storage, its pvary over axes), while a forward runs:
#: a value used by several ops is varied once, and the gradients of its uses summed on each
#: device before one all-reduce (Megatron's "f": the input of q, k and v projections reduced
#: once, not thrice)
PVARIED: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, torch.Tensor]] = {}


# While Dynamo traces, the tables are searched by identity and filled under fresh keys: ``id()``
# of a graph input (a parameter's storage) would guard the graph on that very tensor, and every
# training step, with new parameters, would compile again.


def _key(storage: torch.Tensor, table: dict) -> int:
    return -1 - len(table) if torch.compiler.is_compiling() else id(storage)


def _once(tensor: torch.Tensor, what: tuple, make, *args) -> torch.Tensor:
    """``make(*args)``, once per forward for ``tensor`` and ``what`` (:data:`PVARIED`)."""
    if torch.compiler.is_compiling():
        for (_, kept), (t, out) in PVARIED.items():
            if t is tensor and kept == what:
                return out
    else:
        entry = PVARIED.get((id(tensor), what))
        if entry is not None and entry[0] is tensor:
            return entry[1]
    out = make(*args)
    PVARIED[_key(tensor, PVARIED), what] = (tensor, out)
    return out


def pvaried(storage: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...]) -> torch.Tensor:
    """``storage`` through ``pvary`` over ``axes``, once per forward."""
    return _once(storage, axes, on_storage, storage, mesh, Pvary, axes)


def pvaried_held(held: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...]) -> torch.Tensor:
    """Held blocks (see :meth:`.Backend.held_plan`) through ``pvary`` over ``axes``, along
    which they are held, once per forward: a held cotangent is the sum of the devices' parts
    already, so nothing is summed; the all-reduce the distributed backend runs is counted."""
    return _once(held, (*axes, "held"), pvary_held, held, mesh, axes)


def pvaried_where_needed(storage: torch.Tensor, mesh: DeviceMesh, axes, grad: bool) -> torch.Tensor:
    """``storage`` through ``pvary`` over those of ``axes`` it is not varied over already (its
    gradient is each device's part there), as the global ops give an input: once per forward
    where a sharded forward marks values."""
    if not axes or not grad or not storage.requires_grad:
        return storage
    need = set(axes) - axes_of(storage)
    ordered = tuple(n for n in mesh.axis_names if n in need)
    if not ordered:
        return storage
    return pvaried(storage, mesh, ordered) if TABLE else on_storage(storage, mesh, Pvary, ordered)


def pvary_held(held: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...]) -> torch.Tensor:
    """Held blocks through ``pvary`` over ``axes`` (as :func:`pvaried_held`), for one use."""
    return autograd.apply(_HeldPvary, held, mesh, axes, False)


def pvaried_stacked(x: DTensor, mesh: DeviceMesh, axes: tuple[str, ...]) -> torch.Tensor:
    """The stacked storage of ``x``, a value held once along ``axes`` (among others), through
    ``pvary`` over them, once per forward: made from its blocks, the devices' cotangents summed
    over ``axes`` straight into the held one (the all-reduce the distributed backend runs,
    counted), not written to every device first."""
    return _once(held_of(x), (*axes, "stacked"), _pvary_stacked, x, mesh, axes)


def _pvary_stacked(x: DTensor, mesh: DeviceMesh, axes: tuple[str, ...]) -> torch.Tensor:
    summed = held_varied(x) | set(axes)
    positions = tuple([a for a, name in enumerate(mesh.axis_names) if name in summed])
    return backend_of(mesh).unfold(pvaried_held(held_of(x), mesh, axes), x.sharding, positions)


@autograd.compilable
class _HeldPvary(torch.autograd.Function):
    """Identity on held blocks; ``counted``, it is a ``psum`` of their parts, which are summed
    already: the all-reduce the distributed backend runs is counted. Backward: the same, the
    other way (pvary and psum are each other's transpose)."""

    @staticmethod
    def forward(held, mesh, axes, counted):
        if counted:
            backend_of(mesh).count_held_psum(held, mesh, axes)
        return held.view_as(held)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        mesh, axes, counted = ctx.args
        return autograd.apply(_HeldPvary, g, mesh, axes, not counted), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return autograd.apply(_HeldPvary, t, *ctx.args)


def axes_of_value(x: DTensor) -> frozenset[str]:
    """The axes the value ``x`` is varied over (a value held once keeps its own)."""
    if held_of(x) is not None:
        return held_varied(x)
    return axes_of(storage_of(x)) if TABLE else frozenset()


def marked_storage(x: DTensor) -> torch.Tensor:
    """``x``'s storage, marked as varied where ``x`` is a value held once and varied (made
    from its blocks, it is varied as they are)."""
    storage = storage_of(x)
    if held_of(x) is not None and held_varied(x) and not axes_of(storage):
        mark(storage, held_varied(x))
    return storage


def invariant_value(x: DTensor) -> DTensor:
    """``x`` no longer varied (see :func:`invariant`). A value held once is the same blocks:
    its held cotangent is the sum of the devices' parts, that is the whole cotangent."""
    if held_of(x) is not None:
        return new_held(held_of(x), x.sharding, x.shape)
    return DTensor(invariant(marked_storage(x), x.device_mesh), x.sharding, x.shape)


def axes_of(storage: torch.Tensor) -> frozenset[str]:
    if torch.compiler.is_compiling():
        found = frozenset()
        for s, axes in TABLE.values():  # the last mark counts
            if s is storage:
                found = axes
        return found
    entry = TABLE.get(id(storage))
    return entry[1] if entry is not None and entry[0] is storage else frozenset()


def mark(storage: torch.Tensor, axes) -> torch.Tensor:
    if axes:
        TABLE[_key(storage, TABLE)] = (storage, frozenset(axes))
    return storage


@contextlib.contextmanager
def scope():
    """The marks made inside are dropped at the end (those of an enclosing scope kept)."""
    before, pvaried_before = dict(TABLE), dict(PVARIED)
    try:
        yield
    finally:
        TABLE.clear()
        TABLE.update(before)
        PVARIED.clear()
        PVARIED.update(pvaried_before)


def _ordered(mesh: DeviceMesh, axes) -> tuple[str, ...]:
    return tuple(name for name in mesh.axis_names if name in axes)


def invariant(storage: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``storage`` no longer varied: the same values; the replicated gradient that comes back
    is split evenly among the devices of its axes, as parts to be summed."""
    axes = axes_of(storage)
    if not axes or not storage.requires_grad:
        return storage
    return on_storage(storage, mesh, SplitCotangent, _ordered(mesh, axes))


class _VaryAll(torch.autograd.Function):
    """The same storages, varied over ``axes``: the backward sums every gradient's parts over
    ``axes`` in one all-reduce of their concatenation (per dtype). ``held``: per storage, the
    layout of blocks held once, or None; their cotangent comes summed (see :func:`vary_all`)."""

    @staticmethod
    def forward(mesh, spec, *storages):
        return tuple(s.view_as(s) for s in storages)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, (ctx.axes, ctx.held) = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads):
        backend, held = backend_of(ctx.mesh), ctx.held
        present = [g for g in grads if g is not None]
        again = any([g.requires_grad for g in present]) and not torch.compiler.is_compiling()
        if backend.one_process and not again:
            # one process: each large gradient summed where it lies (no concatenation to copy, no
            # copy of a transposed gradient), the small ones in one concatenation per dtype (one
            # kernel, not one per gradient), held ones summed already; recorded as the one
            # bucketed all-reduce of the ranks. Its kernels are not differentiated: not where a
            # gradient is differentiated again (compiled, never: AOT autograd compiles no double
            # backward)
            _count_bucket("all_reduce", present, ctx.mesh, ctx.axes)
            small = [
                g is not None and h is None and block_numel(g) < _BUCKETED_BELOW for g, h in zip(grads, held)
            ]
            summed = list(grads)  # (a held one summed already; a small one from its concatenation)
            for i, (g, h, s) in enumerate(zip(grads, held, small)):
                if g is not None and h is None and not s:
                    summed[i] = backend.all_reduce(g, ctx.mesh, ctx.axes, counted=False)
            for indices in _by_dtype([g if s else None for g, s in zip(grads, small)]):
                # (a device's block of one dim, as a vector's gradient, is a row as it is)
                rows = [g if g.dim() == 2 else g.reshape(g.shape[0], -1) for g in [grads[i] for i in indices]]
                total = backend.all_reduce(torch.cat(rows, dim=1), ctx.mesh, ctx.axes, counted=False)
                for i, piece in zip(indices, total.split([r.shape[1] for r in rows], dim=1)):
                    summed[i] = piece if grads[i].dim() == 2 else piece.reshape(grads[i].shape)
            return (None, None, *summed)
        # differentiated again: a held cotangent joins the all-reduce as parts that sum to it
        # (the one collective counted, every step differentiable), and is taken back held
        positions = tuple([ctx.mesh.axis_position(a) for a in ctx.axes])
        grads = [
            g if g is None or h is None else backend.unfold(g, h, positions, parts=True)
            for g, h in zip(grads, held)
        ]
        lead = backend.block_dim(0)
        out = list(grads)
        for indices in _by_dtype(grads):
            parts = [grads[i] for i in indices]
            flat = torch.cat([g.reshape(*g.shape[:lead], -1) for g in parts], dim=lead)
            summed = on_storage(flat, ctx.mesh, AllReduce, ctx.axes, op="sum", transpose_psum=True)
            sizes = [g[(0,) * lead].numel() if lead else g.numel() for g in parts]
            for i, piece, g in zip(indices, summed.split(sizes, dim=lead), parts):
                out[i] = piece.reshape(g.shape)
        out = [
            g if g is None or h is None else backend.fold(g, h, backend.held_plan(h))
            for g, h in zip(out, held)
        ]
        return (None, None, *out)


#: elements of a device's block below which a gradient is summed in a concatenation, on one
#: process: there the kernels' Python outweighs the copy
_BUCKETED_BELOW = 1 << 14


def vary_all(values: list[DTensor], mesh: DeviceMesh, axes) -> list[DTensor]:
    """``values`` (replicated over ``axes``) varied over them; their gradients are summed in
    one all-reduce per dtype. A value held once stays so, varied (its storage, made from its
    blocks, sums the devices' cotangent parts into the held one: no all-reduce writes them)."""
    axes = _ordered(mesh, axes)
    needing = [i for i, v in enumerate(values) if v.requires_grad]
    if not axes or not needing or mesh.axis_size(axes) == 1:
        return values
    held = tuple([values[i].sharding if held_of(values[i]) is not None else None for i in needing])
    data = [storage_of(values[i]) if h is None else held_of(values[i]) for i, h in zip(needing, held)]
    out = list(values)
    for i, h, d in zip(needing, held, _applied(_VaryAll, mesh, (axes, held), data)):
        value = values[i]
        if h is None:
            out[i] = new_value(mark(d, axes), value.sharding, value.shape)
        else:  # (its blocks marked too: the global ops read any mark as "some value varies")
            out[i] = new_held(
                mark(d, axes), value.sharding, value.shape, held_varied(value) | frozenset(axes)
            )
    return out


# --- a fully-sharded unit's parameters, gathered together -------------------------------------


def _applied(function, mesh: DeviceMesh, axes, storages) -> tuple[torch.Tensor, ...]:
    """``function.apply(mesh, axes, *storages)``, or, where no storage needs a gradient, its
    forward alone, as ``apply`` runs it then (Dynamo binds the arguments of a variadic
    ``forward`` wrongly on that path: a backward traced by ``torch.compile`` takes it)."""
    if torch.is_grad_enabled() and any([s is not None and s.requires_grad for s in storages]):
        return autograd.apply(function, mesh, axes, *storages)
    return function.forward(mesh, axes, *storages)


def gather_unit(storages: list[torch.Tensor], mesh: DeviceMesh, axis: str, grids=None) -> list[torch.Tensor]:
    """Each storage (dim 0 split over ``axis`` as its innermost axis, into blocks of one shape)
    gathered along dim 0 over ``axis`` and varied over it, FSDP's way: one all-gather of their
    concatenation per dtype, and their gradients reduce-scattered back in one collective. The
    two are each other's transpose, to any order. ``grids``: per storage, None, or the grid of
    the blocks it holds once (a simulated mesh's held blocks, gathered into held blocks; see
    :func:`._sharded_module._held_gather_source`)."""
    if mesh.axis_size((axis,)) == 1 or not storages:
        return storages
    grids = tuple(grids or [None] * len(storages))
    gathered = _applied(_GatherUnit, mesh, (axis, grids), storages)
    return [mark(g, {axis, *axes_of(s)}) for g, s in zip(gathered, storages)]


def _count_bucket(op: str, storages: list[torch.Tensor], mesh: DeviceMesh, axes: tuple[str, ...]) -> None:
    """Record ``op`` on stacked ``storages``, run one by one where they lie, as the one
    bucketed collective the ranks run (the bytes of all of them per device)."""
    nbytes = sum([block_numel(s) * s.element_size() for s in storages])
    backend_of(mesh).count_bytes(op, axes, nbytes, mesh.axis_size(axes))


def _by_dtype(tensors) -> list[list[int]]:
    """The indices of ``tensors`` (None left out), grouped by dtype: one bucket each."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _gathered(storages: list[torch.Tensor], mesh: DeviceMesh, axis: str, grids) -> list[torch.Tensor]:
    backend, size = backend_of(mesh), mesh.axis_size((axis,))
    if backend.one_process:  # each where it lies, recorded as the ranks' one collective
        _count_bucket("all_gather", storages, mesh, (axis,))
        return [
            backend.all_gather(s, mesh, (axis,), 0, True, counted=False)
            if grid is None
            else backend.all_gather_held(s, grid, mesh, (axis,), 0, counted=False)
            for s, grid in zip(storages, grids)
        ]
    out: list[torch.Tensor] = list(storages)
    for group in _by_dtype(storages):
        flat = torch.cat([storages[i].reshape(-1) for i in group])
        blocks = backend.all_gather(flat, mesh, (axis,), 0, False)  # (size, n): each rank's
        start = 0
        for i in group:
            s = storages[i]
            part = blocks[:, start : start + s.numel()].reshape(size, *s.shape)
            out[i] = part.reshape(size * s.shape[0], *s.shape[1:])
            start += s.numel()
    return out


def _scattered(grads: list[torch.Tensor], mesh: DeviceMesh, axis: str, grids) -> list[torch.Tensor]:
    backend, size = backend_of(mesh), mesh.axis_size((axis,))
    if backend.one_process:
        _count_bucket("reduce_scatter", grads, mesh, (axis,))
        return [
            backend.reduce_scatter(g, mesh, (axis,), 0, True, counted=False)
            if grid is None
            else backend.slice_held(g, grid, mesh, (axis,), 0, True, counted=False)
            for g, grid in zip(grads, grids)
        ]
    out: list[torch.Tensor] = list(grads)
    for group in _by_dtype(grads):
        flat = torch.cat([grads[i].reshape(size, -1) for i in group], dim=1)  # (size, n): rank r's
        summed = backend.reduce_scatter(flat, mesh, (axis,), 0, False)  # this rank's (n,)
        start = 0
        for i in group:
            g = grads[i]
            n = g.numel() // size
            out[i] = summed[start : start + n].reshape(g.shape[0] // size, *g.shape[1:])
            start += n
    return out


# A unit: the mesh axis and the grids of :func:`gather_unit`.


class _GatherUnit(torch.autograd.Function):
    @staticmethod
    def forward(mesh, unit, *storages):
        return tuple(_gathered(list(storages), mesh, *unit))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.unit = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_applied(_ScatterUnit, ctx.mesh, ctx.unit, grads))


class _ScatterUnit(torch.autograd.Function):
    @staticmethod
    def forward(mesh, unit, *grads):
        return tuple(_scattered(list(grads), mesh, *unit))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.unit = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_applied(_GatherUnit, ctx.mesh, ctx.unit, grads))

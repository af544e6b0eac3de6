"""A linear layer on a batch split over the axes its weight is held once along (simulated mesh).

A parameter replicated over a data-parallel axis is held once there, as
``fd.parallelize_module`` lays it out and each ``fd.Optimizer`` step returns it (one block per
distinct shard). A linear layer whose input is split over that axis by rows
(the batch) gives every device along it the same weight block. Apart, that block is copied to
each of them, each device's product contracts its own few rows, and backward their parts of the
weight's gradient are summed over the axis (data parallelism's all-reduce). Folded, the devices
along the axis lay their rows end to end: one product per held block, of one device's shapes,
whose contraction sums the weight's gradient over the axis itself. It pays where the rows are
fewer than the weight's elements (the rows are moved instead). Elsewhere, and where the input
is held once too (along the other axes: a column-parallel layer's input, replicated over the
axis that splits the weight), the layer runs crossed: one product per outer position of the
mesh, each taking the operand its devices share (the weight's block, or the held input's) as a
view, nothing copied; backward, the shared operand's gradient is summed over its devices by
the products. A crossed row-parallel layer whose style all-reduces or reduce-scatters its
output (:func:`reduced_linear`) sums the products of the devices that split the weight as it
writes them, the collective counted, not run. Where none applies, the op runs as any other.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from . import _autograd as autograd
from . import _varied as varied
from ._backend import backend_of
from ._cache import Bounded
from ._dtensor import DTensor, data_of, held_of, held_varied, new_held, new_value, parts_of, storage_of
from ._functorch import is_transformed
from ._global_ops import decision_for
from ._layout import Layout
from ._layout_checks import layout_for
from ._placements import Placement, Replicate, Shard
from ._redistribute import HeldAllGather, HeldAllReduce, held_move, redistribute
from ._sharding import shard_table

__all__ = ["folded_linear", "reduced_linear"]


class _Folding(NamedTuple):
    """What a folded (or crossed) linear of some layouts and shapes needs: the weight's held
    plan and its axes, the decision's ``pvary`` per operand, its output layout and shape, the
    layout the bias takes, the mesh axes the output is replicated over, and for a crossed one
    whether the input's positions (along the weight's held axes) are the outer ones in device
    order (None: folded)."""

    plan: Any
    pvary: tuple
    output: Layout
    shape: torch.Size
    axes: tuple[int, ...]
    bias: Layout | None
    replicated: frozenset[str]
    x_outer: bool | None = None


#: (the input held, layouts, shapes and dtypes of the operands) -> a _Folding, or None where
#: it does not apply
_FOLDINGS = Bounded(4096, "folded linear: plans")


def folded_linear(layer, x, weight, bias) -> DTensor | None:
    """``layer(x, weight, bias)`` (``F.linear`` of values) where ``weight`` is held once along
    axes that split ``x`` by rows: folded, where ``x`` is stacked and its rows are fewer than
    the weight's elements; else crossed, one product per outer position on the held blocks
    (``x`` stacked, or held once along all the other axes, as a column-parallel layer's input
    replicated over the axis that splits the weight). None where neither applies (the caller
    runs the op)."""
    folding = _planned(layer, x, weight, bias)
    if folding is None:
        return None
    x_held = held_of(x) is not None
    rows, weight_rows, bias_rows = _operands(folding, x, weight, bias, x_held)
    backend = backend_of(x.device_mesh)
    if folding.x_outer is None:
        out = backend.folded_linear(rows, weight_rows, bias_rows, x.device_mesh.shape, folding.axes)
    else:
        out = backend.crossed_linear(rows, weight_rows, bias_rows, folding.x_outer, x_held)
    return new_value(out, folding.output, folding.shape)


def reduced_linear(x, weight, bias, axis: str, placement: Placement) -> DTensor | None:
    """``F.linear(x, weight, bias)`` split by its input features over ``axis`` and reduced over
    it to ``placement`` (a row-parallel linear and its style's all-reduce, ``Replicate``, or
    reduce-scatter, ``Shard``) at once, where the layer runs crossed on a stacked ``x`` and the
    sum is held once over ``axis``: the products of the devices along ``axis`` summed as they
    are written, one sum per position along the others (then cut into the devices' shards).
    Apart, every device's part is written, then summed, and backward the cotangent is copied to
    every part again. Values, gradients and the communication counted are the layer's and its
    collective's. None where this does not apply: the caller computes the product and reduces
    it."""
    folding = _planned(F.linear, x, weight, bias)
    if folding is None or folding.x_outer is None or held_of(x) is not None:
        return None
    mesh, source, ndim = x.device_mesh, folding.output, len(folding.shape)
    position = mesh.axis_position(axis)
    if [p.is_partial() for p in source.placements] != [a == position for a in range(mesh.ndim)]:
        return None
    placements = [Replicate() if p.is_partial() else p for p in source.placements]
    summed_layout = layout_for(mesh, tuple(placements), ndim, "fd.redistribute")
    integral = not (x.dtype.is_floating_point or x.dtype.is_complex)
    backend = backend_of(mesh)
    threshold = backend.held_min_elements
    move = held_move(source, summed_layout, tuple(folding.shape), x.element_size(), integral, threshold)
    if move is None or not move[0] or move[1] != (axis,) or move[3] is not None:
        return None  # (the sum is not one all-reduce over axis held once, from stacked parts)
    if placement.is_shard():
        dim = placement.dim % ndim
        placements[position] = Shard(dim)
        target = layout_for(mesh, tuple(placements), ndim, "fd.redistribute")
        if target.sharding_axes(dim) != (position,) or not shard_table(target, tuple(folding.shape)).is_even:
            return None
    rows, weight_rows, bias_rows = _operands(folding, x, weight, bias, False)
    summed = backend.reduced_linear(rows, weight_rows, bias_rows, folding.x_outer)
    if placement.is_replicate():  # (the all-reduce counted, its result the sum held once)
        out = autograd.apply(HeldAllReduce, summed, move[4], mesh, (axis,), False, False)
        return new_held(out, summed_layout, folding.shape)
    # each device's shard of the held sum: counted as the reduce-scatter (backward: all-gather)
    out = autograd.apply(HeldAllGather, summed, mesh.shape, mesh, (axis,), dim, True, True, True)
    return new_value(out, target, folding.shape)


def _planned(layer, x, weight, bias) -> _Folding | None:
    """The folding of ``layer(x, weight, bias)``, where one applies."""
    if held_of(weight) is None or type(x) is not DTensor:
        return None
    if bias is not None and type(bias) is not DTensor or torch.compiler.is_compiling():
        return None
    operands = (x, weight) if bias is None else (x, weight, bias)
    x_held = held_of(x) is not None
    key = (x_held, *[(*parts_of(t)[1:], data_of(t).dtype) for t in operands])  # (layout, shape, dtype)
    folding = _FOLDINGS.get(key)
    if folding is None and key not in _FOLDINGS:
        folding = _FOLDINGS[key] = _folding(layer, operands, x_held)
    if folding is None or is_transformed(held_of(weight)) or is_transformed(data_of(x)):
        return None
    if folding.replicated and any([varied.axes_of_value(t) & folding.replicated for t in operands]):
        return None  # (its output varied there: the op's path)
    return folding


def _operands(folding: _Folding, x, weight, bias, x_held: bool):
    """The blocks the kernels take, through ``pvary`` where they need one, in the operands'
    order, as the op's path takes them (backward sums their gradients in reverse)."""
    mesh, grad = x.device_mesh, torch.is_grad_enabled()
    if x_held:
        rows = _held_operand(x, folding.pvary[0], mesh, grad)
    else:
        rows = varied.pvaried_where_needed(storage_of(x), mesh, folding.pvary[0], grad)
    weight_rows = _held_operand(weight, folding.pvary[1], mesh, grad)
    bias_rows = None if bias is None else _bias_rows(bias, folding, mesh, grad)
    return rows, weight_rows, bias_rows


def _bias_rows(bias: DTensor, folding: _Folding, mesh, grad: bool) -> torch.Tensor:
    """The bias's blocks on the weight's held plan, through ``pvary`` where it needs one."""
    if bias.sharding != folding.bias:  # (Replicate to Partial: a row-parallel bias)
        bias = redistribute(bias, folding.bias)
    backend = backend_of(mesh)
    if held_of(bias) is not None and backend.held_plan(bias.sharding) == folding.plan:
        return _held_operand(bias, folding.pvary[2], mesh, grad)
    # its stacked storage (marked where varied) at coordinate 0 of the held axes
    storage = varied.marked_storage(bias)
    along = varied.axes_of(storage) | set(folding.pvary[2])  # (varied there after its pvary)
    storage = varied.pvaried_where_needed(storage, mesh, folding.pvary[2], grad)
    summed = tuple([a for a in folding.axes if mesh.axis_names[a] in along])
    return backend.fold(storage, bias.sharding, folding.plan, summed)


def _folding(layer, operands, x_held: bool) -> _Folding | None:
    x, weight = operands[0], operands[1]
    bias = operands[2] if len(operands) > 2 else None
    if len({t.dtype for t in operands}) > 1 or weight.ndim != 2 or x.ndim < 2:
        return None
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]):
        return None
    mesh = x.device_mesh
    if any([t.device_mesh != mesh for t in operands]):
        return None
    backend = backend_of(mesh)
    plan = backend.held_plan(weight.sharding)
    if plan is None:
        return None
    for a in plan.axes:  # x split by rows along each of the weight's held axes
        p = x.placements[a]
        if not p.is_shard() or p.dim % x.ndim == x.ndim - 1:
            return None
    _, _, decision = decision_for(layer, operands, {})
    along = {mesh.axis_names[a] for a in plan.axes}
    if not (decision.fits[0] and decision.fits[1]) or not set(decision.pvary[1]) <= along:
        return None
    bias_layout = decision.inputs[2] if bias is not None else None
    if bias_layout is not None and any([not bias_layout.placements[a].is_replicate() for a in plan.axes]):
        return None
    shape = torch.Size(decision.out_shapes[0])
    x_outer = None
    block = shard_table(x.sharding, tuple(x.shape)).padded_shape
    rows, features = math.prod(block[:-1]), block[-1]
    out_features = shard_table(weight.sharding, tuple(weight.shape)).padded_shape[0]
    # folded where the rows are fewer than the weight's elements (moving them is cheap)
    if x_held or rows * (features + out_features) > features * out_features:
        x_outer = _crossing(x, weight, plan, decision, x_held)
        if x_outer is None:
            return None
    placements = decision.output.placements
    replicated = frozenset([n for n, p in zip(mesh.axis_names, placements) if p.is_replicate()])
    return _Folding(plan, decision.pvary, decision.output, shape, plan.axes, bias_layout, replicated, x_outer)


def _crossing(x: DTensor, weight: DTensor, plan, decision, x_held: bool) -> bool | None:
    """Whether the input's positions come first in device order (the weight's inner), where a
    crossed linear applies: the weight's own positions (along the mesh axes of more than one
    device it is not held along) all after its held axes or all before; a held input held
    along exactly those, and the output split over every such axis; the output's blocks every
    pair's product. None where it does not."""
    mesh = x.device_mesh
    wide = {a for a, n in enumerate(mesh.shape) if n > 1}
    shared, own = set(plan.axes), wide - set(plan.axes)
    if x_held and set(backend_of(mesh).held_plan(x.sharding).axes) != own:
        return None
    if not all([decision.output.placements[a].is_shard() for a in (wide if x_held else shared)]):
        return None
    x_block = shard_table(x.sharding, tuple(x.shape)).padded_shape
    out_block = shard_table(decision.output, tuple(decision.out_shapes[0])).padded_shape
    if out_block != (*x_block[:-1], shard_table(weight.sharding, tuple(weight.shape)).padded_shape[0]):
        return None
    if not own or max(shared) < min(own):
        return True
    return False if max(own) < min(shared) else None


def _held_operand(value: DTensor, needed, mesh, grad: bool) -> torch.Tensor:
    """``value``'s held blocks through ``pvary`` over the axes of ``needed`` (axes it is held
    along) it is not varied over already: its gradient is summed there, counted."""
    held = held_of(value)
    need = set(needed) - held_varied(value)
    if not need or not grad or not held.requires_grad:
        return held
    axes = tuple(n for n in mesh.axis_names if n in need)
    return varied.pvaried_held(held, mesh, axes) if varied.TABLE else varied.pvary_held(held, mesh, axes)

"""A column-parallel linear and the all-gather of its output, at once on a simulated mesh.

transformers' ``lm_head`` (``"colwise_gather_output"``) and torch's
``ColwiseParallel(output_layouts=Replicate())`` split a linear by its output features and gather
the output over the axis. On the simulated mesh the input is held once over that axis; apart,
the product writes every device's columns, the all-gather copies them into the gathered value,
and backward its cotangent is cut into the devices' columns again: three writes of the output.
At once, one product per distinct block of the input writes the gathered value.
"""

from __future__ import annotations

import torch

from . import _autograd as autograd
from . import _varied as varied
from ._backend import backend_of
from ._dtensor import DTensor, data_of, held_of, held_varied, new_held
from ._functorch import is_transformed
from ._placements import Replicate, Shard
from ._redistribute import HeldAllGather
from ._sharding import shard_table

__all__ = ["gathered_linear"]


def gathered_linear(x, weight, bias, axis: str) -> DTensor | None:
    """``F.linear(x, weight, bias)`` split by its output features over ``axis`` and gathered
    over it (a column-parallel linear whose style gathers its output), at once, where the
    simulated mesh holds ``x`` once over ``axis`` alone: one product per distinct block of ``x``
    with its devices' weight rows end to end writes the gathered output, held once. Apart, every
    device's columns are written, then copied into the gathered value, and backward its
    cotangent is cut into the devices' columns again. Values, gradients and the communication
    counted are those of the product and its all-gather (the ``pvary`` of ``x``, the
    all-gather, and their transposes). None where this does not apply: the caller computes the
    product and gathers it."""
    if not (isinstance(x, DTensor) and isinstance(weight, DTensor)):
        return None
    held, mesh = held_of(x), x.device_mesh
    compiling = torch.compiler.is_compiling()  # (Dynamo traces no transform's wrapper)
    if held is None or held.is_meta or weight.device_mesh != mesh or x.ndim < 2:
        return None
    if not compiling and is_transformed(held):
        return None
    backend, position, layout = backend_of(mesh), mesh.axis_position(axis), x.sharding
    if backend.held_plan(layout).axes != (position,):  # held over other axes too
        return None
    if any([p.is_partial() or p == Shard(x.ndim - 1) for p in layout.placements]):
        return None
    parameters = [weight] if bias is None else [weight, bias]
    wanted = tuple([Shard(0) if a == position else Replicate() for a in range(mesh.ndim)])
    for p in parameters:
        if not isinstance(p, DTensor) or p.sharding.placements != wanted:
            return None
        if p.device_mesh != mesh or p.dtype != x.dtype or not compiling and is_transformed(data_of(p)):
            return None
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] % mesh.axis_size(axis):
        return None
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]):
        return None
    shape = torch.Size((*x.shape[:-1], weight.shape[0]))
    if not backend.holds(layout, tuple(shape)) or not shard_table(layout, tuple(shape)).is_even:
        return None  # (the all-gather would not hold its result once)
    # the batch axes split x and its product: a parameter's gradient there is each device's part
    batch = tuple([n for n, p in zip(mesh.axis_names, layout.placements) if p.is_shard()])
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad and (not varied.TABLE or axis not in held_varied(x)):
        # x's gradient is the sum of the devices' parts over axis: the all-reduce counted
        pvary = varied.pvaried_held if varied.TABLE else varied.pvary_held  # (once per forward there)
        held = pvary(held, mesh, (axis,))
    weight_rows = _varied_parameter(weight, batch, grad)
    out = backend.gathered_linear(held, weight_rows, mesh, axis)
    if bias is not None:  # (its pvary after the product's, as the linear's own add takes it)
        bias_rows = backend.end_to_end(_varied_parameter(bias, batch, grad), mesh, axis)
        out = out + bias_rows.reshape(bias_rows.shape[0], *[1] * (out.ndim - 2), bias_rows.shape[1])
    axes = frozenset([axis]) if out.requires_grad else frozenset()  # as the style's gather (gather_varied)
    out = autograd.apply(HeldAllGather, out, None, mesh, (axis,), x.ndim - 1, bool(axes), False, False)
    return new_held(varied.mark(out, axes), layout, shape, axes)


def _varied_parameter(p: DTensor, batch: tuple[str, ...], grad: bool) -> torch.Tensor:
    """The storage of a parameter replicated over the ``batch`` axes, through ``pvary`` over
    those it is not varied over already (its gradient is each device's part there), as the
    global ops give it (see :func:`._op_inputs.varied_inputs`)."""
    storage = varied.marked_storage(p)  # (a parameter held once: made from its blocks)
    return varied.pvaried_where_needed(storage, p.device_mesh, batch, grad)

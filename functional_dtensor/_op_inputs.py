"""The inputs of a decided global op: each in the layout the decision needs, through ``pvary``
where its gradient is summed over mesh axes, as held blocks where the op runs on them; and the
axes its output is varied over (see :mod:`._varied`).

``pvary``'s rule in one place (:func:`_needs`): an input gets it over the axes the decision
names for it and those the output is varied over, less the axes it is varied over itself.
"""

from __future__ import annotations

import torch

from . import _varied as varied
from ._cache import Bounded
from ._collectives import Pvary, on_storage
from ._dtensor import DTensor, held_of, storage_of
from ._functorch import is_transformed
from ._op_decisions import Decision
from ._redistribute import redistribute

__all__ = ["held_locals", "holds", "input_storage", "varied_inputs", "pvaried_locals"]


def held_locals(args, local: list, ctx) -> list | None:
    """The local arguments of an op with inputs held once, on held blocks: the inputs' own,
    stacked ones folded (see :meth:`.Backend.held_plan`). None where the output is not held
    or an input's blocks are held along other axes too (or a transform's: see holds)."""
    plan = ctx.held
    if plan is None:
        return None
    out, i = [], 0
    for value, storage in zip(args, local):
        if type(value) is DTensor:
            if held_of(value) is None:
                if is_transformed(storage):
                    return None
                storage = ctx.backend.fold(storage, ctx.decision.inputs[i], plan)
            elif not ctx.held_fits[i]:
                return None
            i += 1
        out.append(storage)
    return out


def holds(tensors: list[DTensor]) -> bool:
    """Whether an op whose output can be held once runs on held blocks: where some input is
    held already (an op on stacked inputs stays on them: a value held along some axes and
    split along others takes a copy per device to become stacked storage again, and a view of
    stacked storage takes none), and not on a ``torch.func`` transform's values."""
    if all([held_of(t) is None for t in tensors]):
        return False
    if torch.compiler.is_compiling():  # (Dynamo traces no transform's wrapper)
        return True
    return not any([held_of(t) is None and is_transformed(storage_of(t)) for t in tensors])


def input_storage(t: DTensor, i: int, grad: bool, held, decision: Decision):
    """The storage of input ``i``, ``t``, for the local form: in the decision's layout,
    through ``pvary`` where it needs a gradient; with a ``held`` plan, its blocks held once
    (see :meth:`.Backend.held_plan`)."""
    fits, layout, axes = decision.fits[i], decision.inputs[i], decision.pvary[i]
    if held is not None and fits and not axes and held_of(t) is not None and decision.context.held_fits[i]:
        return held_of(t)
    storage = storage_of(t if fits else redistribute(t, layout))
    if axes and grad and storage.requires_grad:
        storage = on_storage(storage, decision.output.mesh, Pvary, axes)
    return storage if held is None else decision.context.backend.fold(storage, layout, held)


def varied_inputs(tensors: list[DTensor], decision: Decision, held):
    """The inputs' storages where some are varied (see :mod:`._varied`), and the axes the
    output is varied over: no ``pvary`` over an input's varied axes; where the output is
    replicated over an axis an input is varied over, the output is varied there too and every
    other input needing a gradient gets ``pvary`` there. With a ``held`` plan, the storages
    are held blocks, whose ``pvary`` along its axes sums nothing (a held cotangent is the sum
    of the devices' parts already: :func:`._varied.pvaried_held`)."""
    mesh = decision.output.mesh
    entries = []
    for t, fits, layout in zip(tensors, decision.fits, decision.inputs):
        if fits and held_of(t) is not None:
            entries.append((t, varied.axes_of_value(t)))
            continue
        storage = storage_of(t if fits else redistribute(t, layout))  # redistribute keeps marks
        entries.append((storage, varied.axes_of(storage)))
    needs, out_varied = _needs(decision, tuple([axes for _, axes in entries]))
    backend = decision.context.backend
    along = frozenset() if held is None else frozenset([mesh.axis_names[a] for a in held.axes])
    storages = []
    fits = decision.context.held_fits
    for i, ((value, axes), need, layout) in enumerate(zip(entries, needs, decision.inputs)):
        if type(value) is DTensor and (held is None or need - along or not fits[i]):
            own = backend.held_plan(layout)  # held once, needed stacked
            if need and value.requires_grad and need <= {mesh.axis_names[a] for a in own.axes}:
                value = varied.pvaried_stacked(value, mesh, tuple(n for n in mesh.axis_names if n in need))
                if held is not None:  # (the op's own held blocks: held along fewer axes)
                    summed = tuple([a for a in held.axes if mesh.axis_names[a] in axes | need])
                    value = backend.fold(value, layout, held, summed)
                storages.append(value)
                continue
            value = varied.marked_storage(value)
        if type(value) is DTensor:
            value = held_of(value)
        else:
            if need - along and value.requires_grad:
                # once per value and axes: its uses' gradients summed first
                value = varied.pvaried(value, mesh, tuple(n for n in mesh.axis_names if n in need - along))
            if held is not None:
                summed = tuple([a for a in held.axes if mesh.axis_names[a] in axes])
                value = backend.fold(value, layout, held, summed)
        if need & along and value.requires_grad:
            value = varied.pvaried_held(value, mesh, tuple(n for n in mesh.axis_names if n in need & along))
        storages.append(value)
    return storages, out_varied


def pvaried_locals(args, local: list, decision: Decision) -> tuple[list, frozenset[str]]:
    """The local arguments of a call whose inputs all fit the decision (none held once), where
    autograd records and some input's gradient is summed (see :func:`varied_inputs`): each
    input through ``pvary`` where :func:`_needs` says; and the axes the output is varied over.
    Outside a data-parallel forward (no value marked varied), each ``pvary`` is the input's
    own, as :func:`input_storage` gives it."""
    marked = bool(varied.TABLE)
    axes = tuple(
        [varied.axes_of(s) if marked else frozenset() for v, s in zip(args, local) if type(v) is DTensor]
    )
    needs, out_varied = _needs(decision, axes)
    mesh, out, i = decision.output.mesh, [], 0
    for value, storage in zip(args, local):
        if type(value) is DTensor:
            need = needs[i]
            if need and storage.requires_grad:
                if marked:
                    storage = varied.pvaried(storage, mesh, tuple([n for n in mesh.axis_names if n in need]))
                else:
                    storage = on_storage(storage, mesh, Pvary, decision.pvary[i])
            i += 1
        out.append(storage)
    return out, out_varied


#: (id of a decision, its inputs' varied axes) -> (the decision, what :func:`_needs` gives)
_NEEDS = Bounded(4096, "op inputs: pvary needed")


def _needs(decision: Decision, axes: tuple[frozenset[str], ...]) -> tuple[tuple[frozenset, ...], frozenset]:
    """Per input, the axes it needs ``pvary`` over: those ``decision`` names for it and those
    the output is varied over, less its own varied ``axes``; and the axes the output is varied
    over: those of an input's that the output is replicated along (JAX's rule for values of
    differing ``vma``). Kept per decision and varied axes."""
    key = (id(decision), axes)
    found = None if torch.compiler.is_compiling() else _NEEDS.get(key)
    if found is not None and found[0] is decision:
        return found[1]
    output = decision.output
    replicated = {n for n, p in zip(output.mesh.axis_names, output.placements) if p.is_replicate()}
    out_varied = frozenset().union(*axes) & replicated
    needs = tuple([frozenset(needed).union(out_varied) - own for needed, own in zip(decision.pvary, axes)])
    if not torch.compiler.is_compiling():
        _NEEDS[key] = (decision, (needs, out_varied))
    return needs, out_varied

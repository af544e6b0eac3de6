"""The checks of the mesh and layout arguments of the APIs that build a value or give it a
layout: :func:`check_mesh`, :func:`layout_for` (placements or an ``fd.P``, normalized for an
``ndim``-d tensor) and :func:`check_partial_dtype`."""

from __future__ import annotations

import torch

from ._cache import Bounded
from ._errors import InputTypeError, LayoutError, explain
from ._layout import Layout, PlacementsOrSpec, as_layout
from ._mesh import DeviceMesh
from ._placements import Partial
from ._spec import P

__all__ = ["check_mesh", "check_partial_dtype", "layout_for"]


def check_mesh(mesh, where: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise InputTypeError(
            explain(
                where,
                "a device mesh is needed",
                expected="an fd.DeviceMesh",
                got=type(mesh).__name__,
                fix="build one with fd.simulated_mesh(...) or fd.init_device_mesh(...)",
            )
        )
    return mesh


def check_partial_dtype(layout: Layout, dtype: torch.dtype, where: str) -> None:
    """A Partial reduction must be defined on the dtype: complex values have no order (no
    ``max``/``min``), and the average of bools is no bool."""
    for placement in layout.placements:
        if not isinstance(placement, Partial):
            continue
        op = placement.op
        if (dtype.is_complex and op in ("max", "min")) or (dtype == torch.bool and op == "avg"):
            kind = "complex values have no order" if dtype.is_complex else "an average of bools is no bool"
            raise LayoutError(
                explain(
                    where,
                    f"Partial({op!r}) does not reduce {dtype} values ({kind})",
                    expected="Partial('sum') or Partial('avg') for complex values, "
                    "Partial('sum'|'max'|'min') for bool",
                    got=f"Partial({op!r}) for a {dtype} value",
                    fix="convert the value first (x.real, x.abs(), x.to(torch.int64)), or choose another "
                    "reduction",
                )
            )


def layout_for(
    mesh, placements: PlacementsOrSpec, ndim: int, api: str, *, argument: str = "placements"
) -> Layout:
    """The normalized layout that ``api`` was given (as ``argument``) for an ``ndim``-d tensor
    on ``mesh``: checked once per mesh, placements and ``ndim`` (a module's hooks and the loss
    ask for the same few on every call)."""
    key = None
    if not torch.compiler.is_compiling():
        kind = type(placements)
        key = (mesh, kind, tuple(placements) if kind is list else placements, ndim)
        try:
            layout = _LAYOUTS.get(key)
        except TypeError:  # (unhashable: checked as given, below)
            layout = key = None
        if layout is not None:
            return layout
    layout = _checked_layout(mesh, placements, ndim, api, argument)
    if key is not None:
        _LAYOUTS[key] = layout
    return layout


#: (mesh, the placements' type, the placements, ndim) -> the checked, normalized layout
_LAYOUTS = Bounded(4096, "layouts: checked")


def _checked_layout(mesh, placements, ndim: int, api: str, argument: str) -> Layout:
    mesh = check_mesh(mesh, f"{api}(device_mesh)")
    if isinstance(placements, P) and len(placements) > ndim:
        raise LayoutError(
            explain(
                f"{api}({argument})",
                "the spec has more entries than the tensor has dims",
                expected=f"at most {ndim} entries, one per dim",
                got=f"{placements!r} ({len(placements)} entries) for a {ndim}-d tensor",
                fix="drop the extra entries, or reshape the tensor first",
            )
        )
    layout = as_layout(mesh, placements, where=f"{api}({argument})")
    return layout.normalized(ndim, where=api)

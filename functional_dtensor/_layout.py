"""``Layout``: where every block of a global tensor lives on a mesh.

A layout is a mesh plus one placement per mesh axis, exactly as in DTensor. It converts to and
from a partition spec :class:`P`. Several mesh axes may split one tensor dim; then the order of
the axes is DTensor's default, left to right in the mesh: the axis that comes first in
``mesh.axis_names`` is the major one (it splits the dim first, into contiguous blocks that the
later axes split again). In a ``P`` the tuple entry lists the axes major first, so it must follow
mesh order:

>>> import functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> layout = fd.Layout(mesh, (fd.Shard(0), fd.Shard(0)))
>>> layout.spec
P(('x', 'y'))
>>> fd.Layout.from_spec(mesh, fd.P(None, "x")).placements
(Shard(dim=1), Replicate())
>>> str(layout)
'S(0)S(0)'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from ._errors import InputTypeError, LayoutError, MeshError, explain
from ._mesh import DeviceMesh
from ._placements import Partial, Placement, Replicate, Shard
from ._spec import P

__all__ = ["Layout", "PlacementsOrSpec", "as_layout"]

PlacementsOrSpec: TypeAlias = "Sequence[Placement] | P | Layout"


@dataclass(frozen=True, slots=True)
class Layout:
    """A mesh and one placement per mesh axis."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    _hash: int = field(init=False, repr=False, compare=False, default=0)  # layouts key many caches

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise InputTypeError(
                explain(
                    "fd.Layout(mesh)",
                    "a layout needs a device mesh",
                    expected="an fd.DeviceMesh",
                    got=type(self.mesh).__name__,
                    fix="build one with fd.simulated_mesh or fd.init_device_mesh",
                )
            )
        placements = _checked_placements(self.mesh, self.placements, "fd.Layout(placements)")
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "_hash", hash((self.mesh, placements)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Layout, (self.mesh, self.placements))

    @classmethod
    def from_spec(cls, mesh: DeviceMesh, spec: P, *, where: str = "fd.Layout.from_spec") -> Layout:
        """The layout that shards dim ``d`` over the axes named in ``spec[d]``."""
        if not isinstance(spec, P):
            raise InputTypeError(
                explain(
                    f"{where}(spec)",
                    "a partition spec is needed",
                    expected="an fd.P such as fd.P('x', None)",
                    got=repr(spec),
                    fix="wrap the entries in fd.P(...)",
                )
            )
        placements: list[Placement] = [Replicate()] * mesh.ndim
        for dim, entry in enumerate(spec):
            names = (entry,) if isinstance(entry, str) else entry or ()
            positions = []
            for name in names:
                if name not in mesh.axis_names:
                    raise LayoutError(
                        explain(
                            f"{where}(spec[{dim}])",
                            f"unknown mesh axis {name!r}",
                            expected=f"an axis of the mesh, one of {mesh.axis_names}",
                            got=repr(name),
                            fix="use the mesh's axis names, or build the mesh with this axis",
                        )
                    )
                positions.append(mesh.axis_names.index(name))
            if positions != sorted(positions):
                in_order = tuple([mesh.axis_names[p] for p in sorted(positions)])
                raise LayoutError(
                    explain(
                        f"{where}(spec[{dim}])",
                        "axes that split one dim are listed major first, in mesh order",
                        expected=repr(in_order),
                        got=repr(entry),
                        fix=f"write {in_order!r}, or build the mesh with the axes in this order",
                    )
                )
            for position in positions:
                placements[position] = Shard(dim)
        return cls(mesh, tuple(placements))

    @property
    def spec(self) -> P:
        """The partition spec of this layout (trailing unsplit dims omitted)."""
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Partial):
                raise LayoutError(
                    explain(
                        "fd.Layout.spec",
                        f"mesh axis {self.mesh.axis_names[axis]!r} holds partial values",
                        expected="only Shard and Replicate placements",
                        got=str(self),
                        fix="reduce first (fd.redistribute to Replicate), or keep the placements",
                    )
                )
            if isinstance(placement, Shard) and placement.dim < 0:
                raise LayoutError(
                    explain(
                        "fd.Layout.spec",
                        "a negative Shard dim has no position until the tensor rank is known",
                        expected="non-negative dims",
                        got=str(self),
                        fix="call layout.normalized(ndim) first",
                    )
                )
        dims = [p.dim for p in self.placements if isinstance(p, Shard)]
        entries: list[tuple[str, ...]] = [() for _ in range(max(dims, default=-1) + 1)]
        for name, placement in zip(self.mesh.axis_names, self.placements):
            if isinstance(placement, Shard):
                entries[placement.dim] += (name,)
        return P(*entries)

    def sharding_axes(self, dim: int) -> tuple[int, ...]:
        """The positions of the mesh axes that split tensor dim ``dim``, major first."""
        return tuple([a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim])

    @property
    def is_replicated(self) -> bool:
        return all([isinstance(p, Replicate) for p in self.placements])

    @property
    def is_fully_sharded(self) -> bool:
        """Whether every mesh axis splits the value (no replicas, no partial values)."""
        return all([isinstance(p, Shard) for p in self.placements])

    @property
    def has_partial(self) -> bool:
        return any([isinstance(p, Partial) for p in self.placements])

    def normalized(self, ndim: int, *, where: str = "fd.Layout") -> Layout:
        """This layout with negative Shard dims counted from the end of an ``ndim``-d tensor."""
        placements = list(self.placements)
        for axis, placement in enumerate(placements):
            if isinstance(placement, Shard):
                if not -ndim <= placement.dim < ndim:
                    raise LayoutError(
                        explain(
                            f"{where}(placements[{axis}])",
                            f"{placement!r} is out of range for a {ndim}-d tensor",
                            expected=f"a dim in [{-ndim}, {ndim})",
                            got=str(placement.dim),
                            fix=f"shard one of the tensor's dims 0..{ndim - 1}"
                            if ndim
                            else "a 0-d tensor can only be replicated or partial",
                        )
                    )
                if placement.dim < 0:
                    placements[axis] = Shard(placement.dim + ndim)
        return Layout(self.mesh, tuple(placements))

    def __str__(self) -> str:
        return _short(self.placements)


def _checked_placements(mesh: DeviceMesh, placements, where: str) -> tuple[Placement, ...]:
    """``placements`` as a tuple, one Placement per mesh axis; ``where`` names the argument
    (``"fd.Layout(placements)"``), an index goes inside its parenthesis."""
    if isinstance(placements, Placement):
        placements = (placements,)
    placements = tuple(placements)
    for axis, placement in enumerate(placements):
        if not isinstance(placement, Placement):
            raise InputTypeError(
                explain(
                    f"{where[:-1]}[{axis}])" if where.endswith(")") else f"{where}[{axis}]",
                    "each mesh axis needs a placement",
                    expected="fd.Shard(dim), fd.Replicate() or fd.Partial(op)",
                    got=repr(placement),
                    fix="write one placement per mesh axis, or pass an fd.P spec",
                )
            )
    if len(placements) != mesh.ndim:
        raise LayoutError(
            explain(
                where,
                "one placement per mesh axis",
                expected=f"{mesh.ndim} for mesh axes {mesh.axis_names}",
                got=f"{len(placements)}: {_short(placements)}",
                fix="add fd.Replicate() for axes that do not split the tensor",
            )
        )
    return placements


def _short(placements: Sequence[object]) -> str:
    return "".join(str(p) for p in placements)


def as_layout(mesh: DeviceMesh, target: PlacementsOrSpec, *, where: str) -> Layout:
    """Read placements, a ``P`` or a ``Layout`` given for ``mesh`` by the API ``where``."""
    if isinstance(target, Layout):
        if target.mesh != mesh:
            raise MeshError(
                explain(
                    where,
                    "the layout is on another mesh",
                    expected=repr(mesh),
                    got=repr(target.mesh),
                    fix="pass placements or a P spec for this mesh",
                )
            )
        return target
    if isinstance(target, P):
        return Layout.from_spec(mesh, target, where=where)
    if isinstance(target, Placement):
        target = (target,)
    if not isinstance(target, (tuple, list)):
        raise InputTypeError(
            explain(
                where,
                "a layout is needed",
                expected="a sequence of placements, an fd.P spec or an fd.Layout",
                got=type(target).__name__,
                fix="write e.g. [fd.Shard(0), fd.Replicate()] or fd.P('x')",
            )
        )
    return Layout(mesh, _checked_placements(mesh, target, where))

"""``Layout``: where every block of a global tensor lives on a mesh.

A layout is a mesh, one placement per mesh axis (as in DTensor) and, where several mesh axes
split one tensor dim, the order in which they split it. The first axis of that order is the
major one: it splits the dim into contiguous blocks, which the next axis splits again, and so
on. By default the order is the mesh's (DTensor's left-to-right default); any other order is
recorded in ``shard_order``, with the meaning of torch's ``DTensorSpec.shard_order``: entries
``(dim, axes)`` with ``axes`` the positions of the mesh axes that split ``dim``, major first.
Only orders other than the mesh's are recorded, so equal layouts compare and hash equal.

A layout converts to and from a partition spec :class:`P`, whose tuple entries list the axes of
a dim major first, in any order (as in JAX):

>>> import functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> layout = fd.Layout(mesh, (fd.Shard(0), fd.Shard(0)))
>>> layout.spec, str(layout)
(P(('x', 'y')), 'S(0)S(0)')
>>> swapped = fd.Layout.from_spec(mesh, fd.P(("y", "x")))
>>> swapped.shard_order, str(swapped)
(((0, (1, 0)),), 'S(0)[1]S(0)[0]')
>>> fd.Layout.from_spec(mesh, fd.P(None, "x")).placements
(Shard(dim=1), Replicate())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from ._errors import InputTypeError, LayoutError, MeshError, explain
from ._mesh import DeviceMesh
from ._placements import Partial, Placement, Replicate, Shard
from ._public import public
from ._spec import P

__all__ = ["Layout", "PlacementsOrSpec", "ShardOrder", "as_layout"]

PlacementsOrSpec: TypeAlias = "Sequence[Placement] | P | Layout"
#: ``(dim, axes)`` entries: the positions of the mesh axes that split tensor dim ``dim``, major
#: first (torch's ``ShardOrderEntry(tensor_dim, mesh_dims)``).
ShardOrder: TypeAlias = "tuple[tuple[int, tuple[int, ...]], ...]"


@public
@dataclass(frozen=True, slots=True)
class Layout:
    """A mesh, one placement per mesh axis, and the order of the axes that split one dim
    where it is not the mesh's (see the module docstring)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shard_order: ShardOrder = ()
    # derived once, when built: layouts key many caches and their split orders are read per op
    _hash: int = field(init=False, repr=False, compare=False, default=0)
    _orders: dict = field(init=False, repr=False, compare=False, default=None)
    _kinds: frozenset = field(init=False, repr=False, compare=False, default=frozenset())

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
        if isinstance(self.placements, P):  # fd.Layout(mesh, fd.P(...)): the spec's layout
            if self.shard_order:
                raise LayoutError(
                    explain(
                        "fd.Layout(shard_order)",
                        "a partition spec gives its own order (a tuple entry lists axes major first)",
                        expected="no shard_order with an fd.P",
                        got=repr(self.shard_order),
                        fix="write the order in the spec: fd.P(('tp', 'dp'))",
                    )
                )
            spec_layout = Layout.from_spec(self.mesh, self.placements, where="fd.Layout")
            object.__setattr__(self, "placements", spec_layout.placements)
            object.__setattr__(self, "shard_order", spec_layout.shard_order)
        placements = _checked_placements(self.mesh, self.placements, "fd.Layout(placements)")
        orders: dict[int, tuple[int, ...]] = {}
        for axis, placement in enumerate(placements):
            if isinstance(placement, Shard):
                orders[placement.dim] = (*orders.get(placement.dim, ()), axis)
        shard_order = _checked_order(self.mesh, placements, self.shard_order, orders)
        for dim, axes in shard_order:
            orders[dim] = axes
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "shard_order", shard_order)
        object.__setattr__(self, "_orders", orders)
        object.__setattr__(self, "_kinds", frozenset(type(p) for p in placements))
        object.__setattr__(self, "_hash", hash((self.mesh, placements, shard_order)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Layout, (self.mesh, self.placements, self.shard_order))

    def __repr__(self) -> str:
        order = f", shard_order={self.shard_order!r}" if self.shard_order else ""
        return f"Layout(mesh={self.mesh!r}, placements={self.placements!r}{order})"

    @classmethod
    def from_spec(cls, mesh: DeviceMesh, spec: P, *, where: str = "fd.Layout.from_spec") -> Layout:
        """The layout that shards dim ``d`` over the axes named in ``spec[d]``, major first."""
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
        order = []
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
                placements[positions[-1]] = Shard(dim)
            if positions != sorted(positions):
                order.append((dim, tuple(positions)))
        return cls(mesh, tuple(placements), tuple(order))

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
        names = self.mesh.axis_names
        entries = [
            tuple(names[a] for a in self.sharding_axes(d)) for d in range(max(self._orders, default=-1) + 1)
        ]
        return P(*entries)

    def sharding_axes(self, dim: int) -> tuple[int, ...]:
        """The positions of the mesh axes that split tensor dim ``dim``, major first."""
        return self._orders.get(dim, ())

    @property
    def is_replicated(self) -> bool:
        return self._kinds == _REPLICATE

    @property
    def is_fully_sharded(self) -> bool:
        """Whether every mesh axis splits the value (no replicas, no partial values)."""
        return self._kinds == _SHARD

    @property
    def has_partial(self) -> bool:
        return Partial in self._kinds

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
        if placements == list(self.placements):
            return self
        order = tuple((dim % ndim, axes) for dim, axes in self.shard_order)
        return Layout(self.mesh, tuple(placements), order)

    def __str__(self) -> str:
        """The placements in short form; where a dim's axes split it in another order than the
        mesh's, each one's index in that order (``S(0)[1]S(0)[0]``, as torch writes it)."""
        out = []
        for axis, placement in enumerate(self.placements):
            text = str(placement)
            if isinstance(placement, Shard) and any(dim == placement.dim for dim, _ in self.shard_order):
                text += f"[{self._orders[placement.dim].index(axis)}]"
            out.append(text)
        return "".join(out)


_REPLICATE, _SHARD = frozenset([Replicate]), frozenset([Shard])


def _checked_order(mesh: DeviceMesh, placements, shard_order, orders: dict) -> tuple:
    """``shard_order`` in canonical form: entries sorted by dim, those in mesh order dropped."""
    where = "fd.Layout(shard_order)"
    try:
        entries = [(int(dim), tuple(int(a) for a in axes)) for dim, axes in shard_order]
    except (TypeError, ValueError):
        raise InputTypeError(
            explain(
                where,
                "the shard order lists (dim, axes) pairs",
                expected="a tuple such as ((0, (1, 0)),): dim 0 split by mesh axis 1, then axis 0",
                got=repr(shard_order),
                fix="give each dim's mesh axis positions, major first",
            )
        ) from None
    canonical = []
    for dim, axes in sorted(entries):
        if sorted(axes) != list(orders.get(dim, ())) or len(set(axes)) != len(axes):
            raise LayoutError(
                explain(
                    where,
                    f"the order of dim {dim} must list the mesh axes that split it",
                    expected=f"a permutation of {orders.get(dim, ())}",
                    got=repr(axes),
                    fix="list each axis placed Shard(dim) once, major first",
                )
            )
        if list(axes) != sorted(axes):
            canonical.append((dim, axes))
    if len({dim for dim, _ in canonical}) != len(canonical):
        raise LayoutError(
            explain(
                where,
                "one entry per dim",
                expected="each dim at most once",
                got=repr(shard_order),
                fix="merge the entries of a dim into one",
            )
        )
    return tuple(canonical)


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
                got=f"{len(placements)}: {''.join(str(p) for p in placements)}",
                fix="add fd.Replicate() for axes that do not split the tensor",
            )
        )
    return placements


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

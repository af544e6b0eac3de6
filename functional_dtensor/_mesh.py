"""``DeviceMesh``: an n-d grid of devices with named axes. Pure data.

Vocabulary used throughout the library:

* *axis* — a mesh axis (``"dp"``, ``"tp"``); *dim* — a tensor dimension;
* *shard* — the block of a global tensor that one device holds;
* *local* — per device (a local shape, a local tensor); *global* — the logical whole.

A mesh is shape, axis names, device type, backend and the flat ids of its devices in row-major
order (for a sub-mesh, of every group of devices it stands for). It is pure data, the same on
every process; runtime state (process groups, this process's rank) lives in the backend,
looked up from the mesh.

>>> import functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
>>> mesh
DeviceMesh(shape=(2, 4), axis_names=('dp', 'tp'))
>>> mesh.size, mesh["tp"].shape, mesh.coordinate(5)
(8, (4,), (1, 1))
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from ._errors import InputTypeError, MeshError, explain
from ._public import public

__all__ = ["DeviceMesh", "simulated_mesh", "Backend", "check_device_type"]

Backend: TypeAlias = Literal["simulated", "distributed"]
BACKENDS: tuple[str, ...] = ("simulated", "distributed")


@public
@dataclass(frozen=True, slots=True)
class DeviceMesh:
    """An n-d grid of devices with one name per axis.

    Build one with :func:`simulated_mesh` (every device in this process) or
    :func:`init_device_mesh` (one process per device, ``torch.distributed``).
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_type: str = "cpu"
    backend: Backend = "simulated"
    device_ids: tuple[int, ...] = field(default=())
    _hash: int = field(init=False, repr=False, compare=False, default=0)  # meshes key many caches
    _size: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        shape = _as_tuple(self.shape)
        names = (self.axis_names,) if isinstance(self.axis_names, str) else self.axis_names
        try:
            shape = tuple(operator.index(s) for s in shape)
        except TypeError:
            raise InputTypeError(
                explain(
                    "fd.DeviceMesh(shape)",
                    "mesh sizes must be integers",
                    expected="a tuple of positive ints such as (2, 4)",
                    got=repr(self.shape),
                    fix="pass the number of devices along each axis",
                )
            ) from None
        if not shape or any(s < 1 for s in shape):
            raise MeshError(
                explain(
                    "fd.DeviceMesh(shape)",
                    "every mesh axis needs at least one device",
                    expected="a non-empty tuple of positive ints",
                    got=repr(shape),
                    fix="give each axis a size of 1 or more, e.g. (2, 4)",
                )
            )
        names = tuple(names)
        if not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise InputTypeError(
                explain(
                    "fd.DeviceMesh(axis_names)",
                    "axis names must be identifiers",
                    expected="a tuple of str such as ('dp', 'tp')",
                    got=repr(self.axis_names),
                    fix="name each mesh axis with a short identifier",
                )
            )
        if len(names) != len(shape):
            raise MeshError(
                explain(
                    "fd.DeviceMesh(axis_names)",
                    "one name per mesh axis",
                    expected=f"{len(shape)} names for shape {shape}",
                    got=f"{len(names)}: {names!r}",
                    fix="give as many axis names as the mesh shape has entries",
                )
            )
        if len(set(names)) != len(names):
            raise MeshError(
                explain(
                    "fd.DeviceMesh(axis_names)",
                    "axis names must be distinct",
                    expected="no repeated name",
                    got=repr(names),
                    fix="rename the repeated axis",
                )
            )
        if self.backend not in BACKENDS:
            raise MeshError(
                explain(
                    "fd.DeviceMesh(backend)",
                    "unknown backend",
                    expected=" or ".join(repr(b) for b in BACKENDS),
                    got=repr(self.backend),
                    fix="build meshes with fd.simulated_mesh or fd.init_device_mesh",
                )
            )
        size = math.prod(shape)
        try:
            ids = tuple(operator.index(i) for i in self.device_ids) if self.device_ids else tuple(range(size))
        except TypeError:
            ids = tuple(self.device_ids)
        if len(ids) % size or len(set(ids)) != len(ids) or not all(isinstance(i, int) for i in ids):
            raise MeshError(
                explain(
                    "fd.DeviceMesh(device_ids)",
                    "one distinct int id per device (of each group, for a sub-mesh)",
                    expected=f"{size} distinct ids for shape {shape}, or a multiple of {size}",
                    got=repr(ids),
                    fix="omit device_ids to number the devices 0..size-1",
                )
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "_size", size)
        object.__setattr__(self, "_hash", hash((shape, names, self.device_type, self.backend, ids)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt from the fields: the cached hash of str fields differs between processes
        return (DeviceMesh, (self.shape, self.axis_names, self.device_type, self.backend, self.device_ids))

    def __repr__(self) -> str:
        fields = [f"shape={self.shape!r}", f"axis_names={self.axis_names!r}"]
        if self.device_type != "cpu":
            fields.append(f"device_type={self.device_type!r}")
        if self.backend != "simulated":
            fields.append(f"backend={self.backend!r}")
        if self.device_ids != tuple(range(self.size)):
            fields.append(f"device_ids={self.device_ids!r}")
        return f"DeviceMesh({', '.join(fields)})"

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"{self.backend} mesh [{axes}] on {self.device_type}"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of devices."""
        return self._size

    def axis_size(self, axes: str | Sequence[str]) -> int:
        """The number of devices along an axis, or along several axes together."""
        return math.prod([self.shape[self.axis_position(a)] for a in _axis_tuple(axes)])

    def axis_position(self, axis: str) -> int:
        """The index of a named axis in ``shape``."""
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise MeshError(
                explain(
                    "fd.DeviceMesh",
                    f"no mesh axis named {axis!r}",
                    expected=f"one of {self.axis_names!r}",
                    got=repr(axis),
                    fix="use an axis name of this mesh",
                )
            ) from None

    def coordinate(self, device: int) -> tuple[int, ...]:
        """The mesh coordinate of the device at flat (row-major) position ``device``."""
        if not 0 <= device < self.size:
            raise MeshError(
                explain(
                    "fd.DeviceMesh.coordinate(device)",
                    "no such device",
                    expected=f"a flat index in [0, {self.size})",
                    got=repr(device),
                    fix="count devices in row-major mesh order",
                )
            )
        coordinate = []
        for size in reversed(self.shape):
            device, index = divmod(device, size)
            coordinate.append(index)
        return tuple(reversed(coordinate))

    def flat_index(self, coordinate: Sequence[int]) -> int:
        """The flat (row-major) position of the device at ``coordinate``."""
        if len(coordinate) != self.ndim or not all([0 <= c < s for c, s in zip(coordinate, self.shape)]):
            raise MeshError(
                explain(
                    "fd.DeviceMesh.flat_index(coordinate)",
                    "no such device",
                    expected=f"a coordinate within {self.shape}",
                    got=repr(tuple(coordinate)),
                    fix="give one index per mesh axis, each below the axis size",
                )
            )
        index = 0
        for c, size in zip(coordinate, self.shape, strict=True):
            index = index * size + c
        return index

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The device ids of each group of this mesh, in row-major mesh order.

        A mesh built whole has one group. A sub-mesh (``mesh["tp"]``) has one group per
        coordinate of the axes it leaves out: every process finds the group that holds its
        device (on the simulated backend, the first one: the group of device 0)."""
        n = self.size
        return tuple(self.device_ids[start : start + n] for start in range(0, len(self.device_ids), n))

    def __getitem__(self, axes: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over ``axes``: one group of devices for each coordinate of the other
        axes (see :attr:`groups`). Pure data: the same on every process."""
        names = _axis_tuple(axes)
        positions = [self.axis_position(a) for a in names]
        rest = [p for p in range(self.ndim) if p not in positions]
        groups = []
        for ids in self.groups:
            for outer in _coordinates(tuple(self.shape[p] for p in rest)):
                coordinate = [0] * self.ndim
                for p, c in zip(rest, outer):
                    coordinate[p] = c
                group = []
                for inner in _coordinates(tuple(self.shape[p] for p in positions)):
                    for p, c in zip(positions, inner):
                        coordinate[p] = c
                    group.append(ids[self.flat_index(coordinate)])
                groups.append(tuple(group))
        groups.sort()  # canonical: slicing in steps or at once gives the same mesh
        return DeviceMesh(
            tuple(self.shape[p] for p in positions),
            names,
            self.device_type,
            self.backend,
            tuple(i for group in groups for i in group),
        )


def simulated_mesh(
    shape: int | Sequence[int],
    axis_names: str | Sequence[str],
    device_type: str = "cpu",
) -> DeviceMesh:
    """A mesh whose devices all live in this process, on one CPU or one GPU.

    Every device's shard is held in one stacked tensor, so that one tensor op serves all
    devices: meshes of 64 or more devices are practical.
    """
    device_type = check_device_type(device_type, "fd.simulated_mesh")
    return DeviceMesh(_as_tuple(shape), _as_tuple(axis_names), device_type, "simulated")


def _as_tuple(value):
    """A tuple of ``value``'s entries, or of ``value`` itself where it is a single one (an int,
    a name, or anything not iterable: ``DeviceMesh`` then says what is wrong with it)."""
    if isinstance(value, (str, int)) or not hasattr(value, "__iter__"):
        return (value,)
    return tuple(value)


def check_device_type(device_type, where: str) -> str:
    """``device_type`` if this process has such devices: ``'cpu'``, or an accelerator type
    (``'cuda'``, ``'cuda:1'``) whose torch module says it is available."""
    import torch

    try:
        kind = torch.device(device_type).type
    except (RuntimeError, TypeError):
        raise MeshError(
            explain(
                f"{where}(device_type)",
                "unknown device type",
                expected="a torch device type such as 'cpu' or 'cuda'",
                got=repr(device_type),
                fix="use 'cuda' for NVIDIA and AMD GPUs, 'cpu' otherwise",
            )
        ) from None
    module = getattr(torch, kind, None)
    if kind != "cpu" and not (hasattr(module, "is_available") and module.is_available()):
        raise MeshError(
            explain(
                f"{where}(device_type)",
                f"this process has no {kind} device",
                expected=f"a device type available here ({kind} available: False)",
                got=repr(device_type),
                fix="use device_type='cpu', or run where the device and its torch build are",
            )
        )
    return device_type


def _axis_tuple(axes: str | Sequence[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _coordinates(shape: tuple[int, ...]):
    if not shape:
        yield ()
        return
    for head in range(shape[0]):
        for rest in _coordinates(shape[1:]):
            yield (head, *rest)

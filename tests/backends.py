"""One program, both backends: the ``backend`` fixture's machinery, and a plain-loop oracle.

A test writes a module-level *job* ``job(mesh, *args)`` and hands it to
``backend.run(job, mesh_shape, axis_names, *args)``. On the simulated backend the job runs once,
here, on ``fd.simulated_mesh(mesh_shape, axis_names)``; on ``gloo-2`` and ``gloo-4`` it runs on
every rank of the session's pool (see :mod:`distributed_pool`) on
``fd.init_device_mesh("cpu", mesh_shape, axis_names)``. Either way the answer is the list of
per-process results (one on the simulated backend, one per rank on gloo), and arguments and
results go through pickle on both backends, so a job that passes on one cannot fail on the
other for want of pickling.

A process holds the shards of its devices: all of them on the simulated backend, its rank's on
gloo, in flat (row-major) mesh order. A job returns ``x.local_shards()`` and :func:`per_device`
puts the answers of every process together, one shard per device of the mesh. The jobs compare
nothing; the test, in this process, compares what came back with a single-device reference.

The oracle (:func:`block`, :func:`index_along`, :func:`coordinates`) is independent of the
library: the block of a device is found by ``torch.chunk``, one mesh axis at a time in the order
a spec entry lists them (major first).
"""

from __future__ import annotations

import itertools
import math
import pickle
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

import functional_dtensor as fd

__all__ = [
    "BACKENDS",
    "DEFAULT_MESHES",
    "Backend",
    "Mesh",
    "as_mesh",
    "local_devices",
    "local_of",
    "on_mesh",
    "per_device",
    "relayout",
    "events",
    "block",
    "coordinates",
    "index_along",
    "group_of",
    "all_specs",
    "spec_of_shards",
    "reduce_partial",
]

#: backend name -> the number of gloo ranks (None: the simulated backend, one process)
BACKENDS: dict[str, int | None] = {"simulated": None, "gloo-2": 2, "gloo-4": 4}
NAMES = ("x", "y", "z")


@dataclass(frozen=True)
class Mesh:
    """What a test runs on: a mesh shape, its axis names and (for programs mapped over some of
    the axes) the axes a program maps over, in the order it names them. Prints as ``2x2`` or
    ``2x2:yx``."""

    shape: tuple[int, ...]
    names: tuple[str, ...] = ()
    axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "names", tuple(self.names) or NAMES[: len(self.shape)])
        object.__setattr__(self, "axes", tuple(self.axes))

    def __str__(self) -> str:
        text = "x".join(map(str, self.shape))
        return f"{text}:{''.join(self.axes)}" if self.axes else text

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def simulated(self) -> fd.DeviceMesh:
        return fd.simulated_mesh(self.shape, self.names)


def as_mesh(item) -> Mesh:
    return item if isinstance(item, Mesh) else Mesh(tuple(item))


#: the meshes a test taking ``mesh`` runs on unless it says otherwise (``@pytest.mark.meshes``)
DEFAULT_MESHES = (Mesh((2,)), Mesh((4,)), Mesh((2, 2)))


class Backend:
    """The backend a test runs on (see the module docstring)."""

    def __init__(self, name: str, gloo=None) -> None:
        self.name = name
        self.world_size = BACKENDS[name]
        self._gloo = gloo

    def __repr__(self) -> str:
        return f"<backend {self.name}>"

    @property
    def is_simulated(self) -> bool:
        return self.world_size is None

    def runs(self, mesh_shape: Sequence[int]) -> bool:
        """Whether this backend runs a mesh of this shape (gloo: one rank per device)."""
        return self.is_simulated or math.prod(mesh_shape) == self.world_size

    def run(self, job: Callable, mesh_shape, axis_names=None, *args, timeout: float = 60.0) -> list:
        """``job(mesh, *args)`` in every process of this backend; the per-process results."""
        shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
        names = tuple(axis_names or NAMES[: len(shape)])
        if not self.runs(shape):
            raise ValueError(f"the {self.name} backend cannot run a mesh of shape {shape}")
        if self.is_simulated:
            args = pickle.loads(pickle.dumps(args))
            return [pickle.loads(pickle.dumps(job(fd.simulated_mesh(shape, names), *args)))]
        ref = (job.__module__, getattr(sys.modules[job.__module__], "__file__", None), job.__qualname__)
        return self._gloo.run(self.world_size, on_mesh, ref, shape, names, args, timeout=timeout)


def on_mesh(ref: tuple[str, str | None, str], shape, names, args):
    """A rank's side of :meth:`Backend.run`: the job, on this rank's distributed mesh."""
    import distributed_pool

    job = distributed_pool.resolve(*ref)
    return job(fd.init_device_mesh("cpu", shape, names), *args)


# --- in jobs ----------------------------------------------------------------------------------


def local_devices(mesh: fd.DeviceMesh) -> list[int]:
    """The flat indices of the devices this process holds, in mesh order."""
    if mesh.backend == "simulated":
        return list(range(mesh.size))
    from functional_dtensor._distributed import runtime

    return [runtime.device_index(mesh)]


def local_of(mesh: fd.DeviceMesh, shards: Sequence[torch.Tensor]):
    """What ``fd.from_local`` takes in this process, given every device's shard: the list on
    the simulated backend, this rank's shard on gloo."""
    mine = [shards[d] for d in local_devices(mesh)]
    return mine if mesh.backend == "simulated" else mine[0]


def relayout(mesh: fd.DeviceMesh, layout: fd.Layout) -> fd.Layout:
    """``layout`` (built on a simulated mesh in the test) on this job's ``mesh``."""
    return fd.Layout(mesh, layout.placements, layout.shard_order)


def events(comm: fd.CommDebugMode) -> list[tuple[str, tuple[str, ...], int]]:
    """``(op, axes, bytes per device)`` of each collective a ``CommDebugMode`` saw."""
    return [(e.op, tuple(e.axes), e.nbytes) for e in comm.events]


# --- in tests ---------------------------------------------------------------------------------


def per_device(results: list, key=None) -> list:
    """Every device's item, in flat mesh order, from per-process results each holding (under
    ``key``) the items of its own devices."""
    return [item for result in results for item in (result if key is None else result[key])]


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every device's coordinate, in flat (row-major) order."""
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def index_along(mesh_shape, names, axes: Iterable[str], coordinate) -> int:
    """A device's index along ``axes``, the first one major."""
    index = 0
    for axis in axes:
        position = list(names).index(axis)
        index = index * mesh_shape[position] + coordinate[position]
    return index


def group_of(mesh_shape, names, axes: Iterable[str], coordinate) -> list[tuple[int, ...]]:
    """The coordinates of the devices that share ``coordinate`` off ``axes``, by their index
    along ``axes`` (the first one major)."""
    axes = tuple(axes)
    members = [
        c
        for c in coordinates(mesh_shape)
        if all(c[p] == coordinate[p] for p, n in enumerate(names) if n not in axes)
    ]
    return sorted(members, key=lambda c: index_along(mesh_shape, names, axes, c))


def _entries(spec) -> list[tuple[str, ...]]:
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def block(value: torch.Tensor, mesh_shape, names, spec, coordinate) -> torch.Tensor:
    """The block of ``value`` that the device at ``coordinate`` holds under the partition spec
    ``spec``: each dim cut by ``torch.chunk`` over its axes in the spec's order, major first
    (a device past the last chunk holds an empty block)."""
    for dim, axes in enumerate(_entries(spec)):
        for axis in axes:
            position = list(names).index(axis)
            pieces = value.chunk(mesh_shape[position], dim) if value.shape[dim] else ()
            at = coordinate[position]
            value = pieces[at] if at < len(pieces) else value.narrow(dim, value.shape[dim], 0)
    return value


def all_specs(names: Sequence[str], ndim: int) -> list[fd.P]:
    """Every partition spec of an ``ndim``-d value over mesh axes ``names``: each axis splits
    one dim or none, and the axes of a dim come in every order."""
    out = []
    for dims in itertools.product(range(-1, ndim), repeat=len(names)):
        groups = [[n for n, d in zip(names, dims) if d == dim] for dim in range(ndim)]
        for orders in itertools.product(*[itertools.permutations(g) for g in groups]):
            out.append(fd.P(*[tuple(o) for o in orders]))
    return out


def spec_of_shards(layout: fd.Layout) -> fd.P:
    """The partition spec of a layout's Shard axes (Partial axes hold parts of each block, as
    Replicate axes hold copies)."""
    names = layout.mesh.axis_names
    ndim = max((p.dim + 1 for p in layout.placements if p.is_shard()), default=0)
    return fd.P(*[tuple(names[a] for a in layout.sharding_axes(d)) for d in range(ndim)])


def _reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(parts)
    if op == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if op == "avg":
        total = stacked.sum(0, dtype=stacked.dtype)
        return (
            total / len(parts)
            if stacked.is_floating_point()
            else total.div(len(parts), rounding_mode="floor")
        )
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def reduce_partial(shards: Sequence[torch.Tensor], mesh_shape, placements) -> dict:
    """``{coordinate: value}`` for the devices whose Partial coordinates are 0: each value the
    reduction of its group's shards, one Partial axis at a time in mesh order (an integer
    average rounds down at each)."""
    values = dict(zip(coordinates(mesh_shape), shards, strict=True))
    for axis, placement in enumerate(placements):
        if placement.is_partial():
            values = {
                c: _reduce(
                    [values[c[:axis] + (i,) + c[axis + 1 :]] for i in range(mesh_shape[axis])], placement.op
                )
                for c in values
                if c[axis] == 0
            }
    return values

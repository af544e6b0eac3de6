"""Runtime state of the distributed backend: the process group, this rank's place in a mesh and
one process group per mesh axis.

A :class:`DeviceMesh` is pure data, the same on every rank; this module looks up, by mesh, what
it means here: the group of the mesh that holds this rank (a sub-mesh stands for several), this
rank's coordinate in it, and the ``torch.distributed`` process groups it runs on. Groups are
built once (per-axis groups when the mesh is made, flattened groups for a tuple of axes on first
use, by every rank alike) and reused.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _log as log
from .._cache import cached
from .._errors import MeshError, explain
from .._mesh import DeviceMesh, check_device_type
from . import checks
from .errors import DEFAULT_TIMEOUT

__all__ = [
    "init_device_mesh",
    "group",
    "group_ids",
    "coordinate",
    "device_index",
    "group_index",
    "DEFAULT_TIMEOUT",
]

_torch_meshes: dict[DeviceMesh, object] = {}
_timeout: list[datetime.timedelta] = []  # the collective timeout of the process group, once read
_groups: dict[tuple[DeviceMesh, tuple[str, ...]], dist.ProcessGroup] = {}


def init_device_mesh(
    device_type: str,
    shape: int | Sequence[int],
    axis_names: str | Sequence[str],
    *,
    timeout: datetime.timedelta | None = None,
    check_collectives: bool | None = None,
) -> DeviceMesh:
    """A mesh over the ranks of ``torch.distributed`` (one device per rank), creating the process
    group from the ``torchrun`` environment when there is none yet: gloo on CPU, NCCL on CUDA
    (destroyed at exit; a group the program made itself is the program's to destroy).
    ``timeout`` bounds every collective, so that a dead or stuck rank becomes an error (default
    60 s, or ``FD_COLLECTIVE_TIMEOUT`` seconds). ``check_collectives`` turns on the collective
    checks for the rest of the run (see ``fd.check_collectives``; default: on when the
    environment variable ``FD_CHECK_COLLECTIVES`` is 1)."""
    device_type = check_device_type(device_type, "fd.init_device_mesh")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if not dist.is_initialized():
        backend = "nccl" if device_type.startswith("cuda") else "gloo"
        if device_type.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout or DEFAULT_TIMEOUT)
        _timeout[:] = [timeout or DEFAULT_TIMEOUT]
        atexit.register(_destroy_at_exit, dist.group.WORLD)
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise MeshError(
            explain(
                "fd.init_device_mesh(shape)",
                "the mesh must cover every rank",
                expected=f"sizes whose product is the world size {world}",
                got=f"{shape} ({math.prod(shape)} devices)",
                fix=f"launch {math.prod(shape)} ranks with torchrun, or pick a shape for {world}",
            )
        )
    mesh = DeviceMesh(shape, names, device_type, "distributed")
    torch_mesh(mesh)
    for count in range(1, len(names) + 1):  # every group made now, by every rank in one order: a
        for axes in itertools.combinations(names, count):  # compiled graph never makes one
            group(mesh, axes)
    if check_collectives is None:
        check_collectives = os.environ.get("FD_CHECK_COLLECTIVES", "0").lower() in ("1", "true", "yes", "on")
    if check_collectives:
        checks.enable(timeout or collective_timeout())
    elif checks.on:  # on before torch.distributed was: its group is made now, by every rank
        checks.start()
    return mesh


def _destroy_at_exit(world) -> None:
    """At exit, the process group :func:`init_device_mesh` made (``world``, unless the program
    destroyed it and made another) destroyed, as torch asks of every program that makes one.
    Left to the interpreter's teardown, gloo's threads may outlive the objects that own them:
    the rank then aborts after its last line ("terminate called without an active exception")."""
    if dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group()


def _slices(root: DeviceMesh, mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` may be a sub-mesh of ``root``: its axes are axes of ``root``, of the same
    sizes (a (1, 2) mesh is no slice of a (2, 1) one of the same names), its devices root's."""
    return (
        set(mesh.axis_names) <= set(root.axis_names)
        and all(root.shape[root.axis_position(n)] == n_size for n, n_size in zip(mesh.axis_names, mesh.shape))
        and set(mesh.device_ids) <= set(root.device_ids)
    )


def torch_mesh(mesh: DeviceMesh):
    """The ``torch.distributed.DeviceMesh`` of the group of ``mesh`` that holds this rank. A
    sub-mesh (``mesh["tp"]``) is sliced from the mesh it came from, whose groups every rank
    created together: ranks must never create groups on their own."""
    found = _torch_meshes.get(mesh)
    if found is None:
        _check_initialized(mesh)
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh

        override, world = _group_config(), dist.get_world_size()
        for root, root_torch_mesh in list(_torch_meshes.items()):
            if _slices(root, mesh):
                names = tuple(sorted(mesh.axis_names, key=root.axis_position))
                if names != mesh.axis_names:
                    break  # a sub-mesh with reordered axes: not sliceable from the root
                found = root_torch_mesh[names]
                break
        else:
            ids = torch.tensor(group_ids(mesh), dtype=torch.int).reshape(mesh.shape)
            found = TorchMesh(
                mesh.device_type.split(":")[0],
                ids,
                mesh_dim_names=mesh.axis_names,
                # an axis over the whole world runs on the default group, which has the timeout
                backend_override=tuple([(None, None) if n == world else override for n in mesh.shape]),
            )
        if found is None:
            raise MeshError(
                explain(
                    "fd distributed backend",
                    "a sub-mesh keeps the axis order of the mesh it comes from",
                    expected=f"axes in the order {tuple(sorted(mesh.axis_names))}",
                    got=repr(mesh.axis_names),
                    fix="slice the mesh with its axes in mesh order",
                )
            )
        _torch_meshes[mesh] = found
    return found


def group(mesh: DeviceMesh, axes: tuple[str, ...]) -> dist.ProcessGroup:
    """The process group over ``axes`` (ranks in mesh order) that holds this rank."""
    found = _groups.get((mesh, axes))  # also keyed by the axes as given: no sort on the hot path
    if found is None:
        names = tuple(sorted(axes, key=mesh.axis_position))
        found = _groups.get((mesh, names))
        if found is None:
            tm = torch_mesh(mesh)
            if len(names) == 1:
                found = tm.get_group(names[0])
            else:
                found = tm[names]._flatten(backend_override=_group_config()).get_group()
            _groups[(mesh, names)] = found
            if log.groups.isEnabledFor(logging.INFO):
                log.groups.info(
                    "process group over %s of %s: ranks %s (this rank %d)",
                    ", ".join(names),
                    mesh,
                    dist.get_process_group_ranks(found),
                    dist.get_rank(),
                )
        if not torch.compiler.is_compiling():
            _groups[(mesh, axes)] = found
    return found


def collective_timeout() -> datetime.timedelta:
    """The timeout of the default process group (which every mesh group shares)."""
    if not _timeout:
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            _timeout.append(backend.options._timeout)
        except Exception:  # no CPU backend, or no options to read
            _timeout.append(DEFAULT_TIMEOUT)
    return _timeout[0]


def _group_config():
    """The backend and options of the groups a mesh makes: the default group's backend and its
    timeout (torch would give new groups its own default timeout, 30 minutes: a dead rank of a
    mesh axis would then hang the others for that long)."""
    backend = dist.get_backend()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return (None, None)
    options._timeout = collective_timeout()
    return (backend, options)


def group_ids(mesh: DeviceMesh) -> tuple[int, ...]:
    """The ids of the devices of the group of ``mesh`` that holds this rank, in mesh order."""
    _check_initialized(mesh)
    return _group_ids(mesh, dist.get_rank())


@cached(256)
def _group_ids(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    for ids in mesh.groups:
        if rank in ids:
            return ids
    raise MeshError(
        explain(
            "fd distributed backend",
            f"rank {rank} is not a device of the mesh",
            expected=f"a mesh whose device ids include {rank}",
            got=repr(mesh),
            fix="build the mesh with fd.init_device_mesh(...) in every rank, and slice it there",
        )
    )


def device_index(mesh: DeviceMesh) -> int:
    """This rank's flat (row-major) index in its group of ``mesh``."""
    return group_ids(mesh).index(dist.get_rank())


def coordinate(mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's coordinate in ``mesh``."""
    _check_initialized(mesh)
    return _coordinate(mesh, dist.get_rank())


@cached(256)
def _coordinate(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    return mesh.coordinate(_group_ids(mesh, rank).index(rank))


def group_index(mesh: DeviceMesh, axes: tuple[str, ...]) -> int:
    """This rank's index along ``axes`` (major axis first, in the order given)."""
    here = coordinate(mesh)
    index = 0
    for axis in axes:
        position = mesh.axis_position(axis)
        index = index * mesh.shape[position] + here[position]
    return index


def _check_initialized(mesh: DeviceMesh) -> None:
    if not dist.is_initialized():
        raise MeshError(
            explain(
                "fd distributed backend",
                "the mesh is not backed by an initialized torch.distributed process group",
                expected="a mesh from fd.init_device_mesh under torchrun",
                got=repr(mesh),
                fix="build the mesh with fd.init_device_mesh(...) in every rank",
            )
        )

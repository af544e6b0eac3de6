"""Who takes part in a checkpoint (:mod:`functional_dtensor.checkpoint`): this process alone
(a simulated mesh, or values outside a process group) or every rank, and the few collectives
a save or a load runs between them."""

from __future__ import annotations

import torch.distributed as dist

from ._backend import backend_of
from ._checkpoint_leaves import Leaf
from ._dtensor import DTensor, storage_of
from ._errors import MeshError, explain

__all__ = ["own_devices", "is_collective", "rank_and_world", "barrier", "gathered"]


def own_devices(x: DTensor) -> tuple[int, ...] | None:
    """The devices whose shards this process holds: None for every device of the mesh (the
    simulated backend), else this rank's."""
    _, device = backend_of(x.device_mesh).saved(storage_of(x), x.sharding)
    return None if device is None else (device,)


def is_collective(leaves: list[Leaf], api: str) -> bool:
    """Whether every rank takes part (values on ranks of a process group), or this process
    alone does (values that hold every device, or plain values outside a process group)."""
    held = {own_devices(leaf.value) is None for leaf in leaves if leaf.kind == "dtensor"}
    if len(held) > 1:
        raise MeshError(
            explain(
                api,
                "the state mixes values of a simulated mesh with values on ranks",
                expected="every fd.DTensor of one backend",
                got="both",
                fix="save the simulated values and the distributed ones in two checkpoints",
            )
        )
    if held == {True}:
        return False
    return dist.is_available() and dist.is_initialized()


def rank_and_world(collective: bool) -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)


def barrier(collective: bool) -> None:
    if collective:
        dist.barrier()


def gathered(item, collective: bool) -> list:
    """Every process's ``item`` (this one's alone outside a process group)."""
    if not collective:
        return [item]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out

"""Checkpoints: pytrees of ``fd.DTensor`` values, tensors and Python scalars, saved and loaded
in ``torch.distributed.checkpoint``'s format, resharded on load.

:func:`save` writes a directory in DCP's format: each process writes only the shards it holds
(on the simulated backend every device's distinct shard, from this one process; on the
distributed backend this rank's, replicas written once), beside a manifest of every file's size
and checksum, written last. :func:`load` reads it into new values laid out like ``like``: any
mesh, either backend, any layout, bit-exact. :func:`save_full` and :func:`load_full` keep the
global values in one ``torch.save`` file, a plain state dict.

A save writes into a temporary sibling of ``path`` and moves it into place at the end, so a save
that fails leaves the previous checkpoint as it was; a load checks every file against the
manifest first, so a truncated or corrupted checkpoint is an :class:`fd.CheckpointError` naming
the file.

>>> import tempfile, torch, functional_dtensor as fd
>>> state = {"w": fd.distribute_tensor(torch.arange(10.0), fd.simulated_mesh(2, "x"), fd.P("x")), "step": 3}
>>> like = {"w": fd.zeros(10, mesh=fd.simulated_mesh(4, "x"), placements=fd.P(), device="meta"), "step": 0}
>>> with tempfile.TemporaryDirectory() as tmp:
...     fd.checkpoint.save(f"{tmp}/ckpt", state)
...     loaded = fd.checkpoint.load(f"{tmp}/ckpt", like)
>>> loaded["step"], loaded["w"].placements, loaded["w"].full_tensor().tolist()
(3, (Replicate(),), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
"""

from __future__ import annotations

import os
from pathlib import Path

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ._checkpoint_dcp import Buffers, LoadPlanner, SavePlanner, blocks_of, dcp_failure, quiet_dcp
from ._checkpoint_files import (
    FORMAT,
    MANIFEST,
    VERSION,
    check_target,
    checksum,
    dcp_entries,
    digest,
    move_into_place,
    read_manifest,
    remove,
    siblings,
    verify_dcp_files,
    verify_files,
    write_json,
)
from ._checkpoint_leaves import check_leaf, check_like, leaves_of, plain_tensor
from ._checkpoint_processes import barrier, gathered, is_collective, rank_and_world
from ._dtensor import distribute_tensor
from ._errors import CheckpointError, explain
from ._shard_map import NAMESPACE

__all__ = ["save", "load", "save_full", "load_full", "MANIFEST"]

# --- save ---------------------------------------------------------------------------------------


def save(path: str | os.PathLike, state, /) -> None:
    """Save ``state``, a pytree of ``fd.DTensor`` values, tensors and Python scalars, as a
    checkpoint directory at ``path`` (``torch.distributed.checkpoint``'s format).

    Each process writes the shards it holds: on the simulated backend every device's distinct
    shard, from this process; on the distributed backend this rank's (call it on every rank, as
    a collective; replicas are written once). A Partial value is saved as its global value. A
    value saves as its global tensor: any mesh or layout loads it (:func:`load`).

    The checkpoint is written into a temporary sibling (``.NAME.saving``) and renamed to
    ``path`` at the end (on the distributed backend by rank 0, after every rank has written),
    replacing the checkpoint there: a save that fails leaves it as it was. A manifest of every
    file's size and SHA-256 is written last. ``path`` must be a filesystem path every rank sees.

    Raises :class:`fd.CheckpointError` when the save fails, or when ``path`` holds something
    other than a checkpoint; :class:`fd.InputTypeError` for a leaf it cannot keep.
    """
    api = "fd.checkpoint.save"
    path = Path(path)
    leaves, structure = leaves_of(state, "state", api)
    for leaf in leaves:
        check_leaf(leaf, api)
    collective = is_collective(leaves, api)
    rank, world = rank_and_world(collective)
    check_target(path, api)
    tmp, _ = siblings(path)
    if rank == 0:
        remove(tmp)  # what a save that failed left behind
        path.parent.mkdir(parents=True, exist_ok=True)
    barrier(collective)
    state_dict = {}
    for leaf in leaves:
        if leaf.kind == "dtensor":
            state_dict[leaf.key] = blocks_of(leaf.value)
        else:
            state_dict[leaf.key] = leaf.value.detach() if leaf.kind == "tensor" else leaf.value
    try:
        with quiet_dcp():
            dcp.save(
                state_dict,
                storage_writer=dcp.FileSystemWriter(tmp),
                planner=SavePlanner(),
                no_dist=not collective,
            )
    except CheckpointException as error:
        if rank == 0:
            remove(tmp)
        failure, cause = dcp_failure(error, api, path)
        raise failure from cause
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    mine = {
        name: {"bytes": (tmp / name).stat().st_size, "sha256": digest(tmp / name)}
        for name in files[rank::world]
    }
    checksums = {}
    for part in gathered(mine, collective):
        checksums.update(part)
    failed = None
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "structure": structure,
            "leaves": [
                {
                    "key": leaf.key,
                    "path": leaf.where,
                    "kind": leaf.kind,
                    "shape": leaf.shape,
                    "dtype": leaf.dtype,
                }
                for leaf in leaves
            ],
            "files": checksums,
        }
        try:
            write_json(tmp / MANIFEST, manifest | {"checksum": checksum(manifest)})
            move_into_place(tmp, path)
        except Exception as error:
            failed = error
    verdict = [None if failed is None else f"{type(failed).__name__}: {failed}"]
    if collective:  # every rank returns, or raises, with rank 0
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(
            explain(
                f"{api}({str(path)!r})",
                "writing the manifest or moving the checkpoint into place failed on rank 0",
                expected="the new checkpoint at the path",
                got=verdict[0],
                fix="see the cause; the previous checkpoint is still at the path",
            )
        ) from failed


# --- load ---------------------------------------------------------------------------------------


def load(path: str | os.PathLike, like, /, *, verify: bool = True):
    """The state saved at ``path`` by :func:`save` (or by ``torch.distributed.checkpoint.save``),
    as new values laid out like ``like``.

    ``like`` is a pytree of the saved structure, or of a part of it (it names some of the saved
    leaves: those are loaded), whose leaves say what to build: an ``fd.DTensor`` (a meta value
    is enough: ``fd.zeros(..., device="meta")``) gives the mesh and layout of the value
    returned, on either backend, whatever mesh and layout it was saved from; a tensor gives a
    tensor of its device; any other leaf a Python value, the saved one. (A Partial layout gets
    the value on the first device of each ``Partial("sum")`` axis and zeros on the others; for
    avg, max and min the value on every device.) A value needs a gradient where its ``like``
    leaf does (load a model's parameters like the parameters). Shapes and dtypes must be the
    saved ones. ``like`` is not changed. On the distributed backend call it on every rank: each
    reads only the parts of the files its shards need.

    A directory that ``torch.distributed.checkpoint.save`` wrote (torch ``DTensor`` values,
    tensors, Python values; no manifest) loads the same way: a leaf's key is its path joined
    with dots, as DCP flattens a nested state dict (``like={"model": {"w": ...}}`` reads
    ``"model.w"``), and DCP's metadata gives the shapes and dtypes.

    With ``verify`` (the default) every file is first checked against the manifest (its size
    and SHA-256, the work split over the ranks). A directory torch wrote has no manifest: every
    file DCP's metadata names must be there and as long as it records, and with ``verify``
    each item (a ``torch.save`` archive) must match the CRC-32s of its entries. Raises
    :class:`fd.CheckpointError` for a missing, truncated or corrupted checkpoint (naming the
    file), and for a ``like`` leaf that is not saved or whose shape or dtype differs from the
    saved one (naming the pytree path).
    """
    api = "fd.checkpoint.load"
    path = Path(path)
    leaves, like_structure = leaves_of(like, "like", api)
    collective = is_collective(leaves, api)
    manifest = read_manifest(path, api)
    if manifest is None:  # a directory torch.distributed.checkpoint wrote: DCP's metadata alone
        saved, metadata = dcp_entries(path, api)
        check_like(saved, "", leaves, like_structure, api)
        verify_dcp_files(path, metadata, collective, api, crc=verify)
    else:
        saved = {entry["key"]: entry for entry in manifest["leaves"]}
        check_like(saved, manifest["structure"], leaves, like_structure, api)
        if verify:
            verify_files(path, manifest, collective, api)
    state_dict, buffers = {}, {}
    for leaf in leaves:
        if saved[leaf.key]["kind"] == "object":
            state_dict[leaf.key] = None
        elif leaf.kind == "dtensor":
            buffers[leaf.key] = Buffers(leaf.value)
            state_dict[leaf.key] = buffers[leaf.key].chunks
        else:
            plain_tensor(leaf, api)
            device = "cpu" if leaf.value.is_meta else leaf.value.device
            state_dict[leaf.key] = torch.empty(leaf.value.shape, dtype=leaf.value.dtype, device=device)
    try:
        with quiet_dcp():
            dcp.load(
                state_dict,
                storage_reader=dcp.FileSystemReader(path),
                planner=LoadPlanner(),
                no_dist=not collective,
            )
    except CheckpointException as error:
        failure, cause = dcp_failure(error, api, path)
        raise failure from cause
    values = [buffers[leaf.key].value() if leaf.key in buffers else state_dict[leaf.key] for leaf in leaves]
    return optree.tree_unflatten(optree.tree_structure(like, none_is_leaf=True, namespace=NAMESPACE), values)


# --- full-state files ---------------------------------------------------------------------------


def save_full(path: str | os.PathLike, state, /) -> None:
    """Save ``state`` as one ``torch.save`` file of global values: a flat state dict whose keys
    join each leaf's path with dots (``{"params": {"w": x}}`` -> ``"params.w"``), loadable with
    plain ``torch.load(path, weights_only=True)``.

    Every ``fd.DTensor`` is gathered (on the distributed backend a collective: call it on every
    rank; rank 0 writes). The file is written beside ``path`` and renamed onto it at the end.
    """
    api = "fd.checkpoint.save_full"
    path = Path(path)
    leaves, _ = leaves_of(state, "state", api)
    for leaf in leaves:
        check_leaf(leaf, api)
    collective = is_collective(leaves, api)
    rank, _ = rank_and_world(collective)
    full = {}
    for leaf in leaves:
        if leaf.kind == "dtensor":
            full[leaf.key] = leaf.value.full_tensor().detach()
        else:
            full[leaf.key] = leaf.value.detach() if leaf.kind == "tensor" else leaf.value
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.saving"
        try:
            with open(tmp, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    barrier(collective)


def load_full(path: str | os.PathLike, /, like=None):
    """The state saved by :func:`save_full`: without ``like`` the flat state dict as saved;
    with it, a pytree like ``like``, each ``fd.DTensor`` leaf's value distributed as that leaf
    is (its mesh and layout), each tensor on that leaf's device. Shapes and dtypes must be the
    saved ones (:class:`fd.CheckpointError` names the pytree path otherwise), as must a file
    that ``torch.load`` cannot read."""
    api = "fd.checkpoint.load_full"
    path = Path(path)
    try:
        full = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch reports a damaged zip file in several ways
        raise CheckpointError(
            explain(
                f"{api}({str(path)!r})",
                "the file is missing or not readable",
                expected="a file written by fd.checkpoint.save_full (or torch.save of a state dict)",
                got=f"{type(error).__name__}: {error}",
                fix="check the path; a damaged file cannot be read: load an older one",
            )
        ) from None
    if like is None:
        return full
    leaves, _ = leaves_of(like, "like", api)
    saved = {
        key: {
            "key": key,
            "path": repr(key),
            "kind": "object" if not isinstance(v, torch.Tensor) else "tensor",
            "shape": list(v.shape) if isinstance(v, torch.Tensor) else None,
            "dtype": str(v.dtype) if isinstance(v, torch.Tensor) else None,
        }
        for key, v in full.items()
    }
    check_like(saved, "", leaves, "", api)
    values = []
    for leaf in leaves:
        value = full[leaf.key]
        if leaf.kind == "dtensor":
            value = distribute_tensor(value, leaf.value.device_mesh, leaf.value.sharding)
        elif leaf.kind == "tensor" and not leaf.value.is_meta:
            value = value.to(leaf.value.device)
        values.append(value)
    return optree.tree_unflatten(optree.tree_structure(like, none_is_leaf=True, namespace=NAMESPACE), values)

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

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ._backend import backend_of, is_transformed
from ._dtensor import (
    DTensor,
    check_tensor,
    distribute_tensor,
    from_local,
    new_value,
    storage_of,
    without_partial,
)
from ._errors import CheckpointError, InputTypeError, MeshError, explain
from ._layout import Layout
from ._shard_map import NAMESPACE
from ._sharding import shard_table

__all__ = ["save", "load", "save_full", "load_full", "MANIFEST"]

#: the manifest's file name inside a checkpoint directory
MANIFEST = "fd_checkpoint.json"
_FORMAT = "functional_dtensor.checkpoint"
_VERSION = 1
#: the Python values a checkpoint keeps as leaves (besides tensors and fd.DTensor values)
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


# --- the pytree ---------------------------------------------------------------------------------


class _Leaf:
    """One leaf of a state: its DCP key, its pytree path as code, the value and its kind."""

    __slots__ = ("key", "where", "value", "kind")

    def __init__(self, key: str, where: str, value: Any) -> None:
        self.key, self.where, self.value = key, where, value
        if isinstance(value, DTensor):
            self.kind = "dtensor"
        elif isinstance(value, torch.Tensor):
            self.kind = "tensor"
        else:
            self.kind = "object"

    @property
    def shape(self) -> list[int] | None:
        return None if self.kind == "object" else list(self.value.shape)

    @property
    def dtype(self) -> str | None:
        return None if self.kind == "object" else str(self.value.dtype)


def _leaves(state, root: str, api: str) -> tuple[list[_Leaf], str]:
    """The leaves of ``state`` (named from ``root``, as ``state['params']['w']``) and its
    structure as text. Keys join the path with dots, as a module's state dict does."""
    accessors, values, spec = optree.tree_flatten_with_accessor(state, none_is_leaf=True, namespace=NAMESPACE)
    leaves, seen = [], {}
    for value, accessor in zip(values, accessors):
        where = accessor.codify(root)
        key = ".".join(str(getattr(entry, "entry", entry)) for entry in accessor) or "_"
        if key in seen:
            raise CheckpointError(
                explain(
                    f"{api}({where})",
                    f"two leaves have the same checkpoint key {key!r}",
                    expected="paths that stay distinct when joined with dots",
                    got=f"{seen[key]} and {where}",
                    fix="rename a key so that no path joined with dots equals another",
                )
            )
        seen[key] = where
        leaves.append(_Leaf(key, where, value))
    return leaves, str(spec)


def _plain(leaf: _Leaf, api: str) -> torch.Tensor:
    """A tensor leaf, refused if it is a torch DTensor (not a value of this library)."""
    fix = (
        "make it an fd.DTensor with fd.from_torch(x), "
        "or checkpoint torch DTensors with torch.distributed.checkpoint itself"
    )
    return check_tensor(leaf.value, f"{api}({leaf.where})", torch_dtensor_fix=fix)


def _check_leaf(leaf: _Leaf, api: str) -> None:
    """Raise unless ``leaf`` can be saved: a value outside every transform, with memory."""
    value = leaf.value
    if leaf.kind == "object" and not isinstance(value, _SCALARS):
        raise InputTypeError(
            explain(
                f"{api}({leaf.where})",
                "a checkpoint keeps fd.DTensor values, tensors and Python scalars",
                expected="an fd.DTensor, a torch.Tensor, a number, a string, bytes or None",
                got=type(value).__name__,
                fix="convert it to one of those (a module's state: module.state_dict())",
            )
        )
    if leaf.kind == "object":
        return
    tensor = storage_of(value) if leaf.kind == "dtensor" else _plain(leaf, api)
    if tensor.is_meta:
        raise InputTypeError(
            explain(
                f"{api}({leaf.where})",
                "a meta value has no data to save",
                expected="a value with memory",
                got=repr(value),
                fix="materialize it first (a factory without device='meta'), or leave it out",
            )
        )
    if is_transformed(tensor) or torch.compiler.is_compiling():
        raise InputTypeError(
            explain(
                f"{api}({leaf.where})",
                "a value inside a torch.func transform or torch.compile exists only while it runs",
                expected="a value outside every transform",
                got=repr(value),
                fix="save the values the transformed function returns, outside the transform",
            )
        )


# --- processes ----------------------------------------------------------------------------------


def _own_devices(x: DTensor) -> tuple[int, ...] | None:
    """The devices whose shards this process holds: None for every device of the mesh (the
    simulated backend), else this rank's."""
    _, device = backend_of(x.device_mesh).saved(storage_of(x), x.sharding)
    return None if device is None else (device,)


def _collective(leaves: list[_Leaf], api: str) -> bool:
    """Whether every rank takes part (values on ranks of a process group), or this process
    alone does (values that hold every device, or plain values outside a process group)."""
    held = {_own_devices(leaf.value) is None for leaf in leaves if leaf.kind == "dtensor"}
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


def _rank_and_world(collective: bool) -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)


def _barrier(collective: bool) -> None:
    if collective:
        dist.barrier()


def _gathered(item, collective: bool) -> list:
    """Every process's ``item`` (this one's alone outside a process group)."""
    if not collective:
        return [item]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out


# --- DCP's extension protocol -------------------------------------------------------------------


class _Chunks:
    """The distinct blocks of one global tensor that this process holds, as DCP sees them: the
    protocol torch's DTensor implements (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``). Saving, the blocks are the shards of a value; loading, new
    tensors for DCP to fill."""

    def __init__(self, shape: tuple[int, ...], blocks: dict[tuple[int, ...], torch.Tensor]) -> None:
        self.shape = torch.Size(shape)
        self.blocks = blocks  # global offsets -> block

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.shape),
                    properties=TensorProperties.create_from_tensor(block),
                    size=self.shape,
                ),
            )
            for offsets, block in self.blocks.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=block.shape)
            for offsets, block in self.blocks.items()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.blocks[tuple(index.offset)]


def _blocks_of(x: DTensor) -> _Chunks:
    """The distinct shards of ``x`` this process holds, by global offset (a Partial value is
    reduced first: a checkpoint holds global values)."""
    layout = without_partial(x.sharding)
    if layout != x.sharding:
        x = x.redistribute(layout)
    shape = tuple(x.shape)
    table = shard_table(layout, shape)
    devices = _own_devices(x) or range(layout.mesh.size)
    blocks: dict[tuple[int, ...], torch.Tensor] = {}
    for device, shard in zip(devices, x.local_shards()):
        blocks.setdefault(table.offsets[device], shard.detach())
    return _Chunks(shape, blocks)


class _Buffers:
    """New tensors, one per distinct block that this process holds of a value laid out like
    ``like``, and the value they make once DCP has filled them."""

    def __init__(self, like: DTensor) -> None:
        self.like = like
        self.layout = without_partial(like.sharding)
        mesh, shape = self.layout.mesh, tuple(like.shape)
        table = shard_table(self.layout, shape)
        self.devices = _own_devices(like)
        blocks: dict[tuple[int, ...], torch.Tensor] = {}
        for device in self.devices or range(mesh.size):
            offsets = table.offsets[device]
            if offsets not in blocks:
                blocks[offsets] = torch.empty(
                    table.local_shapes[device], dtype=like.dtype, device=mesh.device_type
                )
        self.offsets = table.offsets
        self.chunks = _Chunks(shape, blocks)

    def value(self) -> DTensor:
        blocks, like = self.chunks.blocks, self.like
        devices = self.devices or range(self.layout.mesh.size)
        shards = [blocks[self.offsets[d]] for d in devices]
        if like.sharding.has_partial:
            shards = [_part(shard, like.sharding, d) for shard, d in zip(shards, devices)]
        elif self.devices is None and len(blocks) == 1:  # replicated: held once
            shards = shards[:1]
        local = shards if len(shards) > 1 else shards[0]
        value = from_local(local, self.layout.mesh, like.sharding, shape=tuple(like.shape), copy=False)
        if not like.requires_grad:
            return value
        # a leaf needing a gradient where the like leaf does (a model's parameters)
        return new_value(storage_of(value).detach().requires_grad_(), value.sharding, value.shape)


def _part(block: torch.Tensor, layout: Layout, device: int) -> torch.Tensor:
    """Device ``device``'s part of ``block`` in a layout with Partial axes, reducing to the block
    exactly: for a sum, the block on the first device of each Partial(sum) axis and zeros
    elsewhere (-0.0 for floats, which adds to any value exactly); for avg, max and min, the block
    itself (an avg rounds as its mean does)."""
    coordinate = layout.mesh.coordinate(device)
    for c, placement in zip(coordinate, layout.placements):
        if placement.is_partial() and placement.op == "sum" and c != 0:
            zero = -0.0 if block.is_floating_point() or block.is_complex() else 0
            return torch.full_like(block, zero)
    return block


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (replicas written once), finding our blocks by offset."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, _Chunks) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (reads every saved chunk that overlaps a block wanted: the
    resharding), filling our blocks by offset; Python values loaded with ``weights_only``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default also turns meta tensors into real ones, and drops objects it does not know
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, _Chunks) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns when it runs in one process; here that is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


def _failure(error: CheckpointException, api: str, path: Path) -> tuple[CheckpointError, BaseException]:
    """DCP's report of the ranks that failed, as our error, and the first failure (its cause)."""
    failures = getattr(error, "failures", {}) or {}
    rank, failure = next(iter(sorted(failures.items())), (None, None))
    cause = failure[0] if isinstance(failure, tuple) else failure
    got = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(error)
    return CheckpointError(
        explain(
            f"{api}({str(path)!r})",
            "torch.distributed.checkpoint failed" + ("" if rank is None else f" on rank {rank}"),
            expected="every process to write (or read) its part",
            got=got,
            fix="see the cause above; a failed save leaves the previous checkpoint at the path",
        )
    ), (cause if isinstance(cause, BaseException) else error)


# --- files, checksums, the atomic move ----------------------------------------------------------


def _digest(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _checksum(manifest: dict) -> str:
    """The SHA-256 of a manifest's content (its own checksum left out)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd_ = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(fd_)
    finally:
        os.close(fd_)


def _siblings(path: Path) -> tuple[Path, Path]:
    """The temporary directory a save writes into, and where the previous checkpoint waits
    while the new one moves into place."""
    return path.parent / f".{path.name}.saving", path.parent / f".{path.name}.previous"


def _check_target(path: Path, api: str) -> None:
    """Refuse to replace something that is not a checkpoint (a file, a directory of other files)."""
    if not path.exists() or (path.is_dir() and ((path / MANIFEST).exists() or not any(path.iterdir()))):
        return
    raise CheckpointError(
        explain(
            f"{api}(path={str(path)!r})",
            "the path holds something that is not a checkpoint",
            expected="a new path, an empty directory or a checkpoint to replace",
            got="a file" if not path.is_dir() else "a directory without " + MANIFEST,
            fix="choose another path, or remove what is there",
        )
    )


def _move_into_place(tmp: Path, path: Path) -> None:
    """``tmp`` becomes ``path``; the checkpoint there before is removed once it has."""
    _, previous = _siblings(path)
    _remove(previous)
    if path.exists():
        os.replace(path, previous)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _remove(previous)


def _write_json(file: Path, content: dict) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


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
    leaves, structure = _leaves(state, "state", api)
    for leaf in leaves:
        _check_leaf(leaf, api)
    collective = _collective(leaves, api)
    rank, world = _rank_and_world(collective)
    _check_target(path, api)
    tmp, _ = _siblings(path)
    if rank == 0:
        _remove(tmp)  # what a save that failed left behind
        path.parent.mkdir(parents=True, exist_ok=True)
    _barrier(collective)
    state_dict = {}
    for leaf in leaves:
        if leaf.kind == "dtensor":
            state_dict[leaf.key] = _blocks_of(leaf.value)
        else:
            state_dict[leaf.key] = leaf.value.detach() if leaf.kind == "tensor" else leaf.value
    try:
        with _quiet_dcp():
            dcp.save(
                state_dict,
                storage_writer=dcp.FileSystemWriter(tmp),
                planner=_SavePlanner(),
                no_dist=not collective,
            )
    except CheckpointException as error:
        if rank == 0:
            _remove(tmp)
        failure, cause = _failure(error, api, path)
        raise failure from cause
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    mine = {
        name: {"bytes": (tmp / name).stat().st_size, "sha256": _digest(tmp / name)}
        for name in files[rank::world]
    }
    checksums = {}
    for part in _gathered(mine, collective):
        checksums.update(part)
    failed = None
    if rank == 0:
        manifest = {
            "format": _FORMAT,
            "version": _VERSION,
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
            _write_json(tmp / MANIFEST, manifest | {"checksum": _checksum(manifest)})
            _move_into_place(tmp, path)
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


def _read_manifest(path: Path, api: str) -> dict:
    where = f"{api}({str(path)!r})"
    file = path / MANIFEST
    if not file.is_file():
        _, previous = _siblings(path)
        if not path.exists():
            what, got = "no checkpoint at this path", "nothing there"
            fix = "check the path"
            if previous.exists():
                got += f", but {previous.name} beside it"
                fix = f"a save was interrupted while replacing the checkpoint: load {previous}"
        else:
            what, got = f"the checkpoint has no manifest ({MANIFEST})", "a directory without it"
            fix = (
                "load a checkpoint written by fd.checkpoint.save (the manifest is written last: "
                "a save that did not finish has none)"
            )
        raise CheckpointError(explain(where, what, expected=f"a directory with {MANIFEST}", got=got, fix=fix))
    try:
        manifest = json.loads(file.read_text("utf-8"))
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        if manifest.get("checksum") != _checksum(manifest):
            raise ValueError("its SHA-256 differs from the one written")
        return manifest
    except (ValueError, AttributeError) as error:
        raise CheckpointError(
            explain(
                where,
                f"the manifest {file} is not readable",
                expected=f"the JSON manifest of fd.checkpoint (format {_FORMAT!r})",
                got=f"{type(error).__name__}: {error}",
                fix="the checkpoint is corrupted: load an older one",
            )
        ) from None


def _file_problem(path: Path, name: str, expected: dict) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        state = "truncated" if size < expected["bytes"] else "longer than written"
        return f"{file} is {state}: {size} bytes, written {expected['bytes']}"
    if _digest(file) != expected["sha256"]:
        return f"{file} is corrupted: its SHA-256 differs from the one written"
    return None


def _verify(path: Path, manifest: dict, collective: bool, api: str) -> None:
    """Every file the manifest lists, checked (split over the ranks)."""
    rank, world = _rank_and_world(collective)
    names = sorted(manifest["files"])
    mine = [p for n in names[rank::world] if (p := _file_problem(path, n, manifest["files"][n]))]
    problems = [p for part in _gathered(mine, collective) for p in part]
    if problems:
        raise CheckpointError(
            explain(
                f"{api}({str(path)!r})",
                problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                expected="every file as the manifest records it (size and SHA-256)",
                got="; ".join(problems),
                fix="the checkpoint is damaged: load an older one, or save again",
            )
        )


def _mismatch(api: str, where: str, what: str, expected: str, got: str) -> CheckpointError:
    return CheckpointError(
        explain(
            f"{api}({where})",
            what,
            expected=expected,
            got=got,
            fix="pass a like with the structure, shapes and dtypes of the saved state "
            "(its layouts and meshes may differ)",
        )
    )


def _check_like(saved: dict, structure: str, leaves: list[_Leaf], like_structure: str, api: str) -> None:
    """Raise unless ``like``'s leaves are the saved ones, with their kinds, shapes and dtypes."""
    wanted = {leaf.key: leaf for leaf in leaves}
    for leaf in leaves:
        if leaf.key not in saved:
            raise _mismatch(
                api,
                leaf.where,
                "the checkpoint has no such leaf",
                "one of the saved leaves " + ", ".join(e["path"] for e in saved.values()),
                f"{leaf.where}",
            )
    for entry in saved.values():
        if entry["key"] not in wanted:
            raise _mismatch(
                api,
                "like",
                f"like has no leaf at {entry['path']}",
                "a leaf for every saved one",
                f"none at {entry['path']}",
            )
    if structure != like_structure:
        raise _mismatch(api, "like", "the containers differ", structure, like_structure)
    for leaf in leaves:
        entry = saved[leaf.key]
        is_tensor, saved_tensor = leaf.kind != "object", entry["kind"] != "object"
        if is_tensor != saved_tensor:
            raise _mismatch(
                api,
                leaf.where,
                "a tensor where the checkpoint has a Python value, or the reverse",
                "a tensor" if saved_tensor else "a Python value",
                "a tensor" if is_tensor else type(leaf.value).__name__,
            )
        if is_tensor and entry["shape"] != leaf.shape:
            raise _mismatch(
                api, leaf.where, "the shape differs", f"shape {tuple(entry['shape'])}", f"{tuple(leaf.shape)}"
            )
        if is_tensor and entry["dtype"] != leaf.dtype:
            raise _mismatch(api, leaf.where, "the dtype differs", entry["dtype"], leaf.dtype)


def load(path: str | os.PathLike, like, /, *, verify: bool = True):
    """The state saved at ``path`` by :func:`save`, as new values laid out like ``like``.

    ``like`` is a pytree of the saved structure whose leaves say what to build: an
    ``fd.DTensor`` (a meta value is enough: ``fd.zeros(..., device="meta")``) gives the mesh and
    layout of the value returned, on either backend, whatever mesh and layout it was saved from;
    a tensor gives a tensor of its device; any other leaf a Python value, the saved one. (A
    Partial layout gets the value on the first device of each ``Partial("sum")`` axis and zeros
    on the others; for avg, max and min the value on every device.) A value needs a gradient
    where its ``like`` leaf does (load a model's parameters like the parameters). Shapes and
    dtypes must be the saved ones. ``like`` is not changed. On the distributed backend call
    it on every rank: each reads only the parts of the files its shards need.

    With ``verify`` (the default) every file is first checked against the manifest (its size
    and SHA-256, the work split over the ranks). Raises :class:`fd.CheckpointError` for a
    missing, truncated or corrupted checkpoint (naming the file), and for a ``like`` whose
    structure, shapes or dtypes differ from the saved state (naming the pytree path).
    """
    api = "fd.checkpoint.load"
    path = Path(path)
    leaves, like_structure = _leaves(like, "like", api)
    collective = _collective(leaves, api)
    manifest = _read_manifest(path, api)
    saved = {entry["key"]: entry for entry in manifest["leaves"]}
    _check_like(saved, manifest["structure"], leaves, like_structure, api)
    if verify:
        _verify(path, manifest, collective, api)
    state_dict, buffers = {}, {}
    for leaf in leaves:
        if saved[leaf.key]["kind"] == "object":
            state_dict[leaf.key] = None
        elif leaf.kind == "dtensor":
            buffers[leaf.key] = _Buffers(leaf.value)
            state_dict[leaf.key] = buffers[leaf.key].chunks
        else:
            _plain(leaf, api)
            device = "cpu" if leaf.value.is_meta else leaf.value.device
            state_dict[leaf.key] = torch.empty(leaf.value.shape, dtype=leaf.value.dtype, device=device)
    try:
        with _quiet_dcp():
            dcp.load(
                state_dict,
                storage_reader=dcp.FileSystemReader(path),
                planner=_LoadPlanner(),
                no_dist=not collective,
            )
    except CheckpointException as error:
        failure, cause = _failure(error, api, path)
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
    leaves, _ = _leaves(state, "state", api)
    for leaf in leaves:
        _check_leaf(leaf, api)
    collective = _collective(leaves, api)
    rank, _ = _rank_and_world(collective)
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
    _barrier(collective)


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
    leaves, _ = _leaves(like, "like", api)
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
    _check_like(saved, "", leaves, "", api)
    values = []
    for leaf in leaves:
        value = full[leaf.key]
        if leaf.kind == "dtensor":
            value = distribute_tensor(value, leaf.value.device_mesh, leaf.value.sharding)
        elif leaf.kind == "tensor" and not leaf.value.is_meta:
            value = value.to(leaf.value.device)
        values.append(value)
    return optree.tree_unflatten(optree.tree_structure(like, none_is_leaf=True, namespace=NAMESPACE), values)

"""A checkpoint's values as ``torch.distributed.checkpoint`` sees them
(:mod:`functional_dtensor.checkpoint`): the blocks this process holds, through DCP's extension
protocol (the one torch's DTensor implements); the buffers a load fills; DCP's planners, its
warnings and its failures."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ._checkpoint_processes import own_devices
from ._dtensor import DTensor, from_local, new_value, storage_of, without_partial
from ._errors import CheckpointError, explain
from ._layout import Layout
from ._sharding import shard_table

__all__ = ["Chunks", "blocks_of", "Buffers", "SavePlanner", "LoadPlanner", "quiet_dcp", "dcp_failure"]

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class Chunks:
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


def blocks_of(x: DTensor) -> Chunks:
    """The distinct shards of ``x`` this process holds, by global offset (a Partial value is
    reduced first: a checkpoint holds global values)."""
    layout = without_partial(x.sharding)
    if layout != x.sharding:
        x = x.redistribute(layout)
    shape = tuple(x.shape)
    table = shard_table(layout, shape)
    devices = own_devices(x) or range(layout.mesh.size)
    blocks: dict[tuple[int, ...], torch.Tensor] = {}
    for device, shard in zip(devices, x.local_shards()):
        blocks.setdefault(table.offsets[device], shard.detach())
    return Chunks(shape, blocks)


class Buffers:
    """New tensors, one per distinct block that this process holds of a value laid out like
    ``like``, and the value they make once DCP has filled them."""

    def __init__(self, like: DTensor) -> None:
        self.like = like
        self.layout = without_partial(like.sharding)
        mesh, shape = self.layout.mesh, tuple(like.shape)
        table = shard_table(self.layout, shape)
        self.devices = own_devices(like)
        blocks: dict[tuple[int, ...], torch.Tensor] = {}
        for device in self.devices or range(mesh.size):
            offsets = table.offsets[device]
            if offsets not in blocks:
                blocks[offsets] = torch.empty(
                    table.local_shapes[device], dtype=like.dtype, device=mesh.device_type
                )
        self.offsets = table.offsets
        self.chunks = Chunks(shape, blocks)

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


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (replicas written once), finding our blocks by offset."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
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
        return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns when it runs in one process; here that is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


def dcp_failure(error: CheckpointException, api: str, path: Path) -> tuple[CheckpointError, BaseException]:
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

"""The backend interface: the one place that asks which backend a mesh has.

``backend_of(mesh)`` returns the mesh's :class:`Backend`, which offers the layers above
everything that differs between running every device in this process (``simulated``: each value
is the stack of all devices' shards) and one process per device (``distributed``: each value is
this rank's shard):

* **storage**: a global value to and from its storage (``distribute``, ``gather``), the shards
  this process holds, storage from local shards, a factory's storage;
* **kernels**, on storage: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
  ``permute``, ``reduce_broadcast``, ``axis_index``, ``slice``, ``partition``;
* the **per-device engine** of ``shard_map``: running the per-device function, a collective on a
  per-device value, a torch op of the per-device function.

Communication is recorded here and nowhere else (:meth:`Backend.count`): every kernel that
moves data between devices, the regathering of a value that ``redistribute`` falls back to, and
``full_tensor()`` (as the distributed backend moves it, on either backend, as torch counts it).
The gradient of a global tensor given to ``distribute_tensor`` or ``shard_map`` is not counted.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from . import _comm_log as comm_log
from ._cache import cached
from ._distributed import engine as distributed_engine
from ._distributed import kernels as distributed_kernels
from ._distributed import runtime as distributed_runtime
from ._distributed import storage as distributed_storage
from ._errors import InputTypeError, LayoutError, ShapeError, explain
from ._functorch import current_level, is_transformed, memory_of
from ._layout import Layout
from ._mesh import DeviceMesh
from ._op_args import quiet_if
from ._placements import Partial, Shard
from ._sharding import check_rank, global_shape_of_local, shard_table
from ._simulated import batched as simulated_batched
from ._simulated import crossed as simulated_crossed
from ._simulated import engine as simulated_engine
from ._simulated import kernels as simulated_kernels
from ._simulated import losses as simulated_losses
from ._simulated import storage as simulated_storage

__all__ = ["Backend", "backend_of", "current_level", "is_transformed", "memory_of"]


class Backend:
    """One backend: its storage, kernels and per-device engine behind one set of methods."""

    def __init__(
        self, name: str, storage: ModuleType, kernels: ModuleType, engine: ModuleType, *, stacked: bool
    ):
        self.name = name
        self.stacked = stacked  # storage carries a leading dim over this process's devices
        # every device of a mesh runs in this process (collectives run where the values lie)
        self.one_process = stacked
        # a value the same on every device may be held once, not per device
        self.holds_replicas_once = stacked
        self._storage, self._kernels, self._engine = storage, kernels, engine
        # the per-device engine, as it is
        self.run_per_device = engine.run_per_device
        self.apply = engine.apply
        self.apply_to_storage = engine.apply_to_storage
        self.run_op = engine.run_op
        self.ruled_ops = engine.RULED_OPS  # the ops run_op runs otherwise than as they are
        self.ops_mode = engine.ops_mode
        self.leave = engine.leave
        self.axis_index_per_device = engine.axis_index

    def __repr__(self) -> str:
        return f"<{self.name} backend>"

    # --- communication, recorded here -------------------------------------------------------

    def count(self, op: str, axes: tuple[str, ...], x: torch.Tensor, group_size: int) -> None:
        """Record ``op`` over mesh ``axes`` (a group of ``group_size`` devices) on the
        storage-form value ``x`` (the bytes each device contributes; while compiling, recorded
        when the compiled graph runs)."""
        if comm_log.wanted():
            devices = x.shape[0] if self.stacked and x.dim() else 1
            comm_log.record(op, axes, x.numel() // max(devices, 1) * x.element_size(), group_size)

    def count_bytes(self, op: str, axes: tuple[str, ...], nbytes: int, group_size: int) -> None:
        """Record ``op`` over mesh ``axes`` (``group_size`` devices) on ``nbytes`` per device."""
        if comm_log.wanted():
            comm_log.record(op, axes, nbytes, group_size)

    # --- kernels, on storage ----------------------------------------------------------------

    # A group of one device (axes of size 1) communicates nothing: each kernel's local form
    # runs instead, on a copy (a collective returns a new tensor), and nothing is counted.

    def all_reduce(
        self, x, mesh: DeviceMesh, axes: tuple[str, ...], op: str = "sum", *, counted: bool = True
    ):
        """(``counted=False``: the caller records it, as part of one bucketed collective.)"""
        if mesh.axis_size(axes) == 1:
            return x.clone()
        if counted:
            self.count("all_reduce", axes, x, mesh.axis_size(axes))
        return self._kernels.all_reduce(x, mesh, axes, op)

    def all_gather(self, x, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool, *, counted=True):
        if mesh.axis_size(axes) == 1:
            return x.clone() if tiled else x.unsqueeze(self._lead + dim).clone()
        if counted:
            self.count("all_gather", axes, x, mesh.axis_size(axes))
        return self._kernels.all_gather(x, mesh, axes, dim, tiled)

    # On blocks held once (simulated only: see held_plan), on their ``grid``, each distinct
    # result once; the transposes count what the distributed backend's communicate.

    def all_reduce_held(self, held, grid: tuple[int, ...], mesh: DeviceMesh, axes: tuple[str, ...]):
        """A sum over ``axes``."""
        self.count("all_reduce", axes, held, mesh.axis_size(axes))
        return self._kernels.all_reduce_held(held, grid, mesh, axes, "sum")

    def spread_held(self, held, grid: tuple[int, ...], mesh: DeviceMesh, axes: tuple[str, ...]):
        """:meth:`all_reduce_held`'s transpose: each result for every part (no communication)."""
        return self._kernels.spread_held(held, grid, mesh, axes)

    def all_gather_held(
        self, held, grid: tuple[int, ...], mesh: DeviceMesh, axes: tuple[str, ...], dim: int, *, counted=True
    ):
        """A tiled all-gather over one axis (``counted=False``: the caller records it, as part
        of one bucketed collective)."""
        if counted:
            self.count("all_gather", axes, held, mesh.axis_size(axes))
        return self._kernels.all_gather_held(held, grid, mesh, axes, dim)

    def slice_held(
        self, held, grid, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, summed: bool, *, counted=True
    ):
        """:meth:`all_gather_held`'s transpose: each device's slice; ``summed``: of a cotangent
        whose parts the distributed backend sums in a reduce-scatter (a varied value's;
        ``counted=False``: the caller records it)."""
        if summed and counted:
            self.count("reduce_scatter", axes, held, mesh.axis_size(axes))
        return self._kernels.slice_held(held, grid, mesh, axes, dim)

    def count_gathered(self, gathered, mesh: DeviceMesh, axes: tuple[str, ...], summed, transposed):
        """Count what :meth:`all_gather_held` (``transposed``: :meth:`slice_held`) counts, for
        held blocks that a product wrote gathered already (:meth:`gathered_linear`)."""
        size = mesh.axis_size(axes)
        if transposed:
            if summed:
                self.count("reduce_scatter", axes, gathered, size)
        else:
            per_device = gathered.numel() // max(gathered.shape[0], 1) // size * gathered.element_size()
            self.count_bytes("all_gather", axes, per_device, size)

    def count_reduced(self, summed, mesh: DeviceMesh, axes: tuple[str, ...], transposed) -> None:
        """Count what :meth:`all_reduce_held` counts (``transposed``: :meth:`spread_held`,
        nothing), for held blocks that products wrote summed already (:meth:`reduced_linear`)."""
        if not transposed:
            self.count("all_reduce", axes, summed, mesh.axis_size(axes))

    def gathered_linear(self, x_held, weight, mesh: DeviceMesh, axis: str):
        """A column-parallel linear's product and the all-gather of its output over ``axis`` at
        once, from the input's blocks held once over ``axis`` (a backend that holds replicas
        once; see :func:`._simulated.batched.gathered_linear`). Nothing is counted here."""
        return simulated_batched.gathered_linear(x_held, weight, mesh, axis)

    def folded_linear(self, x, weight_rows, bias_rows, mesh_shape, axes: tuple[int, ...]):
        """``F.linear`` per device where each device's weight block (and bias) is one of the
        rows held once along ``axes`` (positions) and ``x`` is stacked: the devices along
        ``axes`` lay their rows end to end, one product per held block (see
        :func:`._simulated.batched.folded_linear`). Nothing is counted here."""
        return simulated_batched.folded_linear(x, weight_rows, bias_rows, mesh_shape, axes)

    def crossed_linear(self, x, weight_rows, bias_rows, x_outer: bool, x_held: bool):
        """``F.linear`` per device where the weight (and bias) is held once along the axes that
        split ``x`` by rows, and ``x`` is stacked or held once along all the others: one
        product per outer position, no operand copied to the devices that share it (see
        :func:`._simulated.crossed.crossed_linear`). Nothing is counted here."""
        return simulated_crossed.crossed_linear(x, weight_rows, bias_rows, x_outer, x_held)

    def reduced_linear(self, x, weight_rows, bias_rows, x_outer: bool):
        """A row-parallel linear's products summed over the devices that split its weight (its
        all-reduce, or the sum its reduce-scatter cuts), where the weight (and the bias's parts)
        is held once along the axes that split the stacked ``x`` by rows: one sum per position
        along those, written by the products as they are summed (see
        :func:`._simulated.crossed.reduced_linear`). Nothing is counted here."""
        return simulated_crossed.reduced_linear(x, weight_rows, bias_rows, x_outer)

    def cross_entropy_parts(
        self, logits, target, mesh: DeviceMesh, axis: str, ignore_index: int, reduction: str
    ):
        """Every device's part of a cross-entropy whose class dim is split evenly over ``axis``
        and whose rows are split over the other axes, in a few kernels on the grid of the
        devices' blocks (a backend that holds them all; see
        :func:`._simulated.losses.cross_entropy_parts`); None on one that holds one rank's
        block. Nothing is counted here."""
        if not self.stacked:
            return None
        position = mesh.axis_position(axis)
        return simulated_losses.cross_entropy_parts(
            logits, target, mesh.shape, position, ignore_index, reduction
        )

    def end_to_end(self, rows, mesh: DeviceMesh, axis: str):
        """Every device's rows laid end to end along ``axis``, one per position along the other
        axes (the gathered bias of :meth:`gathered_linear`; not counted)."""
        return self._kernels.all_gather_held(rows, mesh.shape, mesh, (axis,), 0)

    def count_held_psum(self, held, mesh: DeviceMesh, axes: tuple[str, ...]) -> None:
        """Count the all-reduce of a held cotangent's parts that the distributed backend runs
        (a held one is their sum already)."""
        self.count("all_reduce", axes, held, mesh.axis_size(axes))

    def reduce_scatter(
        self, x, mesh: DeviceMesh, axes: tuple[str, ...], dim: int, tiled: bool, *, counted=True
    ):
        if mesh.axis_size(axes) == 1:
            return x.clone() if tiled else x.squeeze(self._lead + dim).clone()
        if counted:
            self.count("reduce_scatter", axes, x, mesh.axis_size(axes))
        return self._kernels.reduce_scatter(x, mesh, axes, dim, tiled)

    def all_to_all(self, x, mesh: DeviceMesh, axes: tuple[str, ...], split: int, concat: int, tiled: bool):
        if mesh.axis_size(axes) == 1:
            return x.clone() if tiled else x.movedim(self._lead + split, self._lead + concat).clone()
        self.count("all_to_all", axes, x, mesh.axis_size(axes))
        return self._kernels.all_to_all(x, mesh, axes, split, concat, tiled)

    def permute(self, x, mesh: DeviceMesh, axes: tuple[str, ...], perm: tuple[tuple[int, int], ...]):
        if mesh.axis_size(axes) == 1:
            return x.clone() if perm else torch.zeros_like(x)
        self.count("ppermute", axes, x, mesh.axis_size(axes))
        return self._kernels.permute(x, mesh, axes, perm)

    @property
    def _lead(self) -> int:
        """The dims before a block's own in storage form (the device dim, when stacked)."""
        return 1 if self.stacked else 0

    def block_dim(self, dim: int) -> int:
        """The storage dim of dim ``dim`` (counted from 0) of a device's block."""
        return self._lead + dim

    def reduce_broadcast(self, x, mesh: DeviceMesh, a: int, b: int, op: str):
        """Partial(op) on mesh axis ``a`` and Shard on axis ``b`` (equal sizes) -> Shard on
        ``a`` and Replicate on ``b``: a reduce to the diagonal, a broadcast from it."""
        self.count("reduce+broadcast", (mesh.axis_names[a], mesh.axis_names[b]), x, mesh.shape[a])
        return self._kernels.reduce_broadcast(x, mesh, a, b, op)

    def axis_index(self, mesh: DeviceMesh, axes: tuple[str, ...], device) -> torch.Tensor:
        """Each device's index along ``axes`` (major first), in storage form."""
        return self._kernels.axis_index(mesh, axes, device)

    def slice(self, x, mesh: DeviceMesh, axes: tuple[str, ...], dim: int):
        """Each device keeps its block of dim ``dim``, by its index along ``axes``: local."""
        return self._kernels.slice_blocks(x, mesh, axes, dim)

    def partition(self, x, mesh: DeviceMesh, axes: tuple[str, ...], op: str):
        """Each device's part of a value replicated along ``axes``, to be reduced by ``op``."""
        return self._kernels.partition(x, mesh, axes, op)

    # --- global ops' local forms -------------------------------------------------------------

    def run_local(self, local, batched: str | None, func, args, kwargs, ctx, storages=None, held=None):
        """An op's local form ``local(func, args, kwargs, ctx)`` -- plain torch on one device's
        block -- on this process's storage: on the distributed backend on this rank's shard; on
        the simulated one by its ``batched`` form on every device's block at once, or device by
        device (:mod:`._simulated.batched`). ``storages``: the inputs' storages among the
        arguments, in the decision's order (None: every tensor among ``args``); ``held``: they
        are blocks held once by this plan (``ctx.held``), and so is the output."""
        if self.stacked:
            return simulated_batched.run_local(local, batched, func, args, kwargs, ctx, storages, held)
        if ctx.even:
            return local(func, args, kwargs, ctx)
        empty = any([isinstance(a, torch.Tensor) and not a.numel() for a in (*args, *kwargs.values())])
        return quiet_if(empty, local, func, args, kwargs, ctx)

    def device_index(self, mesh: DeviceMesh) -> int | None:
        """The device (flat mesh index) whose block a local form runs on: this rank's on the
        distributed backend; None on the simulated one, which runs it on every device's."""
        return None if self.stacked else distributed_runtime.device_index(mesh)

    # --- storage ----------------------------------------------------------------------------

    def distribute(self, tensor: torch.Tensor, layout: Layout, *, copy: bool = False) -> torch.Tensor:
        """The storage of the global ``tensor`` laid out by ``layout`` (no communication;
        ``copy``: sharing no memory with ``tensor``)."""
        return self._storage.distribute(tensor, layout, copy=copy)

    def gather(self, storage: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
        """The global value of ``storage`` (on the distributed backend, gathered from every
        rank: not counted as communication, as it moves no data on the simulated backend). A
        meta value's is a meta tensor, with no communication."""
        if storage.is_meta:
            return torch.empty(shape, dtype=storage.dtype, device="meta")
        return self._storage.gather(storage, layout, shape)

    def regather(self, storage: torch.Tensor, source: Layout, target: Layout, shape: tuple[int, ...]):
        """The storage in ``target`` of a value stored in ``source``, through the global value:
        the padded blocks reduced over each Partial axis and gathered over the Shard axes (as
        the distributed backend runs it; counted so on either backend)."""
        self.count_gather(source, shape, storage.element_size())
        return self._storage.distribute(self._storage.gather(storage, source, shape), target)

    def count_gather(self, source: Layout, shape: tuple[int, ...], itemsize: int) -> None:
        """Record reading the global value of a value in ``source`` as the distributed backend
        moves it (the padded blocks reduced over each Partial axis, gathered over the Shard
        axes), on either backend: ``full_tensor()`` counts as torch's does."""
        if not comm_log.wanted():
            return
        mesh = source.mesh
        nbytes = math.prod(shard_table(source, shape).padded_shape) * itemsize
        moving = [(n, p) for n, p, size in zip(mesh.axis_names, source.placements, mesh.shape) if size > 1]
        for name, placement in moving:  # an axis of one device moves nothing
            if isinstance(placement, Partial):
                self.count_bytes("all_reduce", (name,), nbytes, mesh.axis_size((name,)))
        sharding = tuple([n for n, p in moving if isinstance(p, Shard)])
        if sharding:
            self.count_bytes("all_gather", sharding, nbytes, mesh.axis_size(sharding))

    def padded(self, storage, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
        """Every local block at the layout's padded block shape (zeros appended)."""
        return self._storage.padded(storage, layout, shape)

    def unpadded(self, storage, layout: Layout, shape: tuple[int, ...]) -> torch.Tensor:
        """The storage, in ``layout``, of local blocks at its padded block shape."""
        return self._storage.unpadded(storage, layout, shape)

    def splits_as_views(self, layout: Layout, shape: tuple[int, ...]) -> bool:
        """Whether storage and global value are views of each other (then their own autograd
        carries the right gradients)."""
        return self._storage.splits_as_views(layout, shape)

    def shard(self, storage, layout: Layout, shape: tuple[int, ...], device) -> torch.Tensor:
        """One device's shard, unpadded."""
        return self._storage.shard(storage, layout, shape, device)

    def shards(self, storage, layout: Layout, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The shards this process holds, unpadded, in flat mesh order."""
        return self._storage.shards(storage, layout, shape)

    def from_local(self, shards, layout: Layout, shape, *, run_check: bool, copy: bool, where: str):
        """Storage and global shape from local shards, checked against the layout. Without
        ``shape``, or with ``run_check``, every process sees every device's shard metadata and
        reaches the same verdict (``run_check``: and compares values along Replicate axes);
        ``copy``: the storage shares no memory with the shards."""
        if shape is None or run_check:
            infos = self._storage.shard_infos(shards, layout, where=where)
            shape = _agreed_shape(infos, layout, shape, run_check, where)
        storage = self._storage.from_local(shards, layout, shape, copy=copy, where=where)
        differing = self._storage.differing_replicas(storage, layout) if run_check else []
        if differing:
            raise LayoutError(
                explain(
                    f"{where}(local_tensor)",
                    f"shards differ along mesh axis {differing[0]!r}, placed Replicate",
                    expected="equal shards on every device of a Replicate axis",
                    got="different values",
                    fix="pass equal shards, or place that axis fd.Partial / fd.Shard",
                )
            )
        return storage, shape

    def saved(self, storage: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, int | None]:
        """What a saved value keeps of ``storage``: the shards this process holds (detached),
        and the device they belong to (None where they are every device's)."""
        return self._storage.saved(storage, layout)

    def restored(self, storage: torch.Tensor, layout: Layout, shape: tuple[int, ...], device: int | None):
        """The storage of a loaded value, checked against the layout and this process (a
        distributed value loads on the device that saved it, in a world of the same size)."""
        return self._storage.restored(storage, layout, shape, device)

    def materialize(self, layout: Layout, shape: tuple[int, ...], make_blocks) -> torch.Tensor:
        """A factory's storage from ``make_blocks(block_shape, shard)``: the padded blocks of
        every distinct shard (``shard`` None, a grid) or of this rank's distinct shard."""
        return self._storage.materialize(layout, shape, make_blocks)

    def meta(self, layout: Layout, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """The storage of a meta value: its blocks' shapes and dtype, with no memory."""
        return self._storage.materialize(
            layout, shape, lambda block_shape, shard: torch.empty(block_shape, dtype=dtype, device="meta")
        )

    def from_source(self, tensor: torch.Tensor, mesh: DeviceMesh, src: int) -> torch.Tensor:
        """The global tensor as the device at index ``src`` of every mesh axis passed it (the
        distributed backend broadcasts it, counted; in one process every device passed the
        same tensor)."""
        if self.stacked or (not torch.compiler.is_compiling() and is_transformed(tensor)):
            return tensor  # one process's tensor; or a transform's, which no collective takes
        for name, size in zip(mesh.axis_names, mesh.shape):
            if size > 1:
                self.count_bytes("broadcast", (name,), tensor.numel() * tensor.element_size(), size)
        return self._storage.from_source(tensor, mesh, src)

    def replica(self, storage: torch.Tensor) -> torch.Tensor:
        """This process's one copy of a replicated value (the devices' copies are equal; the
        gradient of each is the one computed on it)."""
        return self._storage.replica(storage)

    def replicated(self, tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The storage, in the replicated ``layout``, of the value ``tensor`` computed once by
        this process for its devices (the inverse of :meth:`replica`)."""
        return self._storage.replicated(tensor, layout)

    @property
    def held_min_elements(self) -> int:
        """The elements of a block from which a value is worth holding once (see
        :meth:`held_plan`; none on the distributed backend)."""
        return self._storage.HELD_MIN_ELEMENTS if self.stacked else math.inf

    def holds(self, layout: Layout, shape: tuple[int, ...]) -> bool:
        """Whether a value of ``shape`` moved into ``layout`` is worth holding once: its
        blocks are large enough."""
        return math.prod(shard_table(layout, shape).padded_shape) >= self.held_min_elements

    def held_plan(self, layout: Layout):
        """How a value in ``layout`` is held once along its Replicate axes, one block per
        distinct shard (see :mod:`._simulated.storage`): None where it is not (no axis of more
        than one device replicates it; or the distributed backend, where a rank holds one
        block anyway)."""
        return self._storage.held_plan(layout) if self.stacked else None

    def fold(self, storage: torch.Tensor, layout: Layout, plan, summed: tuple[int, ...] = ()) -> torch.Tensor:
        """The held blocks of ``storage`` (by :meth:`held_plan`'s ``plan`` for ``layout``);
        ``summed``: the mesh axes (positions) along which the value is varied (see
        :mod:`._varied`): its held cotangent is the sum of the devices' parts there."""
        return self._storage.fold(storage, layout, plan, summed)

    def unfold(
        self, held: torch.Tensor, layout: Layout, summed: tuple[int, ...] = (), *, parts: bool = False
    ) -> torch.Tensor:
        """Every device's block of a value held once (the inverse of :meth:`fold`); with
        ``parts``, parts of it along the ``summed`` axes (their sum is the value)."""
        return self._storage.unfold(held, layout, summed, parts=parts)

    def block_shape(self, storage: torch.Tensor) -> tuple[int, ...]:
        """The shape of one device's (padded) block in ``storage``."""
        return tuple(storage.shape[1:] if self.stacked else storage.shape)

    def distinct(self, storage: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The blocks of ``storage`` that differ from one another, in the form
        :meth:`materialize` builds a storage from (its inverse): stacked, the grid ``(*sizes,
        *padded)`` of :func:`.._blocks.distinct_shards` (replicated axes read at coordinate 0);
        else this rank's block. A view where it can be. An elementwise update of them updates
        the value."""
        if not self.stacked:
            return storage
        return storage.reshape(*layout.mesh.shape, *storage.shape[1:])[_distinct_index(layout)]

    def distinct_held(self, held: torch.Tensor, layout: Layout) -> torch.Tensor:
        """The blocks :meth:`distinct` reads, of a value held once (see :meth:`held_plan`): its
        held blocks on their grid, a view."""
        return held.reshape(*self.held_plan(layout).grid, *held.shape[1:])

    def holds_leaf(self, layout: Layout, shape: tuple[int, ...]) -> bool:
        """Whether a value computed outside a program (an optimizer's updated parameter, a
        parameter's gradient) is kept held once in ``layout`` (see :meth:`held_plan`): an axis
        replicates it, its blocks are even and large enough, and no axis is Partial."""
        return self.stacked and _holds_leaf(layout, tuple(shape), self.held_min_elements)

    def from_distinct(self, distinct: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The storage whose blocks :meth:`distinct` reads are ``distinct`` (a grid of one
        block per distinct shard, stacked; else this rank's block): the inverse of
        :meth:`distinct`, with no padding zeroed and no Partial axis partitioned (compare
        :meth:`materialize`)."""
        if not self.stacked:
            return distinct
        block = distinct.shape[mesh.ndim :]
        return distinct.expand(*mesh.shape, *block).reshape(mesh.size, *block)


@cached(4096)
def _holds_leaf(layout: Layout, shape: tuple[int, ...], min_elements: int) -> bool:
    table = shard_table(layout, shape)
    return (
        simulated_storage.held_plan(layout) is not None
        and not layout.has_partial
        and table.is_even
        and math.prod(table.padded_shape) >= min_elements
    )


@cached(1024)
def _distinct_index(layout: Layout) -> tuple[slice, ...]:
    """The index of a stacked storage's grid that :meth:`Backend.distinct` reads: coordinate 0
    of the replicated axes, all of the others."""
    return tuple([slice(0, 1) if p.is_replicate() else slice(None) for p in layout.placements])


def _agreed_shape(infos, layout: Layout, shape, run_check: bool, where: str) -> tuple[int, ...]:
    """The global shape of shards whose metadata, every device's, is ``infos``: ``shape`` where
    given, else the one their local shapes make up. Raises where they cannot make up one value
    (with ``run_check``: where dtype, device type or ``requires_grad`` differ too)."""
    fields = [("ndim", lambda i: len(i.shape))]
    if run_check:
        fields += [("dtype", lambda i: i.dtype), ("device type", lambda i: i.device)]
        fields += [("requires_grad", lambda i: i.requires_grad)]
    for name, read in fields:
        values = [read(i) for i in infos]
        other = next((k for k, v in enumerate(values) if v != values[0]), None)
        if other is not None:
            raise (ShapeError if name == "ndim" else InputTypeError)(
                explain(
                    f"{where}(local_tensor)",
                    f"the shards' {name} differs across devices",
                    expected=f"the same {name} on every device",
                    got=f"{values[0]} on device 0, {values[other]} on device {other}",
                    fix=f"give every device's shard the same {name}",
                )
            )
    local_shapes = tuple([i.shape for i in infos])
    if shape is not None:
        check_rank(shape, len(local_shapes[0]), f"{where}(shape)")
    if shape is None:
        shape = global_shape_of_local(layout, local_shapes)
        fits = shape is not None
    else:
        fits = shard_table(layout, shape).local_shapes == local_shapes
    if not fits:
        raise ShapeError(
            explain(
                f"{where}(local_tensor)",
                f"the shards' shapes fit no global shape of layout {layout}"
                if shape is None
                else f"the shards' shapes do not fit global shape {shape}",
                expected="every device's shard the block the layout gives it (torch.chunk's split)",
                got="shapes " + ", ".join(f"{s} on device {k}" for k, s in enumerate(local_shapes)),
                fix="pass shape= with the global shape, and each device's block of it",
            )
        )
    return shape


_BACKENDS = {
    "simulated": Backend("simulated", simulated_storage, simulated_kernels, simulated_engine, stacked=True),
    "distributed": Backend(
        "distributed", distributed_storage, distributed_kernels, distributed_engine, stacked=False
    ),
}


def backend_of(mesh: DeviceMesh) -> Backend:
    """The backend of ``mesh``."""
    return _BACKENDS[mesh.backend]

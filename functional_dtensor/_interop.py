"""Conversion to and from torch's ``DTensor`` and ``DeviceMesh``: :func:`to_torch`, :func:`from_torch`.

A layout maps placement for placement: ``Shard``, ``Replicate`` and ``Partial`` (sum, avg, max,
min) are the same on both sides, uneven shards included (``torch.chunk``'s split in both). A dim
split by several mesh axes in another order than the mesh's (``fd.P(("tp", "dp"))``, recorded
in ``Layout.shard_order``) becomes torch's ``_StridedShard`` placements, with the split factors
torch's ``DTensorSpec._convert_shard_order_to_StridedShard`` gives, and back.

On the distributed backend the torch mesh of an fd mesh is the one whose process groups fd runs
its collectives on, and a torch ``DTensor`` wraps this rank's shard. On the simulated backend a
torch ``DTensor`` holds every device's shard in a ``LocalTensor`` (torch's own simulation of
SPMD ranks in one process), which needs a ``"fake"`` default process group of the mesh's size.
Both ways, and on both backends, the conversions are differentiable.

Values are copied by default, so that an ``fd.DTensor`` never shares memory a caller can change
(a torch ``DTensor`` is a mutable tensor); ``copy=False`` shares the local storage both ways.
"""

from __future__ import annotations

import math

import torch

from ._backend import backend_of
from ._distributed import runtime
from ._dtensor import DTensor, from_local
from ._errors import InputTypeError, LayoutError, MeshError, explain
from ._layout import Layout
from ._mesh import DeviceMesh, simulated_mesh
from ._placements import Partial, Placement, Replicate, Shard

__all__ = ["to_torch", "from_torch", "torch_placements", "layout_from_torch"]

PARTIAL_OPS = ("sum", "avg", "max", "min")
#: the simulated meshes' torch meshes, with the default process group they were built on
_simulated_torch_meshes: dict[DeviceMesh, tuple[object, object]] = {}


# --- placements ------------------------------------------------------------------------------


def torch_placements(layout: Layout) -> tuple:
    """The torch placements of ``layout`` (non-negative Shard dims): one per mesh axis, with
    ``_StridedShard`` where a dim's axes split it in another order than the mesh's. The split
    factor of an axis is the product of the sizes of the axes that split the dim before it and
    come after it in the mesh (torch's ``DTensorSpec._convert_shard_order_to_StridedShard``)."""
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list = []
    for placement in layout.placements:
        if isinstance(placement, Shard):
            out.append(TorchShard(placement.dim))
        elif isinstance(placement, Partial):
            out.append(TorchPartial(placement.op))
        else:
            out.append(TorchReplicate())
    ops = {p.op for p in layout.placements if isinstance(p, Partial)}
    if len(ops) > 1 and ops != {"sum", "avg"}:
        raise LayoutError(
            explain(
                "fd.to_torch(x.sharding)",
                "torch's DTensor does not mix Partial reductions other than sum and avg",
                expected="one Partial reduction, or sum and avg",
                got=str(layout),
                fix="reduce some of the Partial axes first: fd.redistribute them to Replicate",
            )
        )
    sizes = layout.mesh.shape
    for dim, axes in layout.shard_order:
        for index, axis in enumerate(axes):
            split_factor = math.prod(sizes[a] for a in axes[:index] if a > axis)
            if split_factor > 1:
                out[axis] = _StridedShard(dim, split_factor=split_factor)
    return tuple(out)


def layout_from_torch(mesh: DeviceMesh, placements, ndim: int, *, shard_order=None, where: str) -> Layout:
    """The fd layout on ``mesh`` of torch ``placements`` for an ``ndim``-d tensor: ``_StridedShard``
    read back into the order of a dim's axes (or torch's explicit ``shard_order``, when given
    and not the default). A placement fd has no counterpart for is a ``LayoutError``."""
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(placements)
    ours: list[Placement] = []
    split_factors: dict[int, int] = {}
    for axis, placement in enumerate(placements):
        kind = type(placement)
        if kind is _StridedShard:
            ours.append(Shard(placement.dim % max(ndim, 1)))
            split_factors[axis] = int(placement.split_factor)
        elif kind is TorchShard:
            ours.append(Shard(placement.dim % max(ndim, 1)))
            split_factors[axis] = 1
        elif kind is TorchReplicate:
            ours.append(Replicate())
        elif kind is TorchPartial and placement.reduce_op in PARTIAL_OPS:
            ours.append(Partial(placement.reduce_op))
        else:
            raise LayoutError(
                explain(
                    f"{where}(placements[{axis}])",
                    f"torch placement {placement!r} has no fd counterpart",
                    expected="Shard, _StridedShard, Replicate or Partial with reduce_op sum, avg, max or min",
                    got=repr(placement),
                    fix="redistribute the torch DTensor to such placements first (x.redistribute(...))",
                )
            )
    if shard_order and set(split_factors.values()) <= {1}:
        order = tuple((int(dim), tuple(int(a) for a in axes)) for dim, axes in shard_order)
        return Layout(mesh, tuple(ours), order)
    order = _order_of_split_factors(mesh, ours, split_factors, placements, where)
    layout = Layout(mesh, tuple(ours), order)
    if tuple(torch_placements(layout)) != placements:  # e.g. a split factor left by a view
        raise _unrepresentable(placements, where)
    return layout


def _order_of_split_factors(mesh, ours, split_factors, placements, where) -> tuple:
    """Each dim's axes, major first, that give these split factors (torch's
    ``_maybe_convert_StridedShard_to_shard_order``: axes placed right to left, each where the
    sizes of the axes before it multiply to its split factor)."""
    orders: dict[int, list[int]] = {}
    for axis in reversed(range(len(ours))):
        if axis not in split_factors:
            continue
        order = orders.setdefault(ours[axis].dim, [])
        product = 1
        for position in range(len(order) + 1):
            if product == split_factors[axis]:
                order.insert(position, axis)
                break
            if position < len(order):
                product *= mesh.shape[order[position]]
        else:
            raise _unrepresentable(placements, where)
    return tuple((dim, tuple(axes)) for dim, axes in sorted(orders.items()) if len(axes) > 1)


def _unrepresentable(placements, where: str) -> LayoutError:
    return LayoutError(
        explain(
            f"{where}(placements)",
            "these _StridedShard split factors are no order of the mesh axes that split the dim",
            expected="split factors of a shard order (torch's FSDP2 + TP layouts, or fd.P tuples)",
            got=", ".join(map(str, placements)),
            fix="redistribute the torch DTensor to Shard/Replicate placements first, or convert "
            "its global value with fd.distribute_tensor(x.full_tensor(), ...)",
        )
    )


# --- meshes ----------------------------------------------------------------------------------


def _torch_mesh(mesh: DeviceMesh, where: str):
    """The torch mesh of ``mesh``: on the distributed backend the one fd's collectives run on;
    on the simulated backend one over the ranks of a ``"fake"`` default process group."""
    if not backend_of(mesh).one_process:
        return runtime.torch_mesh(mesh)
    if mesh.device_ids != tuple(range(mesh.size)):
        raise MeshError(
            explain(
                where,
                "a simulated sub-mesh stands for several groups of devices",
                expected="a whole simulated mesh (devices 0..size-1)",
                got=repr(mesh),
                fix="convert the whole mesh and slice the torch mesh: fd.to_torch(mesh)[names]",
            )
        )
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_initialized() else None
    backend = dist.get_backend() if world is not None else None
    if backend != "fake" or dist.get_world_size() != mesh.size:
        raise MeshError(
            explain(
                where,
                f"a simulated mesh converts to torch's LocalTensor simulation, over a 'fake' "
                f"process group of its {mesh.size} devices",
                expected=f"torch.distributed initialized with backend 'fake' and world size {mesh.size}",
                got="no process group"
                if world is None
                else f"backend {backend!r}, {dist.get_world_size()} ranks",
                fix=f"call torch.distributed.init_process_group('fake', rank=0, world_size={mesh.size}, "
                "store=torch.distributed.HashStore()) first (and destroy_process_group() after), or "
                "pass the global value x.full_tensor() to torch",
            )
        )
    found = _simulated_torch_meshes.get(mesh)
    if found is None or found[0] is not world:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh

        with maybe_disable_local_tensor_mode():
            ids = torch.arange(mesh.size, dtype=torch.int).reshape(mesh.shape)
            found = (world, TorchMesh(mesh.device_type.split(":")[0], ids, mesh_dim_names=mesh.axis_names))
        _simulated_torch_meshes[mesh] = found
    return found[1]


def _is_fake(torch_mesh) -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend(torch_mesh.get_group(0)) == "fake"


def _fd_mesh(torch_mesh, where: str) -> DeviceMesh:
    """The fd mesh of a torch mesh: of the same shape, axis names and device type; simulated
    over a ``"fake"`` process group, distributed otherwise (a sub-mesh sliced from the fd mesh of
    its root)."""
    names = torch_mesh.mesh_dim_names
    if not names:
        raise MeshError(
            explain(
                where,
                "fd meshes name their axes",
                expected="a torch DeviceMesh with mesh_dim_names",
                got=repr(torch_mesh),
                fix="build it with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))",
            )
        )
    names = tuple(names)
    root = torch_mesh._get_root_mesh() if hasattr(torch_mesh, "_get_root_mesh") else torch_mesh
    root_names = tuple(root.mesh_dim_names or ())
    ranks = root.mesh.flatten().tolist()
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else None
    if ranks != list(range(world or -1)) or not set(names) <= set(root_names):
        raise MeshError(
            explain(
                where,
                "an fd mesh covers every rank in row-major order, with named axes",
                expected=f"a mesh (or a slice of one) over ranks 0..{(world or 1) - 1} in order",
                got=f"{torch_mesh!r} over ranks {ranks}",
                fix="build the torch mesh with init_device_mesh(device_type, shape, mesh_dim_names=...) "
                "over the whole world, or fd.init_device_mesh and fd.to_torch",
            )
        )
    device_type = root.device_type
    shape = tuple(root.mesh.shape)
    if _is_fake(root):
        mesh = simulated_mesh(shape, root_names, device_type)
    else:
        mesh = runtime.init_device_mesh(device_type, shape, root_names)
    return mesh if names == root_names else mesh[names]


# --- values ----------------------------------------------------------------------------------


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def to_torch(x, /, *, copy: bool = True):
    """The torch counterpart of an ``fd.DTensor`` (a ``torch.distributed.tensor.DTensor``) or of
    an ``fd.DeviceMesh`` (a ``torch.distributed.DeviceMesh``).

    A mesh keeps its shape, axis names (``mesh_dim_names``) and device type; on the distributed
    backend it is the torch mesh whose process groups fd runs on. A value keeps its global shape
    and layout: placement for placement, with ``_StridedShard`` for a dim split by several axes
    in another order than the mesh's. On the distributed backend the torch DTensor wraps this
    rank's shard; on the simulated backend every device's, in a torch ``LocalTensor`` (rank
    ``k`` holding device ``k``'s shard), which needs a ``"fake"`` default process group of the
    mesh's size (see ``docs/concepts/interop.md``). Differentiable: gradients flow back to
    ``x``, each rank's to its shard. ``copy=False`` shares the shards' memory instead of
    copying it (then do not change the torch tensor in place: the fd value would change).
    """
    api = "fd.to_torch"
    if isinstance(x, DeviceMesh):
        return _torch_mesh(x, f"{api}(mesh)")
    if not isinstance(x, DTensor):
        raise InputTypeError(
            explain(
                f"{api}(x)",
                "converts an fd value or mesh",
                expected="an fd.DTensor or an fd.DeviceMesh",
                got=f"{type(x).__module__}.{type(x).__name__}",
                fix="pass an fd.DTensor (fd.distribute_tensor a plain tensor first) or an fd.DeviceMesh",
            )
        )
    from torch.distributed.tensor import DTensor as TorchDTensor

    layout, shape = x.sharding, tuple(x.shape)
    mesh = layout.mesh
    torch_mesh = _torch_mesh(mesh, f"{api}(x.device_mesh)")
    placements = torch_placements(layout)
    stride = _contiguous_stride(shape)
    if not backend_of(mesh).one_process:
        local = x.to_local()
        local = local.clone() if copy else local
        return TorchDTensor.from_local(
            local, torch_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )
    shards = x.local_shards()
    held = _IntoLocalTensor.apply(*[s.clone() if copy else s for s in shards])
    return TorchDTensor.from_local(
        held, torch_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def from_torch(t, /, *, copy: bool = True):
    """The fd counterpart of a ``torch.distributed.tensor.DTensor`` (an ``fd.DTensor``) or of a
    ``torch.distributed.DeviceMesh`` (an ``fd.DeviceMesh``): the inverse of :func:`to_torch`.

    A torch mesh needs named axes and must cover every rank in row-major order (or be a slice of
    such a mesh); on a ``"fake"`` process group it becomes a simulated mesh, otherwise a
    distributed one. A torch DTensor's ``_StridedShard`` placements become the order of a dim's
    axes (``fd.P(("tp", "dp"))``); a placement fd cannot represent is an ``fd.LayoutError``. On
    the distributed backend the value holds this rank's shard; a ``LocalTensor``-backed
    DTensor (a fake process group) becomes a simulated value holding every rank's.
    Differentiable: gradients flow back to ``t``. ``copy=False`` shares the distributed shard's
    memory instead of copying it (then do not change ``t`` in place: the fd value would
    change); a simulated value stacks the shards, a copy either way.
    """
    api = "fd.from_torch"
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.tensor import DTensor as TorchDTensor

    if isinstance(t, TorchMesh):
        return _fd_mesh(t, f"{api}(mesh)")
    if not isinstance(t, TorchDTensor):
        raise InputTypeError(
            explain(
                f"{api}(t)",
                "converts a torch DTensor or DeviceMesh",
                expected="a torch.distributed.tensor.DTensor or a torch.distributed.DeviceMesh",
                got=f"{type(t).__module__}.{type(t).__name__}",
                fix="fd.distribute_tensor a plain tensor; fd values need no conversion"
                if not isinstance(t, DTensor)
                else "it is already an fd.DTensor: use it as it is",
            )
        )
    mesh = _fd_mesh(t.device_mesh, f"{api}(t.device_mesh)")
    spec = getattr(t, "_spec", None)
    shard_order = None
    if spec is not None and not getattr(spec, "use_strided_shard_as_shard_order", True):
        shard_order = spec.shard_order
    layout = layout_from_torch(mesh, t.placements, t.dim(), shard_order=shard_order, where=api)
    shape = tuple(t.shape)
    if not backend_of(mesh).one_process:
        return from_local(t.to_local(), mesh, layout, shape=shape, copy=copy)
    local = t.to_local()
    shards = getattr(local, "_local_tensors", None)
    if shards is None or set(shards) != set(range(mesh.size)):
        raise MeshError(
            explain(
                f"{api}(t)",
                "a DTensor on a 'fake' process group holds every rank's shard in a LocalTensor",
                expected=f"a LocalTensor of ranks 0..{mesh.size - 1}",
                got=type(local).__name__,
                fix="build it under torch's LocalTensorMode, or fd.to_torch an fd value on a simulated mesh",
            )
        )
    return from_local(list(_OutOfLocalTensor.apply(local)), mesh, layout, shape=shape, copy=copy)


class _IntoLocalTensor(torch.autograd.Function):
    """Every device's shard, in flat mesh order, into one ``LocalTensor`` (rank ``k`` holding
    device ``k``'s), sharing their memory; the gradient of rank ``k`` goes to shard ``k``, as
    each rank's own gradient does on the distributed backend."""

    @staticmethod
    def forward(*shards):
        from torch.distributed._local_tensor import LocalTensor

        return LocalTensor({rank: shard.detach() for rank, shard in enumerate(shards)})

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad._local_tensors[rank] for rank in range(len(grad._local_tensors)))


class _OutOfLocalTensor(torch.autograd.Function):
    """The inverse of :class:`_IntoLocalTensor`: a ``LocalTensor``'s tensors, in rank order."""

    @staticmethod
    def forward(local):
        return tuple(local._local_tensors[rank].detach() for rank in range(len(local._local_tensors)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in output]

    @staticmethod
    def backward(ctx, *grads):
        from torch.distributed._local_tensor import LocalTensor

        return LocalTensor(
            {
                rank: torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad
                for rank, (grad, (shape, dtype, device)) in enumerate(zip(grads, ctx.shapes))
            }
        )

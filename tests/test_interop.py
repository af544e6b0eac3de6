"""fd.to_torch / fd.from_torch: values and meshes to and from torch's DTensor and DeviceMesh.

On gloo (2 and 4 ranks) and on the simulated backend (torch's LocalTensor over a 'fake' process
group): drawn layouts round-trip fd -> torch -> fd with their layout, shape and shards; torch's
own ops on the converted value give fd's values; the local storage is shared with copy=False
and copied by default; a dim split in another order than the mesh's is torch's _StridedShard
(checked against torch's own conversion); gradients flow through both conversions; a module
sharded by fd trains under torch's FSDP2 (fully_shard) as on one device; bad inputs are the
library's errors.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from backends import Mesh, all_specs, coordinates
from common import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor.placement_types import _StridedShard

import functional_dtensor as fd
from functional_dtensor._interop import layout_from_torch, torch_placements
from functional_dtensor._sharding import shard_table
from functional_dtensor.testing import strategies as fds

S, R, Pa = fd.Shard, fd.Replicate(), fd.Partial


# --- the torch side of a job: real ranks on gloo, LocalTensor ranks on a simulated mesh --------


@contextlib.contextmanager
def torch_world(mesh: fd.DeviceMesh):
    """Where ``mesh`` is simulated: a 'fake' default process group of its size for the length
    of the block (destroyed after, so no other test sees it). On gloo: nothing to do."""
    if mesh.backend != "simulated":
        yield
        return
    dist.init_process_group("fake", rank=0, world_size=mesh.size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def torch_ops(mesh: fd.DeviceMesh):
    """Where torch ops on a converted value run: under LocalTensorMode on a simulated mesh."""
    if mesh.backend != "simulated":
        return contextlib.nullcontext()
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(mesh.size)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A torch op's result as a plain tensor (a LocalTensor's, the same on every rank)."""
    return t.reconcile() if hasattr(t, "reconcile") else t


def torch_locals(t: TorchDTensor) -> list[torch.Tensor]:
    """The local tensors of a torch DTensor that this process holds: every rank's in a
    LocalTensor, in rank order; this rank's on gloo."""
    local = t._local_tensor
    shards = getattr(local, "_local_tensors", None)
    return [shards[k] for k in sorted(shards)] if shards is not None else [local]


def local_ptrs(t: TorchDTensor) -> list[int]:
    return [s.untyped_storage().data_ptr() for s in torch_locals(t)]


def fd_ptrs(x: fd.DTensor) -> list[int]:
    return [s.untyped_storage().data_ptr() for s in x.local_shards()]


# --- placements: torch's own conversion is the reference ----------------------------------------


class _Sizes:
    """What torch's shard-order conversion reads of a mesh: its sizes."""

    def __init__(self, shape) -> None:
        self.shape = shape

    def size(self, axis: int) -> int:
        return self.shape[axis]


@st.composite
def torch_layouts(draw):
    """Layouts of a 3-d value on meshes of up to 24 devices, Partial axes of one reduction (or
    sum and avg: torch mixes no others)."""
    ops = draw(st.sampled_from([("sum", "avg"), ("max",), ("min",)]))
    return draw(fds.layouts(fds.meshes(max_devices=24), 3, allow_partial=True, partial_ops=ops))


@settings(max_examples=200)
@given(torch_layouts())
def test_placements_are_torchs_conversion_of_the_shard_order_and_convert_back(layout):
    ours = torch_placements(layout)
    base = tuple(
        TorchShard(p.dim) if p.is_shard() else TorchPartial(p.op) if p.is_partial() else TorchReplicate()
        for p in layout.placements
    )
    order = tuple(ShardOrderEntry(dim, axes) for dim, axes in layout.shard_order)
    assert ours == DTensorSpec._convert_shard_order_to_StridedShard(order, base, _Sizes(layout.mesh.shape))
    back = layout_from_torch(layout.mesh, ours, 3, where="test")
    if all(layout.mesh.shape[a] > 1 for _, axes in layout.shard_order for a in axes):
        assert back == layout
    else:  # axes of one device split alike in any order: torch keeps no order for them
        table, back_table = shard_table(layout, (7, 5, 6)), shard_table(back, (7, 5, 6))
        assert (back.placements, back_table.local_shapes, back_table.offsets) == (
            layout.placements,
            table.local_shapes,
            table.offsets,
        )


def test_mixed_partial_reductions_torch_cannot_hold_are_layout_errors():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    assert torch_placements(fd.Layout(mesh, (Pa("sum"), Pa("avg")))) == (
        TorchPartial("sum"),
        TorchPartial("avg"),
    )
    with pytest.raises(fd.LayoutError, match="does not mix Partial reductions.*fd.redistribute"):
        torch_placements(fd.Layout(mesh, (Pa("sum"), Pa("max"))))


def test_strided_shard_of_a_dim_split_tp_first():
    mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
    layout = fd.Layout.from_spec(mesh, fd.P(("tp", "dp")))
    assert torch_placements(layout) == (_StridedShard(0, split_factor=4), TorchShard(0))
    three = fd.simulated_mesh((2, 3, 2), ("a", "b", "c"))
    layout = fd.Layout.from_spec(three, fd.P(None, ("c", "a", "b")))
    expected = (_StridedShard(1, split_factor=2), _StridedShard(1, split_factor=2), TorchShard(1))
    assert torch_placements(layout) == expected


def test_an_explicit_torch_shard_order_is_read():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    order = (ShardOrderEntry(0, (1, 0)),)
    layout = layout_from_torch(mesh, (TorchShard(0), TorchShard(0)), 2, shard_order=order, where="test")
    assert layout.spec == fd.P(("y", "x"))


@pytest.mark.parametrize(
    "placements",
    [
        (_StridedShard(0, split_factor=3), TorchShard(0)),  # no order of sizes 2, 2 gives 3
        (TorchShard(0), _StridedShard(0, split_factor=2)),  # strided on the minor axis
        (TorchPartial("product"), TorchReplicate()),
    ],
    ids=["split-factor", "strided-minor", "partial-product"],
)
def test_torch_placements_fd_cannot_represent_are_layout_errors(placements):
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    with pytest.raises(fd.LayoutError, match=r"fd.from_torch\(placements") as caught:
        layout_from_torch(mesh, placements, 2, where="fd.from_torch")
    assert "Fix:" in str(caught.value)


# --- bad inputs ---------------------------------------------------------------------------------


def test_wrong_types_are_input_type_errors():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.arange(4.0), mesh, fd.P("x"))
    with pytest.raises(fd.InputTypeError, match=r"fd.to_torch\(x\).*got torch.Tensor"):
        fd.to_torch(torch.ones(3))
    with pytest.raises(fd.InputTypeError, match=r"fd.from_torch\(t\).*got torch.Tensor"):
        fd.from_torch(torch.ones(3))
    with pytest.raises(fd.InputTypeError, match="already an fd.DTensor"):
        fd.from_torch(x)
    with pytest.raises(fd.InputTypeError, match=r"fd.to_torch\(x\)"):
        fd.to_torch(fd.P("x"))


def test_a_simulated_mesh_without_a_fake_process_group_says_how():
    assert not dist.is_initialized()
    x = fd.distribute_tensor(torch.arange(4.0), fd.simulated_mesh(2, "x"), fd.P("x"))
    with pytest.raises(fd.MeshError, match="init_process_group\\('fake'.*x.full_tensor\\(\\)"):
        fd.to_torch(x)
    mesh = fd.simulated_mesh(4, "x")
    with torch_world(mesh), pytest.raises(fd.MeshError, match="world size 2, got backend 'fake', 4 ranks"):
        fd.to_torch(x)
    assert not dist.is_initialized()


def test_a_simulated_sub_mesh_and_an_unnamed_torch_mesh_are_mesh_errors():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    with torch_world(mesh):
        with pytest.raises(fd.MeshError, match="sub-mesh.*fd.to_torch\\(mesh\\)\\[names\\]"):
            fd.to_torch(mesh["y"])
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh

        unnamed = TorchMesh("cpu", torch.arange(4).reshape(2, 2))
        with pytest.raises(fd.MeshError, match="mesh_dim_names"):
            fd.from_torch(unnamed)
        assert fd.from_torch(fd.to_torch(mesh)["y"]) == mesh["y"]


# --- round trips, on both backends --------------------------------------------------------------


def value_of(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def job_round_trip(mesh, items) -> list[dict]:
    out = []
    with torch_world(mesh):
        torch_mesh = fd.to_torch(mesh)
        for shape, placements, order, seed in items:
            t = value_of(shape, seed)
            x = fd.distribute_tensor(t, mesh, fd.Layout(mesh, placements, order))
            tt = fd.to_torch(x)
            y = fd.from_torch(tt)
            with torch_ops(mesh):
                full = plain(tt.full_tensor()) if torch_gathers(x.sharding, shape) else None
            out.append(
                {
                    "layout": y.sharding == x.sharding and y.device_mesh == mesh,
                    "shape": (tuple(tt.shape), tuple(y.shape)),
                    "mesh": tt.device_mesh is torch_mesh,
                    "placements": tuple(tt.placements) == torch_placements(x.sharding),
                    "shards": all(torch.equal(a, b) for a, b in zip(x.local_shards(), y.local_shards())),
                    "torch_shards": all(
                        torch.equal(a, b) for a, b in zip(x.local_shards(), torch_locals(tt), strict=True)
                    ),
                    "full": full,
                    "y_full": y.full_tensor(),
                }
            )
    return out


def torch_gathers(layout: fd.Layout, shape) -> bool:
    """Whether torch's full_tensor is right for this layout on gloo: torch 2.13 assembles a dim
    split unevenly by two or more axes wrongly there (its own distribute_tensor's values too:
    rows 6 over Shard(0), Shard(0) on 2x2 come back with a row of zeros), so its shards are
    compared instead."""
    if layout.mesh.backend == "simulated":
        return True
    for dim, size in enumerate(shape):
        axes = layout.sharding_axes(dim)
        if len(axes) > 1 and size % math.prod(layout.mesh.shape[a] for a in axes):
            return False
    return True


@st.composite
def round_trip_items(draw, mesh: Mesh, count: int):
    simulated = mesh.simulated()
    items = []
    for _ in range(count):
        ops = draw(st.sampled_from([("sum", "avg"), ("max",), ("min",)]))  # torch mixes no others
        case = draw(
            fds.sharded_cases(
                mesh=simulated,
                max_dims=3,
                max_side=9,
                dtype=torch.float64,
                allow_partial=True,
                partial_ops=ops,
            )
        )
        layout = case.layout
        items.append((case.global_shape, layout.placements, layout.shard_order, draw(st.integers(0, 999))))
    return items


@pytest.mark.meshes((2,), (4,), (2, 2), Mesh((2, 2), ("dp", "tp")))
@settings(max_examples=4)
@given(data=st.data())
def test_drawn_layouts_round_trip_with_torchs_global_value(backend, mesh, data):
    items = data.draw(round_trip_items(mesh, 8))
    results = backend.run(job_round_trip, mesh.shape, mesh.names, items)
    for result in results:
        for (shape, *_, seed), got in zip(items, result, strict=True):
            assert got["layout"] and got["mesh"] and got["placements"]
            assert got["shards"] and got["torch_shards"]
            assert got["shape"] == (shape, shape)
            if got["full"] is not None:
                assert_close(got["full"], value_of(shape, seed))
            assert_close(got["y_full"], value_of(shape, seed))


@pytest.mark.meshes((2, 2), (4,))
def test_every_spec_round_trips_even_and_uneven(backend, mesh):
    """Every spec of a 2-d value (each axis splits a dim or none, a dim's axes in every order),
    on an even and an uneven shape."""
    items = [
        (shape, layout.placements, layout.shard_order, seed)
        for seed, shape in enumerate([(4, 8), (5, 7)])
        for spec in all_specs(mesh.names, 2)
        for layout in [fd.Layout.from_spec(mesh.simulated(), spec)]
    ]
    assert any(item[2] for item in items) == (len(mesh.shape) > 1)
    for result in backend.run(job_round_trip, mesh.shape, mesh.names, items):
        for (shape, *_, seed), got in zip(items, result, strict=True):
            assert got["layout"] and got["placements"] and got["shards"] and got["torch_shards"]
            if got["full"] is not None:
                assert_close(got["full"], value_of(shape, seed))


def job_strided_blocks(mesh) -> dict:
    """Rows 0..6 over ("y", "x") (uneven: 7 over 4), columns over nothing: each device's torch
    block, and fd's."""
    with torch_world(mesh):
        x = fd.distribute_tensor(torch.arange(14.0).reshape(7, 2), mesh, fd.P(("y", "x")))
        tt = fd.to_torch(x)
        torch_blocks = torch_locals(tt)
        return {
            "placements": [str(p) for p in tt.placements],
            "torch": [b.clone() for b in torch_blocks],
            "fd": [s.clone() for s in x.local_shards()],
            "back": fd.from_torch(tt).sharding == x.sharding,
        }


@pytest.mark.meshes((2, 2))
def test_a_dim_split_in_another_order_is_torchs_strided_shard_uneven_too(backend, mesh):
    results = backend.run(job_strided_blocks, mesh.shape)
    torch_blocks = [b for r in results for b in r["torch"]]
    fd_blocks = [b for r in results for b in r["fd"]]
    assert all(r["placements"] == ["_S(0, 2)", "S(0)"] and r["back"] for r in results)
    # device (x, y) holds block y * 2 + x of torch.chunk(7 rows, 4)... nested: 4 rows, 3 rows
    rows = torch.arange(14.0).reshape(7, 2)
    for (x, y), got_torch, got_fd in zip(coordinates((2, 2)), torch_blocks, fd_blocks, strict=True):
        half = rows.chunk(2)[y]
        pieces = half.chunk(2)
        expected = pieces[x] if x < len(pieces) else half[:0]
        assert torch.equal(got_torch, expected) and torch.equal(got_fd, expected)


def job_storage(mesh) -> dict:
    with torch_world(mesh):
        x = fd.distribute_tensor(torch.arange(32.0).reshape(4, 8), mesh, fd.P(None, mesh.axis_names))
        with fd.CommDebugMode() as comm:
            shared, copied = fd.to_torch(x, copy=False), fd.to_torch(x)
            back_shared, back_copied = fd.from_torch(shared, copy=False), fd.from_torch(shared)
        ptrs = fd_ptrs(x)
        return {
            "communicated": len(comm.events),
            "to_shared": local_ptrs(shared) == ptrs,
            "to_copied": not set(local_ptrs(copied)) & set(ptrs),
            "from_shared": fd_ptrs(back_shared) == local_ptrs(shared),
            "from_copied": not set(fd_ptrs(back_copied)) & set(ptrs),
        }


@pytest.mark.meshes((2,), (4,))
def test_local_storage_is_shared_with_copy_false_and_copied_by_default(backend, mesh):
    results = backend.run(job_storage, mesh.shape)
    for result in results:
        assert result["communicated"] == 0  # a conversion never communicates
        shared = result["to_shared"], result["to_copied"], result["from_copied"]
        assert all(shared), result
        if not backend.is_simulated:  # a simulated value stacks the shards of a LocalTensor
            assert result["from_shared"], result


def job_torch_ops(mesh) -> dict:
    """Torch's ops on converted values, fd's global ops on the same values."""
    names = mesh.axis_names
    a_t = value_of((6, 5), 1)
    b_t = value_of((5, 7), 2)
    with torch_world(mesh):
        a = fd.distribute_tensor(a_t, mesh, fd.P(names[0]))
        b = fd.distribute_tensor(b_t, mesh, fd.P(None, names[-1]))
        ta, tb = fd.to_torch(a), fd.to_torch(b)
        with torch_ops(mesh):
            torch_out = {
                "matmul": plain((ta @ tb).full_tensor()),
                "relu_sum": plain(torch.relu(ta).sum(0).full_tensor()),
                "softmax": plain(torch.softmax(tb, dim=-1).full_tensor()),
            }
            back = fd.from_torch(ta @ tb) if mesh.backend != "simulated" else None
        fd_out = {
            "matmul": (a @ b).full_tensor(),
            "relu_sum": torch.relu(a).sum(0).full_tensor(),
            "softmax": torch.softmax(b, dim=-1).full_tensor(),
        }
        return {"torch": torch_out, "fd": fd_out, "back": None if back is None else back.full_tensor()}


@pytest.mark.meshes((2,), (2, 2))
def test_torch_ops_on_converted_values_match_fds_global_ops(backend, mesh):
    for result in backend.run(job_torch_ops, mesh.shape):
        for name, value in result["fd"].items():
            assert_close(result["torch"][name], value)
        if result["back"] is not None:
            assert_close(result["back"], result["fd"]["matmul"])


# --- gloo: meshes and process groups, gradients -------------------------------------------------


def job_meshes(mesh) -> dict:
    from functional_dtensor._distributed import runtime

    torch_mesh = fd.to_torch(mesh)
    tp = fd.to_torch(mesh["y"])
    return {
        "names": torch_mesh.mesh_dim_names,
        "shape": tuple(torch_mesh.mesh.shape),
        "same_groups": all(torch_mesh.get_group(n) is runtime.group(mesh, (n,)) for n in mesh.axis_names)
        and tp.get_group() is runtime.group(mesh, ("y",)),
        "back": fd.from_torch(torch_mesh) == mesh,
        "sub_back": fd.from_torch(torch_mesh["y"]) == mesh["y"] and fd.from_torch(tp) == mesh["y"],
    }


@pytest.mark.distributed
def test_a_mesh_is_the_torch_mesh_fd_runs_its_groups_on(gloo):
    for result in gloo.run(4, job_meshes_on_4):
        assert result["names"] == ("x", "y") and result["shape"] == (2, 2)
        assert result["same_groups"] and result["back"] and result["sub_back"], result


def job_meshes_on_4() -> dict:
    return job_meshes(fd.init_device_mesh("cpu", (2, 2), ("x", "y")))


def job_unrepresentable_mesh() -> list[str]:
    """Torch meshes fd has no mesh for: ranks out of row-major order, unnamed axes; and a value
    on one. Every rank raises the same error."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    errors = []
    reversed_mesh = TorchMesh("cpu", torch.arange(4).flip(0).reshape(2, 2), mesh_dim_names=("a", "b"))
    unnamed = TorchMesh("cpu", torch.arange(4))
    value = TorchDTensor.from_local(torch.ones(2), reversed_mesh, [TorchShard(0), TorchReplicate()])
    for item in (reversed_mesh, unnamed, value):
        try:
            fd.from_torch(item)
        except fd.MeshError as error:
            errors.append(str(error))
    return errors


@pytest.mark.distributed
def test_torch_meshes_fd_cannot_represent_are_mesh_errors(gloo):
    for errors in gloo.run(4, job_unrepresentable_mesh):
        assert len(errors) == 3
        assert errors[0].startswith("fd.from_torch(mesh): an fd mesh covers every rank in row-major order")
        assert "over ranks [3, 2, 1, 0]" in errors[0]
        assert errors[1].startswith("fd.from_torch(mesh): fd meshes name their axes")
        assert errors[2] == errors[0].replace("(mesh)", "(t.device_mesh)", 1) and "Fix:" in errors[2]


def job_torch_made() -> dict:
    """A mesh and a value torch made alone: fd builds its own groups for the mesh, once, and
    reads the value's shards (FSDP2-style strided rows, uneven columns)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    torch_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "cols"))
    mesh = fd.from_torch(torch_mesh)
    t = value_of((8, 5), 7)
    placements = [_StridedShard(0, split_factor=2), TorchShard(0)]
    strided = torch_distribute(t, torch_mesh, [TorchShard(0), TorchShard(0)]).redistribute(
        torch_mesh, [TorchReplicate(), TorchReplicate()]
    )
    made = TorchDTensor.from_local(
        fd.distribute_tensor(t, mesh, fd.P(("cols", "rows"))).to_local(), torch_mesh, placements
    )
    columns = torch_distribute(t, torch_mesh["cols"], [TorchShard(1)])
    return {
        "mesh": (mesh.shape, mesh.axis_names, mesh.backend),
        "again": fd.from_torch(torch_mesh) == mesh and fd.from_torch(torch_mesh["cols"]) == mesh["cols"],
        "strided": (fd.from_torch(made).spec, fd.from_torch(made).full_tensor()),
        "replicated": fd.from_torch(strided).full_tensor(),
        "columns": (fd.from_torch(columns).spec, fd.from_torch(columns).full_tensor()),
    }


@pytest.mark.distributed
def test_a_mesh_and_values_torch_made_alone_come_over(gloo):
    t = value_of((8, 5), 7)
    for result in gloo.run(4, job_torch_made):
        assert result["mesh"] == ((2, 2), ("rows", "cols"), "distributed") and result["again"]
        assert result["strided"][0] == fd.P(("cols", "rows"))
        assert result["columns"][0] == fd.P(None, "cols")
        for value in (result["strided"][1], result["replicated"], result["columns"][1]):
            assert_close(value, t)


def job_gradients(mesh) -> dict:
    """Both conversions keep the graph: a loss computed by torch on the converted value
    differentiates back to the global tensor given to fd, and one computed by fd on a torch
    DTensor's conversion back to the torch leaf (replicated, sharded, strided)."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    out = {}
    with torch_world(mesh):
        for name, spec in [
            ("R", fd.P()),
            ("S", fd.P(mesh.axis_names[-1])),
            ("SS", fd.P(mesh.axis_names[::-1])),
        ]:
            t = value_of((8, 4), 3).requires_grad_()
            x = fd.distribute_tensor(t, mesh, spec)
            tt = fd.to_torch(x)
            with torch_ops(mesh):
                (tt.full_tensor() ** 2).sum().backward()
                leaf = torch_distribute(value_of((8, 4), 4), fd.to_torch(mesh), torch_placements(x.sharding))
                leaf.requires_grad_()
            y = fd.from_torch(leaf)
            (y.full_tensor() ** 3).sum().backward()
            with torch_ops(mesh):
                leaf_grad = plain(leaf.grad.full_tensor())
            out[name] = {"requires_grad": (tt.requires_grad, y.requires_grad), "t": t.grad, "leaf": leaf_grad}
    return out


@pytest.mark.meshes((2,), (2, 2))
def test_gradients_flow_through_both_conversions(backend, mesh):
    for result in backend.run(job_gradients, mesh.shape):
        for got in result.values():
            assert got["requires_grad"] == (True, True)
            assert_close(got["t"], 2 * value_of((8, 4), 3))
            assert_close(got["leaf"], 3 * value_of((8, 4), 4) ** 2)


def test_simulated_conversions_hold_every_device_shard():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    with torch_world(mesh):
        x = fd.distribute_tensor(value_of((5, 3), 5).requires_grad_(), mesh, fd.P("y", "x"))
        tt = fd.to_torch(x)
        assert tt.requires_grad and sorted(tt._local_tensor._local_tensors) == [0, 1, 2, 3]
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.distributed.tensor import distribute_tensor as torch_distribute

        with LocalTensorMode(4):  # a value torch built itself comes over too
            made = torch_distribute(value_of((5, 3), 6), fd.to_torch(mesh), [TorchReplicate(), TorchShard(1)])
        y = fd.from_torch(made)
        assert y.device_mesh == mesh and y.spec == fd.P(None, "y")
        assert_close(y.full_tensor(), value_of((5, 3), 6))


# --- FSDP2 on fd's tensor-parallel weights ------------------------------------------------------


def job_fsdp(steps: int) -> dict:
    """A 2-layer MLP, column- then row-parallel over "tp" by fd, its parameters torch DTensors
    on the tp sub-mesh, then fully_shard over "dp"; each dp rank trains on its half of the
    batch. Losses and final weights come back for the single-device comparison."""
    from torch.distributed.fsdp import fully_shard

    mesh = fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    torch_mesh = fd.to_torch(mesh)
    tp = mesh["tp"]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = reference_model()
    layouts = {"0.weight": fd.P("tp"), "0.bias": fd.P("tp"), "2.weight": fd.P(None, "tp"), "2.bias": fd.P()}
    state = dict(reference.named_parameters())
    for name, spec in layouts.items():
        value = fd.distribute_tensor(state[name].detach(), tp, spec)
        module_name, attr = name.split(".")
        setattr(model[int(module_name)], attr, torch.nn.Parameter(fd.to_torch(value)))
    fully_shard(model, mesh=torch_mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = batch()
    dp = dist.get_rank() // 2
    losses = []
    for _ in range(steps):
        # the input replicated over tp, as parallelize_module's input hooks would make it
        x = TorchDTensor.from_local(inputs.chunk(2)[dp], fd.to_torch(tp), [TorchReplicate()])
        out = model(x).full_tensor()
        loss = ((out - targets.chunk(2)[dp]) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    weights, specs = {}, {}
    for name, param in model.named_parameters():
        value = fd.from_torch(param.detach())  # FSDP2's 2-d parameters, (dp, tp)
        weights[name], specs[name] = value.full_tensor(), value.spec
    return {
        "losses": losses,
        "weights": weights,
        "specs": specs,
        "placements": str(model[0].weight.placements),
    }


def reference_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


@pytest.mark.distributed
def test_fd_sharded_weights_train_under_fsdp2_as_on_one_device(gloo):
    steps = 3
    results = gloo.run(4, job_fsdp, steps)
    reference = reference_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    inputs, targets = batch()
    expected_losses = []
    for _ in range(steps):
        # each dp rank's loss is the mean over its half; FSDP averages the gradients over dp
        halves = [((reference(i) - t) ** 2).mean() for i, t in zip(inputs.chunk(2), targets.chunk(2))]
        (sum(halves) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append([h.detach() for h in halves])
    for rank, result in enumerate(results):
        assert result["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert result["specs"] == {
            "0.weight": fd.P(("tp", "dp")),
            "0.bias": fd.P(("tp", "dp")),
            "2.weight": fd.P("dp", "tp"),
            "2.bias": fd.P("dp"),
        }
        for got, want in zip(result["losses"], expected_losses, strict=True):
            assert_close(got, want[rank // 2])
        for name, param in reference.named_parameters():
            assert_close(result["weights"][name], param.detach())

"""Sharding math against torch's own rule (torch.chunk; DTensor's
``compute_local_shape_and_global_offset``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from backends import all_specs, block, coordinates
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)

import functional_dtensor as fd
from functional_dtensor._sharding import (
    check_divisible,
    chunk,
    global_shape_of_even_local,
    shard_table,
)
from functional_dtensor.testing import strategies as fds


def torch_placements(layout: fd.Layout):
    """Our layout as torch.distributed.tensor placements: a shard order other than the mesh's
    becomes torch's ``_StridedShard`` placements, by torch's own conversion."""
    out = []
    for p in layout.placements:
        if isinstance(p, fd.Shard):
            out.append(tdt.Shard(p.dim))
        elif isinstance(p, fd.Replicate):
            out.append(tdt.Replicate())
        else:
            out.append(tdt.Partial(p.op))
    if layout.shard_order:
        order = tuple(ShardOrderEntry(dim, axes) for dim, axes in layout.shard_order)
        out = list(DTensorSpec._convert_shard_order_to_StridedShard(order, tuple(out), _Sizes(layout.mesh)))
    return out


class _Sizes:
    """What torch's shard-order conversion reads of a mesh: the size of each axis."""

    def __init__(self, mesh: fd.DeviceMesh) -> None:
        self.shape = mesh.shape

    def size(self, axis: int) -> int:
        return self.shape[axis]


# ---------------------------------------------------------------------------------------------
# The chunk rule.


@pytest.mark.parametrize(
    "size, parts, lengths, starts",
    [
        (5, 4, [2, 2, 1, 0], [0, 2, 4, 5]),
        (6, 4, [2, 2, 2, 0], [0, 2, 4, 6]),
        (8, 4, [2, 2, 2, 2], [0, 2, 4, 6]),
        (3, 5, [1, 1, 1, 0, 0], [0, 1, 2, 3, 3]),
        (0, 3, [0, 0, 0], [0, 0, 0]),
        (7, 1, [7], [0]),
    ],
)
def test_chunk_examples(size, parts, lengths, starts):
    assert [chunk(size, parts, i) for i in range(parts)] == list(zip(lengths, starts, strict=True))


@given(st.integers(0, 40), st.integers(1, 12))
def test_chunk_matches_torch_chunk(size, parts):
    pieces = torch.arange(size).chunk(parts) if size else ()
    lengths = [len(p) for p in pieces] + [0] * (parts - len(pieces))
    got = [chunk(size, parts, i) for i in range(parts)]
    assert [length for length, _ in got] == lengths
    for (length, start), piece in zip(got, pieces, strict=False):
        if length:
            assert start == piece[0].item()
    # the blocks tile [0, size) in order
    assert sum(lengths) == size
    position = 0
    for length, start in got:
        if length:
            assert start == position
            position += length


# ---------------------------------------------------------------------------------------------
# shard_table against torch's rule.


def test_shard_table_example():
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    table = shard_table(fd.Layout(mesh, (fd.Shard(1), fd.Shard(1))), (2, 5))
    # the example in the docstring of torch's compute_local_shape_and_global_offset
    assert table.local_shapes == ((2, 2), (2, 1), (2, 1), (2, 1))
    assert table.offsets == ((0, 0), (0, 2), (0, 3), (0, 4))
    assert table.padded_shape == (2, 2) and not table.is_even
    assert str(table).splitlines()[1] == "1: (2, 1) @ (0, 2)"


@given(fds.sharded_cases(allow_partial=True, dtype=torch.float32))
def test_shard_table_matches_torch_for_every_device(case):
    mesh, layout, shape, _ = case
    table = shard_table(layout, shape)
    placements = torch_placements(layout)
    assert len(table.local_shapes) == len(table.offsets) == mesh.size
    for device in range(mesh.size):
        coordinate = list(mesh.coordinate(device))
        expected = _compute_local_shape_and_global_offset(shape, mesh.shape, coordinate, placements)
        assert (table.local_shapes[device], table.offsets[device]) == expected, (device, coordinate)


@given(fds.sharded_cases(allow_partial=True))
def test_shard_table_summary_fields(case):
    table = case.table
    ndim = len(case.global_shape)
    assert table.padded_shape == tuple(
        max((s[d] for s in table.local_shapes), default=0) for d in range(ndim)
    )
    assert table.is_even == all(s == table.padded_shape for s in table.local_shapes)
    # unsplit dims are whole on every device
    for dim in range(ndim):
        if not case.layout.sharding_axes(dim):
            assert all(s[dim] == case.global_shape[dim] for s in table.local_shapes)
            assert all(o[dim] == 0 for o in table.offsets)


@given(fds.sharded_cases())
def test_blocks_tile_the_global_tensor_exactly_once(case):
    """Devices whose Replicate coordinates are 0 hold disjoint blocks covering every element."""
    mesh, layout, shape, _ = case
    table = case.table
    count = torch.zeros(shape, dtype=torch.int64)
    for device in range(mesh.size):
        coordinate = mesh.coordinate(device)
        if any(c and not p.is_shard() for c, p in zip(coordinate, layout.placements, strict=True)):
            continue
        index = tuple(
            slice(o, o + s) for o, s in zip(table.offsets[device], table.local_shapes[device], strict=True)
        )
        count[index] += 1
    assert bool((count == 1).all())


@given(fds.sharded_cases(even=True, allow_partial=True))
def test_even_cases_divide_and_invert(case):
    table = case.table
    assert table.is_even
    check_divisible(case.layout, case.global_shape, where="test")
    assert global_shape_of_even_local(case.layout, table.local_shapes[0]) == case.global_shape


@pytest.mark.parametrize(
    "shape, placements, dim",
    [((5, 4), (fd.Shard(0),), 0), ((4, 6), (fd.Shard(1),), 1), ((3,), (fd.Replicate(),), None)],
)
def test_check_divisible(shape, placements, dim):
    layout = fd.Layout(fd.simulated_mesh(4, "x"), placements)
    if dim is None:
        check_divisible(layout, shape, where="fd.shard_map(in_specs[0])")
        return
    with pytest.raises(fd.ShapeError) as info:
        check_divisible(layout, shape, where="fd.shard_map(in_specs[0])")
    message = str(info.value)
    assert "in_specs[0]" in message and f"dim {dim}" in message and "multiple of 4" in message
    assert "Fix:" in message


# ---------------------------------------------------------------------------------------------
# Any order of a dim's axes, against the plain-loop oracle (nested torch.chunk, major first)


def check_table_against_the_oracle(mesh: fd.DeviceMesh, spec: fd.P, shape: tuple[int, ...]) -> None:
    value = torch.arange(math.prod(shape)).reshape(shape)
    table = shard_table(fd.Layout.from_spec(mesh, spec), shape)
    for k, coordinate in enumerate(coordinates(mesh.shape)):
        want = block(value, mesh.shape, mesh.axis_names, spec, coordinate)
        at = f"{spec} {shape}, device {k} at {coordinate}"
        assert table.local_shapes[k] == tuple(want.shape), at
        index = tuple(slice(o, o + n) for o, n in zip(table.offsets[k], table.local_shapes[k], strict=True))
        assert torch.equal(value[index], want), at


@pytest.mark.parametrize("mesh_shape", [(2, 3), (3, 2), (2, 2, 2), (2, 3, 2)], ids=str)
def test_shard_table_of_every_spec_is_the_nested_chunk(mesh_shape):
    """Every spec of a 2-d value (each axis on a dim or none, a dim's axes in every order) on
    2-d and 3-d meshes, for an even, an uneven and an empty shape."""
    mesh = fd.simulated_mesh(mesh_shape, ("x", "y", "z")[: len(mesh_shape)])
    specs = all_specs(mesh.axis_names, 2)
    # sum over the axes left unsplit (u of n) of n!/u! orders times the ways to pick the dims
    assert len(specs) == {2: 1 + 2 * 2 + 2 * 3, 3: 1 + 3 * 2 + 6 * 3 + 6 * 4}[mesh.ndim]
    for spec in specs:
        for shape in [(12, 12), (7, 5), (0, 3)]:
            check_table_against_the_oracle(mesh, spec, shape)


@given(st.data())
def test_shard_table_is_the_nested_chunk_for_drawn_specs(data):
    mesh = data.draw(fds.meshes(min_dims=2, max_dims=3, max_devices=24))
    shape = data.draw(fds.global_shapes(min_dims=1, max_dims=3, max_side=9, max_elements=400))
    check_table_against_the_oracle(mesh, data.draw(fds.specs(mesh, len(shape))), shape)


def test_oracle_examples():
    """The oracle itself on a case worked by hand: 5 rows over P(('y', 'x')) on a 2 x 2 mesh
    are chunked by y (3 + 2), then each by x (2 + 1, 1 + 1)."""
    value = torch.arange(5)
    got = [block(value, (2, 2), ("x", "y"), fd.P(("y", "x")), c).tolist() for c in coordinates((2, 2))]
    assert got == [[0, 1], [3], [2], [4]]  # (x, y) = (0, 0), (0, 1), (1, 0), (1, 1)
    assert [block(value, (4,), ("x",), fd.P("x"), (k,)).tolist() for k in range(4)] == [
        [0, 1],
        [2, 3],
        [4],
        [],
    ]


# ---------------------------------------------------------------------------------------------
# The public torch function, with a real (fake-backend) torch DeviceMesh per rank.


def _torch_public_rule(mesh_shape, placements, global_shape):
    """compute_local_shape_and_global_offset on every rank of a fake process group."""
    world = math.prod(mesh_shape)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    results = []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            tmesh = TorchDeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
            assert tuple(tmesh.get_coordinate()) == fd.simulated_mesh(
                mesh_shape, [f"a{i}" for i in range(len(mesh_shape))]
            ).coordinate(rank)
            results.append(compute_local_shape_and_global_offset(global_shape, tmesh, placements))
        finally:
            dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def no_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")


@pytest.mark.parametrize(
    "mesh_shape, placements, global_shape",
    [
        ((4,), (fd.Shard(0),), (5, 3)),
        ((2, 3), (fd.Shard(0), fd.Shard(0)), (5, 7)),
        ((2, 3), (fd.Shard(1), fd.Shard(0)), (4, 0)),
        ((2, 2, 2), (fd.Shard(1), fd.Replicate(), fd.Shard(1)), (3, 3)),
        ((3, 2), (fd.Partial(), fd.Shard(2)), (2, 2, 1)),
    ],
)
def test_shard_table_matches_torch_public_rule(no_process_group, mesh_shape, placements, global_shape):
    mesh = fd.simulated_mesh(mesh_shape, [f"a{i}" for i in range(len(mesh_shape))])
    layout = fd.Layout(mesh, placements)
    table = shard_table(layout, global_shape)
    expected = _torch_public_rule(mesh_shape, torch_placements(layout), global_shape)
    assert list(zip(table.local_shapes, table.offsets, strict=True)) == expected


@settings(max_examples=20)
@given(fds.sharded_cases(mesh=fds.meshes(max_devices=8), allow_partial=True, dtype=torch.float32))
def test_shard_table_matches_torch_public_rule_drawn(no_process_group, case):
    table = case.table
    expected = _torch_public_rule(case.mesh.shape, torch_placements(case.layout), case.global_shape)
    assert list(zip(table.local_shapes, table.offsets, strict=True)) == expected

"""DTensor on the simulated backend, against direct slicing of the global tensor.

The oracle is a plain loop over devices: device k's shard is the block of the global tensor at
``shard_table`` offset/shape k (torch's own rule, checked in test_sharding.py), and a Partial
value is the reduction, in mesh order, of the shards of the devices that differ only in their
Partial coordinates.
"""

from __future__ import annotations

import itertools
import math

import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

NAMESPACE = "functional_dtensor"


def global_value(shape, dtype) -> torch.Tensor:
    """Distinct, signed values (so that a wrong block or a wrong max/min shows)."""
    n = math.prod(shape)
    values = torch.arange(n, dtype=torch.float64) - n // 3
    if dtype.is_floating_point:
        values = values * 0.5
    return values.reshape(shape).to(dtype)


def block(tensor: torch.Tensor, table, device: int) -> torch.Tensor:
    index = tuple(
        slice(o, o + s) for o, s in zip(table.offsets[device], table.local_shapes[device], strict=True)
    )
    return tensor[index]


def assert_same(got: torch.Tensor, expected: torch.Tensor, *, exact: bool = True, terms: int = 1) -> None:
    """Equal, or (``exact=False``) close to the rounding of a sum of ``terms`` values."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if exact:
        assert torch.equal(got, expected)
    else:
        tolerance = max(terms * torch.finfo(got.dtype).eps, 1.3e-6)
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


REDUCE = {
    "sum": lambda ts: torch.stack(ts).sum(0, dtype=ts[0].dtype),
    "avg": lambda ts: (
        torch.stack(ts).sum(0, dtype=ts[0].dtype) / len(ts)
        if ts[0].is_floating_point()
        else torch.stack(ts).sum(0, dtype=ts[0].dtype).div(len(ts), rounding_mode="floor")
    ),
    "max": lambda ts: torch.stack(ts).amax(0),
    "min": lambda ts: torch.stack(ts).amin(0),
}


def reduce_partial_shards(shards, mesh: fd.DeviceMesh, layout: fd.Layout) -> dict:
    """{device: value} for the devices with Partial coordinates 0, each value the reduction of
    its group's shards, axis by axis in mesh order (a plain loop, independent of the library)."""
    values = {mesh.coordinate(k): shards[k] for k in range(mesh.size)}
    for axis, placement in enumerate(layout.placements):
        if not placement.is_partial():
            continue
        reduced = {}
        for coordinate in values:
            if coordinate[axis] == 0:
                group = [
                    values[coordinate[:axis] + (i,) + coordinate[axis + 1 :]] for i in range(mesh.shape[axis])
                ]
                reduced[coordinate] = REDUCE[placement.op](group)
        values = reduced
    return {mesh.flat_index(c): v for c, v in values.items()}


# ---------------------------------------------------------------------------------------------
# distribute_tensor / full_tensor / local shards.


@given(fds.sharded_cases(allow_partial=True, dtype=fds.dtypes(low_precision=True)))
def test_distribute_then_full_tensor_is_the_identity(case):
    mesh, layout, shape, dtype = case
    tensor = global_value(shape, dtype)
    before = tensor.clone()
    x = fd.distribute_tensor(tensor, mesh, layout)
    assert x.shape == torch.Size(shape) and x.dtype == dtype and x.ndim == len(shape)
    assert x.layout == layout and x.placements == layout.placements and x.device_mesh == mesh
    inexact = dtype.is_floating_point and any(
        p == fd.Partial("sum") or p == fd.Partial("avg") for p in layout.placements
    )
    assert_same(x.full_tensor(), tensor, exact=not inexact, terms=mesh.size)
    assert torch.equal(tensor, before)  # the input is not modified


@given(fds.sharded_cases(allow_partial=True, dtype=fds.dtypes()))
def test_every_shard_is_the_block_the_chunk_rule_gives(case):
    mesh, layout, shape, dtype = case
    tensor = global_value(shape, dtype)
    x = fd.distribute_tensor(tensor, mesh, layout)
    table = case.table
    shards = x.local_shards()
    assert len(shards) == mesh.size
    for k in range(mesh.size):
        assert torch.equal(x.to_local(device=k), shards[k])
        assert torch.equal(x.to_local(device=mesh.coordinate(k)), shards[k])
        assert tuple(shards[k].shape) == table.local_shapes[k] and shards[k].dtype == dtype
    if not layout.has_partial:
        for k in range(mesh.size):
            assert torch.equal(shards[k], block(tensor, table, k))
        return
    reduced = reduce_partial_shards(shards, mesh, layout)
    for k, value in reduced.items():
        assert_same(value, block(tensor, table, k), exact=not dtype.is_floating_point, terms=mesh.size)


def test_partial_sum_shards_follow_dtensor():
    """Floats are divided evenly; integers are held by coordinate 0 (a float split would
    change the dtype)."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = fd.distribute_tensor(torch.tensor([4.0, 8.0]), mesh, [fd.Partial(), fd.Shard(0)])
    assert [s.tolist() for s in x.local_shards()] == [[2.0], [4.0], [2.0], [4.0]]
    n = fd.distribute_tensor(torch.tensor([4, 8]), mesh, [fd.Partial(), fd.Shard(0)])
    assert [s.tolist() for s in n.local_shards()] == [[4], [8], [0], [0]]
    m = fd.distribute_tensor(torch.tensor([4, 8]), mesh, [fd.Partial("max"), fd.Replicate()])
    assert [s.tolist() for s in m.local_shards()] == [[4, 8]] * 4


def test_distribute_examples():
    mesh = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(torch.arange(10.0), mesh, fd.P("x"))
    assert [s.tolist() for s in x.local_shards()] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    y = fd.distribute_tensor(
        torch.arange(6).reshape(2, 3), fd.simulated_mesh((2, 2), ("a", "b")), fd.P(None, ("a", "b"))
    )
    assert [s.tolist() for s in y.local_shards()] == [[[0], [3]], [[1], [4]], [[2], [5]], [[], []]]
    z = fd.distribute_tensor(torch.ones(3, 4), mesh, [fd.Shard(-1)])  # negative dims are normalized
    assert z.placements == (fd.Shard(1),) and z.to_local(device=0).shape == (3, 1)
    assert len(z) == 3 and z.size() == (3, 4) and z.size(1) == 4
    assert "DTensor(shape=(3, 4), dtype=torch.float32, layout=S(1)" in repr(z)


# ---------------------------------------------------------------------------------------------
# from_local.


@given(fds.sharded_cases(allow_partial=True, dtype=fds.dtypes()), st.booleans())
def test_from_local_list_of_shards_round_trips(case, run_check):
    mesh, layout, shape, dtype = case
    tensor = global_value(shape, dtype)
    x = fd.distribute_tensor(tensor, mesh, layout)
    shards = [s.clone() for s in x.local_shards()]
    y = fd.from_local(shards, mesh, layout, shape=shape, run_check=run_check)
    assert y.shape == x.shape and y.layout == layout and y.dtype == dtype
    for a, b in zip(y.local_shards(), shards, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(y.full_tensor(), x.full_tensor())
    # a spec works as well as placements where there is one
    if not layout.has_partial:
        assert fd.from_local(shards, mesh, layout.spec, shape=shape).layout == layout
    if case.table.is_even:  # the even split is the default global shape
        assert fd.from_local(shards, mesh, layout).shape == torch.Size(shape)


@given(fds.sharded_cases(even=True, allow_partial=True, dtype=fds.dtypes()))
def test_from_local_single_tensor_is_held_by_every_device(case):
    mesh, layout, shape, dtype = case
    local_shape = case.table.local_shapes[0]
    local = global_value(local_shape, dtype)
    y = fd.from_local(local, mesh, layout, run_check=True)
    assert y.shape == torch.Size(shape)
    assert all(torch.equal(s, local) for s in y.local_shards())
    # the global value: the block tiled along each sharded dim, then Partial axes reduced
    repeats = [math.prod(mesh.shape[a] for a in layout.sharding_axes(d)) for d in range(len(shape))]
    expected = local.repeat(repeats) if repeats else local.clone()
    for axis, placement in enumerate(layout.placements):
        if placement == fd.Partial("sum"):
            expected = expected * mesh.shape[axis]
    inexact = dtype.is_floating_point and layout.has_partial
    assert_same(y.full_tensor(), expected, exact=not inexact, terms=mesh.size)


@given(st.data())
def test_from_local_run_check_catches_unequal_replicas(data):
    mesh = data.draw(fds.meshes().filter(lambda m: max(m.shape) > 1))
    axis = data.draw(st.sampled_from([a for a, size in enumerate(mesh.shape) if size > 1]))
    shape = data.draw(fds.global_shapes(min_side=1, max_dims=3))
    placements = list(data.draw(fds.placements(mesh, len(shape), allow_partial=True)))
    placements[axis] = fd.Replicate()
    # the device at coordinate 1 on the Replicate axis and 0 elsewhere holds a non-empty shard
    k = mesh.flat_index([1 if a == axis else 0 for a in range(mesh.ndim)])
    shards = list(fd.distribute_tensor(global_value(shape, torch.float32), mesh, placements).local_shards())
    shards[k] = shards[k] + 1
    with pytest.raises(fd.LayoutError) as info:
        fd.from_local(shards, mesh, placements, shape=shape, run_check=True)
    message = str(info.value)
    assert "placed Replicate" in message and "Fix:" in message
    named = [n for n, p in zip(mesh.axis_names, placements, strict=True) if f"axis {n!r}" in message]
    assert named and all(placements[mesh.axis_names.index(n)] == fd.Replicate() for n in named)
    fd.from_local(shards, mesh, placements, shape=shape)  # unchecked: accepted


@given(st.data())
def test_from_local_single_tensor_rejects_uneven_shapes(data):
    case = data.draw(fds.sharded_cases(min_dims=1, dtype=torch.float32))
    mesh, layout, shape, _ = case
    parts = {d: math.prod(mesh.shape[a] for a in layout.sharding_axes(d)) for d in range(len(shape))}
    split = [d for d, n in parts.items() if n > 1]
    assume(split)
    dim = data.draw(st.sampled_from(split))
    shape = list(shape)
    shape[dim] = parts[dim] * data.draw(st.integers(0, 2)) + data.draw(st.integers(1, parts[dim] - 1))
    local = torch.zeros(fds.ShardedCase(mesh, layout, tuple(shape), torch.float32).table.local_shapes[0])
    with pytest.raises(fd.ShapeError, match="Fix:"):
        fd.from_local(local, mesh, layout, shape=shape)


def test_from_local_example():
    mesh = fd.simulated_mesh(4, "x")
    shards = [torch.arange(2.0) + 2 * k for k in range(3)] + [torch.zeros(0)]
    x = fd.from_local(shards, mesh, [fd.Shard(0)], shape=(6,))
    assert torch.equal(x.full_tensor(), torch.arange(6.0))
    y = fd.from_local(torch.ones(2), mesh, [fd.Partial()])
    assert torch.equal(y.full_tensor(), torch.full((2,), 4.0))


# ---------------------------------------------------------------------------------------------
# Factories.


def replica_groups(mesh: fd.DeviceMesh, layout: fd.Layout):
    """Groups of devices that differ only in their Replicate (or Partial max/min/avg)
    coordinates: they hold equal shards."""
    groups = {}
    for k in range(mesh.size):
        key = tuple(
            c if p.is_shard() or p == fd.Partial("sum") else 0
            for c, p in zip(mesh.coordinate(k), layout.placements, strict=True)
        )
        groups.setdefault(key, []).append(k)
    return list(groups.values())


FACTORIES = ["zeros", "ones", "empty", "full", "rand", "randn"]


@pytest.mark.parametrize("name", FACTORIES)
@given(case=fds.sharded_cases(allow_partial=True, dtype=fds.dtypes(integral=False)))
def test_factories_shapes_dtypes_and_values(name, case):
    mesh, layout, shape, dtype = case
    if name == "full":
        x = fd.full(shape, 2.5, mesh=mesh, placements=layout, dtype=dtype)
    else:
        x = getattr(fd, name)(shape, mesh=mesh, placements=layout, dtype=dtype)
    assert isinstance(x, fd.DTensor)
    assert x.shape == torch.Size(shape) and x.dtype == dtype and x.layout == layout
    shards = x.local_shards()
    for k, s in enumerate(shards):
        assert tuple(s.shape) == case.table.local_shapes[k] and s.dtype == dtype
    full = x.full_tensor()
    assert full.shape == torch.Size(shape) and full.dtype == dtype
    fills = {"zeros": 0.0, "ones": 1.0, "full": 2.5}
    if name in fills:
        torch.testing.assert_close(full, torch.full(shape, fills[name], dtype=dtype))
    if name == "rand":
        assert bool(((full >= 0) & (full < 1)).all())
    if name in ("rand", "randn", "zeros", "ones", "full"):
        for group in replica_groups(mesh, layout):
            assert all(torch.equal(shards[group[0]], shards[k]) for k in group)


def test_factories_default_dtype_and_size_forms():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    a = fd.zeros(5, 4, mesh=mesh, placements=fd.P("x", "y"))
    b = fd.zeros((5, 4), mesh=mesh, placements=[fd.Shard(0), fd.Shard(1)])
    c = fd.zeros(torch.Size([5, 4]), mesh=mesh, placements=fd.P("x", "y"))
    assert a.shape == b.shape == c.shape == (5, 4) and a.dtype == torch.get_default_dtype()
    assert a.layout == b.layout == c.layout
    assert [tuple(s.shape) for s in a.local_shards()] == [(3, 2), (3, 2), (2, 2), (2, 2)]
    assert fd.ones(3, mesh=mesh, placements=fd.P(), requires_grad=True).requires_grad
    assert not fd.ones(3, mesh=mesh, placements=fd.P()).requires_grad
    assert fd.full((2,), 7, mesh=mesh, placements=fd.P("y"), dtype=torch.int64).full_tensor().tolist() == [
        7,
        7,
    ]
    assert fd.zeros((), mesh=mesh, placements=fd.P()).shape == ()


def test_rand_draws_different_values_on_different_shards():
    mesh = fd.simulated_mesh(4, "x")
    x = fd.rand(4, 64, mesh=mesh, placements=fd.P("x"))
    rows = x.local_shards()
    assert not any(torch.equal(rows[i], rows[j]) for i, j in itertools.combinations(range(4), 2))


# ---------------------------------------------------------------------------------------------
# Values: immutable, pytree leaves, differentiable.


def test_dtensor_is_immutable():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.arange(4.0), mesh, fd.P("x"))
    for name, value in [("shape", (2,)), ("layout", None), ("_storage", None), ("anything", 1)]:
        with pytest.raises(AttributeError, match="immutable"):
            setattr(x, name, value)
    with pytest.raises(AttributeError):
        del x.shape
    assert torch.equal(x.full_tensor(), torch.arange(4.0))


@given(fds.sharded_cases(allow_partial=True, max_dims=2, dtype=torch.float32))
def test_dtensor_is_a_pytree_leaf(case):
    x = fd.distribute_tensor(global_value(case.global_shape, case.dtype), case.mesh, case.layout)
    tree = {"a": x, "b": [x, (1, x)]}
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    assert len(leaves) == 4 and all(leaf is x for i, leaf in enumerate(leaves) if i != 2)
    assert optree.tree_leaves(x, namespace=NAMESPACE) == [x]
    assert optree.tree_unflatten(spec, leaves)["b"][1][1] is x
    mapped = optree.tree_map(lambda v: v, tree, namespace=NAMESPACE)
    assert mapped["a"] is x


@given(fds.sharded_cases(allow_partial=True, max_dims=3, dtype=torch.float64))
def test_gradients_flow_through_distribute_and_full_tensor(case):
    mesh, layout, shape, dtype = case
    tensor = global_value(shape, dtype).requires_grad_(True)
    weight = torch.randn(shape, dtype=dtype)
    x = fd.distribute_tensor(tensor, mesh, layout)
    assert x.requires_grad
    (x.full_tensor() * weight).sum().backward()
    torch.testing.assert_close(tensor.grad, weight)


@given(fds.sharded_cases(max_dims=3, dtype=torch.float64))
def test_gradients_flow_from_local_shards(case):
    """A loss over one replica of every block (devices at Replicate coordinate 0), each shard
    weighted by its block of ``weight``: the gradient is ``weight``."""
    mesh, layout, shape, dtype = case
    tensor = global_value(shape, dtype).requires_grad_(True)
    weight = torch.randn(shape, dtype=dtype)
    x = fd.distribute_tensor(tensor, mesh, layout)
    loss = torch.zeros((), dtype=dtype)
    for k in range(mesh.size):
        if all(c == 0 or p.is_shard() for c, p in zip(mesh.coordinate(k), layout.placements, strict=True)):
            loss = loss + (x.to_local(device=k) * block(weight, case.table, k)).sum()
    loss.backward()
    torch.testing.assert_close(tensor.grad, weight)

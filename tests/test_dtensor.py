"""DTensor and its factories, on the simulated backend and (second half) on both backends,
against direct slicing of the global tensor.

The oracle is a plain loop over devices: device k's shard is the block of the global tensor at
``shard_table`` offset/shape k (torch's own rule, checked in test_sharding.py) or, on both
backends, the nested ``torch.chunk`` of :mod:`backends`; a Partial value is the reduction, in
mesh order, of the shards of the devices that differ only in their Partial coordinates.
"""

from __future__ import annotations

import itertools
import math

import optree
import pytest
import torch
from backends import (
    Mesh,
    all_specs,
    block,
    coordinates,
    local_of,
    per_device,
    reduce_partial,
    relayout,
    spec_of_shards,
)
from common import assert_close
from hypothesis import assume, given, settings
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


def table_block(tensor: torch.Tensor, table, device: int) -> torch.Tensor:
    index = tuple(
        slice(o, o + s) for o, s in zip(table.offsets[device], table.local_shapes[device], strict=True)
    )
    return tensor[index]


def assert_same(got: torch.Tensor, expected: torch.Tensor, *, exact: bool = True, terms: int = 1) -> None:
    """Equal, or (``exact=False``) close to the rounding of a sum of ``terms`` values (the
    shared bound of ``common.assert_close``)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if exact:
        assert torch.equal(got, expected)
    else:
        assert_close(got, expected, terms=terms)


# ---------------------------------------------------------------------------------------------
# distribute_tensor / full_tensor / local shards.


@given(fds.sharded_cases(allow_partial=True, dtype=fds.dtypes(low_precision=True)))
def test_distribute_then_full_tensor_is_the_identity(case):
    mesh, layout, shape, dtype = case
    tensor = global_value(shape, dtype)
    before = tensor.clone()
    x = fd.distribute_tensor(tensor, mesh, layout)
    assert x.shape == torch.Size(shape) and x.dtype == dtype and x.ndim == len(shape)
    assert x.sharding == layout and x.placements == layout.placements and x.device_mesh == mesh
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
            assert torch.equal(shards[k], table_block(tensor, table, k))
        return
    reduced = reduce_partial(shards, mesh.shape, layout.placements)
    assert len(reduced) == mesh.size // math.prod(
        n for n, p in zip(mesh.shape, layout.placements, strict=True) if p.is_partial()
    )
    for coordinate, value in reduced.items():
        k = mesh.flat_index(coordinate)
        assert_same(value, table_block(tensor, table, k), exact=not dtype.is_floating_point, terms=mesh.size)


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
    assert "DTensor(shape=(3, 4), dtype=torch.float32, sharding=S(1)" in repr(z)


# ---------------------------------------------------------------------------------------------
# from_local.


@given(fds.sharded_cases(allow_partial=True, dtype=fds.dtypes()), st.booleans())
def test_from_local_list_of_shards_round_trips(case, run_check):
    mesh, layout, shape, dtype = case
    tensor = global_value(shape, dtype)
    x = fd.distribute_tensor(tensor, mesh, layout)
    shards = [s.clone() for s in x.local_shards()]
    y = fd.from_local(shards, mesh, layout, shape=shape, run_check=run_check)
    assert y.shape == x.shape and y.sharding == layout and y.dtype == dtype
    for a, b in zip(y.local_shards(), shards, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(y.full_tensor(), x.full_tensor())
    # a spec works as well as placements where there is one
    if not layout.has_partial:
        assert fd.from_local(shards, mesh, layout.spec, shape=shape).sharding == layout
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
    assert x.shape == torch.Size(shape) and x.dtype == dtype and x.sharding == layout
    shards = x.local_shards()
    for k, s in enumerate(shards):
        assert tuple(s.shape) == case.table.local_shapes[k] and s.dtype == dtype
    full = x.full_tensor()
    assert full.shape == torch.Size(shape) and full.dtype == dtype
    fills = {"zeros": 0.0, "ones": 1.0, "full": 2.5}
    if name in fills:
        assert_close(full, torch.full(shape, fills[name], dtype=dtype))
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
    assert a.sharding == b.sharding == c.sharding
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
    assert_close(tensor.grad, weight)


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
            loss = loss + (x.to_local(device=k) * table_block(weight, case.table, k)).sum()
    loss.backward()
    assert_close(tensor.grad, weight)


# =============================================================================================
# On both backends (simulated; gloo with 2 and 4 ranks)

S, R, Pa = fd.Shard, fd.Replicate(), fd.Partial


def value_of(shape, dtype: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == "int64":
        return torch.randint(-5, 6, shape, generator=generator)
    return torch.randn(shape, generator=generator, dtype=getattr(torch, dtype))


def job_round_trip(mesh, items) -> list[dict]:
    """distribute_tensor then full_tensor for each ``(shape, layout, dtype, seed)``; the
    gradient of the round trip (the identity) for floating values; and from_local of the
    shards distribute_tensor gave, with and without run_check."""
    out = []
    for shape, layout, dtype, seed in items:
        layout = relayout(mesh, layout)
        value = value_of(shape, dtype, seed)
        x = value.clone().requires_grad_(value.is_floating_point())
        d = fd.distribute_tensor(x, mesh, layout)
        full = d.full_tensor()
        grad = None
        if value.is_floating_point():
            (grad,) = torch.autograd.grad(full, x, torch.ones_like(full) * 3 + value)
        shards = [s.detach() for s in d.local_shards()]
        local = shards if mesh.backend == "simulated" else shards[0]
        again = [fd.from_local(local, mesh, layout, shape=shape, run_check=check) for check in (True, False)]
        out.append(
            {
                "shape": tuple(d.shape),
                "layout": (d.placements, d.sharding.shard_order),
                "shards": shards,
                "full": full.detach(),
                "grad": grad,
                "from_local": [(tuple(a.shape), a.full_tensor()) for a in again],
            }
        )
    return out


def check_round_trips(backend, mesh: Mesh, items) -> None:
    results = backend.run(job_round_trip, mesh.shape, mesh.names, items)
    for k, (shape, layout, dtype, seed) in enumerate(items):
        value = value_of(shape, dtype, seed)
        at = f"{layout} {shape} {dtype} on {mesh}"
        inexact = value.is_floating_point() and any(p in (Pa("sum"), Pa("avg")) for p in layout.placements)
        answers = [r[k] for r in results]
        for p, got in enumerate(answers):
            assert got["shape"] == tuple(shape) and got["layout"] == (
                layout.placements,
                layout.shard_order,
            ), at
            for full in [got["full"], *[f for _, f in got["from_local"]]]:
                if inexact:
                    assert_close(full, value)
                else:
                    assert torch.equal(full, value), f"{at}, process {p}"
            assert all(s == tuple(shape) for s, _ in got["from_local"]), at
            if value.is_floating_point():
                assert_close(got["grad"], torch.ones_like(value) * 3 + value)
        shards = per_device(answers, "shards")
        assert len(shards) == mesh.size and all(s.dtype == value.dtype for s in shards), at
        blocks = reduce_partial(shards, mesh.shape, layout.placements)
        for coordinate, got in blocks.items():
            want = block(value, mesh.shape, mesh.names, spec_of_shards(layout), coordinate)
            if inexact:
                assert_close(got, want)
            else:
                assert torch.equal(got, want), f"{at}: device at {coordinate}"


def items_of(mesh: Mesh, rows) -> list[tuple]:
    sim = mesh.simulated()
    return [
        (shape, fd.Layout.from_spec(sim, spec) if isinstance(spec, fd.P) else fd.Layout(sim, spec), dtype, k)
        for k, (shape, spec, dtype) in enumerate(rows)
    ]


LAYOUTS_1D = [
    ((5, 3), (R,), "float64"),
    ((5, 3), (S(0),), "float64"),  # uneven: 3+2 on 2 ranks, 2+2+1+0 on 4
    ((2, 7), (S(1),), "float32"),
    ((1,), (S(0),), "float64"),  # trailing ranks empty
    ((0, 2), (S(0),), "float64"),  # empty global value
    ((7,), (S(0),), "int64"),
    ((3, 2), (Pa("sum"),), "float64"),
    ((3, 2), (Pa("avg"),), "float64"),
    ((3, 2), (Pa("max"),), "float64"),
    ((3, 2), (Pa("min"),), "float64"),
    ((3, 2), (Pa("sum"),), "int64"),
    ((3,), (Pa("max"),), "int64"),
    ((3,), (Pa("avg"),), "int64"),
]
LAYOUTS_2D = [
    ((5, 3), (S(0), S(1)), "float64"),
    ((7, 2), (S(0), S(0)), "float64"),  # dim 0 split over both axes, unevenly
    ((7, 2), fd.P(("y", "x")), "float64"),  # the same, y major
    ((3, 5), (S(1), S(0)), "float32"),
    ((5,), (R, S(0)), "float64"),
    ((2, 2), (R, R), "float64"),
    ((5, 2), (Pa("sum"), S(0)), "float64"),
    ((2, 3), (S(1), Pa("max")), "float64"),
    ((3,), (Pa("avg"), Pa("min")), "float64"),
    ((4,), (Pa("sum"), Pa("sum")), "int64"),
    ((5,), (Pa("avg"), Pa("avg")), "int64"),
    ((1, 3), (S(0), Pa("sum")), "float64"),
]
LAYOUTS_3D = [
    ((12, 5), fd.P(("z", "x", "y")), "float64"),
    ((7, 5), fd.P(("y", "x"), "z"), "int64"),
    ((5,), (Pa("sum"), S(0), Pa("avg")), "int64"),
]
LAYOUTS = {(2,): LAYOUTS_1D, (4,): LAYOUTS_1D, (2, 2): LAYOUTS_2D, (2, 3, 2): LAYOUTS_3D}


@pytest.mark.meshes(*LAYOUTS)
def test_distribute_full_tensor_and_from_local(backend, mesh):
    check_round_trips(backend, mesh, items_of(mesh, LAYOUTS[mesh.shape]))


@pytest.mark.meshes((4,), (2, 2), (2, 3), (2, 3, 2))
def test_every_spec_of_a_2d_value(backend, mesh):
    """Every spec (each axis on a dim or none, a dim's axes in every order), even and uneven."""
    specs = all_specs(mesh.names, 2)
    rows = [((2 * mesh.size, mesh.size), spec, "float64") for spec in specs]
    rows += [((7, 5), spec, "int64") for spec in specs]
    check_round_trips(backend, mesh, items_of(mesh, rows))


@st.composite
def drawn_items(draw, mesh: Mesh, n: int):
    sim = mesh.simulated()
    items = []
    for k in range(n):
        shape = draw(fds.global_shapes(max_dims=3, max_side=6, max_elements=64))
        layout = draw(fds.layouts(sim, len(shape), allow_partial=True))
        items.append((shape, layout, draw(st.sampled_from(["float64", "float32", "int64"])), k))
    return items


@pytest.mark.meshes((2,), (4,), (2, 2), (2, 3, 2))
@settings(max_examples=5)
@given(data=st.data())
def test_drawn_round_trips(backend, mesh, data):
    check_round_trips(backend, mesh, data.draw(drawn_items(mesh, 6)))


def job_from_local_even(mesh) -> dict:
    """from_local without ``shape``: the shape the shards make up (here an even split; uneven
    ones in test_from_local_of_uneven_shards_agrees_on_the_global_shape). Device d's rows are d."""
    local = [torch.full((2, 3), float(d)) for d in range(mesh.size)]
    d = fd.from_local(local_of(mesh, local), mesh, fd.P(tuple(reversed(mesh.axis_names))))
    return {"shape": tuple(d.shape), "full": d.full_tensor()}


@pytest.mark.meshes((2,), (2, 2))
def test_from_local_without_a_shape_of_even_shards(backend, mesh):
    spec = fd.P(tuple(reversed(mesh.names)))
    for got in backend.run(job_from_local_even, mesh.shape, mesh.names):
        assert got["shape"] == (2 * mesh.size, 3)
        for d, coordinate in enumerate(coordinates(mesh.shape)):
            assert (block(got["full"], mesh.shape, mesh.names, spec, coordinate) == d).all(), coordinate


def job_bad_replicas(mesh) -> str:
    """Shards that differ along a Replicate axis: every process must raise."""
    local = [torch.full((2,), float(d)) for d in range(mesh.size)]
    try:
        fd.from_local(local_of(mesh, local), mesh, (R,) * mesh.ndim, run_check=True)
    except fd.LayoutError as e:
        return type(e).__name__ + ": " + str(e)
    return "no error"


@pytest.mark.meshes((2,), (4,))
def test_from_local_run_check_finds_differing_replicas(backend, mesh):
    for p, got in enumerate(backend.run(job_bad_replicas, mesh.shape, mesh.names)):
        assert got.startswith("LayoutError") and "placed Replicate" in got and "'x'" in got, (p, got)


FACTORIES = [
    ("zeros", (5, 3), (S(0),)),
    ("ones", (5, 3), (S(1),)),
    ("ones", (4,), (Pa("sum"),)),
    ("full", (3, 2), (R,)),
    ("full", (7,), (S(0),)),
    ("empty", (5, 2), (S(0),)),
    ("rand", (6, 2), (S(0),)),
    ("rand", (7, 3), (S(1),)),
    ("randn", (3, 3), (R,)),
    ("randn", (9,), (S(0),)),
]


def job_factories(mesh, seed: int) -> list[dict]:
    """Each factory with every process's generator seeded alike (as usual): the local shards
    and the global value."""
    torch.manual_seed(seed)
    out = []
    for name, shape, placements in FACTORIES:
        placements = placements + (R,) * (mesh.ndim - len(placements))
        if name == "full":
            d = fd.full(shape, 2.5, mesh=mesh, placements=placements, dtype=torch.float64)
        else:
            d = getattr(fd, name)(shape, mesh=mesh, placements=placements, dtype=torch.float64)
        out.append(
            {
                "shape": tuple(d.shape),
                "dtype": d.dtype,
                "shards": list(d.local_shards()),
                "full": d.full_tensor(),
            }
        )
    return out


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_factories(backend, mesh):
    results = backend.run(job_factories, mesh.shape, mesh.names, 0)
    # random values do not depend on the backend: the simulated mesh draws the same
    sim = job_factories(mesh.simulated(), 0)
    fills = {"zeros": 0.0, "ones": 1.0, "full": 2.5}
    for k, (name, shape, placements) in enumerate(FACTORIES):
        answers = [r[k] for r in results]
        at = f"fd.{name} {placements} on {mesh}"
        layout = fd.Layout(mesh.simulated(), placements + (R,) * (len(mesh.shape) - len(placements)))
        table = layout_table(layout, shape)
        shards = per_device(answers, "shards")
        for d, s in enumerate(shards):
            assert tuple(s.shape) == table[d] and s.dtype == torch.float64, at
        for got in answers:
            assert (got["shape"], got["dtype"], got["full"].shape) == (
                shape,
                torch.float64,
                torch.Size(shape),
            ), at
            if name in fills:
                assert torch.equal(got["full"], torch.full(shape, fills[name], dtype=torch.float64)), at
            if name in ("rand", "randn"):
                assert torch.equal(got["full"], sim[k]["full"]), f"{at}: differs from the simulated draw"
        if name == "rand":
            full = answers[0]["full"]
            assert bool(((full >= 0) & (full < 1)).all()), at
        if name in ("rand", "randn") and placements[0].is_shard():  # distinct blocks, distinct draws
            along = [shards[i * (mesh.size // mesh.shape[0])] for i in range(mesh.shape[0])]  # axis 0
            distinct = [s for s in along if s.numel()]
            assert len(distinct) > 1, at
            assert not any(torch.equal(a, b) for a, b in itertools.combinations(distinct, 2)), at


def layout_table(layout: fd.Layout, shape) -> list[tuple[int, ...]]:
    """Each device's local shape, by the oracle."""
    mesh = layout.mesh
    zeros = torch.zeros(shape)
    spec = spec_of_shards(layout)
    return [tuple(block(zeros, mesh.shape, mesh.axis_names, spec, c).shape) for c in coordinates(mesh.shape)]


def job_vmap_full_tensor(mesh):
    """vmap over distribute_tensor + full_tensor; an error is returned, not raised (every
    process fails alike, before any data moves)."""
    import traceback

    batch = torch.arange(16.0).reshape(2, 4, 2)
    try:
        return torch.func.vmap(lambda a: fd.distribute_tensor(a, mesh, fd.P(mesh.axis_names)).full_tensor())(
            batch
        )
    except Exception:
        return traceback.format_exc()


@pytest.mark.meshes((2,), (2, 2))
def test_vmap_of_distribute_and_full_tensor(backend, mesh):
    for p, got in enumerate(backend.run(job_vmap_full_tensor, mesh.shape, mesh.names)):
        assert isinstance(got, torch.Tensor), f"process {p}:\n{got}"
        assert torch.equal(got, torch.arange(16.0).reshape(2, 4, 2)), p


# ---------------------------------------------------------------------------------------------
# from_local: every process agrees on the global shape, or every process raises.


UNEVEN = [  # (spec over the mesh's names, global shape): splits of torch.chunk that are uneven
    (lambda names: fd.P(names[0]), (5, 3)),
    (lambda names: fd.P(None, tuple(names)), (2, 7)),
    (lambda names: fd.P(names[-1], names[0]) if len(names) > 1 else fd.P(None, names[0]), (3, 5)),
]


def job_from_local_uneven(mesh) -> list:
    """Uneven shards without ``shape``: the global shape comes from every device's shard."""
    out = []
    for spec_of, shape in UNEVEN:
        spec = spec_of(mesh.axis_names)
        value = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        shards = [block(value, mesh.shape, mesh.axis_names, spec, c) for c in coordinates(mesh.shape)]
        x = fd.from_local(local_of(mesh, shards), mesh, spec)
        out.append({"shape": tuple(x.shape), "full": x.full_tensor()})
    return out


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_from_local_of_uneven_shards_agrees_on_the_global_shape(backend, mesh):
    """Regression: each rank took its own shard for an even split's, and the ranks built
    values of different shapes (uninitialised memory on one, an abort on the other)."""
    for p, results in enumerate(backend.run(job_from_local_uneven, mesh.shape, mesh.names)):
        for (_, shape), got in zip(UNEVEN, results, strict=True):
            value = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
            assert got["shape"] == shape and torch.equal(got["full"], value), (p, shape)


MISMATCHES = {  # what differs on the last device, and the error every process must raise
    "dtype": ("InputTypeError", "dtype differs", lambda t: t.double()),
    "requires_grad": ("InputTypeError", "requires_grad differs", lambda t: t.requires_grad_()),
    "device": ("InputTypeError", "device type differs", lambda t: t.to("meta")),
    "rank": ("ShapeError", "ndim differs", lambda t: t.unsqueeze(-1)),
    "trailing shape": ("ShapeError", "fit no global shape", lambda t: torch.cat([t, t], 1)),
    "sharded size": ("ShapeError", "fit no global shape", lambda t: torch.cat([t, t], 0)),
}


def job_from_local_mismatch(mesh, what: str, shape_given: bool) -> str:
    shards = [torch.full((2, 3), float(d)) for d in range(mesh.size)]
    shards[-1] = MISMATCHES[what][2](shards[-1])
    shape = (2 * mesh.size, 3) if shape_given else None
    try:
        fd.from_local(local_of(mesh, shards), mesh, fd.P(mesh.axis_names), shape=shape, run_check=True)
    except fd.FunctionalDTensorError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.meshes((2,), (4,))
@pytest.mark.parametrize("what", list(MISMATCHES))
@pytest.mark.parametrize("shape_given", [False, True], ids=["no-shape", "shape"])
def test_from_local_run_check_finds_shards_that_disagree(backend, mesh, what, shape_given):
    """Every process raises the same error (none waits in a collective for a peer that left),
    naming the property and the device."""
    error, text, _ = MISMATCHES[what]
    if shape_given and what in ("trailing shape", "sharded size"):
        text = "do not fit global shape"
    for p, got in enumerate(backend.run(job_from_local_mismatch, mesh.shape, mesh.names, what, shape_given)):
        assert got.startswith(f"{error}: fd.from_local(local_tensor)") and text in got, (p, got)
        assert f"device {mesh.size - 1}" in got, (p, got)


def job_to_local_of_another_device(mesh) -> list[str]:
    x = fd.distribute_tensor(torch.arange(8.0), mesh, fd.P("x"))
    out = []
    for device in range(mesh.size):
        try:
            out.append(x.to_local(device=device).tolist())
        except fd.FunctionalDTensorError as e:
            out.append(type(e).__name__)
    return out


@pytest.mark.meshes((2,), (4,))
def test_to_local_of_a_device_this_process_does_not_hold_is_an_error(backend, mesh):
    shards = [block(torch.arange(8.0), mesh.shape, mesh.names, fd.P("x"), c) for c in coordinates(mesh.shape)]
    for p, got in enumerate(backend.run(job_to_local_of_another_device, mesh.shape, mesh.names)):
        held = range(mesh.size) if backend.is_simulated else [p]
        for device in range(mesh.size):
            want = shards[device].tolist() if device in held else "InputTypeError"
            assert got[device] == want, (p, device, got)


def job_torch_dtensor(mesh) -> list[str]:
    """A torch.distributed.tensor.DTensor given where a plain tensor is expected."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch_mesh = init_device_mesh("cpu", (mesh.size,))
    x = distribute_tensor(torch.arange(8.0), torch_mesh, [Shard(0)])
    calls = [
        lambda: fd.distribute_tensor(x, mesh, fd.P()),
        lambda: fd.from_local(x, mesh, fd.P("x")),
        lambda: fd.shard_map(lambda v: v, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"))(x),
    ]
    out = []
    for call in calls:
        try:
            call()
            out.append("no error")
        except fd.FunctionalDTensorError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.meshes((2,))
def test_a_torch_dtensor_is_refused_with_the_conversion_to_use(backend, mesh):
    """Regression: a torch DTensor (a torch.Tensor subclass) was taken for a plain tensor and
    nested into a corrupt value."""
    if backend.is_simulated:
        pytest.skip("a torch DTensor needs a process group")
    for p, got in enumerate(backend.run(job_torch_dtensor, mesh.shape, mesh.names)):
        apis = ["fd.distribute_tensor(tensor)", "fd.from_local(local_tensor)", "fd.shard_map(args[0])"]
        fixes = ["x.full_tensor()", "x.to_local()", "fd.from_torch(x)"]
        for got_one, api, fix in zip(got, apis, fixes, strict=True):
            assert got_one.startswith(f"InputTypeError: {api}") and "torch DTensor" in got_one, (p, got_one)
            assert fix in got_one, (p, got_one)


def job_meta_values(mesh) -> dict:
    """Meta values: every factory, a redistribute and the global value, with no memory and no
    communication."""
    spec = fd.P(*mesh.axis_names[:2]) if mesh.ndim > 1 else fd.P(mesh.axis_names[0])
    out = {}
    with fd.CommDebugMode() as comm:
        values = {
            "zeros": fd.zeros(5, 6, mesh=mesh, placements=spec, device="meta"),
            "randn": fd.randn((5, 6), mesh=mesh, placements=spec, dtype=torch.float64, device="meta"),
            "full": fd.full((5, 6), 3, mesh=mesh, placements=spec, device=torch.device("meta")),
            "partial": fd.ones(5, 6, mesh=mesh, placements=[fd.Partial()] * mesh.ndim, device="meta"),
        }
        for name, x in values.items():
            moved = x.redistribute(fd.P(None, mesh.axis_names[-1]))
            out[name] = {
                "is_meta": (x.is_meta, moved.is_meta, x.full_tensor().is_meta),
                "dtype": x.dtype,
                "shards": [s.shape for s in x.local_shards()],
                "moved": [s.shape for s in moved.local_shards()],
                "full": tuple(x.full_tensor().shape),
            }
    out["communication"] = comm.get_total_counts()
    return out


@pytest.mark.meshes((2,), (2, 2), (4,))
def test_meta_values_hold_shapes_and_layouts_without_memory_or_communication(backend, mesh):
    for got in backend.run(job_meta_values, mesh.shape, mesh.names):
        assert got.pop("communication") == 0
        assert got["full"]["dtype"] == torch.int64 and got["randn"]["dtype"] == torch.float64
        for name, value in got.items():
            assert value["is_meta"] == (True, True, True), name
            assert value["full"] == (5, 6)
    real = fd.zeros(5, 6, mesh=fd.simulated_mesh(mesh.shape, mesh.names), placements=fd.P())
    assert not real.is_meta


def test_a_factory_on_another_device_is_refused():
    mesh = fd.simulated_mesh(2, "x")
    for device in ("cuda:0", torch.device("cuda"), 3):
        with pytest.raises(fd.InputTypeError, match=r"fd\.zeros\(device\).*'meta'"):
            fd.zeros(4, mesh=mesh, placements=fd.P(), device=device)
    assert fd.zeros(4, mesh=mesh, placements=fd.P(), device="cpu").full_tensor().tolist() == [0.0] * 4

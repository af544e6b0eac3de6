"""The shipped hypothesis strategies: arguments are checked eagerly, values are valid, and the
interesting cases (uneven, empty, nested, partial, 3-d meshes) are actually drawn."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import functional_dtensor as fd
import functional_dtensor.testing
from functional_dtensor._sharding import check_divisible
from functional_dtensor.testing import strategies as fds

MESH = fd.simulated_mesh((2, 3), ("x", "y"))


def test_testing_package_exposes_strategies():
    assert functional_dtensor.testing.strategies is fds
    assert set(fds.__all__) >= {
        "meshes",
        "placements",
        "specs",
        "layouts",
        "global_shapes",
        "dtypes",
        "sharded_cases",
        "ShardedCase",
    }


# ---------------------------------------------------------------------------------------------
# Eager argument checks: the error comes from the call, before anything is drawn.

BAD_ARGUMENTS = [
    ("meshes-min-dims-0", lambda: fds.meshes(min_dims=0), "min_dims"),
    ("meshes-min-gt-max", lambda: fds.meshes(min_dims=3, max_dims=2), "min_dims, max_dims"),
    ("meshes-max-devices-0", lambda: fds.meshes(max_devices=0), "max_devices"),
    ("meshes-max-devices-float", lambda: fds.meshes(max_devices=8.0), "max_devices"),
    ("meshes-max-dims-bool", lambda: fds.meshes(max_dims=True), "max_dims"),
    ("meshes-too-many-dims", lambda: fds.meshes(max_dims=9), "max_dims"),
    ("meshes-names-str", lambda: fds.meshes(axis_names="xy"), "axis_names"),
    ("meshes-names-repeated", lambda: fds.meshes(axis_names=("x", "x")), "axis_names"),
    ("meshes-names-not-identifiers", lambda: fds.meshes(axis_names=("a b",)), "axis_names"),
    ("meshes-names-too-few", lambda: fds.meshes(max_dims=3, axis_names=("x", "y")), "max_dims"),
    ("meshes-max-side-0", lambda: fds.meshes(max_side=0), "max_side"),
    ("placements-mesh", lambda: fds.placements((2, 2), 2), "placements(mesh)"),
    ("placements-ndim", lambda: fds.placements(MESH, -1), "placements(ndim)"),
    ("placements-flag", lambda: fds.placements(MESH, 2, allow_partial="yes"), "allow_partial"),
    ("placements-ops", lambda: fds.placements(MESH, 2, partial_ops=("prod",)), "partial_ops"),
    ("placements-ops-str", lambda: fds.placements(MESH, 2, partial_ops="sum"), "partial_ops"),
    ("placements-ops-empty", lambda: fds.placements(MESH, 2, partial_ops=()), "partial_ops"),
    ("specs-mesh", lambda: fds.specs("mesh", 2), "specs(mesh)"),
    ("specs-ndim", lambda: fds.specs(MESH, 1.5), "specs(ndim)"),
    ("layouts-ndim", lambda: fds.layouts(MESH, -2), "layouts(ndim)"),
    ("layouts-ops", lambda: fds.layouts(MESH, 2, partial_ops=["sum", "mean"]), "partial_ops"),
    ("shapes-min-gt-max", lambda: fds.global_shapes(3, 2), "min_dims, max_dims"),
    ("shapes-negative-side", lambda: fds.global_shapes(min_side=-1), "min_side"),
    ("shapes-side-bounds", lambda: fds.global_shapes(min_side=5, max_side=4), "min_side, max_side"),
    ("shapes-budget", lambda: fds.global_shapes(max_dims=4, min_side=8, max_elements=100), "max_elements"),
    ("shapes-max-elements-0", lambda: fds.global_shapes(max_elements=0), "max_elements"),
    ("dtypes-none", lambda: fds.dtypes(floating=False, integral=False), "dtypes"),
    ("dtypes-flag", lambda: fds.dtypes(floating=1), "floating"),
    ("cases-mesh", lambda: fds.sharded_cases(mesh=4), "sharded_cases(mesh)"),
    ("cases-dtype", lambda: fds.sharded_cases(dtype="float32"), "sharded_cases(dtype)"),
    ("cases-dims", lambda: fds.sharded_cases(min_dims=2, max_dims=1), "min_dims, max_dims"),
    ("cases-even", lambda: fds.sharded_cases(even=None), "even"),
    ("cases-budget", lambda: fds.sharded_cases(min_side=5, max_elements=10), "max_elements"),
]


@pytest.mark.parametrize("call, argument", [c[1:] for c in BAD_ARGUMENTS], ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_raise_at_call_time(call, argument):
    with pytest.raises(InvalidArgument) as info:
        call()  # no .example(), no drawing: the check is eager
    message = str(info.value)
    assert message.startswith("fd.testing.strategies.") and argument in message
    assert ": expected " in message and ", got " in message and ". Fix: " in message


#: a mesh argument -> what the meshes drawn from it satisfy
MESH_ARGUMENTS = {
    "a mesh": (MESH, lambda m: m == MESH),
    "a strategy of meshes": (fds.meshes(max_devices=4), lambda m: m.size <= 4),
    "st.just": (st.just(MESH), lambda m: m == MESH),
}


@pytest.mark.parametrize("mesh_argument, is_mesh", list(MESH_ARGUMENTS.values()), ids=list(MESH_ARGUMENTS))
@given(data=st.data())
def test_strategies_accept_a_mesh_or_a_strategy_of_meshes(mesh_argument, is_mesh, data):
    """Each strategy taking a mesh takes a mesh or a strategy drawing meshes, and draws values
    on that mesh."""
    placements = data.draw(fds.placements(mesh_argument, 2))
    assert all(isinstance(p, fd.Placement) for p in placements)
    assert 1 <= len(placements) <= 4 and (len(placements) == 2 or not is_mesh(MESH))
    spec = data.draw(fds.specs(mesh_argument, 2))
    assert isinstance(spec, fd.P) and len(spec) <= 2
    layout = data.draw(fds.layouts(mesh_argument, 2))
    assert isinstance(layout, fd.Layout) and is_mesh(layout.mesh)
    case = data.draw(fds.sharded_cases(mesh=mesh_argument))
    assert is_mesh(case.mesh) and case.layout.mesh == case.mesh


# ---------------------------------------------------------------------------------------------
# Valid values.


@given(fds.meshes())
def test_meshes_defaults(mesh):
    assert isinstance(mesh, fd.DeviceMesh) and mesh.backend == "simulated"
    assert 1 <= mesh.ndim <= 3 and 1 <= mesh.size <= 64 and all(s >= 1 for s in mesh.shape)
    assert set(mesh.axis_names) <= set(fds.AXIS_NAMES) and len(set(mesh.axis_names)) == mesh.ndim


@given(fds.meshes(2, 2, 6, max_side=3))
def test_meshes_bounds(mesh):
    assert mesh.ndim == 2 and mesh.size <= 6 and max(mesh.shape) <= 3


@given(fds.meshes(axis_names=("dp", "tp", "pp"), min_dims=1))
def test_meshes_named(mesh):
    assert mesh.axis_names == ("dp", "tp", "pp")[: mesh.ndim]


@given(fds.meshes(axis_names=("dp", "tp")))
def test_meshes_named_default_rank(mesh):
    assert mesh.axis_names == ("dp", "tp")


@given(st.data())
def test_placements_are_valid(data):
    mesh = data.draw(fds.meshes())
    ndim = data.draw(st.integers(0, 4))
    ops = data.draw(st.lists(st.sampled_from(["sum", "avg", "max", "min"]), min_size=1, unique=True))
    negative = data.draw(st.booleans())
    placements = data.draw(
        fds.placements(mesh, ndim, allow_partial=True, partial_ops=ops, negative_dims=negative)
    )
    assert len(placements) == mesh.ndim
    for p in placements:
        assert isinstance(p, (fd.Shard, fd.Replicate, fd.Partial))
        if p.is_shard():
            assert (-ndim if negative else 0) <= p.dim < ndim
        if p.is_partial():
            assert p.op in ops
    fd.Layout(mesh, placements).normalized(ndim)  # raises if invalid


@given(st.data())
def test_placements_without_partial(data):
    mesh = data.draw(fds.meshes())
    placements = data.draw(fds.placements(mesh, data.draw(st.integers(0, 3))))
    assert not any(p.is_partial() for p in placements)
    assert all(p.dim >= 0 for p in placements if p.is_shard())


@given(st.data())
def test_specs_are_valid(data):
    mesh = data.draw(fds.meshes())
    ndim = data.draw(st.integers(0, 4))
    spec = data.draw(fds.specs(mesh, ndim))
    assert isinstance(spec, fd.P) and len(spec) <= ndim
    assert set(spec.axis_names) <= set(mesh.axis_names)
    fd.Layout.from_spec(mesh, spec).normalized(ndim)  # raises if invalid
    t = torch.zeros([2] * ndim)
    assert fd.distribute_tensor(t, mesh, spec).shape == t.shape


@given(st.data())
def test_layouts_are_valid(data):
    mesh = data.draw(fds.meshes())
    ndim = data.draw(st.integers(0, 4))
    allow_partial = data.draw(st.booleans())
    layout = data.draw(fds.layouts(mesh, ndim, allow_partial=allow_partial))
    assert isinstance(layout, fd.Layout) and layout.mesh == mesh
    assert layout.normalized(ndim) == layout
    assert allow_partial or not layout.has_partial


@given(fds.global_shapes())
def test_global_shapes_defaults(shape):
    assert isinstance(shape, tuple) and len(shape) <= 4
    assert all(isinstance(s, int) and 0 <= s <= 12 for s in shape)
    assert math.prod(s for s in shape if s) <= 2048


@given(fds.global_shapes(2, 3, min_side=2, max_side=9, max_elements=100))
def test_global_shapes_bounds(shape):
    assert 2 <= len(shape) <= 3 and all(2 <= s <= 9 for s in shape) and math.prod(shape) <= 100


@given(fds.dtypes(low_precision=True))
def test_dtypes(dtype):
    assert dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.float16)


@given(fds.dtypes(floating=False))
def test_dtypes_integral(dtype):
    assert not dtype.is_floating_point


@given(fds.sharded_cases())
def test_sharded_cases_defaults(case):
    assert isinstance(case, fds.ShardedCase) and isinstance(case, tuple)
    mesh, layout, shape, dtype = case
    assert layout.mesh == mesh and case.placements == layout.placements
    assert layout.normalized(len(shape)) == layout and not layout.has_partial
    assert case.spec == layout.spec
    assert len(case.table.local_shapes) == mesh.size
    assert isinstance(dtype, torch.dtype)
    assert math.prod(s for s in shape if s) <= 2048


@given(
    fds.sharded_cases(
        mesh=MESH,
        min_dims=1,
        max_dims=2,
        min_side=1,
        max_side=5,
        dtype=torch.int64,
        allow_partial=True,
        partial_ops=("max",),
    )
)
def test_sharded_cases_arguments(case):
    assert case.mesh == MESH and case.dtype == torch.int64
    assert 1 <= len(case.global_shape) <= 2 and all(1 <= s <= 5 for s in case.global_shape)
    assert all(p == fd.Partial("max") for p in case.placements if p.is_partial())


@given(fds.sharded_cases(even=True, allow_partial=True))
def test_sharded_cases_even(case):
    assert case.table.is_even
    check_divisible(case.layout, case.global_shape, where="test")


# ---------------------------------------------------------------------------------------------
# The interesting cases are reachable (each `find` fails the test if none is drawn).

FIND = settings(max_examples=2000, database=None, phases=[Phase.generate])  # no shrinking


@pytest.mark.parametrize(
    "what, condition",
    [
        ("3-d mesh", lambda c: c.mesh.ndim == 3),
        ("64 devices", lambda c: c.mesh.size == 64),
        ("size-1 axis", lambda c: 1 in c.mesh.shape and c.mesh.ndim > 1),
        ("0-d tensor", lambda c: c.global_shape == ()),
        ("empty dim", lambda c: 0 in c.global_shape and c.layout.sharding_axes(c.global_shape.index(0))),
        ("uneven", lambda c: not c.table.is_even),
        (
            "empty shard of a non-empty tensor",
            lambda c: 0 not in c.global_shape and any(0 in s for s in c.table.local_shapes),
        ),
        (
            "nested axes on one dim",
            lambda c: any(len(c.layout.sharding_axes(d)) > 1 for d in range(len(c.global_shape))),
        ),
        (
            "nested uneven on a 3-d mesh",
            lambda c: (
                c.mesh.ndim == 3
                and not c.table.is_even
                and any(len(c.layout.sharding_axes(d)) > 1 for d in range(len(c.global_shape)))
            ),
        ),
        ("every partial op", lambda c: {p.op for p in c.placements if p.is_partial()} >= {"sum", "max"}),
        ("axes not in alphabetical order", lambda c: list(c.mesh.axis_names) != sorted(c.mesh.axis_names)),
        ("a dim's axes out of mesh order", lambda c: c.layout.shard_order != ()),
        (
            "out of mesh order, with a Partial axis",
            lambda c: c.layout.shard_order != () and c.layout.has_partial,
        ),
    ],
)
def test_interesting_cases_are_drawn(what, condition):
    case = find(fds.sharded_cases(allow_partial=True), condition, settings=FIND)
    assert condition(case), what


def _out_of_mesh_order(mesh, spec) -> bool:
    for entry in spec:
        if isinstance(entry, tuple) and list(entry) != sorted(entry, key=mesh.axis_names.index):
            return True
    return False


@pytest.mark.parametrize("ndim", [1, 2])
def test_specs_draw_a_dims_axes_in_any_order(ndim):
    """specs() draws tuples out of mesh order (JAX's meaning: major first), and in mesh order."""
    mesh = fd.simulated_mesh((2, 2, 2), ("x", "y", "z"))
    seen = set()
    for order in find_all(
        fds.specs(mesh, ndim), lambda s: any(isinstance(e, tuple) and len(e) == 3 for e in s)
    ):
        seen.add(order)
    assert seen == {"".join(p) for p in itertools.permutations("xyz")}, seen
    spec = find(fds.specs(mesh, ndim), lambda s: _out_of_mesh_order(mesh, s), settings=FIND)
    assert _out_of_mesh_order(mesh, spec)
    spec = find(
        fds.specs(mesh, ndim),
        lambda s: any(isinstance(e, tuple) for e in s) and not _out_of_mesh_order(mesh, s),
        settings=FIND,
    )
    assert not _out_of_mesh_order(mesh, spec)


def find_all(strategy, condition, n: int = 300) -> set[str]:
    """The orders of three-axis entries among ``n`` drawn values that meet ``condition``."""
    found: set[str] = set()

    @settings(max_examples=n, database=None, phases=[Phase.generate])
    @given(strategy)
    def collect(spec):
        if condition(spec):
            found.update("".join(e) for e in spec if isinstance(e, tuple) and len(e) == 3)

    collect()
    return found

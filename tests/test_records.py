"""Layout records: placements, P, DeviceMesh, Layout are frozen, hashable values with
evaluable reprs and short strs, and convert between placements and specs."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

NAMESPACE = vars(fd)

any_placement = st.one_of(
    st.builds(fd.Shard, st.integers(-4, 4)),
    st.just(fd.Replicate()),
    st.sampled_from([fd.Partial(op) for op in ("sum", "avg", "max", "min")]),
)


@st.composite
def any_record(draw):
    """A placement, a P, a mesh (possibly a sub-mesh, with non-trivial device ids) or a layout."""
    kind = draw(st.sampled_from(["placement", "spec", "mesh", "submesh", "layout"]))
    if kind == "placement":
        return draw(any_placement)
    mesh = draw(fds.meshes())
    if kind == "spec":
        return draw(fds.specs(mesh, draw(st.integers(0, 4))))
    if kind == "mesh":
        return mesh
    if kind == "submesh":
        axes = draw(st.permutations(mesh.axis_names))[: draw(st.integers(1, mesh.ndim))]
        return mesh[tuple(axes)]
    return draw(fds.layouts(mesh, draw(st.integers(0, 4)), allow_partial=True))


# ---------------------------------------------------------------------------------------------
# Values: frozen, hashable, evaluable repr.


@given(any_record())
def test_repr_evaluates_to_an_equal_value_with_an_equal_hash(record):
    again = eval(repr(record), NAMESPACE)
    assert again == record and again is not record
    assert hash(again) == hash(record)
    assert repr(again) == repr(record)


@given(any_record())
def test_records_pickle_and_copy(record):
    for again in (pickle.loads(pickle.dumps(record)), copy.deepcopy(record), copy.copy(record)):
        assert again == record and hash(again) == hash(record)


@given(any_record())
def test_records_are_frozen(record):
    for field in dataclasses.fields(record):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field.name, None)
    # (slots: no new attributes; CPython 3.11's frozen+slots dataclasses raise TypeError here)
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
        record.new_attribute = 1


@given(any_record(), any_record())
def test_equal_iff_same_repr(a, b):
    assert (a == b) == (type(a) is type(b) and repr(a) == repr(b))
    if a == b:
        assert hash(a) == hash(b)


def test_records_work_as_dict_keys_and_set_members():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    keys = {
        fd.Shard(0): 1,
        fd.Replicate(): 2,
        fd.Partial(): 3,
        fd.P("x", None): 4,
        mesh: 5,
        fd.Layout(mesh, (fd.Shard(0), fd.Replicate())): 6,
    }
    assert keys[fd.Shard(0)] == 1 and keys[fd.Partial("sum")] == 3
    assert keys[fd.P(("x",), None)] == 4
    assert keys[fd.simulated_mesh([2, 2], ["x", "y"])] == 5
    assert keys[fd.Layout(fd.simulated_mesh((2, 2), ("x", "y")), [fd.Shard(0), fd.Replicate()])] == 6
    assert len({fd.Shard(0), fd.Shard(0), fd.Shard(1), fd.Replicate(), fd.Replicate()}) == 3


def test_records_of_different_kinds_differ():
    assert fd.Shard(0) != fd.Shard(1)
    assert fd.Shard(0) != fd.Replicate() and fd.Partial("sum") != fd.Partial("max")
    assert fd.P("x") != ("x",) and fd.P("x") != fd.P("x", "y")
    assert fd.simulated_mesh(4, "x") != fd.simulated_mesh(4, "y")
    assert fd.simulated_mesh(4, "x") != fd.simulated_mesh(2, "x")


def test_replace_derives_a_validated_copy():
    mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
    layout = fd.Layout(mesh, (fd.Shard(0), fd.Replicate()))
    other = dataclasses.replace(layout, placements=[fd.Replicate(), fd.Shard(1)])
    assert other.placements == (fd.Replicate(), fd.Shard(1)) and layout.placements[0] == fd.Shard(0)
    with pytest.raises(fd.LayoutError):
        dataclasses.replace(layout, placements=(fd.Replicate(),))
    assert dataclasses.replace(fd.Shard(0), dim=2) == fd.Shard(2)


# ---------------------------------------------------------------------------------------------
# Short forms.


@pytest.mark.parametrize(
    "placement, short, long",
    [
        (fd.Shard(0), "S(0)", "Shard(dim=0)"),
        (fd.Shard(-1), "S(-1)", "Shard(dim=-1)"),
        (fd.Replicate(), "R", "Replicate()"),
        (fd.Partial(), "P(sum)", "Partial(op='sum')"),
        (fd.Partial("avg"), "P(avg)", "Partial(op='avg')"),
        (fd.Partial("max"), "P(max)", "Partial(op='max')"),
        (fd.Partial("min"), "P(min)", "Partial(op='min')"),
    ],
)
def test_placement_str_and_repr(placement, short, long):
    assert str(placement) == short
    assert repr(placement) == long


def test_layout_and_mesh_short_forms():
    mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
    assert str(fd.Layout(mesh, (fd.Shard(0), fd.Partial()))) == "S(0)P(sum)"
    assert str(fd.Layout(mesh, (fd.Replicate(), fd.Shard(1)))) == "RS(1)"
    assert str(mesh) == "simulated mesh [dp=2, tp=4] on cpu"
    assert repr(mesh) == "DeviceMesh(shape=(2, 4), axis_names=('dp', 'tp'))"
    assert repr(fd.P("x", None, ("y", "z"))) == "P('x', None, ('y', 'z'))"
    assert str(fd.P()) == "P()"


@given(st.lists(any_placement, min_size=1, max_size=3))
def test_layout_str_concatenates_placement_strs(placements):
    names = ("a", "b", "c")[: len(placements)]
    layout = fd.Layout(fd.simulated_mesh((2,) * len(placements), names), placements)
    assert str(layout) == "".join(str(p) for p in placements)


# ---------------------------------------------------------------------------------------------
# P canonicalization.


@pytest.mark.parametrize(
    "written, canonical",
    [
        (fd.P(("x",), None), fd.P("x", None)),
        (fd.P((), "y"), fd.P(None, "y")),
        (fd.P(["x", "y"]), fd.P(("x", "y"))),
        (fd.P(("x",), ("y", "z")), fd.P("x", ("y", "z"))),
    ],
)
def test_spec_canonical_forms_are_equal(written, canonical):
    assert written == canonical and hash(written) == hash(canonical)
    assert repr(written) == repr(canonical)


@given(st.data())
def test_spec_entries_written_any_way_canonicalize(data):
    mesh = data.draw(fds.meshes())
    spec = data.draw(fds.specs(mesh, data.draw(st.integers(0, 4))))
    rewritten = []
    for entry in spec:
        if entry is None:
            rewritten.append(data.draw(st.sampled_from([None, (), []])))
        elif isinstance(entry, str):
            rewritten.append(data.draw(st.sampled_from([entry, (entry,), [entry]])))
        else:
            rewritten.append(data.draw(st.sampled_from([entry, list(entry)])))
    again = fd.P(*rewritten)
    assert again == spec and hash(again) == hash(spec)
    assert all(e is None or isinstance(e, str) or (isinstance(e, tuple) and len(e) > 1) for e in again)


def test_spec_sequence_protocol():
    spec = fd.P("x", None, ("y", "z"))
    assert len(spec) == 3 and list(spec) == ["x", None, ("y", "z")] and spec[2] == ("y", "z")
    assert spec.axis_names == ("x", "y", "z")
    assert fd.P().axis_names == () and len(fd.P()) == 0


def test_shard_dim_accepts_integer_likes():
    assert fd.Shard(np.int64(1)) == fd.Shard(1)
    assert type(fd.Shard(np.int64(1)).dim) is int
    assert hash(fd.Shard(np.int64(1))) == hash(fd.Shard(1))


def test_mesh_canonicalizes_its_fields():
    canonical = fd.simulated_mesh((2, 3), ("x", "y"))
    for again in (
        fd.simulated_mesh([2, 3], ["x", "y"]),
        fd.simulated_mesh((np.int64(2), np.int64(3)), ("x", "y")),
        fd.DeviceMesh((2, 3), ("x", "y"), device_ids=range(6)),
    ):
        assert again == canonical and hash(again) == hash(canonical)
    assert fd.simulated_mesh(4, "x") == fd.DeviceMesh((4,), ("x",))


# ---------------------------------------------------------------------------------------------
# Placements <-> P.


@given(st.data())
def test_layout_spec_round_trip(data):
    mesh = data.draw(fds.meshes())
    ndim = data.draw(st.integers(0, 4))
    layout = data.draw(fds.layouts(mesh, ndim))
    spec = layout.spec
    assert fd.Layout.from_spec(mesh, spec) == layout
    # independent check of what the spec says: entry d lists the axes on Shard(d), major first:
    # in mesh order, unless the layout's shard order says otherwise
    order = dict(layout.shard_order)
    for dim in range(ndim):
        positions = order.get(dim) or [a for a, p in enumerate(layout.placements) if p == fd.Shard(dim)]
        entry = spec[dim] if dim < len(spec) else None
        assert fd.P(entry) == fd.P(tuple(mesh.axis_names[a] for a in positions))
    assert len(spec) == 0 or spec[-1] is not None  # trailing unsplit dims are omitted


@given(st.data())
def test_spec_layout_round_trip(data):
    mesh = data.draw(fds.meshes())
    spec = data.draw(fds.specs(mesh, data.draw(st.integers(0, 4))))
    layout = fd.Layout.from_spec(mesh, spec)
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    assert layout.spec == fd.P(*entries)
    for axis, name in enumerate(mesh.axis_names):
        dims = [d for d, e in enumerate(spec) if name in fd.P(e).axis_names]
        assert layout.placements[axis] == (fd.Shard(dims[0]) if dims else fd.Replicate())


def test_a_dims_axes_in_any_order():
    """A tuple entry lists axes major first, in any order (JAX's meaning); an order other than
    the mesh's is the layout's shard order (torch's), shown as each axis's rank in it."""
    mesh = fd.simulated_mesh((2, 2, 2), ("x", "y", "z"))
    layout = fd.Layout.from_spec(mesh, fd.P(("z", "x"), "y"))
    assert layout.placements == (fd.Shard(0), fd.Shard(1), fd.Shard(0))
    assert layout.shard_order == ((0, (2, 0)),) and layout.sharding_axes(0) == (2, 0)
    assert str(layout) == "S(0)[1]S(1)S(0)[0]" and layout.spec == fd.P(("z", "x"), "y")
    assert layout != fd.Layout.from_spec(mesh, fd.P(("x", "z"), "y"))
    assert fd.Layout.from_spec(mesh, fd.P(("x", "z"), "y")).shard_order == ()  # mesh order: none recorded
    assert fd.Layout(mesh, layout.placements, ((0, (0, 2)),)) == fd.Layout(mesh, layout.placements)
    assert eval(repr(layout), NAMESPACE) == layout
    assert layout.normalized(2) is layout
    negative = fd.Layout(mesh, (fd.Shard(-2), fd.Shard(1), fd.Shard(-2)), ((-2, (2, 0)),))
    assert negative.normalized(2) == layout
    three = fd.Layout.from_spec(mesh, fd.P(("y", "z", "x")))
    assert three.sharding_axes(0) == (1, 2, 0) and str(three) == "S(0)[2]S(0)[0]S(0)[1]"


def test_layout_from_spec_examples():
    mesh = fd.simulated_mesh((2, 2, 2), ("x", "y", "z"))
    assert fd.Layout.from_spec(mesh, fd.P()).placements == (fd.Replicate(),) * 3
    assert fd.Layout.from_spec(mesh, fd.P(None, ("x", "z"))).placements == (
        fd.Shard(1),
        fd.Replicate(),
        fd.Shard(1),
    )
    assert fd.Layout(mesh, (fd.Shard(0), fd.Shard(0), fd.Shard(0))).spec == fd.P(("x", "y", "z"))
    assert fd.Layout(mesh, (fd.Replicate(), fd.Shard(2), fd.Replicate())).spec == fd.P(None, None, "y")
    # a spec in place of the placements builds the spec's layout
    assert fd.Layout(mesh, fd.P(("z", "x"))) == fd.Layout.from_spec(mesh, fd.P(("z", "x")))
    assert fd.Layout(mesh, fd.P(None, "y")).placements == (fd.Replicate(), fd.Shard(1), fd.Replicate())
    with pytest.raises(fd.LayoutError, match="unknown mesh axis"):
        fd.Layout(mesh, fd.P("w"))
    with pytest.raises(fd.LayoutError, match="order in the spec"):
        fd.Layout(mesh, fd.P(("x", "y")), ((0, (1, 0)),))


@given(st.data())
def test_partial_layouts_have_no_spec(data):
    mesh = data.draw(fds.meshes())
    layout = data.draw(fds.layouts(mesh, 2, allow_partial=True))
    if layout.has_partial:
        with pytest.raises(fd.LayoutError, match="Fix:"):
            _ = layout.spec
    else:
        assert fd.Layout.from_spec(mesh, layout.spec) == layout


@given(st.data())
def test_normalized_counts_negative_dims_from_the_end(data):
    mesh = data.draw(fds.meshes())
    ndim = data.draw(st.integers(1, 4))
    placements = data.draw(fds.placements(mesh, ndim, negative_dims=True, allow_partial=True))
    layout = fd.Layout(mesh, placements).normalized(ndim)
    expected = tuple(fd.Shard(p.dim % ndim) if p.is_shard() else p for p in placements)
    assert layout.placements == expected
    assert layout.normalized(ndim) == layout


def test_layout_predicates_and_sharding_axes():
    mesh = fd.simulated_mesh((2, 2, 2), ("x", "y", "z"))
    layout = fd.Layout(mesh, (fd.Shard(1), fd.Partial(), fd.Shard(1)))
    assert layout.sharding_axes(1) == (0, 2) and layout.sharding_axes(0) == ()
    assert layout.has_partial and not layout.is_replicated
    assert fd.Layout(mesh, (fd.Replicate(),) * 3).is_replicated
    assert fd.Shard(1).is_shard() and fd.Shard(1).is_shard(1) and not fd.Shard(1).is_shard(0)
    assert fd.Replicate().is_replicate() and fd.Partial().is_partial() and not fd.Partial().is_shard()
    assert fd.Layout(fd.simulated_mesh(2, "x"), fd.Shard(0)).placements == (fd.Shard(0),)


# ---------------------------------------------------------------------------------------------
# Mesh: coordinates and sub-meshes.


@given(fds.meshes())
def test_coordinate_and_flat_index_are_inverse_row_major(mesh):
    grid = np.arange(mesh.size).reshape(mesh.shape)
    seen = set()
    for device in range(mesh.size):
        coordinate = mesh.coordinate(device)
        assert coordinate == tuple(int(c) for c in np.unravel_index(device, mesh.shape))
        assert grid[coordinate] == device
        assert mesh.flat_index(coordinate) == device
        seen.add(coordinate)
    assert len(seen) == mesh.size


@given(fds.meshes())
def test_mesh_sizes(mesh):
    assert mesh.size == int(np.prod(mesh.shape)) and mesh.ndim == len(mesh.shape)
    for position, name in enumerate(mesh.axis_names):
        assert mesh.axis_position(name) == position
        assert mesh.axis_size(name) == mesh.shape[position]
    assert mesh.axis_size(mesh.axis_names) == mesh.size
    assert mesh.axis_size(()) == 1


@given(st.data())
def test_sub_mesh_has_one_group_per_slice(data):
    mesh = data.draw(fds.meshes())
    axes = tuple(data.draw(st.permutations(mesh.axis_names))[: data.draw(st.integers(1, mesh.ndim))])
    positions = [mesh.axis_names.index(a) for a in axes]
    rest = [p for p in range(mesh.ndim) if p not in positions]
    grid = np.arange(mesh.size).reshape(mesh.shape).transpose(positions + rest)
    groups = grid.reshape(-1, int(np.prod([mesh.shape[p] for p in rest], dtype=int))).T  # one row per slice
    expected = sorted(tuple(int(i) for i in row) for row in groups)
    sub = mesh[axes if len(axes) > 1 else axes[0]]
    assert sub.shape == tuple(mesh.shape[p] for p in positions)
    assert sub.axis_names == axes
    assert list(sub.groups) == expected
    assert sub.groups[0] == tuple(
        int(i) for i in grid[(Ellipsis, *[0] * len(rest))].reshape(-1)
    )  # through device 0
    assert sub.backend == mesh.backend and sub.device_type == mesh.device_type
    # slicing again composes, and the sub-mesh is the same data whoever slices it
    assert sub[axes[0]] == mesh[axes[0]]
    assert eval(repr(sub), NAMESPACE) == sub


def test_sub_mesh_example():
    mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
    assert mesh["tp"] == fd.DeviceMesh((4,), ("tp",), device_ids=(0, 1, 2, 3, 4, 5, 6, 7))
    assert mesh["tp"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert mesh["dp"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert mesh[("tp", "dp")].device_ids == (0, 4, 1, 5, 2, 6, 3, 7)
    assert (
        repr(mesh["dp"]) == "DeviceMesh(shape=(2,), axis_names=('dp',), device_ids=(0, 4, 1, 5, 2, 6, 3, 7))"
    )
    with pytest.raises(fd.MeshError, match="'pp'"):
        mesh["pp"]


def test_records_pickle_under_their_public_names():
    """A pickle names ``functional_dtensor.P``, not a private module, so files written today
    load after the package's modules are reorganised."""
    mesh = fd.simulated_mesh((2, 2), ("a", "b"))
    layout = fd.Layout.from_spec(mesh, fd.P(("b", "a")))
    for record in [fd.P("a", None), fd.Shard(1), fd.Replicate(), fd.Partial("avg"), mesh, layout]:
        data = pickle.dumps(record)
        assert b"functional_dtensor._" not in data, record
        assert pickle.loads(data) == record

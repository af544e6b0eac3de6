"""shard_map and collectives reject bad input with the library's errors, naming the path."""

from __future__ import annotations

import pytest
import torch

import functional_dtensor as fd

mesh = fd.simulated_mesh((2, 2), ("x", "y"))


def mapped(f=lambda *a: a[0], in_specs=fd.P("x"), out_specs=fd.P("x"), **kw):
    return fd.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def check(error, builtin, call, *fragments):
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, builtin) and isinstance(info.value, fd.FunctionalDTensorError)
    message = str(info.value)
    assert "Fix:" in message and "expected" in message and "got" in message
    for fragment in fragments:
        assert fragment in message, message


def test_spec_longer_than_rank_names_the_path():
    f = mapped(in_specs=({"w": fd.P("x", None, None)},))
    check(fd.SpecError, ValueError, lambda: f({"w": torch.ones(4, 4)}), "in_specs[0]['w']", "3 entries")


def test_indivisible_dim_gives_the_arithmetic_and_the_fix():
    check(
        fd.ShapeError,
        ValueError,
        lambda: mapped()(torch.ones(5)),
        "5 = 2 * 2 + 1",
        "pad dim 0 to 6",
        "redistribute",
    )


def test_unknown_and_repeated_axis_names():
    check(fd.LayoutError, ValueError, lambda: mapped(in_specs=fd.P("q"))(torch.ones(4)), "'q'")
    check(fd.LayoutError, ValueError, lambda: fd.P("x", "x"), "used twice")


def test_structure_mismatch_uses_optree_prefix_errors():
    f = mapped(in_specs=(fd.P("x"), fd.P()))
    check(fd.SpecError, ValueError, lambda: f(torch.ones(4)), "in_specs", "children")
    g = mapped(in_specs=({"a": fd.P("x")},))
    check(fd.SpecError, ValueError, lambda: g({"b": torch.ones(4)}), "missing key")


def test_dtensor_with_another_layout_says_redistribute():
    x = fd.distribute_tensor(torch.ones(4, 4), mesh, fd.P("y"))
    check(fd.SpecError, ValueError, lambda: mapped()(x), "args[0]", "fd.redistribute")


def test_dtensor_on_another_mesh():
    other = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(torch.ones(4), other, fd.P("x"))
    check(fd.MeshError, ValueError, lambda: mapped()(x), "another mesh")


def test_non_tensor_argument_with_a_spec():
    check(fd.InputTypeError, TypeError, lambda: mapped()([1, 2, 3, 4]), "args[0]", "None")


def test_none_spec_passes_an_argument_through():
    f = mapped(lambda x, k: x * k, in_specs=(fd.P("x"), None))
    assert torch.equal(f(torch.ones(4), 3).full_tensor(), torch.full((4,), 3.0))


def test_spec_leaves_must_be_partition_specs():
    check(fd.InputTypeError, TypeError, lambda: mapped(in_specs=("x",)), "in_specs[0]", "fd.P")


def test_out_spec_claiming_replication_names_output_and_axes():
    f = mapped(lambda x: {"y": x * 2}, out_specs={"y": fd.P()})
    check(fd.SpecError, ValueError, lambda: f(torch.ones(4)), "out_specs['y']", "('x',)", "check_rep=False")
    g = mapped(lambda x: {"y": x * 2}, out_specs={"y": fd.P()}, check_rep=False)
    assert g(torch.ones(4))["y"].shape == (2,)


def test_collective_outside_shard_map_is_an_unbound_axis():
    check(fd.AxisNameError, NameError, lambda: fd.psum(torch.ones(2), "x"), "no shard_map binds", "'x'")


def test_collective_with_an_axis_of_no_mesh():
    f = mapped(lambda x: fd.psum(x, "z"), out_specs=fd.P())
    check(fd.AxisNameError, NameError, lambda: f(torch.ones(4)), "'z'")


def test_collective_shape_errors():
    f = mapped(lambda x: fd.psum_scatter(x, "x"), in_specs=fd.P(), out_specs=fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: f(torch.ones(3)), "tiled=True")
    g = mapped(lambda x: fd.all_to_all(x, "x", 0, 0, tiled=True), in_specs=fd.P(), out_specs=fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: g(torch.ones(3)), "3 = 1 * 2 + 1")
    h = mapped(lambda x: fd.ppermute(x, "x", [(0, 1), (1, 1)]), out_specs=fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: h(torch.ones(4)), "perm")
    k = mapped(lambda x: fd.all_gather(x, "x", axis=3))
    check(fd.ShapeError, ValueError, lambda: k(torch.ones(4)), "axis")


def test_nested_shard_map_is_not_supported_yet():
    inner = mapped()
    outer = mapped(lambda x: inner(x))
    check(fd.FunctionalDTensorError, Exception, lambda: outer(torch.ones(4)), "nested shard_map")


def test_collectives_over_axis_tuples_in_any_order():
    """A tuple of axes indexes devices major first in the order given."""
    mesh_xy = fd.simulated_mesh((2, 3), ("x", "y"))
    x = torch.arange(6.0)
    for axes in (("x", "y"), ("y", "x")):
        index = fd.shard_map(
            lambda v, axes=axes: v * 0 + fd.axis_index(axes),
            mesh=mesh_xy,
            in_specs=fd.P(("x", "y")),
            out_specs=fd.P(("x", "y")),
        )(x).full_tensor()
        # device (i, j) in mesh order; with ("y", "x") its index is j * 2 + i
        expected = [i * 3 + j if axes == ("x", "y") else j * 2 + i for i in range(2) for j in range(3)]
        assert index.tolist() == expected
        gathered = fd.shard_map(
            lambda v, axes=axes: fd.all_gather(v, axes, tiled=True),
            mesh=mesh_xy,
            in_specs=fd.P(("x", "y")),
            out_specs=fd.P(),
            check_rep=False,
        )(x).full_tensor()
        order = sorted(range(6), key=lambda d: expected[d])
        assert gathered.tolist() == [float(d) for d in order]

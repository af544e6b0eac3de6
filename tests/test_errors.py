"""Invalid inputs: each raises the library's own exception, which is also the fitting builtin,
and whose message names the API and argument, says what was expected and what was got, and
ends with the fix."""

# ruff: noqa: E501  (the table keeps one invalid input per line)
from __future__ import annotations

import pytest
import torch

import functional_dtensor as fd

MESH = fd.simulated_mesh((2, 2), ("x", "y"))
MESH_1D = fd.simulated_mesh(4, "x")
T = torch.arange(12.0).reshape(3, 4)


def _distributed(placements, shape=(4, 4), mesh=MESH):
    return fd.distribute_tensor(torch.zeros(shape), mesh, placements)


# (id, call, library error, builtin, text the message must contain: the argument, the values)
# fmt: off
CASES = [
    # --- placements
    ("shard-dim-str", lambda: fd.Shard("0"), fd.InputTypeError, TypeError, ["fd.Shard(dim)", "'0'"]),
    ("shard-dim-float", lambda: fd.Shard(1.0), fd.InputTypeError, TypeError, ["fd.Shard(dim)", "1.0"]),
    ("shard-dim-bool", lambda: fd.Shard(True), fd.InputTypeError, TypeError, ["fd.Shard(dim)", "True"]),
    ("partial-op", lambda: fd.Partial("prod"), fd.LayoutError, ValueError, ["fd.Partial(op)", "'prod'", "'sum'"]),
    # --- P
    ("spec-entry-type", lambda: fd.P(0), fd.InputTypeError, TypeError, ["fd.P(entries[0])", "0"]),
    ("spec-entry-names", lambda: fd.P(None, ("x", 1)), fd.InputTypeError, TypeError, ["entries[1]", "('x', 1)"]),
    ("spec-axis-twice", lambda: fd.P("x", "x"), fd.LayoutError, ValueError, ["entries[1]", "'x'", "entries[0]"]),
    ("spec-axis-twice-tuple", lambda: fd.P(("x", "y"), None, "y"), fd.LayoutError, ValueError, ["entries[2]", "'y'"]),
    # --- meshes
    ("mesh-names-mismatch", lambda: fd.simulated_mesh((2, 2), ("x",)), fd.MeshError, ValueError, ["axis_names", "2 names", "('x',)"]),
    ("mesh-repeated-names", lambda: fd.simulated_mesh((2, 2), ("x", "x")), fd.MeshError, ValueError, ["axis_names", "('x', 'x')"]),
    ("mesh-zero-size", lambda: fd.simulated_mesh((2, 0), ("x", "y")), fd.MeshError, ValueError, ["fd.DeviceMesh(shape)", "(2, 0)"]),
    ("mesh-empty-shape", lambda: fd.DeviceMesh((), ()), fd.MeshError, ValueError, ["fd.DeviceMesh(shape)", "()"]),
    ("mesh-size-type", lambda: fd.simulated_mesh((2.0,), ("x",)), fd.InputTypeError, TypeError, ["fd.DeviceMesh(shape)", "2.0"]),
    ("mesh-name-type", lambda: fd.simulated_mesh((2,), (3,)), fd.InputTypeError, TypeError, ["axis_names", "(3,)"]),
    ("mesh-name-identifier", lambda: fd.simulated_mesh((2,), ("a b",)), fd.InputTypeError, TypeError, ["axis_names", "'a b'"]),
    ("mesh-backend", lambda: fd.DeviceMesh((2,), ("x",), backend="nope"), fd.MeshError, ValueError, ["fd.DeviceMesh(backend)", "'nope'", "'simulated'"]),
    ("mesh-device-ids", lambda: fd.DeviceMesh((2,), ("x",), device_ids=(0, 0)), fd.MeshError, ValueError, ["device_ids", "(0, 0)"]),
    ("mesh-unknown-axis", lambda: MESH["z"], fd.MeshError, ValueError, ["'z'", "('x', 'y')"]),
    ("mesh-axis-size", lambda: MESH.axis_size("z"), fd.MeshError, ValueError, ["'z'", "('x', 'y')"]),
    # --- layouts
    ("layout-mesh-type", lambda: fd.Layout("mesh", (fd.Shard(0),)), fd.InputTypeError, TypeError, ["fd.Layout(mesh)", "str"]),
    ("layout-placement-type", lambda: fd.Layout(MESH, (fd.Shard(0), "R")), fd.InputTypeError, TypeError, ["placements[1]", "'R'"]),
    ("layout-count", lambda: fd.Layout(MESH, (fd.Shard(0),)), fd.LayoutError, ValueError, ["fd.Layout(placements)", "2 for mesh axes", "1: S(0)"]),
    ("from-spec-type", lambda: fd.Layout.from_spec(MESH, ("x",)), fd.InputTypeError, TypeError, ["from_spec(spec)", "('x',)"]),
    ("spec-of-partial", lambda: fd.Layout(MESH, (fd.Partial(), fd.Shard(0))).spec, fd.LayoutError, ValueError, ["fd.Layout.spec", "'x'", "P(sum)S(0)"]),
    ("spec-of-negative-dim", lambda: fd.Layout(MESH_1D, (fd.Shard(-1),)).spec, fd.LayoutError, ValueError, ["fd.Layout.spec", "S(-1)"]),
    ("shard-order-repeats-an-axis", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((0, (0, 0)),)), fd.LayoutError, ValueError, ["fd.Layout(shard_order)", "a permutation of (0, 1)", "(0, 0)"]),
    ("shard-order-misses-an-axis", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((0, (1,)),)), fd.LayoutError, ValueError, ["fd.Layout(shard_order)", "a permutation of (0, 1)", "(1,)"]),
    ("shard-order-of-an-unsplit-dim", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((1, (1, 0)),)), fd.LayoutError, ValueError, ["order of dim 1", "a permutation of ()"]),
    ("shard-order-dim-twice", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((0, (1, 0)), (0, (1, 0)))), fd.LayoutError, ValueError, ["one entry per dim", "each dim at most once"]),
    ("shard-order-type", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), "yx"), fd.InputTypeError, TypeError, ["fd.Layout(shard_order)", "(dim, axes) pairs", "'yx'"]),
    ("normalized-out-of-range", lambda: fd.Layout(MESH_1D, (fd.Shard(2),)).normalized(2), fd.LayoutError, ValueError, ["placements[0]", "[-2, 2)", "2"]),
    # --- distribute_tensor
    ("distribute-unknown-axis", lambda: fd.distribute_tensor(T, MESH, fd.P("z")), fd.LayoutError, ValueError, ["fd.distribute_tensor(placements)(spec[0])", "'z'", "('x', 'y')"]),
    ("distribute-shard-dim", lambda: fd.distribute_tensor(T, MESH, [fd.Shard(2), fd.Replicate()]), fd.LayoutError, ValueError, ["fd.distribute_tensor(placements[0])", "2-d", "[-2, 2)"]),
    ("distribute-shard-negative-dim", lambda: fd.distribute_tensor(T, MESH, [fd.Shard(-3), fd.Replicate()]), fd.LayoutError, ValueError, ["placements[0]", "-3"]),
    ("distribute-0d-shard", lambda: fd.distribute_tensor(torch.tensor(1.0), MESH_1D, [fd.Shard(0)]), fd.LayoutError, ValueError, ["placements[0]", "0-d", "replicated or partial"]),
    ("distribute-count", lambda: fd.distribute_tensor(T, MESH, [fd.Shard(0)]), fd.LayoutError, ValueError, ["fd.distribute_tensor(placements)", "2 for mesh axes", "1: S(0)"]),
    ("distribute-placement-type", lambda: fd.distribute_tensor(T, MESH, ["S0", fd.Replicate()]), fd.InputTypeError, TypeError, ["fd.distribute_tensor(placements[0])", "'S0'"]),
    ("distribute-placements-type", lambda: fd.distribute_tensor(T, MESH, "x"), fd.InputTypeError, TypeError, ["fd.distribute_tensor(placements)", "str"]),
    ("distribute-list", lambda: fd.distribute_tensor([1.0, 2.0], MESH_1D, fd.P()), fd.InputTypeError, TypeError, ["fd.distribute_tensor(tensor)", "list", "torch.as_tensor"]),
    ("distribute-dtensor", lambda: fd.distribute_tensor(_distributed(fd.P()), MESH, fd.P()), fd.InputTypeError, TypeError, ["fd.distribute_tensor(tensor)", "DTensor(", "fd.redistribute"]),
    ("distribute-mesh-type", lambda: fd.distribute_tensor(T, (2, 2), fd.P()), fd.InputTypeError, TypeError, ["device_mesh", "tuple"]),
    ("distribute-layout-other-mesh", lambda: fd.distribute_tensor(T, MESH, fd.Layout(MESH_1D, (fd.Shard(0),))), fd.MeshError, ValueError, ["fd.distribute_tensor(placements)", "another mesh", repr(MESH_1D), repr(MESH)]),
    # --- from_local
    ("from-local-type", lambda: fd.from_local("shard", MESH, fd.P()), fd.InputTypeError, TypeError, ["fd.from_local(local_tensor)", "str"]),
    ("from-local-element-type", lambda: fd.from_local([T, T, T, [1]], MESH, fd.P()), fd.InputTypeError, TypeError, ["local_tensor[3]", "list"]),
    ("from-local-count", lambda: fd.from_local([T, T], MESH, fd.P()), fd.ShapeError, ValueError, ["fd.from_local(local_tensor)", "4 tensors", "2"]),
    ("from-local-shape", lambda: fd.from_local(torch.zeros(2, 2), MESH_1D, fd.P("x"), shape=(9, 2)), fd.ShapeError, ValueError, ["fd.from_local(local_tensor)", "(3, 2)", "(2, 2)", "shape="]),
    ("from-local-shard-shape", lambda: fd.from_local([torch.zeros(2)] * 4, MESH_1D, fd.P("x"), shape=(7,)), fd.ShapeError, ValueError, ["device 3", "(1,)", "(2,)"]),
    ("from-local-rank", lambda: fd.from_local(torch.zeros(2, 2), MESH_1D, fd.P("x"), shape=(8,)), fd.ShapeError, ValueError, ["fd.from_local(shape)", "2 sizes", "(8,)"]),
    ("from-local-uneven-single", lambda: fd.from_local(torch.zeros(2), MESH_1D, fd.P("x"), shape=(7,)), fd.ShapeError, ValueError, ["fd.from_local(local_tensor)", "unevenly", "list"]),
    ("from-local-replicas", lambda: fd.from_local([torch.zeros(2)] * 3 + [torch.ones(2)], MESH_1D, fd.P(), run_check=True), fd.LayoutError, ValueError, ["fd.from_local(local_tensor)", "'x'", "Replicate"]),
    ("from-local-unknown-axis", lambda: fd.from_local(T, MESH, fd.P("z")), fd.LayoutError, ValueError, ["fd.from_local(placements)(spec[0])", "'z'"]),
    ("from-local-mesh-type", lambda: fd.from_local(T, "mesh", fd.P()), fd.InputTypeError, TypeError, ["fd.from_local(device_mesh)", "str"]),
    # --- DTensor
    ("to-local-no-device", lambda: _distributed(fd.P("x")).to_local(), fd.InputTypeError, TypeError, ["fd.DTensor.to_local(device)", "None", "local_shards()"]),
    ("to-local-bad-index", lambda: _distributed(fd.P("x")).to_local(device=4), fd.InputTypeError, TypeError, ["to_local(device)", "[0, 4)", "4"]),
    ("to-local-bad-coordinate", lambda: _distributed(fd.P("x")).to_local(device=(0, 2)), fd.InputTypeError, TypeError, ["to_local(device)", "(2, 2)", "(0, 2)"]),
    # --- factories
    ("zeros-unknown-axis", lambda: fd.zeros(4, 4, mesh=MESH, placements=fd.P("z")), fd.LayoutError, ValueError, ["fd.zeros(placements)", "'z'"]),
    ("ones-shard-dim", lambda: fd.ones((4,), mesh=MESH_1D, placements=[fd.Shard(1)]), fd.LayoutError, ValueError, ["fd.ones(placements[0])", "1-d"]),
    ("full-count", lambda: fd.full((4,), 1.0, mesh=MESH, placements=[fd.Shard(0)]), fd.LayoutError, ValueError, ["fd.full(placements)", "2 for mesh axes"]),
    ("rand-mesh-type", lambda: fd.rand(4, mesh=None, placements=fd.P()), fd.InputTypeError, TypeError, ["fd.rand(device_mesh)", "NoneType"]),
]
# fmt: on


@pytest.mark.parametrize("call, error, builtin, mentions", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_input_raises_a_teaching_error(call, error, builtin, mentions):
    with pytest.raises(fd.FunctionalDTensorError) as info:
        call()
    exc = info.value
    assert type(exc) is error, f"raised {type(exc).__name__}, expected {error.__name__}"
    assert isinstance(exc, builtin) and issubclass(error, builtin)
    assert not isinstance(exc, AssertionError)
    message = str(exc)
    assert message.startswith("fd."), message  # names the API
    assert ": expected " in message and ", got " in message, message
    assert ". Fix: " in message and not message.rstrip().endswith("Fix:"), message
    for text in mentions:
        assert text in message, f"{text!r} not in {message!r}"


def test_every_error_class_is_also_a_builtin():
    pairs = {
        fd.LayoutError: ValueError,
        fd.MeshError: ValueError,
        fd.SpecError: ValueError,
        fd.ShapeError: ValueError,
        fd.InputTypeError: TypeError,
        fd.AxisNameError: NameError,
        fd.CommunicationError: RuntimeError,
    }
    for error, builtin in pairs.items():
        assert issubclass(error, fd.FunctionalDTensorError) and issubclass(error, builtin)


# ---------------------------------------------------------------------------------------------
# Inputs that look odd but are valid.


def test_negative_shard_dims_are_normalized():
    x = fd.distribute_tensor(T, MESH, [fd.Shard(-1), fd.Shard(-2)])
    assert x.placements == (fd.Shard(1), fd.Shard(0))
    assert x.layout == fd.Layout(MESH, (fd.Shard(1), fd.Shard(0)))
    assert torch.equal(x.full_tensor(), T)
    y = fd.from_local([s for s in x.local_shards()], MESH, [fd.Shard(-1), fd.Shard(0)], shape=(3, 4))
    assert y.placements == x.placements and torch.equal(y.full_tensor(), T)
    assert fd.zeros(3, 4, mesh=MESH, placements=[fd.Shard(-1), fd.Replicate()]).placements[0] == fd.Shard(1)


def test_single_placement_and_lists_are_accepted():
    a = fd.distribute_tensor(T, MESH_1D, fd.Shard(0))
    b = fd.distribute_tensor(T, MESH_1D, [fd.Shard(0)])
    c = fd.distribute_tensor(T, MESH_1D, fd.P("x"))
    d = fd.distribute_tensor(T, MESH_1D, fd.Layout(MESH_1D, (fd.Shard(0),)))
    assert a.layout == b.layout == c.layout == d.layout


def test_error_messages_read_in_one_form():
    with pytest.raises(fd.LayoutError) as info:
        fd.distribute_tensor(T, MESH, fd.P(("z", "x")))
    assert str(info.value) == (
        "fd.distribute_tensor(placements)(spec[0]): unknown mesh axis 'z': expected an axis of the "
        "mesh, one of ('x', 'y'), got 'z'. Fix: use the mesh's axis names, or build the mesh with "
        "this axis"
    )


# ---------------------------------------------------------------------------------------------
# The same errors on both backends, raised in every process before any collective runs


def _shard_map(mesh, f, in_specs, out_specs):
    return fd.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


# (call on a 2-device mesh 'x' or a 2 x 2 mesh ('x', 'y'), library error, text of the message)
BOTH_BACKENDS = [
    (
        lambda m: _shard_map(m, lambda v: v, fd.P("x"), fd.P("x"))(torch.ones(5)),
        fd.ShapeError,
        "5 = 2 * 2 + 1",
    ),
    (lambda m: _shard_map(m, lambda v: v, fd.P("x"), fd.P())(torch.ones(4)), fd.SpecError, "check_rep=False"),
    (
        lambda m: _shard_map(m, lambda v: fd.psum(v, "z"), fd.P("x"), fd.P())(torch.ones(4)),
        fd.AxisNameError,
        "'z'",
    ),
    (
        lambda m: _shard_map(m, lambda v: v, fd.P("x"), fd.P("x"))(
            fd.distribute_tensor(torch.ones(4), m, fd.P())
        ),
        fd.SpecError,
        "fd.redistribute",
    ),
    (lambda m: fd.from_local(torch.ones(3), m, fd.P("x"), shape=(4,)), fd.ShapeError, "(2,)"),
    (lambda m: fd.distribute_tensor(T, m, fd.P("q")), fd.LayoutError, "'q'"),
    (lambda m: fd.redistribute(torch.ones(2), fd.P()), fd.InputTypeError, "fd.distribute_tensor"),
]
BOTH_BACKENDS_2D = [  # a dim's axes in another order than the mesh's
    (
        lambda m: _shard_map(m, lambda v: v, fd.P(("y", "x")), fd.P(("y", "x")))(torch.ones(6)),
        fd.ShapeError,
        "('y', 'x')",
    ),
    (
        lambda m: _shard_map(m, lambda v: v, fd.P(("x", "y")), fd.P(("x", "y")))(
            fd.distribute_tensor(torch.ones(8), m, fd.P(("y", "x")))
        ),
        fd.SpecError,
        "fd.redistribute",
    ),
    (lambda m: fd.P(("y", "x"), "x"), fd.LayoutError, "'x'"),
]


def job_raised(mesh, table: str) -> list[str]:
    """The error each call of the table raises here (each before any collective runs)."""
    out = []
    for call, _, _ in {"1d": BOTH_BACKENDS, "2d": BOTH_BACKENDS_2D}[table]:
        try:
            call(mesh)
            out.append("no error")
        except fd.FunctionalDTensorError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.meshes((2,), (2, 2))
def test_errors_are_the_same_on_every_backend(backend, mesh):
    table = "1d" if len(mesh.shape) == 1 else "2d"
    rows = {"1d": BOTH_BACKENDS, "2d": BOTH_BACKENDS_2D}[table]
    want = job_raised(mesh.simulated(), table)
    for p, got in enumerate(backend.run(job_raised, mesh.shape, mesh.names, table)):
        for (_, error, text), g, w in zip(rows, got, want, strict=True):
            assert g.startswith(f"{error.__name__}: fd.") and text in g, (p, g)
            assert g.split(":")[:2] == w.split(":")[:2], (p, g, w)  # the class and the API's argument

"""shard_map on both backends: in and out specs with a dim's axes in any order against the
plain-loop oracle, no_grad, chains of shard_maps through DTensors, values the per-device
function did not get through its specs (closures, pass-through arguments, module parameters,
no inputs); then the errors of shard_map (simulated: they are raised before anything runs; the
same errors on gloo are checked in test_errors.py)."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import optree
import pytest
import torch
from backends import all_specs, block, coordinates, events, per_device
from catalogue import cases, global_inputs
from common import assert_close, check
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

# --- in and out specs in any order --------------------------------------------------------------


def reordered(spec: fd.P, permutation_index: int) -> fd.P:
    """``spec`` with the axes of each dim in another order (a deterministic choice)."""
    entries = []
    for k, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        orders = list(itertools.permutations(axes))
        entries.append(orders[(permutation_index + k) % len(orders)] if axes else None)
    return fd.P(*entries)


def job_identity(mesh, x, pairs) -> list[dict]:
    """The per-device identity from ``in_spec`` to ``out_spec`` for each pair: the output's
    local shards and global value."""
    out = []
    for in_spec, out_spec in pairs:
        y = fd.shard_map(lambda v: v, mesh=mesh, in_specs=in_spec, out_specs=out_spec)(x)
        out.append(
            {
                "shards": y.local_shards(),
                "full": y.full_tensor(),
                "layout": (y.placements, y.sharding.shard_order),
            }
        )
    return out


@pytest.mark.meshes((4,), (2, 2), (2, 3), (2, 3, 2), (3, 1, 2))
def test_in_and_out_specs_in_any_order(backend, mesh):
    """Every spec of a 2-d value, each with another order of its axes as out spec: the device at
    ``c`` receives its oracle block of the input under the in spec, and the output's global
    value holds it at ``c``'s oracle block under the out spec."""
    specs = all_specs(mesh.names, 2)
    pairs = [(spec, reordered(spec, k)) for k, spec in enumerate(specs)]
    assert mesh.size == mesh.shape[0] or any(a != b for a, b in pairs)  # out specs that reorder
    x = torch.arange(4 * mesh.size * mesh.size, dtype=torch.float64).reshape(2 * mesh.size, 2 * mesh.size)
    results = backend.run(job_identity, mesh.shape, mesh.names, x, pairs)
    sim = mesh.simulated()
    for k, (in_spec, out_spec) in enumerate(pairs):
        answers = [r[k] for r in results]
        shards = per_device(answers, "shards")
        want_layout = fd.Layout.from_spec(sim, out_spec)
        for d, coordinate in enumerate(coordinates(mesh.shape)):
            at = f"{in_spec} -> {out_spec}, device {d} at {coordinate}"
            received = block(x, mesh.shape, mesh.names, in_spec, coordinate)
            assert torch.equal(shards[d], received), at
            for answer in answers:
                assert torch.equal(
                    block(answer["full"], mesh.shape, mesh.names, out_spec, coordinate), received
                ), at
        assert all(a["layout"] == (want_layout.placements, want_layout.shard_order) for a in answers)
        if in_spec == out_spec:
            assert all(torch.equal(a["full"], x) for a in answers)


def job_drawn_specs(mesh, x, in_spec, out_spec) -> dict:
    y = fd.shard_map(lambda v: v * 2, mesh=mesh, in_specs=in_spec, out_specs=out_spec)(x)
    return {"shards": y.local_shards()}


@pytest.mark.meshes((2, 2), (2, 3, 2))
@settings(max_examples=10)
@given(data=st.data())
def test_drawn_specs_in_any_order(backend, mesh, data):
    sim = mesh.simulated()
    in_spec = data.draw(fds.specs(sim, 3))
    out_spec = reordered(in_spec, data.draw(st.integers(0, 5)))
    x = torch.randn(2 * mesh.size, mesh.size, mesh.size, dtype=torch.float64)
    shards = per_device(backend.run(job_drawn_specs, mesh.shape, mesh.names, x, in_spec, out_spec), "shards")
    for d, coordinate in enumerate(coordinates(mesh.shape)):
        assert_close(shards[d], 2 * block(x, mesh.shape, mesh.names, in_spec, coordinate))


# --- no_grad -----------------------------------------------------------------------------------

NO_GRAD_CASES = ["psum", "pmax", "all_gather then psum_scatter", "ppermute ring", "mlp"]


def job_no_grad(mesh, axes, name) -> dict:
    """A catalogue case with and without autograd: the values and the collectives of each."""
    case = next(c for c in cases(mesh, axes) if c.name == name)
    mapped = fd.shard_map(case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs)
    runs = {}
    for grad in (True, False):
        inputs = [t.requires_grad_() for t in global_inputs(case, seed=3)]
        with torch.set_grad_enabled(grad), fd.CommDebugMode() as comm:
            out = mapped(*inputs)
            full = out.full_tensor()
        runs[grad] = {"full": full.detach(), "requires_grad": out.requires_grad, "events": events(comm)}
    return runs


@pytest.mark.meshes((2,), (2, 2))
@pytest.mark.parametrize("name", NO_GRAD_CASES)
def test_no_grad_runs_the_same_collectives_for_the_same_values(backend, mesh, name):
    axes = mesh.names
    case = next(c for c in cases(mesh.simulated(), axes) if c.name == name)
    want = case.reference(*global_inputs(case, seed=3))
    for p, got in enumerate(backend.run(job_no_grad, mesh.shape, mesh.names, axes, name)):
        assert got[True]["requires_grad"] and not got[False]["requires_grad"], p
        assert_close(got[False]["full"], want)
        assert_close(got[True]["full"], want)
        assert got[False]["events"] == got[True]["events"] != [], p


# --- chained shard_maps ------------------------------------------------------------------------


def job_chained(mesh) -> dict:
    """Two shard_maps chained through a DTensor (a pre-distributed input, an output fed on),
    differentiated end to end."""
    names = mesh.axis_names
    rows = fd.P(tuple(reversed(names)))  # dim 0 split over every axis, in reverse mesh order
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    x_rows = fd.distribute_tensor(x, mesh, rows)
    first = fd.shard_map(lambda a, b: torch.tanh(a @ b), mesh=mesh, in_specs=(rows, fd.P()), out_specs=rows)
    second = fd.shard_map(
        lambda h: fd.psum(h.square().sum(0, keepdim=True), names), mesh=mesh, in_specs=rows, out_specs=fd.P()
    )
    with fd.CommDebugMode() as comm:
        h = first(x_rows, w)
        out = second(h)
    full = out.full_tensor()
    gx, gw = torch.autograd.grad(full.sum(), (x, w))
    return {
        "h": [s.detach() for s in h.local_shards()],
        "full": full.detach(),
        "grads": (gx, gw),
        "comm": events(comm),
    }


@pytest.mark.meshes((2,), (4,), (2, 2), (2, 2, 2))
def test_chained_shard_maps_on_dtensors(backend, mesh):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    h = torch.tanh(x @ w)
    want = h.square().sum(0, keepdim=True)
    want_grads = torch.autograd.grad(want.sum(), (x, w))
    results = backend.run(job_chained, mesh.shape, mesh.names)
    hs = per_device(results, "h")
    rows = fd.P(tuple(reversed(mesh.names)))
    for d, coordinate in enumerate(coordinates(mesh.shape)):
        assert_close(hs[d], block(h.detach(), mesh.shape, mesh.names, rows, coordinate))
    for p, got in enumerate(results):
        assert_close(got["full"], want.detach())
        for g, w_, what in zip(got["grads"], want_grads, "xw", strict=True):
            assert_close(g, w_, msg=lambda m, what=what, p=p: f"process {p}: gradient of {what}: {m}")
        # the forward runs the psum alone: the DTensor enters and leaves in its layout
        assert [op for op, _, _ in got["comm"]] == ["all_reduce"], got["comm"]


# --- values the per-device function did not get through its specs -------------------------------


def job_captured(mesh, check_rep: bool) -> dict:
    """Closures, a pass-through argument and module parameters: the gradients of the values
    they capture, and the single-device reference of each."""
    torch.manual_seed(0)
    out = {}
    s = torch.tensor(2.0, requires_grad=True)
    f = fd.shard_map(lambda v: v * s, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"), check_rep=check_rep)
    f(torch.arange(8.0)).full_tensor().sum().backward()
    out["closure"] = s.grad

    layer = torch.nn.Linear(3, 2)
    scale = torch.tensor(1.5, requires_grad=True)
    x = torch.randn(8, 3)
    g = fd.shard_map(
        lambda v, k: layer(v) * k,
        mesh=mesh,
        in_specs=(fd.P("x"), None),
        out_specs=fd.P("x"),
        check_rep=check_rep,
    )
    out["module"] = torch.autograd.grad(
        g(x, scale).full_tensor().square().sum(), (layer.weight, layer.bias, scale)
    )
    out["module_reference"] = torch.autograd.grad(
        (layer(x) * scale).square().sum(), (layer.weight, layer.bias, scale)
    )

    r = torch.tensor([1.0, 2.0], requires_grad=True)
    h = fd.shard_map(lambda v: r * 2, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P(), check_rep=check_rep)
    (out["replicated"],) = torch.autograd.grad(h(torch.ones(4)).full_tensor().sum(), r)
    return out


@pytest.mark.meshes((2,), (4,))
@pytest.mark.parametrize("check_rep", [True, False])
def test_captured_values_get_their_global_gradients(backend, mesh, check_rep):
    for p, got in enumerate(backend.run(job_captured, mesh.shape, mesh.names, check_rep)):
        assert got["closure"].item() == 28.0, p  # d/ds sum(v * s) = sum(range(8))
        for a, b in zip(got["module"], got["module_reference"], strict=True):
            assert_close(a, b)
        assert_close(got["replicated"], torch.full((2,), 2.0))


def job_without_inputs(mesh) -> dict:
    no_inputs = fd.shard_map(
        lambda: fd.axis_index("x").reshape(1), mesh=mesh, in_specs=(), out_specs=fd.P("x")
    )
    passed = fd.shard_map(
        lambda k: torch.full((1,), k) + fd.axis_index("x"), mesh=mesh, in_specs=None, out_specs=fd.P("x")
    )
    return {"no_inputs": no_inputs().full_tensor(), "pass_through": passed(10).full_tensor()}


@pytest.mark.meshes((2,), (4,))
def test_functions_without_tensor_inputs(backend, mesh):
    for got in backend.run(job_without_inputs, mesh.shape, mesh.names):
        assert got["no_inputs"].tolist() == list(range(mesh.size))
        assert got["pass_through"].tolist() == [10 + k for k in range(mesh.size)]


def test_transforms_inside_the_function_need_check_rep_off():
    mesh = fd.simulated_mesh(4, "x")
    inner = lambda v: torch.func.vmap(lambda r: r * 2)(v)  # noqa: E731
    f = fd.shard_map(inner, mesh=mesh, in_specs=fd.P(None, "x"), out_specs=fd.P(None, "x"))
    with pytest.raises(fd.FunctionalDTensorError, match="check_rep=False"):
        f(torch.ones(2, 4))
    x = torch.ones(2, 4, requires_grad=True)
    g = fd.shard_map(inner, mesh=mesh, in_specs=fd.P(None, "x"), out_specs=fd.P(None, "x"), check_rep=False)
    (grad,) = torch.autograd.grad(g(x).full_tensor().sum(), x)
    assert_close(grad, torch.full((2, 4), 2.0))
    h = fd.shard_map(
        lambda v: torch.func.grad(lambda t: fd.psum(t.sum(), "x"))(v),
        mesh=mesh,
        in_specs=fd.P("x"),
        out_specs=fd.P("x"),
        check_rep=False,
    )
    # unchecked, psum transposes to psum (as JAX with check_vma=False): each device's
    # gradient of the replicated total counts every device's copy
    assert_close(h(torch.randn(8)).full_tensor(), torch.full((8,), 4.0))


# --- errors ------------------------------------------------------------------------------------

MESH = fd.simulated_mesh((2, 2), ("x", "y"))


def mapped(f=lambda *a: a[0], in_specs=fd.P("x"), out_specs=fd.P("x"), **kw):
    return fd.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs, **kw)


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
    f = mapped(in_specs=fd.P(("y", "x")))  # a dim over two axes, in any order: a multiple of 4
    check(
        fd.ShapeError, ValueError, lambda: f(torch.ones(6)), "6 = 1 * 4 + 2", "('y', 'x')", "pad dim 0 to 8"
    )


def test_unknown_and_repeated_axis_names():
    check(fd.LayoutError, ValueError, lambda: mapped(in_specs=fd.P("q"))(torch.ones(4)), "'q'")
    check(fd.LayoutError, ValueError, lambda: fd.P("x", "x"), "used twice")
    check(fd.LayoutError, ValueError, lambda: fd.P(("y", "x"), "y"), "used twice")


def test_structure_mismatch_uses_optree_prefix_errors():
    f = mapped(in_specs=(fd.P("x"), fd.P()))
    check(fd.SpecError, ValueError, lambda: f(torch.ones(4)), "in_specs", "children")
    g = mapped(in_specs=({"a": fd.P("x")},))
    check(fd.SpecError, ValueError, lambda: g({"b": torch.ones(4)}), "missing key")


def test_dtensor_with_another_layout_says_redistribute():
    x = fd.distribute_tensor(torch.ones(4, 4), MESH, fd.P("y"))
    check(fd.SpecError, ValueError, lambda: mapped()(x), "args[0]", "fd.redistribute")
    # the same axes in another order are another layout
    z = fd.distribute_tensor(torch.ones(4, 4), MESH, fd.P(("y", "x")))
    check(
        fd.SpecError, ValueError, lambda: mapped(in_specs=fd.P(("x", "y")))(z), "args[0]", "fd.redistribute"
    )


def test_dtensor_on_another_mesh():
    other = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(torch.ones(4), other, fd.P("x"))
    check(fd.MeshError, ValueError, lambda: mapped()(x), "another mesh")


def test_non_tensor_argument_with_a_spec():
    check(fd.InputTypeError, TypeError, lambda: mapped()([1, 2, 3, 4]), "args[0]", "None")


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


_X = fd.P("x")


@pytest.mark.parametrize(
    ("shape_of", "out_specs"),
    [
        (lambda x, y: x + y, _X),
        (lambda x, y: (x, y), (_X, _X)),
        (lambda x, y: [x, y], [_X, _X]),
        (lambda x, y: _Pair(x, y), _Pair(_X, _X)),
        (lambda x, y: (x, None), (_X, None)),
        (lambda x, y: {"s": x + y}, {"s": _X}),
    ],
    ids=["tensor", "tuple", "list", "namedtuple", "tuple with None", "dict"],
)
def test_a_warm_call_keeps_the_structures_of_its_arguments_and_outputs(shape_of, out_specs):
    """Arguments and outputs of every structure come back as they went in, on the first call and
    on warm ones (a tensor and a tuple of tensors take their structure from a table)."""
    x = torch.arange(8.0)
    y = fd.distribute_tensor(torch.ones(8), MESH, _X)
    f = mapped(shape_of, in_specs=(_X, _X), out_specs=out_specs)
    want = shape_of(x, torch.ones(8))
    for _ in range(3):
        got = f(x, y)
        leaves, structure = optree.tree_flatten(got, none_is_leaf=True)
        assert structure == optree.tree_structure(want, none_is_leaf=True)
        for g, w in zip(leaves, optree.tree_leaves(want, none_is_leaf=True)):
            assert (g is None and w is None) or torch.equal(g.full_tensor(), w)


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9])
def test_a_warm_call_takes_and_returns_any_number_of_tensors(count):
    """A tuple of tensors takes its structure from a table up to a length (7): longer ones, as
    arguments and as outputs, take optree's, and every one comes back in its place."""
    xs = [fd.distribute_tensor(torch.arange(8.0) + i, MESH, _X) for i in range(count)]
    f = mapped(lambda *a: tuple(v * 2 for v in a), in_specs=_X, out_specs=(_X,) * count)
    for _ in range(3):
        got = f(*xs)
        assert type(got) is tuple and len(got) == count
        for i, g in enumerate(got):
            assert torch.equal(g.full_tensor(), (torch.arange(8.0) + i) * 2)


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


def test_nested_shard_map_is_not_supported_yet():
    inner = mapped()
    outer = mapped(lambda x: inner(x))
    check(fd.FunctionalDTensorError, Exception, lambda: outer(torch.ones(4)), "nested shard_map")


@given(st.data())
def test_any_spec_of_any_mesh_maps_and_returns_the_value(data):
    """shard_map with the same drawn spec in and out (any order of a dim's axes) is the
    identity on the global value, for shapes that divide."""
    case = data.draw(fds.sharded_cases(mesh=fds.meshes(max_devices=12), even=True, max_elements=256))
    x = torch.arange(math.prod(case.global_shape)).reshape(case.global_shape)
    y = fd.shard_map(lambda v: v + 0, mesh=case.mesh, in_specs=case.spec, out_specs=case.spec)(x)
    assert torch.equal(y.full_tensor(), x) and y.sharding == case.layout


def _scaled(v, scale, shift):
    return v * scale + shift, 2.5, fd.psum(v.sum(), "x") * scale


def job_python_scalars(mesh, check_rep: bool) -> dict:
    """Python scalars as arguments and results with spec P(), as JAX: 0-d values."""
    f = fd.shard_map(
        _scaled,
        mesh=mesh,
        in_specs=(fd.P("x"), fd.P(), fd.P()),
        out_specs=(fd.P("x"), fd.P(), fd.P()),
        check_rep=check_rep,
    )
    x = torch.arange(4.0, requires_grad=True)
    y, constant, total = f(x, 3, 0.5)
    (grad,) = torch.autograd.grad(y.full_tensor().sum() + total.full_tensor(), x)
    return {
        "y": y.full_tensor().detach(),
        "constant": constant.full_tensor(),
        "total": total.full_tensor().detach(),
        "shapes": (tuple(constant.shape), tuple(total.shape)),
        "grad": grad,
    }


@pytest.mark.meshes((2,), (4,))
@pytest.mark.parametrize("check_rep", [True, False])
def test_python_scalars_are_zero_dim_values_with_spec_P(backend, mesh, check_rep):
    """Regression: a Python number as an argument or a result with spec P() was refused
    ("must be a tensor")."""
    x = torch.arange(4.0, requires_grad=True)
    want_y, want_total = x * 3 + 0.5, x.sum() * 3
    (want_grad,) = torch.autograd.grad(want_y.sum() + want_total, x)
    for p, got in enumerate(backend.run(job_python_scalars, mesh.shape, mesh.names, check_rep)):
        assert torch.equal(got["y"], want_y.detach()) and torch.equal(got["total"], want_total.detach()), p
        assert torch.equal(got["constant"], torch.tensor(2.5)) and got["shapes"] == ((), ()), p
        assert torch.equal(got["grad"], want_grad), p


def test_attention_inside_shard_map_is_batched_over_the_devices():
    """torch has no vmap rule for scaled_dot_product_attention (it would loop over the devices
    and warn): the device dim folds into its batch dims, values and gradients unchanged."""
    import warnings

    import torch.nn.functional as F

    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    q, k, v = (torch.randn(4, 4, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    cases = [
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), fd.P("dp", "tp")),
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), fd.P(None, "tp")),
    ]
    for attention, spec in cases:
        mapped = fd.shard_map(attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "performance drop" fallback
            out = mapped(q, k, v).full_tensor()
        expected = attention(q, k, v)
        assert_close(out, expected)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v))):
            assert_close(got, want)

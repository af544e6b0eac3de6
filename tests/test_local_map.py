"""``fd.local_map``: a per-device function on global values, with DTensor's semantics.

Values and gradients are compared with the same computation on one device (the global
tensors): on even and uneven layouts, on the simulated backend (batched when every input is
even, a loop over the devices otherwise) and on gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from common import assert_close, check
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

R, S, Pa = fd.Replicate(), fd.Shard, fd.Partial


def job_rows_times_weight(mesh, n: int) -> dict:
    """``y = sin(x * w)`` by rows, ``z`` = every device's column sums (a Partial output); the
    weight is replicated, its local gradients partial (``in_grad_placements``)."""
    t = torch.linspace(-2.0, 3.0, n * 3).reshape(n, 3).requires_grad_()
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    rows = (S(0),) + (R,) * (mesh.ndim - 1)
    x = fd.distribute_tensor(t, mesh, rows)
    wd = fd.distribute_tensor(w, mesh, (R,) * mesh.ndim)

    def f(x_rows, w_whole):
        y_rows = torch.sin(x_rows * w_whole)
        return y_rows, y_rows.sum(0)

    z_placements = (Pa(),) + (R,) * (mesh.ndim - 1)
    mapped = fd.local_map(
        f,
        out_placements=(rows, z_placements),
        in_placements=(rows, (R,) * mesh.ndim),
        in_grad_placements=(rows, z_placements),  # partial over x, the same over y
    )
    y, z = mapped(x, wd)
    loss = y.full_tensor().square().sum() + (z.full_tensor() * torch.tensor([1.0, 2.0, 3.0])).sum()
    t_grad, w_grad = torch.autograd.grad(loss, (t, w))
    return {
        "y": y.full_tensor().detach(),
        "z": z.full_tensor().detach(),
        "placements": (y.placements, z.placements),
        "shards": [s.shape for s in y.local_shards()],
        "grads": (t_grad, w_grad),
    }


@pytest.mark.meshes((2,), (4,), (2, 2))
@pytest.mark.parametrize("n", [8, 7], ids=["even", "uneven"])
def test_values_and_gradients_equal_one_device(backend, mesh, n):
    t = torch.linspace(-2.0, 3.0, n * 3).reshape(n, 3).requires_grad_()
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    y = torch.sin(t * w)
    z = y.sum(0)
    loss = y.square().sum() + (z * torch.tensor([1.0, 2.0, 3.0])).sum()
    expected = torch.autograd.grad(loss, (t, w))
    for got in backend.run(job_rows_times_weight, mesh.shape, mesh.names, n):
        assert_close(got["y"], y.detach())
        assert_close(got["z"], z.detach())
        for g, e in zip(got["grads"], expected):
            assert_close(g, e)
        assert got["placements"][0][0] == S(0) and got["placements"][1][0] == Pa()
    if backend.is_simulated:  # every device's func saw its true shard (torch.chunk's split)
        rows = [len(c) for c in torch.arange(n).chunk(mesh.shape[0])]
        per_device = [(r, 3) for r in rows for _ in range(mesh.size // mesh.shape[0])]
        assert [tuple(s) for s in got["shards"]] == per_device


@settings(max_examples=30)
@given(
    case=fds.sharded_cases(
        mesh=fds.meshes(max_devices=8),
        min_dims=1,
        max_dims=3,
        dtype=torch.float64,
        allow_partial=True,
        partial_ops=("sum",),
    ),
    seed=st.integers(0, 2**16),
)
def test_drawn_layouts_elementwise_values_and_gradients(case, seed):
    """Any layout, even or not: an elementwise function (linear where a Partial axis holds
    parts of the value) gives the one-device values and gradients."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(case.global_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    x = fd.distribute_tensor(t, case.mesh, case.placements)
    linear = case.layout.has_partial

    def f(v):
        return 3.0 * v if linear else torch.exp(v) * v

    y = fd.local_map(f, case.placements, (case.placements,))(x)
    assert y.placements == case.placements and y.shape == t.shape
    weight = torch.randn(case.global_shape, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad((y.full_tensor() * weight).sum(), t)
    t_ref = t.detach().requires_grad_()
    y_ref = f(t_ref)
    (expected,) = torch.autograd.grad((y_ref * weight).sum(), t_ref)
    assert_close(y.full_tensor(), y_ref)
    assert_close(grad, expected)


def test_uneven_func_sees_true_shards_and_outputs_may_be_uneven():
    mesh = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(torch.arange(10.0), mesh, [S(0)])
    seen = []

    def f(v):
        seen.append(tuple(v.shape))
        return torch.cat([v, v[:1]])  # one more element on each device: 4, 4, 4, 2

    y = fd.local_map(f, [S(0)], ([S(0)],))(x)
    assert seen == [(3,), (3,), (3,), (1,)]
    assert y.shape == (14,) and [len(s) for s in y.local_shards()] == [4, 4, 4, 2]
    assert y.full_tensor().tolist() == [0, 1, 2, 0, 3, 4, 5, 3, 6, 7, 8, 6, 9, 9]


def test_python_control_flow_runs_device_by_device():
    """A func that reads a value into Python cannot be batched: it runs once per device."""
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.tensor([-1.0, -2.0, 3.0, 4.0]), mesh, [S(0)])

    def f(v):
        return v * 2 if v.sum() > 0 else -v

    assert fd.local_map(f, [S(0)], ([S(0)],))(x).full_tensor().tolist() == [1.0, 2.0, 6.0, 8.0]


def job_redistributed(mesh) -> dict:
    t = torch.arange(8.0, requires_grad=True)
    x = fd.distribute_tensor(t, mesh, [S(0)])
    whole = (R,) * mesh.ndim
    y = fd.local_map(torch.cumsum, whole, (whole, None), redistribute_inputs=True)(x, 0)
    (grad,) = torch.autograd.grad((y.full_tensor() * torch.arange(8.0)).sum(), t)
    return {"y": y.full_tensor().detach(), "grad": grad, "placements": y.placements}


@pytest.mark.meshes((2,), (4,))
def test_redistribute_inputs(backend, mesh):
    t = torch.arange(8.0, requires_grad=True)
    (expected,) = torch.autograd.grad((torch.cumsum(t, 0) * torch.arange(8.0)).sum(), t)
    for got in backend.run(job_redistributed, mesh.shape, mesh.names):
        assert_close(got["y"], torch.cumsum(t.detach(), 0))
        assert_close(got["grad"], expected)
        assert got["placements"] == (R,) * len(mesh.shape)


def test_layout_mismatch_without_redistribute_inputs_is_an_error():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.arange(8.0), mesh, [S(0)])
    mapped = fd.local_map(torch.cumsum, [R], ({"a": [R]}, None))
    check(
        fd.LayoutError,
        ValueError,
        lambda: mapped({"a": x}, 0),
        "fd.local_map(func)(args[0]['a'])",
        "expected R",
        "got S(0)",
        "redistribute_inputs=True",
        "x.redistribute(",
    )


def test_in_grad_placements_partial_sums_the_devices_gradients():
    """A replicated weight used against row shards: each device's local gradient is a part.
    Read as Replicate (the default, as DTensor) the gradient is one device's; as Partial,
    their sum, the one-device gradient."""
    mesh = fd.simulated_mesh(4, "x")
    t = torch.arange(8.0)
    w = torch.tensor(2.0, requires_grad=True)
    x = fd.distribute_tensor(t, mesh, [S(0)])
    wd = fd.distribute_tensor(w, mesh, [R])
    grads = {}
    for name, grad_placements in (("default", None), ("partial", ([S(0)], [Pa()]))):
        mapped = fd.local_map(torch.mul, [S(0)], ([S(0)], [R]), grad_placements)
        (grads[name],) = torch.autograd.grad(mapped(x, wd).full_tensor().sum(), w)
    assert grads["partial"].item() == t.sum().item()
    assert grads["default"].item() == t[:2].sum().item()  # device 0's part
    check(
        fd.LayoutError,
        ValueError,
        lambda: fd.local_map(torch.mul, [S(0)], None, ([R], [R]))(x, wd),
        "fd.local_map(in_grad_placements[0])",
    )


def test_plain_arguments_and_plain_outputs():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.arange(4.0), mesh, [S(0)])
    shift = torch.tensor(10.0, requires_grad=True)

    def f(v, s, k):
        return v + s * k, k + 1, v.shape[0], (v - v).sum()

    y, k, rows, zero = fd.local_map(f, ([S(0)], None, None, None), ([S(0)], None, None))(x, shift, 2)
    assert y.full_tensor().tolist() == [20.0, 21.0, 22.0, 23.0] and (k, rows) == (3, 2)
    assert isinstance(zero, torch.Tensor) and zero.shape == () and zero.item() == 0.0  # device 0's
    (grad,) = torch.autograd.grad(y.full_tensor().sum(), shift)
    assert grad.item() == 8.0  # every element's contribution, summed over the devices


def test_without_dtensor_arguments_on_a_given_mesh():
    mesh = fd.simulated_mesh(4, "x")
    y = fd.local_map(lambda: torch.ones(2), [S(0)], device_mesh=mesh)()
    assert y.shape == (8,) and y.placements == (S(0),)


def test_func_may_not_write_into_its_inputs():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.arange(4.0), mesh, [S(0)])
    check(
        fd.ImmutableError,
        RuntimeError,
        lambda: fd.local_map(lambda v: v.add_(1), [S(0)], ([S(0)],))(x),
        "fd.local_map",
        "add_",
    )
    assert x.full_tensor().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_under_torch_compile():
    mesh = fd.simulated_mesh(4, "x")
    mapped = fd.local_map(
        lambda v, w: torch.tanh(v @ w),
        [
            S(0),
        ],
        ([S(0)], [R]),
        ([S(0)], [Pa()]),
    )

    def loss(t, w):
        x = fd.distribute_tensor(t, mesh, [S(0)])
        wd = fd.distribute_tensor(w, mesh, [R])
        return mapped(x, wd).full_tensor().square().sum()

    t = torch.randn(8, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(t, w)
    got_grads = torch.autograd.grad(got, (t, w))
    t_ref, w_ref = t.detach().requires_grad_(), w.detach().requires_grad_()
    expected = torch.tanh(t_ref @ w_ref).square().sum()
    expected_grads = torch.autograd.grad(expected, (t_ref, w_ref))
    assert_close(got, expected)
    for g, e in zip(got_grads, expected_grads):
        assert_close(g, e)


# --- bad input ----------------------------------------------------------------------------------


def test_errors():
    mesh = fd.simulated_mesh(2, "x")
    other = fd.simulated_mesh(2, "y")
    x = fd.distribute_tensor(torch.arange(4.0), mesh, [S(0)])
    check(fd.InputTypeError, TypeError, lambda: fd.local_map(3, [S(0)]), "fd.local_map(func)", "a callable")
    check(
        fd.InputTypeError,
        TypeError,
        lambda: fd.local_map(torch.neg, ["S(0)"]),
        "fd.local_map(out_placements[0])",
    )
    check(
        fd.SpecError,
        ValueError,
        lambda: fd.local_map(torch.add, [S(0)], ([S(0)], [S(0)], [S(0)]))(x, x),
        "fd.local_map(in_placements)",
        "3 entries",
    )
    check(
        fd.LayoutError,
        ValueError,
        lambda: fd.local_map(torch.neg, [S(0)], ([S(0), R],))(x),
        "fd.local_map(in_placements[0])",
        "one placement per mesh axis",
    )
    check(
        fd.LayoutError,
        ValueError,
        lambda: fd.local_map(torch.neg, [S(0), R], ([S(0)],))(x),
        "fd.local_map(out_placements)",
        "one placement per mesh axis",
    )
    y = fd.distribute_tensor(torch.arange(4.0), other, [S(0)])
    check(fd.MeshError, ValueError, lambda: fd.local_map(torch.add, [S(0)])(x, y), "args[1]", "another mesh")
    check(
        fd.MeshError,
        ValueError,
        lambda: fd.local_map(torch.neg, [S(0)], device_mesh=other)(x),
        "args[0]",
        "another mesh",
    )
    check(
        fd.InputTypeError,
        TypeError,
        lambda: fd.local_map(torch.add, [S(0)], ([S(0)], [S(0)]))(x, torch.ones(4)),
        "fd.local_map(func)(args[1])",
        "a plain torch.Tensor",
        "fd.distribute_tensor",
    )
    check(
        fd.LayoutError,
        ValueError,
        lambda: fd.local_map(torch.neg, [S(0)], (None,))(x),
        "fd.local_map(in_placements[0])",
        "its entry is None",
    )
    check(fd.MeshError, ValueError, lambda: fd.local_map(torch.neg, [S(0)])(torch.ones(2)), "device_mesh")
    check(
        fd.InputTypeError,
        TypeError,
        lambda: fd.local_map(lambda v: 3, [S(0)], ([S(0)],))(x),
        "fd.local_map(out_placements)",
        "a local tensor",
    )
    check(fd.InputTypeError, TypeError, lambda: fd.local_map(torch.neg, [S(0)])(input=x), "kwargs['input']")
